package dispatch

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/router"
)

// A rank whose published map gives a token fewer terms than its choices there (memory
// written wrongly) makes the in-place combine that reads it fail with ErrMismatch, not
// sum the wrong terms or index past them: rank 1 moves one of rank 0's token 0's two
// entries to the next row after publishing. Token 0 has all its choices on rank 1, so
// its own count is checked, as its neighbour's.
func TestInPlaceTermsMismatch(t *testing.T) {
	for _, both := range []bool{false, true} {
		t.Run(fmt.Sprintf("neighbour-on-rank-1=%v", both), func(t *testing.T) { checkTermsMismatch(t, both) })
	}
}

func checkTermsMismatch(t *testing.T, both bool) {
	const hid = 8
	cs, err := coll.Local(2, coll.Config{Timeout: 10 * time.Second}) // a hang fails the test
	require.NoError(t, err)
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	pl, err := router.NewPlacement(router.Contiguous, 4, 2) // experts 2 and 3 on rank 1
	require.NoError(t, err)
	cfg := Config{Hidden: hid, TopK: 2, Placement: pl, Mode: LowLatency, MaxTokens: 2}
	published := make(chan struct{})
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[c.Rank()] = func() error {
				ctx := context.Background()
				d, err := New[float32](ctx, c, cfg)
				if err != nil {
					return err
				}
				defer d.Close()
				cb, err := NewCombiner[float32](ctx, d, CombineConfig{})
				if err != nil {
					return err
				}
				defer cb.Close()
				// Token 0 goes to experts 2 and 3 (rank 1); token 1 to 0 (rank 0) and 2, or,
				// with both, to 2 alone (its other choice dropped).
				r := &router.Routing{T: 2, K: 2, E: 4, Experts: []int32{2, 3, 0, 2}, Weights: []float32{0.5, 0.25, 1, 0.75}}
				if both {
					r.Experts[2], r.Weights[2] = -1, 0
				}
				out, h, err := d.Dispatch(ctx, make([]float32, 2*hid), r)
				if err != nil {
					return err
				}
				y := make([]float32, out.Rows()*hid)
				p, err := cb.Start(ctx, h, y, make([]float32, 2*hid))
				if err != nil {
					return err
				}
				if c.Rank() == 0 {
					<-published // reads rank 1's outputs in Wait, after
					return p.Wait(ctx)
				}
				// Rank 0's token 0 has two entries here (experts 2 and 3): give one of
				// them to its next row.
				b := cb.ways[LowLatency].back.(*inPlaceBack)
				reg := b.region(1, h.s.idx)
				a, _ := h.s.incoming(0)
				start := i32s(reg[b.rg.start:], a+2)
				start[a+1]--
				close(published)
				return p.Wait(ctx)
			}()
			if errs[c.Rank()] != nil {
				c.Abort(errs[c.Rank()].Error())
			}
		}()
	}
	wg.Wait()
	require.ErrorIs(t, errs[0], ErrMismatch)
}
