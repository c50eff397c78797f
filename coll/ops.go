package coll

import (
	"context"
	"fmt"
	"github.com/moex-ai/moex/coll/algos"
	"unsafe"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/transport"
)

// The operations. Every one is generic over the element type, takes the context first,
// and comes in a blocking form and a non-blocking I-form that returns a *Handle.
//
// In place: pass send == nil (or send aliasing recv) to AllReduce and Reduce; for
// AllGather pass send == nil with this rank's block already in recv.

// invalid aborts the communicator (so that every rank learns) and returns the ArgError.
func (c *Comm) invalid(arg, format string, a ...any) error {
	err := &ArgError{Arg: arg, Reason: fmt.Sprintf(format, a...)}
	if c.Err() == nil && !c.closed.Load() {
		c.abortLocal(err)
	}
	return err
}

func sameStart(a, b []byte) bool {
	return len(a) > 0 && len(b) > 0 && unsafe.SliceData(a) == unsafe.SliceData(b)
}

func (c *Comm) checkRoot(root int) error {
	if root < 0 || root >= c.size {
		return c.invalid("root", "rank %d out of range [0,%d)", root, c.size)
	}
	return nil
}

func (c *Comm) checkOp(op dtype.Op) error {
	if !op.Valid() {
		return c.invalid("op", "unknown reduction %v", op)
	}
	return nil
}

// start assigns the sequence number(s) and arms the watchdog; the caller runs the plan
// (now, or in a goroutine for the I-forms) and calls c.end.
func (c *Comm) start(ctx context.Context, verify bool) (uint32, error) {
	if err := c.begin(ctx); err != nil {
		return 0, err
	}
	seq := c.nextSeq()
	if c.cfg.Profile {
		c.nextSeq()
	}
	if verify {
		c.nextSeq()
	}
	return seq, nil
}

// submit runs the call now, or in the background when async (returning its handle).
// after, if set, runs once the call is over (releasing scratch the call used).
func (c *Comm) submit(ctx context.Context, cl call, k algos.PlanKey, async bool, after func()) (*Handle, error) {
	return c.submitPlan(ctx, cl, c.getPlan(k), async, after)
}

func (c *Comm) submitPlan(ctx context.Context, cl call, pl *algos.Plan, async bool, after func()) (*Handle, error) {
	var h *Handle
	if async {
		h = newHandle()
	}
	return h, c.submitInto(ctx, cl, pl, h, after)
}

// submitInto runs the call now (h nil) or on a worker, completing h.
func (c *Comm) submitInto(ctx context.Context, cl call, pl *algos.Plan, h *Handle, after func()) error {
	if h != nil {
		if err := h.take(); err != nil {
			return err
		}
	}
	confirm := c.confirms(&cl) // first: it keeps the state of every call
	cl.verify = c.verifies(&cl) || confirm
	seq, err := c.start(ctx, cl.verify)
	if err != nil {
		if after != nil {
			after()
		}
		if h != nil {
			h.finish(err)
		}
		return err
	}
	if pl.Algo == Shared {
		cl.turn = c.direct.Turn() // in issue order, as the sequence numbers
	}
	if h == nil {
		err := c.exec(pl, seq, &cl)
		if after != nil {
			after()
		}
		return err
	}
	j := c.getJob()
	j.pl, j.seq, j.cl, j.after, j.h = pl, seq, cl, after, h
	c.runAsync(j)
	return nil
}

func key(c *Comm, cl *call, costBytes int) algos.PlanKey {
	return algos.PlanKey{Op: cl.op, Algo: c.choose(cl.op, costBytes), Dt: cl.dt, Redop: cl.redop, Es: cl.dt.Size(), Count: cl.count, Root: cl.root}
}

// ---- AllReduce ----

// AllReduce combines send from every rank with op and leaves the result, bitwise
// identical, in recv on every rank. send == nil works in place on recv.
func AllReduce[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, op dtype.Op) error {
	_, err := allReduce(ctx, c, send, recv, op, false)
	return err
}

