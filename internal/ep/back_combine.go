// Package combine is the second stage of MoE expert parallelism: it brings the experts'
// outputs back to the ranks the tokens came from and sums them with the router's weights.
//
// Each expert rank first sums, weighted, the outputs of its experts for the same token
// (in the order of the token's choices), so one row per (token, rank) goes back: in the
// normal mode one fused AlltoAllv over the layout the dispatch Handle remembers, in the
// low-latency mode one coll.Exchange (written straight into the origin's buffer where
// ranks share memory). The origin starts from the terms of the experts it holds itself
// (in the order of the token's choices, in float32), then adds the other ranks' partial
// sums in ascending rank order: a fixed order, so the result is bitwise identical run to
// run. The result goes into the caller's output.
//
// In the low-latency mode, where every rank can read every rank's memory (inproc; shm
// with every rank on one host), nothing is summed on the expert side: the experts write
// their outputs where Buffer says, and each origin reads its tokens' terms there in
// place and adds them all in float32 in one pass (dtype.WeightedSum), in the order of
// the token's choices, as a single process adds them; the partial sums and their
// rounding to the combine's wire type do not exist there (Config.SendPartials
// restores them).
//
// What is guaranteed: for a fixed number of ranks, placement and wire types, the output
// is bitwise reproducible whatever the timing. Where the outputs are read in place it is
// moreover the same bits whatever the number of ranks and the placement: those of one
// rank's combine (in either mode) of the same tokens, so that an engine's results do not
// change when it adds ranks on a host. With partial sums the per-rank grouping of a
// token's experts changes with the ranks, and with it the rounding of the sum: results
// then agree to a few float32 ulps of the largest term (f32 partial sums), or to bf16
// precision (bf16 partial sums), not bit for bit.
//
// Every block carries a header with a status, so that a rank whose call is bad (a stale
// handle, buffers of the wrong length) makes every rank fail in the same call with a
// PeerInputError naming it, and the communicator stays usable.
//
// combine owns its buffers (reused: no allocation per call in steady state); it must not
// import models.
package ep

import (
	"context"
	"errors"
	"fmt"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
)

// Out is the element type of the expert outputs and of the combined output.
type Out interface{ float32 | dtype.BFloat16 }

// Errors.
var (
	// ErrCombineInput: this rank's expert outputs or output buffer have the wrong length.
	ErrCombineInput = errors.New("combine: invalid input")
)

// Source is what a Combiner needs of a dispatcher: every *Dispatcher is one.
type Source interface {
	Comm() *coll.Comm
	Config() Config
	Format() Format
	Owner() any
}

// Combiner brings expert outputs back. One per dispatcher; as many combines may be in
// flight as the dispatcher's InFlight.
type Combiner[T Out] struct {
	c      *coll.Comm
	cfg    Config
	f      Format
	owner  any
	slots  []*cslot[T]
	n      uint64 // combines started
	x      *coll.Exchange
	part   []float32 // one row of a partial sum
	scl    []float32 // its scales, where the combine type is fp8 or int8
	chunkR []router.Routing
	// In place (low-latency, every rank reading every rank's memory): inplace.go.
	board *coll.Board
	rg    regions
	views []view[T]
	read  int
	ws    []float32 // a token's terms: weights and rows
	rows  [][]T
	at    []int // sumInPlace: where each destination rank's terms start in ws and rows, and the end
	cur   []int // sumInPlace: the next term of each destination rank's
	ows   []float32
	orows [][]T // sumInPlace: the terms in the order of the token's choices
	terms [][]T // sumRows's rows
	// reduce's partial sums of a token, in the combine's wire type, and their weights (1,
	// one per rank).
	partsB [][]dtype.BFloat16
	partsF [][]float32
	ones   []float32
}

// slot is one combine in flight and its buffers.
type cslot[T Out] struct {
	cb      *Combiner[T]
	started bool
	h       Handle
	pinned  bool
	out     []T
	acc     []float32 // the sum being made: out itself for float32, else accS
	accS    obuf.Scratch
	code    int
	inErr   error
	rows    bool // CombineRows: y holds a summed row per incoming row, not a row per entry
	// Normal mode.
	plan       coll.VPlan
	bytes      [][]int
	sendS      obuf.Scratch
	recvS      obuf.Scratch
	send, recv []byte
	pend       coll.Handle
	// Low-latency mode.
	op      *coll.XOp
	pending CombinePending[T]
	// Where each rank's partial sums arrived (reduce), and a count per rank.
	parts [][]byte
	cnt   []int
	// Gathered mode: elements per rank, the bf16 sum, every rank's status.
	gcounts []int
	accB    []dtype.BFloat16
	st      [3]int64
	stAll   []int64
	sh      coll.Handle
}

