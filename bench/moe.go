package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/models"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport/bootstrap"
)

// MoEOpts selects an expert-parallel MoE measurement.
type MoEOpts struct {
	Model     string
	Tokens    int           // tokens per rank
	Act       dtype.Type    // the activations: F32 (default) or BF16
	Wire      dtype.Type    // F32, BF16, FP8E4M3 or I8
	Combine   dtype.Type    // the partial sums on the way back: F32 or BF16 (default: F32 for an f32 wire, else BF16)
	Mode      dispatch.Mode // normal or low-latency (buffers for Tokens per rank)
	Quantized bool          // the experts take the fp8 or int8 rows and their scales (dispatch.Config.Quantized)
	Compute   string        // "none" (identity experts) or "ffn" (the reference SwiGLU)
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
	Path      string `json:"path"` // how rows move: the AlltoAllv's algorithm, or the low-latency exchange's
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
}

// profiled is the operation whose waits the profile of a mode's stages reports.
func profiled(m dispatch.Mode) coll.OpKind {
	if m == dispatch.LowLatency {
		return coll.OpExchange
	}
	return coll.OpAlltoAllv
}

const dtype32 = dtype.F32

// defaultCombine is the bench's combine type for a wire type: f32 after an f32 wire,
// else bf16 (DeepEP's fp8 dispatch, bf16 combine).
func defaultCombine(wire dtype.Type) dtype.Type {
	if wire == dtype.F32 {
		return dtype.F32
	}
	return dtype.BF16
}

func memTotal() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 8 << 30
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) >= 2 && fs[0] == "MemTotal:" {
			kb, _ := strconv.ParseInt(fs[1], 10, 64)
			return kb << 10
		}
	}
	return 8 << 30
}

// moeSetup is one rank's expert-parallel layer and tokens, routed.
type moeSetup[T combine.Act] struct {
	cfg models.Config
	pl  *router.Placement
	ep  *models.EP[T]
	x32 []float32 // the tokens
	x   []T       // the same, as the activations
	r   *router.Routing
}

