package dispatch

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/internal/memx"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
)

// Stats describes a dispatch: rows and bytes each way, the algorithm, whether the rows
// were read in place.
type Stats struct {
	RowsSent      int   // rows this rank sent to other ranks (each token once per rank)
	RowsReceived  int   // rows it received from other ranks
	BytesSent     int   // bytes on the wire from this rank (its own rows aside)
	BytesReceived int   // bytes on the wire to this rank
	Assignments   int   // (token, expert) choices of this rank's tokens
	RowsPerRank   []int // rows this rank sent to each rank, itself included
	// Algo is the normal mode's AlltoAllv algorithm.
	Algo coll.Algo
	// Pushed, in the low-latency mode, is how many ranks this rank wrote its rows into
	// directly.
	Pushed int
	// PackedBytes is what Config.ExpertMajor copied to lay out expert-major rows that
	// the mode would have left where they arrived (0 in the normal mode).
	PackedBytes int
	// Put, in the low-latency mode, is how many ranks this rank put its rows into with
	// one-sided operations (UCX windows: a put, a fence and a signal; the receiver posts
	// no receive).
	Put int
	// InPlace, in the low-latency mode: this rank wrote its tokens once into its own
	// staging and the other ranks read them there (the bytes above count those reads).
	InPlace bool
	// Mode is the mode the dispatch ran in (in the Auto mode, the one the step took).
	Mode Mode
}

// mode is how a dispatcher moves its steps: one protocol (a flat mode: normal,
// low-latency, gathered) or, in the Auto mode, a choice among two per step. New picks
// it once; nothing on a step's path asks which it is.
//
// A mode is handed a step (what the plan says to move, and all it is handed) and never
// the dispatcher's slot: the slot's lifecycle, the experts' view and the Stats are the
// dispatcher's, which builds the view from the rows a mode says arrived.
type mode interface {
	// start begins step st and sets st.m to the protocol that runs it; wait completes
	// it and returns where the rows arrived.
	start(ctx context.Context, st *step) error
	wait(ctx context.Context, st *step) (arrived, error)
	// flats are the protocols the mode runs steps in: a combiner makes a way back for
	// each.
	flats() []flat
	// capacity is the most tokens a dispatch may carry (0: any number).
	capacity() int
	// readsInPlace reports whether the experts read the rows where their origins staged
	// them (for the last step); staging is where this rank may write the tokens of a
	// dispatch into the buffers idx (a slot not in use) so that it stages nothing (nil:
	// nowhere, or not now).
	readsInPlace() bool
	staging(idx int) []byte
	// bytes is the memory the mode holds beyond the slots' scratch; close frees it.
	bytes() int
	close() error
}

// flat is one protocol. It owns both halves: the dispatch (start sends this rank's rows
// of a step, wait receives the others') and, through newBack, the combine's. Its
// executors iterate the step's Schedule, which its planner lays out.
type flat interface {
	mode
	kind() Mode    // the mode a step it runs ran in (Stats.Mode, Schedule.Mode)
	plan() planner // its planner
	// newBack makes the combine half for a combiner of cb's configuration.
	newBack(ctx context.Context, cb *backCore) (back, error)
	// combined says that every rank has started the combine of the dispatch in the
	// buffers idx: no rank reads its rows any more.
	combined(idx int)
}

// step is what a protocol is handed to move one dispatch, and all it is handed: this
// rank's input (x, its tokens, their routing and placement), the plan (the layout: the
// rows for each peer; the counts; the schedule: every block's rows, bytes and offsets),
// what every block's header says (status, fingerprint, generation), which of the
// protocol's buffers it runs in (idx), and the step's bad input, which the rank still
// takes part with. The protocol fills in the receive side of the counts and schedule,
// and says how its blocks went (moved).
type step struct {
	idx    int
	gen    uint64 // the dispatch it holds
	tokens int
	asked  int // the tokens this rank's dispatch asked to send (its routing's, valid or not)
	r      *router.Routing
	pl     *router.Placement // the placement it was dispatched with
	fp     uint64            // and its fingerprint
	layout router.Layout
	m      flat // the protocol that runs (or ran) the dispatch
	sched  Schedule
	k      counts
	// This dispatch's input (as bytes), and its input error, if any: the rank still
	// takes part, then Wait returns it.
	x     []byte
	code  int
	inErr error
	reuse bool // Redispatch: the layout and schedule of the last dispatch
	moved moved
}

