package coll

import (
	"context"
	"errors"
	"fmt"
	"github.com/moex-ai/moex/coll/algos"
	"log/slog"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
)

// VerifyRootedMin is the size from which Broadcast, Reduce, Gather and Scatter start
// with the agreement of Config.Verify on their own (Config.NoRootedVerify turns that
// off). In these operations some ranks only send (the root of a Broadcast or a Scatter,
// the leaves of a Reduce or a Gather) and would finish before a peer's bad argument or
// failure reached them; with the agreement every rank fails in the same call. The
// agreement is an all-gather of 8 bytes in ceil(log2 p) steps: from this size on a few
// percent of the operation (BenchmarkBroadcastVerify), below it up to as much again.
// Smaller rooted operations do not verify: their send-only ranks see a peer's failure in
// their next operation, which confirms the rooted one first (see confirms).
const VerifyRootedMin = 1 << 20

// verifies says whether the call starts with the agreement: the same on every rank that
// issued the same operation.
func (c *Comm) verifies(cl *call) bool {
	if c.cfg.Verify {
		return true
	}
	if c.cfg.NoRootedVerify || c.size < 2 {
		return false
	}
	n := cl.count * cl.dt.Size()
	switch cl.op {
	case OpBroadcast, OpReduce:
	case OpGather, OpScatter:
		n *= c.size
	default:
		return false
	}
	return n >= VerifyRootedMin
}

// confirms says whether the call must start with the agreement because the operation
// before it was a rooted one that did not verify: its send-only ranks (a Broadcast's
// root, a Reduce's leaves) finished without hearing from the others, so a peer that
// failed there (a short buffer, a mismatch) has left them unaware. An operation in which
// every rank hears from every rank (AllReduce, AllGather, ReduceScatter, AlltoAll,
// Barrier) confirms it by itself: a rank that aborted does not take part, so the others
// wait until its abort notice reaches them. Any other operation (another small rooted
// one, an AlltoAllv, whose blocks may be empty) starts with the agreement, which the
// aborted rank does not join. Every rank issues the same operations, so every rank
// decides alike. Config.NoRootedVerify turns this off with the rooted operations' check.
func (c *Comm) confirms(cl *call) bool {
	if c.cfg.NoRootedVerify || c.cfg.Verify || c.size < 2 {
		return false // no automatic check; or every operation checks itself
	}
	c.issueMu.Lock()
	defer c.issueMu.Unlock()
	unconfirmed := c.unconfirmed
	switch cl.op {
	case OpBroadcast, OpReduce, OpGather, OpScatter:
		c.unconfirmed = !c.verifies(cl) && !unconfirmed // a verified one confirms itself
	case OpAllReduce, OpAllGather, OpAllGatherv, OpReduceScatter, OpReduceScatterv, OpAlltoAll, OpBarrier:
		c.unconfirmed = false
		return false
	default:
		c.unconfirmed = false
	}
	return unconfirmed
}

// getPlan returns the cached plan for the call, computing it on first use.
func (c *Comm) getPlan(k algos.PlanKey) *algos.Plan {
	c.planMu.Lock()
	pl, ok := c.plans[k]
	c.planMu.Unlock()
	if ok {
		return pl
	}
	sh := algos.Shape{P: c.size, Rank: c.rank, Root: k.Root, Es: k.Es, Count: k.Count}
	e := algos.EntryOf(k.Op, k.Algo)
	if e == nil {
		panic(fmt.Sprintf("coll: no planner for %v", k.Op))
	}
	pl = e.Plan(sh, c.topo, k)
	pl.Sig = algos.Signature(k.Op, pl.Algo, k.Es, k.Count, k.Root, int(k.Dt), int(k.Redop))
	pl.CountBytes()
	if pl.Algo == Shared {
		pl.Bytes = (c.size - 1) * k.Count * k.Es
		if k.Op == OpAllReduce { // as the ring: a block to every rank, twice
			pl.Bytes = 2 * pl.Bytes / c.size
		}
	}
	c.planMu.Lock()
	c.plans[k] = pl
	c.planMu.Unlock()
	if c.log.Enabled(context.Background(), slog.LevelInfo) {
		c.log.Info("moex: algorithm", "comm", c.id, "rank", c.rank, "op", k.Op.String(), "algo", pl.Algo.String(),
			"ranks", c.size, "bytes", k.Count*k.Es, "steps", len(pl.Steps), "override", c.cfg.Algo[k.Op] != AlgoAuto)
	}
	return pl
}

