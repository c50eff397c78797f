package coll

import (
	"context"
	"fmt"
	"github.com/moex-ai/moex/coll/algos"

	"github.com/moex-ai/moex/coll/dtype"
)

// AlltoAllv sends sendCounts[j] elements, starting at sendDispls[j] of send, to rank j,
// which receives recvCounts[i] elements at recvDispls[i] of its recv (i = this rank).
// nil displacements mean the blocks are packed in rank order. Counts that disagree between
// a sender and its receiver are ErrMismatch on every rank.
//
// The algorithm depends only on the number of ranks (the sizes are not known to every
// rank): linear (every transfer posted at once) up to 16 ranks, pairwise beyond, unless
// MOEX_ALGO says otherwise. Bruck and Hier (two-level, for ranks on several hosts) first
// all-gather every rank's counts. When every rank
// knows the whole count matrix, PlanAlltoAllv lets the cost model choose, and the plan
// can be reused while the counts repeat.
//
// Counts that disagree are seen by the ranks involved, which abort the communicator; the
// others may already have finished this operation and see the error on their next one.
// With Config.Verify (or Bruck) every rank first learns every rank's counts, and all of
// them fail this operation with ErrMismatch.
func AlltoAllv[T dtype.Elem](ctx context.Context, c *Comm, send []T, sendCounts, sendDispls []int, recv []T, recvCounts, recvDispls []int) error {
	_, err := alltoAllv(ctx, c, send, sendCounts, sendDispls, recv, recvCounts, recvDispls, false)
	return err
}

// IAlltoAllv is the non-blocking AlltoAllv.
func IAlltoAllv[T dtype.Elem](ctx context.Context, c *Comm, send []T, sendCounts, sendDispls []int, recv []T, recvCounts, recvDispls []int) (*Handle, error) {
	return alltoAllv(ctx, c, send, sendCounts, sendDispls, recv, recvCounts, recvDispls, true)
}

// layoutFrom validates counts and displacements (elements) and returns them in bytes.
func (c *Comm) layoutFrom(name string, counts, displs []int, total, es int) (off, ln []int, err error) {
	if len(counts) != c.size {
		return nil, nil, c.invalid(name+"Counts", "%d entries for %d ranks", len(counts), c.size)
	}
	if displs != nil && len(displs) != c.size {
		return nil, nil, c.invalid(name+"Displs", "%d entries for %d ranks", len(displs), c.size)
	}
	off, ln = make([]int, c.size), make([]int, c.size)
	o := 0
	for j, n := range counts {
		if n < 0 {
			return nil, nil, c.invalid(fmt.Sprintf("%sCounts[%d]", name, j), "negative count %d", n)
		}
		d := o
		if displs != nil {
			d = displs[j]
			if d < 0 {
				return nil, nil, c.invalid(fmt.Sprintf("%sDispls[%d]", name, j), "negative displacement %d", d)
			}
		}
		if d+n > total {
			return nil, nil, c.invalid(name, "block %d ([%d,+%d)) runs past the %d-element buffer", j, d, n, total)
		}
		off[j], ln[j] = d*es, n*es
		o += n
	}
	return off, ln, nil
}

func alltoAllv[T dtype.Elem](ctx context.Context, c *Comm, send []T, sendCounts, sendDispls []int, recv []T, recvCounts, recvDispls []int, async bool) (*Handle, error) {
	dt := dtype.Of[T]()
	es := dt.Size()
	var l algos.Vlayout
	var err error
	if l.SendOff, l.SendLen, err = c.layoutFrom("send", sendCounts, sendDispls, len(send), es); err != nil {
		return nil, err
	}
	if l.RecvOff, l.RecvLen, err = c.layoutFrom("recv", recvCounts, recvDispls, len(recv), es); err != nil {
		return nil, err
	}
	algo := c.cfg.Algo[OpAlltoAllv]
	if algo == AlgoAuto {
		algo = Linear
		if c.size > 16 {
			algo = Pairwise
		}
	}
	pl := &algos.Plan{Op: OpAlltoAllv, Algo: algo}
	var m [][]int
	if algo == Bruck || algo == Hier || c.cfg.Verify {
		// Every rank learns every rank's send and receive sizes, so that a disagreement is
		// seen, identically, by all of them (and Bruck needs the sizes anyway).
		p := c.size
		mine := make([]int64, 2*p)
		for j := 0; j < p; j++ {
			mine[j], mine[p+j] = int64(l.SendLen[j]), int64(l.RecvLen[j])
		}
		all := make([]int64, 2*p*p)
		if err := AllGather(ctx, c, mine, all); err != nil {
			return nil, err
		}
		m = make([][]int, p)
		for i := range m {
			m[i] = make([]int, p)
			for j := range m[i] {
				sent, expected := all[i*2*p+j], all[j*2*p+p+i]
				if sent != expected {
					return nil, c.fail(fmt.Errorf("%w: rank %d sends %d bytes to rank %d, which expects %d",
						ErrMismatch, i, sent, j, expected))
				}
				m[i][j] = int(sent)
			}
		}
	}
	switch algo {
	case Bruck:
		algos.PlanAlltoAllBruck(pl, c.size, c.rank, l, m)
	case Hier:
		algos.PlanAlltoAllHier(pl, c.topo, c.rank, l, func(i, j int) int { return m[i][j] })
	case Pairwise:
		algos.PlanAlltoAllPairwise(pl, c.size, c.rank, l)
	default:
		pl.Algo = Linear
		algos.PlanAlltoAllLinear(pl, c.size, c.rank, l)
	}
	pl.Sig = algos.Signature(OpAlltoAllv, pl.Algo, es)
	pl.CountBytes()
	cl := call{op: OpAlltoAllv, dt: dt, send: dtype.Bytes(send), recv: dtype.Bytes(recv)}
	return c.submitPlan(ctx, cl, pl, async, nil)
}

