package dispatch

import (
	"context"
	"fmt"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
)

// The normal mode (prefill): a counts all-gather (hdrLen words of header, then a word
// per destination: rows and the choices they carry), from which every rank plans the
// same schedule, then one exact-size AlltoAllv of blocks, each a header and that many
// rows; the receiver scatters the rows into contiguous per-expert blocks. The combine
// goes back over the transposed layout: one AlltoAllv of a header and the answers to
// the rows each rank sent. Each block's header repeats the status, so that a Redispatch
// (no counts exchange) or a combine with bad input still fails every rank.

const hdrLen = 2 // status, fingerprint

type normal struct {
	unstaged
	d  *core
	ss []normalSlot
}

// normalSlot is one dispatch slot's state: the counts and the AlltoAllv.
type normalSlot struct {
	hdr, all      []int64
	rows, choices [][]int // rows[i][j] go from rank i to rank j, with choices[i][j] choices
	bytes         [][]int // the AlltoAllv's block sizes: bytes[i][j] from rank i to j
	sendOff       [][]int // where rank i's block for rank j starts in i's send buffer
	recvOff       []int   // where this rank's block from rank j starts in its receive buffer
	peer          counts  // a rank's counts, read from the matrix (layoutAll)
	peerSt        Stage   // and its stage, as the planner lays it out
	fwd           coll.VPlan
	sendS, recvS  obuf.Scratch
	send, recv    []byte
	pend          coll.Handle
	cursor        cursor
}

func (m *normal) kind() Mode    { return Normal }
func (m *normal) plan() planner { return normalPlan{} }
func (m *normal) flats() []flat { return []flat{m} }

func newNormal(d *core) *normal {
	p := d.c.Size()
	m := &normal{d: d, ss: make([]normalSlot, len(d.slots))}
	for i := range m.ss {
		ns := &m.ss[i]
		ns.hdr, ns.all = make([]int64, hdrLen+p), make([]int64, (hdrLen+p)*p)
		ns.rows, ns.choices, ns.bytes, ns.sendOff = square(p), square(p), square(p), square(p)
		ns.recvOff = make([]int, p)
		ns.sendS.Pool, ns.recvS.Pool = d.cfg.Pool, d.cfg.Pool
	}
	return m
}

func square(p int) [][]int {
	m := make([][]int, p)
	for i := range m {
		m[i] = make([]int, p)
	}
	return m
}

// layoutAll lays out, with the mode's planner, the stage (the dispatch, or with back the
// combine in format f) that every rank runs for the step's count matrix, and reads from
// it bytes[i][j] and sendOff[i][j], the size of rank i's block for rank j and where it
// starts in i's send buffer, for every rank; and, from this rank's schedule own,
// recvOff[j], where its block from rank j starts in its receive buffer. The AlltoAllv
// then moves each block from where its sender's plan put it to where its receiver's
// plan reads it: the offsets go to coll as the planner laid them out.
func (ns *normalSlot) layoutAll(d *core, back bool, f CombineFormat, own *Stage, bytes, sendOff [][]int, recvOff []int) {
	p, me := d.c.Size(), d.c.Rank()
	k := &ns.peer
	k.rowsTo, k.choicesTo = growInts(k.rowsTo, p), growInts(k.choicesTo, p)
	k.rowsFrom, k.choicesFrom = growInts(k.rowsFrom, p), growInts(k.choicesFrom, p)
	for i := 0; i < p; i++ {
		st := own
		if i != me {
			for j := 0; j < p; j++ {
				k.rowsTo[j], k.choicesTo[j] = ns.rows[i][j], ns.choices[i][j]
				k.rowsFrom[j], k.choicesFrom[j] = ns.rows[j][i], ns.choices[j][i]
			}
			st = &ns.peerSt
			if back {
				normalPlan{}.combine(st, f, i, k, d.backInPlace[Normal])
			} else {
				normalPlan{}.dispatch(st, d.f, i, k)
			}
		}
		for j := 0; j < p; j++ {
			bytes[i][j], sendOff[i][j] = st.Send[j].Bytes[0], st.Send[j].Off[0]
		}
	}
	for j := 0; j < p; j++ {
		recvOff[j] = own.Recv[j].Off[0]
	}
}

func (m *normal) bytes() int {
	n := 0
	for i := range m.ss {
		n += m.ss[i].sendS.Cap() + m.ss[i].recvS.Cap()
	}
	return n
}

func (m *normal) close() error {
	for i := range m.ss {
		ns := &m.ss[i]
		ns.send, ns.recv = nil, nil
		ns.sendS.Release()
		ns.recvS.Release()
	}
	return nil
}