// IAllReduce is the non-blocking AllReduce.
func IAllReduce[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, op dtype.Op) (*Handle, error) {
	return allReduce(ctx, c, send, recv, op, true)
}

func allReduce[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, op dtype.Op, async bool) (*Handle, error) {
	if err := c.checkOp(op); err != nil {
		return nil, err
	}
	if send != nil && len(send) != len(recv) {
		return nil, c.invalid("recv", "%d elements for a %d-element send", len(recv), len(send))
	}
	dt := dtype.Of[T]()
	sb, rb := dtype.Bytes(send), dtype.Bytes(recv)
	cl := call{op: OpAllReduce, dt: dt, redop: op, count: len(recv), recv: rb}
	k := key(c, &cl, len(rb))
	if send != nil && !sameStart(sb, rb) {
		if k.Algo == Shared && c.allReducesAcross(len(rb)) {
			cl.send = sb // read where it is
		} else {
			copy(rb, sb)
		}
	}
	return c.submit(ctx, cl, k, async, nil)
}

// ---- Broadcast ----

// Broadcast copies root's buf into buf on every rank.
func Broadcast[T dtype.Elem](ctx context.Context, c *Comm, buf []T, root int) error {
	_, err := broadcast(ctx, c, buf, root, false)
	return err
}

// IBroadcast is the non-blocking Broadcast.
func IBroadcast[T dtype.Elem](ctx context.Context, c *Comm, buf []T, root int) (*Handle, error) {
	return broadcast(ctx, c, buf, root, true)
}

func broadcast[T dtype.Elem](ctx context.Context, c *Comm, buf []T, root int, async bool) (*Handle, error) {
	if err := c.checkRoot(root); err != nil {
		return nil, err
	}
	dt := dtype.Of[T]()
	b := dtype.Bytes(buf)
	cl := call{op: OpBroadcast, dt: dt, count: len(buf), root: root, recv: b}
	return c.submit(ctx, cl, key(c, &cl, len(b)), async, nil)
}

// ---- Reduce ----

// Reduce combines send from every rank with op into recv on root. recv is ignored (may be
// nil) on other ranks; at root, send == nil works in place on recv.
func Reduce[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, op dtype.Op, root int) error {
	_, err := reduce(ctx, c, send, recv, op, root, false)
	return err
}

// IReduce is the non-blocking Reduce.
func IReduce[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, op dtype.Op, root int) (*Handle, error) {
	return reduce(ctx, c, send, recv, op, root, true)
}

func reduce[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, op dtype.Op, root int, async bool) (*Handle, error) {
	if err := c.checkOp(op); err != nil {
		return nil, err
	}
	if err := c.checkRoot(root); err != nil {
		return nil, err
	}
	dt := dtype.Of[T]()
	n := len(send)
	if c.rank == root {
		if send == nil {
			n = len(recv)
		} else if len(recv) != n {
			return nil, c.invalid("recv", "%d elements at the root for a %d-element send", len(recv), n)
		}
	}
	sb := dtype.Bytes(send)
	var rb []byte
	var owned func()
	if c.rank == root {
		rb = dtype.Bytes(recv)
		if send != nil && !sameStart(sb, rb) {
			copy(rb, sb)
		}
	} else {
		// The accumulation buffer of a non-root is scratch: send stays untouched.
		buf := c.pool.Get(len(sb))
		rb = buf.Bytes()
		copy(rb, sb)
		owned = buf.Release
	}
	cl := call{op: OpReduce, dt: dt, redop: op, count: n, root: root, recv: rb}
	return c.submit(ctx, cl, key(c, &cl, n*dt.Size()), async, owned)
}

// ---- AllGather ----

