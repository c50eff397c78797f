package ep

import (
	"context"
	"encoding/binary"
	"fmt"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/router"
)

// The low-latency mode: one coll.Exchange per dispatch, three fields per block: a
// BlockHeader and the rows' metadata; the rows' payloads; their scales (fp8, int8).
// Every rank sends every rank a block, a header-only one when it has no rows for it or
// its input is bad, so the counts and the status travel with the rows and nobody waits
// for a rank that gave up.

// BlockHeader is the size of the header that starts every block of a low-latency
// dispatch and of every combine: status (u32), rows (u32), fingerprint (u64), the
// dispatch's generation (u64), reserved (u64).
const BlockHeader = 32

// PutHeader writes a block header.
func PutHeader(b []byte, status, rows int, fp, gen uint64) {
	binary.LittleEndian.PutUint32(b[0:], uint32(status))
	binary.LittleEndian.PutUint32(b[4:], uint32(rows))
	binary.LittleEndian.PutUint64(b[8:], fp)
	binary.LittleEndian.PutUint64(b[16:], gen)
	binary.LittleEndian.PutUint64(b[24:], 0)
}

// ReadHeader reads a block header.
func ReadHeader(b []byte) (status, rows int, fp, gen uint64) {
	return int(binary.LittleEndian.Uint32(b[0:])), int(binary.LittleEndian.Uint32(b[4:])),
		binary.LittleEndian.Uint64(b[8:]), binary.LittleEndian.Uint64(b[16:])
}

func (s *slot[T]) startLL(ctx context.Context, x []T, r *router.Routing, code int, inErr error, reuse bool) error {
	d := s.d
	sc := s.sc
	me := d.c.Rank()
	if !reuse && code == CodeOK {
		if err := router.BuildLayoutInto(&sc.layout, r, sc.pl, me); err != nil {
			code, inErr = CodeRouting, fmt.Errorf("%w: %v", ErrInput, err)
		} else {
			sc.tokens, sc.r = r.T, r
		}
	}
	s.x, s.code, s.inErr = x, code, inErr
	// In place: this rank's tokens go once into its staging, where the experts read
	// them, if no rank still reads what it last wrote there.
	inPlace := d.rowsPer > 0 && sc.stageFree && code == CodeOK
	if inPlace {
		sc.stageFree = false
		d.stageTokens(x, sc)
	} else if code == CodeOK {
		d.beginPack(x, sc.tokens)
	}
	op, err := d.x.Begin(ctx)
	if err != nil {
		return err
	}
	s.op = op
	f := &d.f
	sb := f.ScaleBytes()
	st := &s.stats
	st.RowsSent, st.BytesSent, st.Pushed, st.Assignments, st.InPlace = 0, 0, 0, 0, inPlace
	if code == CodeOK {
		st.Assignments = sc.layout.Assignments
	}
	// Rows written into other ranks' memory, which they read only once all have
	// arrived, go past the caches (non-temporal stores) when the exchange touches more
	// than the last-level cache holds: each line would go to memory anyway.
	stream := false
	if code == CodeOK && d.llc > 0 && !inPlace {
		sent := 0
		for q, rows := range sc.layout.Rows {
			if q != me {
				sent += len(rows) * f.Payload
			}
		}
		stream = sent*d.c.Size() > d.llc // about every rank's share, all of them
	}
	for {
		q, dst, err := op.NextDest(ctx)
		if err != nil {
			return err
		}
		if q < 0 {
			break
		}
		var rows []int32
		if code == CodeOK {
			rows = sc.layout.Rows[q]
		}
		n := len(rows)
		PutHeader(dst[0], code, n, sc.fp, sc.gen)
		mo := BlockHeader // the metadata, packed: each row's as long as its choices need
		pay, scb := n*f.Payload, n*sb
		if inPlace {
			dst[0][24] = flagInPlace
			for _, t := range rows {
				mo += d.putMeta(dst[0][mo:], sc.pl, sc.r, int(t), q)
			}
			pay, scb = 0, 0
		} else {
			for i, t := range rows {
				mo += d.putMeta(dst[0][mo:], sc.pl, sc.r, int(t), q)
				d.put(int(t), dst[1][i*f.Payload:(i+1)*f.Payload], dtype.FromBytes[float32](dst[2][i*sb:(i+1)*sb]), stream && q != me && d.x.Pushes(q))
			}
		}
		if err := op.Send(q, mo, pay, scb); err != nil {
			return err
		}
		if q != me {
			st.RowsSent += n
			st.BytesSent += mo + n*(f.Payload+sb) // in place: read by q where they are
			if d.x.Pushes(q) && !inPlace {
				st.Pushed++
			}
		}
	}
	return nil
}

// flagInPlace, in a block header's reserved word: the block's rows are in its sender's
// staging, at their token indices, to be read in place.
const flagInPlace = 1