// fail turns an error seen during an op into the op's result, aborting the communicator
// for everyone if it is not aborted already.
func (c *Comm) fail(err error) error {
	c.awaitNotice(err)
	if cause := c.Err(); cause != nil {
		return cause
	}
	if errors.Is(err, transport.ErrTruncated) {
		err = fmt.Errorf("%w: %v", ErrMismatch, err)
	}
	c.abortLocal(err)
	return err
}

// execShared runs an AlltoAll, an AllGather, a planned AlltoAllv, an AllReduce or a
// ReduceScatter through the shared areas (transport.SharedAreas).
func (c *Comm) execShared(pl *algos.Plan, cl *call) error {
	var err error
	switch {
	case pl.Op == OpAllReduce && c.allReducesAcross(len(cl.recv)): // from send (nil: in place)
		send := cl.send
		if send == nil {
			send = cl.recv
		}
		if err = c.direct.AllReduceAcross(c.actx, cl.turn, send, cl.recv, cl.dt.Size(), pl.Reduce, uint64(pl.Sig)); err == nil {
			dtype.Finish(cl.dt, cl.redop, cl.recv, c.size)
		}
	case pl.Op == OpAllReduce: // in place in recv
		if err = c.direct.AllReduce(c.actx, cl.turn, cl.recv, cl.recv, cl.dt.Size(), pl.Reduce, uint64(pl.Sig)); err == nil {
			dtype.Finish(cl.dt, cl.redop, cl.recv, c.size)
		}
	case pl.Op == OpReduceScatter && c.reduceScattersAcross(len(cl.send)):
		if err = c.direct.ReduceScatterAcross(c.actx, cl.turn, cl.send, cl.recv, cl.dt.Size(), pl.Reduce, uint64(pl.Sig)); err == nil {
			dtype.Finish(cl.dt, cl.redop, cl.recv, c.size)
		}
	case pl.Op == OpReduceScatter:
		if err = c.direct.ReduceScatter(c.actx, cl.turn, cl.send, cl.recv, pl.Reduce, uint64(pl.Sig)); err == nil {
			dtype.Finish(cl.dt, cl.redop, cl.recv, c.size)
		}
	case pl.Op == OpAllGather || pl.Op == OpAllGatherv: // this rank's block in send, else in place in recv
		off, b := pl.Shared.RecvOff[c.rank], pl.Shared.SrcLen[c.rank]
		send := cl.recv[off : off+b]
		if cl.send != nil {
			send = cl.send // the others read it there while this rank copies it into recv
		}
		err = c.direct.AllToAllv(c.actx, cl.turn, send, cl.recv, pl.Shared, uint64(pl.Sig))
	case pl.Shared != nil:
		err = c.direct.AllToAllv(c.actx, cl.turn, cl.send, cl.recv, pl.Shared, uint64(pl.Sig))
	default:
		err = c.direct.AllToAll(c.actx, cl.turn, cl.send, cl.recv, uint64(pl.Sig))
	}
	if err != nil {
		_ = c.fail(err) // aborts, unless the communicator was (that ended the wait)
		return c.opError()
	}
	return nil // progress is recorded as the operation ends (Comm.end)
}

// opError is the error an operation returns once the communicator aborted: this rank's
// own error as it saw it, or the abort that came from elsewhere.
func (c *Comm) opError() error {
	cause := c.Err()
	var ae *AbortError
	if errors.As(cause, &ae) && ae.Rank == c.rank {
		return ae.Err
	}
	return cause
}