// VPlan is a reusable AlltoAllv schedule for a count matrix every rank knows.
type VPlan struct {
	pl               *algos.Plan
	lay              algos.Vlayout
	sendLen, recvLen int
	// Algo is the algorithm the cost model chose.
	Algo Algo
}

// PlanAlltoAllv plans an AlltoAllv from the full count matrix: counts[i][j] units of
// unit bytes go from rank i to rank j, blocks packed in rank order on both sides. Every
// rank must pass the same matrix (it is part of the operation's signature).
func (c *Comm) PlanAlltoAllv(counts [][]int, unit int) (*VPlan, error) {
	vp := &VPlan{pl: &algos.Plan{}}
	return vp, c.ReplanAlltoAllv(vp, counts, unit)
}

// ReplanAlltoAllv rebuilds vp for a new count matrix, reusing its storage: with the
// linear and pairwise algorithms a steady stream of new matrices allocates nothing.
func (c *Comm) ReplanAlltoAllv(vp *VPlan, counts [][]int, unit int) error {
	return c.replanV(vp, counts, unit, nil, nil)
}

// ReplanAlltoAllvAt is ReplanAlltoAllv with the blocks where the caller lays them out
// (as MPI_Alltoallv's displacements, in units): rank i's block for rank j starts at
// sendOff[i][j] in its send buffer, and this rank's block from rank j at recvOff[j] in
// its receive buffer. Every rank passes the same counts and sendOff (a rank may read a
// peer's block at the peer's offset, in shared memory); recvOff is this rank's own. The
// blocks a rank receives may not overlap. The plan's buffers end where the last block
// does.
func (c *Comm) ReplanAlltoAllvAt(vp *VPlan, counts [][]int, unit int, sendOff [][]int, recvOff []int) error {
	if len(sendOff) != c.size {
		return &ArgError{Arg: "sendOff", Reason: fmt.Sprintf("%d rows for %d ranks", len(sendOff), c.size)}
	}
	for i, row := range sendOff {
		if len(row) != c.size {
			return &ArgError{Arg: fmt.Sprintf("sendOff[%d]", i), Reason: fmt.Sprintf("%d entries for %d ranks", len(row), c.size)}
		}
		for j, o := range row {
			if o < 0 {
				return &ArgError{Arg: fmt.Sprintf("sendOff[%d][%d]", i, j), Reason: "negative"}
			}
		}
	}
	if len(recvOff) != c.size {
		return &ArgError{Arg: "recvOff", Reason: fmt.Sprintf("%d entries for %d ranks", len(recvOff), c.size)}
	}
	for j, o := range recvOff {
		if o < 0 {
			return &ArgError{Arg: fmt.Sprintf("recvOff[%d]", j), Reason: "negative"}
		}
	}
	return c.replanV(vp, counts, unit, sendOff, recvOff)
}