// AllGather concatenates every rank's send, in rank order, into recv on every rank
// (len(recv) = Size()*len(send)). send == nil: this rank's block is already in recv.
func AllGather[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T) error {
	_, err := allGather(ctx, c, send, recv, false)
	return err
}

// IAllGather is the non-blocking AllGather.
func IAllGather[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T) (*Handle, error) {
	return allGather(ctx, c, send, recv, true)
}

// IAllGatherWith is IAllGather completing h, a Handle whose operation has completed (or a
// zero Handle), instead of a new one: nothing is allocated.
func IAllGatherWith[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, h *Handle) error {
	cl, pl, err := allGatherCall(c, send, recv)
	if err != nil {
		return err
	}
	return c.submitInto(ctx, cl, pl, h, nil)
}

func allGather[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, async bool) (*Handle, error) {
	cl, pl, err := allGatherCall(c, send, recv)
	if err != nil {
		return nil, err
	}
	return c.submitPlan(ctx, cl, pl, async, nil)
}

func allGatherCall[T dtype.Elem](c *Comm, send, recv []T) (call, *algos.Plan, error) {
	blk := len(recv) / c.size
	if len(recv)%c.size != 0 {
		return call{}, nil, c.invalid("recv", "%d elements is not a multiple of %d ranks", len(recv), c.size)
	}
	if send != nil && len(send) != blk {
		return call{}, nil, c.invalid("recv", "%d elements for %d ranks of %d", len(recv), c.size, len(send))
	}
	dt := dtype.Of[T]()
	rb := dtype.Bytes(recv)
	cl := call{op: OpAllGather, dt: dt, count: blk, recv: rb}
	pl := c.getPlan(key(c, &cl, blk*dt.Size()))
	if send != nil {
		mine := rb[c.rank*blk*dt.Size() : (c.rank+1)*blk*dt.Size()]
		if sb := dtype.Bytes(send); !sameStart(sb, mine) {
			cl.send = outOfPlace(pl, sb, mine)
		}
	}
	return cl, pl, nil
}

// outOfPlace readies an AllGather(v) whose block send is not in place in recv (at
// mine): through the shared areas the others read it from send while this rank copies
// it into recv, so the call keeps send (returned); the other plans read recv, so it is
// copied there now (nil returned).
func outOfPlace(pl *algos.Plan, send, mine []byte) []byte {
	if pl.Algo == Shared {
		return send
	}
	copy(mine, send)
	return nil
}

// ---- ReduceScatter ----

// ReduceScatter combines send (Size() blocks of len(recv)) from every rank with op and
// leaves block r of the result in recv on rank r.
func ReduceScatter[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, op dtype.Op) error {
	_, err := reduceScatter(ctx, c, send, recv, op, false)
	return err
}

// IReduceScatter is the non-blocking ReduceScatter.
func IReduceScatter[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, op dtype.Op) (*Handle, error) {
	return reduceScatter(ctx, c, send, recv, op, true)
}

func reduceScatter[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, op dtype.Op, async bool) (*Handle, error) {
	if err := c.checkOp(op); err != nil {
		return nil, err
	}
	if len(send) != c.size*len(recv) {
		return nil, c.invalid("send", "%d elements, want %d ranks x %d", len(send), c.size, len(recv))
	}
	dt := dtype.Of[T]()
	cl := call{op: OpReduceScatter, dt: dt, redop: op, count: len(recv), send: dtype.Bytes(send), recv: dtype.Bytes(recv)}
	return c.submit(ctx, cl, key(c, &cl, len(recv)*dt.Size()), async, nil)
}

// ---- AlltoAll ----

// AlltoAll sends block j of send (Size() equal blocks) to rank j, which stores it as
// block i (this rank's index) of recv.
func AlltoAll[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T) error {
	_, err := alltoAll(ctx, c, send, recv, false)
	return err
}

// IAlltoAll is the non-blocking AlltoAll.
func IAlltoAll[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T) (*Handle, error) {
	return alltoAll(ctx, c, send, recv, true)
}

