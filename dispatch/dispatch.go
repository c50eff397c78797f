// Package dispatch is the first stage of MoE expert parallelism: it sends every token to
// the ranks that hold its experts, as one message per destination rank, and hands each
// rank its experts' inputs with an expert-major view, ready for grouped expert compute.
//
// A token bound for several experts on one rank crosses the wire once: its row is
// followed, in the same message, by the list of that rank's experts it goes to and the
// router's weights. Three modes share one API (Config.Mode):
//
//   - Normal (prefill): one small all-gather exchanges every rank's per-destination row
//     counts (with a status and a fingerprint of the configuration and placement, so
//     that a rank with bad input or another placement fails every rank in the same
//     call), then one fused, exact-size AlltoAllv moves the rows, and the receiver
//     scatters them into contiguous per-expert blocks (optionally padded for grouped
//     GEMM).
//   - LowLatency (decode): buffers sized once for Config.MaxTokens tokens per rank; no
//     counts round trip, the counts travel with the rows in one coll.Exchange; the
//     receive buffer is indexed by source rank (its size grows with ranks, not with
//     local experts). Where every rank can map every rank's memory (inproc; shm on one
//     host) each rank writes its tokens once into its own staging and the experts read
//     them there, so that no row is copied to another rank (Config.PushRows: each sender
//     writes its rows straight into the receivers' buffers instead). The experts see the
//     rows through an expert-major view (Output.Entry, Output.Gather) with a count per
//     expert; nothing is allocated from call to call.
//   - Gathered (data-parallel attention with expert parallelism): every rank's tokens
//     all-gathered (coll.AllGatherv), each rank's experts take the ones that chose them,
//     and package combine reduce-scatters the sums back (coll.ReduceScatterv).
//
// Activations are float32 or bfloat16, or opaque rows of bytes (Dispatcher[byte]) for
// engines with element types of their own. The wire is f32, bf16, fp8 E4M3 (a float32
// scale per 128 elements) or int8 (a float32 scale per token), quantised as the rows
// are packed; the experts get rows in the activation type, or the quantised rows and
// their scales (Config.Quantized). Every expert sees a token as the wire carries it,
// whichever rank holds the expert.
//
// Dispatch is Start (the send half) then Wait (the receive half); between them the
// caller may compute (two micro-batches: start B while A's experts run). InFlight
// results may be alive at once: the dispatch after them reuses the oldest's buffers, and
// its Output and Handle become stale (ErrStale); a dispatch that would reuse buffers
// still in use (not waited for, or pinned by a running combine) returns ErrBusy. The
// Handle is an opaque token for package combine; its Schedule says what moved to and
// from every peer.
//
// Beside the step, the package keeps what serving over time needs: the load of every
// expert (LoadRecorder), moving expert weights to a new placement (Migrate), and putting
// a lost rank's experts back after coll.Comm.Shrink (Recover).
//
// The package is also the engine of package combine, whose names for the way back
// (combine.Combiner, combine.Config, ...) are this package's Combiner, CombineConfig and
// the rest: the two stages share one engine, so their types are defined once, here.
// Inside, a pure planner lays out each step's Schedule from the routing, the placement
// and the counts, and one object per mode (normal.go, lowlatency.go, gathered.go;
// twolevel.go composes two) owns both halves of its protocol, the dispatch and the
// combine's way back, and moves what the schedule lists.
package dispatch

import (
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
)

// Act is the element type of the activations a Dispatcher moves: float32, bfloat16, or
// byte for opaque rows (Hidden is then the bytes of a row, and the wire carries them as
// they are).
type Act interface {
	float32 | dtype.BFloat16 | byte
}

// Mode selects how a step moves its rows: Auto, Normal, LowLatency or Gathered.
type Mode int

// The modes.
const (
	// Auto, the zero Mode: each step in the low-latency mode when every rank's tokens
	// fit in MaxTokens (default AutoMaxTokens), else in the normal mode. The choice
	// needs no agreement of its own: a rank with more tokens says so in the low-latency
	// exchange's headers, and every rank then runs that step in the normal mode (a step
	// that does not fit costs one exchange of headers more). The mode for a serving
	// loop that mixes decode and prefill steps.
	Auto Mode = iota
	// Normal: a counts all-gather, then an exact-size AlltoAllv (prefill).
	Normal
	// LowLatency: one exchange into buffers sized for MaxTokens tokens per rank, counts
	// travelling with the rows (decode).
	LowLatency
	// Gathered: every rank's tokens all-gathered, each rank's experts take the ones that
	// chose them, and the combine reduce-scatters the sums back (data-parallel attention
	// with expert parallelism, vLLM's AgRs). Every token crosses to every rank.
	Gathered
)

