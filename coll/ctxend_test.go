package coll

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/moex-ai/moex/coll/dtype"
)

// A context that ends after its operation returned (a caller's defer cancel()) does not
// abort the communicator, whatever the next operation's context: over inproc and tcp,
// after a Barrier and an AllReduce, the next operations (with a context that never
// ends) give the right results.
func TestContextEndedAfterOpKeepsComm(t *testing.T) {
	for _, tr := range []string{"inproc", "tcp"} {
		for _, op := range []string{"barrier", "allreduce"} {
			t.Run(tr+"/"+op, func(t *testing.T) {
				var cs []*Comm
				if tr == "tcp" {
					cs, _ = tcpComms(t, 4, Config{Timeout: 5 * time.Second})
				} else {
					cs = newLocal(t, 4, Config{Timeout: 5 * time.Second})
				}
				noErr(t, runOn(cs, func(c *Comm) error {
					for i := 0; i < 50; i++ {
						ctx, cancel := context.WithCancel(context.Background())
						var err error
						if op == "barrier" {
							err = Barrier(ctx, c)
						} else {
							err = AllReduce(ctx, c, nil, []int64{1, 2}, dtype.Sum)
						}
						cancel()
						if err != nil {
							return fmt.Errorf("iter %d op: %w", i, err)
						}
						if err := checkWorks(context.Background(), c); err != nil {
							return fmt.Errorf("iter %d after: %w", i, err)
						}
					}
					return nil
				}))
			})
		}
	}
}
