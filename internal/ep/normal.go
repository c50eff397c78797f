package ep

import (
	"context"
	"encoding/binary"
	"fmt"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/internal/memx"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
)

// The normal mode: a counts all-gather (hdrLen words of header, then a row count per
// destination), then one AlltoAllv of blocks, each a blockHeader and that many rows.
// The block header repeats the status, so that a Redispatch (no counts exchange) with
// bad input still fails every rank.

const (
	hdrLen      = 2  // status, fingerprint
	blockHeader = 16 // status (u32), rows (u32), fingerprint (u64)
)

// slot is one in-flight or alive dispatch result and its buffers.
type slot[T Act] struct {
	d  *Dispatcher[T]
	sc *slotCore
	x  []T
	// This dispatch's input error, if any: it still takes part, then Wait returns it.
	code  int
	inErr error
	// Normal mode.
	hdr, all         []int64
	bytes            [][]int // the AlltoAllv's block sizes
	fwd              coll.VPlan
	sendS, recvS, xS obuf.Scratch
	send, recv       []byte
	pend             coll.Handle
	// Low-latency mode.
	op *coll.XOp
	// Gathered mode: every rank's routing, rows and scales, their counts, the gathers.
	gMeta, gPay, gSca []byte
	gcounts           []int
	gh                [3]coll.Handle
	// Both.
	out     Output[T]
	stats   Stats
	pending Pending[T]
}

func (s *slot[T]) release() {
	s.send, s.recv, s.out.X, s.out.Q, s.out.Scales = nil, nil, nil, nil, nil
	s.sendS.Release()
	s.recvS.Release()
	s.xS.Release()
}

// Packing encodes each token in the wire format straight into the first row it is
// written to and copies that encoding into the token's other rows: no separate
// quantisation pass, and each token is encoded once however many ranks it goes to.
// beginPack starts a pass over t tokens of x; put writes one row.

// tokLoc is where a pass put a token's encoding first.
type tokLoc struct {
	pay []byte
	sca []float32
}

func (d *Dispatcher[T]) beginPack(x []T, t int) {
	d.stX = x
	if d.f.Wire == d.act {
		return
	}
	if cap(d.loc) < t {
		d.loc = make([]tokLoc, t)
	}
	d.loc = d.loc[:t]
	clear(d.loc)
}

// put writes token t's payload into pay and its scales into sca; stream sends the
// payload past the caches (it is only copied, never encoded, that way).
func (d *Dispatcher[T]) put(t int, pay []byte, sca []float32, stream bool) {
	f := &d.f
	if f.Wire == d.act {
		hid := d.cfg.Hidden
		copyRow(pay, dtype.Bytes(d.stX[t*hid:(t+1)*hid]), stream)
		return
	}
	if l := &d.loc[t]; l.pay != nil {
		copyRow(pay, l.pay, stream)
		copy(sca, l.sca)
		return
	}
	hid := d.cfg.Hidden
	encode(f, pay, sca, dtype.Bytes(d.stX[t*hid:(t+1)*hid]), d.act, d.cfg.PowerOfTwoScales)
	d.loc[t] = tokLoc{pay, sca}
}

func copyRow(dst, src []byte, stream bool) {
	if stream {
		memx.Stream(dst, src)
	} else {
		copy(dst, src)
	}
}

// stageRows encodes the listed tokens of x (the rows that stay on this rank) into the
// stage, at their token positions, when the wire type is not the activation type;
// token then gives a staged token's payload and scales.
func (d *Dispatcher[T]) stageRows(x []T, t int, rows []int32) {
	f := &d.f
	hid := d.cfg.Hidden
	d.stX = x
	if f.Wire == d.act {
		return
	}
	d.stPer = (f.Payload + 3) &^ 3
	d.stRow = d.stPer + f.ScaleBytes()
	d.st = d.stage.Bytes(t * d.stRow)
	for _, i := range rows {
		row := d.st[int(i)*d.stRow : (int(i)+1)*d.stRow]
		encode(f, row[:f.Payload], dtype.FromBytes[float32](row[d.stPer:]), dtype.Bytes(x[int(i)*hid:(int(i)+1)*hid]), d.act, d.cfg.PowerOfTwoScales)
	}
}

