package ep

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
)

// The low-latency mode in place: where every rank can read every rank's memory (a
// coll.Board: inproc, or shm with every rank on one host), the expert outputs stay
// where the experts wrote them, in this rank's part of the board, and the ranks that
// sent the tokens read them there and sum them, each token's terms in one pass into a
// row that stays in the cache. Nobody writes partial sums: the outputs are read once,
// by the rank that needs them. The exchange that remains carries only each rank's
// header, which says that its outputs are in place (and its status).
//
// The board holds one region per dispatch slot (Handle.Slot): a rank fills the
// region of a slot only after a later dispatch into that slot has completed, which every
// rank enters only after its combine of the dispatch before (whose reads are then over).
//
// A region: its header (regionHeader bytes: kind, rows), then the handle's map
// (Handle.Map: originStart, start, entries, weights as 32-bit values), then the
// outputs, one row of Hidden T per entry (kindEntries) or per incoming row (kindRows:
// CombineRows, summed already).

const (
	regionHeader = 64
	kindEntries  = 1
	kindRows     = 2
)

// regions lays out the board: offsets within a region and its size.
type regions struct {
	size                         int
	origin, start, entries, wts  int
	y                            int
	maxIncoming, maxContrib, max int // capacities: incoming rows, contributions, rows of outputs
}

func align(n, a int) int { return (n + a - 1) / a * a }

// newRegions sizes a region for cfg on p ranks with outputs of es bytes per value: the
// same on every rank (the largest number of local experts of any rank).
func newRegions(cfg Config, p, es int) regions {
	nl := cfg.MaxLocalExperts // under any placement the dispatcher uses
	var r regions
	r.maxIncoming = p * cfg.MaxTokens
	r.maxContrib = r.maxIncoming * min(cfg.TopK, nl)
	r.max = r.maxContrib + nl*(cfg.Align-1)
	r.origin = regionHeader
	r.start = align(r.origin+4*(p+1), 64)
	r.entries = align(r.start+4*(r.maxIncoming+1), 64)
	r.wts = align(r.entries+4*r.maxContrib, 64)
	r.y = align(r.wts+4*r.maxContrib, 4096)
	r.size = align(r.y+r.max*cfg.Hidden*es, 4096)
	return r
}

// openBoard makes the board of an in-place low-latency combiner, or leaves cb.board nil
// (every rank alike) where some ranks cannot read each other's memory.
func (cb *Combiner[T]) openBoard(ctx context.Context) error {
	cfg := cb.cfg
	total := boardSize[T](cfg, cb.c.Size())
	if total == 0 {
		return nil // the same on every rank: sizes are agreed
	}
	cb.rg = newRegions(cfg, cb.c.Size(), int(unsafe.Sizeof(*new(T))))
	b, err := cb.c.NewBoard(ctx, total)
	switch {
	case err == nil:
		cb.board = b
	case !errors.Is(err, coll.ErrNoBoard):
		return err
	}
	return nil
}

// maxBoard bounds the memory an in-place combiner maps per rank; past it the partial
// sums are sent instead.
const maxBoard = 8 << 30

// boardSize is the size of an in-place combiner's board on p ranks (InFlight regions),
// or 0 where the combine sends partial sums whichever ranks may map each other's memory:
// another mode, SendPartials, a single rank, or more than maxBoard.
func boardSize[T Out](cfg Config, p int) int {
	if cfg.Mode != LowLatency || cfg.SendPartials || p == 1 {
		return 0
	}
	total := newRegions(cfg, p, int(unsafe.Sizeof(*new(T)))).size * cfg.InFlight
	if total > maxBoard {
		return 0
	}
	return total
}

// InPlace reports whether the combine reads the expert outputs in place (Buffer).
func (cb *Combiner[T]) InPlace() bool { return cb.board != nil }

// Buffer returns where this rank's experts should write their outputs for the dispatch
// that h belongs to (Output.Rows() x Hidden values, in entry order) for the combine to
// read them in place; nil where it does not (the normal and gathered modes, ranks that
// cannot all read one another's memory, Config.SendPartials, outputs of more than 8 GiB
// per rank for InFlight dispatches at MaxTokens), or for a handle that is not valid. The memory is this dispatch's until the next dispatch into the same buffers
// (Handle.Slot). Combine with y anywhere else copies y there first; CombineRows takes
// the first IncomingRows() x Hidden values of it the same way.
func (cb *Combiner[T]) Buffer(h Handle) []T {
	if cb.board == nil || h.Owner() != cb.owner || !h.Valid() {
		return nil
	}
	n := h.Rows() * cb.cfg.Hidden
	reg := cb.region(cb.c.Rank(), h.Slot())
	return dtype.FromBytes[T](reg[cb.rg.y:])[:n:n]
}

