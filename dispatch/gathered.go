package dispatch

import (
	"context"
	"encoding/binary"
	"fmt"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
)

// The gathered mode (data-parallel attention with expert parallelism, vLLM's AgRs): a
// small all-gather of every rank's status and token count, then three AllGathervs issued
// together: every token's routing (GatheredMeta bytes: its index, its choices and their
// weights), its row, its scales. Every rank then sees every token, and its experts take
// the ones that chose them. The combine: every rank sums its experts' outputs for every
// token (zeros for the tokens none of its experts took) and one ReduceScatterv, in the
// partial sums' type, brings each rank the sum of its own tokens' rows, summed in the
// reduce-scatter's order; a small all-gather of every rank's status beside it makes a
// rank whose call is bad (it sends zeros) fail every rank in the same call. Every token
// crosses to every rank: the mode trades bytes for the simplest exchange.

type gathered struct {
	unstaged
	d    *core
	ss   []gatheredSlot
	rows gatheredRows // the view's rowSource
}

type gatheredSlot struct {
	hdr, all     []int64
	sendS, recvS obuf.Scratch
	field        [3][]byte // every rank's routing, rows and scales
	counts       []int
	gh           [3]coll.Handle
}

func (m *gathered) kind() Mode    { return Gathered }
func (m *gathered) plan() planner { return gatheredPlan{} }
func (m *gathered) flats() []flat { return []flat{m} }

func newGathered(d *core) *gathered {
	p := d.c.Size()
	m := &gathered{d: d, ss: make([]gatheredSlot, len(d.slots))}
	for i := range m.ss {
		gs := &m.ss[i]
		gs.hdr, gs.all = make([]int64, hdrLen+p), make([]int64, (hdrLen+p)*p)
		gs.sendS.Pool, gs.recvS.Pool = d.cfg.Pool, d.cfg.Pool
	}
	return m
}

func (m *gathered) bytes() int {
	n := 0
	for i := range m.ss {
		n += m.ss[i].sendS.Cap() + m.ss[i].recvS.Cap()
	}
	return n
}

func (m *gathered) close() error {
	for i := range m.ss {
		gs := &m.ss[i]
		gs.field = [3][]byte{}
		gs.sendS.Release()
		gs.recvS.Release()
	}
	return nil
}

func (m *gathered) start(ctx context.Context, s *step) error {
	s.m = m
	d := m.d
	c := d.c
	p, me := c.Size(), c.Rank()
	f := &d.f
	gs := &m.ss[s.idx]
	ok := s.code == codeOK
	k := s.countsOf(p, me, ok)
	clear(gs.hdr[hdrLen:])
	gs.hdr[hdrLen] = int64(k.tokens[me])
	if err := agree(ctx, c, gs.hdr, gs.all, s.fp, s.code, s.inErr); err != nil {
		return err
	}
	w := hdrLen + p
	for q := 0; q < p; q++ {
		n := int(gs.all[q*w+hdrLen])
		if n < 0 || n > 1<<24 {
			return fmt.Errorf("%w: rank %d says it has %d tokens", ErrMismatch, q, n)
		}
		k.tokens[q] = n
	}
	d.plan(s)
	// This rank's routing, rows and scales, each packed; then every rank's.
	sc := &s.sched.Dispatch
	own := sc.Send[me]
	t, r := s.tokens, s.r
	buf := gs.sendS.Bytes(own.Total())
	meta, pay, sca := buf[:own.Bytes[0]], buf[own.Bytes[0]:own.Bytes[0]+own.Bytes[1]], buf[own.Bytes[0]+own.Bytes[1]:]
	gm, sb := f.GatheredMeta(), f.ScaleBytes()
	for i := 0; i < t; i++ {
		mt := meta[i*gm : (i+1)*gm]
		binary.LittleEndian.PutUint32(mt[0:], uint32(i))
		binary.LittleEndian.PutUint32(mt[4:], uint32(r.K))
		for j := 0; j < r.K; j++ {
			binary.LittleEndian.PutUint32(mt[8+8*j:], uint32(r.Experts[i*r.K+j]))
			putF32(mt[12+8*j:], r.Weights[i*r.K+j])
		}
	}
	if f.Wire == d.act {
		pay = s.x // no copy: the rows are gathered from x itself
	} else {
		pk := d.packer()
		pk.x = s.x
		for i := 0; i < t; i++ {
			pk.encodeRow(i, pay[i*f.Payload:(i+1)*f.Payload], dtype.FromBytes[float32](sca[i*sb:(i+1)*sb]))
		}
	}
	all := gs.recvS.Bytes(extent(sc.Recv, 0) + extent(sc.Recv, 1) + extent(sc.Recv, 2))
	n0, n1 := extent(sc.Recv, 0), extent(sc.Recv, 1)
	gs.field = [3][]byte{all[:n0], all[n0 : n0+n1], all[n0+n1:]}
	gs.counts = growInts(gs.counts, p)
	for fi, send := range [3][]byte{meta, pay, sca} {
		for q := range gs.counts {
			gs.counts[q] = sc.Recv[q].Bytes[fi]
		}
		if err := coll.IAllGathervWith(ctx, c, send, gs.field[fi], gs.counts, nil, &gs.gh[fi]); err != nil {
			return err
		}
	}
	return nil
}

