package dispatch

import (
	"encoding/binary"
	"fmt"

	"github.com/moex-ai/moex/coll/dtype"
)

// The combiner's arithmetic, picked once at NewCombiner (the sums interface).

func isF32[T Out]() bool {
	var z T
	_, ok := any(z).(float32)
	return ok
}

// rowSummer sums the expert outputs of one incoming row: what the partial sums and the
// gathered mode share.
type rowSummer[T Out] struct {
	cb    *backCore
	terms [][]T
}

// sumRow writes into dst the weighted sum of the expert outputs of incoming row i (the
// first term written, the others added: nothing to clear).
func (r *rowSummer[T]) sumRow(dst []float32, cs *cstep, i int) {
	hid := r.cb.d.cfg.Hidden
	y := dtype.FromBytes[T](cs.y)
	if cs.rows { // summed already: row i of y
		if isF32[T]() {
			copy(dst, dtype.FromBytes[float32](dtype.Bytes(y[i*hid:(i+1)*hid])))
		} else {
			dtype.BF16ToF32(dst, dtype.FromBytes[dtype.BFloat16](dtype.Bytes(y[i*hid:(i+1)*hid])))
		}
		return
	}
	entries, ws := cs.d.contributions(i)
	if len(entries) == 0 {
		clear(dst)
		return
	}
	// One pass over dst for all the terms (WeightedSum gives, bit for bit, Scale with the
	// first and Axpy with each next).
	terms := r.terms[:0]
	for _, e := range entries {
		terms = append(terms, y[int(e)*hid:(int(e)+1)*hid])
	}
	dtype.WeightedSum(dst, ws, terms, false)
	clear(terms) // no reference to y stays behind
	r.terms = terms[:0]
}

// partialSums: each rank sends a token's rank one partial sum per (token, rank), in the
// partial sums' type; the origin adds them to its own terms in ascending rank order.
type partialSums[T Out] struct {
	rowSummer[T]
	part []float32 // one row of a partial sum
	scl  []float32 // its scales, where the partial sums are fp8 or int8
	ones []float32
	pb   [][]dtype.BFloat16
	pf   [][]float32
}

func newPartialSums[T Out](cb *backCore) *partialSums[T] {
	p := cb.d.c.Size()
	ps := &partialSums[T]{rowSummer: rowSummer[T]{cb: cb}, part: make([]float32, cb.d.cfg.Hidden), scl: make([]float32, cb.f.Scales), ones: make([]float32, p)}
	for i := range ps.ones {
		ps.ones[i] = 1
	}
	return ps
}

// own starts the sum: for each of this rank's tokens, the terms of this rank's own
// experts, in the order of the token's choices, or zeros.
func (ps *partialSums[T]) own(cs *cstep) {
	hid := ps.cb.d.cfg.Hidden
	if isF32[T]() {
		cs.acc = dtype.FromBytes[float32](cs.out)
	} else {
		cs.acc = dtype.FromBytes[float32](cs.accS.Bytes(len(cs.out) * 2))
	}
	s := cs.d
	me := ps.cb.d.c.Rank()
	a, b := s.incoming(me)
	own := s.layout.Rows[me] // incoming rows from this rank are its own tokens, in token order
	i := a
	for t := 0; t < s.tokens; t++ {
		dst := cs.acc[t*hid : (t+1)*hid]
		if i == b || int(own[i-a]) != t {
			clear(dst)
			continue
		}
		ps.sumRow(dst, cs, i)
		i++
	}
}

// put writes the partial sums of incoming rows [a, b) into dst, one Row each.
func (ps *partialSums[T]) put(dst []byte, cs *cstep, a, b int) {
	rb := ps.cb.f.Row
	for i := a; i < b; i++ {
		ps.partial(dst[(i-a)*rb:(i-a+1)*rb], cs, i)
	}
}