// moved is how a protocol's blocks went: Stats' Pushed, Put, InPlace and Algo.
type moved struct {
	pushed, put int
	inPlace     bool
	algo        coll.Algo
}

// arrived is where a protocol's wait found the rows: the dispatcher builds the view
// from it (placed as place says; rg: placeRegion's rows).
type arrived struct {
	src   rowSource
	place placement
	rg    region
}

// rowMaps are a dispatch's incoming rows, in order (origin rank ascending, then the
// origin's token order): originStart[s] is the first incoming row from origin s; the
// entries of row i (and their router weights) are entries[start[i]:start[i+1]]. The
// view builds them; the combine walks them back.
type rowMaps struct {
	originStart []int
	start       []int32
	entries     []int32
	weights     []float32
	rowsOut     int // entries (expert-major rows), padding included
}

// dispatched is what a step leaves for its combine: the step and its rows' maps. The
// ways back are handed it, not the slot.
type dispatched struct {
	step
	rowMaps
}

// unstaged is the part of the flat interface of the modes that stage nothing in place
// and take any number of tokens (normal, gathered).
type unstaged struct{}

func (unstaged) capacity() int      { return 0 }
func (unstaged) readsInPlace() bool { return false }
func (unstaged) staging(int) []byte { return nil }
func (unstaged) combined(int)       {}

// core is the part of a dispatcher that does not depend on the activation type: its
// configuration, its slots and its mode.
type core struct {
	c     *coll.Comm
	cfg   Config
	act   dtype.Type
	f     Format
	fp    uint64
	fpBuf []byte // UsePlacement's encoding of the configuration
	gen   uint64 // dispatches begun
	slots []*slot
	mode  mode
	llc   int // the host's last-level cache, bytes (0: unknown)
	stats Stats
	// arrival (the normal mode, for TwoLevel's up stage): the rows stay in arrival
	// order, one per incoming row (X row i is incoming row i), and the entries point at
	// them, instead of a copy per entry in expert-major blocks.
	arrival bool
	closed  bool
	stage   obuf.Scratch // this rank's own rows in the wire format (the normal mode)
	pk      packer
	cs      []contrib // a row's (local expert, weight) pairs, as read
	fill    []int     // entries filled per local expert
	in      inRow     // the row a rowSource reads (here: through the interface it would escape)
	// The combine the dispatcher's combiner declared (nil until one is made), and
	// whether it reads the outputs in place: the schedules plan it.
	back        *declared
	backInPlace [numModes]bool // per flat mode (kind)
	backs       []*backCore    // the combiners made for this dispatcher (lowLatency.grow)
	retired     []func() error // the buffers a growth replaced, freed after the step
}

// numModes bounds the modes, to index what is kept per flat mode.
const numModes = int(Gathered) + 1

// slot states.
const (
	slotIdle    = iota
	slotStarted // a dispatch was started and not waited for
)

// slot is one of the dispatcher's buffers of a dispatch: the step and its rows' maps
// (dispatched: what the protocol and the way back are handed), the experts' view, the
// Stats and the slot's lifecycle (the dispatcher's and the combiner's alone). A Handle
// names it.
type slot struct {
	dispatched
	d     *core
	state int
	pins  int  // running combines
	valid bool // holds a complete dispatch
	view  view
	xS    obuf.Scratch // the rows decoded for the experts
	stats Stats
	// combined: a combine of this dispatch has started on this rank.
	combined bool
}

