package coll

import (
	"context"
	"errors"
	"fmt"
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
// Smaller rooted operations do not verify: their send-only ranks see a peer's failure on
// their next operation.
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

// getPlan returns the cached plan for the call, computing it on first use.
func (c *Comm) getPlan(k planKey) *plan {
	c.planMu.Lock()
	pl, ok := c.plans[k]
	c.planMu.Unlock()
	if ok {
		return pl
	}
	sh := shape{p: c.size, rank: c.rank, root: k.root, es: k.es, count: k.count}
	e := entryOf(k.op, k.algo)
	if e == nil {
		panic(fmt.Sprintf("coll: no planner for %v", k.op))
	}
	pl = e.plan(sh, c.topo, k)
	pl.sig = signature(k.op, pl.algo, k.es, k.count, k.root, int(k.dt), int(k.redop))
	pl.countBytes()
	if pl.algo == Shared {
		pl.bytes = (c.size - 1) * k.count * k.es
		if k.op == OpAllReduce { // as the ring: a block to every rank, twice
			pl.bytes = 2 * pl.bytes / c.size
		}
	}
	c.planMu.Lock()
	c.plans[k] = pl
	c.planMu.Unlock()
	if c.log.Enabled(context.Background(), slog.LevelInfo) {
		c.log.Info("moex: algorithm", "comm", c.id, "rank", c.rank, "op", k.op.String(), "algo", pl.algo.String(),
			"ranks", c.size, "bytes", k.count*k.es, "steps", len(pl.steps), "override", c.cfg.Algo[k.op] != AlgoAuto)
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
func (c *Comm) execShared(pl *plan, cl *call) error {
	var err error
	switch {
	case pl.op == OpAllReduce: // in place in recv
		if err = c.direct.AllReduce(c.actx, cl.turn, cl.recv, cl.recv, cl.dt.Size(), pl.reduce, uint64(pl.sig)); err == nil {
			dtype.Finish(cl.dt, cl.redop, cl.recv, c.size)
		}
	case pl.op == OpReduceScatter:
		if err = c.direct.ReduceScatter(c.actx, cl.turn, cl.send, cl.recv, pl.reduce, uint64(pl.sig)); err == nil {
			dtype.Finish(cl.dt, cl.redop, cl.recv, c.size)
		}
	case pl.op == OpAllGather || pl.op == OpAllGatherv: // this rank's block is in place in recv
		off, b := pl.shared.RecvOff[c.rank], pl.shared.SrcLen[c.rank]
		err = c.direct.AllToAllv(c.actx, cl.turn, cl.recv[off:off+b], cl.recv, pl.shared, uint64(pl.sig))
	case pl.shared != nil:
		err = c.direct.AllToAllv(c.actx, cl.turn, cl.send, cl.recv, pl.shared, uint64(pl.sig))
	default:
		err = c.direct.AllToAll(c.actx, cl.turn, cl.send, cl.recv, uint64(pl.sig))
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
func (c *Comm) execute(pl *plan, seq uint32, cl *call) error {
	if pl.algo == Shared {
		return c.execShared(pl, cl)
	}
	es := c.execPool.Get().(*execState)
	defer c.execPool.Put(es)
	var tmp *obuf.Buf
	if pl.tmp > 0 {
		tmp = c.pool.Get(pl.tmp)
		defer tmp.Release()
	}
	bufs := [3][]byte{cl.send, cl.recv, nil}
	if tmp != nil {
		bufs[bTmp] = tmp.Bytes()
	}
	view := func(r region) []byte { return bufs[r.buf][r.off : r.off+r.n : r.off+r.n] }
	doLocal := func(l local) {
		switch l.kind {
		case lCopy:
			copy(view(l.dst), view(l.src))
		case lReduce:
			dtype.Reduce(cl.dt, cl.redop, view(l.dst), view(l.src))
		case lFinish:
			dtype.Finish(cl.dt, cl.redop, view(l.dst), c.size)
		}
	}
	tag := transport.Tag{Comm: c.id, Seq: seq, Sig: pl.sig}
	for si := range pl.steps {
		st := &pl.steps[si]
		for _, l := range st.pre {
			doLocal(l)
		}
		es.reqs, es.wants, es.xs = es.reqs[:0], es.wants[:0], es.xs[:0]
		var postErr error
		for _, x := range st.recvs {
			tag.Tag = x.tag
			r, err := c.tr.Irecv(c.ranks[x.peer], tag, view(x.region))
			if err != nil {
				postErr = err
				break
			}
			es.reqs, es.wants, es.xs = append(es.reqs, r), append(es.wants, x.n), append(es.xs, x)
			c.pend[x.peer].Add(1)
		}
		if postErr == nil {
			for _, x := range st.sends {
				tag.Tag = x.tag
				r, err := c.tr.Isend(c.ranks[x.peer], tag, view(x.region))
				if err != nil {
					postErr = err
					break
				}
				es.reqs, es.wants, es.xs = append(es.reqs, r), append(es.wants, -1), append(es.xs, x)
				c.pend[x.peer].Add(1)
			}
		}
		if postErr != nil {
			_ = c.fail(postErr) // aborts: the waits below end at once
		}
		for _, l := range st.mid {
			doLocal(l)
		}
		var first error
		for i, r := range es.reqs {
			n, err := r.Wait(c.actx)
			c.pend[es.xs[i].peer].Add(-1)
			if err == nil && es.wants[i] >= 0 && n != es.wants[i] {
				x := es.xs[i]
				err = &PeerError{Rank: c.ranks[x.peer], Op: "recv", Err: fmt.Errorf(
					"%w: %v step %d: rank %d sent %d bytes, this rank expects %d (counts differ across ranks)",
					ErrMismatch, pl.op, si, x.peer, n, es.wants[i])}
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
		for _, l := range st.post {
			doLocal(l)
		}
		c.progress.Store(nanotime())
	}
	return nil
}

// verify checks, with one all-gather of the operation's signature, that every rank
// issued the same operation (Config.Verify, and the rooted operations' automatic
// check). It allocates nothing: the plan is made once, the scratch is pooled.
func (c *Comm) verify(cl *call, pl *plan, seq uint32) error {
	c.verifyOnce.Do(func() {
		// Bruck: ceil(log2 p) steps, where a ring takes p-1.
		vp := planAllGatherBruck(shape{p: c.size, rank: c.rank, es: 8, count: 1})
		vp.sig = signature(OpAllGather, Bruck, 8, 1, -1)
		c.verifyPlan = vp
	})
	mine := int64(uint64(pl.sig)<<32 | uint64(cl.root&0xffff)<<16 | uint64(cl.op))
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
				ErrMismatch, r, OpKind(v&0xffff), uint64(v)>>32, int(v>>16)&0xffff, cl.op, pl.sig, cl.root)
			return c.fail(err)
		}
	}
	return nil
}
