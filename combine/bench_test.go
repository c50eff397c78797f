package combine_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// BenchmarkMoEStep times one layer step, dispatch then combine, on 4 in-process ranks:
// 128 tokens a rank, 1024 values a row, 16 experts, top-2, with the experts' work left
// out (their outputs are a buffer). The bytes are what rank 0 sent in a step, so MB/s is
// its send rate; allocations are rank 0's.
func BenchmarkMoEStep(b *testing.B) {
	const p, hidden, experts, topK, tokens = 4, 1024, 16, 2, 128
	for _, c := range []struct {
		mode dispatch.Mode
		wire dtype.Type
	}{{dispatch.Normal, dtype.BF16}, {dispatch.LowLatency, dtype.BF16}, {dispatch.LowLatency, dtype.FP8E4M3}, {dispatch.Gathered, dtype.BF16}} {
		b.Run(fmt.Sprintf("%v/%v", c.mode, c.wire), func(b *testing.B) {
			cs, err := coll.Local(p, coll.Config{})
			require.NoError(b, err)
			defer func() {
				for _, c := range cs {
					c.Close()
				}
			}()
			pl, err := router.NewPlacement(router.Contiguous, experts, p)
			require.NoError(b, err)
			ctx := context.Background()
			steps := make([]func() error, p)
			moved := 0
			errs := runOnComms(cs, func(cm *coll.Comm) error {
				d, err := dispatch.New[float32](ctx, cm, dispatch.Config{Hidden: hidden, TopK: topK, Placement: pl, WireDType: c.wire, Mode: c.mode, MaxTokens: tokens})
				if err != nil {
					return err
				}
				cb, err := combine.New[float32](ctx, d, combine.Config{})
				if err != nil {
					return err
				}
				logits := make([]float32, tokens*experts)
				for i := range logits {
					logits[i] = float32((i*7919 + cm.Rank()*31) % 97)
				}
				r, err := router.Route(&router.Config{Experts: experts, TopK: topK, Gating: router.TopKSoftmax}, logits, nil)
				if err != nil {
					return err
				}
				x := make([]float32, tokens*hidden)
				for i := range x {
					x[i] = float32(i%13) / 13
				}
				y := make([]float32, p*tokens*topK*hidden)
				out := make([]float32, len(x))
				steps[cm.Rank()] = func() error {
					in, h, err := d.Dispatch(ctx, x, r)
					if err != nil {
						return err
					}
					if cm.Rank() == 0 && moved == 0 {
						moved = scheduled(h.Schedule())
					}
					return cb.Combine(ctx, h, y[:in.Rows()*hidden], out)
				}
				b.Cleanup(func() { cb.Close(); d.Close() })
				return nil
			})
			for _, err := range errs {
				require.NoError(b, err)
			}
			// Ranks 1..p-1 step when rank 0 does.
			gos := make([]chan struct{}, p)
			done := make(chan error, p)
			for r := 1; r < p; r++ {
				gos[r] = make(chan struct{})
				go func() {
					var first error
					for range gos[r] {
						if err := steps[r](); err != nil && first == nil {
							first = err
						}
					}
					done <- first
				}()
			}
			step := func() {
				for r := 1; r < p; r++ {
					gos[r] <- struct{}{}
				}
				if err := steps[0](); err != nil {
					b.Fatal(err)
				}
			}
			for range 10 { // the pools and the plans' caches warm up
				step()
			}
			require.Positive(b, moved)
			b.SetBytes(int64(moved))
			b.ReportAllocs()
			for b.Loop() {
				step()
			}
			for r := 1; r < p; r++ {
				close(gos[r])
				require.NoError(b, <-done)
			}
		})
	}
}

// scheduled is what a rank's schedule moves to other ranks: its blocks, dispatch and
// combine, and what they read in place.
func scheduled(s dispatch.Schedule) int {
	n := 0
	for j := range s.Dispatch.Send {
		if j != s.Rank {
			n += s.Dispatch.Send[j].Total() + s.Dispatch.Send[j].Read + s.Combine.Send[j].Total() + s.Combine.Send[j].Read
		}
	}
	return n
}