// rowsInPlace reports whether the block whose header starts h has its rows in place.
func rowsInPlace(h []byte) bool { return h[24]&flagInPlace != 0 }

// Buffer is where this rank may write the tokens of its next Start (Hidden values per
// token, at most MaxTokens tokens) so that the dispatch copies nothing of them: the
// staging the experts read in place. It is nil unless the rows are read in place
// (RowsInPlace) in the activation type (the wire type is the activation type) and the
// staging is free (the combine of the last dispatch into it has completed). A Start
// whose x is Buffer()[:T*Hidden] stages nothing; the memory is the other ranks' to read
// until the combine of that dispatch completes, and must not be written meanwhile.
func (d *Dispatcher[T]) Buffer() []T {
	if d.rowsPer == 0 || d.f.Wire != d.act || d.closed {
		return nil
	}
	sc := d.slots[int(d.gen%uint64(len(d.slots)))].sc
	if !sc.stageFree || sc.state == slotStarted || sc.pins > 0 {
		return nil
	}
	return dtype.FromBytes[T](sc.stage[0].Local())[: d.cfg.MaxTokens*d.cfg.Hidden : d.cfg.MaxTokens*d.cfg.Hidden]
}

// stageTokens writes this rank's tokens into the slot's staging, in the wire format, at
// their token indices: each token once, whatever ranks it goes to.
func (d *Dispatcher[T]) stageTokens(x []T, sc *slotCore) {
	f := &d.f
	hid := d.cfg.Hidden
	pay := sc.stage[0].Local()
	var sca []float32
	if sc.stage[1] != nil {
		sca = dtype.FromBytes[float32](sc.stage[1].Local())
	}
	if f.Wire == d.act && len(x) > 0 && len(pay) > 0 && &dtype.Bytes(x)[0] == &pay[0] {
		return // the tokens were written there (Buffer)
	}
	for t := 0; t < sc.tokens; t++ {
		src := dtype.Bytes(x[t*hid : (t+1)*hid])
		encode(f, pay[t*f.Payload:(t+1)*f.Payload], sca[t*f.Scales:(t+1)*f.Scales], src, d.act, d.cfg.PowerOfTwoScales)
	}
}

func (s *slot[T]) waitLL(ctx context.Context) error {
	d := s.d
	sc := s.sc
	op := s.op
	s.op = nil
	if err := op.Wait(ctx); err != nil {
		return err
	}
	p, me := d.c.Size(), d.c.Rank()
	f := &d.f
	sb := f.ScaleBytes()
	sc.from = growInts(sc.from, p)
	// Headers first: another configuration on any rank, then a rank's bad input, fail
	// every rank alike.
	for q := 0; q < p; q++ {
		h := op.Recv(q, 0)
		if len(h) < BlockHeader {
			return fmt.Errorf("%w: rank %d sent a %d-byte block", ErrMismatch, q, len(h))
		}
		if _, _, fp, _ := ReadHeader(h); fp != sc.fp {
			return fmt.Errorf("%w: rank %d dispatches with another configuration or placement (fingerprint %#x, this rank's %#x)", ErrMismatch, q, fp, sc.fp)
		}
	}
	if s.inErr != nil {
		return s.inErr
	}
	st := &s.stats
	st.RowsReceived, st.BytesReceived = 0, 0
	for q := 0; q < p; q++ {
		h := op.Recv(q, 0)
		status, n, _, _ := ReadHeader(h)
		if status != CodeOK {
			return &PeerInputError{Rank: q, Code: status}
		}
		pay, scb := n*f.Payload, n*sb
		if rowsInPlace(h) {
			pay, scb = 0, 0
		}
		if n > d.cfg.MaxTokens || len(h) < BlockHeader+n*f.MetaBytes(0) || len(h) > BlockHeader+n*f.Meta || len(op.Recv(q, 1)) != pay || len(op.Recv(q, 2)) != scb || (pay == 0 && n > 0 && d.rowsPer == 0) {
			return fmt.Errorf("%w: rank %d's block says %d rows but carries %d, %d and %d bytes", ErrMismatch, q, n, len(h), len(op.Recv(q, 1)), len(op.Recv(q, 2)))
		}
		sc.from[q] = n
		if q != me {
			st.RowsReceived += n
			st.BytesReceived += len(h) + n*(f.Payload+sb)
		}
	}
	st.RowsPerRank = growInts(st.RowsPerRank, p)
	for q := 0; q < p; q++ {
		st.RowsPerRank[q] = len(sc.layout.Rows[q])
	}
	if err := s.viewLL(op); err != nil {
		return err
	}
	d.stats = *st
	return nil
}

