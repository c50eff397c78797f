package coll_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
)

// A program with one rank per process, whole: its main would be this. coll.Init reads
// the launcher's environment (moex run -n 4 -- ./prog, mpirun, torchrun, srun), meets the
// other ranks and opens the fastest transport to each; run alone, it is a job of one
// rank, as here. Every call has a deadline, and a rank that panics after the deferred
// Close is named to every rank at once.
func Example_init() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := coll.Init(ctx, coll.Config{})
	if err != nil {
		log.Fatal(err) // a *bootstrap.StartupError names the ranks that never came
	}
	defer c.Close()

	x := []float32{float32(c.Rank() + 1), 1}
	if err := coll.AllReduce(ctx, c, nil, x, dtype.Sum); err != nil {
		log.Fatal(err) // a *coll.PeerError or *coll.AbortError names the rank at fault
	}
	fmt.Printf("rank %d of %d: %v\n", c.Rank(), c.Size(), x)
	// Output: rank 0 of 1: [1 1]
}