// view is the non-generic part of an Output.
type view struct {
	x, q                []byte
	scales              []float32
	offsets, counts     []int
	row, origin, source []int32
	weight              []float32
	expert              []int32
	expertMajor         bool
}

// Dispatcher moves tokens to experts over one communicator. Make one with New, before
// serving, and use it for every MoE layer of a model (UsePlacement switches layers);
// Dispatch (or Start and Wait) runs a step; Close frees its buffers. A Dispatcher is for
// one goroutine at a time.
type Dispatcher[T Act] struct {
	*core
	outs    []Output[T]
	pending []Pending[T]
}

// options are what the engine's own stages set beside a Config.
type options struct {
	// Arrival keeps the normal mode's rows in arrival order (TwoLevel's up stage).
	Arrival bool
	agreed  bool // the ranks agreed on the configuration already (newAuto's stages)
}

// New returns a dispatcher for c. It is collective (every rank calls it with the same
// configuration) in the modes with buffers sized once (low-latency, Auto): it makes the
// exchange's buffers. A configuration that is not valid is ErrConfig.
func New[T Act](ctx context.Context, c *coll.Comm, cfg Config) (*Dispatcher[T], error) {
	return newWith[T](ctx, c, cfg, options{})
}

// newWith is New with the engine's options.
func newWith[T Act](ctx context.Context, c *coll.Comm, cfg Config, o options) (*Dispatcher[T], error) {
	cfg, err := Defaults[T](cfg)
	if err != nil {
		return nil, err
	}
	if cfg.Placement.Ranks != c.Size() {
		return nil, fmt.Errorf("%w: placement over %d ranks on a communicator of %d", ErrConfig, cfg.Placement.Ranks, c.Size())
	}
	if (cfg.Mode == Auto || cfg.Mode == LowLatency) && !o.agreed {
		// New is collective in these modes: agree first, so that a rank with another
		// configuration is named with the field, before any buffer is made.
		if err := agreeConfig(ctx, c, cfg); err != nil {
			return nil, err
		}
		o.agreed = true
	}
	if cfg.Pool == nil {
		cfg.Pool = obuf.Default
		if c.SharedMemory() {
			cfg.Pool = obuf.Shared
		}
	}
	co := &core{c: c, cfg: cfg, act: actType[T](), f: NewFormat(cfg), llc: memx.LastLevelCache(), arrival: o.Arrival}
	co.fp, co.fpBuf = fingerprint(nil, cfg)
	co.stage.Pool = cfg.Pool
	d := &Dispatcher[T]{core: co, outs: make([]Output[T], cfg.InFlight), pending: make([]Pending[T], cfg.InFlight)}
	for i := 0; i < cfg.InFlight; i++ {
		s := &slot{d: co}
		s.idx = i
		s.xS.Pool = cfg.Pool
		co.slots = append(co.slots, s)
	}
	co.stats.RowsPerRank = make([]int, c.Size())
	switch cfg.Mode {
	case Auto:
		co.mode, err = newAuto(ctx, co)
	case LowLatency:
		co.mode, err = newLowLatency(ctx, co)
	case Gathered:
		co.mode = newGathered(co)
	default:
		co.mode = newNormal(co)
	}
	if err != nil {
		return nil, err
	}
	co.stats.Mode = co.mode.flats()[0].kind() // what InPlace and RowsInPlace say before a step
	return d, nil
}

// othersFree says whether no slot but the one of buffers idx is in use: started and not
// waited for, pinned by a running combine, or holding a dispatch not combined yet.
// Growing the buffers (lowLatency.grow) reuses every slot's.
func (d *core) othersFree(idx int) bool {
	for _, o := range d.slots {
		if o.idx != idx && (o.state == slotStarted || o.pins > 0 || o.valid && !o.combined) {
			return false
		}
	}
	return true
}

