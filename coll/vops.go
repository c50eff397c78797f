package coll

import (
	"context"
	"fmt"
	"github.com/moex-ai/moex/coll/algos"

	"github.com/moex-ai/moex/coll/dtype"
)

// The variable-size collectives: AllGatherv, ReduceScatterv, Gatherv and Scatterv, with
// a block of its own size per rank (MPI's v-forms; vLLM's CPU expert-parallel path, an
// all-gather of every rank's tokens and a reduce-scatter of the outputs, is built on the
// first two). They run the algorithms of their fixed-size forms, chosen by the same cost
// model for a block of the average size, and MOEX_ALGO overrides them by their own names
// (allgatherv:ring). counts (and displs, where there are any) must be the same on every
// rank: they are part of the operation's signature, so ranks that disagree get
// ErrMismatch. Plans are cached for the counts last seen, so an operation whose counts
// repeat allocates nothing.

// AllGatherv gathers every rank's send into recv on every rank: rank q's block,
// counts[q] elements, lands at displs[q] (nil displs: the blocks packed in rank order).
// len(send) must be counts[this rank]; send == nil: this rank's block is in recv already.
func AllGatherv[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, counts, displs []int) error {
	_, err := allGatherv(ctx, c, send, recv, counts, displs, false)
	return err
}

// IAllGatherv is the non-blocking AllGatherv.
func IAllGatherv[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, counts, displs []int) (*Handle, error) {
	return allGatherv(ctx, c, send, recv, counts, displs, true)
}

// IAllGathervWith is IAllGatherv completing h, a Handle whose operation has completed
// (or a zero Handle), instead of a new one: nothing is allocated.
func IAllGathervWith[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, counts, displs []int, h *Handle) error {
	_, err := allGathervInto(ctx, c, send, recv, counts, displs, h)
	return err
}

func allGatherv[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, counts, displs []int, async bool) (*Handle, error) {
	var h *Handle
	if async {
		h = newHandle()
	}
	return allGathervInto(ctx, c, send, recv, counts, displs, h)
}

func allGathervInto[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, counts, displs []int, h *Handle) (*Handle, error) {
	dt := dtype.Of[T]()
	pl, bl, err := c.vplan(OpAllGatherv, dt, 0, 0, "recv", counts, displs, len(recv))
	if err != nil {
		return nil, err
	}
	if send != nil && len(send) != counts[c.rank] {
		return nil, c.invalid("send", "%d elements, counts[%d] is %d", len(send), c.rank, counts[c.rank])
	}
	rb := dtype.Bytes(recv)
	cl := call{op: OpAllGatherv, dt: dt, recv: rb}
	if send != nil {
		mine := rb[bl.Off[c.rank] : bl.Off[c.rank]+bl.N[c.rank]]
		if sb := dtype.Bytes(send); !sameStart(sb, mine) {
			cl.send = outOfPlace(pl, sb, mine)
		}
	}
	return h, c.submitInto(ctx, cl, pl, h, nil)
}

// ReduceScatterv combines every rank's send (its blocks packed in rank order: block q has
// counts[q] elements) with op and leaves block r of the result, counts[r] elements, in
// recv on rank r.
func ReduceScatterv[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, counts []int, op dtype.Op) error {
	_, err := reduceScatterv(ctx, c, send, recv, counts, op, false)
	return err
}

// IReduceScatterv is the non-blocking ReduceScatterv.
func IReduceScatterv[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, counts []int, op dtype.Op) (*Handle, error) {
	return reduceScatterv(ctx, c, send, recv, counts, op, true)
}

// IReduceScattervWith is IReduceScatterv completing h, a Handle whose operation has
// completed (or a zero Handle), instead of a new one: nothing is allocated.
func IReduceScattervWith[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, counts []int, op dtype.Op, h *Handle) error {
	_, err := reduceScattervInto(ctx, c, send, recv, counts, op, h)
	return err
}

func reduceScatterv[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, counts []int, op dtype.Op, async bool) (*Handle, error) {
	var h *Handle
	if async {
		h = newHandle()
	}
	return reduceScattervInto(ctx, c, send, recv, counts, op, h)
}

func reduceScattervInto[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, counts []int, op dtype.Op, h *Handle) (*Handle, error) {
	if err := c.checkOp(op); err != nil {
		return nil, err
	}
	dt := dtype.Of[T]()
	pl, bl, err := c.vplan(OpReduceScatterv, dt, op, 0, "send", counts, nil, len(send))
	if err != nil {
		return nil, err
	}
	if tot := bl.Off[c.size-1] + bl.N[c.size-1]; tot != len(send)*dt.Size() {
		return nil, c.invalid("send", "%d elements, the counts add up to %d", len(send), tot/dt.Size())
	}
	if len(recv) != counts[c.rank] {
		return nil, c.invalid("recv", "%d elements, counts[%d] is %d", len(recv), c.rank, counts[c.rank])
	}
	cl := call{op: OpReduceScatterv, dt: dt, redop: op, send: dtype.Bytes(send), recv: dtype.Bytes(recv)}
	return h, c.submitInto(ctx, cl, pl, h, nil)
}

// Gatherv collects every rank's send (counts[q] elements from rank q) into root's recv,
// rank q's at displs[q] (nil: packed in rank order). recv is ignored on other ranks;
// counts and displs are the same on every rank (unlike MPI, where only the root's count).
func Gatherv[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, counts, displs []int, root int) error {
	if err := c.checkRoot(root); err != nil {
		return err
	}
	dt := dtype.Of[T]()
	size := len(recv)
	if c.rank != root {
		size = -1 // not checked here
	}
	pl, _, err := c.vplan(OpGatherv, dt, 0, root, "recv", counts, displs, size)
	if err != nil {
		return err
	}
	if len(send) != counts[c.rank] {
		return c.invalid("send", "%d elements, counts[%d] is %d", len(send), c.rank, counts[c.rank])
	}
	cl := call{op: OpGatherv, dt: dt, root: root, send: dtype.Bytes(send), recv: dtype.Bytes(recv)}
	_, err = c.submitPlan(ctx, cl, pl, false, nil)
	return err
}

