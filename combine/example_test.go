package combine_test

import (
	"context"
	"fmt"
	"sync"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// One MoE layer step on two ranks: four experts, two per rank; each token goes to its
// top-2 experts; expert e multiplies its rows by e+1; combine sums the outputs with the
// router's weights at each token's own rank.
func Example() {
	ctx := context.Background()
	const hidden, experts, topK = 4, 4, 2
	cs, err := coll.Local(2, coll.Config{})
	if err != nil {
		panic(err)
	}
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	pl, err := router.NewPlacement(router.Contiguous, experts, len(cs))
	if err != nil {
		panic(err)
	}
	results := make([][]float32, len(cs))
	var wg sync.WaitGroup
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[c.Rank()] = layerStep(ctx, c, pl, hidden, experts, topK)
		}()
	}
	wg.Wait()
	fmt.Println("rank 0:", results[0])
	fmt.Println("rank 1:", results[1])
	// Output:
	// rank 0: [1.5 1.5 1.5 1.5 3.5 3.5 3.5 3.5]
	// rank 1: [2.5 2.5 2.5 2.5 2.5 2.5 2.5 2.5]
}

// layerStep is one rank's layer step: two tokens of ones, routed by fixed logits.
func layerStep(ctx context.Context, c *coll.Comm, pl *router.Placement, hidden, experts, topK int) []float32 {
	d, err := dispatch.New[float32](ctx, c, dispatch.Config{Hidden: hidden, TopK: topK, Placement: pl, WireDType: dtype.BF16})
	if err != nil {
		panic(err)
	}
	defer d.Close()
	cb, err := combine.New[float32](ctx, d, combine.Config{})
	if err != nil {
		panic(err)
	}
	defer cb.Close()
	// Rank 0's tokens go to experts {0,1} and {2,3}, rank 1's to {1,2} and {0,3}, each
	// half and half (equal logits).
	choices := [][2][2]int{{{0, 1}, {2, 3}}, {{1, 2}, {0, 3}}}[c.Rank()]
	logits := make([]float32, 2*experts)
	for t, pair := range choices {
		for _, e := range pair {
			logits[t*experts+e] = 5
		}
	}
	r, err := router.Route(&router.Config{Experts: experts, TopK: topK, Gating: router.TopKSoftmax}, logits, nil)
	if err != nil {
		panic(err)
	}
	x := make([]float32, 2*hidden)
	for i := range x {
		x[i] = 1
	}
	in, h, err := d.Dispatch(ctx, x, r)
	if err != nil {
		panic(err)
	}
	// The experts: one output row per entry of the view, in its order.
	y := make([]float32, in.Rows()*hidden)
	for j := 0; j < in.Rows(); j++ {
		if in.Expert[j] < 0 {
			continue // padding
		}
		for i, v := range in.Entry(j) {
			y[j*hidden+i] = v * float32(in.Expert[j]+1)
		}
	}
	out := make([]float32, 2*hidden)
	if err := cb.Combine(ctx, h, y, out); err != nil {
		panic(err)
	}
	return out
}