// replanV plans vp; nil offsets: the blocks packed in rank order.
func (c *Comm) replanV(vp *VPlan, counts [][]int, unit int, sendOff [][]int, recvOff []int) error {
	if len(counts) != c.size {
		return &ArgError{Arg: "counts", Reason: fmt.Sprintf("%d rows for %d ranks", len(counts), c.size)}
	}
	if unit <= 0 {
		return &ArgError{Arg: "unit", Reason: fmt.Sprintf("%d bytes", unit)}
	}
	if vp.pl == nil {
		vp.pl = &algos.Plan{}
	}
	l := &vp.lay
	l.SendOff, l.SendLen = growInts(l.SendOff, c.size), growInts(l.SendLen, c.size)
	l.RecvOff, l.RecvLen = growInts(l.RecvOff, c.size), growInts(l.RecvLen, c.size)
	total, h, maxRow := 0, 0, 0 // maxRow: the largest send buffer of any rank, in bytes
	for i, row := range counts {
		if len(row) != c.size {
			return &ArgError{Arg: fmt.Sprintf("counts[%d]", i), Reason: fmt.Sprintf("%d entries for %d ranks", len(row), c.size)}
		}
		rowBytes := 0
		for j, n := range row {
			if n < 0 {
				return &ArgError{Arg: fmt.Sprintf("counts[%d][%d]", i, j), Reason: "negative"}
			}
			total += n * unit
			end := rowBytes + n*unit
			if sendOff != nil {
				end = (sendOff[i][j] + n) * unit
				h = h*31 + sendOff[i][j]
			}
			rowBytes = max(rowBytes, end)
			h = h*31 + n
		}
		maxRow = max(maxRow, rowBytes)
	}
	so, ro := 0, 0
	for j := 0; j < c.size; j++ {
		sOff, rOff := so, ro
		if sendOff != nil {
			sOff, rOff = sendOff[c.rank][j]*unit, recvOff[j]*unit
		}
		l.SendOff[j], l.SendLen[j] = sOff, counts[c.rank][j]*unit
		l.RecvOff[j], l.RecvLen[j] = rOff, counts[j][c.rank]*unit
		so, ro = max(so, sOff+l.SendLen[j]), max(ro, rOff+l.RecvLen[j])
	}
	if recvOff != nil {
		if err := disjoint(l.RecvOff, l.RecvLen); err != nil {
			return err
		}
	}
	avg := total / max(1, c.size*c.size)
	algo := c.chooseFit(OpAlltoAllv, avg, c.direct != nil && c.direct.Fits(maxRow))
	pl := vp.pl
	pl.Op, pl.Algo, pl.Tmp = OpAlltoAllv, algo, 0
	switch algo {
	case Shared:
		planAlltoAllvShared(pl, c.rank, counts, unit, sendOff, *l)
	case Bruck:
		m := make([][]int, c.size)
		for i := range m {
			m[i] = make([]int, c.size)
			for j := range m[i] {
				m[i][j] = counts[i][j] * unit
			}
		}
		pl.Steps = nil
		algos.PlanAlltoAllBruck(pl, c.size, c.rank, *l, m)
	case Hier:
		algos.PlanAlltoAllHier(pl, c.topo, c.rank, *l, func(i, j int) int { return counts[i][j] * unit })
	case Pairwise:
		algos.PlanAlltoAllPairwise(pl, c.size, c.rank, *l)
	default:
		algos.PlanAlltoAllLinear(pl, c.size, c.rank, *l)
	}
	pl.Sig = algos.Signature(OpAlltoAllv, algo, unit, h)
	pl.CountBytes()
	if algo == Shared {
		pl.Bytes = 0
		for j := range l.SendLen {
			if j != c.rank {
				pl.Bytes += l.SendLen[j]
			}
		}
	}
	vp.sendLen, vp.recvLen, vp.Algo = so, ro, algo
	return nil
}

// disjoint checks that the blocks [off[j], off[j]+n[j]) do not overlap: an ArgError
// names two that do.
func disjoint(off, n []int) error {
	end, sorted := 0, true // blocks in rank order, the common case: one pass
	for j := range off {
		if n[j] > 0 {
			if off[j] < end {
				sorted = false
				break
			}
			end = off[j] + n[j]
		}
	}
	if sorted {
		return nil
	}
	for i := range off {
		for j := i + 1; j < len(off); j++ {
			if n[i] > 0 && n[j] > 0 && off[i] < off[j]+n[j] && off[j] < off[i]+n[i] {
				return &ArgError{Arg: "recvOff", Reason: fmt.Sprintf("the blocks from ranks %d and %d overlap", i, j)}
			}
		}
	}
	return nil
}