// AutoMaxTokens is MaxTokens in the Auto mode where it is not set: the steps of up to
// this many tokens per rank run in the low-latency mode.
const AutoMaxTokens = 16

// MaxLowLatencyTokens bounds Config.MaxTokens.
const MaxLowLatencyTokens = 1 << 16

// DefaultMaxBufferBytes is Config.MaxBufferBytes in the Auto and normal modes where it is
// not set: 1 GiB a rank.
const DefaultMaxBufferBytes = 1 << 30

// MaxBufferBytesLimit bounds Config.MaxBufferBytes.
const MaxBufferBytesLimit = 1 << 40

// Config describes the dispatch of one MoE layer: what every rank must agree on, and the
// limits its buffers are sized for. What the combine adds is CombineConfig (package
// combine's Config).
type Config struct {
	// Hidden is the elements of a token's row (bytes, for opaque rows).
	Hidden int
	// TopK is the experts per token (the router's k).
	TopK int
	// WireDType is the type of the rows on the wire: F32, BF16, FP8E4M3 (a float32 scale
	// per 128 values) or I8 (a float32 scale per row). Default: the activation type; U8,
	// and only U8, for opaque rows.
	WireDType dtype.Type
	// Placement says which ranks hold which experts; it spans the communicator's ranks.
	Placement *router.Placement
	// Mode is how steps move their rows (default Auto).
	Mode Mode
	// MaxTokens is, in the low-latency mode, the most tokens any rank dispatches in one
	// call (required; at most MaxLowLatencyTokens); in the Auto mode, the most for which
	// a step runs in the low-latency mode (default AutoMaxTokens) when the dispatcher is
	// made. Buffers are sized for it once (in the Auto mode, they grow: MaxBufferBytes).
	MaxTokens int
	// MaxBufferBytes bounds the memory of a step's buffers on a rank (Dispatcher.Bytes
	// and its Combiner's). In the Auto mode, where every rank maps every rank's memory
	// (inproc; shm on one host), a step with more tokens than the low-latency buffers
	// hold makes every rank grow them, together, for the next power of two of the
	// tokens, when they then fit in MaxBufferBytes and no other dispatch is in use (not
	// waited for, or not combined): that step and the ones after it run in the
	// low-latency mode, each row written once and read in place; else the step runs in
	// the normal mode. Growing makes the dispatcher's earlier Outputs, Handles and Buffer
	// slices stale (a step that grows the buffers runs from tokens in the old Buffer).
	// In the normal mode (and Auto's normal steps), a step whose exact-size buffers would
	// pass it fails on every rank with a *BufferLimitError, before anything moves.
	// Default DefaultMaxBufferBytes in those modes; negative: no growth and no limit. At
	// most MaxBufferBytesLimit.
	MaxBufferBytes int
	// InFlight is how many dispatch results may be alive at once (default 2, at most
	// 16): the dispatch after them makes the oldest stale.
	InFlight int
	// Align pads each local expert's block of entries to a multiple of Align (grouped
	// GEMM kernels want this; default 1); padding entries have origin -1 (and, in the
	// normal mode, zero activations).
	Align int
	// Quantized hands the experts the rows as the wire carries them (Output.QEntry and
	// Output.QBlock, for fp8 or int8 kernels) instead of rows in the activation type
	// (Output.Entry and Output.Block).
	Quantized bool
	// ExpertMajor lays the rows out expert-major in every mode, local expert i's rows one
	// contiguous block (Output.Block returns it in place), as grouped GEMM kernels and
	// DeepEP's low-latency layout want: the low-latency and gathered modes, which leave
	// rows where they arrived, copy them once into their entries in the dispatch
	// (Stats.PackedBytes counts the bytes); the normal mode's rows are expert-major
	// anyway.
	ExpertMajor bool
	// PowerOfTwoScales rounds fp8 scales up to powers of two (exact to apply; the UE8M0
	// scales some kernels want).
	PowerOfTwoScales bool
	// MaxLocalExperts is the most experts any rank holds in any placement the
	// dispatcher will use (UsePlacement): the combine's buffers are sized for it.
	// Default, and least: the most any rank holds in Placement.
	MaxLocalExperts int
	// PushRows makes the low-latency dispatch write each token's row into every
	// destination's memory even where every rank maps every rank's memory (inproc; shm
	// on one host), where by default each rank writes its tokens once into its own
	// staging and the experts read them there in place (Output.Entry then reads the
	// origins' memory). Only in the low-latency mode (else ErrConfig).
	PushRows bool
	// Pool provides the buffers: page aligned, reused across calls. Default: obuf.Shared
	// when the communicator's collectives run through shared memory
	// (coll.Comm.SharedMemory), where the other ranks read the wire buffers in place;
	// obuf.Default (huge pages from 256 KiB) otherwise.
	Pool *obuf.Pool
}
