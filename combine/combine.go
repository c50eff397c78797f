// Package combine is the second stage of MoE expert parallelism: it brings the experts'
// outputs back to the ranks the tokens came from and sums them with the router's weights.
//
// Each expert rank first sums, weighted, the outputs of its experts for the same token
// (in the order of the token's choices), so one row per (token, rank) goes back: in the
// normal mode one fused AlltoAllv over the layout the dispatch left behind, in the
// low-latency mode one coll.Exchange (written straight into the origin's buffer where
// ranks share memory). The origin starts from the terms of the experts it holds itself
// (in the order of the token's choices, in float32), then adds the other ranks' partial
// sums in ascending rank order: a fixed order, so the result is bitwise identical run to
// run. The result goes into the caller's output.
//
// In the low-latency mode, where every rank can read every rank's memory (inproc; shm
// with every rank on one host), nothing is summed on the expert side: the experts write
// their outputs where Buffer says, and each origin reads its tokens' terms there in
// place and adds them all in float32 in one pass, in the order of the token's choices,
// as a single process adds them; the partial sums and their rounding to the partial
// sums' type do not exist there (Config.SendPartials restores them).
//
// What is guaranteed: for a fixed number of ranks, placement and wire types, the output
// is bitwise reproducible whatever the timing. Where the outputs are read in place, or
// with Config.SumAtOrigin, it is moreover the same bits whatever the number of ranks and
// the placement: those of one rank's combine of the same tokens. With partial sums the
// per-rank grouping of a token's experts changes with the ranks, and with it the
// rounding of the sum: results then agree to a few float32 ulps of the largest term (f32
// partial sums), or to bf16 precision (bf16 partial sums), not bit for bit.
//
// Every block carries a header with a status, so that a rank whose call is bad (a stale
// handle, buffers of the wrong length) makes every rank fail in the same call with a
// dispatch.PeerInputError naming it, and the communicator stays usable.
//
// A Combiner serves one dispatcher, whose mode moves its blocks; it takes the handles
// that dispatcher's steps return. Plan lays out a whole step over every rank without
// running anything (moex flow prints it).
package combine

import (
	"context"
	"fmt"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/internal/ep"
	"github.com/moex-ai/moex/router"
)

// Act is the element type of the expert outputs and of the combined output: float32 or
// bfloat16.
type Act interface{ float32 | dtype.BFloat16 }

// Config is how the expert outputs go back. The zero Config sends partial sums in the
// outputs' type, read in place where every rank maps every rank's memory.
type Config struct {
	// PartialDType is the type of the partial sums (each rank's weighted sum of its
	// experts' outputs for a token) on the way back: F32, BF16, or, to halve the bytes
	// of bf16, FP8E4M3 (a scale per 128 values) or I8 (a scale per row), quantised once
	// on the rank that sums them and added in float32 on the token's rank. Default: the
	// outputs' type. The gathered mode adds the partial sums on the way, so it takes F32
	// or BF16 only. Where the combine reads the outputs in place (see SendPartials), no
	// partial sums travel.
	PartialDType dtype.Type
	// SendPartials makes the low-latency combine send partial sums even where every rank
	// can read every rank's memory (inproc; shm on one host), where by default the ranks
	// that sent the tokens read the expert outputs in place (Combiner.Buffer).
	SendPartials bool
	// SumAtOrigin sends each expert output back as the expert wrote it, rather than each
	// rank's partial sum of a token, and the token's rank adds all of its terms in
	// float32 in the order of its choices: the bits one process computes, whatever the
	// number of ranks and hosts and the placement. It costs bytes (a row per (token,
	// choice) instead of one per (token, rank)), and y is copied at Start. Not in the
	// gathered mode, on the two-level path or with CombineRows; PartialDType, if set,
	// must be the outputs' type.
	SumAtOrigin bool
}

// Source is what a combiner is made for: a *dispatch.Dispatcher of any activation type.
type Source interface {
	Config() dispatch.Config
}

// Combiner brings the expert outputs of one dispatcher's steps back to the ranks the
// tokens came from and sums them. Make it once with New, beside its dispatcher; Combine
// (or Start and Wait) runs a step's way back; Close frees its buffers. A Combiner is for
// one goroutine at a time.
type Combiner[T Act] struct {
	e      *ep.Combiner[T]
	src    Source
	pends  []*Pending[T]
	chunkR []router.Routing // Pipeline's chunks
}

// New returns a combiner for the dispatches of d. It is collective (every rank calls it)
// in the modes with buffers sized once (low-latency, Auto): it makes the exchange's
// buffers. A dispatcher serves one combine configuration (another is
// dispatch.ErrConfig): its schedules plan that combine.
func New[T Act](ctx context.Context, d Source, cfg Config) (*Combiner[T], error) {
	src, ok := hooks.engine(d).(ep.Source)
	if !ok {
		return nil, fmt.Errorf("%w: the combiner's source is not a *dispatch.Dispatcher", dispatch.ErrConfig)
	}
	e, err := ep.NewCombiner[T](ctx, src, ep.CombineConfig(cfg))
	if err != nil {
		return nil, err
	}
	return &Combiner[T]{e: e, src: d}, nil
}

// Combine takes the experts' outputs y (one row of Hidden values per entry of the
// dispatch Output that h belongs to, in entry order: Output.Rows() x Hidden) and writes
// into out (Tokens x Hidden) the weighted sum, for each of this rank's tokens, of its
// experts' outputs. Every rank must call it. Tokens whose every choice was dropped get
// zeros. A stale or foreign handle, or buffers of the wrong length, fail this rank with
// dispatch.ErrStale or ErrInput and every other rank with a *dispatch.PeerInputError
// naming it, in the same call. It is Start followed by Wait.
func (cb *Combiner[T]) Combine(ctx context.Context, h dispatch.Handle, y, out []T) error {
	return cb.e.Combine(ctx, hooks.handle(h), y, out)
}