func (m *normal) start(ctx context.Context, s *step) error {
	s.m = m
	d := m.d
	c := d.c
	p, me := c.Size(), c.Rank()
	ns := &m.ss[s.idx]
	ok := s.code == codeOK
	if !s.reuse {
		k := s.countsOf(p, me, ok)
		for q := 0; q < p; q++ {
			ns.hdr[hdrLen+q] = int64(k.rowsTo[q]) | int64(k.choicesTo[q])<<32
		}
		if err := agree(ctx, c, ns.hdr, ns.all, s.fp, s.code, s.inErr); err != nil {
			return err
		}
		// Each word holds the rows rank i sends rank j and the choices they carry. The
		// words come from every rank alike, so every rank fails alike on a bad one.
		w := hdrLen + p
		for i := 0; i < p; i++ {
			for j := 0; j < p; j++ {
				v := ns.all[i*w+hdrLen+j]
				n, ch := int(uint32(v)), int(uint32(v>>32))
				if n > 1<<30 || ch > n*d.cfg.TopK {
					return fmt.Errorf("%w: rank %d says it sends rank %d %d rows with %d choices", ErrMismatch, i, j, n, ch)
				}
				ns.rows[i][j], ns.choices[i][j] = n, ch
			}
		}
		for q := 0; q < p; q++ {
			k.rowsFrom[q], k.choicesFrom[q] = ns.rows[q][me], ns.choices[q][me]
		}
		d.plan(s)
		ns.layoutAll(d, false, CombineFormat{}, &s.sched.Dispatch, ns.bytes, ns.sendOff, ns.recvOff)
		if err := m.withinLimit(ns); err != nil {
			return err
		}
		if err := c.ReplanAlltoAllvAt(&ns.fwd, ns.bytes, 1, ns.sendOff, ns.recvOff); err != nil {
			return err
		}
	}
	sc := &s.sched.Dispatch
	ns.send = ns.sendS.Bytes(extent(sc.Send, 0))
	ns.recv = ns.recvS.Bytes(extent(sc.Recv, 0))
	pk := d.packer()
	if ok {
		pk.begin(s.x, s.tokens)
	}
	f := &d.f
	for q := 0; q < p; q++ {
		if q == me {
			continue
		}
		b := sc.Send[q]
		blk := ns.send[b.Off[0] : b.Off[0]+b.Bytes[0]]
		header{status: s.code, rows: b.Rows, fp: s.fp, gen: s.gen}.put(blk)
		if !ok {
			continue // the planned size (the rows as they were), the status in the header
		}
		off := blockHeader
		for _, t := range s.layout.Rows[q] {
			off += putMeta(blk[off:], s.pl, s.r, me, int(t), q)
			row := blk[off : off+f.rowTail()]
			pk.put(int(t), row[:f.Payload], dtype.FromBytes[float32](row[f.scaleAt():f.scaleAt()+f.ScaleBytes()]), false)
			off += len(row)
		}
	}
	return c.IRunAlltoAllvWith(ctx, &ns.fwd, ns.send, ns.recv, &ns.pend)
}

// agree all-gathers every rank's header (status, fingerprint, then the words the caller
// put in hdr[hdrLen:]) into all and fails, the same way on every rank, when a rank's
// configuration or placement differs or a rank's input is bad (this rank's: inErr).
func agree(ctx context.Context, c *coll.Comm, hdr, all []int64, fp uint64, code int, inErr error) error {
	p := c.Size()
	hdr[0], hdr[1] = int64(code), int64(fp)
	if err := coll.AllGather(ctx, c, hdr, all); err != nil {
		return err
	}
	w := len(hdr)
	for q := 0; q < p; q++ {
		if uint64(all[q*w+1]) != fp {
			return fmt.Errorf("%w: rank %d dispatches with another configuration or placement (fingerprint %#x, this rank's %#x)", ErrMismatch, q, uint64(all[q*w+1]), fp)
		}
	}
	if inErr != nil {
		return inErr
	}
	for q := 0; q < p; q++ {
		if cd := all[q*w]; cd != codeOK {
			return peerInput(q, int(cd))
		}
	}
	return nil
}