// New returns a combiner for the dispatches of d. In the low-latency mode it is
// collective (every rank calls it): it makes the exchange's buffers.
func NewCombiner[T Out](ctx context.Context, d Source) (*Combiner[T], error) {
	cfg := d.Config()
	cb := &Combiner[T]{c: d.Comm(), cfg: cfg, f: d.Format(), owner: d.Owner()}
	p := cb.c.Size()
	for i := 0; i < cfg.InFlight; i++ {
		s := &cslot[T]{cb: cb}
		s.sendS.Pool, s.recvS.Pool, s.accS.Pool = cfg.Pool, cfg.Pool, cfg.Pool
		s.parts = make([][]byte, p)
		s.bytes = make([][]int, p)
		for j := range s.bytes {
			s.bytes[j] = make([]int, p)
		}
		cb.slots = append(cb.slots, s)
	}
	cb.part = make([]float32, cfg.Hidden)
	cb.scl = make([]float32, cb.f.CombineScales)
	cb.ones = make([]float32, p)
	for i := range cb.ones {
		cb.ones[i] = 1
	}
	if cfg.Mode == LowLatency {
		if err := cb.openBoard(ctx); err != nil {
			return nil, err
		}
		x, err := cb.c.NewExchange(ctx, backExchange(cfg, cb.f, cb.board != nil, elemSize[T]()))
		if err != nil {
			cb.closeBoard()
			return nil, err
		}
		cb.x = x
	}
	return cb, nil
}

// llExchange is the low-latency combine's exchange: per block a header and, unless the
// outputs are read in place, the partial sums of MaxTokens rows (or their terms, of es
// bytes a value, with SumAtOrigin).
func backExchange(cfg Config, f Format, inPlace bool, es int) coll.ExchangeConfig {
	partials := cfg.MaxTokens * f.Combined
	switch {
	case inPlace:
		partials = 0 // the header alone
	case cfg.SumAtOrigin:
		partials = maxTermsBlock(cfg, es)
	}
	return coll.ExchangeConfig{Slots: cfg.InFlight, Fields: []int{BlockHeader, partials}}
}

// LowLatencyBytes is the memory (Combiner.Bytes) that the Combiner[T] of a
// Dispatcher[T] of cfg in the low-latency mode holds on each rank of cfg.Placement once
// every slot has combined MaxTokens tokens: where every rank maps every rank's memory
// (shared: one host, over shm or inproc; the outputs are then read in place unless
// SendPartials), or where blocks travel as messages. It runs nothing
// (LowLatencyBytes is the dispatcher's).
func CombineLowLatencyBytes[T Out](cfg Config, shared bool) (int, error) {
	cfg, err := Defaults[T](cfg)
	if err != nil {
		return 0, err
	}
	if cfg.Mode != LowLatency {
		return 0, fmt.Errorf("%w: LowLatencyBytes of the %v mode", ErrConfig, cfg.Mode)
	}
	p := cfg.Placement.Ranks
	board := boardSize[T](cfg, p)
	if !shared {
		board = 0
	}
	n := board + coll.ExchangeBytes(backExchange(cfg, NewFormat(cfg), board > 0, elemSize[T]()), p, shared)
	switch {
	case board == 0 && cfg.SumAtOrigin: // the own terms (ownTermsBlock)
		n += cfg.InFlight * obuf.Capacity(maxTermsBlock(cfg, elemSize[T]()))
	case board == 0 && !isF32[T](): // the sums in float32 (ownTerms)
		n += cfg.InFlight * obuf.Capacity(cfg.MaxTokens*cfg.Hidden*4)
	}
	return n, nil
}

// RowBytes is the size of one partial sum on the wire.
func (cb *Combiner[T]) RowBytes() int { return cb.f.Combined }

// Plan returns the AlltoAllv schedule of the last normal-mode combine (for moex flow).
func (cb *Combiner[T]) Plan() *coll.VPlan {
	if cb.n == 0 {
		return &cb.slots[0].plan
	}
	return &cb.slots[(cb.n-1)%uint64(len(cb.slots))].plan
}