// token returns staged token t's payload and scales.
func (d *Dispatcher[T]) token(t int) ([]byte, []float32) {
	if d.f.Wire == d.act {
		hid := d.cfg.Hidden
		return dtype.Bytes(d.stX[t*hid : (t+1)*hid]), nil
	}
	row := d.st[t*d.stRow : (t+1)*d.stRow]
	return row[:d.f.Payload], dtype.FromBytes[float32](row[d.stPer:])
}

func (s *slot[T]) startNormal(ctx context.Context, x []T, r *router.Routing, code int, inErr error, reuse bool) error {
	d := s.d
	sc := s.sc
	c := d.c
	p, me := c.Size(), c.Rank()
	if !reuse {
		if code == CodeOK {
			if err := router.BuildLayoutInto(&sc.layout, r, sc.pl, me); err != nil {
				code, inErr = CodeRouting, fmt.Errorf("%w: %v", ErrInput, err)
			}
		}
		for q := 0; q < p; q++ {
			s.hdr[hdrLen+q] = 0
			if code == CodeOK {
				s.hdr[hdrLen+q] = int64(len(sc.layout.Rows[q])) | int64(sc.layout.Choices[q])<<32
			}
		}
		if err := s.agree(ctx, code, inErr); err != nil {
			return err
		}
		w := hdrLen + p
		if s.bytes == nil {
			s.bytes = make([][]int, p)
			for i := range s.bytes {
				s.bytes[i] = make([]int, p)
			}
		}
		// Each word holds the rows rank i sends rank j and the choices they carry. The
		// words come from every rank alike, so every rank fails alike on a bad one.
		for i := 0; i < p; i++ {
			for j := 0; j < p; j++ {
				v := s.all[i*w+hdrLen+j]
				n, m := int(uint32(v)), int(uint32(v>>32))
				if n > 1<<30 || m > n*d.cfg.TopK {
					return fmt.Errorf("%w: rank %d says it sends rank %d %d rows with %d choices", ErrMismatch, i, j, n, m)
				}
				sc.matrix[i][j], sc.back[j][i], sc.backTerms[j][i], s.bytes[i][j] = n, n, m, normalBlock(d.f, n, m)
				if i == j {
					sc.back[j][i], sc.backTerms[j][i], s.bytes[i][j] = 0, 0, 0
				}
			}
		}
		if err := c.ReplanAlltoAllv(&s.fwd, s.bytes, 1); err != nil {
			return err
		}
		sc.tokens, sc.r = r.T, r
	}
	s.x, s.code, s.inErr = x, code, inErr
	s.send = s.sendS.Bytes(s.fwd.SendBytes())
	s.recv = s.recvS.Bytes(s.fwd.RecvBytes())
	if code == CodeOK {
		d.beginPack(x, sc.tokens)
	}
	f := &d.f
	off := 0
	st := &s.stats
	st.RowsSent, st.Assignments = 0, sc.layout.Assignments
	for q := 0; q < p; q++ {
		if q == me {
			continue
		}
		var rows []int32
		if code == CodeOK {
			rows = sc.layout.Rows[q]
		}
		start := off
		h := s.send[off : off+blockHeader]
		binary.LittleEndian.PutUint32(h[0:], uint32(code))
		binary.LittleEndian.PutUint32(h[4:], uint32(len(rows)))
		binary.LittleEndian.PutUint64(h[8:], sc.fp)
		off += blockHeader
		for _, t := range rows {
			off += d.putMeta(s.send[off:], sc.pl, sc.r, int(t), q)
			row := s.send[off : off+f.rowTail()]
			d.put(int(t), row[:f.Payload], dtype.FromBytes[float32](row[f.scaleAt():f.scaleAt()+f.ScaleBytes()]), false)
			off += len(row)
		}
		off = start + s.bytes[me][q] // the planned size (the same unless the input is bad)
		st.RowsSent += len(rows)
	}
	return c.IRunAlltoAllvWith(ctx, &s.fwd, s.send, s.recv, &s.pend)
}

