package dispatch

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
)

// The low-latency mode (decode): buffers sized once for MaxTokens tokens per rank; one
// coll.Exchange per dispatch, three fields per block: a header and the rows' metadata,
// their payloads, their scales (fp8, int8). Every rank sends every rank a block, a
// header-only one when it has no rows for it or its input is bad, so the counts and the
// status travel with the rows and nobody waits for a rank that gave up. The receive
// buffer is indexed by source rank (it grows with ranks, not with local experts).
//
// Where every rank can map every rank's memory side by side (inproc; shm on one host),
// each rank writes its tokens once into its own staging and the experts read them there
// (the blocks then carry the metadata alone), unless Config.PushRows. The combine's half
// sends the partial sums back the same way, or, where every rank reads every rank's
// memory, the origins read the expert outputs where the experts wrote them
// (lowlatency_inplace.go).

type lowLatency struct {
	d *core
	x *coll.Exchange
	// rowsPer is, when the rows are read in place, the rows of each source rank's part
	// of the view (MaxTokens rounded up so that a part is whole pages); 0 when they are
	// pushed. stage[i] holds slot i's staging: payloads and scales (nil without).
	rowsPer int
	stage   [][2]*coll.Board
	ss      []llSlot
	rows    llRows // the view's rowSource
	// overflow decides what a step that some rank's tokens did not fit becomes (its
	// headers in op): an error that the step's caller handles (the Auto mode: errGrown
	// or errOverflow), or nil, where such tokens are that rank's bad input.
	overflow func(ctx context.Context, s *step, op *coll.XOp) error
}

// tooMany is the flat low-latency mode's overflow: tokens that do not fit are the
// rank's bad input, which the step reports as any other.
func tooMany(context.Context, *step, *coll.XOp) error { return nil }

func (m *lowLatency) kind() Mode    { return LowLatency }
func (m *lowLatency) plan() planner { return llPlan{} }
func (m *lowLatency) flats() []flat { return []flat{m} }

type llSlot struct {
	op *coll.XOp
	// stageFree: no rank reads what this rank last wrote into the slot's staging (its
	// combine has completed since).
	stageFree bool
}

// llExchange is the mode's exchange: per block a header and the rows' metadata, their
// payloads and their scales, each for MaxTokens rows.
func llExchange(cfg Config, f Format) coll.ExchangeConfig {
	return coll.ExchangeConfig{Slots: cfg.InFlight, Fields: []int{
		blockHeader + cfg.MaxTokens*f.Meta, cfg.MaxTokens * f.Payload, cfg.MaxTokens * f.ScaleBytes()}}
}

func newLowLatency(ctx context.Context, d *core) (*lowLatency, error) {
	m := &lowLatency{d: d, stage: make([][2]*coll.Board, len(d.slots)), ss: make([]llSlot, len(d.slots)), overflow: tooMany}
	x, err := d.c.NewExchange(ctx, llExchange(d.cfg, d.f))
	if err != nil {
		return nil, err
	}
	m.x = x
	if !d.cfg.PushRows && d.c.Size() > 1 {
		if err := m.openStaging(ctx); err != nil {
			x.Close()
			return nil, err
		}
	}
	return m, nil
}

// LowLatencyBytes is the memory (Dispatcher.Bytes) that a Dispatcher[T] of cfg in the
// low-latency mode holds on each rank of cfg.Placement once every slot has taken a
// dispatch of MaxTokens tokens: where every rank maps every rank's memory (shared: one
// host, over shm or inproc; the experts then read the rows in place unless PushRows), or
// where blocks travel as messages (coll.ExchangeBytes says what a mix adds). It runs
// nothing, so that an engine can size its other buffers first (moex flow prints it).
func LowLatencyBytes[T Act](cfg Config, shared bool) (int, error) {
	cfg, err := Defaults[T](cfg)
	if err != nil {
		return 0, err
	}
	if cfg.Mode != LowLatency && cfg.Mode != Auto { // Auto: its low-latency mode's
		return 0, fmt.Errorf("%w: LowLatencyBytes of the %v mode", ErrConfig, cfg.Mode)
	}
	cfg.Mode = LowLatency
	return llBytes(cfg, actType[T](), shared), nil
}

