package bench

import (
	"context"
	"fmt"
	"runtime"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// MoEOpts selects an expert-parallel MoE measurement.
type MoEOpts struct {
	Model   string
	Tokens  int           // tokens per rank
	Act     dtype.Type    // the activations: F32 (default) or BF16
	Wire    dtype.Type    // F32, BF16, FP8E4M3 or I8
	Combine dtype.Type    // the partial sums on the way back: F32 or BF16 (default: F32 for an f32 wire, else BF16)
	Mode    dispatch.Mode // normal or low-latency (buffers for Tokens per rank)
	// MaxBufferBytes is dispatch.Config.MaxBufferBytes: how far the Auto mode's buffers
	// may grow, and the largest normal-mode step (0: the default; negative: no bound).
	MaxBufferBytes int
	Quantized      bool   // the experts take the fp8 or int8 rows and their scales (dispatch.Config.Quantized)
	Compute        string // "none" (identity experts) or "ffn" (the reference SwiGLU)
	// SendPartials makes the low-latency combine send partial sums where it would read
	// the expert outputs in place (dispatch.Config.SendPartials).
	SendPartials bool
	// SumAtOrigin sends the expert outputs back unsummed and sums them at the tokens'
	// ranks (dispatch.Config.SumAtOrigin).
	SumAtOrigin bool
	// PushRows makes the low-latency dispatch write each token into every destination's
	// memory where the experts would read it in place (dispatch.Config.PushRows).
	PushRows bool
	// TokensInBuffer writes each timed step's tokens where dispatch.Dispatcher.Buffer
	// says (as the layer before the MoE would write them), outside the timed dispatch,
	// which then stages none of them (the pairs still pass them in a buffer of their own).
	TokensInBuffer bool
	Placement      string // "contiguous" (default), "roundrobin"
	Iters          int    // 0: about a second's worth, 3..200
	Warmup         int
	Seed           uint64
	Naive          bool // also time the naive dispatch (one message per token-expert pair)
	// Overlap also times the step as Chunks micro-batches (default 2) in a pipeline
	// (combine.Pipeline: one chunk's rows move while another's experts compute) against
	// the same micro-batches one after the other.
	Overlap bool
	Chunks  int
	// Pairs is how many dispatch-then-combine pairs run back to back, without a barrier
	// or expert compute, for the pair period (default 32).
	Pairs int
	// Profile reports how much of the stages' time is waiting for the last rank, and
	// which rank that was: in the AlltoAllvs of the normal mode, in the exchanges of the
	// low-latency mode (the communicator must have been made with coll.Config.Profile).
	Profile bool
	// LocalRanks is how many ranks share this process (memory budget for --compute ffn).
	LocalRanks int
	// Progress, when set, is called on rank 0 after each timed step with the steps done
	// and the steps in all.
	Progress func(done, total int)
}

// Stage is one stage's figures over the timed iterations, each the slowest rank's time.
type Stage struct {
	MeanUS float64 `json:"mean_us"`
	P50US  float64 `json:"p50_us"`
	P99US  float64 `json:"p99_us"`
	Tail   Tail    `json:"tail"`       // who the slow steps waited for
	Bytes  int64   `json:"wire_bytes"` // every rank's bytes on the wire in one stage
	// Moved is what the stage must move at least once: its bytes on the wire, and for the
	// combine the expert outputs it reads (one row per (token, expert) choice, as DeepEP
	// counts a combine's bytes), when they are more.
	Moved   int64   `json:"moved_bytes"`
	FloorUS float64 `json:"copy_floor_us"`  // those bytes, each copied once, with every CPU
	OverP50 float64 `json:"p50_over_floor"` // P50US / FloorUS
	// StepFloorUS is the p50 of every rank copying its share of those bytes once in the
	// cache state of a step, timed as the stage is (stepFloors); OverStepFloor is P50US
	// over it. For a dispatch whose wire type is not the activations', the step floor also
	// converts, as the dispatch must: each of the rank's tokens into the wire type once,
	// and each row it receives back where the experts take rows in the activations' type
	// (StepFloorConverts).
	StepFloorUS       float64 `json:"step_floor_us"`
	OverStepFloor     float64 `json:"p50_over_step_floor"`
	StepFloorConverts bool    `json:"step_floor_converts,omitempty"`
	// BufferBytes is the most memory any rank held for the stage's buffers after the
	// timed steps (dispatch.Dispatcher.Bytes, combine.Combiner.Bytes).
	BufferBytes int64 `json:"buffer_bytes"`
}

// MoEResult is the outcome, the fields of `moex bench moe --json`.
type MoEResult struct {
	Model     string `json:"model"`
	Ranks     int    `json:"ranks"`
	Transport string `json:"transport"`
	Mode      string `json:"mode"`
	// StepMode is the mode the steps ran in: Mode, or the one the Auto mode picked.
	StepMode string `json:"step_mode"`
	Path     string `json:"path"` // how rows move: the AlltoAllv's algorithm, or the low-latency exchange's
	// Kernels: the vector kernels that encode, decode and sum the rows (dtype.Kernels).
	Kernels       string `json:"kernels"`
	TokensPerRank int    `json:"tokens_per_rank"`
	Act           string `json:"activations"`
	Hidden        int    `json:"hidden"`
	TopK          int    `json:"top_k"`
	Experts       int    `json:"experts"`
	Wire          string `json:"wire_dtype"`
	Quantized     bool   `json:"quantized,omitempty"` // the experts took the quantised rows
	CombineWire   string `json:"combine_dtype"`
	// CombineInPlace: the combine read the expert outputs where the experts wrote them
	// (low-latency mode, every rank reading every rank's memory), not partial sums.
	CombineInPlace bool `json:"combine_in_place"`
	// SumAtOrigin: the expert outputs went back unsummed, summed at the tokens' ranks.
	SumAtOrigin bool `json:"sum_at_origin"`
	// DispatchInPlace: the experts read the tokens where their origins wrote them
	// (dispatch.Dispatcher.RowsInPlace).
	DispatchInPlace bool `json:"dispatch_in_place"`
	// TokensInBuffer: the timed steps' tokens were written where Dispatcher.Buffer says.
	TokensInBuffer bool    `json:"tokens_in_buffer"`
	Compute        string  `json:"compute"`
	Dispatch       Stage   `json:"dispatch"`
	Combine        Stage   `json:"combine"`
	ComputeUS      float64 `json:"compute_us"`
	StepUS         float64 `json:"step_us"` // dispatch + compute + combine, the slowest rank per stage, mean
	// GOMAXPROCS, HostCPUs and HostRanks are rank 0's: its Go runtime's Ps, its host's
	// CPUs and the ranks on that host.
	GOMAXPROCS int     `json:"gomaxprocs"`
	HostCPUs   int     `json:"host_cpus"`
	HostRanks  int     `json:"host_ranks"`
	PairUS     float64 `json:"pair_us"` // one dispatch-then-combine pair, back to back (mean)
	// PairP50US and PairP99US are percentiles of the pairs' times on each rank, the
	// slowest rank's: where the mean is far above the p50, a few pairs waited long.
	PairP50US  float64 `json:"pair_p50_us"`
	PairP99US  float64 `json:"pair_p99_us"`
	TokensPerS float64 `json:"tokens_per_s"` // every rank's tokens per step time
	// ErrorRel is, with identity experts, the last step's error against the exact sum:
	// |out - ref| / |ref| over every rank's tokens (Frobenius norms), where ref is each
	// token's input times its valid choices' weights, in float64. It measures the wire
	// and combine types' rounding (and the activations'); 0 with computing experts.
	// With an fp8 wire, fp8 partial sums add nothing to it here: a rank's partial sum of
	// identity outputs is a multiple of an fp8 row, which fp8 holds exactly.
	ErrorRel float64 `json:"error_rel"`
	// DeepEP counts a dispatch's bytes per valid (token, expert) choice: for fp8 the
	// payload, its scales and 16 bytes of routing, for bf16 the payload.
	Choices        int64   `json:"choices"`
	BytesPerChoice int     `json:"bytes_per_choice"`
	ExpertImbal    float64 `json:"expert_imbalance"` // max/mean tokens per expert
	RankImbal      float64 `json:"rank_imbalance"`   // max/mean rows received per rank
	AuxLoss        float64 `json:"aux_loss"`
	Iters          int     `json:"iters"`
	// Overlap: the step as micro-batches one after the other, and pipelined.
	Chunks         int     `json:"chunks,omitempty"`
	SerialUS       float64 `json:"serial_us,omitempty"`
	OverlapUS      float64 `json:"overlap_us,omitempty"`
	OverlapSpeedup float64 `json:"overlap_speedup,omitempty"`
	NaiveUS        float64 `json:"naive_dispatch_us,omitempty"`
	NaiveMessages  int64   `json:"naive_messages,omitempty"`
	FusedOverNaive float64 `json:"naive_over_fused,omitempty"`
	// With profiling, per step (dispatch and combine together), the longest over the
	// ranks: waiting in the AlltoAllvs (normal mode) or the exchanges (low-latency mode)
	// for the last rank to arrive, and, for AlltoAllvs, moving after it; the rank that
	// arrived last most often; and, per rank, the wait charged to it (coll's
	// OpProfile.WaitFor), the longest over the ranks that waited.
	WaitUS    float64   `json:"wait_us,omitempty"`
	MoveUS    float64   `json:"move_us,omitempty"`
	LastRank  *int      `json:"last_rank,omitempty"`
	WaitForUS []float64 `json:"wait_for_us,omitempty"`
	// Run is the command line and the machine (as bench coll's rows have them).
	Run *RunInfo `json:"run,omitempty"`
}

// MoE runs the measurement on every rank of c (collectively); the result on rank 0.
func MoE(ctx context.Context, c *coll.Comm, o MoEOpts) (*MoEResult, error) {
	switch o.Act {
	case 0, dtype.F32:
		return moe[float32](ctx, c, o)
	case dtype.BF16:
		return moe[dtype.BFloat16](ctx, c, o)
	}
	return nil, fmt.Errorf("bench: activations of %v (want f32 or bf16)", o.Act)
}

func moe[T combine.Act](ctx context.Context, c *coll.Comm, o MoEOpts) (*MoEResult, error) {
	su, err := setup[T](ctx, c, &o)
	if err != nil {
		return nil, err
	}
	defer su.ep.Close()
	sc := &moeScenario[T]{moeSetup: su, o: o, c: c, out: make([]T, len(su.x))}
	tm, err := Time(ctx, c, sc, TimeOpts{Warmup: o.Warmup, Iters: o.Iters, Progress: o.Progress})
	if err != nil {
		return nil, err
	}
	sc.prof = c.ProfileOf(profiled(su.ep.D.Stats().Mode))
	res := sc.result(tm)
	for _, part := range []func(context.Context, *MoEResult) error{sc.errorAndFloors, sc.loads, sc.copyFloors, sc.extras} {
		if err := part(ctx, res); err != nil {
			return nil, err
		}
	}
	if c.Rank() != 0 {
		return nil, nil
	}
	return res, nil
}

// moeScenario is the MoE step as a Scenario: dispatch, experts, combine, each timed from
// a barrier, so that a stage's time is its own: not the wait for a rank still busy with
// the stage before, nor, where ranks outnumber CPUs, the wait for a CPU that a rank
// already in the next stage holds.
type moeScenario[T combine.Act] struct {
	*moeSetup[T]
	o            MoEOpts
	c            *coll.Comm
	out          []T
	combineBytes int
	lastOut      *dispatch.Output[T] // the last timed step's, for the in-step floors
	inBuffer     bool
	prof0, prof  coll.OpProfile // the profile before and after the timed steps
	iters        int
}

func (sc *moeScenario[T]) Stages() []string { return []string{"dispatch", "experts", "combine"} }

// experts runs this rank's experts on o2's rows: the layer's, or identity ones.
func (sc *moeScenario[T]) experts(o2 *dispatch.Output[T]) error {
	if sc.o.Compute == "ffn" {
		return sc.ep.Experts(o2)
	}
	sc.ep.Identity(o2)
	return nil
}

func (sc *moeScenario[T]) Step(ctx context.Context, i int, rec []float64) error {
	ep := sc.ep
	if i == 0 && rec != nil {
		sc.prof0 = sc.c.ProfileOf(profiled(ep.D.Stats().Mode)) // the warm-up's steps ran in it
	}
	xs := sc.x
	if b := ep.D.Buffer(); b != nil && sc.o.TokensInBuffer {
		xs, sc.inBuffer = b[:copy(b, sc.x)], true // the layer before writes them there
	}
	var t [6]time.Time // each stage's start and end
	stage := func(k int, run func() error) error {
		if rec != nil {
			if err := coll.Barrier(ctx, sc.c); err != nil {
				return err
			}
		}
		t[2*k] = time.Now()
		err := run()
		t[2*k+1] = time.Now()
		return err
	}
	var dout *dispatch.Output[T]
	var h dispatch.Handle
	if err := stage(0, func() (err error) { dout, h, err = ep.D.Dispatch(ctx, xs, sc.r); return err }); err != nil {
		return err
	}
	if err := stage(1, func() error { return sc.experts(dout) }); err != nil {
		return err
	}
	if err := stage(2, func() error { return ep.C.Combine(ctx, h, ep.Output(), sc.out) }); err != nil {
		return err
	}
	for k := range rec {
		rec[k] = t[2*k+1].Sub(t[2*k]).Seconds()
	}
	sc.combineBytes = ep.C.Stats().BytesSent
	if ep.C.InPlace() { // the expert outputs this rank read in other ranks' memory
		sc.combineBytes = ep.C.Stats().BytesRead
	}
	sc.lastOut = dout
	return nil
}

// result is the run's figures that the timing and the stages' settings give.
func (sc *moeScenario[T]) result(tm *Timing) *MoEResult {
	o, c, ep, cfg := sc.o, sc.c, sc.ep, sc.cfg
	p := c.Size()
	sc.iters = tm.Iters
	st := ep.D.Stats()
	res := &MoEResult{
		Model: cfg.Name, Ranks: p, Transport: c.Transport().Name(), Mode: o.Mode.String(), StepMode: st.Mode.String(), TokensPerRank: o.Tokens,
		Act: o.Act.String(), Hidden: cfg.Hidden, TopK: cfg.TopK, Experts: cfg.Experts, Wire: o.Wire.String(), Quantized: o.Quantized,
		CombineWire: ep.C.Config().PartialDType.String(), CombineInPlace: ep.C.InPlace(), SumAtOrigin: ep.C.Config().SumAtOrigin, DispatchInPlace: ep.D.RowsInPlace(), TokensInBuffer: sc.inBuffer, Compute: o.Compute, Iters: tm.Iters,
		GOMAXPROCS: runtime.GOMAXPROCS(0), HostCPUs: runtime.NumCPU(), HostRanks: HostRanks(c),
	}
	switch st.Mode {
	case dispatch.LowLatency:
		res.Path = fmt.Sprintf("exchange, written into %d of %d peers' memory", st.Pushed, p-1)
		if st.Put > 0 {
			res.Path = fmt.Sprintf("exchange, one-sided: put into %d of %d peers' registered windows, then a signal", st.Put, p-1)
		}
		if ep.D.RowsInPlace() {
			res.Path = fmt.Sprintf("exchange of headers; the experts read the tokens in their origins' memory (%d peers)", p-1)
			if sc.inBuffer {
				res.Path += "; the tokens written where Dispatcher.Buffer says, outside the timed dispatch"
			}
		}
	case dispatch.Gathered:
		res.Path = fmt.Sprintf("allgatherv %v, reducescatterv %v", c.Algorithm(coll.OpAllGatherv, st.BytesSent/max(p-1, 1)), c.Algorithm(coll.OpReduceScatterv, st.BytesSent/max(p-1, 1)))
	default:
		res.Path = st.Algo.String()
	}
	res.Kernels = dtype.Kernels()
	res.Dispatch, res.Combine = tm.Stage(0), tm.Stage(2)
	res.ComputeUS = tm.Stage(1).MeanUS
	res.StepUS = mean(tm.Steps()) * 1e6
	if res.StepUS > 0 {
		res.TokensPerS = float64(p*o.Tokens) / (res.StepUS / 1e6)
	}
	return res
}

// errorAndFloors measures the step's error (identity experts), the buffers held and the
// stages' in-step floors.
func (sc *moeScenario[T]) errorAndFloors(ctx context.Context, res *MoEResult) error {
	o, c, ep, cfg := sc.o, sc.c, sc.ep, sc.cfg
	var err error
	if o.Compute != "ffn" {
		if res.ErrorRel, err = identityError(ctx, c, sc.x, sc.r, sc.out, cfg.Hidden); err != nil {
			return err
		}
	}
	var conv func() int
	if sc.lastOut != nil {
		conv = conversions(sc.x, o.Tokens, cfg.Hidden, o.Wire, o.Quantized, decodedRows(sc.lastOut))
	}
	dFloor, cFloor, err := stepFloors(ctx, c, sc.lastOut, sc.x, o.Tokens, cfg.Hidden, ep.Output, sc.experts, min(sc.iters, 30),
		dispatch.NewFormat(ep.D.Config()).Payload, ep.D.Stats().BytesSent, conv)
	if err != nil {
		return err
	}
	held := []float64{float64(ep.D.Bytes()), float64(ep.C.Bytes())}
	if err := coll.AllReduce(ctx, c, nil, held, dtype.Max); err != nil {
		return err
	}
	res.Dispatch.BufferBytes, res.Combine.BufferBytes = int64(held[0]), int64(held[1])
	for _, sf := range []struct {
		s     *Stage
		floor float64
	}{{&res.Dispatch, dFloor}, {&res.Combine, cFloor}} {
		sf.s.StepFloorUS = sf.floor * 1e6
		sf.s.StepFloorConverts = sf.s == &res.Dispatch && conv != nil
		if sf.floor > 0 {
			sf.s.OverStepFloor = sf.s.P50US / sf.s.StepFloorUS
		}
	}
	return nil
}

// loads sums every rank's bytes, rows and choices: the stages' bytes, DeepEP's count
// and the imbalances.
func (sc *moeScenario[T]) loads(ctx context.Context, res *MoEResult) error {
	c, cfg := sc.c, sc.cfg
	p := c.Size()
	st := sc.ep.D.Stats()
	stats := sc.r.Stats()
	f := dispatch.NewFormat(sc.ep.D.Config())
	loads := make([]int64, 3+p+cfg.Experts)
	loads[0], loads[1], loads[2] = int64(st.BytesSent), int64(sc.combineBytes), int64(st.Assignments)
	for q, n := range st.RowsPerRank {
		loads[3+q] = int64(n)
	}
	for e, n := range stats.TokensPerExpert {
		loads[3+p+e] = int64(n)
	}
	if err := coll.AllReduce(ctx, c, nil, loads, dtype.Sum); err != nil {
		return err
	}
	res.Dispatch.Bytes, res.Combine.Bytes, res.Choices = loads[0], loads[1], loads[2]
	res.BytesPerChoice = f.Payload
	if f.Scales > 0 {
		res.BytesPerChoice = f.Payload + f.ScaleBytes() + 16
	}
	rowsPerRank := make([]int, p)
	for q := range rowsPerRank {
		rowsPerRank[q] = int(loads[3+q])
	}
	res.RankImbal = router.Imbalance(rowsPerRank)
	perExpert := make([]int, cfg.Experts)
	for e := range perExpert {
		perExpert[e] = int(loads[3+p+e])
	}
	res.ExpertImbal = router.Imbalance(perExpert)
	res.AuxLoss = stats.AuxLoss
	return nil
}

// copyFloors is every rank's stage bytes copied once, every rank at once.
func (sc *moeScenario[T]) copyFloors(ctx context.Context, res *MoEResult) error {
	c := sc.c
	p := c.Size()
	st := sc.ep.D.Stats()
	outputs := int64(st.Assignments) * int64(sc.cfg.Hidden) * int64(sc.o.Act.Size()) // the expert outputs of this rank's tokens
	sent := []int64{int64(st.BytesSent), max(int64(sc.combineBytes), outputs)}
	allSent := make([]int64, 2*p)
	if err := coll.AllGather(ctx, c, sent, allSent); err != nil {
		return err
	}
	if c.Rank() == 0 {
		for k, s := range []*Stage{&res.Dispatch, &res.Combine} {
			per := make([]int, p)
			for q := range per {
				per[q] = int(allSent[2*q+k])
				s.Moved += allSent[2*q+k]
			}
			s.FloorUS = StageFloor(per).Seconds() * 1e6
			if s.FloorUS > 0 {
				s.OverP50 = s.P50US / s.FloorUS
			}
		}
	}
	return coll.Barrier(ctx, c)
}

// extras runs what the options ask for beside the timed steps: the pair period, the
// chunked pipeline, the profile of the waits, the naive dispatch.
func (sc *moeScenario[T]) extras(ctx context.Context, res *MoEResult) error {
	o, c, ep := sc.o, sc.c, sc.ep
	var err error
	// The pair period: dispatch then combine, back to back, no barrier, no compute.
	if res.PairUS, res.PairP50US, res.PairP99US, err = pairPeriod(ctx, c, ep, sc.x, sc.r, sc.out, o.Pairs); err != nil {
		return err
	}
	if o.Overlap {
		res.Chunks = o.Chunks
		if res.SerialUS, res.OverlapUS, err = overlap(ctx, c, ep, sc.x, sc.r, sc.out, o.Chunks, sc.iters, sc.experts); err != nil {
			return err
		}
		if res.OverlapUS > 0 {
			res.OverlapSpeedup = res.SerialUS / res.OverlapUS
		}
	}
	if o.Profile {
		if err := profileWaits(ctx, c, sc.prof0, sc.prof, sc.iters, res); err != nil {
			return err
		}
	}
	if o.Naive {
		us, msgs, err := naiveDispatch(ctx, c, sc.x32, sc.r, sc.pl, sc.cfg.Hidden, o.Wire)
		if err != nil {
			return err
		}
		res.NaiveUS, res.NaiveMessages = us, msgs
		if res.Dispatch.MeanUS > 0 {
			res.FusedOverNaive = us / res.Dispatch.MeanUS
		}
	}
	return nil
}

// profileWaits reports, from the communicator's profile over the timed steps, how much
// of a stage was waiting for the last rank and which rank that was.
func profileWaits(ctx context.Context, c *coll.Comm, prof0, prof coll.OpProfile, iters int, res *MoEResult) error {
	p := c.Size()
	us := func(d time.Duration) float64 { return d.Seconds() / float64(iters) * 1e6 }
	wm := make([]float64, 2+p)
	wm[0], wm[1] = us(prof.Wait-prof0.Wait), us(prof.Move-prof0.Move)
	for q, d := range prof.WaitFor {
		if q < len(prof0.WaitFor) {
			d -= prof0.WaitFor[q]
		}
		wm[2+q] = us(d)
	}
	if err := coll.AllReduce(ctx, c, nil, wm, dtype.Max); err != nil {
		return err
	}
	res.WaitUS, res.MoveUS, res.WaitForUS = wm[0], wm[1], wm[2:]
	last, most := 0, -1
	for q, k := range prof.Last {
		if q < len(prof0.Last) {
			k -= prof0.Last[q]
		}
		if k > most {
			last, most = q, k
		}
	}
	res.LastRank = &last
	return nil
}