func tokensOf(r *router.Routing) int {
	if r == nil {
		return 0
	}
	return r.T
}

// source makes every dispatcher a Source of a combiner.
func (d *core) source() *core { return d }

// Source is what a combiner is made for: a dispatcher, of any activation type.
type Source interface{ source() *core }

// UsePlacement is Dispatcher.UsePlacement.
func (d *core) UsePlacement(pl *router.Placement) error {
	switch {
	case pl == nil:
		return fmt.Errorf("%w: no placement", ErrConfig)
	case pl == d.cfg.Placement:
		return nil
	case pl.Ranks != d.c.Size():
		return fmt.Errorf("%w: placement over %d ranks on a communicator of %d", ErrConfig, pl.Ranks, d.c.Size())
	case pl.Experts < d.cfg.TopK:
		return fmt.Errorf("%w: top-k %d with %d experts", ErrConfig, d.cfg.TopK, pl.Experts)
	case maxLocal(pl) > d.cfg.MaxLocalExperts:
		return fmt.Errorf("%w: a rank holds %d experts, MaxLocalExperts is %d", ErrConfig, maxLocal(pl), d.cfg.MaxLocalExperts)
	}
	d.cfg.Placement = pl
	d.fp, d.fpBuf = fingerprint(d.fpBuf, d.cfg)
	return nil
}

// Config is Dispatcher.Config.
func (d *core) Config() Config { return d.cfg }

// Comm is Dispatcher.Comm.
func (d *core) Comm() *coll.Comm { return d.c }

// Stats is Dispatcher.Stats.
func (d *core) Stats() Stats {
	st := d.stats
	st.RowsPerRank = slices.Clone(st.RowsPerRank)
	return st
}

// Pending is a dispatch whose rows are on their way: Wait completes it.
type Pending[T Act] struct {
	d   *Dispatcher[T]
	s   *slot
	gen uint64
}

// Dispatch sends this rank's tokens x (Tokens x Hidden values, row-major) to the
// experts r chose and returns what this rank's experts receive, with the handle of the
// step for the combine. Every rank must call it (a rank with no tokens passes empty x
// and routing). A rank whose input is bad gets ErrInput and every other rank a
// *PeerInputError naming it, in the same call; the communicator stays usable. It is
// Start followed by Wait.
func (d *Dispatcher[T]) Dispatch(ctx context.Context, x []T, r *router.Routing) (*Output[T], Handle, error) {
	p, err := d.Start(ctx, x, r)
	if err != nil {
		return nil, Handle{}, err
	}
	return p.Wait(ctx)
}

// Start is the send half of Dispatch: it checks the input, plans, packs and sends, and
// returns without waiting for the other ranks' rows. x and r must stay unchanged until
// Wait returns. It fails with ErrBusy where the buffers it would take are still in use.
func (d *Dispatcher[T]) Start(ctx context.Context, x []T, r *router.Routing) (*Pending[T], error) {
	s, err := d.take()
	if err != nil {
		return nil, err
	}
	code, inErr := d.check(len(x), r)
	s.asked = tokensOf(r)
	return d.startSlot(ctx, s, dtype.Bytes(x), r, code, inErr, false)
}

// take reserves the next slot, unless its buffers are still in use.
func (d *core) take() (*slot, error) {
	if d.closed {
		return nil, fmt.Errorf("%w: dispatcher closed", coll.ErrClosed)
	}
	s := d.slots[int(d.gen%uint64(len(d.slots)))]
	switch {
	case s.state == slotStarted:
		return nil, fmt.Errorf("%w: dispatch %d would reuse the buffers of dispatch %d, not waited for (InFlight %d)", ErrBusy, d.gen+1, s.gen, len(d.slots))
	case s.pins > 0:
		return nil, fmt.Errorf("%w: dispatch %d would reuse the buffers of dispatch %d, whose combine runs (InFlight %d)", ErrBusy, d.gen+1, s.gen, len(d.slots))
	}
	d.gen++
	s.gen, s.valid, s.combined = d.gen, false, false
	s.pl, s.fp = d.cfg.Placement, d.fp
	return s, nil
}

