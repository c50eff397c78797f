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

// A bf16 serving step in two micro-batches on each of four ranks, with the moves and
// the experts overlapped: batch B's rows travel (Start) while batch A's experts run, and
// A's sums travel back while B's experts run. The dispatcher keeps two results in flight
// (Config.InFlight, default 2), so A's Output stays valid while B is dispatched. Expert e
// multiplies its rows by e+1; token t of rank r picks experts e = (t+r)%8 and e+4 with
// equal weights, so it comes back as (e+1)/2 + (e+5)/2 = e+3 times its values.
func Example_overlap() {
	const ranks, hidden, experts, topK = 4, 16, 8, 2
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
			a, b, err := overlapped(context.Background(), c, pl, hidden, experts, topK)
			if err != nil {
				results[c.Rank()] = "error: " + err.Error()
				return
			}
			results[c.Rank()] = fmt.Sprintf("A %v, B %v", a, b)
		}()
	}
	wg.Wait()
	for r, s := range results {
		fmt.Printf("rank %d, first value of each token: %s\n", r, s)
	}
	// Output:
	// rank 0, first value of each token: A [3 4 5], B [3 4 5 6]
	// rank 1, first value of each token: A [4 5 6], B [4 5 6 3]
	// rank 2, first value of each token: A [5 6 3], B [5 6 3 4]
	// rank 3, first value of each token: A [6 3 4], B [6 3 4 5]
}

// overlapped runs one step of a rank in two micro-batches (3 and 4 tokens of ones) and
// returns the first value of each token of each.
func overlapped(ctx context.Context, c *coll.Comm, pl *router.Placement, hidden, experts, topK int) ([]float32, []float32, error) {
	d, err := dispatch.New[dtype.BFloat16](ctx, c, dispatch.Config{Hidden: hidden, TopK: topK, Placement: pl, MaxTokens: 8})
	if err != nil {
		return nil, nil, err
	}
	defer d.Close()
	cb, err := combine.New[dtype.BFloat16](ctx, d, combine.Config{})
	if err != nil {
		return nil, nil, err
	}
	defer cb.Close()
	gate := &router.Config{Experts: experts, TopK: topK, Gating: router.TopKSoftmax}
	batch := func(tokens int) ([]dtype.BFloat16, *router.Routing, error) {
		logits := make([]float32, tokens*experts)
		for t := 0; t < tokens; t++ { // experts (t+rank)%8 and (t+rank+4)%8
			e := (t + c.Rank()) % experts
			logits[t*experts+e], logits[t*experts+(e+experts/2)%experts] = 1, 1
		}
		r, err := router.Route(gate, logits, nil)
		x := make([]dtype.BFloat16, tokens*hidden)
		for i := range x {
			x[i] = dtype.ToBF16(1)
		}
		return x, r, err
	}
	// The experts of one micro-batch: one output row per entry, where the combine reads
	// it in place if it can.
	run := func(in *dispatch.Output[dtype.BFloat16], h dispatch.Handle) []dtype.BFloat16 {
		y := cb.Buffer(h)
		if y == nil {
			y = make([]dtype.BFloat16, in.Rows()*hidden)
		}
		for i := range in.Counts {
			for j := in.Offsets[i]; j < in.Offsets[i]+in.Counts[i]; j++ {
				scale := float32(in.Expert[j] + 1)
				for k, v := range in.Entry(j) {
					y[j*hidden+k] = dtype.ToBF16(v.Float32() * scale)
				}
			}
		}
		return y
	}
	xa, ra, err := batch(3)
	if err != nil {
		return nil, nil, err
	}
	xb, rb, err := batch(4)
	if err != nil {
		return nil, nil, err
	}
	pa, err := d.Start(ctx, xa, ra)
	if err != nil {
		return nil, nil, err
	}
	inA, hA, err := pa.Wait(ctx)
	if err != nil {
		return nil, nil, err
	}
	pb, err := d.Start(ctx, xb, rb) // B's rows travel ...
	if err != nil {
		return nil, nil, err
	}
	yA := run(inA, hA) // ... while A's experts run
	outA, outB := make([]dtype.BFloat16, 3*hidden), make([]dtype.BFloat16, 4*hidden)
	ca, err := cb.Start(ctx, hA, yA, outA) // A's sums travel back ...
	if err != nil {
		return nil, nil, err
	}
	inB, hB, err := pb.Wait(ctx)
	if err != nil {
		return nil, nil, err
	}
	yB := run(inB, hB) // ... while B's experts run
	if err := ca.Wait(ctx); err != nil {
		return nil, nil, err
	}
	if err := cb.Combine(ctx, hB, yB, outB); err != nil {
		return nil, nil, err
	}
	first := func(out []dtype.BFloat16) []float32 {
		var f []float32
		for t := 0; t < len(out)/hidden; t++ {
			f = append(f, out[t*hidden].Float32())
		}
		return f
	}
	return first(outA), first(outB), nil
}
