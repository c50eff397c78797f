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
// A combiner serves one dispatcher, whose mode moves its blocks (internal/ep: one object
// per mode owns both halves). combine owns what the way back adds to the dispatch:
// its configuration (Config), the arithmetic, and the plan of a whole step (Plan). It
// must not import models.
package combine

import (
	"context"

	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/internal/ep"
	"github.com/moex-ai/moex/router"
)

// Act is the element type of the expert outputs and of the combined output: float32 or
// bfloat16.
type Act = ep.Out

// Config is how the expert outputs go back: PartialDType (the partial sums' type on the
// wire: f32, bf16, fp8 or int8), SendPartials (send partial sums even where the outputs
// could be read in place) and SumAtOrigin (send every output unsummed, to sum at the
// token's rank as one process does). The zero Config sends partial sums in the outputs'
// type, read in place where every rank maps every rank's memory.
type Config = ep.CombineConfig

// Source is what a combiner is made for: any *dispatch.Dispatcher.
type Source = ep.Source

// Combiner brings expert outputs back: Combine (or Start and Wait), CombineRows for
// outputs summed already, Buffer where the experts should write to be read in place,
// Pipeline for a chunked layer, Close.
type Combiner[T Act] = ep.Combiner[T]

// Pending is a combine in flight: Wait completes it.
type Pending[T Act] = ep.CombinePending[T]

// Stats describes the last combine: bytes each way, and what was read in place.
type Stats = ep.CombineStats

// Experts computes one chunk's expert outputs for Pipeline: one row of Hidden values per
// entry of o, in entry order.
type Experts[T Act] = ep.Experts[T]

// ErrInput: this rank's expert outputs or output buffer have the wrong length.
var ErrInput = ep.ErrCombineInput

// New returns a combiner for the dispatches of d. In the low-latency mode it is
// collective (every rank calls it): it makes the exchange's buffers. A dispatcher serves
// one combine configuration (another is ErrConfig): its schedules plan that combine.
func New[T Act](ctx context.Context, d Source, cfg Config) (*Combiner[T], error) {
	return ep.NewCombiner[T](ctx, d, cfg)
}

// Defaults returns cfg as New[T] uses it beside a dispatcher of dcfg: the partial sums'
// type defaulting to T's, every field checked (dispatch.ErrConfig).
func Defaults[T Act](dcfg dispatch.Config, cfg Config) (Config, error) {
	return ep.CombineDefaults(dcfg, cfg, ep.TypeOf[T]())
}

// LowLatencyBytes is the memory (Combiner.Bytes) that the Combiner[T] of cfg, beside a
// dispatcher of dcfg in the low-latency mode, holds on each rank once every slot has
// combined MaxTokens tokens: where every rank maps every rank's memory (shared: one
// host), or where blocks travel as messages. It runs nothing.
func LowLatencyBytes[T Act](dcfg dispatch.Config, cfg Config, shared bool) (int, error) {
	return ep.CombineLowLatencyBytes[T](dcfg, cfg, shared)
}

// TwoLevel combines the dispatches of a dispatch.TwoLevel: each host's sum crosses
// back once.
type TwoLevel[T Act] = ep.TwoLevelCombiner[T]

// NewTwoLevel returns the combiner of d's dispatches (collective in the low-latency
// mode, as New is). An fp8 or int8 PartialDType applies to the host sums that cross
// hosts; SumAtOrigin is refused (ErrConfig).
func NewTwoLevel[T Act](ctx context.Context, d *dispatch.TwoLevel[T], cfg Config) (*TwoLevel[T], error) {
	return ep.NewTwoLevelCombiner[T](ctx, d, cfg)
}

// Plan is one step (a dispatch and its combine) over every rank, planned without running
// anything: every rank's Schedule, as its executors lay it out. moex flow prints it.
type Plan = ep.Plan

// Format is the wire format of the way back.
type Format = ep.CombineFormat

// HostTraffic is one step's bytes within and across hosts, flat and two-level
// (Plan.Hosts); StageTraffic is one of the two.
type (
	HostTraffic  = ep.HostTraffic
	StageTraffic = ep.StageTraffic
)

// NewPlan plans a step of every rank's routing (routings[r] is rank r's) under dcfg and
// cfg for activations and outputs of type T; shared says every rank maps every rank's
// memory (one host), where the low-latency mode reads rows and outputs in place.
func NewPlan[T Act](dcfg dispatch.Config, cfg Config, routings []*router.Routing, shared bool) (*Plan, error) {
	return ep.NewPlan[T](dcfg, cfg, routings, shared)
}
