package coll

import (
	"fmt"
	"time"

	"github.com/moex-ai/moex/coll/dtype"
)

// Profiling tells waiting from moving. Most reports of a slow collective are a rank
// waiting for a straggler, not bytes moving slowly; a timer around the call cannot tell
// the two apart. With Config.Profile (MOEX_PROFILE=1) every operation starts with an
// all-gather of the ranks' entry times (8 bytes each, ceil(log2 P) rounds): the time
// until it completes is the wait for the last rank to arrive, the time after it is the
// operation itself, and the entry times name the rank that arrived last and by how much.
// The all-gather costs a few round trips per operation, so profiling is off by default.

func (p OpProfile) String() string {
	if p.Count == 0 {
		return fmt.Sprintf("%v: no operations", p.Op)
	}
	n := time.Duration(p.Count)
	most, q := 0, -1
	for r, k := range p.Last {
		if k > most {
			most, q = k, r
		}
	}
	return fmt.Sprintf("%v: %d ops, wait %v, move %v, skew %v per op; last to arrive most often: rank %d (%d of %d)",
		p.Op, p.Count, p.Wait/n, p.Move/n, p.Skew/n, q, most, p.Count)
}

// arrive runs the arrival all-gather under seq and returns the last rank to enter and the
// spread of the entry times.
func (c *Comm) arrive(seq uint32, entered time.Time) (last int, skew time.Duration, err error) {
	times := make([]int64, c.size)
	times[c.rank] = entered.UnixNano()
	if err := c.execute(c.prof.plan, seq, &call{op: OpAllGather, dt: dtype.I64, recv: dtype.Bytes(times)}); err != nil {
		return 0, 0, err
	}
	first := times[0]
	for r, t := range times {
		if t > times[last] {
			last = r
		}
		first = min(first, t)
	}
	return last, time.Duration(times[last] - first), nil
}

func (c *Comm) record(op OpKind, wait, move, skew time.Duration, last int) {
	c.prof.mu.Lock()
	defer c.prof.mu.Unlock()
	p := &c.prof.ops[op]
	if p.Last == nil {
		p.Op, p.Last = op, make([]int, c.size)
	}
	p.Count++
	p.Wait += wait
	p.Move += move
	p.Skew += skew
	p.Last[last]++
}

// Profile returns what profiling measured on this rank, per kind of operation, for the
// kinds run so far (nil when Config.Profile is off).
func (c *Comm) Profile() []OpProfile {
	c.prof.mu.Lock()
	defer c.prof.mu.Unlock()
	var out []OpProfile
	for _, p := range c.prof.ops {
		if p.Count > 0 {
			p.Last = append([]int(nil), p.Last...)
			out = append(out, p)
		}
	}
	return out
}

// ProfileOf returns the profile of one kind of operation (zero when none ran).
func (c *Comm) ProfileOf(op OpKind) OpProfile {
	c.prof.mu.Lock()
	defer c.prof.mu.Unlock()
	if op >= opKindEnd {
		return OpProfile{Op: op}
	}
	p := c.prof.ops[op]
	p.Op = op
	p.Last = append([]int(nil), p.Last...)
	return p
}
