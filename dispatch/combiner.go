package dispatch

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
)

// The combine: each expert rank first sums, weighted, the outputs of its experts for the
// same token (in the order of the token's choices), so one answer per (token, rank) goes
// back, in the dispatch's mode, over the layout the dispatch left in its slot. The
// origin starts from the terms of the experts it holds itself (in float32), then adds
// the other ranks' partial sums in ascending rank order: a fixed order, so the result is
// bitwise identical run to run. How the answers move is the mode's (its back); what they
// are and how they are summed is the combiner's arithmetic (sums), picked at New:
// partial sums, unsummed terms (SumAtOrigin), the outputs read in place, or the gathered
// mode's reduce-scatter.

// back is a mode's combine half: it moves the blocks the slot's schedule lays out.
type back interface {
	// start sends this rank's answers (filled by the combiner's sums) and returns; wait
	// receives the others', checks every header and points cs.parts at the answers.
	start(ctx context.Context, cs *cstep) error
	wait(ctx context.Context, cs *cstep) error
	// inPlace reports whether the origins read the expert outputs where they were
	// written (no partial sums travel); buffer is where, for slot s's dispatch, this
	// rank's experts write them then (nil where they are not read in place).
	inPlace() bool
	buffer(d *dispatched) []byte
	// takesRows reports whether the way back can carry rows summed already
	// (CombineRows): a partial sum per incoming row.
	takesRows() bool
	bytes() int
	close() error
}

// sent is the part of the back interface of the ways back that send their answers
// (partial sums or terms) and take summed rows.
type sent struct{}

func (sent) buffer(*dispatched) []byte { return nil }
func (sent) takesRows() bool           { return true }

// sums is the combiner's arithmetic, which depends on the outputs' type.
type sums interface {
	// own, at Start, keeps what this rank's own tokens need of y.
	own(cs *cstep)
	// put writes into dst the answers to incoming rows [a, b).
	put(dst []byte, cs *cstep, a, b int)
	// finish, at Wait, writes the sums into out.
	finish(cs *cstep) error
}

// backCore is the part of a combiner that does not depend on the outputs' type.
type backCore struct {
	d     *core
	cfg   CombineConfig
	f     CombineFormat
	out   dtype.Type
	slots []*cslot
	n     uint64 // combines started
	// ways are the ways back of the protocols the dispatcher runs steps in, by kind
	// (the Auto mode has two; the others' back is nil). A combine takes the way of the
	// protocol that ran its dispatch (slot.m).
	ways   [numModes]way
	stats  CombineStats
	closed bool
	// regrow makes the way back anew for the grown buffers of m (the dispatcher's
	// low-latency mode, lowLatency.grow) and returns the close of the old one.
	regrow func(ctx context.Context, m *lowLatency) (func() error, error)
}

// CombineStats describes a combine: bytes each way, and what was read in place.
type CombineStats struct {
	BytesSent     int // on the wire from this rank, its own answers aside
	BytesReceived int // on the wire to this rank
	// BytesRead is what the last in-place combine read of other ranks' memory (the
	// expert outputs of this rank's tokens; 0 where the combine does not read in place).
	BytesRead int
	// InPlace: the combine read the expert outputs in place.
	InPlace bool
	// Algo is the normal mode's AlltoAllv algorithm.
	Algo coll.Algo
}

// way is one protocol's way back: how the answers move, and the arithmetic that makes
// and sums them.
type way struct {
	back back
	sums sums
}

// cstep is what a way back is handed to move one combine, and all it is handed: the
// dispatch it answers (its step: layout, counts, schedule; and its rows' maps), what
// every block's header says (status, fingerprint, generation), the experts' outputs and
// where the sums go, the arithmetic's scratch, and the call's bad input, which the rank
// still takes part with. Not the dispatcher's slot, nor the combiner's bookkeeping.
type cstep struct {
	cb    *backCore
	idx   int
	d     *dispatched // the dispatch being combined
	gen   uint64      // its generation
	fp    uint64      // the combine's fingerprint
	y     []byte
	out   []byte
	rows  bool // CombineRows: y holds a summed row per incoming row, not a row per entry
	code  int
	inErr error
	parts [][]byte // the answers each rank sent, where they arrived
	cnt   []int
	acc   []float32 // the sum being made: out itself for float32, else accS
	accS  obuf.Scratch
	algo  coll.Algo // the normal mode's AlltoAllv
	sums  sums      // what fills in this rank's answers (sums.put)
}

