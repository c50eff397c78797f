package dispatch

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
)

// The low-latency combine in place: where every rank can read every rank's memory (a
// coll.Board: inproc, or shm with every rank on one host), the expert outputs stay where
// the experts wrote them, in this rank's part of the board, and the ranks that sent the
// tokens read them there and sum them, each token's terms in one pass into a row that
// stays in the cache. Nobody writes partial sums: the outputs are read once, by the rank
// that needs them. The exchange that remains carries only each rank's header, which says
// that its outputs are in place (and its status).
//
// The board holds one region per dispatch slot: a rank fills the region of a slot only
// after a later dispatch into that slot has completed, which every rank enters only
// after its combine of the dispatch before (whose reads are then over).
//
// A region: its header (regionHeader bytes: kind, rows), then the dispatch's map of
// incoming rows (originStart, start, entries, weights as 32-bit values), then the
// outputs, one row of Hidden values per entry (kindEntries) or per incoming row
// (kindRows: CombineRows, summed already).

const (
	regionHeader = 64
	kindEntries  = 1
	kindRows     = 2
)

type inPlaceBack struct {
	m     *lowLatency
	cb    *backCore
	board *coll.Board
	rg    regions
	x     *coll.Exchange // the headers
	op    []*coll.XOp
}

// regions lays out the board: offsets within a region and its size.
type regions struct {
	size                         int
	origin, start, entries, wts  int
	y                            int
	maxIncoming, maxContrib, max int // capacities: incoming rows, contributions, rows of outputs
}

func alignUp(n, a int) int { return (n + a - 1) / a * a }

// newRegions sizes a region for cfg on p ranks with outputs of es bytes per value: the
// same on every rank (the most local experts of any placement the dispatcher uses).
func newRegions(cfg Config, p, es int) regions {
	nl := cfg.MaxLocalExperts
	var r regions
	r.maxIncoming = p * cfg.MaxTokens
	r.maxContrib = r.maxIncoming * min(cfg.TopK, nl)
	r.max = r.maxContrib + nl*(cfg.Align-1)
	r.origin = regionHeader
	r.start = alignUp(r.origin+4*(p+1), 64)
	r.entries = alignUp(r.start+4*(r.maxIncoming+1), 64)
	r.wts = alignUp(r.entries+4*r.maxContrib, 64)
	r.y = alignUp(r.wts+4*r.maxContrib, 4096)
	r.size = alignUp(r.y+r.max*cfg.Hidden*es, 4096)
	return r
}

// maxBoard bounds the memory an in-place combiner maps per rank; past it the partial
// sums are sent instead.
const maxBoard = 8 << 30

// boardSize is the size of an in-place combiner's board on p ranks (InFlight regions),
// or 0 where the combine sends partial sums whichever ranks may map each other's memory:
// SendPartials, a single rank, or more than maxBoard. The low-latency protocol's ways
// back alone ask it.
func boardSize(cfg Config, ccfg CombineConfig, p, es int) int {
	if ccfg.SendPartials || p == 1 {
		return 0
	}
	total := newRegions(cfg, p, es).size * cfg.InFlight
	if total > maxBoard {
		return 0
	}
	return total
}

// newInPlaceBack makes the board of an in-place combine, or returns nil (every rank
// alike) where some ranks cannot read each other's memory.
func newInPlaceBack(ctx context.Context, m *lowLatency, cb *backCore) (*inPlaceBack, error) {
	cfg := m.d.cfg
	p := m.d.c.Size()
	total := boardSize(cfg, cb.cfg, p, cb.out.Size())
	if total == 0 {
		return nil, nil // the same on every rank: sizes are agreed
	}
	b := &inPlaceBack{m: m, cb: cb, rg: newRegions(cfg, p, cb.out.Size()), op: make([]*coll.XOp, len(cb.slots))}
	board, err := m.d.c.NewBoard(ctx, total)
	switch {
	case errors.Is(err, coll.ErrNoBoard):
		return nil, nil
	case err != nil:
		return nil, err
	}
	b.board = board
	if b.x, err = m.d.c.NewExchange(ctx, llBackExchange(cfg, &cb.f, true)); err != nil {
		board.Close()
		return nil, err
	}
	return b, nil
}

func (b *inPlaceBack) inPlace() bool   { return true }
func (b *inPlaceBack) takesRows() bool { return true }
func (b *inPlaceBack) bytes() int      { return b.x.Bytes() + b.board.Size() }

func (b *inPlaceBack) close() error {
	return errors.Join(b.board.Close(), b.x.Close())
}

// region is rank q's region for dispatch slot i.
func (b *inPlaceBack) region(q, i int) []byte {
	return b.board.Peer(q)[i*b.rg.size : (i+1)*b.rg.size]
}

// buffer is where this rank's experts write their outputs for slot s's dispatch.
func (b *inPlaceBack) buffer(s *dispatched) []byte {
	n := s.rowsOut * b.m.d.cfg.Hidden * b.cb.out.Size()
	return b.region(b.m.d.c.Rank(), s.idx)[b.rg.y:][:n:n]
}