// Bytes is the memory this rank holds for the combiner's buffers (address space: a page
// takes memory when first written). In the low-latency mode most of it is fixed by New:
// where the combine reads the expert outputs in place, the region the experts write them
// into (InFlight of them, each with room for MaxRows rows) and an exchange of headers;
// elsewhere the exchange of partial sums (coll.Exchange.Bytes: InFlight+1 blocks per
// rank, each with room for MaxTokens rows, or their outputs with SumAtOrigin);
// LowLatencyBytes says it beforehand. Besides, scratch buffers grow to the largest
// combine so far, at their pool's capacity: the wire buffers of the normal and gathered
// modes, the float32 sums of bfloat16 outputs, and with SumAtOrigin this rank's own
// outputs (sized once for MaxTokens in the low-latency mode). The caller's memory does
// not count. It is 0 after Close.
func (cb *Combiner[T]) Bytes() int {
	n := 0
	if cb.x != nil {
		n += cb.x.Bytes()
	}
	if cb.board != nil {
		n += cb.board.Size()
	}
	for _, s := range cb.slots {
		n += s.sendS.Cap() + s.recvS.Cap() + s.accS.Cap()
	}
	return n
}

// Close gives the combiner's buffers back to their pool; it must not be used again.
func (cb *Combiner[T]) Close() error {
	for _, s := range cb.slots {
		s.send, s.recv, s.acc = nil, nil, nil
		s.sendS.Release()
		s.recvS.Release()
		s.accS.Release()
	}
	err := cb.closeBoard()
	if cb.x != nil {
		err = errors.Join(cb.x.Close(), err)
	}
	return err
}

func (cb *Combiner[T]) closeBoard() error {
	if cb.board == nil {
		return nil
	}
	err := cb.board.Close()
	cb.board = nil
	return err
}

// Pending is a combine in flight: Wait completes it.
type CombinePending[T Out] struct {
	s *cslot[T]
	n uint64
}

// Combine takes the experts' outputs y (one row of Hidden values per entry of the
// dispatch Output that h belongs to, in entry order: Output.Rows() x Hidden) and writes
// into out (Tokens x Hidden) the weighted sum, for each of this rank's tokens, of its
// experts' outputs. Every rank must call it. Tokens whose every choice was dropped get
// zeros. It is Start followed by Wait.
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
	return cb.start(ctx, h, y, out, false)
}

// CombineRows is Combine for expert outputs already weighted and summed on this rank:
// y holds one row per incoming row of the dispatch (a token that came to this rank,
// however many of its experts it chose here: Handle.IncomingRows() x Hidden, in the
// order of Handle.Incoming), and each goes back to its origin as it is, to be added
// there to the token's other partial sums. Not in the gathered mode.
func (cb *Combiner[T]) CombineRows(ctx context.Context, h Handle, y, out []T) error {
	p, err := cb.start(ctx, h, y, out, true)
	if err != nil {
		return err
	}
	return p.Wait(ctx)
}

func (cb *Combiner[T]) start(ctx context.Context, h Handle, y, out []T, rows bool) (*CombinePending[T], error) {
	if rows && cb.cfg.Mode == Gathered {
		return nil, fmt.Errorf("%w: summed rows in the gathered mode", ErrConfig)
	}
	s := cb.slots[cb.n%uint64(len(cb.slots))]
	if s.started {
		return nil, fmt.Errorf("%w: combine %d would reuse the buffers of a combine not waited for", ErrBusy, cb.n+1)
	}
	if h.Owner() != cb.owner {
		return nil, fmt.Errorf("%w: the handle is not from this combiner's dispatcher", ErrStale)
	}
	hid := cb.cfg.Hidden
	s.code, s.inErr = CodeOK, nil
	switch {
	case !h.Valid():
		s.code, s.inErr = CodeStale, ErrStale
	case len(out) != h.Tokens()*hid:
		s.code, s.inErr = CodeOutput, fmt.Errorf("%w: output of %d values for %d tokens of %d", ErrCombineInput, len(out), h.Tokens(), hid)
	case !rows && len(y) != h.Rows()*hid:
		s.code, s.inErr = CodeOutput, fmt.Errorf("%w: %d expert output values, the dispatch delivered %d rows of %d", ErrCombineInput, len(y), h.Rows(), hid)
	case rows && len(y) != h.IncomingRows()*hid:
		s.code, s.inErr = CodeOutput, fmt.Errorf("%w: %d summed values, %d rows of %d came to this rank", ErrCombineInput, len(y), h.IncomingRows(), hid)
	case rows && cb.cfg.SumAtOrigin:
		s.code, s.inErr = CodeOutput, fmt.Errorf("%w: CombineRows with SumAtOrigin (the rows are summed already)", ErrConfig)
	}
	s.h, s.out, s.rows = h, out, rows
	if s.code == CodeOK {
		h.Pin()
		s.pinned = true
		switch {
		case cb.cfg.Mode == Gathered || cb.board != nil:
		case cb.cfg.SumAtOrigin:
			s.ownTermsBlock(y)
		default:
			s.ownTerms(y)
		}
	}
	var err error
	switch cb.cfg.Mode {
	case LowLatency:
		err = s.startLL(ctx, y)
	case Gathered:
		err = s.startGathered(ctx, y)
	default:
		err = s.startNormal(ctx, y)
	}
	if err != nil {
		s.unpin()
		return nil, err
	}
	cb.n++
	s.started = true
	s.pending = CombinePending[T]{s: s, n: cb.n}
	return &s.pending, nil
}

