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
package dispatch

import (
	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/internal/ep"
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

// String names the mode as ParseMode reads it.
func (m Mode) String() string { return ep.Mode(m).String() }

// ParseMode accepts "auto" (or ""), "normal", "low-latency" (or "ll") and "gathered".
func ParseMode(s string) (Mode, error) {
	m, err := ep.ParseMode(s)
	return Mode(m), err
}

// AutoMaxTokens is MaxTokens in the Auto mode where it is not set: the steps of up to
// this many tokens per rank run in the low-latency mode.
const AutoMaxTokens = ep.AutoMaxTokens

// MaxLowLatencyTokens bounds Config.MaxTokens.
const MaxLowLatencyTokens = ep.MaxLowLatencyTokens

// DefaultMaxBufferBytes is Config.MaxBufferBytes in the Auto and normal modes where it is
// not set: 1 GiB a rank.
const DefaultMaxBufferBytes = ep.DefaultMaxBufferBytes

// MaxBufferBytesLimit bounds Config.MaxBufferBytes.
const MaxBufferBytesLimit = ep.MaxBufferBytesLimit

// Config describes the dispatch of one MoE layer: what every rank must agree on, and the
// limits its buffers are sized for. What the combine adds is combine.Config.
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

// engine is cfg as the engine takes it.
func (cfg Config) engine() ep.Config {
	return ep.Config{
		Hidden: cfg.Hidden, TopK: cfg.TopK, WireDType: cfg.WireDType, Placement: cfg.Placement,
		Mode: ep.Mode(cfg.Mode), MaxTokens: cfg.MaxTokens, MaxBufferBytes: cfg.MaxBufferBytes, InFlight: cfg.InFlight, Align: cfg.Align,
		Quantized: cfg.Quantized, PowerOfTwoScales: cfg.PowerOfTwoScales, ExpertMajor: cfg.ExpertMajor,
		MaxLocalExperts: cfg.MaxLocalExperts, PushRows: cfg.PushRows, Pool: cfg.Pool,
	}
}

// configOf is the engine's configuration as a Config.
func configOf(c ep.Config) Config {
	return Config{
		Hidden: c.Hidden, TopK: c.TopK, WireDType: c.WireDType, Placement: c.Placement,
		Mode: Mode(c.Mode), MaxTokens: c.MaxTokens, MaxBufferBytes: c.MaxBufferBytes, InFlight: c.InFlight, Align: c.Align,
		Quantized: c.Quantized, PowerOfTwoScales: c.PowerOfTwoScales, ExpertMajor: c.ExpertMajor,
		MaxLocalExperts: c.MaxLocalExperts, PushRows: c.PushRows, Pool: c.Pool,
	}
}

// Defaults returns cfg as New[T] would use it: the wire type defaulting to T's, InFlight
// to 2, Align to 1, MaxLocalExperts to the placement's, and every field checked
// (ErrConfig).
func Defaults[T Act](cfg Config) (Config, error) {
	c, err := ep.Defaults[T](cfg.engine())
	return configOf(c), err
}

// Format is the wire format of a dispatch: how big a row is, where its parts are. A row
// carries the metadata of the token's choices its destination holds (MetaBytes(m) for m
// of them), the payload and its scales.
type Format struct {
	Hidden  int        // elements per row
	TopK    int        // routing choices per token
	Wire    dtype.Type // the payload's type
	Scales  int        // float32 scales per row (fp8: one per 128 values; int8: one)
	Meta    int        // the most bytes of a row's metadata (MetaBytes(TopK))
	Payload int        // bytes of a row's values on the wire
	Row     int        // the most bytes of a row in the normal mode (RowBytes(TopK))
}

// NewFormat returns the wire format of cfg (the wire type defaults to f32).
func NewFormat(cfg Config) Format { return Format(ep.NewFormat(cfg.engine())) }

// MetaBytes is the bytes of the metadata of a row with m choices: its source index, m,
// and each (local expert, weight).
func (f Format) MetaBytes(m int) int { return ep.Format(f).MetaBytes(m) }

// RowBytes is the bytes of a row with m choices in the normal mode: metadata, payload
// and scales (4-aligned after the payload), 8-aligned.
func (f Format) RowBytes(m int) int { return ep.Format(f).RowBytes(m) }

// ScaleBytes is the bytes of a row's scales.
func (f Format) ScaleBytes() int { return ep.Format(f).ScaleBytes() }

// WireBytesPerChoice is the bytes DeepEP counts per valid (token, expert) choice: the
// payload, its scales and 16 bytes of routing (index and weight).
func (f Format) WireBytesPerChoice() int { return ep.Format(f).WireBytesPerChoice() }

// GatheredMeta is the bytes of a token's routing in the gathered mode.
func (f Format) GatheredMeta() int { return ep.Format(f).GatheredMeta() }

// Fingerprint identifies what every rank must agree on to dispatch together: the
// format, the mode, the limits and the placement.
func Fingerprint(cfg Config) uint64 { return ep.Fingerprint(cfg.engine()) }

// PlacementFingerprint identifies a placement: its kind and every expert's replicas.
func PlacementFingerprint(pl *router.Placement) uint64 { return ep.PlacementFingerprint(pl) }

// LowLatencyBytes is the memory (Dispatcher.Bytes) that a Dispatcher[T] of cfg in the
// low-latency mode holds on each rank of cfg.Placement once every slot has taken a
// dispatch of MaxTokens tokens: where every rank maps every rank's memory (shared: one
// host, over shm or inproc), or where blocks travel as messages. It runs nothing, so
// that an engine can size its other buffers first (moex flow prints it).
func LowLatencyBytes[T Act](cfg Config, shared bool) (int, error) {
	return ep.LowLatencyBytes[T](cfg.engine(), shared)
}

// ChooseTwoLevel reports whether the two-level dispatch (NewTwoLevel) is expected to
// take less time than the flat one for cfg on c, and says why (the cost model's
// figures).
func ChooseTwoLevel(c *coll.Comm, cfg Config) (bool, string) {
	return ep.ChooseTwoLevel(c, cfg.engine())
}

// PeerInputError says that another rank could not dispatch (or combine) its tokens:
// every rank returns an error in the same call, and the communicator stays usable. Rank
// is that rank. errors.Is matches it with ErrInput, and with what the rank found wrong
// (ErrStale, combine.ErrInput, ErrWeights).
type PeerInputError = ep.PeerInputError

// ConfigMismatchError says which field of the configuration the ranks disagree on, when
// New finds it (in the modes where New is collective: Auto and LowLatency): Field, the
// odd Ranks (whose Value differs from the most ranks'; on a tie, from the lowest rank's)
// and the others (Rest, with Want). Every rank gets the same one, and a launcher (moex
// run) blames the odd ranks. It matches ErrMismatch.
type ConfigMismatchError = ep.ConfigMismatchError

// BufferLimitError says that a step of the normal mode (or an Auto step in it) would need
// more memory on a rank than Config.MaxBufferBytes: every rank gets it in the same call,
// naming the first Rank over the limit, its Need and the Limit, before anything is sized
// or moved, and the communicator serves on. It matches ErrBufferLimit.
type BufferLimitError = ep.BufferLimitError

// Errors.
var (
	// ErrConfig: the configuration is invalid.
	ErrConfig = ep.ErrConfig
	// ErrInput: this rank's tokens or routing are invalid (details in the message).
	ErrInput = ep.ErrInput
	// ErrMismatch: ranks disagree on the configuration or the placement; every rank gets
	// it, naming one that differs.
	ErrMismatch = ep.ErrMismatch
	// ErrStale: a Handle or Output that does not describe a live dispatch of this
	// dispatcher: the zero Handle, another dispatcher's, one whose buffers a newer
	// dispatch reused, or one combined already (the error says which).
	ErrStale = ep.ErrStale
	// ErrBusy: a dispatch would reuse buffers still in use (InFlight results, the
	// oldest not waited for or pinned by a combine).
	ErrBusy = ep.ErrBusy
	// ErrWeights: expert weights of the wrong size (Migrate).
	ErrWeights = ep.ErrWeights
	// ErrBufferLimit: a step would need more memory than Config.MaxBufferBytes.
	ErrBufferLimit = ep.ErrBufferLimit
)
