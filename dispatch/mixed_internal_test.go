package dispatch

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/router"
)

// Ranks that disagree on whether a slot's staging is free (one marked its dispatch done
// without a combine) still deliver every row: the rows of those in place are copied in
// beside the pushed ones.
func TestDispatchInPlaceMixed(t *testing.T) {
	const p, hid, k, experts, maxTokens = 3, 16, 2, 6, 8
	tokens := []int{5, 7, 4}
	pl, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	routing := func(r int) (*router.Routing, []float32) {
		rng := rand.New(rand.NewPCG(9, uint64(r)))
		rt := &router.Routing{T: tokens[r], K: k, E: experts, Experts: make([]int32, tokens[r]*k), Weights: make([]float32, tokens[r]*k)}
		for i := 0; i < tokens[r]; i++ {
			for j, e := range rng.Perm(experts)[:k] {
				rt.Experts[i*k+j], rt.Weights[i*k+j] = int32(e), 0.5
			}
		}
		x := make([]float32, tokens[r]*hid)
		for i := range x {
			x[i] = float32(rng.IntN(9) - 4)
		}
		return rt, x
	}
	for _, wire := range []dtype.Type{dtype.F32, dtype.FP8E4M3} {
		t.Run(wire.String(), func(t *testing.T) {
			cs, err := coll.Local(p, coll.Config{Timeout: 30 * time.Second})
			require.NoError(t, err)
			defer func() {
				for _, c := range cs {
					c.Close()
				}
			}()
			errs := make([]error, p)
			var wg sync.WaitGroup
			for _, c := range cs {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs[c.Rank()] = checkMixed(c, pl, wire, routing)
					if errs[c.Rank()] != nil {
						c.Abort(errs[c.Rank()].Error())
					}
				}()
			}
			wg.Wait()
			for r, err := range errs {
				require.NoError(t, err, "rank %d", r)
			}
		})
	}
}

func checkMixed(c *coll.Comm, pl *router.Placement, wire dtype.Type, routing func(int) (*router.Routing, []float32)) error {
	const hid = 16
	ctx := context.Background()
	me := c.Rank()
	d, err := New[float32](ctx, c, Config{Hidden: hid, TopK: 2, Placement: pl, Mode: LowLatency, MaxTokens: 8, InFlight: 1, WireDType: wire})
	if err != nil {
		return err
	}
	defer d.Close()
	if (d.Buffer() != nil) != (wire == dtype.F32) {
		return fmt.Errorf("Buffer of %d values with a %v wire", len(d.Buffer()), wire)
	}
	r, x := routing(me)
	_, h, err := d.Dispatch(ctx, x, r)
	if err != nil {
		return err
	}
	if me == 0 {
		d.mode.(*lowLatency).combined(h.s.idx) // rank 0 alone: its next dispatch is in place, the others push
	}
	out, _, err := d.Dispatch(ctx, x, r)
	if err != nil {
		return err
	}
	if d.Stats().InPlace != (me == 0) {
		return fmt.Errorf("in place %v", d.Stats().InPlace)
	}
	for j := 0; j < out.Rows(); j++ {
		if out.Origin[j] < 0 {
			continue
		}
		q, src := int(out.Origin[j]), int(out.Source[j])
		_, xq := routing(q)
		want := xq[src*hid : (src+1)*hid]
		if wire == dtype.FP8E4M3 { // the wire's rounding, as the origin made it
			want = slices.Clone(want)
			q8, sc := make([]byte, hid), make([]float32, dtype.FP8Scales(hid))
			dtype.QuantizeFP8(q8, sc, xq[src*hid:(src+1)*hid], false)
			dtype.DequantizeFP8(want, q8, sc)
		}
		if !slices.Equal(out.Entry(j), want) {
			return fmt.Errorf("entry %d (rank %d's token %d): %v, want %v", j, q, src, out.Entry(j), want)
		}
	}
	return nil
}