func (m *gathered) wait(ctx context.Context, s *step) (arrived, error) {
	gs := &m.ss[s.idx]
	var first error
	for k := range gs.gh {
		if err := gs.gh[k].Wait(ctx); err != nil && first == nil {
			first = err
		}
	}
	if first != nil {
		return arrived{}, first
	}
	return m.view(s, gs), nil
}

// view builds the experts' view over every rank's tokens (in rank order, then each
// rank's token order), where they arrived: an entry per choice of a local expert.
func (m *gathered) view(s *step, gs *gatheredSlot) arrived {
	src := &m.rows
	*src = gatheredRows{d: m.d, s: s, meta: gs.field[0], pay: gs.field[1], sca: dtype.FromBytes[float32](gs.field[2]), i: -1}
	rows := len(gs.field[0]) / m.d.f.GatheredMeta()
	return arrived{src: src, place: placeRegion, rg: region{pay: gs.field[1], sca: gs.field[2], rows: rows}}
}

// gatheredRows walks every rank's tokens as they were all-gathered, checking the routing
// that came with them: the gathered mode's rowSource. A token whose choices are all
// another rank's is a row with no entries.
type gatheredRows struct {
	d        *core
	s        *step
	meta     []byte    // each token's index and routing
	pay      []byte    // and its payload
	sca      []float32 // and scales
	q, i, at int
}

func (w *gatheredRows) rewind() { w.q, w.i, w.at = 0, -1, 0 }

func (w *gatheredRows) next(r *inRow) (bool, error) {
	s, d := w.s, w.d
	p, me, k, f := d.c.Size(), d.c.Rank(), d.cfg.TopK, &d.f
	pl, gm := s.pl, f.GatheredMeta()
	for w.q < p {
		if w.i++; w.i >= s.k.tokens[w.q] {
			w.q, w.i = w.q+1, -1
			continue
		}
		g := w.at
		w.at++
		mt := w.meta[g*gm : (g+1)*gm]
		if int(binary.LittleEndian.Uint32(mt[0:])) != w.i || int(binary.LittleEndian.Uint32(mt[4:])) != k {
			return false, fmt.Errorf("%w: rank %d's token %d came with bad routing", ErrMismatch, w.q, w.i)
		}
		r.q, r.src, r.at, r.cs = w.q, w.i, g, r.cs[:0]
		for j := 0; j < k; j++ {
			e := int(int32(binary.LittleEndian.Uint32(mt[8+8*j:])))
			if e < -1 || e >= pl.Experts {
				return false, fmt.Errorf("%w: rank %d's token %d chose expert %d of %d", ErrMismatch, w.q, w.i, e, pl.Experts)
			}
			if e >= 0 && pl.RankOf(e, w.q, w.i) == me {
				r.cs = append(r.cs, contrib{pl.LocalIndex(me, e), getF32(mt[12+8*j:])})
			}
		}
		r.pay = w.pay[g*f.Payload : (g+1)*f.Payload]
		r.sca = w.sca[g*f.Scales : (g+1)*f.Scales]
		return true, nil
	}
	return false, nil
}

// The combine half: the partial sums of every token, one ReduceScatterv, and every
// rank's status beside it.

type gatheredBack struct {
	m  *gathered
	cb *backCore
	cs []gatheredBackSlot
}

type gatheredBackSlot struct {
	sendS, recvS obuf.Scratch
	counts       []int
	st           [3]int64
	stAll        []int64
	sh, pend     coll.Handle
	sum          []byte // the reduce-scatter's result, in the partial sums' type
}

func (m *gathered) newBack(_ context.Context, cb *backCore) (back, error) {
	b := &gatheredBack{m: m, cb: cb, cs: make([]gatheredBackSlot, len(cb.slots))}
	for i := range b.cs {
		b.cs[i].sendS.Pool, b.cs[i].recvS.Pool = m.d.cfg.Pool, m.d.cfg.Pool
	}
	return b, nil
}