func (m *normal) wait(ctx context.Context, s *step) (arrived, error) {
	d := m.d
	p, me := d.c.Size(), d.c.Rank()
	ns := &m.ss[s.idx]
	if err := ns.pend.Wait(ctx); err != nil {
		return arrived{}, err
	}
	// Every block's header: a rank with bad input (Redispatch) says so in it.
	sc := &s.sched.Dispatch
	for q := 0; q < p; q++ {
		if q == me {
			continue
		}
		h := readHeader(ns.recv[sc.Recv[q].Off[0]:])
		switch {
		case h.fp != s.fp:
			return arrived{}, fmt.Errorf("%w: rank %d's rows are of another configuration or placement", ErrMismatch, q)
		case h.status != codeOK && s.inErr == nil:
			return arrived{}, peerInput(q, h.status)
		}
	}
	if s.inErr != nil {
		return arrived{}, s.inErr
	}
	s.moved = moved{algo: ns.fwd.Algo}
	return m.unpack(s, ns), nil
}

// cursor walks the rows this rank received, in order (origin rank ascending, then the
// origin's order): received ones from the blocks the schedule lays out, this rank's own
// from its stage or x. It is the normal mode's rowSource.
type cursor struct {
	d    *core
	s    *step
	recv []byte
	q, i int // origin, row index within it
	off  int // in recv
	end  int // of the block being read
}

func (ns *normalSlot) cursorOf(d *core, s *step) *cursor {
	c := &ns.cursor
	*c = cursor{d: d, s: s, recv: ns.recv, i: -1}
	return c
}

func (c *cursor) rewind() { c.q, c.i, c.off, c.end = 0, -1, 0, 0 }

func (c *cursor) next(r *inRow) (bool, error) {
	s, d := c.s, c.d
	p, me, k := d.c.Size(), d.c.Rank(), d.cfg.TopK
	pl := s.pl
	f := &d.f
	for c.q < p {
		c.i++
		b := &s.sched.Dispatch.Recv[c.q]
		if c.i == 0 && c.q != me {
			c.off, c.end = b.Off[0]+blockHeader, b.Off[0]+b.Bytes[0]
		}
		n := b.Rows
		if c.q == me {
			n = len(s.layout.Rows[me])
		}
		if c.i >= n {
			if c.q != me && c.off != c.end {
				return false, fmt.Errorf("%w: rank %d sent rows whose metadata is not what its counts said", ErrMismatch, c.q)
			}
			c.q++
			c.i = -1
			continue
		}
		r.q, r.cs, r.at = c.q, r.cs[:0], -1
		if c.q == me {
			t := int(s.layout.Rows[me][c.i])
			rt := s.r
			for j := 0; j < k; j++ {
				e := int(rt.Experts[t*k+j])
				if e >= 0 && pl.RankOf(e, me, t) == me {
					r.cs = append(r.cs, contrib{pl.LocalIndex(me, e), rt.Weights[t*k+j]})
				}
			}
			r.src = t
			r.pay, r.sca = d.pk.token(t)
			return true, nil
		}
		src, cs, mb, ok := getMeta(c.recv[c.off:c.end], k, len(pl.Local[me]), r.cs)
		if !ok || c.off+mb+f.rowTail() > c.end {
			return false, fmt.Errorf("%w: rank %d sent a row whose metadata is out of bounds", ErrMismatch, c.q)
		}
		row := c.recv[c.off+mb : c.off+mb+f.rowTail()]
		c.off += mb + len(row)
		r.src, r.cs = src, cs
		r.pay = row[:f.Payload]
		r.sca = dtype.FromBytes[float32](row[f.scaleAt() : f.scaleAt()+f.ScaleBytes()])
		return true, nil
	}
	return false, nil
}

// unpack makes the experts' view of the incoming rows: expert-major blocks (or, for
// TwoLevel's up stage, the rows in arrival order).
func (m *normal) unpack(s *step, ns *normalSlot) arrived {
	d := m.d
	if rows := s.layout.Rows[d.c.Rank()]; len(rows) > 0 {
		d.stageRows(s.x, s.tokens, rows) // the own rows are read from it
	}
	place := placeExpertMajor
	if d.arrival {
		place = placeArrival
	}
	return arrived{src: ns.cursorOf(d, s), place: place}
}

// The combine half: one AlltoAllv of blocks, each a header and the answers to the rows
// the destination sent this rank, in the order it sent them. A rank whose call is bad
// still sends every block its handle's layout calls for (header set, rows left as they
// are), so that the sizes agree and every rank learns.

type normalBack struct {
	sent
	m  *normal
	cb *backCore
	cs []normalBackSlot
}

type normalBackSlot struct {
	plan           coll.VPlan
	bytes, sendOff [][]int // as normalSlot's, for the combine
	recvOff        []int
	sendS, recvS   obuf.Scratch
	send, recv     []byte
	pend           coll.Handle
}