// uncombined is the slot of the oldest dispatch that completed here and has not been
// combined: the one every other rank combines when this rank's combine call is bad, as
// combines follow dispatches in order. Nil when there is none.
func (d *core) uncombined() *slot {
	var oldest *slot
	for _, s := range d.slots {
		if s.valid && !s.combined && s.state == slotIdle && s.pins == 0 && (oldest == nil || s.gen < oldest.gen) {
			oldest = s
		}
	}
	return oldest
}

// startSlot hands the slot to the mode. A rank whose input is bad (code) still takes
// part, so that every rank fails in the same call.
func (d *Dispatcher[T]) startSlot(ctx context.Context, s *slot, x []byte, r *router.Routing, code int, inErr error, reuse bool) (*Pending[T], error) {
	if !reuse && code == codeOK {
		if err := router.BuildLayoutInto(&s.layout, r, s.pl, d.c.Rank()); err != nil {
			code, inErr = codeRouting, fmt.Errorf("%w: %v", ErrInput, err)
		} else {
			s.tokens, s.r = r.T, r
		}
	}
	s.x, s.code, s.inErr, s.reuse = x, code, inErr, reuse
	s.moved = moved{}
	if err := d.mode.start(ctx, &s.step); err != nil {
		return nil, err
	}
	s.state = slotStarted
	p := &d.pending[s.idx]
	*p = Pending[T]{d: d, s: s, gen: s.gen}
	return p, nil
}

// Wait is the receive half of Dispatch: it waits for the other ranks' rows and returns
// what this rank's experts receive, with the step's handle. Call it once.
func (p *Pending[T]) Wait(ctx context.Context) (*Output[T], Handle, error) {
	s, d := p.s, p.d
	if p.gen != s.gen || s.state != slotStarted {
		return nil, Handle{}, fmt.Errorf("%w: Wait called twice, or after the dispatcher moved on", ErrStale)
	}
	a, err := d.mode.wait(ctx, &s.step)
	if err == nil {
		err = s.arrive(a)
	}
	s.state = slotIdle
	s.x = nil
	if err != nil {
		return nil, Handle{}, err
	}
	s.valid = true
	d.stats = s.stats
	d.stats.Mode = s.m.kind()
	o := &d.outs[s.idx]
	o.fill(s)
	return o, o.h, nil
}

// Abandon takes part in a dispatch that this rank cannot make (its router failed, for
// instance): the other ranks' Dispatch returns a *PeerInputError naming this rank, in
// the same call, instead of waiting; the communicator stays usable. It returns cause.
func (d *Dispatcher[T]) Abandon(ctx context.Context, cause error) error {
	s, err := d.take()
	if err != nil {
		return errors.Join(cause, err)
	}
	p, err := d.startSlot(ctx, s, nil, nil, codeOf(cause), cause, false)
	if err != nil {
		return errors.Join(cause, err)
	}
	if _, _, err := p.Wait(ctx); err != nil && !errors.Is(err, cause) {
		return errors.Join(cause, err)
	}
	return cause
}

// Redispatch moves new activations x with the routing of h (same tokens, same experts):
// the layout and plan of h are reused (in the normal mode, no counts exchange), and h
// and its Output stay valid. Every rank must call it. A handle that is not valid is
// ErrStale; one whose buffers are in use, ErrBusy.
func (d *Dispatcher[T]) Redispatch(ctx context.Context, h Handle, x []T) (*Output[T], error) {
	if err := badHandle(h, d.core); err != nil && !errors.Is(err, errCombined) {
		return nil, err
	}
	s := h.s
	if s.state == slotStarted || s.pins > 0 {
		return nil, fmt.Errorf("%w: the dispatch's buffers are in use", ErrBusy)
	}
	code, inErr := codeOK, error(nil)
	if len(x) != s.tokens*d.cfg.Hidden {
		code, inErr = codeShape, fmt.Errorf("%w: %d values for %d tokens of %d", ErrInput, len(x), s.tokens, d.cfg.Hidden)
	}
	p, err := d.startSlot(ctx, s, dtype.Bytes(x), s.r, code, inErr, true)
	if err != nil {
		return nil, err
	}
	out, _, err := p.Wait(ctx)
	return out, err
}