// planAlltoAllvShared lays out an AlltoAllv through the shared areas: the block rank q
// sends this rank r starts at sendOff[q][r] units (nil: after q's blocks for ranks
// before r, packed in rank order), in q's send buffer, which ends where its last block
// does.
func planAlltoAllvShared(pl *algos.Plan, r int, counts [][]int, unit int, sendOff [][]int, l algos.Vlayout) {
	p := len(counts)
	pl.Steps = pl.Steps[:0] // no steps: execShared runs it
	if pl.Shared == nil {
		pl.Shared = &algos.VLayout{}
	}
	v := pl.Shared
	v.RecvOff, v.RecvLen = l.RecvOff, l.RecvLen
	v.SrcOff, v.SrcLen = growInts(v.SrcOff, p), growInts(v.SrcLen, p)
	for q, row := range counts {
		off, n := 0, 0
		for j, k := range row {
			o := n
			if sendOff != nil {
				o = sendOff[q][j] * unit
			}
			if j == r {
				off = o
			}
			n = max(n, o+k*unit)
		}
		v.SrcOff[q], v.SrcLen[q] = off, n
	}
}

func growInts(s []int, n int) []int {
	if cap(s) < n {
		return make([]int, n)
	}
	return s[:n]
}

// Describe writes the plan's schedule on c's rank: steps, transfers, local copies (for
// moex flow and debugging).
func (v *VPlan) Describe(c *Comm) string {
	if v.pl == nil {
		return ""
	}
	var sb algos.StringsBuilder
	v.pl.Describe(&sb, c.rank)
	return sb.String()
}

// SendBytes and RecvBytes are the buffer sizes the plan needs on this rank.
func (v *VPlan) SendBytes() int { return v.sendLen }

// RecvBytes is the receive buffer size the plan needs on this rank.
func (v *VPlan) RecvBytes() int { return v.recvLen }

// RunAlltoAllv executes vp with the given byte buffers.
func (c *Comm) RunAlltoAllv(ctx context.Context, vp *VPlan, send, recv []byte) error {
	_, err := c.runV(ctx, vp, send, recv, false)
	return err
}

// IRunAlltoAllv is the non-blocking RunAlltoAllv.
func (c *Comm) IRunAlltoAllv(ctx context.Context, vp *VPlan, send, recv []byte) (*Handle, error) {
	return c.runV(ctx, vp, send, recv, true)
}

// IRunAlltoAllvWith is IRunAlltoAllv completing h, a Handle of an earlier operation that
// has completed (or a zero Handle), instead of a new one: nothing is allocated.
func (c *Comm) IRunAlltoAllvWith(ctx context.Context, vp *VPlan, send, recv []byte, h *Handle) error {
	if len(send) < vp.sendLen {
		return c.invalid("send", "%d bytes, the plan sends %d", len(send), vp.sendLen)
	}
	if len(recv) < vp.recvLen {
		return c.invalid("recv", "%d bytes, the plan receives %d", len(recv), vp.recvLen)
	}
	return c.submitInto(ctx, call{op: OpAlltoAllv, dt: dtype.U8, send: send, recv: recv}, vp.pl, h, nil)
}

func (c *Comm) runV(ctx context.Context, vp *VPlan, send, recv []byte, async bool) (*Handle, error) {
	if len(send) < vp.sendLen {
		return nil, c.invalid("send", "%d bytes, the plan sends %d", len(send), vp.sendLen)
	}
	if len(recv) < vp.recvLen {
		return nil, c.invalid("recv", "%d bytes, the plan receives %d", len(recv), vp.recvLen)
	}
	cl := call{op: OpAlltoAllv, dt: dtype.U8, send: send, recv: recv}
	return c.submitPlan(ctx, cl, vp.pl, async, nil)
}

// Describe writes the schedule of op on count elements of dt (per block or per rank, as
// the op takes them) on this rank, as the cost model would choose it; for `moex flow` and
// debugging. A variable-size operation (AlltoAllv, AllGatherv, ...) is described by its
// fixed-size form with count elements per block, the plan the cost model weighs for it.
func (c *Comm) Describe(op OpKind, dt dtype.Type, count, root int) string {
	var sb algos.StringsBuilder
	switch op = algos.FixedOf(op); op {
	case OpAlltoAllv:
		op = OpAlltoAll
	case OpAllReduce, OpBroadcast, OpReduce, OpAllGather, OpReduceScatter, OpAlltoAll, OpScatter, OpGather, OpBarrier:
	default:
		return fmt.Sprintf("rank %d: %v has no schedule of its own", c.rank, op)
	}
	cl := call{op: op, dt: dt, redop: dtype.Sum, count: count, root: root}
	pl := c.getPlan(key(c, &cl, count*dt.Size()))
	pl.Describe(&sb, c.rank)
	return sb.String()
}