// agree all-gathers every rank's header (status, fingerprint, then the words the caller
// put in s.hdr[hdrLen:]) into s.all and fails, the same way on every rank, when a rank's
// configuration or placement differs or a rank's input is bad (this rank's: inErr).
func (s *slot[T]) agree(ctx context.Context, code int, inErr error) error {
	d := s.d
	p := d.c.Size()
	fp := s.sc.fp
	s.hdr[0], s.hdr[1] = int64(code), int64(fp)
	if err := coll.AllGather(ctx, d.c, s.hdr, s.all); err != nil {
		return err
	}
	w := hdrLen + p
	for q := 0; q < p; q++ {
		if uint64(s.all[q*w+1]) != fp {
			return fmt.Errorf("%w: rank %d dispatches with another configuration or placement (fingerprint %#x, this rank's %#x)", ErrMismatch, q, uint64(s.all[q*w+1]), fp)
		}
	}
	if inErr != nil {
		return inErr
	}
	for q := 0; q < p; q++ {
		if cd := s.all[q*w]; cd != CodeOK {
			return &PeerInputError{Rank: q, Code: int(cd)}
		}
	}
	return nil
}

func (s *slot[T]) waitNormal(ctx context.Context) error {
	d := s.d
	c := d.c
	p, me := c.Size(), c.Rank()
	if err := s.pend.Wait(ctx); err != nil {
		return err
	}
	// Every block's header: a rank with bad input (Redispatch) says so in it.
	off := 0
	for q := 0; q < p; q++ {
		if q == me {
			continue
		}
		hb := s.recv[off : off+blockHeader]
		switch {
		case binary.LittleEndian.Uint64(hb[8:]) != s.sc.fp:
			return fmt.Errorf("%w: rank %d's rows are of another configuration or placement", ErrMismatch, q)
		case binary.LittleEndian.Uint32(hb[0:]) != CodeOK && s.inErr == nil:
			return &PeerInputError{Rank: q, Code: int(binary.LittleEndian.Uint32(hb[0:]))}
		}
		off += s.bytes[q][me]
	}
	if s.inErr != nil {
		return s.inErr
	}
	st := &s.stats
	st.BytesSent, st.BytesReceived = s.fwd.SendBytes(), s.fwd.RecvBytes()
	st.RowsReceived, st.Pushed = 0, 0
	st.RowsPerRank = growInts(st.RowsPerRank, p)
	for q := 0; q < p; q++ {
		if q != me {
			st.RowsReceived += s.sc.matrix[q][me]
		}
		st.RowsPerRank[q] = len(s.sc.layout.Rows[q])
	}
	st.Algo = s.fwd.Algo
	if err := s.unpackNormal(); err != nil {
		return err
	}
	d.stats = *st
	return nil
}

// cursor walks the rows this rank received, in order (origin rank ascending, then the
// origin's order): received ones from the blocks, this rank's own from its stage or x.
type cursor[T Act] struct {
	s    *slot[T]
	q, i int // origin, row index within it
	off  int // in recv
	end  int // of the block being read
	src  int
	cs   []contrib
	pay  []byte
	sca  []float32
	bad  bool // a row whose metadata is out of bounds
}

func (s *slot[T]) cursor() cursor[T] {
	return cursor[T]{s: s, i: -1, cs: s.d.cs[:0]}
}