// check validates this rank's input of n values, returning its status code.
func (d *core) check(n int, r *router.Routing) (int, error) {
	t, err := checkRouting(d.cfg, r)
	if err != nil {
		return codeRouting, err
	}
	if n != t*d.cfg.Hidden {
		return codeShape, fmt.Errorf("%w: %d values for %d tokens of %d", ErrInput, n, t, d.cfg.Hidden)
	}
	if c := d.mode.capacity(); c > 0 && t > c {
		return codeTooMany, fmt.Errorf("%w: %d tokens, MaxTokens is %d", ErrInput, t, c)
	}
	return codeOK, nil
}

// Close is Dispatcher.Close.
func (d *core) Close() error {
	if d.closed {
		return nil
	}
	d.closed = true
	d.gen++
	for _, s := range d.slots {
		s.valid = false
		s.view = view{}
		s.xS.Release()
	}
	d.stage.Release()
	return errors.Join(d.retire(), d.mode.close())
}

// Bytes is Dispatcher.Bytes.
func (d *core) Bytes() int {
	if d.closed {
		return 0
	}
	n := d.stage.Cap() + d.mode.bytes()
	for _, s := range d.slots {
		n += s.xS.Cap()
	}
	return n
}

// RowsInPlace is Dispatcher.RowsInPlace.
func (d *core) RowsInPlace() bool { return d.mode.readsInPlace() }

// Buffer is where this rank may write the tokens of its next Start (Hidden values per
// token, at most MaxTokens tokens) so that the dispatch copies nothing of them: the
// staging the experts read in place. It is nil unless the rows are read in place
// (RowsInPlace) in the activation type (the wire type is the activation type) and the
// staging is free (the combine of the last dispatch into it has completed). A Start
// whose x is Buffer()[:T*Hidden] stages nothing; the memory is the other ranks' to read
// until the combine of that dispatch completes, and must not be written meanwhile.
func (d *Dispatcher[T]) Buffer() []T {
	if d.closed {
		return nil
	}
	s := d.slots[int(d.gen%uint64(len(d.slots)))]
	if s.state == slotStarted || s.pins > 0 {
		return nil
	}
	b := d.mode.staging(s.idx)
	if b == nil {
		return nil
	}
	n := d.cfg.MaxTokens * d.cfg.Hidden
	return dtype.FromBytes[T](b)[:n:n]
}

// plan lays out the step's schedule from its counts: the dispatch, and the combine the
// dispatcher's combiner declared (partial sums in the activation type, f32 for opaque
// rows, where none did yet).
func (d *core) plan(s *step) {
	var f CombineFormat
	if d.back != nil {
		f = d.back.f
	} else {
		out := d.act
		if out == dtype.U8 {
			out = dtype.F32
		}
		f = newCombineFormat(d.cfg.Hidden, CombineConfig{PartialDType: out}, out)
	}
	planStep(&s.sched, s.m.kind(), s.m.plan(), d.c.Rank(), d.c.Size(), d.f, f, &s.k, d.backInPlace[s.m.kind()])
}

// planStep lays out rank me's schedule of a step from its counts with the mode's
// planner: what a dispatcher runs (core.plan) and what NewPlan returns for every rank.
func planStep(sc *Schedule, mode Mode, pn planner, me, p int, f Format, cf CombineFormat, k *counts, outsInPlace bool) {
	sc.Mode, sc.Rank, sc.Ranks, sc.Control = mode, me, p, pn.control(p)
	pn.dispatch(&sc.Dispatch, f, me, k)
	pn.combine(&sc.Combine, cf, me, k, outsInPlace)
}