// cslot is one combine in flight: its step and the combiner's bookkeeping of it.
type cslot struct {
	cstep
	started bool
	s       *slot // the dispatch being combined, which the combine pins
	w       *way  // the way back of the protocol that ran it
	pinned  bool
}

// Combiner brings the expert outputs of one dispatcher's steps back to the ranks the
// tokens came from and sums them. Make it once with New, beside its dispatcher; Combine
// (or Start and Wait) runs a step's way back; Close frees its buffers. A Combiner is for
// one goroutine at a time.
type Combiner[T Out] struct {
	*backCore
	pending []CombinePending[T]
	chunkR  []router.Routing // Pipeline's chunks
}

// NewCombiner returns a combiner for the dispatches of d. In the low-latency mode it is
// collective (every rank calls it): it makes the exchange's buffers. A dispatcher serves
// one combine configuration: its schedules plan that combine's bytes.
func NewCombiner[T Out](ctx context.Context, src Source, ccfg CombineConfig) (*Combiner[T], error) {
	d := src.source()
	ccfg, err := combineDefaults(d.cfg, ccfg, outType[T]())
	if err != nil {
		return nil, err
	}
	if err := d.declare(ccfg, outType[T]()); err != nil {
		return nil, err
	}
	p := d.c.Size()
	cb := &backCore{d: d, cfg: ccfg, f: newCombineFormat(d.cfg.Hidden, ccfg, outType[T]()), out: outType[T]()}
	for i := 0; i < d.cfg.InFlight; i++ {
		cs := &cslot{cstep: cstep{cb: cb, idx: i, parts: make([][]byte, p)}}
		cs.accS.Pool = d.cfg.Pool
		cb.slots = append(cb.slots, cs)
	}
	for _, m := range d.mode.flats() {
		b, err := m.newBack(ctx, cb)
		if err != nil {
			cb.closeWays()
			return nil, err
		}
		cb.setWay(sumsFor[T](cb, m.kind(), b), m.kind(), b)
	}
	// Where the dispatcher's low-latency buffers grow (the Auto mode), this combiner's
	// way back grows with them, in the outputs' type.
	cb.regrow = func(ctx context.Context, m *lowLatency) (func() error, error) {
		nb, err := m.newBack(ctx, cb)
		if err != nil {
			return nil, err
		}
		old := cb.ways[LowLatency].back
		cb.setWay(sumsFor[T](cb, LowLatency, nb), LowLatency, nb)
		return old.close, nil
	}
	d.backs = append(d.backs, cb)
	return &Combiner[T]{backCore: cb, pending: make([]CombinePending[T], len(cb.slots))}, nil
}

// setWay makes b, with the arithmetic s, the way back of the protocol of kind k; the
// dispatcher's schedules then plan it.
func (cb *backCore) setWay(s sums, k Mode, b back) {
	cb.ways[k] = way{back: b, sums: s}
	cb.d.backInPlace[k] = b.inPlace()
}

// closeWays frees the ways back made.
func (cb *backCore) closeWays() error {
	var errs []error
	for _, w := range cb.ways {
		if w.back != nil {
			errs = append(errs, w.back.close())
		}
	}
	return errors.Join(errs...)
}

// sumsFor is the arithmetic of b, the way back of the protocol of kind k.
func sumsFor[T Out](cb *backCore, k Mode, b back) sums {
	switch {
	case b.inPlace():
		return newInPlaceSums[T](cb, b.(*inPlaceBack))
	case k == Gathered:
		return newGatheredSums[T](cb)
	case cb.cfg.SumAtOrigin:
		return &termSums[T]{cb: cb}
	}
	return newPartialSums[T](cb)
}

// last is the way back of the protocol of the dispatcher's last step.
func (cb *backCore) last() *way { return &cb.ways[cb.d.stats.Mode] }

// declare records the combine configuration the dispatcher serves: its schedules plan
// that combine. A second combiner of another configuration is ErrConfig.
func (d *core) declare(ccfg CombineConfig, out dtype.Type) error {
	if d.back != nil && (d.back.cfg != ccfg || d.back.out != out) {
		return fmt.Errorf("%w: a dispatcher serves one combine configuration (it has %+v of %v)", ErrConfig, d.back.cfg, d.back.out)
	}
	d.back = &declared{cfg: ccfg, out: out, f: newCombineFormat(d.cfg.Hidden, ccfg, out)}
	return nil
}