// partial writes into dst (a partial sum on the wire) the weighted sum of the expert
// outputs for incoming row i.
func (ps *partialSums[T]) partial(dst []byte, cs *cstep, i int) {
	f := &ps.cb.f
	acc := ps.part
	if f.Partial == dtype.F32 {
		acc = dtype.FromBytes[float32](dst)
	}
	ps.sumRow(acc, cs, i)
	switch f.Partial {
	case dtype.BF16:
		dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](dst), acc)
	case dtype.FP8E4M3:
		dtype.QuantizeFP8(dst[:f.Hidden], ps.scl, acc, false)
		copy(dst[f.ScaleAt():f.Row], dtype.Bytes(ps.scl))
	case dtype.I8:
		ps.scl[0] = dtype.QuantizeI8(dst[:f.Hidden], acc)
		copy(dst[f.ScaleAt():f.Row], dtype.Bytes(ps.scl))
	}
}

// addQuantized adds the partial sum src (of an fp8 or int8 combine) to dst.
func (ps *partialSums[T]) addQuantized(dst []float32, src []byte) {
	f := &ps.cb.f
	copy(dtype.Bytes(ps.scl), src[f.ScaleAt():f.Row])
	if f.Partial == dtype.FP8E4M3 {
		dtype.DequantizeFP8(ps.part, src[:f.Hidden], ps.scl)
	} else {
		dtype.DequantizeI8(ps.part, src[:f.Hidden], ps.scl[0])
	}
	dtype.Axpy(dst, 1, ps.part)
}

// finish adds, token by token, the other ranks' partial sums (cs.parts[q] holds rank
// q's, in the order this rank sent q its rows) to the own terms, in ascending rank
// order, and writes each finished row into out: every partial is read once, and a
// token's sum stays in the cache until it is done.
func (ps *partialSums[T]) finish(cs *cstep) error {
	cb := ps.cb
	s := cs.d
	hid, rb := cb.d.cfg.Hidden, cb.f.Row
	quant := cb.f.Scales > 0
	me := cb.d.c.Rank()
	cs.cnt = growInts(cs.cnt, cb.d.c.Size())
	clear(cs.cnt)
	pb, pf := ps.pb[:0], ps.pf[:0]
	out := dtype.FromBytes[dtype.BFloat16](cs.out)
	for t := 0; t < s.tokens; t++ {
		dst := cs.acc[t*hid : (t+1)*hid]
		// The partials in ascending rank order, added to the own terms in one pass
		// (WeightedSum with add: Axpy with each, bit for bit); quantised ones one by one.
		pb, pf = pb[:0], pf[:0]
		for _, q := range s.layout.Dest[t] {
			if int(q) == me {
				continue
			}
			i := cs.cnt[q]
			cs.cnt[q]++
			src := cs.parts[q][i*rb : (i+1)*rb]
			switch {
			case quant:
				ps.addQuantized(dst, src)
			case cb.f.Partial == dtype.BF16:
				pb = append(pb, dtype.FromBytes[dtype.BFloat16](src))
			default:
				pf = append(pf, dtype.FromBytes[float32](src))
			}
		}
		if len(pb) > 0 {
			dtype.WeightedSum(dst, ps.ones[:len(pb)], pb, true)
		}
		if len(pf) > 0 {
			dtype.WeightedSum(dst, ps.ones[:len(pf)], pf, true)
		}
		if !isF32[T]() {
			dtype.F32ToBF16(out[t*hid:(t+1)*hid], dst)
		}
	}
	clear(pb[:cap(pb)]) // no reference to the receive buffers stays behind
	clear(pf[:cap(pf)])
	ps.pb, ps.pf = pb[:0], pf[:0]
	return nil
}

// termSums (SumAtOrigin) over messages: each rank sends a token's rank its expert
// outputs unsummed, as the experts wrote them, and the token's rank adds every term of a
// token in the order of its choices, as one process does (as the in-place combine does).
// A block, for the rows one origin sent this rank, is the number of terms of each row
// (int32), then the terms, row by row, each row's in the order of its entries (the order
// of the token's choices); this rank's own block stays in its memory.
type termSums[T Out] struct {
	cb       *backCore
	part     []float32
	cur, end []int
	ws       []float32
	rows     [][]T
}

