package coll

import (
	"time"

	"github.com/moex-ai/moex/coll/algos"
)

// One operation run: the arrival all-gather of a profiled communicator, the agreement of
// Config.Verify, the plan executed, and the counters.

func (c *Comm) exec(pl *algos.Plan, seq uint32, cl *call) error {
	defer c.end()
	var entered, arrived time.Time
	var last int
	var skew time.Duration
	if c.cfg.Profile {
		entered = time.Now()
		var err error
		if last, skew, err = c.arrive(seq, entered); err != nil {
			return err
		}
		arrived = time.Now()
		seq = nextOf(seq)
	}
	if cl.verify {
		if err := c.verify(cl, pl, seq); err != nil {
			return err
		}
		seq = nextOf(seq)
	}
	if err := c.execute(pl, seq, cl); err != nil {
		return err
	}
	if c.cfg.Profile {
		wait, move := arrived.Sub(entered), time.Since(arrived)
		c.record(pl.Op, wait, move, skew, last)
		if c.cfg.TraceDir != "" {
			c.traceOp(pl, entered, wait, move, skew, last)
		}
	}
	c.stats.Ops.Add(1)
	c.stats.BytesSent.Add(uint64(pl.Bytes))
	return nil
}