// declared is what a dispatcher's combiner declared.
type declared struct {
	cfg CombineConfig
	out dtype.Type
	f   CombineFormat
}

// Buffer returns where this rank's experts should write their outputs for the dispatch
// h belongs to (Output.Rows() x Hidden values, in entry order) for the combine to read
// them in place; nil where it does not (the normal and gathered modes, ranks that
// cannot all read one another's memory, SendPartials), or for a handle that is not
// valid. The memory is this dispatch's until the next dispatch into the same buffers.
// Combine with y anywhere else copies y there first.
func (cb *Combiner[T]) Buffer(h Handle) []T {
	if !h.of(cb.d) {
		return nil
	}
	return dtype.FromBytes[T](cb.ways[h.s.m.kind()].back.buffer(&h.s.dispatched))
}

// InPlace is Combiner.InPlace.
func (cb *backCore) InPlace() bool { return cb.last().back.inPlace() }

// Stats is Combiner.Stats.
func (cb *backCore) Stats() CombineStats { return cb.stats }

// Config is Combiner.Config.
func (cb *backCore) Config() CombineConfig { return cb.cfg }

// Bytes is Combiner.Bytes.
func (cb *backCore) Bytes() int {
	if cb.closed {
		return 0
	}
	n := 0
	for _, w := range cb.ways {
		if w.back != nil {
			n += w.back.bytes()
		}
	}
	for _, cs := range cb.slots {
		n += cs.accS.Cap()
	}
	return n
}

// Close is Combiner.Close.
func (cb *backCore) Close() error {
	if cb.closed {
		return nil
	}
	cb.closed = true
	cb.d.backs = slices.DeleteFunc(cb.d.backs, func(x *backCore) bool { return x == cb })
	for _, cs := range cb.slots {
		cs.acc = nil
		cs.accS.Release()
	}
	return cb.closeWays()
}

// CombinePending is a combine in flight: Wait completes it.
type CombinePending[T Out] struct {
	cs *cslot
	n  uint64
}

// Combine takes the experts' outputs y (one row of Hidden values per entry of the
// dispatch Output that h belongs to, in entry order: Output.Rows() x Hidden) and writes
// into out (Tokens x Hidden) the weighted sum, for each of this rank's tokens, of its
// experts' outputs. Every rank must call it. Tokens whose every choice was dropped get
// zeros. A stale or foreign handle, or buffers of the wrong length, fail this rank with
// ErrStale or ErrCombineInput and every other rank with a *PeerInputError
// naming it, in the same call. It is Start followed by Wait.
func (cb *Combiner[T]) Combine(ctx context.Context, h Handle, y, out []T) error {
	p, err := cb.Start(ctx, h, y, out)
	if err != nil {
		return err
	}
	return p.Wait(ctx)
}

// Start is the send half of Combine: it sums this rank's experts' outputs per token and
// sends them; y is not read after Start returns, out is written until Wait returns. In
// place (Buffer), Start only says that the outputs are there (copying y there first if
// it is elsewhere), and Wait does the sums.
func (cb *Combiner[T]) Start(ctx context.Context, h Handle, y, out []T) (*CombinePending[T], error) {
	return cb.start(ctx, h, dtype.Bytes(y), dtype.Bytes(out), len(y), len(out), false, nil)
}

// CombineRows is Combine for expert outputs already weighted and summed on this rank: y
// holds one row per incoming row of the dispatch (a token that came to this rank,
// however many of its experts it chose here: Handle.IncomingRows() x Hidden, origin
// rank ascending, then the origin's token order; Handle.Contributions says which
// entries and weights make each), and each goes back to its origin as it is, to be
// added there to the token's other partial sums. Not in the gathered mode, nor with
// SumAtOrigin.
func (cb *Combiner[T]) CombineRows(ctx context.Context, h Handle, y, out []T) error {
	p, err := cb.start(ctx, h, dtype.Bytes(y), dtype.Bytes(out), len(y), len(out), true, nil)
	if err != nil {
		return err
	}
	return p.Wait(ctx)
}