// region is rank q's region for dispatch slot i.
func (cb *Combiner[T]) region(q, i int) []byte {
	return cb.board.Peer(q)[i*cb.rg.size : (i+1)*cb.rg.size]
}

func i32s(b []byte, n int) []int32 { return dtype.FromBytes[int32](b[:4*n]) }

// publish puts this rank's outputs and map into its region (before the header says so).
func (s *cslot[T]) publish(y []T) {
	cb := s.cb
	h := s.h
	rg := &cb.rg
	hid := cb.cfg.Hidden
	reg := cb.region(cb.c.Rank(), h.Slot())
	n, kind := h.Rows(), kindEntries
	if s.rows {
		n, kind = h.IncomingRows(), kindRows
	}
	if n > 0 {
		ys := dtype.FromBytes[T](reg[rg.y:])[: n*hid : n*hid]
		if &ys[0] != &y[0] {
			copy(ys, y[:n*hid])
		}
	}
	origin, start, entries, wts := h.Map()
	binary.LittleEndian.PutUint32(reg[0:], uint32(kind))
	binary.LittleEndian.PutUint32(reg[4:], uint32(n))
	binary.LittleEndian.PutUint32(reg[8:], uint32(len(start)-1))
	binary.LittleEndian.PutUint32(reg[12:], uint32(len(entries)))
	o := i32s(reg[rg.origin:], len(origin))
	for i, v := range origin {
		o[i] = int32(v)
	}
	if kind == kindEntries {
		copy(i32s(reg[rg.start:], len(start)), start)
		copy(i32s(reg[rg.entries:], len(entries)), entries)
		copy(dtype.FromBytes[float32](reg[rg.wts:rg.wts+4*len(wts)]), wts)
	}
}

// view is what this rank reads of one rank's region.
type view[T Out] struct {
	kind           int
	first          int // its first incoming row from this rank
	start, entries []int32
	wts            []float32
	y              []T
	rows           int
}

// readView checks rank q's region header and map bounds and sets v to read it.
func (cb *Combiner[T]) readView(v *view[T], q, slot, sent int) error {
	rg := &cb.rg
	hid, p, me := cb.cfg.Hidden, cb.c.Size(), cb.c.Rank()
	reg := cb.region(q, slot)
	kind := int(binary.LittleEndian.Uint32(reg[0:]))
	n := int(binary.LittleEndian.Uint32(reg[4:]))
	inc := int(binary.LittleEndian.Uint32(reg[8:]))
	nc := int(binary.LittleEndian.Uint32(reg[12:]))
	origin := i32s(reg[rg.origin:], p+1)
	bad := func(what string) error {
		return fmt.Errorf("%w: rank %d's outputs in place: %s", ErrMismatch, q, what)
	}
	switch {
	case kind != kindEntries && kind != kindRows:
		return bad(fmt.Sprintf("kind %d", kind))
	case n > rg.max || inc > rg.maxIncoming || nc > rg.maxContrib:
		return bad(fmt.Sprintf("%d rows, %d incoming, %d contributions", n, inc, nc))
	case origin[me] < 0 || origin[me+1] < origin[me] || int(origin[me+1]) > inc:
		return bad(fmt.Sprintf("rows [%d,%d) of %d from this rank", origin[me], origin[me+1], inc))
	case int(origin[me+1]-origin[me]) != sent:
		return bad(fmt.Sprintf("%d rows from this rank, which sent it %d", origin[me+1]-origin[me], sent))
	case kind == kindRows && int(origin[me+1]) > n:
		return bad(fmt.Sprintf("%d summed rows", n))
	}
	v.kind, v.first, v.rows = kind, int(origin[me]), n
	v.y = dtype.FromBytes[T](reg[rg.y:])[: n*hid : n*hid]
	if kind == kindEntries {
		v.start = i32s(reg[rg.start:], inc+1)
		v.entries = i32s(reg[rg.entries:], nc)
		v.wts = dtype.FromBytes[float32](reg[rg.wts : rg.wts+4*nc])
	}
	return nil
}