func alltoAll[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, async bool) (*Handle, error) {
	if len(send) != len(recv) {
		return nil, c.invalid("recv", "%d elements for a %d-element send", len(recv), len(send))
	}
	if len(send)%c.size != 0 {
		return nil, c.invalid("send", "%d elements is not a multiple of %d ranks", len(send), c.size)
	}
	dt := dtype.Of[T]()
	blk := len(send) / c.size
	sb, rb := dtype.Bytes(send), dtype.Bytes(recv)
	var owned func()
	if sameStart(sb, rb) { // in place: send from a copy
		buf := c.pool.Get(len(sb))
		copy(buf.Bytes(), sb)
		sb = buf.Bytes()
		owned = buf.Release
	}
	cl := call{op: OpAlltoAll, dt: dt, count: blk, send: sb, recv: rb}
	return c.submit(ctx, cl, key(c, &cl, blk*dt.Size()), async, owned)
}

// ---- Scatter, Gather ----

// Scatter sends block j of root's send (Size() blocks of len(recv)) to rank j's recv.
// send is ignored on other ranks.
func Scatter[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, root int) error {
	if err := c.checkRoot(root); err != nil {
		return err
	}
	if c.rank == root && len(send) != c.size*len(recv) {
		return c.invalid("send", "%d elements at the root, want %d ranks x %d", len(send), c.size, len(recv))
	}
	dt := dtype.Of[T]()
	cl := call{op: OpScatter, dt: dt, count: len(recv), root: root, send: dtype.Bytes(send), recv: dtype.Bytes(recv)}
	_, err := c.submit(ctx, cl, key(c, &cl, len(recv)*dt.Size()), false, nil)
	return err
}

// Gather collects every rank's send into root's recv (Size() blocks, rank order). recv is
// ignored on other ranks.
func Gather[T dtype.Elem](ctx context.Context, c *Comm, send, recv []T, root int) error {
	if err := c.checkRoot(root); err != nil {
		return err
	}
	if c.rank == root && len(recv) != c.size*len(send) {
		return c.invalid("recv", "%d elements at the root, want %d ranks x %d", len(recv), c.size, len(send))
	}
	dt := dtype.Of[T]()
	cl := call{op: OpGather, dt: dt, count: len(send), root: root, send: dtype.Bytes(send), recv: dtype.Bytes(recv)}
	_, err := c.submit(ctx, cl, key(c, &cl, len(send)*dt.Size()), false, nil)
	return err
}

// Barrier returns once every rank has entered it.
func Barrier(ctx context.Context, c *Comm) error {
	cl := call{op: OpBarrier, dt: dtype.U8}
	_, err := c.submit(ctx, cl, algos.PlanKey{Op: OpBarrier, Algo: Dissemination, Dt: dtype.U8, Es: 1}, false, nil)
	return err
}

// ---- Send, Recv ----

// Send sends buf to peer with a tag (point to point; not a collective). Messages with the
// same (peer, tag) arrive in order.
func Send[T dtype.Elem](ctx context.Context, c *Comm, buf []T, peer, tag int) error {
	if peer < 0 || peer >= c.size {
		return &ArgError{Arg: "peer", Reason: fmt.Sprintf("rank %d out of range [0,%d)", peer, c.size)}
	}
	if tag < 0 {
		return &ArgError{Arg: "tag", Reason: "negative"}
	}
	if err := c.begin(ctx); err != nil {
		return err
	}
	defer c.end()
	r, err := c.tr.Isend(c.ranks[peer], transport.Tag{Comm: c.id, Seq: p2pSeq, Tag: uint32(tag)}, dtype.Bytes(buf))
	if err != nil {
		return c.fail(err)
	}
	if _, err := r.Wait(c.actx); err != nil {
		return c.fail(err)
	}
	return nil
}