func (m *normal) newBack(_ context.Context, cb *backCore) (back, error) {
	b := &normalBack{m: m, cb: cb, cs: make([]normalBackSlot, len(cb.slots))}
	for i := range b.cs {
		bs := &b.cs[i]
		bs.bytes, bs.sendOff, bs.recvOff = square(m.d.c.Size()), square(m.d.c.Size()), make([]int, m.d.c.Size())
		bs.sendS.Pool, bs.recvS.Pool = m.d.cfg.Pool, m.d.cfg.Pool
	}
	return b, nil
}

func (b *normalBack) inPlace() bool { return false }

func (b *normalBack) bytes() int {
	n := 0
	for i := range b.cs {
		n += b.cs[i].sendS.Cap() + b.cs[i].recvS.Cap()
	}
	return n
}

func (b *normalBack) close() error {
	for i := range b.cs {
		bs := &b.cs[i]
		bs.send, bs.recv = nil, nil
		bs.sendS.Release()
		bs.recvS.Release()
	}
	return nil
}

func (b *normalBack) start(ctx context.Context, cs *cstep) error {
	cb := b.cb
	c := cb.d.c
	p, me := c.Size(), c.Rank()
	s := cs.d
	bs := &b.cs[cs.idx]
	ns := &b.m.ss[s.idx]
	st := &s.sched.Combine
	ns.layoutAll(cb.d, true, cb.f, st, bs.bytes, bs.sendOff, bs.recvOff)
	if err := c.ReplanAlltoAllvAt(&bs.plan, bs.bytes, 1, bs.sendOff, bs.recvOff); err != nil {
		return err
	}
	cs.algo = bs.plan.Algo
	bs.send = bs.sendS.Bytes(extent(st.Send, 0))
	bs.recv = bs.recvS.Bytes(extent(st.Recv, 0))
	for q := 0; q < p; q++ {
		if q == me {
			continue
		}
		blk := st.Send[q]
		dst := bs.send[blk.Off[0] : blk.Off[0]+blk.Bytes[0]]
		header{status: cs.code, rows: blk.Rows, fp: cs.fp, gen: cs.gen}.put(dst)
		if cs.code == codeOK {
			a, _ := s.incoming(q)
			cs.sums.put(dst[blockHeader:], cs, a, a+blk.Rows)
		}
	}
	return c.IRunAlltoAllvWith(ctx, &bs.plan, bs.send, bs.recv, &bs.pend)
}

func (b *normalBack) wait(ctx context.Context, cs *cstep) error {
	cb := b.cb
	p, me := cb.d.c.Size(), cb.d.c.Rank()
	bs := &b.cs[cs.idx]
	if err := bs.pend.Wait(ctx); err != nil {
		return err
	}
	st := &cs.d.sched.Combine
	var first error
	for q := 0; q < p; q++ {
		if q == me {
			continue
		}
		blk := st.Recv[q]
		if err := cs.checkHeader(q, bs.recv[blk.Off[0]:], blk.Rows); err != nil && first == nil {
			first = err
		}
		cs.parts[q] = bs.recv[blk.Off[0]+blockHeader : blk.Off[0]+blk.Bytes[0]]
	}
	if cs.inErr != nil {
		return cs.inErr
	}
	return first
}

// withinLimit checks, before anything is sized, that no rank's buffers for this step
// pass Config.MaxBufferBytes: its AlltoAllv's send and receive buffers (from the count
// matrix every rank holds), the rows it hands its experts, and its combiner's partial
// sums both ways. Every rank reads the same matrix, so every rank fails alike, naming
// the first rank over the limit; nothing has moved, and the communicator serves on.
func (m *normal) withinLimit(ns *normalSlot) error {
	d := m.d
	limit := d.cfg.MaxBufferBytes
	if limit <= 0 {
		return nil
	}
	p, f := d.c.Size(), &d.f
	es := d.act.Size()
	row := max(d.cfg.Hidden*es, f.Payload+f.ScaleBytes()) // a row handed to the experts
	answer := 0                                           // a partial sum or term on the way back
	if d.back != nil {
		answer = d.back.f.Row + d.back.f.TermRow
	}
	nLocal := d.cfg.MaxLocalExperts
	for i := 0; i < p; i++ {
		need := 0
		for j := 0; j < p; j++ {
			if i != j {
				need += ns.bytes[i][j] + ns.bytes[j][i]
				need += (ns.rows[i][j] + ns.rows[j][i]) * answer
			}
			need += ns.choices[j][i] * row
		}
		need += nLocal * (d.cfg.Align - 1) * row
		if need > limit {
			return &BufferLimitError{Rank: i, Need: need, Limit: limit}
		}
	}
	return nil
}