func (s *cslot[T]) unpin() {
	if s.pinned {
		s.h.Unpin()
		s.pinned = false
	}
}

// Wait is the receive half of Combine: it adds the other ranks' partial sums into out.
func (p *CombinePending[T]) Wait(ctx context.Context) error {
	s := p.s
	if !s.started {
		return fmt.Errorf("%w: Wait called twice", ErrStale)
	}
	s.started = false
	defer s.unpin()
	var err error
	switch s.cb.cfg.Mode {
	case LowLatency:
		err = s.waitLL(ctx)
	case Gathered:
		return s.waitGathered(ctx)
	default:
		err = s.waitNormal(ctx)
	}
	if err != nil {
		return err
	}
	if s.inErr != nil {
		return s.inErr
	}
	// Every rank has started this combine, so its experts read no more of the
	// dispatch's rows: this rank may write its staging again.
	s.h.Done()
	switch {
	case s.cb.board != nil:
		return s.sumInPlace()
	case s.cb.cfg.SumAtOrigin:
		return s.sumTerms()
	}
	s.reduce()
	return nil
}

func isF32[T Out]() bool {
	var z T
	_, ok := any(z).(float32)
	return ok
}

// ownTerms starts the sum: for each of this rank's tokens, the terms of this rank's own
// experts, in the order of the token's choices, or zeros.
func (s *cslot[T]) ownTerms(y []T) {
	cb := s.cb
	h := s.h
	hid := cb.cfg.Hidden
	if isF32[T]() {
		s.acc = dtype.FromBytes[float32](dtype.Bytes(s.out))
	} else {
		s.acc = dtype.FromBytes[float32](s.accS.Bytes(len(s.out) * 4))
	}
	me := cb.c.Rank()
	a, b := h.Incoming(me)
	own := h.RowsTo(me) // incoming rows from this rank are its own tokens, in token order
	i := a
	for t := 0; t < h.Tokens(); t++ {
		dst := s.acc[t*hid : (t+1)*hid]
		if i == b || int(own[i-a]) != t {
			clear(dst)
			continue
		}
		s.sumRows(dst, y, i)
		i++
	}
}

// sumRows writes into dst the weighted sum of the expert outputs of incoming row i (the
// first term written, the others added: nothing to clear).
func (s *cslot[T]) sumRows(dst []float32, y []T, i int) {
	if s.rows { // summed already: row i of y
		hid := s.cb.cfg.Hidden
		if isF32[T]() {
			copy(dst, dtype.FromBytes[float32](dtype.Bytes(y[i*hid:(i+1)*hid])))
		} else {
			dtype.BF16ToF32(dst, dtype.FromBytes[dtype.BFloat16](dtype.Bytes(y[i*hid:(i+1)*hid])))
		}
		return
	}
	entries, ws := s.h.Contributions(i)
	if len(entries) == 0 {
		clear(dst)
		return
	}
	// One pass over dst for all the terms (WeightedSum gives, bit for bit, Scale with the
	// first and Axpy with each next).
	cb := s.cb
	hid := cb.cfg.Hidden
	terms := cb.terms[:0]
	for _, e := range entries {
		terms = append(terms, y[int(e)*hid:(int(e)+1)*hid])
	}
	dtype.WeightedSum(dst, ws, terms, false)
	clear(terms) // no reference to y stays behind
	cb.terms = terms[:0]
}