// Recv receives from peer with a tag into buf and returns the number of elements that
// arrived (a shorter message fills part of buf; a longer one is an error).
func Recv[T dtype.Elem](ctx context.Context, c *Comm, buf []T, peer, tag int) (int, error) {
	if peer < 0 || peer >= c.size {
		return 0, &ArgError{Arg: "peer", Reason: fmt.Sprintf("rank %d out of range [0,%d)", peer, c.size)}
	}
	if tag < 0 {
		return 0, &ArgError{Arg: "tag", Reason: "negative"}
	}
	if err := c.begin(ctx); err != nil {
		return 0, err
	}
	defer c.end()
	b := dtype.Bytes(buf)
	r, err := c.tr.Irecv(c.ranks[peer], transport.Tag{Comm: c.id, Seq: p2pSeq, Tag: uint32(tag)}, b)
	if err != nil {
		return 0, c.fail(err)
	}
	n, err := r.Wait(c.actx)
	if err != nil {
		return 0, c.fail(err)
	}
	return n / dtype.Of[T]().Size(), nil
}

// P2P is one message of a SendRecv batch: Buf goes to Peer (Recv false) or comes from
// it (Recv true, and the message must fill Buf exactly), under Tag.
type P2P struct {
	Peer int    // the other rank
	Tag  int    // the message's tag: messages of one (peer, tag) arrive in order
	Buf  []byte // what to send, or where to receive
	Recv bool   // a receive (else a send)
}

// SendRecv posts every message of ops at once and returns when all have completed (a
// group of point-to-point operations, as in NCCL's grouped send and receive): the
// order of ops cannot deadlock, and each pair of ranks moves its messages as the
// transport allows, in parallel with every other pair. It is not a collective: only
// the ranks named take part. Messages with the same (peer, tag) match in order. A
// failure aborts the communicator, as a collective's does, so that every rank of a
// batch that another rank waits on returns an error rather than hanging.
func SendRecv(ctx context.Context, c *Comm, ops []P2P) error {
	for i, op := range ops {
		switch {
		case op.Peer < 0 || op.Peer >= c.size:
			return &ArgError{Arg: fmt.Sprintf("ops[%d].Peer", i), Reason: fmt.Sprintf("rank %d out of range [0,%d)", op.Peer, c.size)}
		case op.Tag < 0:
			return &ArgError{Arg: fmt.Sprintf("ops[%d].Tag", i), Reason: "negative"}
		}
	}
	if err := c.begin(ctx); err != nil {
		return err
	}
	defer c.end()
	reqs := make([]transport.Request, 0, len(ops))
	var first error
	for _, op := range ops {
		tag := transport.Tag{Comm: c.id, Seq: p2pSeq, Tag: uint32(op.Tag)}
		var r transport.Request
		var err error
		if op.Recv {
			r, err = c.tr.Irecv(c.ranks[op.Peer], tag, op.Buf)
		} else {
			r, err = c.tr.Isend(c.ranks[op.Peer], tag, op.Buf)
		}
		if err != nil {
			first = c.fail(err)
			break
		}
		c.pend[op.Peer].Add(1) // whom a stalled batch waits for (TimeoutError.Waiting)
		reqs = append(reqs, r)
	}
	// Every posted request is waited for, also after a failure (the abort ends the
	// others at once), so that no buffer of ops is still the transport's on return.
	for i, r := range reqs {
		n, err := r.Wait(c.actx)
		c.pend[ops[i].Peer].Add(-1)
		switch {
		case first != nil:
		case err != nil:
			first = c.fail(err)
		case ops[i].Recv && n != len(ops[i].Buf):
			first = c.fail(&ArgError{Arg: fmt.Sprintf("ops[%d].Buf", i), Reason: fmt.Sprintf("%d bytes arrived from rank %d for a buffer of %d", n, ops[i].Peer, len(ops[i].Buf))})
		}
	}
	return first
}