// llBytes is LowLatencyBytes of cfg (defaults filled) for activations of type act.
func llBytes(cfg Config, act dtype.Type, shared bool) int {
	p, f := cfg.Placement.Ranks, NewFormat(cfg)
	n := coll.ExchangeBytes(llExchange(cfg, f), p, shared)
	perSrc := cfg.MaxTokens // rows per source rank in the experts' view
	if rows := stagingRows(f, cfg.MaxTokens, p); shared && !cfg.PushRows && p > 1 && rows > 0 {
		n += cfg.InFlight * rows * (f.Payload + f.ScaleBytes())
		perSrc = rows
	}
	if !cfg.Quantized && f.Wire != act { // the rows decoded for the experts
		n += cfg.InFlight * obuf.Capacity(p*perSrc*cfg.Hidden*act.Size())
	}
	return n
}

// maxStaging bounds the staging of one slot (every rank's part) for the rows read in
// place; above it the rows are pushed.
const maxStaging = 4 << 30

// stagingRows is how many rows each rank's part of a slot's staging holds: MaxTokens,
// rounded up so that the payloads (and the scales) of a part fill whole pages, the parts
// then lying side by side as one array of rows; 0 where every rank's parts together
// would pass maxStaging (the rows are then pushed).
func stagingRows(f Format, maxTokens, p int) int {
	pg := os.Getpagesize()
	unit := pg / gcd(f.Payload, pg)
	if sb := f.ScaleBytes(); sb > 0 {
		u := pg / gcd(sb, pg)
		unit = unit / gcd(unit, u) * u
	}
	rows := (maxTokens + unit - 1) / unit * unit
	if rows*(f.Payload+f.ScaleBytes())*p > maxStaging {
		return 0
	}
	return rows
}