func i32s(b []byte, n int) []int32 { return dtype.FromBytes[int32](b[:4*n]) }

func (b *inPlaceBack) start(ctx context.Context, cs *cstep) error {
	if cs.code == codeOK {
		b.publish(cs)
	}
	op, err := b.x.Begin(ctx)
	if err != nil {
		return err
	}
	b.op[cs.idx] = op
	for {
		q, dst, err := op.NextDest(ctx)
		if err != nil {
			return err
		}
		if q < 0 {
			return nil
		}
		n := 0
		if cs.code == codeOK && q != b.m.d.c.Rank() {
			n = cs.d.sched.Combine.Send[q].Rows
		}
		header{status: cs.code, rows: n, fp: cs.fp, gen: cs.gen}.put(dst[0])
		if err := op.Send(q, blockHeader, 0); err != nil {
			return err
		}
	}
}

func (b *inPlaceBack) wait(ctx context.Context, cs *cstep) error {
	p, me := b.m.d.c.Size(), b.m.d.c.Rank()
	op := b.op[cs.idx]
	b.op[cs.idx] = nil
	if err := op.Wait(ctx); err != nil {
		return err
	}
	var first error
	for q := 0; q < p; q++ {
		if q == me {
			continue
		}
		if err := cs.checkBlock(q, op.Recv(q, 0)); err != nil && first == nil {
			first = err
		}
	}
	if cs.inErr != nil {
		return cs.inErr
	}
	return first
}

// publish puts this rank's outputs and map into its region (before the header says so).
func (b *inPlaceBack) publish(cs *cstep) {
	rg := &b.rg
	s := cs.d
	reg := b.region(b.m.d.c.Rank(), s.idx)
	rb := b.m.d.cfg.Hidden * b.cb.out.Size()
	n, kind := s.rowsOut, kindEntries
	if cs.rows {
		n, kind = s.incomingRows(), kindRows
	}
	if n > 0 {
		ys := reg[rg.y:][: n*rb : n*rb]
		if &ys[0] != &cs.y[0] {
			copy(ys, cs.y[:n*rb])
		}
	}
	inc := s.incomingRows()
	start, entries, wts := s.start[:inc+1], s.entries[:s.start[inc]], s.weights[:s.start[inc]]
	binary.LittleEndian.PutUint32(reg[0:], uint32(kind))
	binary.LittleEndian.PutUint32(reg[4:], uint32(n))
	binary.LittleEndian.PutUint32(reg[8:], uint32(inc))
	binary.LittleEndian.PutUint32(reg[12:], uint32(len(entries)))
	o := i32s(reg[rg.origin:], len(s.originStart))
	for i, v := range s.originStart {
		o[i] = int32(v)
	}
	if kind == kindEntries {
		copy(i32s(reg[rg.start:], len(start)), start)
		copy(i32s(reg[rg.entries:], len(entries)), entries)
		copy(dtype.FromBytes[float32](reg[rg.wts:rg.wts+4*len(wts)]), wts)
	}
}

// regionView is what this rank reads of one rank's region.
type regionView struct {
	kind           int
	first          int // its first incoming row from this rank
	start, entries []int32
	wts            []float32
	y              []byte
	rows           int
}

// readView checks rank q's region header and map bounds and sets v to read it.
func (b *inPlaceBack) readView(v *regionView, q, slot, sent int) error {
	rg := &b.rg
	p, me := b.m.d.c.Size(), b.m.d.c.Rank()
	rb := b.m.d.cfg.Hidden * b.cb.out.Size()
	reg := b.region(q, slot)
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
	v.y = reg[rg.y:][: n*rb : n*rb]
	if kind == kindEntries {
		v.start = i32s(reg[rg.start:], inc+1)
		v.entries = i32s(reg[rg.entries:], nc)
		v.wts = dtype.FromBytes[float32](reg[rg.wts : rg.wts+4*nc])
	}
	return nil
}

// inPlaceSums: nothing is summed on the expert side; the origin reads each token's terms
// where they were written and adds them in float32 in one pass, in the order of the
// token's choices, as a single process adds them. Rows summed already (CombineRows) are
// added rank by rank in ascending order.
type inPlaceSums[T Out] struct {
	b       *inPlaceBack
	views   []regionView
	ws      []float32
	rows    [][]T
	at, cur []int
	ows     []float32
	orows   [][]T
	part    []float32
}

func newInPlaceSums[T Out](cb *backCore, b *inPlaceBack) *inPlaceSums[T] {
	return &inPlaceSums[T]{b: b, part: make([]float32, cb.d.cfg.Hidden)}
}

func (is *inPlaceSums[T]) own(*cstep)                   {}
func (is *inPlaceSums[T]) put([]byte, *cstep, int, int) {}

