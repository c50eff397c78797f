package router_test

import (
	"fmt"

	"github.com/moex-ai/moex/router"
)

// Two tokens, four experts, top-2 with Mixtral's gating: the two largest logits, then a
// softmax over them.
func ExampleRoute() {
	cfg := router.Config{Experts: 4, TopK: 2, Gating: router.TopKSoftmax}
	logits := []float32{
		0, 3, 0, 3, // token 0: experts 1 and 3 tie
		5, 0, 0, 4, // token 1: expert 0, then 3
	}
	r, err := router.Route(&cfg, logits, nil)
	if err != nil {
		panic(err)
	}
	for t := 0; t < r.T; t++ {
		fmt.Printf("token %d: experts %v, weights %.3f\n", t, r.Experts[t*r.K:(t+1)*r.K], r.Weights[t*r.K:(t+1)*r.K])
	}
	// Output:
	// token 0: experts [1 3], weights [0.500 0.500]
	// token 1: experts [0 3], weights [0.731 0.269]
}

// Eight experts on four ranks, two each, in blocks.
func ExampleNewPlacement() {
	pl, err := router.NewPlacement(router.Contiguous, 8, 4)
	if err != nil {
		panic(err)
	}
	fmt.Println(pl.Local[2], pl.RankOf(5, 0, 0))
	// Output: [4 5] 2
}