func (b *gatheredBack) inPlace() bool             { return false }
func (b *gatheredBack) buffer(*dispatched) []byte { return nil }

// takesRows: the reduce-scatter adds a partial sum per token, not per incoming row.
func (b *gatheredBack) takesRows() bool { return false }

func (b *gatheredBack) bytes() int {
	n := 0
	for i := range b.cs {
		n += b.cs[i].sendS.Cap() + b.cs[i].recvS.Cap()
	}
	return n
}

func (b *gatheredBack) close() error {
	for i := range b.cs {
		b.cs[i].sum = nil
		b.cs[i].sendS.Release()
		b.cs[i].recvS.Release()
	}
	return nil
}

func (b *gatheredBack) start(ctx context.Context, cs *cstep) error {
	cb := b.cb
	c := cb.d.c
	p, me := c.Size(), c.Rank()
	s := cs.d
	bs := &b.cs[cs.idx]
	st := &s.sched.Combine
	part := bs.sendS.Bytes(extent(st.Send, 0))
	if cs.code == codeOK {
		cs.sums.put(part, cs, 0, s.incomingRows())
	} else {
		clear(part)
	}
	bs.st[0], bs.st[1], bs.st[2] = int64(cs.code), int64(cs.fp), int64(cs.gen)
	bs.stAll = growI64(bs.stAll, 3*p)
	if err := coll.IAllGatherWith(ctx, c, bs.st[:], bs.stAll, &bs.sh); err != nil {
		return err
	}
	bs.counts = growInts(bs.counts, p)
	es := cb.f.Partial.Size()
	for q := range bs.counts {
		bs.counts[q] = st.Send[q].Bytes[0] / es
	}
	bs.sum = cs.out // the sum in place where it is of the outputs' type
	if cb.f.Partial != cb.out || cs.code != codeOK {
		bs.sum = bs.recvS.Bytes(st.Recv[me].Bytes[0])
	}
	if cb.f.Partial == dtype.F32 {
		return coll.IReduceScattervWith(ctx, c, dtype.FromBytes[float32](part), dtype.FromBytes[float32](bs.sum), bs.counts, dtype.Sum, &bs.pend)
	}
	return coll.IReduceScattervWith(ctx, c, dtype.FromBytes[dtype.BFloat16](part), dtype.FromBytes[dtype.BFloat16](bs.sum), bs.counts, dtype.Sum, &bs.pend)
}

func (b *gatheredBack) wait(ctx context.Context, cs *cstep) error {
	bs := &b.cs[cs.idx]
	err := bs.pend.Wait(ctx)
	if e := bs.sh.Wait(ctx); err == nil {
		err = e
	}
	if err != nil {
		return err
	}
	if cs.inErr != nil {
		return cs.inErr
	}
	for q := 0; q < b.cb.d.c.Size(); q++ {
		code, fp, gen := bs.stAll[3*q], uint64(bs.stAll[3*q+1]), uint64(bs.stAll[3*q+2])
		switch {
		case fp != cs.fp:
			return fmt.Errorf("%w: rank %d combines the dispatches of another configuration or placement", ErrMismatch, q)
		case code != codeOK:
			return peerInput(q, int(code))
		case gen != cs.gen:
			return fmt.Errorf("%w: rank %d combines dispatch %d, this rank dispatch %d", ErrMismatch, q, gen, cs.gen)
		}
	}
	cs.parts[b.cb.d.c.Rank()] = bs.sum
	return nil
}

// gatheredSums: the partial sums of every incoming row (every rank's tokens), and the
// reduce-scatter's sum of this rank's tokens into out.
type gatheredSums[T Out] struct{ *partialSums[T] }

func newGatheredSums[T Out](cb *backCore) gatheredSums[T] {
	return gatheredSums[T]{newPartialSums[T](cb)}
}

func (gs gatheredSums[T]) own(*cstep) {}

// finish puts the sum, which arrived in the partial sums' type, into out.
func (gs gatheredSums[T]) finish(cs *cstep) error {
	sum := cs.parts[gs.cb.d.c.Rank()]
	switch {
	case gs.cb.f.Partial == outType[T]():
		if len(sum) > 0 && &sum[0] != &cs.out[0] {
			copy(cs.out, sum)
		}
	case isF32[T](): // bf16 sums
		dtype.BF16ToF32(dtype.FromBytes[float32](cs.out), dtype.FromBytes[dtype.BFloat16](sum))
	default: // f32 sums
		dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](cs.out), dtype.FromBytes[float32](sum))
	}
	return nil
}