// finish writes out: for each token, its terms read where the experts wrote them, summed
// in float32 in one pass in the order of the token's choices (as one process sums them:
// the same bits whatever the ranks and placement).
func (is *inPlaceSums[T]) finish(cs *cstep) error {
	b := is.b
	s := cs.d
	hid, p, me := b.m.d.cfg.Hidden, b.m.d.c.Size(), b.m.d.c.Rank()
	if cap(is.views) < p {
		is.views = make([]regionView, p)
	}
	vs := is.views[:p]
	for q := 0; q < p; q++ {
		if err := b.readView(&vs[q], q, s.idx, len(s.layout.Rows[q])); err != nil {
			return err
		}
	}
	cs.cnt = growInts(cs.cnt, p)
	clear(cs.cnt)
	read := 0
	summed := false // some rank sent rows summed already (CombineRows)
	for q := range vs {
		summed = summed || vs[q].kind == kindRows
	}
	r := s.r
	for t := 0; t < s.tokens; t++ {
		// The token's terms, gathered rank by rank, each rank's in the order of its
		// choices.
		ws, rows := is.ws[:0], is.rows[:0]
		dests := s.layout.Dest[t]
		at := is.at[:0] // where each destination's terms start in ws and rows
		for _, q := range dests {
			v := &vs[q]
			y := dtype.FromBytes[T](v.y)
			i := v.first + cs.cnt[q]
			cs.cnt[q]++
			n := len(rows)
			at = append(at, n)
			if v.kind == kindRows {
				ws, rows = append(ws, 1), append(rows, y[i*hid:(i+1)*hid])
			} else {
				a, e := v.start[i], v.start[i+1]
				if a < 0 || e < a || int(e) > len(v.entries) {
					return fmt.Errorf("%w: rank %d's outputs in place: row %d's entries [%d,%d) of %d", ErrMismatch, q, i, a, e, len(v.entries))
				}
				for j := a; j < e; j++ {
					en := int(v.entries[j])
					if en < 0 || en >= v.rows {
						return fmt.Errorf("%w: rank %d's outputs in place: entry %d of %d", ErrMismatch, q, en, v.rows)
					}
					ws, rows = append(ws, v.wts[j]), append(rows, y[en*hid:(en+1)*hid])
				}
			}
			if int(q) != me {
				read += len(rows) - n
			}
		}
		at = append(at, len(rows)) // the end of the last destination's terms
		is.ws, is.rows, is.at = ws, rows, at
		if !summed {
			// In the order of the token's choices, as one process adds them: choice j's
			// term is the next of its rank's, and each rank has one term per choice.
			ows, orows := is.ows[:0], is.orows[:0]
			cur := append(is.cur[:0], at[:len(dests)]...)
			for _, q := range s.layout.ChoiceRank[t*r.K : (t+1)*r.K] {
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
			is.ows, is.orows, is.cur = ows, orows, cur
			ws, rows = ows, orows
		}
		writeSum[T](cs.out, t, hid, ws, rows, is.part)
	}
	clear(is.rows[:cap(is.rows)]) // no reference to the board stays behind
	clear(is.orows[:cap(is.orows)])
	cs.cb.stats.BytesRead = read * hid * b.cb.out.Size()
	return nil
}

// CombineLowLatencyBytes is the memory (Combiner.Bytes) that the Combiner[T] of a
// dispatcher of cfg in the low-latency mode holds on each rank of cfg.Placement once
// every slot has combined MaxTokens tokens: where every rank maps every rank's memory
// (shared: one host, over shm or inproc; the outputs are then read in place unless
// SendPartials), or where blocks travel as messages. It runs nothing (LowLatencyBytes
// is the dispatcher's).
func CombineLowLatencyBytes[T Out](cfg Config, ccfg CombineConfig, shared bool) (int, error) {
	cfg, err := Defaults[T](cfg)
	if err != nil {
		return 0, err
	}
	ccfg, err = combineDefaults(cfg, ccfg, outType[T]())
	if err != nil {
		return 0, err
	}
	if cfg.Mode != LowLatency && cfg.Mode != Auto { // Auto: its low-latency mode's
		return 0, fmt.Errorf("%w: LowLatencyBytes of the %v mode", ErrConfig, cfg.Mode)
	}
	cfg.Mode = LowLatency
	return llCombineBytes(cfg, ccfg, outType[T](), shared), nil
}

// llCombineBytes is CombineLowLatencyBytes of cfg and ccfg (defaults filled) for outputs
// of type out.
func llCombineBytes(cfg Config, ccfg CombineConfig, out dtype.Type, shared bool) int {
	p, es := cfg.Placement.Ranks, out.Size()
	f := newCombineFormat(cfg.Hidden, ccfg, out)
	board := boardSize(cfg, ccfg, p, es)
	if !shared {
		board = 0
	}
	n := board + coll.ExchangeBytes(llBackExchange(cfg, &f, board > 0), p, shared)
	switch {
	case board == 0 && ccfg.SumAtOrigin: // the own terms (termSums.own)
		n += cfg.InFlight * obuf.Capacity(f.Block(cfg.MaxTokens, cfg.MaxTokens*min(cfg.TopK, cfg.MaxLocalExperts)))
	case board == 0 && out != dtype.F32: // the sums in float32 (partialSums.own)
		n += cfg.InFlight * obuf.Capacity(cfg.MaxTokens*cfg.Hidden*4)
	}
	return n
}