// sumInPlace writes out: for each token, its terms read where the experts wrote them,
// summed in float32 in one pass in the order of the token's choices (as one process sums
// them: the same bits whatever the ranks and placement). Rows summed already
// (CombineRows) are added rank by rank in ascending order.
func (s *cslot[T]) sumInPlace() error {
	cb := s.cb
	h := s.h
	hid, p, me := cb.cfg.Hidden, cb.c.Size(), cb.c.Rank()
	if cap(cb.views) < p {
		cb.views = make([]view[T], p)
	}
	vs := cb.views[:p]
	for q := 0; q < p; q++ {
		if err := cb.readView(&vs[q], q, h.Slot(), len(h.RowsTo(q))); err != nil {
			return err
		}
	}
	s.cnt = growInts(s.cnt, p)
	clear(s.cnt)
	read := 0
	summed := false // some rank sent rows summed already (CombineRows)
	for q := range vs {
		summed = summed || vs[q].kind == kindRows
	}
	for t := 0; t < h.Tokens(); t++ {
		// The token's terms, gathered rank by rank, each rank's in the order of its
		// choices.
		ws, rows := cb.ws[:0], cb.rows[:0]
		dests := h.Dests(t)
		at := cb.at[:0] // where each destination's terms start in ws and rows
		for _, q := range dests {
			v := &vs[q]
			r := v.first + s.cnt[q]
			s.cnt[q]++
			n := len(rows)
			at = append(at, n)
			if v.kind == kindRows {
				ws, rows = append(ws, 1), append(rows, v.y[r*hid:(r+1)*hid])
			} else {
				a, b := v.start[r], v.start[r+1]
				if a < 0 || b < a || int(b) > len(v.entries) {
					return fmt.Errorf("%w: rank %d's outputs in place: row %d's entries [%d,%d) of %d", ErrMismatch, q, r, a, b, len(v.entries))
				}
				for j := a; j < b; j++ {
					e := int(v.entries[j])
					if e < 0 || e >= v.rows {
						return fmt.Errorf("%w: rank %d's outputs in place: entry %d of %d", ErrMismatch, q, e, v.rows)
					}
					ws, rows = append(ws, v.wts[j]), append(rows, v.y[e*hid:(e+1)*hid])
				}
			}
			if int(q) != me {
				read += len(rows) - n
			}
		}
		at = append(at, len(rows)) // the end of the last destination's terms
		cb.ws, cb.rows, cb.at = ws, rows, at
		if !summed {
			// In the order of the token's choices, as one process adds them: choice j's
			// term is the next of its rank's, and each rank has one term per choice.
			ows, orows := cb.ows[:0], cb.orows[:0]
			cur := append(cb.cur[:0], at[:len(dests)]...)
			for _, q := range h.ChoiceRanks(t) {
				if q < 0 {
					continue
				}
				d := 0
				for d < len(dests) && dests[d] != q {
					d++
				}
				if d == len(dests) || cur[d] == at[d+1] {
					return fmt.Errorf("%w: rank %d's outputs in place: fewer terms for token %d than its choices there", ErrMismatch, q, t)
				}
				ows, orows = append(ows, ws[cur[d]]), append(orows, rows[cur[d]])
				cur[d]++
			}
			for d := range dests {
				if cur[d] != at[d+1] {
					return fmt.Errorf("%w: rank %d's outputs in place: more terms for token %d than its choices there", ErrMismatch, dests[d], t)
				}
			}
			cb.ows, cb.orows, cb.cur = ows, orows, cur
			ws, rows = ows, orows
		}
		if isF32[T]() {
			dtype.WeightedSum(dtype.FromBytes[float32](dtype.Bytes(s.out[t*hid:(t+1)*hid])), ws, rows, false)
		} else {
			dtype.WeightedSum(cb.part, ws, rows, false)
			dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](dtype.Bytes(s.out[t*hid:(t+1)*hid])), cb.part)
		}
	}
	cb.read = read * hid * int(unsafe.Sizeof(*new(T)))
	return nil
}

// LastRead is the bytes of other ranks' memory the last in-place combine read (0 where
// the combine does not read in place).
func (cb *Combiner[T]) LastRead() int { return cb.read }
