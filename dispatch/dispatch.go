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
// The engine behind both stages is internal/ep (one object per mode, which owns both
// halves of its protocol, and the pure planner whose schedule they execute): the types
// here are its, under the names engines use. dispatch adds what runs beside the step:
// expert load (LoadRecorder), weight migration (Migrate) and recovery (Recover). It must
// not import combine or models.
package dispatch

import (
	"context"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/internal/ep"
	"github.com/moex-ai/moex/router"
)

// Act is the element type of the activations a Dispatcher moves: float32, bfloat16, or
// byte for opaque rows (Hidden is then the bytes of a row, and the wire carries them as
// they are).
type Act = ep.Act

// Mode selects how a step moves its rows: Normal, LowLatency or Gathered.
type Mode = ep.Mode

// The modes.
const (
	// Auto, the zero Mode: each step in the low-latency mode when every rank's tokens
	// fit in MaxTokens (default AutoMaxTokens), else in the normal mode; a step that
	// does not fit costs one exchange of headers more. The mode for a serving loop that
	// mixes decode and prefill steps.
	Auto = ep.Auto
	// Normal: a counts all-gather, then an exact-size AlltoAllv (prefill).
	Normal = ep.Normal
	// LowLatency: one exchange into buffers sized for MaxTokens tokens per rank, counts
	// travelling with the rows (decode).
	LowLatency = ep.LowLatency
	// Gathered: every rank's tokens all-gathered, each rank's experts take the ones that
	// chose them, and the combine reduce-scatters the sums back (data-parallel attention
	// with expert parallelism, vLLM's AgRs).
	Gathered = ep.Gathered
)

// ParseMode accepts "auto" (or ""), "normal", "low-latency" (or "ll") and "gathered".
func ParseMode(s string) (Mode, error) { return ep.ParseMode(s) }

// AutoMaxTokens is MaxTokens in the Auto mode where it is not set.
const AutoMaxTokens = ep.AutoMaxTokens

// MaxLowLatencyTokens bounds Config.MaxTokens.
const MaxLowLatencyTokens = ep.MaxLowLatencyTokens

// Config describes the dispatch of one MoE layer: Hidden, TopK, WireDType, Placement,
// Mode, MaxTokens (low-latency), InFlight, Align, Quantized, PowerOfTwoScales,
// MaxLocalExperts, PushRows and Pool (see their comments). What the combine adds is
// combine.Config.
type Config = ep.Config

// Dispatcher moves tokens to experts over one communicator: New makes one, Dispatch (or
// Start and Wait) runs a step, UsePlacement switches layers, Close frees its buffers.
type Dispatcher[T Act] = ep.Dispatcher[T]

// Pending is a dispatch whose rows are on their way: Wait completes it.
type Pending[T Act] = ep.Pending[T]

// Output is what a rank's experts receive, through an expert-major view: local expert
// i's entries are [Offsets[i], Offsets[i]+Counts[i]); walk them with Entry(j), or copy
// an expert's rows into one matrix with Gather. The rows themselves are expert-major
// only where ExpertMajor holds (the normal mode).
type Output[T Act] = ep.Output[T]

// Handle is an opaque token for one dispatch, for the combine and Redispatch: Valid,
// Rows, Tokens, IncomingRows, Contributions (for CombineRows), Placement and Schedule.
type Handle = ep.Handle

// Stats describes the last dispatch: rows and bytes each way, the algorithm, whether
// the rows were read in place.
type Stats = ep.Stats

// Format is the wire format of a dispatch: how big a row is, where its parts are.
type Format = ep.Format

// Schedule is one rank's part of a step, as the planner lays it out and the executors
// move it: for every peer, the block this rank sends and receives in the dispatch and
// in the combine, field by field (Stage, Block).
type (
	Schedule = ep.Schedule
	Stage    = ep.Stage
	Block    = ep.Block
)

// PeerInputError says that another rank could not dispatch (or combine) its tokens:
// every rank returns an error in the same call, and the communicator stays usable.
// errors.Is matches it with ErrInput, and with what the rank found wrong (ErrStale,
// combine.ErrInput, ErrWeights).
type PeerInputError = ep.PeerInputError

// Errors.
var (
	// ErrConfig: the configuration is invalid.
	ErrConfig = ep.ErrConfig
	// ErrInput: this rank's tokens or routing are invalid (details in the message).
	ErrInput = ep.ErrInput
	// ErrMismatch: ranks disagree on the configuration or the placement; every rank gets
	// it, naming one that differs.
	ErrMismatch = ep.ErrMismatch
	// ErrStale: a Handle or Output was used after a newer dispatch reused its buffers,
	// or is not one of the dispatcher's.
	ErrStale = ep.ErrStale
	// ErrBusy: a dispatch would reuse buffers still in use (InFlight results, the
	// oldest not waited for or pinned by a combine).
	ErrBusy = ep.ErrBusy
	// ErrWeights: expert weights of the wrong size (Migrate).
	ErrWeights = ep.ErrWeights
)

// New returns a dispatcher for c. In the low-latency mode it is collective (every rank
// calls it with the same configuration): it makes the exchange's buffers.
func New[T Act](ctx context.Context, c *coll.Comm, cfg Config) (*Dispatcher[T], error) {
	return ep.New[T](ctx, c, cfg)
}

// Defaults returns cfg as New[T] would use it: the wire type defaulting to T's, InFlight
// to 2, Align to 1, MaxLocalExperts to the placement's, and every field checked
// (ErrConfig).
func Defaults[T Act](cfg Config) (Config, error) { return ep.Defaults[T](cfg) }

// LowLatencyBytes is the memory (Dispatcher.Bytes) that a Dispatcher[T] of cfg in the
// low-latency mode holds on each rank of cfg.Placement once every slot has taken a
// dispatch of MaxTokens tokens: where every rank maps every rank's memory (shared: one
// host, over shm or inproc), or where blocks travel as messages. It runs nothing, so
// that an engine can size its other buffers first (moex flow prints it).
func LowLatencyBytes[T Act](cfg Config, shared bool) (int, error) {
	return ep.LowLatencyBytes[T](cfg, shared)
}

// NewFormat returns the wire format of cfg (the wire type defaults to f32).
func NewFormat(cfg Config) Format { return ep.NewFormat(cfg) }

// Fingerprint identifies what every rank must agree on to dispatch together: the
// format, the mode, the limits and the placement.
func Fingerprint(cfg Config) uint64 { return ep.Fingerprint(cfg) }

// PlacementFingerprint identifies a placement: its kind and every expert's replicas.
func PlacementFingerprint(pl *router.Placement) uint64 { return ep.PlacementFingerprint(pl) }

// TwoLevel is the dispatch for ranks on several hosts: a token crosses the network once
// per remote host, and the host's ranks pass it on among themselves (combine.NewTwoLevel
// combines it).
type TwoLevel[T Act] = ep.TwoLevel[T]

// TwoLevelHandle remembers a two-level dispatch for the combine.
type TwoLevelHandle = ep.TwoLevelHandle

// NewTwoLevel splits c by host (collectively: every rank calls it with the same cfg)
// and makes the two stages' dispatchers.
func NewTwoLevel[T Act](ctx context.Context, c *coll.Comm, cfg Config) (*TwoLevel[T], error) {
	return ep.NewTwoLevel[T](ctx, c, cfg)
}

// ChooseTwoLevel reports whether the two-level dispatch is expected to take less time
// than the flat one for cfg on c, and says why (the cost model's figures).
func ChooseTwoLevel(c *coll.Comm, cfg Config) (bool, string) { return ep.ChooseTwoLevel(c, cfg) }