// Start is the send half of Combine: it sums this rank's experts' outputs per token and
// sends them; y is not read after Start returns, out is written until Wait returns. In
// place (Buffer), Start only says that the outputs are there (copying y there first if
// it is elsewhere), and Wait does the sums.
func (cb *Combiner[T]) Start(ctx context.Context, h dispatch.Handle, y, out []T) (*Pending[T], error) {
	p, err := cb.e.Start(ctx, hooks.handle(h), y, out)
	if err != nil {
		return nil, err
	}
	for _, pp := range cb.pends {
		if pp.e == p {
			return pp, nil
		}
	}
	pp := &Pending[T]{e: p}
	cb.pends = append(cb.pends, pp)
	return pp, nil
}

// CombineRows is Combine for expert outputs already weighted and summed on this rank: y
// holds one row per incoming row of the dispatch (a token that came to this rank,
// however many of its experts it chose here: Handle.IncomingRows() x Hidden, origin
// rank ascending, then the origin's token order; Handle.Contributions says which
// entries and weights make each), and each goes back to its origin as it is, to be
// added there to the token's other partial sums. Not in the gathered mode, nor with
// SumAtOrigin.
func (cb *Combiner[T]) CombineRows(ctx context.Context, h dispatch.Handle, y, out []T) error {
	return cb.e.CombineRows(ctx, hooks.handle(h), y, out)
}

// Buffer returns where this rank's experts should write their outputs for the dispatch
// h belongs to (Output.Rows() x Hidden values, in entry order) for the combine to read
// them in place; nil where it does not (the normal and gathered modes, ranks that
// cannot all read one another's memory, SendPartials), or for a handle that is not
// valid. The memory is this dispatch's until the next dispatch into the same buffers.
// Combine with y anywhere else copies y there first.
func (cb *Combiner[T]) Buffer(h dispatch.Handle) []T { return cb.e.Buffer(hooks.handle(h)) }

// InPlace reports whether the combine reads the expert outputs in place (Buffer); in
// the Auto mode, that of the last dispatch's mode.
func (cb *Combiner[T]) InPlace() bool { return cb.e.InPlace() }

// Stats describes the last combine.
func (cb *Combiner[T]) Stats() Stats { return Stats(cb.e.Stats()) }

// Config returns the combine's configuration, defaults filled.
func (cb *Combiner[T]) Config() Config { return Config(cb.e.Config()) }

// Bytes is the memory this rank holds for the combiner's buffers (address space: a page
// takes memory when first written): in the low-latency mode most of it is fixed by New
// (LowLatencyBytes says it beforehand); elsewhere scratch buffers grow to the largest
// combine so far. The caller's memory does not count. It is 0 after Close.
func (cb *Combiner[T]) Bytes() int { return cb.e.Bytes() }

// Close gives the combiner's buffers back to their pool; it must not be used again.
func (cb *Combiner[T]) Close() error { return cb.e.Close() }

// Pending is a combine in flight: Wait completes it.
type Pending[T Act] struct {
	e *ep.CombinePending[T]
}

// Wait is the receive half of Combine: it waits for the other ranks' partial sums (or
// reads the outputs in place) and writes out. Call it once.
func (p *Pending[T]) Wait(ctx context.Context) error { return p.e.Wait(ctx) }

// Stats describes a combine: bytes each way, and what was read in place.
type Stats struct {
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

// ErrInput: this rank's expert outputs or output buffer have the wrong length.
var ErrInput = ep.ErrCombineInput

// Defaults returns cfg as New[T] uses it beside a dispatcher of dcfg: the partial sums'
// type defaulting to T's, every field checked (dispatch.ErrConfig).
func Defaults[T Act](dcfg dispatch.Config, cfg Config) (Config, error) {
	c, err := ep.CombineDefaults(hooks.engineConfig(dcfg), ep.CombineConfig(cfg), ep.TypeOf[T]())
	return Config(c), err
}

// LowLatencyBytes is the memory (Combiner.Bytes) that the Combiner[T] of cfg, beside a
// dispatcher of dcfg in the low-latency mode, holds on each rank once every slot has
// combined MaxTokens tokens: where every rank maps every rank's memory (shared: one
// host), or where blocks travel as messages. It runs nothing.
func LowLatencyBytes[T Act](dcfg dispatch.Config, cfg Config, shared bool) (int, error) {
	return ep.CombineLowLatencyBytes[T](hooks.engineConfig(dcfg), ep.CombineConfig(cfg), shared)
}

// Format is the wire format of the way back: a partial sum per (token, rank), or with
// SumAtOrigin each expert output as it was written.
type Format struct {
	Hidden  int        // values per row
	Partial dtype.Type // the partial sums' type
	Scales  int        // float32 scales per partial sum (fp8: one per 128 values; int8: one)
	Row     int        // bytes of a partial sum on the wire, scales included
	// Terms: the outputs travel unsummed (SumAtOrigin), TermRow bytes each, in the
	// outputs' type, with a count per row.
	Terms   bool
	TermRow int
}

// ScaleAt is where a partial sum's scales start: after its payload, 4-aligned.
func (f Format) ScaleAt() int { return ep.CombineFormat(f).ScaleAt() }

// Block is the bytes, after its header, of a block of the way back that answers n rows
// carrying m choices: a partial sum per row, or with Terms a count per row and an output
// per choice.
func (f Format) Block(n, m int) int { return ep.CombineFormat(f).Block(n, m) }