// contribs is a scratch of TopK (local expert, weight) pairs.
func (d *core) contribs() []contrib {
	if cap(d.cs) < d.cfg.TopK {
		d.cs = make([]contrib, 0, d.cfg.TopK)
	}
	return d.cs[:0]
}

// fillScratch returns a zeroed counter per local expert.
func (d *core) fillScratch(n int) []int {
	d.fill = growInts(d.fill, n)
	clear(d.fill)
	return d.fill
}

// incoming fills the slot's incoming-row maps from per-origin rows: it sizes them.
func (s *slot) allocEntries(total, incomingRows, contribs int) {
	v := &s.view
	v.row = growI32(v.row, total)
	v.origin = growI32(v.origin, total)
	v.source = growI32(v.source, total)
	v.weight = growF32(v.weight, total)
	v.expert = growI32(v.expert, total)
	s.originStart = growInts(s.originStart, s.d.c.Size()+1)
	s.start = growI32(s.start, incomingRows+1)
	s.entries = growI32(s.entries, contribs)
	s.weights = growF32(s.weights, contribs)
	s.rowsOut = total
}

// layoutEntries sets the view's offsets from its counts (each block padded to align)
// and returns the number of entries.
func (v *view) layoutEntries(align int) int {
	total := 0
	for i, c := range v.counts {
		v.offsets[i] = total
		total += (c + align - 1) / align * align
	}
	v.offsets[len(v.counts)] = total
	return total
}

// startCounts sizes the view's per-expert counts for n local experts, zeroed.
func (v *view) startCounts(n int) {
	v.counts = growInts(v.counts, n)
	clear(v.counts)
	v.offsets = growInts(v.offsets, n+1)
}

// padEntries marks the padding entries, zeroing their rows when the rows are
// expert-major (zero).
func (s *slot) padEntries(zero bool) {
	v := &s.view
	d := s.d
	hid := d.cfg.Hidden
	es := d.act.Size()
	local := s.pl.Local[d.c.Rank()]
	for i, c := range v.counts {
		for j := v.offsets[i] + c; j < v.offsets[i+1]; j++ {
			if zero {
				if v.x != nil {
					clear(v.x[j*hid*es : (j+1)*hid*es])
				} else {
					clear(v.q[j*d.f.Payload : (j+1)*d.f.Payload])
					clear(v.scales[j*d.f.Scales : (j+1)*d.f.Scales])
				}
			}
			v.row[j], v.origin[j], v.source[j], v.weight[j], v.expert[j] = -1, -1, -1, 0, int32(local[i])
		}
	}
}

// countsOf sets the counts of what rank me of p sends from its layout (rows and choices
// per destination) and sizes the rest.
func (s *step) countsOf(p, me int, ok bool) *counts {
	k := &s.k
	k.rowsTo, k.choicesTo = growInts(k.rowsTo, p), growInts(k.choicesTo, p)
	k.rowsFrom, k.choicesFrom = growInts(k.rowsFrom, p), growInts(k.choicesFrom, p)
	k.tokens = growInts(k.tokens, p)
	clear(k.rowsTo)
	clear(k.choicesTo)
	clear(k.rowsFrom)
	clear(k.choicesFrom)
	clear(k.tokens)
	if ok {
		for q, rows := range s.layout.Rows {
			k.rowsTo[q], k.choicesTo[q] = len(rows), s.layout.Choices[q]
		}
		k.tokens[me] = s.tokens
	}
	return k
}

// arrive makes the slot's Stats and the experts' view of the rows a protocol's wait
// says arrived.
func (s *slot) arrive(a arrived) error {
	s.finishStats()
	st := &s.stats
	st.Pushed, st.Put, st.InPlace, st.Algo = s.moved.pushed, s.moved.put, s.moved.inPlace, s.moved.algo
	return s.buildView(a.src, a.place, a.rg)
}