// next advances to the next incoming row; false at the end (or at a bad row: c.bad).
func (c *cursor[T]) next() bool {
	s := c.s
	d := s.d
	sc := s.sc
	p, me, k := d.c.Size(), d.c.Rank(), d.cfg.TopK
	pl := s.sc.pl
	f := &d.f
	for c.q < p {
		c.i++
		if c.i == 0 && c.q != me {
			c.end = c.off + s.bytes[c.q][me]
			c.off += blockHeader // every block has one, rows or not
		}
		n := sc.matrix[c.q][me]
		if c.q == me {
			n = len(sc.layout.Rows[me])
		}
		if c.i >= n {
			if c.q != me && c.off != c.end {
				c.bad = true // the rows' metadata is not what the counts said
				return false
			}
			c.q++
			c.i = -1
			continue
		}
		c.cs = c.cs[:0]
		if c.q == me {
			t := int(sc.layout.Rows[me][c.i])
			rt := sc.r
			for j := 0; j < k; j++ {
				e := int(rt.Experts[t*k+j])
				if e >= 0 && pl.RankOf(e, me, t) == me {
					c.cs = append(c.cs, contrib{pl.LocalIndex(me, e), rt.Weights[t*k+j]})
				}
			}
			c.src = t
			c.pay, c.sca = d.token(t)
			return true
		}
		var ok bool
		var mb int
		c.src, c.cs, mb, ok = getMeta(s.recv[c.off:c.end], k, len(pl.Local[me]), c.cs)
		if !ok || c.off+mb+f.rowTail() > c.end {
			c.bad = true
			return false
		}
		row := s.recv[c.off+mb : c.off+mb+f.rowTail()]
		c.off += mb + len(row)
		c.pay = row[:f.Payload]
		c.sca = dtype.FromBytes[float32](row[f.scaleAt() : f.scaleAt()+f.ScaleBytes()])
		return true
	}
	return false
}

// unpackNormal scatters the incoming rows into expert-major blocks and records the
// handle's maps.
func (s *slot[T]) unpackNormal() error {
	d := s.d
	sc := s.sc
	p, me, hid := d.c.Size(), d.c.Rank(), d.cfg.Hidden
	pl := s.sc.pl
	f := &d.f
	nLocal := len(pl.Local[me])
	o := &s.out
	o.hidden, o.ExpertMajor, o.format = hid, true, f
	if cap(d.cs) < d.cfg.TopK {
		d.cs = make([]contrib, 0, d.cfg.TopK)
	}
	if len(sc.layout.Rows[me]) > 0 {
		d.stageRows(s.x, sc.tokens, sc.layout.Rows[me]) // the own rows are read from it
	}
	// Pass 1: rows per local expert.
	o.Counts = growInts(o.Counts, nLocal)
	clear(o.Counts)
	o.Offsets = growInts(o.Offsets, nLocal+1)
	incomingRows, contribs := 0, 0
	c := s.cursor()
	for c.next() {
		incomingRows++
		contribs += len(c.cs)
		for _, x := range c.cs {
			o.Counts[x.le]++
		}
	}
	if c.bad {
		return fmt.Errorf("%w: rank %d sent a row whose metadata is out of bounds", ErrMismatch, c.q)
	}
	total := layoutEntries(o, d.cfg.Align)
	s.allocEntries(total, incomingRows, contribs)
	if d.arrival {
		o.ExpertMajor = false
		o.X, o.Q, o.Scales = dtype.FromBytes[T](s.xS.Bytes(incomingRows*hid*int(sizeOf[T]()))), nil, nil
	} else if d.cfg.Quantized {
		qb := s.xS.Bytes(total * (f.Payload + f.ScaleBytes()))
		o.X, o.Q, o.Scales = nil, qb[:total*f.Payload], dtype.FromBytes[float32](qb[total*f.Payload:])
	} else {
		o.X, o.Q, o.Scales = dtype.FromBytes[T](s.xS.Bytes(total*hid*int(sizeOf[T]()))), nil, nil
	}
	s.padEntries(!d.arrival)
	// Pass 2: scatter.
	fill := d.fillScratch(nLocal)
	row, ci := 0, 0
	lastOrigin := -1
	for c := s.cursor(); c.next(); {
		for lastOrigin < c.q {
			lastOrigin++
			sc.originStart[lastOrigin] = row
		}
		sc.start[row] = int32(ci)
		if d.arrival {
			decode(f, dtype.Bytes(o.X[row*hid:(row+1)*hid]), d.act, c.pay, c.sca)
		}
		for _, x := range c.cs {
			dst := o.Offsets[x.le] + fill[x.le]
			fill[x.le]++
			switch {
			case d.arrival:
				o.Row[dst] = int32(row)
			case d.cfg.Quantized:
				copy(o.Q[dst*f.Payload:(dst+1)*f.Payload], c.pay)
				copy(o.Scales[dst*f.Scales:(dst+1)*f.Scales], c.sca)
				o.Row[dst] = int32(dst)
			default:
				decode(f, dtype.Bytes(o.X[dst*hid:(dst+1)*hid]), d.act, c.pay, c.sca)
				o.Row[dst] = int32(dst)
			}
			o.Origin[dst], o.Source[dst], o.Weight[dst] = int32(c.q), int32(c.src), x.w
			o.Expert[dst] = int32(pl.Local[me][x.le])
			sc.entries[ci], sc.weights[ci] = int32(dst), x.w
			ci++
		}
		row++
	}
	for lastOrigin < p {
		lastOrigin++
		sc.originStart[lastOrigin] = row
	}
	sc.start[row] = int32(ci)
	return nil
}