// Scatterv sends root's block q (counts[q] elements at displs[q] of send; nil displs:
// packed in rank order) to rank q's recv, which has counts[q] elements. send is ignored
// on other ranks; counts and displs are the same on every rank.
func Scatterv[T dtype.Elem](ctx context.Context, c *Comm, send []T, counts, displs []int, recv []T, root int) error {
	if err := c.checkRoot(root); err != nil {
		return err
	}
	dt := dtype.Of[T]()
	size := len(send)
	if c.rank != root {
		size = -1
	}
	pl, _, err := c.vplan(OpScatterv, dt, 0, root, "send", counts, displs, size)
	if err != nil {
		return err
	}
	if len(recv) != counts[c.rank] {
		return c.invalid("recv", "%d elements, counts[%d] is %d", len(recv), c.rank, counts[c.rank])
	}
	cl := call{op: OpScatterv, dt: dt, root: root, send: dtype.Bytes(send), recv: dtype.Bytes(recv)}
	_, err = c.submitPlan(ctx, cl, pl, false, nil)
	return err
}

// blocksOf validates counts and displacements (elements) for a buffer of size elements
// (-1: not checked) and returns them in bytes, in the communicator's scratch (the caller
// holds vmu).
func (c *Comm) blocksOf(buf string, counts, displs []int, size, es int) (*algos.Blocks, error) {
	if len(counts) != c.size {
		return nil, c.invalid("counts", "%d entries for %d ranks", len(counts), c.size)
	}
	if displs != nil && len(displs) != c.size {
		return nil, c.invalid("displs", "%d entries for %d ranks", len(displs), c.size)
	}
	bl := &c.vscratch
	bl.Off, bl.N, bl.Packed = growInts(bl.Off, c.size), growInts(bl.N, c.size), true
	o := 0
	for q, n := range counts {
		if n < 0 {
			return nil, c.invalid(fmt.Sprintf("counts[%d]", q), "negative count %d", n)
		}
		d := o
		if displs != nil {
			d = displs[q]
			if d < 0 {
				return nil, c.invalid(fmt.Sprintf("displs[%d]", q), "negative displacement %d", d)
			}
		}
		if size >= 0 && d+n > size {
			return nil, c.invalid(buf, "block %d ([%d,+%d)) runs past the %d-element buffer", q, d, n, size)
		}
		bl.Packed = bl.Packed && d == o
		bl.Off[q], bl.N[q] = d*es, n*es
		o += n
	}
	return bl, nil
}

// maxVPlans bounds the cache of variable-size plans (it is emptied when full).
const maxVPlans = 64

// vplan validates a variable-size op's counts and displacements (for a buffer of size
// elements; -1: not checked) and returns its plan, from the cache when the counts were
// seen lately, with its blocks (the plan's copy, never changed).
func (c *Comm) vplan(op OpKind, dt dtype.Type, redop dtype.Op, root int, buf string, counts, displs []int, size int) (*algos.Plan, *algos.Blocks, error) {
	c.vmu.Lock()
	defer c.vmu.Unlock()
	bl, err := c.blocksOf(buf, counts, displs, size, dt.Size())
	if err != nil {
		return nil, nil, err
	}
	total, big := 0, 0
	for _, n := range bl.N {
		total += n
		big = max(big, n)
	}
	fits := op == OpAllGatherv && c.direct != nil && c.direct.Fits(big)
	algo := c.chooseFit(op, total/c.size, fits)
	h := bl.Hash()
	k := vkey{algos.PlanKey{Op: op, Algo: algo, Dt: dt, Redop: redop, Es: dt.Size(), Root: root}, h}
	c.planMu.Lock()
	e, ok := c.vplans[k]
	c.planMu.Unlock()
	if !ok || !e.bl.Equal(bl) {
		kept := bl.Clone()
		e = &vcached{pl: c.planV(k.PlanKey, kept, h), bl: kept}
		c.planMu.Lock()
		if len(c.vplans) >= maxVPlans {
			clear(c.vplans)
		}
		c.vplans[k] = e
		c.planMu.Unlock()
	}
	return e.pl, e.bl, nil
}

// planV builds the plan of a variable-size op.
func (c *Comm) planV(k algos.PlanKey, bl *algos.Blocks, h uint64) *algos.Plan {
	sh := algos.Shape{P: c.size, Rank: c.rank, Root: k.Root, Es: k.Es, V: bl}
	var pl *algos.Plan
	switch k.Op {
	case OpAllGatherv:
		pl = algos.PlanAllGather(k.Algo, sh, c.topo)
	case OpReduceScatterv:
		pl = algos.PlanReduceScatter(k.Algo, sh, c.topo)
	case OpGatherv:
		pl = algos.PlanGatherLinear(sh)
	case OpScatterv:
		pl = algos.PlanScatterLinear(sh)
	default:
		panic(fmt.Sprintf("coll: no variable-size planner for %v", k.Op))
	}
	pl.Op = k.Op
	pl.Sig = algos.Signature(k.Op, pl.Algo, k.Es, k.Root, int(k.Dt), int(k.Redop), int(h), int(h>>32))
	pl.CountBytes()
	if pl.Algo == Shared {
		pl.Bytes = (c.size - 1) * bl.N[c.rank]
	}
	return pl
}