// execute runs pl's steps on the transport.
func (c *Comm) execute(pl *algos.Plan, seq uint32, cl *call) error {
	if pl.Algo == Shared {
		return c.execShared(pl, cl)
	}
	es := c.execPool.Get().(*execState)
	defer c.execPool.Put(es)
	var tmp *obuf.Buf
	if pl.Tmp > 0 {
		tmp = c.pool.Get(pl.Tmp)
		defer tmp.Release()
	}
	bufs := [3][]byte{cl.send, cl.recv, nil}
	if tmp != nil {
		bufs[algos.BTmp] = tmp.Bytes()
	}
	view := func(r algos.Region) []byte { return bufs[r.Buf][r.Off : r.Off+r.N : r.Off+r.N] }
	doLocal := func(l algos.Local) {
		switch l.Kind {
		case algos.LCopy:
			copy(view(l.Dst), view(l.Src))
		case algos.LReduce:
			dtype.Reduce(cl.dt, cl.redop, view(l.Dst), view(l.Src))
		case algos.LFinish:
			dtype.Finish(cl.dt, cl.redop, view(l.Dst), c.size)
		}
	}
	tag := transport.Tag{Comm: c.id, Seq: seq, Sig: pl.Sig}
	for si := range pl.Steps {
		st := &pl.Steps[si]
		for _, l := range st.Pre {
			doLocal(l)
		}
		es.reqs, es.wants, es.xs = es.reqs[:0], es.wants[:0], es.xs[:0]
		var postErr error
		for _, x := range st.Recvs {
			tag.Tag = x.Tag
			r, err := c.tr.Irecv(c.ranks[x.Peer], tag, view(x.Region))
			if err != nil {
				postErr = err
				break
			}
			es.reqs, es.wants, es.xs = append(es.reqs, r), append(es.wants, x.N), append(es.xs, x)
			c.pend[x.Peer].Add(1)
		}
		if postErr == nil {
			for _, x := range st.Sends {
				tag.Tag = x.Tag
				r, err := c.tr.Isend(c.ranks[x.Peer], tag, view(x.Region))
				if err != nil {
					postErr = err
					break
				}
				es.reqs, es.wants, es.xs = append(es.reqs, r), append(es.wants, -1), append(es.xs, x)
				c.pend[x.Peer].Add(1)
			}
		}
		if postErr != nil {
			_ = c.fail(postErr) // aborts: the waits below end at once
		}
		for _, l := range st.Mid {
			doLocal(l)
		}
		var first error
		for i, r := range es.reqs {
			n, err := r.Wait(c.actx)
			c.pend[es.xs[i].Peer].Add(-1)
			if err == nil && es.wants[i] >= 0 && n != es.wants[i] {
				x := es.xs[i]
				err = &PeerError{Rank: c.ranks[x.Peer], Op: "recv", Err: fmt.Errorf(
					"%w: %v step %d: rank %d sent %d bytes, this rank expects %d (counts differ across ranks)",
					ErrMismatch, pl.Op, si, x.Peer, n, es.wants[i])}
			}
			if err != nil && first == nil {
				first = err
				_ = c.fail(err) // abort now so that the remaining waits end
			}
			es.reqs[i] = nil
		}
		if postErr != nil && first == nil {
			first = postErr
		}
		if first != nil {
			if c.Err() != nil {
				return c.opError()
			}
			return first
		}
		for _, l := range st.Post {
			doLocal(l)
		}
		c.dog.Progressed()
	}
	return nil
}

// verify checks, with one all-gather of the operation's signature, that every rank
// issued the same operation (Config.Verify, and the rooted operations' automatic
// check). It allocates nothing: the plan is made once, the scratch is pooled.
func (c *Comm) verify(cl *call, pl *algos.Plan, seq uint32) error {
	c.verifyOnce.Do(func() {
		// Bruck: ceil(log2 p) steps, where a ring takes p-1.
		vp := algos.PlanAllGatherBruck(algos.Shape{P: c.size, Rank: c.rank, Es: 8, Count: 1})
		vp.Sig = algos.Signature(OpAllGather, Bruck, 8, 1, -1)
		c.verifyPlan = vp
	})
	mine := int64(uint64(pl.Sig)<<32 | uint64(cl.root&0xffff)<<16 | uint64(cl.op))
	vs, _ := c.verifyScratch.Get().(*verifyScratch)
	if vs == nil {
		vs = &verifyScratch{all: make([]int64, c.size)}
	}
	defer c.verifyScratch.Put(vs)
	clear(vs.all)
	vs.all[c.rank] = mine
	vs.cl = call{op: OpAllGather, dt: dtype.I64, recv: dtype.Bytes(vs.all)}
	if err := c.execute(c.verifyPlan, seq, &vs.cl); err != nil {
		return err
	}
	for r, v := range vs.all {
		if v != mine {
			err := fmt.Errorf("%w: rank %d issued %v (signature %#x, root %d) where this rank issued %v (signature %#x, root %d)",
				ErrMismatch, r, OpKind(v&0xffff), uint64(v)>>32, int(v>>16)&0xffff, cl.op, pl.Sig, cl.root)
			return c.fail(err)
		}
	}
	return nil
}