// abandon takes part in the combine the other ranks run (see start) with a status that
// fails theirs, because this rank cannot combine: the stage before failed here. It
// returns cause, and what else went wrong.
func (cb *Combiner[T]) abandon(ctx context.Context, cause error) error {
	p, err := cb.start(ctx, Handle{}, nil, nil, 0, 0, false, cause)
	if err == nil {
		err = p.Wait(ctx)
	}
	if err == nil || errors.Is(err, cause) {
		return cause
	}
	return errors.Join(cause, err)
}

// start begins a combine of h. A rank whose call is bad (the handle, the lengths), or
// that gives up (giveUp, from abandon), still takes part, with a status that fails
// every rank's call.
func (cb *Combiner[T]) start(ctx context.Context, h Handle, y, out []byte, ny, nout int, rows bool, giveUp error) (*CombinePending[T], error) {
	d := cb.d
	cs := cb.slots[cb.n%uint64(len(cb.slots))]
	if cs.started {
		return nil, fmt.Errorf("%w: combine %d would reuse the buffers of a combine not waited for", ErrBusy, cb.n+1)
	}
	s, gen := h.s, h.gen
	hid := d.cfg.Hidden
	cs.code, cs.inErr = codeOK, nil
	bad := giveUp
	if bad == nil {
		bad = badHandle(h, d)
	}
	if bad != nil {
		// This rank still takes part, in the combine the others run, with a status that
		// fails theirs: every rank fails in this call, and the pair stays usable. Their
		// combine is, as combines follow dispatches, that of the dispatch now in the
		// stale handle's buffers, else of the oldest dispatch not combined yet (the
		// low-latency mode's blocks do not depend on which).
		if s = d.uncombined(); h.s != nil && h.s.d == d && h.s.valid && !h.s.combined && h.s.pins == 0 {
			s = h.s
		}
		if s == nil {
			return nil, fmt.Errorf("%w (and no dispatch of this dispatcher waits for its combine)", bad)
		}
		gen, cs.code, cs.inErr = s.gen, codeOf(bad), bad
	}
	switch {
	case cs.code != codeOK:
	case nout != s.tokens*hid:
		cs.code, cs.inErr = codeOutput, fmt.Errorf("%w: output of %d values for %d tokens of %d", ErrCombineInput, nout, s.tokens, hid)
	case !rows && ny != s.rowsOut*hid:
		cs.code, cs.inErr = codeOutput, fmt.Errorf("%w: %d expert output values, the dispatch delivered %d rows of %d", ErrCombineInput, ny, s.rowsOut, hid)
	case rows && ny != s.incomingRows()*hid:
		cs.code, cs.inErr = codeOutput, fmt.Errorf("%w: %d summed values, %d rows of %d came to this rank", ErrCombineInput, ny, s.incomingRows(), hid)
	case rows && cb.cfg.SumAtOrigin:
		cs.code, cs.inErr = codeOutput, fmt.Errorf("%w: CombineRows with SumAtOrigin (the rows are summed already)", ErrConfig)
	}
	w := &cb.ways[s.m.kind()]
	if rows && !w.back.takesRows() {
		return nil, fmt.Errorf("%w: summed rows in the %v mode", ErrConfig, s.m.kind())
	}
	cs.s, cs.d, cs.w, cs.sums, cs.gen, cs.y, cs.out, cs.rows = s, &s.dispatched, w, w.sums, gen, y, out, rows
	cs.fp = combineFingerprint(s.fp, cb.cfg, cb.out)
	if cs.code == codeOK {
		s.pins++
		s.combined = true
		cs.pinned = true
		cs.sums.own(&cs.cstep)
	}
	if err := w.back.start(ctx, &cs.cstep); err != nil {
		if cs.code == codeOK {
			s.combined = false
		}
		cs.unpin()
		return nil, err
	}
	cb.n++
	cs.started = true
	p := &cb.pending[cs.idx]
	*p = CombinePending[T]{cs: cs, n: cb.n}
	return p, nil
}

// badHandle says what is wrong with h as the handle of a combine on d: ErrStale for a
// zero handle, one of another dispatcher, one whose buffers a later dispatch reused,
// or one combined already; nil for a good one.
func badHandle(h Handle, d *core) error {
	switch {
	case h.s == nil:
		return fmt.Errorf("%w: a zero handle (not one that Dispatch returned)", ErrStale)
	case h.s.d != d:
		return fmt.Errorf("%w: the handle is another dispatcher's", ErrStale)
	case !h.Valid():
		return fmt.Errorf("%w: the handle's dispatch was overwritten by a later one (InFlight %d) or its dispatcher closed", ErrStale, len(d.slots))
	case h.s.combined:
		return errCombined
	}
	return nil
}