// put writes the block of incoming rows [a, b) into dst.
func (ts *termSums[T]) put(dst []byte, cs *cstep, a, b int) {
	rb := ts.cb.f.TermRow
	off := 4 * (b - a)
	for i := a; i < b; i++ {
		entries, _ := cs.d.contributions(i)
		binary.LittleEndian.PutUint32(dst[4*(i-a):], uint32(len(entries)))
		for _, e := range entries {
			copy(dst[off:off+rb], cs.y[int(e)*rb:(int(e)+1)*rb])
			off += rb
		}
	}
}

// own keeps this rank's own terms (the block of its rows to itself) for finish: y is
// not read after Start.
func (ts *termSums[T]) own(cs *cstep) {
	cb := ts.cb
	s := cs.d
	me := cb.d.c.Rank()
	a, b := s.incoming(me)
	need := termsBytes(b-a, s.layout.Choices[me], cb.f.TermRow)
	size := need
	if c := cb.d.mode.capacity(); c > 0 { // sized once, for the most a dispatch carries
		size = max(need, cb.f.Block(c, c*min(cb.d.cfg.TopK, cb.d.cfg.MaxLocalExperts)))
	}
	blk := cs.accS.Bytes(size)[:need]
	ts.put(blk, cs, a, b)
	cs.parts[me] = blk
}

// finish writes out: each token's terms, from the blocks in cs.parts, weighted by its
// routing and added in float32 in one pass in the order of its choices.
func (ts *termSums[T]) finish(cs *cstep) error {
	cb := ts.cb
	s := cs.d
	hid, p := cb.d.cfg.Hidden, cb.d.c.Size()
	rb := cb.f.TermRow
	r := s.r
	if ts.part == nil {
		ts.part = make([]float32, hid)
	}
	cs.cnt = growInts(cs.cnt, 2*p)
	clear(cs.cnt)
	row, term := cs.cnt[:p], cs.cnt[p:] // each rank's next row and next term
	for t := 0; t < s.tokens; t++ {
		dests := s.layout.Dest[t]
		cur, end := ts.cur[:0], ts.end[:0]
		for _, q := range dests {
			blk := cs.parts[q]
			i := row[q]
			row[q]++
			m := int(int32(binary.LittleEndian.Uint32(blk[4*i:])))
			first := 4*len(s.layout.Rows[q]) + term[q]*rb
			if m < 0 || first+m*rb > len(blk) {
				return fmt.Errorf("%w: rank %d says token %d has %d terms, past its block of %d bytes", ErrMismatch, q, t, m, len(blk))
			}
			cur, end = append(cur, term[q]), append(end, term[q]+m)
			term[q] += m
		}
		ws, rows := ts.ws[:0], ts.rows[:0]
		for j, q := range s.layout.ChoiceRank[t*r.K : (t+1)*r.K] {
			if q < 0 {
				continue
			}
			d := 0
			for d < len(dests) && dests[d] != q {
				d++
			}
			if d == len(dests) || cur[d] == end[d] {
				return fmt.Errorf("%w: rank %d sent fewer terms for token %d than its choices there", ErrMismatch, q, t)
			}
			off := 4*len(s.layout.Rows[q]) + cur[d]*rb
			cur[d]++
			ws, rows = append(ws, r.Weights[t*r.K+j]), append(rows, dtype.FromBytes[T](cs.parts[q][off:off+rb]))
		}
		for d := range dests {
			if cur[d] != end[d] {
				return fmt.Errorf("%w: rank %d sent more terms for token %d than its choices there", ErrMismatch, dests[d], t)
			}
		}
		ts.cur, ts.end, ts.ws, ts.rows = cur, end, ws, rows
		writeSum[T](cs.out, t, hid, ws, rows, ts.part)
	}
	clear(ts.rows[:cap(ts.rows)]) // no reference to the blocks stays behind
	return nil
}

// writeSum writes token t's row of out: the weighted sum of rows, in float32 in one
// pass (through part for bfloat16 outputs).
func writeSum[T Out](out []byte, t, hid int, ws []float32, rows [][]T, part []float32) {
	if isF32[T]() {
		dtype.WeightedSum(dtype.FromBytes[float32](out)[t*hid:(t+1)*hid], ws, rows, false)
		return
	}
	dtype.WeightedSum(part, ws, rows, false)
	dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](out)[t*hid:(t+1)*hid], part)
}
