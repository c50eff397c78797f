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

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// Act is the element type of the expert outputs and of the combined output: float32 or
// bfloat16.
type Act interface{ float32 | dtype.BFloat16 }

// Config is how the expert outputs go back (dispatch.CombineConfig: PartialDType,
// SendPartials, SumAtOrigin). The zero Config sends partial sums in the outputs' type,
// read in place where every rank maps every rank's memory.
type Config = dispatch.CombineConfig

// Combiner brings the expert outputs of one dispatcher's steps back to the ranks the
// tokens came from and sums them (dispatch.Combiner: Combine, Start, CombineRows,
// Buffer, Pipeline, Stats, Bytes, Close). Make it once with New, beside its dispatcher.
type Combiner[T Act] = dispatch.Combiner[T]

// Pending is a combine in flight (dispatch.CombinePending): Wait completes it.
type Pending[T Act] = dispatch.CombinePending[T]

// Stats describes a combine: bytes each way, and what was read in place
// (dispatch.CombineStats).
type Stats = dispatch.CombineStats

// Format is the wire format of the way back (dispatch.CombineFormat): a partial sum per
// (token, rank), or with SumAtOrigin each expert output as it was written.
type Format = dispatch.CombineFormat

// TwoLevel combines the dispatches of a dispatch.TwoLevel (dispatch.TwoLevelCombiner):
// within each host first, then each host's sum back across once.
type TwoLevel[T Act] = dispatch.TwoLevelCombiner[T]

// Experts computes one chunk's expert outputs for Combiner.Pipeline (dispatch.Experts).
type Experts[T Act] = dispatch.Experts[T]

// Plan is one step (a dispatch and its combine) over every rank, planned without running
// anything (dispatch.Plan): every rank's Schedule, as its executors lay it out.
type Plan = dispatch.Plan

// HostTraffic is one step's bytes on the wire within and across hosts, flat and
// two-level (dispatch.HostTraffic, from Plan.Hosts).
type HostTraffic = dispatch.HostTraffic

// StageTraffic is bytes on the wire within and across hosts (dispatch.StageTraffic).
type StageTraffic = dispatch.StageTraffic

// MaxChunks bounds Pipeline's chunks.
const MaxChunks = dispatch.MaxChunks

// ErrInput: this rank's expert outputs or output buffer have the wrong length
// (dispatch.ErrCombineInput).
var ErrInput = dispatch.ErrCombineInput

// New returns a combiner for the dispatches of d, a *dispatch.Dispatcher of any
// activation type (dispatch.NewCombiner). It is collective (every rank calls it) in the
// modes with buffers sized once (low-latency, Auto): it makes the exchange's buffers. A
// dispatcher serves one combine configuration (another is dispatch.ErrConfig): its
// schedules plan that combine.
func New[T Act](ctx context.Context, d dispatch.Source, cfg Config) (*Combiner[T], error) {
	return dispatch.NewCombiner[T](ctx, d, cfg)
}

// NewTwoLevel returns the combiner of d's dispatches (dispatch.NewTwoLevelCombiner;
// collective in the low-latency mode, as New is). An fp8 or int8 PartialDType applies
// to the host sums that cross hosts; within a host the partial sums travel in the
// outputs' type. SumAtOrigin is refused (dispatch.ErrConfig).
func NewTwoLevel[T Act](ctx context.Context, d *dispatch.TwoLevel[T], cfg Config) (*TwoLevel[T], error) {
	return dispatch.NewTwoLevelCombiner[T](ctx, d, cfg)
}

// Defaults returns cfg as New[T] uses it beside a dispatcher of dcfg: the partial sums'
// type defaulting to T's, every field checked (dispatch.ErrConfig).
func Defaults[T Act](dcfg dispatch.Config, cfg Config) (Config, error) {
	return dispatch.CombineDefaults[T](dcfg, cfg)
}

// LowLatencyBytes is the memory (Combiner.Bytes) that the Combiner[T] of cfg, beside a
// dispatcher of dcfg in the low-latency mode, holds on each rank once every slot has
// combined MaxTokens tokens: where every rank maps every rank's memory (shared: one
// host), or where blocks travel as messages. It runs nothing.
func LowLatencyBytes[T Act](dcfg dispatch.Config, cfg Config, shared bool) (int, error) {
	return dispatch.CombineLowLatencyBytes[T](dcfg, cfg, shared)
}

// NewPlan plans a step of every rank's routing (routings[r] is rank r's) under dcfg and
// cfg for activations and outputs of type T (the defaults of dispatch.New[T] and New[T])
// without running anything (dispatch.NewPlan); shared says every rank maps every rank's
// memory (one host), where the low-latency mode reads rows and outputs in place. In the
// Auto mode the step is planned in the mode it would run in.
func NewPlan[T Act](dcfg dispatch.Config, cfg Config, routings []*router.Routing, shared bool) (*Plan, error) {
	return dispatch.NewPlan[T](dcfg, cfg, routings, shared)
}