// setup builds, on this rank, the model's layer (with this rank's experts when o.Compute
// is ffn), its expert-parallel form and routed tokens. It fills o's defaults. The caller
// closes s.ep.
func setup[T combine.Act](ctx context.Context, c *coll.Comm, o *MoEOpts) (*moeSetup[T], error) {
	cfg, err := models.Get(o.Model)
	if err != nil {
		return nil, err
	}
	if o.Wire == 0 {
		o.Wire = dtype.F32
	}
	o.Act = dtype.Of[T]()
	switch {
	case o.Combine == 0 && o.SumAtOrigin:
		o.Combine = o.Act // the outputs travel as they are
	case o.Combine == 0:
		o.Combine = defaultCombine(o.Wire)
	}
	if o.Warmup == 0 {
		o.Warmup = 2
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.Chunks == 0 {
		o.Chunks = 2
	}
	if o.Pairs == 0 {
		o.Pairs = 32
	}
	pl, err := placementOf(o.Placement, cfg.Experts, c.Size())
	if err != nil {
		return nil, err
	}
	experts := []int{} // none: identity experts
	switch o.Compute {
	case "none", "":
		o.Compute = "none"
	case "ffn":
		experts = pl.Local[c.Rank()]
	default:
		return nil, fmt.Errorf("bench: --compute %q (want none or ffn)", o.Compute)
	}
	budget := memTotal() * 6 / 10 / int64(max(o.LocalRanks, 1))
	layer, err := models.NewRoutedLayer(cfg, o.Seed, experts, budget)
	if err != nil {
		return nil, fmt.Errorf("%w (use --compute none, a smaller model or fewer ranks per process)", err)
	}
	dcfg := dispatch.Config{WireDType: o.Wire, Placement: pl, Mode: o.Mode, MaxTokens: max(o.Tokens, 1), Quantized: o.Quantized, PushRows: o.PushRows}
	ccfg := combine.Config{PartialDType: o.Combine, SendPartials: o.SendPartials, SumAtOrigin: o.SumAtOrigin}
	ep, err := models.NewEP[T](ctx, c, layer, dcfg, ccfg)
	if err != nil {
		return nil, err
	}
	x32 := models.Floats(cfg.Tokens(o.Seed, c.Rank(), o.Tokens))
	r, err := layer.Route(x32, o.Tokens)
	if err != nil {
		ep.Close()
		return nil, err
	}
	x := make([]T, len(x32))
	dtype.Convert(x, x32)
	return &moeSetup[T]{cfg: cfg, pl: pl, ep: ep, x32: x32, x: x, r: r}, nil
}

// placementOf places experts on p ranks as the --placement flag names it.
func placementOf(name string, experts, p int) (*router.Placement, error) {
	kind := router.Contiguous
	switch name {
	case "", "contiguous":
	case "roundrobin", "round-robin":
		kind = router.RoundRobin
	default:
		return nil, fmt.Errorf("bench: placement %q (want contiguous or roundrobin)", name)
	}
	return router.NewPlacement(kind, experts, p)
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
	cfg, pl, ep, x, r := su.cfg, su.pl, su.ep, su.x, su.r
	p, me := c.Size(), c.Rank()
	out := make([]T, len(x))
	experts := func(o2 *dispatch.Output[T]) error {
		if o.Compute == "ffn" {
			return ep.Experts(o2)
		}
		ep.Identity(o2)
		return nil
	}
	var combineBytes int
	var lastOut *dispatch.Output[T] // the last timed step's, for the in-step floors
	// A timed step starts each stage together (a barrier before it), so that a stage's
	// time is its own: not the wait for a rank still busy with the stage before, nor,
	// where ranks outnumber CPUs, the wait for a CPU that a rank already in the next
	// stage holds.
	inBuffer := false
	step := func(rec []float64) error {
		xs := x
		if b := ep.D.Buffer(); b != nil && o.TokensInBuffer {
			xs, inBuffer = b[:copy(b, x)], true // the layer before writes them there
		}
		if rec != nil {
			if err := coll.Barrier(ctx, c); err != nil {
				return err
			}
		}
		t0 := time.Now()
		dout, h, err := ep.D.Dispatch(ctx, xs, r)
		if err != nil {
			return err
		}
		t1 := time.Now()
		if rec != nil {
			if err := coll.Barrier(ctx, c); err != nil {
				return err
			}
		}
		t1b := time.Now()
		if err := experts(dout); err != nil {
			return err
		}
		t2 := time.Now()
		if rec != nil {
			if err := coll.Barrier(ctx, c); err != nil {
				return err
			}
		}
		t2b := time.Now()
		if err := ep.C.Combine(ctx, h, ep.Output(), out); err != nil {
			return err
		}
		t3 := time.Now()
		if rec != nil {
			rec[0], rec[1], rec[2] = t1.Sub(t0).Seconds(), t2.Sub(t1b).Seconds(), t3.Sub(t2b).Seconds()
		}
		combineBytes = ep.C.Stats().BytesSent
		if ep.C.InPlace() { // the expert outputs this rank read in other ranks' memory
			combineBytes = ep.C.Stats().BytesRead
		}
		lastOut = dout
		return nil
	}
	for i := 0; i < o.Warmup; i++ {
		if err := step(nil); err != nil {
			return nil, err
		}
	}
	iters := o.Iters
	if iters <= 0 {
		start := time.Now()
		if err := step(nil); err != nil {
			return nil, err
		}
		per := []float64{time.Since(start).Seconds()}
		if err := coll.AllReduce(ctx, c, nil, per, dtype.Max); err != nil {
			return nil, err
		}
		iters = int(min(200, max(5, 1/max(per[0], 1e-6))))
	}
	prof0 := c.ProfileOf(profiled(o.Mode))
	// Every rank's stage times are kept: a stage takes, each iteration, as long as its
	// slowest rank.
	times := make([]float64, 3*iters)
	for i := 0; i < iters; i++ {
		if err := step(times[3*i : 3*i+3]); err != nil {
			return nil, err
		}
		if me == 0 && o.Progress != nil {
			o.Progress(i+1, iters)
		}
	}
	prof := c.ProfileOf(profiled(o.Mode))
	var errRel float64
	if o.Compute != "ffn" {
		if errRel, err = identityError(ctx, c, x, r, out, cfg.Hidden); err != nil {
			return nil, err
		}
	}
	var conv func() int
	if lastOut != nil {
		conv = conversions(x, o.Tokens, cfg.Hidden, o.Wire, o.Quantized, decodedRows(lastOut))
	}
	dFloor, cFloor, err := stepFloors(ctx, c, lastOut, x, o.Tokens, cfg.Hidden, ep.Output, experts, min(iters, 30),
		dispatch.NewFormat(ep.D.Config()).Payload, ep.D.Stats().BytesSent, conv)
	if err != nil {
		return nil, err
	}
	if err := coll.AllReduce(ctx, c, nil, times, dtype.Max); err != nil {
		return nil, err
	}
	held := []float64{float64(ep.D.Bytes()), float64(ep.C.Bytes())}
	if err := coll.AllReduce(ctx, c, nil, held, dtype.Max); err != nil {
		return nil, err
	}
	st := ep.D.Stats()
	res := &MoEResult{
		Model: cfg.Name, Ranks: p, Transport: c.Transport().Name(), Mode: o.Mode.String(), TokensPerRank: o.Tokens,
		Act: o.Act.String(), Hidden: cfg.Hidden, TopK: cfg.TopK, Experts: cfg.Experts, Wire: o.Wire.String(), Quantized: o.Quantized,
		CombineWire: ep.C.Config().PartialDType.String(), CombineInPlace: ep.C.InPlace(), SumAtOrigin: ep.C.Config().SumAtOrigin, DispatchInPlace: ep.D.RowsInPlace(), TokensInBuffer: inBuffer, Compute: o.Compute, Iters: iters,
		GOMAXPROCS: runtime.GOMAXPROCS(0), HostCPUs: runtime.NumCPU(), HostRanks: HostRanks(c),
	}
	switch o.Mode {
	case dispatch.LowLatency:
		res.Path = fmt.Sprintf("exchange, written into %d of %d peers' memory", st.Pushed, p-1)
		if ep.D.RowsInPlace() {
			res.Path = fmt.Sprintf("exchange of headers; the experts read the tokens in their origins' memory (%d peers)", p-1)
			if inBuffer {
				res.Path += "; the tokens written where Dispatcher.Buffer says, outside the timed dispatch"
			}
		}
	case dispatch.Gathered:
		res.Path = fmt.Sprintf("allgatherv %v, reducescatterv %v", c.Algorithm(coll.OpAllGatherv, st.BytesSent/max(p-1, 1)), c.Algorithm(coll.OpReduceScatterv, st.BytesSent/max(p-1, 1)))
	default:
		res.Path = st.Algo.String()
	}
	res.Kernels = dtype.Kernels()
	res.ErrorRel = errRel
	res.Dispatch = stageOf(times, 0, iters)
	res.Combine = stageOf(times, 2, iters)
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
	comp := stageOf(times, 1, iters)
	res.ComputeUS = comp.MeanUS
	steps := make([]float64, iters)
	for i := range steps {
		steps[i] = times[3*i] + times[3*i+1] + times[3*i+2]
	}
	res.StepUS = mean(steps) * 1e6
	if res.StepUS > 0 {
		res.TokensPerS = float64(p*o.Tokens) / (res.StepUS / 1e6)
	}

	// Bytes, loads and DeepEP's count, summed over the ranks.
	stats := r.Stats()
	f := dispatch.NewFormat(ep.D.Config())
	loads := make([]int64, 3+p+cfg.Experts)
	loads[0], loads[1], loads[2] = int64(st.BytesSent), int64(combineBytes), int64(st.Assignments)
	for q, n := range st.RowsPerRank {
		loads[3+q] = int64(n)
	}
	for e, n := range stats.TokensPerExpert {
		loads[3+p+e] = int64(n)
	}
	if err := coll.AllReduce(ctx, c, nil, loads, dtype.Sum); err != nil {
		return nil, err
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

	// Copy floors: every rank's stage bytes copied once, every rank at once.
	outputs := int64(st.Assignments) * int64(cfg.Hidden) * int64(o.Act.Size()) // the expert outputs of this rank's tokens
	sent := []int64{int64(st.BytesSent), max(int64(combineBytes), outputs)}
	allSent := make([]int64, 2*p)
	if err := coll.AllGather(ctx, c, sent, allSent); err != nil {
		return nil, err
	}
	if me == 0 {
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
	if err := coll.Barrier(ctx, c); err != nil {
		return nil, err
	}

	// The pair period: dispatch then combine, back to back, no barrier, no compute.
	if res.PairUS, res.PairP50US, res.PairP99US, err = pairPeriod(ctx, c, ep, x, r, out, o.Pairs); err != nil {
		return nil, err
	}

	if o.Overlap {
		res.Chunks = o.Chunks
		if res.SerialUS, res.OverlapUS, err = overlap(ctx, c, ep, x, r, out, o.Chunks, iters, experts); err != nil {
			return nil, err
		}
		if res.OverlapUS > 0 {
			res.OverlapSpeedup = res.SerialUS / res.OverlapUS
		}
	}
	if o.Profile {
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
			return nil, err
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
	}
	if o.Naive {
		us, msgs, err := naiveDispatch(ctx, c, su.x32, r, pl, cfg.Hidden, o.Wire)
		if err != nil {
			return nil, err
		}
		res.NaiveUS, res.NaiveMessages = us, msgs
		if res.Dispatch.MeanUS > 0 {
			res.FusedOverNaive = us / res.Dispatch.MeanUS
		}
	}
	if me != 0 {
		return nil, nil
	}
	return res, nil
}

// identityError is the relative error of out, this rank's combined tokens from identity
// experts, against each token's input times the sum of its valid choices' weights (in
// float64), over every rank's tokens: sqrt(sum (out-ref)^2 / sum ref^2).
func identityError[T combine.Act](ctx context.Context, c *coll.Comm, x []T, r *router.Routing, out []T, hid int) (float64, error) {
	sums := make([]float64, 2) // squared error, squared reference
	xf, of := make([]float32, hid), make([]float32, hid)
	for t := 0; t < r.T; t++ {
		w := 0.0
		for j := 0; j < r.K; j++ {
			if r.Experts[t*r.K+j] >= 0 {
				w += float64(r.Weights[t*r.K+j])
			}
		}
		dtype.Convert(xf, x[t*hid:(t+1)*hid])
		dtype.Convert(of, out[t*hid:(t+1)*hid])
		for i := range xf {
			ref := w * float64(xf[i])
			d := float64(of[i]) - ref
			sums[0] += d * d
			sums[1] += ref * ref
		}
	}
	if err := coll.AllReduce(ctx, c, nil, sums, dtype.Sum); err != nil {
		return 0, err
	}
	if sums[1] == 0 {
		return 0, nil
	}
	return math.Sqrt(sums[0] / sums[1]), nil
}

// stageOf is stage k's figures from the per-iteration times (seconds, [iteration][3]).
func stageOf(times []float64, k, iters int) Stage {
	v := make([]float64, iters)
	for i := range v {
		v[i] = times[3*i+k]
	}
	return Stage{MeanUS: mean(v) * 1e6, P50US: percentile(v, 0.50) * 1e6, P99US: percentile(v, 0.99) * 1e6}
}

func mean(v []float64) float64 {
	s := 0.0
	for _, x := range v {
		s += x
	}
	return s / float64(max(len(v), 1))
}

// percentile is the q-th quantile of v (nearest rank).
func percentile(v []float64, q float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	i := int(q*float64(len(s))+0.999999) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// HostRanks counts the ranks of c on this rank's host.
func HostRanks(c *coll.Comm) int {
	ls := c.Links()
	n := 0
	for _, l := range ls {
		if l.Host == ls[c.Rank()].Host {
			n++
		}
	}
	return n
}

// SharedCPUsAdvice is a word of advice where hostRanks ranks that talk over transport
// (a transport's name) share cpus CPUs with procs Ps each, more than their share
// (bootstrap.ProcsShare), else "".
func SharedCPUsAdvice(transport string, procs, cpus, hostRanks int) string {
	share := bootstrap.ProcsShare(transport, procs, cpus, hostRanks)
	if share == 0 {
		return ""
	}
	return fmt.Sprintf("%d ranks share %d CPUs over %s with GOMAXPROCS %d, so every message wakes threads of the Go runtime on CPUs the ranks need: set GOMAXPROCS=%d, each rank's share, or MOEX_GOMAXPROCS=auto, which moex run and moex bench set (README: Transports and buffers)",
		hostRanks, cpus, transport, procs, share)
}

// SharedCPUsNote is SharedCPUsAdvice for the ranks of r.
func SharedCPUsNote(r *MoEResult) string {
	return SharedCPUsAdvice(r.Transport, r.GOMAXPROCS, r.HostCPUs, r.HostRanks)
}

// pairPeriod times n dispatch-then-combine pairs back to back (the expert outputs are a
// fixed buffer, or the combine's where it reads them in place: the pair moves the bytes,
// nothing computes) and returns, in microseconds, the slowest rank's mean time per pair
// and the slowest rank's p50 and p99 of the pairs' times.
func pairPeriod[T combine.Act](ctx context.Context, c *coll.Comm, ep *models.EP[T], x []T, r *router.Routing, out []T, n int) (mean, p50, p99 float64, err error) {
	hid := ep.L.Cfg.Hidden
	var y []T
	pair := func() error {
		o, h, err := ep.D.Dispatch(ctx, x, r)
		if err != nil {
			return err
		}
		ys := ep.C.Buffer(h)
		if ys == nil {
			if cap(y) < o.Rows()*hid {
				y = make([]T, o.Rows()*hid)
			}
			ys = y[:o.Rows()*hid]
		}
		return ep.C.Combine(ctx, h, ys, out)
	}
	// One pair untimed: the first allocates the expert outputs, and faulting in their
	// pages (tens of MiB at 128 tokens) would be timed as one pair's.
	if err := pair(); err != nil {
		return 0, 0, 0, err
	}
	ts := make([]float64, 0, n)
	if err := coll.Barrier(ctx, c); err != nil {
		return 0, 0, 0, err
	}
	start := time.Now()
	last := start
	for i := 0; i < n; i++ {
		if err := pair(); err != nil {
			return 0, 0, 0, err
		}
		now := time.Now()
		ts = append(ts, float64(now.Sub(last).Nanoseconds())/1e3)
		last = now
	}
	v := []float64{time.Since(start).Seconds() / float64(max(n, 1)) * 1e6, percentile(ts, 0.5), percentile(ts, 0.99)}
	if err := coll.AllReduce(ctx, c, nil, v, dtype.Max); err != nil {
		return 0, 0, 0, err
	}
	return v[0], v[1], v[2], nil
}

// overlap times the step as chunks micro-batches one after the other and pipelined
// (combine.Pipeline), and returns the slowest rank's mean time of each.
func overlap[T combine.Act](ctx context.Context, c *coll.Comm, ep *models.EP[T], x []T, r *router.Routing, out []T, chunks, iters int, experts func(*dispatch.Output[T]) error) (serial, pipelined float64, err error) {
	run := func(o *dispatch.Output[T]) ([]T, error) {
		if err := experts(o); err != nil {
			return nil, err
		}
		return ep.Output(), nil
	}
	hid := ep.L.Cfg.Hidden
	serialStep := func() error {
		for i := 0; i < chunks; i++ {
			a, b := r.T*i/chunks, r.T*(i+1)/chunks
			ri := &router.Routing{T: b - a, K: r.K, E: r.E, Experts: r.Experts[a*r.K : b*r.K], Weights: r.Weights[a*r.K : b*r.K]}
			if err := ep.C.Pipeline(ctx, ep.D, x[a*hid:b*hid], ri, 1, run, out[a*hid:b*hid]); err != nil {
				return err
			}
		}
		return nil
	}
	pipeStep := func() error { return ep.C.Pipeline(ctx, ep.D, x, r, chunks, run, out) }
	var ts, tp time.Duration
	for i := 0; i < iters+1; i++ {
		for k, f := range []func() error{serialStep, pipeStep} {
			if err := coll.Barrier(ctx, c); err != nil {
				return 0, 0, err
			}
			start := time.Now()
			if err := f(); err != nil {
				return 0, 0, err
			}
			if i > 0 { // the first round warms up
				if k == 0 {
					ts += time.Since(start)
				} else {
					tp += time.Since(start)
				}
			}
		}
	}
	v := []float64{ts.Seconds() / float64(iters) * 1e6, tp.Seconds() / float64(iters) * 1e6}
	if err := coll.AllReduce(ctx, c, nil, v, dtype.Max); err != nil {
		return 0, 0, err
	}
	return v[0], v[1], nil
}

// stepFloors times every rank copying once, in the cache state of a step, what its
// stages move, each iteration as a stage is timed (every rank starting together, the
// slowest rank's time) and returns the p50s over iters: after the experts have run (on
// out, the last dispatch's output, as in a step), the sent bytes of the dispatch, taken
// from the tokens x a payload (bytes of a row on the wire) at a time, into one buffer;
// then the combine's reads, the expert outputs y(), row by row into another; where ranks
// outnumber the host's CPUs, no less than all the ranks' copying shared among them. What the
// stages add to these copies is their protocol, their waiting for one another and their
// writes into other ranks' memory. StageFloor is the same bytes copied with warm caches.
func stepFloors[T combine.Act](ctx context.Context, c *coll.Comm, out *dispatch.Output[T], x []T, tokens, hid int,
	y func() []T, experts func(*dispatch.Output[T]) error, iters, payload, sent int, conv func() int) (disp, comb float64, err error) {
	if out == nil || iters <= 0 || tokens == 0 {
		return 0, 0, nil
	}
	xb := dtype.Bytes(x)
	rowB := len(xb) / tokens
	pay := max(min(payload, rowB), 1)
	dbuf := make([]byte, sent)
	var cbuf []T
	times := make([]float64, 2*iters)
	for i := 0; i < iters; i++ {
		if err := coll.Barrier(ctx, c); err != nil {
			return 0, 0, err
		}
		t0 := time.Now()
		for off, t := 0, 0; off < sent; t = (t + 1) % tokens {
			off += copy(dbuf[off:min(off+pay, sent)], xb[t*rowB:])
		}
		if conv != nil {
			conv()
		}
		times[2*i] = time.Since(t0).Seconds()
		if err := experts(out); err != nil {
			return 0, 0, err
		}
		if err := coll.Barrier(ctx, c); err != nil {
			return 0, 0, err
		}
		ys := y()[:out.Rows()*hid]
		if cbuf == nil {
			cbuf = make([]T, len(ys))
		}
		t1 := time.Now()
		for r := 0; r < len(ys); r += hid {
			copy(cbuf[r:r+hid], ys[r:r+hid])
		}
		times[2*i+1] = time.Since(t1).Seconds()
	}
	// The slowest rank's copy, or, where ranks outnumber CPUs and so copy in turns, every
	// rank's copying shared among the CPUs, whichever is longer.
	sum := append([]float64(nil), times...)
	if err := coll.AllReduce(ctx, c, nil, times, dtype.Max); err != nil {
		return 0, 0, err
	}
	if err := coll.AllReduce(ctx, c, nil, sum, dtype.Sum); err != nil {
		return 0, 0, err
	}
	cpus := float64(min(c.Size(), runtime.NumCPU()))
	d, cm := make([]float64, iters), make([]float64, iters)
	for i := range d {
		d[i], cm[i] = max(times[2*i], sum[2*i]/cpus), max(times[2*i+1], sum[2*i+1]/cpus)
	}
	return percentile(d, 0.5), percentile(cm, 0.5), nil
}

// conversions returns what a dispatch computes besides moving bytes, for its step floor:
// each of the rank's tokens in x converted into the wire type once, and, unless the
// experts take the quantised rows, each of the rows it received converted back. The
// conversions run on one row of scratch, whose bytes the floor's copy already counts; the
// function returns how many rows it converted. It is nil where the wire type is the
// activations'.
func conversions[T combine.Act](x []T, tokens, hid int, wire dtype.Type, quantized bool, rows int) func() int {
	if wire == dtype.Of[T]() {
		return nil
	}
	q := make([]byte, hid*wire.Size())
	sc := make([]float32, max(dtype.FP8Scales(hid), 1))
	back := make([]T, hid)
	var enc func(row []T)
	var dec func()
	switch wire {
	case dtype.FP8E4M3:
		enc = func(row []T) { dtype.QuantizeFP8(q, sc, row, false) }
		dec = func() { dtype.DequantizeFP8(back, q, sc) }
	case dtype.I8:
		enc = func(row []T) { sc[0] = dtype.QuantizeI8(q, row) }
		dec = func() { dtype.DequantizeI8(back, q, sc[0]) }
	case dtype.BF16:
		w := dtype.FromBytes[dtype.BFloat16](q)
		enc = func(row []T) { dtype.Convert(w, row) }
		dec = func() { dtype.Convert(back, w) }
	case dtype.F32:
		w := dtype.FromBytes[float32](q)
		enc = func(row []T) { dtype.Convert(w, row) }
		dec = func() { dtype.Convert(back, w) }
	default:
		return nil
	}
	if quantized {
		rows = 0
	}
	return func() int {
		for t := 0; t < tokens; t++ {
			enc(x[t*hid : (t+1)*hid])
		}
		for r := 0; r < rows; r++ {
			dec()
		}
		return tokens + rows
	}
}

// decodedRows is how many rows the dispatch that gave out converted for its experts: one
// per row its entries name (in the low-latency mode entries of one token share its row).
func decodedRows[T combine.Act](out *dispatch.Output[T]) int {
	seen := make(map[int32]struct{}, len(out.Row))
	for _, r := range out.Row {
		if r >= 0 {
			seen[r] = struct{}{}
		}
	}
	return len(seen)
}

// StageFloor is a lower bound for a stage in which rank q puts bytes[q] on the wire and
// each byte moves once: the best time, over a few tries, of copying every rank's bytes
// once into another buffer with as many threads as there are CPUs (at most one per
// rank), alternating Go's copy, memx.Copy and memx.Stream.
func StageFloor(bytes []int) time.Duration {
	p := len(bytes)
	total := 0
	for _, n := range bytes {
		total += n
	}
	if p == 0 || total == 0 {
		return 0
	}
	// Where ranks outnumber CPUs the shm transport's progress loop sleeps holding a P (see
	// its rawParks): one P more, so that the copies still have a P per CPU.
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(runtime.GOMAXPROCS(0) + 1))
	src, dst := make([]*obuf.Buf, p), make([]*obuf.Buf, p)
	for q, n := range bytes {
		src[q], dst[q] = obuf.Default.Get(max(n, 1)), obuf.Default.Get(max(n, 1))
		defer src[q].Release()
		defer dst[q].Release()
		clear(src[q].Bytes()) // fault the pages in
		clear(dst[q].Bytes())
	}
	return fastestCopy(min(p, runtime.NumCPU()), max(5, min(100, (256<<20)/total)), func(cp func(dst, src []byte), w, threads int) {
		for q := w; q < p; q += threads {
			cp(dst[q].Bytes()[:bytes[q]], src[q].Bytes()[:bytes[q]])
		}
	})
}

// PrintMoE writes the result as a table.
func PrintMoE(w io.Writer, r *MoEResult) {
	back := r.CombineWire + " back"
	switch {
	case r.CombineInPlace:
		back = "expert outputs read in place"
	case r.SumAtOrigin:
		back = "expert outputs back unsummed (" + r.CombineWire + "), summed at the tokens' ranks"
	}
	fmt.Fprintf(w, "# moex bench moe: %s (hidden %d, %d experts, top-%d), %d ranks over %s, %s mode, %d tokens per rank, %s activations, %s on the wire, %s, experts: %s\n",
		r.Model, r.Hidden, r.Experts, r.TopK, r.Ranks, r.Transport, r.Mode, r.TokensPerRank, r.Act, r.Wire, back, r.Compute)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, v) }
	stage := func(name string, s Stage) {
		conv := ""
		if s.StepFloorConverts {
			conv = ", conversions included"
		}
		row(name, fmt.Sprintf("p50 %.1f us, p99 %.1f us, mean %.1f us; %s on the wire, copy floor %.1f us for %s (p50 %.2fx the floor), %.1f us in a step's cache state%s (p50 %.2fx)",
			s.P50US, s.P99US, s.MeanUS, SizeOf(s.Bytes), s.FloorUS, SizeOf(s.Moved), s.OverP50, s.StepFloorUS, conv, s.OverStepFloor))
	}
	row("path", r.Path)
	if note := SharedCPUsNote(r); note != "" {
		row("note", note)
	}
	row("kernels", r.Kernels)
	row("runtime", fmt.Sprintf("GOMAXPROCS %d per rank (rank 0's); %d ranks share the host's %d CPUs", r.GOMAXPROCS, r.HostRanks, r.HostCPUs))
	stage("dispatch", r.Dispatch)
	row("expert compute", fmt.Sprintf("%.1f us", r.ComputeUS))
	stage("combine", r.Combine)
	row("step", fmt.Sprintf("%.1f us (slowest rank per stage, mean of %d)", r.StepUS, r.Iters))
	row("buffers", fmt.Sprintf("dispatch %s, combine %s per rank (the most of any rank)", SizeOf(r.Dispatch.BufferBytes), SizeOf(r.Combine.BufferBytes)))
	row("tokens/s", fmt.Sprintf("%.0f", r.TokensPerS))
	if r.Compute != "ffn" {
		row("error", fmt.Sprintf("%.2e relative to the exact weighted sums (every rank's tokens; the wire's, the combine's and the activations' rounding)", r.ErrorRel))
	}
	row("dispatch+combine pair", fmt.Sprintf("%.1f us back to back (mean; p50 %.1f us, p99 %.1f us)", r.PairUS, r.PairP50US, r.PairP99US))
	row("bytes per choice", fmt.Sprintf("%d (DeepEP's count; %d choices, %s)", r.BytesPerChoice, r.Choices, SizeOf(int64(r.BytesPerChoice)*r.Choices)))
	row("load imbalance", fmt.Sprintf("experts %.2f, ranks %.2f (max/mean); aux loss %.3f", r.ExpertImbal, r.RankImbal, r.AuxLoss))
	if r.Chunks > 0 {
		row("overlap", fmt.Sprintf("%d micro-batches: %.1f us one after the other, %.1f us pipelined (%.2fx)", r.Chunks, r.SerialUS, r.OverlapUS, r.OverlapSpeedup))
	}
	if r.LastRank != nil {
		longest := 0
		for q, w := range r.WaitForUS {
			if w > r.WaitForUS[longest] {
				longest = q
			}
		}
		waited := ""
		if longest < len(r.WaitForUS) {
			waited = fmt.Sprintf("; waited longest for rank %d (%.1f us per step)", longest, r.WaitForUS[longest])
		}
		if r.Mode == dispatch.LowLatency.String() {
			row("exchange wait", fmt.Sprintf("%.1f us per step (longest over the ranks); last to arrive most often: rank %d%s", r.WaitUS, *r.LastRank, waited))
		} else {
			row("alltoallv wait / move", fmt.Sprintf("%.1f / %.1f us per step (longest over the ranks); last to arrive most often: rank %d%s", r.WaitUS, r.MoveUS, *r.LastRank, waited))
		}
	}
	if r.NaiveUS > 0 {
		row("naive dispatch", fmt.Sprintf("%.1f us, %d messages: fused is %.1fx faster", r.NaiveUS, r.NaiveMessages, r.FusedOverNaive))
	}
	tw.Flush()
}

// SizeOf writes n bytes with one decimal in the largest unit that fits (KiB, MiB).
func SizeOf(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}