// layoutEntries sets the view's offsets from its counts (each block padded to align)
// and returns the number of entries.
func layoutEntries[T Act](o *Output[T], align int) int {
	total := 0
	for i, c := range o.Counts {
		o.Offsets[i] = total
		total += (c + align - 1) / align * align
	}
	o.Offsets[len(o.Counts)] = total
	return total
}

// allocEntries sizes the view and the handle's maps.
func (s *slot[T]) allocEntries(total, incomingRows, contribs int) {
	o := &s.out
	sc := s.sc
	o.Row = growI32(o.Row, total)
	o.Origin = growI32(o.Origin, total)
	o.Source = growI32(o.Source, total)
	o.Weight = growF32(o.Weight, total)
	o.Expert = growI32(o.Expert, total)
	sc.originStart = growInts(sc.originStart, s.d.c.Size()+1)
	sc.start = growI32(sc.start, incomingRows+1)
	sc.entries = growI32(sc.entries, contribs)
	sc.weights = growF32(sc.weights, contribs)
	sc.rowsOut = total
}

// padEntries marks the padding entries, zeroing their rows when the rows are
// expert-major (zero).
func (s *slot[T]) padEntries(zero bool) {
	o := &s.out
	d := s.d
	hid := d.cfg.Hidden
	local := s.sc.pl.Local[d.c.Rank()]
	for i, c := range o.Counts {
		for j := o.Offsets[i] + c; j < o.Offsets[i+1]; j++ {
			if zero {
				if o.X != nil {
					clear(o.X[j*hid : (j+1)*hid])
				} else {
					clear(o.Q[j*d.f.Payload : (j+1)*d.f.Payload])
					clear(o.Scales[j*d.f.Scales : (j+1)*d.f.Scales])
				}
			}
			o.Row[j], o.Origin[j], o.Source[j], o.Weight[j], o.Expert[j] = -1, -1, -1, 0, int32(local[i])
		}
	}
}

// fillScratch returns a zeroed counter per local expert.
func (d *Dispatcher[T]) fillScratch(n int) []int {
	d.fill = growInts(d.fill, n)
	clear(d.fill)
	return d.fill
}

func sizeOf[T Act]() uintptr {
	switch actType[T]() {
	case dtype.F32:
		return 4
	case dtype.BF16:
		return 2
	}
	return 1
}