// viewLL builds the expert-major view of the rows where they arrived (MaxTokens rows
// per source rank), and the handle's maps; it converts the rows into X only when the
// wire type is not the activation type.
func (s *slot[T]) viewLL(op interface {
	Recv(q, f int) []byte
	Field(f int) []byte
}) error {
	d := s.d
	sc := s.sc
	p, me, hid, k := d.c.Size(), d.c.Rank(), d.cfg.Hidden, d.cfg.TopK
	pl := sc.pl
	f := &d.f
	nLocal := len(pl.Local[me])
	mt := d.cfg.MaxTokens
	o := &s.out
	o.hidden, o.ExpertMajor, o.format = hid, false, f
	if cap(d.cs) < k {
		d.cs = make([]contrib, 0, k)
	}
	o.Counts = growInts(o.Counts, nLocal)
	clear(o.Counts)
	o.Offsets = growInts(o.Offsets, nLocal+1)
	// Where the rows are: all in their senders' staging, the view then spanning every
	// rank's (in place), or all here. A mix (ranks that disagree on whether their last
	// combine completed) is made all here: the rows in place are copied in.
	nIn, nAll := 0, 0
	for q := 0; q < p; q++ {
		if sc.from[q] > 0 {
			nAll++
			if rowsInPlace(op.Recv(q, 0)) {
				nIn++
			}
		}
	}
	inPlace, mixed := nIn > 0 && nIn == nAll, nIn > 0 && nIn < nAll
	var span, spanSca []byte
	if nIn > 0 { // waitLL refused rows in place where this rank has no staging
		span = sc.stage[0].Span()
		if sc.stage[1] != nil {
			spanSca = sc.stage[1].Span()
		}
	}
	R := d.rowsPer
	sb := f.ScaleBytes()
	incomingRows, contribs := 0, 0
	for q := 0; q < p; q++ {
		meta := op.Recv(q, 0)[BlockHeader:]
		copyIn := mixed && sc.from[q] > 0 && rowsInPlace(op.Recv(q, 0))
		for i := 0; i < sc.from[q]; i++ {
			src, cs, n, ok := getMeta(meta, k, nLocal, d.cs[:0])
			if !ok || (nIn > 0 && src >= mt) {
				return fmt.Errorf("%w: rank %d sent a row whose metadata is out of bounds", ErrMismatch, q)
			}
			if copyIn {
				from, to := q*R+src, q*mt+i
				copy(op.Field(1)[to*f.Payload:(to+1)*f.Payload], span[from*f.Payload:(from+1)*f.Payload])
				copy(op.Field(2)[to*sb:(to+1)*sb], spanSca[from*sb:(from+1)*sb])
			}
			meta = meta[n:]
			incomingRows++
			contribs += len(cs)
			for _, x := range cs {
				o.Counts[x.le]++
			}
		}
		if len(meta) != 0 {
			return fmt.Errorf("%w: rank %d sent %d bytes of metadata past its %d rows", ErrMismatch, q, len(meta), sc.from[q])
		}
	}
	total := layoutEntries(o, d.cfg.Align)
	s.allocEntries(total, incomingRows, contribs)
	pay, sca := op.Field(1), op.Field(2)
	perSrc := mt
	if inPlace {
		pay, sca, perSrc = span, spanSca, R
	}
	decoding := false
	switch {
	case d.cfg.Quantized:
		o.X, o.Q, o.Scales = nil, pay, dtype.FromBytes[float32](sca)
	case f.Wire == d.act:
		o.X, o.Q, o.Scales = dtype.FromBytes[T](pay), nil, nil // where the rows are
	default:
		o.X, o.Q, o.Scales = dtype.FromBytes[T](s.xS.Bytes(p*perSrc*hid*int(sizeOf[T]()))), nil, nil
		decoding = true
	}
	scales := dtype.FromBytes[float32](sca)
	s.padEntries(false)
	fill := d.fillScratch(nLocal)
	row, ci := 0, 0
	for q := 0; q < p; q++ {
		sc.originStart[q] = row
		meta := op.Recv(q, 0)[BlockHeader:]
		for i := 0; i < sc.from[q]; i++ {
			src, cs, n, _ := getMeta(meta, k, nLocal, d.cs[:0])
			meta = meta[n:]
			r := q*perSrc + i
			if inPlace {
				r = q*perSrc + src
			}
			if decoding {
				decode(f, dtype.Bytes(o.X[r*hid:(r+1)*hid]), d.act, pay[r*f.Payload:(r+1)*f.Payload], scales[r*f.Scales:(r+1)*f.Scales])
			}
			sc.start[row] = int32(ci)
			for _, x := range cs {
				dst := o.Offsets[x.le] + fill[x.le]
				fill[x.le]++
				o.Row[dst] = int32(r)
				o.Origin[dst], o.Source[dst], o.Weight[dst] = int32(q), int32(src), x.w
				o.Expert[dst] = int32(pl.Local[me][x.le])
				sc.entries[ci], sc.weights[ci] = int32(dst), x.w
				ci++
			}
			row++
		}
	}
	sc.originStart[p] = row
	sc.start[row] = int32(ci)
	return nil
}