// errCombined is badHandle's answer for the handle of a dispatch combined already (which
// Redispatch may still take).
var errCombined = fmt.Errorf("%w: the handle's dispatch was combined already", ErrStale)

func (cs *cslot) unpin() {
	if cs.pinned {
		cs.s.pins--
		cs.pinned = false
	}
}

// Wait is the receive half of Combine: it waits for the other ranks' partial sums (or
// reads the outputs in place) and writes out. Call it once.
func (p *CombinePending[T]) Wait(ctx context.Context) error {
	cs := p.cs
	if !cs.started {
		return fmt.Errorf("%w: Wait called twice", ErrStale)
	}
	cs.started = false
	defer cs.unpin()
	cb := cs.cb
	err := cs.w.back.wait(ctx, &cs.cstep)
	cs.y = nil
	if err == nil && cs.inErr != nil {
		err = cs.inErr
	}
	if err != nil {
		if cs.code == codeOK && cs.s.gen == cs.gen {
			cs.s.combined = false // it failed on every rank: the handle may be combined again
		}
		return err
	}
	// Every rank has started this combine, so its experts read no more of the
	// dispatch's rows: this rank may write its staging again.
	if (Handle{s: cs.s, gen: cs.gen}).Valid() {
		cs.s.m.combined(cs.s.idx)
	}
	me := cb.d.c.Rank()
	st := &cs.s.sched.Combine
	cb.stats = CombineStats{BytesSent: st.Sent(me), BytesReceived: st.Received(me), InPlace: cs.w.back.inPlace(), Algo: cs.algo}
	return cs.sums.finish(&cs.cstep)
}

// checkBlock checks the header of the block rank q sent: the same configuration, the
// same dispatch, and its status (it answers the rows this rank sent q).
func (cs *cstep) checkBlock(q int, hb []byte) error {
	if len(hb) < blockHeader {
		return fmt.Errorf("%w: rank %d sent a %d-byte combine block", ErrMismatch, q, len(hb))
	}
	rows := 0
	if cs.code == codeOK {
		rows = cs.d.sched.Combine.Recv[q].Rows
	}
	return cs.checkHeader(q, hb, rows)
}

// checkHeader checks the header of the block rank q sent, which should answer rows
// rows.
func (cs *cstep) checkHeader(q int, hb []byte, rows int) error {
	h := readHeader(hb)
	switch {
	case h.fp != cs.fp:
		return fmt.Errorf("%w: rank %d combines the dispatches of another configuration or placement", ErrMismatch, q)
	case h.status == codeOK && cs.code == codeOK && h.gen != cs.gen:
		return fmt.Errorf("%w: rank %d combines dispatch %d, this rank dispatch %d", ErrMismatch, q, h.gen, cs.gen)
	case h.status != codeOK:
		return peerInput(q, h.status)
	case cs.code == codeOK && h.rows != rows:
		return fmt.Errorf("%w: rank %d sends %d partial sums for the %d rows this rank sent it", ErrMismatch, q, h.rows, rows)
	}
	return nil
}

// InPlace reports whether the combine reads the expert outputs in place (Buffer); in
// the Auto mode, that of the last dispatch's mode.
func (cb *Combiner[T]) InPlace() bool { return cb.backCore.InPlace() }

// Stats describes the last combine.
func (cb *Combiner[T]) Stats() CombineStats { return cb.backCore.Stats() }

// Config returns the combine's configuration, defaults filled.
func (cb *Combiner[T]) Config() CombineConfig { return cb.backCore.Config() }

// Bytes is the memory this rank holds for the combiner's buffers (address space: a page
// takes memory when first written): in the low-latency mode most of it is fixed by New
// (CombineLowLatencyBytes says it beforehand); elsewhere scratch buffers grow to the largest
// combine so far. The caller's memory does not count. It is 0 after Close.
func (cb *Combiner[T]) Bytes() int { return cb.backCore.Bytes() }

// Close gives the combiner's buffers back to their pool; it must not be used again.
func (cb *Combiner[T]) Close() error { return cb.backCore.Close() }