// partial writes into dst (Combined bytes, the combine's wire type) the weighted sum of
// the expert outputs for incoming row i.
func (s *cslot[T]) partial(dst []byte, y []T, i int) {
	cb := s.cb
	acc := cb.part
	if cb.f.Combine == dtype.F32 {
		acc = dtype.FromBytes[float32](dst)
	}
	s.sumRows(acc, y, i)
	f := &cb.f
	switch f.Combine {
	case dtype.BF16:
		dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](dst), acc)
	case dtype.FP8E4M3:
		dtype.QuantizeFP8(dst[:f.Hidden], cb.scl, acc, false)
		copy(dst[f.CombineScaleAt():f.Combined], dtype.Bytes(cb.scl))
	case dtype.I8:
		cb.scl[0] = dtype.QuantizeI8(dst[:f.Hidden], acc)
		copy(dst[f.CombineScaleAt():f.Combined], dtype.Bytes(cb.scl))
	}
}

// addQuantized adds the partial sum src (a combined row of an fp8 or int8 combine) to
// dst.
func (cb *Combiner[T]) addQuantized(dst []float32, src []byte) {
	f := &cb.f
	copy(dtype.Bytes(cb.scl), src[f.CombineScaleAt():f.Combined])
	if f.Combine == dtype.FP8E4M3 {
		dtype.DequantizeFP8(cb.part, src[:f.Hidden], cb.scl)
	} else {
		dtype.DequantizeI8(cb.part, src[:f.Hidden], cb.scl[0])
	}
	dtype.Axpy(dst, 1, cb.part)
}

// reduce adds, token by token, the other ranks' partial sums (s.parts[q] holds rank q's,
// in the order this rank sent q its rows) to the own terms, in ascending rank order,
// and writes each finished row into out: every partial is read once, and a token's sum
// stays in the cache until it is done.
func (s *cslot[T]) reduce() {
	cb := s.cb
	h := s.h
	hid, rb := cb.cfg.Hidden, cb.f.Combined
	quant := cb.f.CombineScales > 0
	me := cb.c.Rank()
	s.cnt = growInts(s.cnt, cb.c.Size())
	clear(s.cnt)
	pb, pf := cb.partsB[:0], cb.partsF[:0]
	for t := 0; t < h.Tokens(); t++ {
		dst := s.acc[t*hid : (t+1)*hid]
		// The partials in ascending rank order, added to the own terms in one pass
		// (WeightedSum with add: Axpy with each, bit for bit); quantised ones one by one.
		pb, pf = pb[:0], pf[:0]
		for _, q := range h.Dests(t) {
			if int(q) == me {
				continue
			}
			i := s.cnt[q]
			s.cnt[q]++
			src := s.parts[q][i*rb : (i+1)*rb]
			switch {
			case quant:
				cb.addQuantized(dst, src)
			case cb.f.Combine == dtype.BF16:
				pb = append(pb, dtype.FromBytes[dtype.BFloat16](src))
			default:
				pf = append(pf, dtype.FromBytes[float32](src))
			}
		}
		if len(pb) > 0 {
			dtype.WeightedSum(dst, cb.ones[:len(pb)], pb, true)
		}
		if len(pf) > 0 {
			dtype.WeightedSum(dst, cb.ones[:len(pf)], pf, true)
		}
		if !isF32[T]() {
			dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](dtype.Bytes(s.out[t*hid:(t+1)*hid])), dst)
		}
	}
	clear(pb[:cap(pb)]) // no reference to the receive buffers stays behind
	clear(pf[:cap(pf)])
	cb.partsB, cb.partsF = pb[:0], pf[:0]
}


// checkHeader checks the header of the block rank q sent: the same dispatcher
// configuration, the same dispatch, and its status.
func (s *cslot[T]) checkHeader(q int, hb []byte, rows int) error {
	status, n, fp, gen := ReadHeader(hb)
	switch {
	case fp != s.h.Fingerprint():
		return fmt.Errorf("%w: rank %d combines the dispatches of another configuration or placement", ErrMismatch, q)
	case status == CodeOK && s.code == CodeOK && gen != s.h.Generation():
		return fmt.Errorf("%w: rank %d combines dispatch %d, this rank dispatch %d", ErrMismatch, q, gen, s.h.Generation())
	case status != CodeOK:
		return &PeerInputError{Rank: q, Code: status}
	case s.code == CodeOK && n != rows:
		return fmt.Errorf("%w: rank %d sends %d partial sums for the %d rows this rank sent it", ErrMismatch, q, n, rows)
	}
	return nil
}
