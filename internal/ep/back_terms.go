package ep

import (
	"encoding/binary"
	"fmt"
	"unsafe"

	"github.com/moex-ai/moex/coll/dtype"
)

// Summing at the origin (Config.SumAtOrigin) over messages: each rank sends a
// token's rank its expert outputs unsummed, as the experts wrote them, and the token's
// rank adds every term of a token in the order of its choices, as one process does (as
// the in-place combine does, inplace.go). A block, for the rows one origin sent this
// rank (Handle.Incoming), is the number of terms of each row (int32), then the terms,
// row by row, each row's in the order of its entries (Handle.Contributions: the order
// of the token's choices); this rank's own block stays in its memory.

// termsBytes is the size of a block of n rows with m terms of hid values of es bytes.
func termsBytes(n, m, hid, es int) int { return 4*n + m*hid*es }

// maxTermsBlock is the largest block of the low-latency mode: MaxTokens rows, each with
// at most as many terms as a rank holds experts (MaxLocalExperts), or TopK.
func maxTermsBlock(cfg Config, es int) int {
	return termsBytes(cfg.MaxTokens, cfg.MaxTokens*min(cfg.TopK, cfg.MaxLocalExperts), cfg.Hidden, es)
}

func elemSize[T Out]() int { return int(unsafe.Sizeof(*new(T))) }

// putTerms writes into dst the block of incoming rows [a, b) and returns its size.
func (s *cslot[T]) putTerms(dst []byte, y []T, a, b int) int {
	hid := s.cb.cfg.Hidden
	rb := hid * elemSize[T]()
	off := 4 * (b - a)
	for i := a; i < b; i++ {
		entries, _ := s.h.Contributions(i)
		binary.LittleEndian.PutUint32(dst[4*(i-a):], uint32(len(entries)))
		for _, e := range entries {
			copy(dst[off:off+rb], dtype.Bytes(y[int(e)*hid:(int(e)+1)*hid]))
			off += rb
		}
	}
	return off
}

// ownTermsBlock keeps this rank's own terms (the block of its rows to itself) for
// sumTerms: y is not read after Start.
func (s *cslot[T]) ownTermsBlock(y []T) {
	cb := s.cb
	h := s.h
	me := cb.c.Rank()
	a, b := h.Incoming(me)
	need := termsBytes(b-a, h.ChoicesTo(me), cb.cfg.Hidden, elemSize[T]())
	size := need
	if cb.cfg.Mode == LowLatency {
		size = max(need, maxTermsBlock(cb.cfg, elemSize[T]())) // sized once
	}
	blk := s.accS.Bytes(size)[:need]
	s.putTerms(blk, y, a, b)
	s.parts[me] = blk
}

// termsExpected is the size of the block rank q sends this rank: a row per token of this
// rank that went to q, a term per choice there.
func (s *cslot[T]) termsExpected(q int) int {
	return termsBytes(len(s.h.RowsTo(q)), s.h.ChoicesTo(q), s.cb.cfg.Hidden, elemSize[T]())
}

// sumTerms writes out: each token's terms, from the blocks in s.parts, weighted by its
// routing and added in float32 in one pass in the order of its choices.
func (s *cslot[T]) sumTerms() error {
	cb := s.cb
	h := s.h
	hid, p := cb.cfg.Hidden, cb.c.Size()
	rb := hid * elemSize[T]()
	r := h.Routing()
	s.cnt = growInts(s.cnt, 2*p)
	clear(s.cnt)
	row, term := s.cnt[:p], s.cnt[p:] // each rank's next row and next term
	for t := 0; t < h.Tokens(); t++ {
		dests := h.Dests(t)
		cur, end := cb.cur[:0], cb.at[:0]
		for _, q := range dests {
			blk := s.parts[q]
			i := row[q]
			row[q]++
			m := int(int32(binary.LittleEndian.Uint32(blk[4*i:])))
			first := 4*len(h.RowsTo(int(q))) + term[q]*rb
			if m < 0 || first+m*rb > len(blk) {
				return fmt.Errorf("%w: rank %d says token %d has %d terms, past its block of %d bytes", ErrMismatch, q, t, m, len(blk))
			}
			cur, end = append(cur, term[q]), append(end, term[q]+m)
			term[q] += m
		}
		ws, rows := cb.ows[:0], cb.orows[:0]
		for j, q := range h.ChoiceRanks(t) {
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
			off := 4*len(h.RowsTo(int(q))) + cur[d]*rb
			cur[d]++
			ws, rows = append(ws, r.Weights[t*r.K+j]), append(rows, dtype.FromBytes[T](s.parts[q][off:off+rb]))
		}
		for d := range dests {
			if cur[d] != end[d] {
				return fmt.Errorf("%w: rank %d sent more terms for token %d than its choices there", ErrMismatch, dests[d], t)
			}
		}
		cb.cur, cb.at, cb.ows, cb.orows = cur, end, ws, rows
		if isF32[T]() {
			dtype.WeightedSum(dtype.FromBytes[float32](dtype.Bytes(s.out[t*hid:(t+1)*hid])), ws, rows, false)
		} else {
			dtype.WeightedSum(cb.part, ws, rows, false)
			dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](dtype.Bytes(s.out[t*hid:(t+1)*hid])), cb.part)
		}
	}
	clear(cb.orows[:cap(cb.orows)]) // no reference to the blocks stays behind
	return nil
}
