package dispatch_test

import (
	"context"
	"fmt"
	"log"
	"sync"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// A serving loop on each of two ranks in the low-latency mode, rows in bf16 on the
// wire: the dispatcher and its combiner are made once, outside the loop, and every
// step routes, dispatches, runs the experts and combines. Expert e multiplies its rows
// by e+1, so each token comes back as its own values times the weighted sum of (e+1)
// over its two experts.
func Example_lowLatency() {
	const ranks, hidden, experts, topK, maxTokens = 2, 8, 4, 2, 16
	cs, err := coll.Local(ranks, coll.Config{})
	if err != nil {
		log.Fatal(err)
	}
	pl, err := router.NewPlacement(router.Contiguous, experts, ranks)
	if err != nil {
		log.Fatal(err)
	}
	results := make([]string, ranks)
	var wg sync.WaitGroup
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			out, err := serve(context.Background(), c, pl, hidden, experts, topK, maxTokens)
			if err != nil {
				results[c.Rank()] = "error: " + err.Error()
				return
			}
			results[c.Rank()] = fmt.Sprint(out)
		}()
	}
	wg.Wait()
	for r, s := range results {
		fmt.Printf("rank %d, last step, first value of each token: %s\n", r, s)
	}
	// Output:
	// rank 0, last step, first value of each token: [2 3 2]
	// rank 1, last step, first value of each token: [3 2 3]
}

// serve runs three steps of one rank and returns the first value of each token of the
// last one.
func serve(ctx context.Context, c *coll.Comm, pl *router.Placement, hidden, experts, topK, maxTokens int) ([]float32, error) {
	// New is generic in the activations' type and takes the context: it agrees on the
	// configuration with every rank (a mismatch is an error on all of them).
	d, err := dispatch.New[float32](ctx, c, dispatch.Config{
		Hidden: hidden, TopK: topK, Placement: pl,
		Mode: dispatch.LowLatency, MaxTokens: maxTokens, WireDType: dtype.BF16,
	})
	if err != nil {
		return nil, err
	}
	defer d.Close()
	cb, err := combine.New[float32](ctx, d, combine.Config{})
	if err != nil {
		return nil, err
	}
	defer cb.Close()
	gate := &router.Config{Experts: experts, TopK: topK, Gating: router.TopKSoftmax}
	var firsts []float32
	for step := 0; step < 3; step++ {
		// Three tokens of ones; token t picks experts (t + rank) % 4 and (t + rank + 2) % 4,
		// half and half.
		const tokens = 3
		logits := make([]float32, tokens*experts)
		for t := 0; t < tokens; t++ {
			e := (t + c.Rank()) % experts
			logits[t*experts+e], logits[t*experts+(e+2)%experts] = 1, 1
		}
		r, err := router.Route(gate, logits, nil)
		if err != nil {
			return nil, err
		}
		x := make([]float32, tokens*hidden)
		for i := range x {
			x[i] = 1
		}
		in, h, err := d.Dispatch(ctx, x, r)
		if err != nil {
			return nil, err
		}
		// The experts: one output row per entry, in entry order. Walk the entries of each
		// local expert and read entry j's row with Entry(j) (or take the expert's rows as
		// one matrix with Block(i)): in the low-latency mode the rows stay where they
		// arrived, not in expert order.
		y := cb.Buffer(h) // where the combine reads the outputs in place (one host), else nil
		if y == nil {
			y = make([]float32, in.Rows()*hidden)
		}
		for i := range in.Counts {
			for j := in.Offsets[i]; j < in.Offsets[i]+in.Counts[i]; j++ {
				scale := float32(in.Expert[j] + 1)
				for k, v := range in.Entry(j) {
					y[j*hidden+k] = v * scale
				}
			}
		}
		out := make([]float32, tokens*hidden)
		if err := cb.Combine(ctx, h, y, out); err != nil {
			return nil, err
		}
		firsts = firsts[:0]
		for t := 0; t < tokens; t++ {
			firsts = append(firsts, out[t*hidden])
		}
	}
	return firsts, nil
}