func gcd(a, b int) int {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// openStaging makes each slot's staging where every rank can map every rank's side by
// side (coll.Comm.NewSpanBoard), so that the experts read the rows in place; where some
// rank cannot, every rank pushes its rows instead.
func (m *lowLatency) openStaging(ctx context.Context) error {
	d := m.d
	f := &d.f
	rows := stagingRows(*f, d.cfg.MaxTokens, d.c.Size())
	if rows == 0 {
		return nil
	}
	for i := range m.stage {
		for j, size := range []int{rows * f.Payload, rows * f.ScaleBytes()} {
			if size == 0 {
				continue
			}
			b, err := d.c.NewSpanBoard(ctx, size)
			if errors.Is(err, coll.ErrNoBoard) {
				m.closeStaging()
				return nil
			}
			if err != nil {
				m.closeStaging()
				return err
			}
			m.stage[i][j] = b
		}
		m.ss[i].stageFree = true
	}
	m.rowsPer = rows
	return nil
}

func (m *lowLatency) closeStaging() {
	for i := range m.stage {
		for j, b := range m.stage[i] {
			if b != nil {
				b.Close()
				m.stage[i][j] = nil
			}
		}
	}
	m.rowsPer = 0
}

func (m *lowLatency) close() error {
	m.closeStaging()
	return m.x.Close()
}

func (m *lowLatency) bytes() int {
	n := m.x.Bytes()
	for i := range m.stage {
		for _, b := range m.stage[i] {
			if b != nil {
				n += b.Size()
			}
		}
	}
	return n
}

func (m *lowLatency) capacity() int { return llPlan{}.capacity(m.d.cfg) }

// readsInPlace: the rows are staged where the experts read them (rowsPer > 0).
func (m *lowLatency) readsInPlace() bool { return m.rowsPer > 0 }

// staging is the staging of buffers idx, where the next Start may write its tokens
// (Buffer); nil where the rows are not read in place in the activation type or the
// staging is busy.
func (m *lowLatency) staging(idx int) []byte {
	if m.rowsPer == 0 || m.d.f.Wire != m.d.act || !m.ss[idx].stageFree {
		return nil
	}
	return m.stage[idx][0].Local()
}

// combined marks the staging of buffers idx free to write again: every rank has started
// the combine of its dispatch, and experts read no row of a dispatch after the combine
// of it starts.
func (m *lowLatency) combined(idx int) { m.ss[idx].stageFree = true }

func (m *lowLatency) start(ctx context.Context, s *step) error {
	s.m = m
	d := m.d
	me := d.c.Rank()
	ok := s.code == codeOK
	ls := &m.ss[s.idx]
	// In place: this rank's tokens go once into its staging, where the experts read
	// them, if no rank still reads what it last wrote there.
	inPlace := m.rowsPer > 0 && ls.stageFree && ok
	pk := d.packer()
	if inPlace {
		ls.stageFree = false
		m.stageTokens(s)
	} else if ok {
		pk.begin(s.x, s.tokens)
	}
	k := s.countsOf(d.c.Size(), me, ok)
	k.sentInPlace = inPlace
	k.fromInPlace = growBools(k.fromInPlace, d.c.Size())
	clear(k.fromInPlace) // until the headers say
	d.plan(s)
	op, err := m.x.Begin(ctx)
	if err != nil {
		return err
	}
	ls.op = op
	f := &d.f
	sb := f.ScaleBytes()
	// Rows written into other ranks' memory, which they read only once all have
	// arrived, go past the caches (non-temporal stores) when the exchange touches more
	// than the last-level cache holds: each line would go to memory anyway.
	stream := false
	if ok && d.llc > 0 && !inPlace {
		sent := 0
		for q, b := range s.sched.Dispatch.Send {
			if q != me {
				sent += b.Bytes[1]
			}
		}
		stream = sent*d.c.Size() > d.llc // about every rank's share, all of them
	}
	pushed, put := 0, 0
	busy := !d.othersFree(s.idx)
	for {
		q, dst, err := op.NextDest(ctx)
		if err != nil {
			return err
		}
		if q < 0 {
			break
		}
		b := &s.sched.Dispatch.Send[q]
		h := header{status: s.code, rows: b.Rows, fp: s.fp, gen: s.gen, flags: uint64(s.asked) << 32}
		if inPlace {
			h.flags |= flagInPlace
		}
		if busy {
			h.flags |= flagBusy
		}
		h.put(dst[0])
		mo := blockHeader // the metadata, packed: each row's as long as its choices need
		if ok {
			for i, t := range s.layout.Rows[q] {
				mo += putMeta(dst[0][mo:], s.pl, s.r, me, int(t), q)
				if !inPlace {
					pk.put(int(t), dst[1][i*f.Payload:(i+1)*f.Payload], dtype.FromBytes[float32](dst[2][i*sb:(i+1)*sb]), stream && q != me && m.x.Pushes(q))
				}
			}
		}
		if mo != b.Bytes[0] {
			return fmt.Errorf("dispatch: rank %d's block for rank %d has %d bytes of metadata, its schedule %d", me, q, mo, b.Bytes[0])
		}
		if err := op.Send(q, b.Bytes[0], b.Bytes[1], b.Bytes[2]); err != nil {
			return err
		}
		switch {
		case q == me || inPlace:
		case m.x.Pushes(q):
			pushed++
		case m.x.Puts(q):
			put++
		}
	}
	s.moved = moved{pushed: pushed, put: put, inPlace: inPlace}
	return nil
}

// stageTokens writes this rank's tokens into the slot's staging, in the wire format, at
// their token indices: each token once, whatever ranks it goes to.
func (m *lowLatency) stageTokens(s *step) {
	d := m.d
	f := &d.f
	pk := d.packer()
	pay := m.stage[s.idx][0].Local()
	var sca []float32
	if b := m.stage[s.idx][1]; b != nil {
		sca = dtype.FromBytes[float32](b.Local())
	}
	if f.Wire == d.act && len(s.x) > 0 && len(pay) > 0 && &s.x[0] == &pay[0] {
		return // the tokens were written there (Buffer)
	}
	pk.x = s.x
	for t := 0; t < s.tokens; t++ {
		pk.encodeRow(t, pay[t*f.Payload:(t+1)*f.Payload], sca[t*f.Scales:(t+1)*f.Scales])
	}
}

func (m *lowLatency) wait(ctx context.Context, s *step) (arrived, error) {
	d := m.d
	ls := &m.ss[s.idx]
	op := ls.op
	ls.op = nil
	if err := op.Wait(ctx); err != nil {
		return arrived{}, err
	}
	p := d.c.Size()
	f := &d.f
	// Headers first: another configuration on any rank, then a rank's bad input, fail
	// every rank alike.
	for q := 0; q < p; q++ {
		h := op.Recv(q, 0)
		if len(h) < blockHeader {
			return arrived{}, fmt.Errorf("%w: rank %d sent a %d-byte block", ErrMismatch, q, len(h))
		}
		if hd := readHeader(h); hd.fp != s.fp {
			return arrived{}, fmt.Errorf("%w: rank %d dispatches with another configuration or placement (fingerprint %#x, this rank's %#x)", ErrMismatch, q, hd.fp, s.fp)
		}
	}
	if over, err := m.overflowed(s, op); err != nil {
		return arrived{}, err
	} else if over {
		if err := m.overflow(ctx, s, op); err != nil {
			return arrived{}, err
		}
	}
	if s.inErr != nil {
		return arrived{}, s.inErr
	}
	// The receive side of the schedule, from the headers: the counts travel with the
	// rows. Each block is checked against it before anything is read.
	k := &s.k
	for q := 0; q < p; q++ {
		h := readHeader(op.Recv(q, 0))
		if h.status != codeOK {
			return arrived{}, peerInput(q, h.status)
		}
		meta := len(op.Recv(q, 0)) - blockHeader - h.rows*f.MetaBytes(0)
		if h.rows > d.cfg.MaxTokens || meta < 0 || meta%8 != 0 {
			return arrived{}, fmt.Errorf("%w: rank %d's block says %d rows but carries %d bytes of metadata", ErrMismatch, q, h.rows, len(op.Recv(q, 0)))
		}
		k.rowsFrom[q], k.choicesFrom[q] = h.rows, meta/8
		k.fromInPlace[q] = h.flags&flagInPlace != 0 && h.rows > 0
	}
	d.plan(s)
	for q := 0; q < p; q++ {
		b := s.sched.Dispatch.Recv[q]
		n := b.Rows
		switch {
		case len(op.Recv(q, 0)) > blockHeader+n*f.Meta || len(op.Recv(q, 1)) != b.Bytes[1] || len(op.Recv(q, 2)) != b.Bytes[2]:
			return arrived{}, fmt.Errorf("%w: rank %d's block says %d rows but carries %d, %d and %d bytes", ErrMismatch, q, n, len(op.Recv(q, 0)), len(op.Recv(q, 1)), len(op.Recv(q, 2)))
		case b.InPlace && m.rowsPer == 0:
			return arrived{}, fmt.Errorf("%w: rank %d's rows are in place, where this rank cannot read them", ErrMismatch, q)
		}
	}
	return m.view(s, op), nil
}

// overflowed reads, in the Auto mode, every rank's status: an error for the first
// input that is bad (this rank's, else a peer's) other than tokens that do not fit, and
// whether any rank's tokens did not fit (codeTooMany): the step then runs in the normal
// mode on every rank, unless some input is bad, which fails every rank alike.
func (m *lowLatency) overflowed(s *step, op *coll.XOp) (bool, error) {
	over := s.code == codeTooMany
	if s.code != codeOK && !over {
		return false, s.inErr
	}
	for q := 0; q < m.d.c.Size(); q++ {
		switch st := readHeader(op.Recv(q, 0)).status; st {
		case codeOK:
		case codeTooMany:
			over = true
		default:
			return false, peerInput(q, st)
		}
	}
	return over, nil
}

func growBools(s []bool, n int) []bool {
	if cap(s) < n {
		return make([]bool, n)
	}
	return s[:n]
}

// view builds the experts' view of the rows where they arrived (MaxTokens rows per
// source rank) or where their senders staged them, and the handle's maps; the rows are
// converted only where the wire type is not the activations'.
func (m *lowLatency) view(s *step, op *coll.XOp) arrived {
	d := m.d
	p := d.c.Size()
	// Where the rows are: all in their senders' staging, the view then spanning every
	// rank's (in place), or all here. A mix (ranks that disagree on whether their last
	// combine completed) is made all here: the rows in place are copied in.
	nIn, nAll := 0, 0
	for q := 0; q < p; q++ {
		if s.k.rowsFrom[q] > 0 {
			nAll++
			if s.k.fromInPlace[q] {
				nIn++
			}
		}
	}
	src := &m.rows
	*src = llRows{d: d, s: s, op: op, first: true, i: -1, perSrc: d.cfg.MaxTokens,
		inPlace: nIn > 0 && nIn == nAll, mixed: nIn > 0 && nIn < nAll, anyIn: nIn > 0}
	if nIn > 0 { // wait refused rows in place where this rank has no staging
		src.span = m.stage[s.idx][0].Span()
		if b := m.stage[s.idx][1]; b != nil {
			src.spanSca = b.Span()
		}
		src.rowsPer = m.rowsPer
	}
	rg := region{pay: op.Field(1), sca: op.Field(2)}
	if src.inPlace {
		rg.pay, rg.sca, src.perSrc = src.span, src.spanSca, m.rowsPer
	}
	rg.rows = p * src.perSrc
	src.pay, src.sca = rg.pay, dtype.FromBytes[float32](rg.sca)
	return arrived{src: src, place: placeRegion, rg: rg}
}

// llRows walks the rows of a low-latency exchange: each source rank's block of
// metadata, the rows in its payload field, or in place in their senders' staging. It is
// the low-latency mode's rowSource.
type llRows struct {
	d       *core
	s       *step
	op      *coll.XOp
	q, i    int
	meta    []byte
	perSrc  int       // rows per source rank in the region
	pay     []byte    // the region's payloads
	sca     []float32 // and scales
	inPlace bool      // every row is read in its sender's staging
	// mixed: some are, and the first walk copies them here; anyIn: some are.
	mixed, anyIn  bool
	first         bool
	span, spanSca []byte // the senders' staging, read in place
	rowsPer       int    // rows per sender in it
}

func (w *llRows) rewind() { w.q, w.i, w.first = 0, -1, false }

func (w *llRows) next(r *inRow) (bool, error) {
	s, d := w.s, w.d
	p, k, f := d.c.Size(), d.cfg.TopK, &d.f
	nLocal, mt := len(s.pl.Local[d.c.Rank()]), d.cfg.MaxTokens
	for w.q < p {
		w.i++
		if w.i == 0 {
			w.meta = w.op.Recv(w.q, 0)[blockHeader:]
		}
		if w.i >= s.k.rowsFrom[w.q] {
			if len(w.meta) != 0 {
				return false, fmt.Errorf("%w: rank %d sent %d bytes of metadata past its %d rows", ErrMismatch, w.q, len(w.meta), s.k.rowsFrom[w.q])
			}
			w.q, w.i = w.q+1, -1
			continue
		}
		src, got, n, ok := getMeta(w.meta, k, nLocal, r.cs[:0])
		if !ok || (w.anyIn && src >= mt) {
			return false, fmt.Errorf("%w: rank %d sent a row whose metadata is out of bounds", ErrMismatch, w.q)
		}
		w.meta = w.meta[n:]
		at := w.q*w.perSrc + w.i
		if w.inPlace {
			at = w.q*w.perSrc + src
		}
		if w.first && w.mixed && s.k.fromInPlace[w.q] {
			sb := f.ScaleBytes()
			from, to := w.q*w.rowsPer+src, w.q*mt+w.i
			copy(w.op.Field(1)[to*f.Payload:(to+1)*f.Payload], w.span[from*f.Payload:(from+1)*f.Payload])
			copy(w.op.Field(2)[to*sb:(to+1)*sb], w.spanSca[from*sb:(from+1)*sb])
		}
		r.q, r.src, r.cs, r.at = w.q, src, got, at
		r.pay = w.pay[at*f.Payload : (at+1)*f.Payload]
		r.sca = w.sca[at*f.Scales : (at+1)*f.Scales]
		return true, nil
	}
	return false, nil
}

// The combine half over messages: one exchange of two fields, the header and the
// answers to the rows the destination sent (partial sums, or terms with SumAtOrigin).

type llBack struct {
	sent
	m  *lowLatency
	cb *backCore
	x  *coll.Exchange
	op []*coll.XOp
}

// llBackExchange is the combine's exchange: per block a header and, unless the outputs
// are read in place, the answers to MaxTokens rows.
func llBackExchange(cfg Config, f *CombineFormat, inPlace bool) coll.ExchangeConfig {
	answers := f.Block(cfg.MaxTokens, cfg.MaxTokens*min(cfg.TopK, cfg.MaxLocalExperts))
	if inPlace {
		answers = 0 // the header alone
	}
	return coll.ExchangeConfig{Slots: cfg.InFlight, Fields: []int{blockHeader, answers}}
}

func (m *lowLatency) newBack(ctx context.Context, cb *backCore) (back, error) {
	if !cb.cfg.SendPartials && m.d.c.Size() > 1 {
		b, err := newInPlaceBack(ctx, m, cb)
		if b != nil || err != nil {
			return b, err
		}
	}
	x, err := m.d.c.NewExchange(ctx, llBackExchange(m.d.cfg, &cb.f, false))
	if err != nil {
		return nil, err
	}
	return &llBack{m: m, cb: cb, x: x, op: make([]*coll.XOp, len(cb.slots))}, nil
}

func (b *llBack) inPlace() bool { return false }
func (b *llBack) bytes() int    { return b.x.Bytes() }
func (b *llBack) close() error  { return b.x.Close() }

func (b *llBack) start(ctx context.Context, cs *cstep) error {
	op, err := b.x.Begin(ctx)
	if err != nil {
		return err
	}
	b.op[cs.idx] = op
	st := &cs.d.sched.Combine
	for {
		q, dst, err := op.NextDest(ctx)
		if err != nil {
			return err
		}
		if q < 0 {
			return nil
		}
		blk := st.Send[q]
		n := 0
		if cs.code == codeOK && q != b.cb.d.c.Rank() {
			n = blk.Rows
			a, _ := cs.d.incoming(q)
			cs.sums.put(dst[1], cs, a, a+n)
		}
		header{status: cs.code, rows: n, fp: cs.fp, gen: cs.gen}.put(dst[0])
		answers := blk.Bytes[1]
		if cs.code != codeOK {
			answers = 0
		}
		if err := op.Send(q, blockHeader, answers); err != nil {
			return err
		}
	}
}

func (b *llBack) wait(ctx context.Context, cs *cstep) error {
	cb := b.cb
	p, me := cb.d.c.Size(), cb.d.c.Rank()
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
		err := cs.checkBlock(q, op.Recv(q, 0))
		if err == nil && cs.code == codeOK {
			blk := cs.d.sched.Combine.Recv[q]
			if got := len(op.Recv(q, 1)); got != blk.Bytes[1] {
				err = fmt.Errorf("%w: rank %d sent %d bytes of partial sums for %d rows (want %d)", ErrMismatch, q, got, blk.Rows, blk.Bytes[1])
			}
		}
		if err != nil && first == nil {
			first = err
		}
	}
	if cs.inErr != nil {
		return cs.inErr
	}
	if first != nil {
		return first
	}
	for q := 0; q < p; q++ {
		if q != me {
			cs.parts[q] = op.Recv(q, 1)
		}
	}
	return nil
}