// finishStats fills the stats the schedule says (rows and bytes each way).
func (s *slot) finishStats() {
	d := s.d
	p, me := d.c.Size(), d.c.Rank()
	st := &s.stats
	sc := &s.sched
	st.RowsSent, st.RowsReceived = 0, 0
	st.RowsPerRank = growInts(st.RowsPerRank, p)
	for q := 0; q < p; q++ {
		st.RowsPerRank[q] = sc.Dispatch.Send[q].Rows
		if q != me {
			st.RowsSent += sc.Dispatch.Send[q].Rows
			st.RowsReceived += sc.Dispatch.Recv[q].Rows
		}
	}
	// Rows read in place count as the bytes the reader takes from the sender's memory.
	st.BytesSent, st.BytesReceived = sc.Dispatch.Sent(me), sc.Dispatch.Received(me)
	for q := 0; q < p; q++ {
		if q != me {
			st.BytesSent += sc.Dispatch.Send[q].Read
			st.BytesReceived += sc.Dispatch.Recv[q].Read
		}
	}
	st.Assignments = 0
	if s.code == codeOK {
		st.Assignments = s.layout.Assignments
	}
}

func growInts(s []int, n int) []int {
	if cap(s) < n {
		return make([]int, n)
	}
	return s[:n]
}

func growI32(s []int32, n int) []int32 {
	if cap(s) < n {
		return make([]int32, n)
	}
	return s[:n]
}

func growF32(s []float32, n int) []float32 {
	if cap(s) < n {
		return make([]float32, n)
	}
	return s[:n]
}

func growI64(s []int64, n int) []int64 {
	if cap(s) < n {
		return make([]int64, n)
	}
	return s[:n]
}

// UsePlacement makes the dispatches started after it use pl, another layer's placement
// for instance: one dispatcher and combiner, their buffers made once, serve every layer
// whose configuration differs only in its placement. Results already started keep the
// placement they were dispatched with (Handle.Placement), and so does Redispatch. Every
// rank must use the same placement for a dispatch, or it fails on every rank with
// ErrMismatch. pl must span the communicator's ranks, have at least TopK experts, and
// give no rank more than MaxLocalExperts of them (ErrConfig); it must not change while
// in use.
func (d *Dispatcher[T]) UsePlacement(pl *router.Placement) error { return d.core.UsePlacement(pl) }

// Config returns the dispatcher's configuration, defaults filled; its placement is the
// one the next dispatch uses.
func (d *Dispatcher[T]) Config() Config { return d.core.Config() }

// Comm returns the communicator the dispatcher runs on.
func (d *Dispatcher[T]) Comm() *coll.Comm { return d.core.Comm() }

// Stats describes the last dispatch that completed.
func (d *Dispatcher[T]) Stats() Stats { return d.core.Stats() }

// Bytes is the memory this rank holds for the dispatcher's buffers (address space: a
// page takes memory when first written): in the low-latency mode most of it is fixed by
// New (LowLatencyBytes says it beforehand); elsewhere scratch buffers grow to the
// largest dispatch so far. The caller's memory does not count. It is 0 after Close.
func (d *Dispatcher[T]) Bytes() int { return d.core.Bytes() }

// RowsInPlace reports whether the low-latency dispatch writes each token once into its
// origin's staging, where the experts read it (PushRows unset, and every rank maps
// every rank's staging); in the Auto mode, for the last step.
func (d *Dispatcher[T]) RowsInPlace() bool { return d.core.RowsInPlace() }

// Close gives the dispatcher's buffers back to their pool. Outputs and Handles are not
// valid afterwards, and the Dispatcher must not be used again.
func (d *Dispatcher[T]) Close() error { return d.core.Close() }
