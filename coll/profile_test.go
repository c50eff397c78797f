package coll

import (
	"context"
	"testing"
	"time"

	"github.com/moex-ai/moex/coll/dtype"
)

// Profiling names the straggler: rank 2 enters every AllReduce 200 ms after the others.
// They wait for it (Wait holds those 200 ms), it does not, and every rank's profile says
// rank 2 arrived last. Results stay correct with profiling (and verification) on.
func TestProfileNamesTheStraggler(t *testing.T) {
	const p, late, rounds = 4, 2, 2
	const delay = 200 * time.Millisecond
	for _, verify := range []bool{false, true} {
		cs := newLocal(t, p, Config{Profile: true, Verify: verify})
		ctx := context.Background()
		noErr(t, runOn(cs, func(c *Comm) error {
			for i := 0; i < rounds; i++ {
				if c.Rank() == late {
					time.Sleep(delay)
				}
				x := []float32{float32(c.Rank()), 1}
				if err := AllReduce(ctx, c, nil, x, dtype.Sum); err != nil {
					return err
				}
				if x[0] != 0+1+2+3 || x[1] != p {
					t.Errorf("rank %d: allreduce gave %v", c.Rank(), x)
				}
			}
			return nil
		}))
		for _, c := range cs {
			prof := c.ProfileOf(OpAllReduce)
			if prof.Count != rounds {
				t.Fatalf("rank %d: %d allreduces profiled, want %d", c.Rank(), prof.Count, rounds)
			}
			if prof.Last[late] != rounds {
				t.Errorf("rank %d: last arrivals %v, want rank %d every time", c.Rank(), prof.Last, late)
			}
			if c.Rank() != late && prof.Wait < rounds*delay/2 {
				t.Errorf("rank %d waited %v in %d rounds behind a %v straggler", c.Rank(), prof.Wait, rounds, delay)
			}
			if prof.Skew < rounds*delay/2 {
				t.Errorf("rank %d: skew %v, want about %v", c.Rank(), prof.Skew, rounds*delay)
			}
			t.Logf("rank %d: %v", c.Rank(), prof)
			if len(c.Profile()) != 1 {
				t.Errorf("rank %d: profiles of %d kinds, want 1", c.Rank(), len(c.Profile()))
			}
		}
		if got := cs[late].ProfileOf(OpAllReduce).Wait; got > cs[0].ProfileOf(OpAllReduce).Wait {
			t.Errorf("the straggler waited %v, more than rank 0 (%v)", got, cs[0].ProfileOf(OpAllReduce).Wait)
		}
	}
	// Off by default: nothing recorded.
	cs := newLocal(t, 2, Config{})
	noErr(t, runOn(cs, func(c *Comm) error { return Barrier(context.Background(), c) }))
	if prof := cs[0].Profile(); prof != nil {
		t.Fatalf("profile without Config.Profile: %v", prof)
	}
}
