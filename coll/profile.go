package coll

import (
	"cmp"
	"fmt"
	"github.com/moex-ai/moex/coll/algos"
	"slices"
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
//
// Exchanges (the MoE low-latency mode's) add no all-gather: every block says by arriving
// that its sender has entered, so XOp.Wait notes when each arrives and charges each
// sender with the wait it caused (OpProfile.WaitFor).

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
	longest, w := 0, time.Duration(0)
	for r, d := range p.WaitFor {
		if d > w {
			longest, w = r, d
		}
	}
	times := fmt.Sprintf("wait %v, move %v, skew %v per op", p.Wait/n, p.Move/n, p.Skew/n)
	if p.Op == OpExchange { // no arrival all-gather: the senders' entries are not timed
		times = fmt.Sprintf("wait %v per op", p.Wait/n)
	}
	return fmt.Sprintf("%v: %d ops, %s; last to arrive most often: rank %d (%d of %d); waited longest for rank %d (%v per op)",
		p.Op, p.Count, times, q, most, p.Count, longest, w/n)
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
	p := c.profileFor(op)
	p.Count++
	p.Wait += wait
	p.Move += move
	p.Skew += skew
	p.Last[last]++
	p.WaitFor[last] += wait
}

// profileFor returns op's profile, made on first use (c.prof.mu held).
func (c *Comm) profileFor(op OpKind) *OpProfile {
	p := &c.prof.ops[op]
	if p.Last == nil {
		p.Op, p.Last, p.WaitFor = op, make([]int, c.size), make([]time.Duration, c.size)
	}
	return p
}

// recordExchange records one exchange's wait: arrived[q] is when rank q's block was seen
// to arrive, in nanoseconds after XOp.Wait started waiting, or 0 or less where this rank
// did not wait for it (it had arrived, or it is this rank's own). The ranks are taken in
// the order their blocks arrived, each charged with the time from the arrival before its
// own; order is scratch of P entries. It returns the wait, the rank that came last (-1:
// none was waited for) and the ranks waited for, in order (in order's storage).
func (c *Comm) recordExchange(arrived []int64, order []int32) (wait time.Duration, last int, waited []int32) {
	order = order[:0]
	for q, t := range arrived {
		if t > 0 {
			order = append(order, int32(q))
		}
	}
	slices.SortFunc(order, func(a, b int32) int { return cmp.Compare(arrived[a], arrived[b]) })
	c.prof.mu.Lock()
	defer c.prof.mu.Unlock()
	p := c.profileFor(OpExchange)
	p.Count++
	prev := int64(0)
	for _, q := range order {
		p.WaitFor[q] += time.Duration(arrived[q] - prev)
		prev = arrived[q]
	}
	p.Wait += time.Duration(prev)
	last = -1
	if len(order) > 0 {
		last = int(order[len(order)-1])
		p.Last[last]++
	}
	return time.Duration(prev), last, order
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
			p.WaitFor = append([]time.Duration(nil), p.WaitFor...)
			out = append(out, p)
		}
	}
	return out
}

// ProfileOf returns the profile of one kind of operation (zero when none ran).
func (c *Comm) ProfileOf(op OpKind) OpProfile {
	c.prof.mu.Lock()
	defer c.prof.mu.Unlock()
	if op >= algos.OpKindEnd {
		return OpProfile{Op: op}
	}
	p := c.prof.ops[op]
	p.Op = op
	p.Last = append([]int(nil), p.Last...)
	p.WaitFor = append([]time.Duration(nil), p.WaitFor...)
	return p
}
