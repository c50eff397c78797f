package bench

import (
	"context"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/models"
	"github.com/moex-ai/moex/router"
)

// EPLBOpts selects a serving run with skewed routing and periodic rebalancing.
type EPLBOpts struct {
	Model  string
	Tokens int        // tokens per rank per step
	Wire   dtype.Type // on the wire (default bf16)
	Mode   dispatch.Mode
	// MaxBufferBytes is dispatch.Config.MaxBufferBytes (0: the default).
	MaxBufferBytes int
	Skew           float64 // Zipf exponent of the experts' popularity (0: uniform)
	Every          int     // rebalance every so many steps
	Steps          int     // steps in all (0: 3 x Every)
	Redundant      int     // physical slots beyond one per logical expert
	Placement      string  // the placement before the first rebalance: contiguous (default) or roundrobin
	// ExpertUS is what one row costs a rank's experts: they sleep rows x ExpertUS, as
	// ranks whose experts run on an accelerator wait for it, so that the busiest rank
	// sets the step's pace. 0: identity experts (the communication alone).
	ExpertUS float64
	Seed     uint64
}

// EPLBPhase is one placement's figures: per step, the slowest rank's time, and the
// rank imbalance (max over mean of the (token, expert) rows each rank's experts took).
type EPLBPhase struct {
	Placement  string  `json:"placement"`
	Steps      int     `json:"steps"`
	StepUS     float64 `json:"step_us"`
	TokensPerS float64 `json:"tokens_per_s"`
	Imbalance  float64 `json:"rank_imbalance"` // mean over the steps
}

// EPLBResult is the outcome of `moex bench moe --eplb N --json`.
type EPLBResult struct {
	Model         string      `json:"model"`
	Ranks         int         `json:"ranks"`
	Transport     string      `json:"transport"`
	Mode          string      `json:"mode"`
	TokensPerRank int         `json:"tokens_per_rank"`
	Skew          float64     `json:"skew"`
	Slots         int         `json:"slots"`
	Policy        string      `json:"policy"`
	ExpertUS      float64     `json:"expert_us_per_row"`
	Every         int         `json:"rebalance_every"`
	Rebalances    int         `json:"rebalances"`
	RebalanceUS   float64     `json:"rebalance_us"` // gather, rebalance and a new dispatcher, the slowest rank, mean
	Before        EPLBPhase   `json:"before"`
	After         EPLBPhase   `json:"after"`
	Speedup       float64     `json:"speedup"`         // After.TokensPerS / Before.TokensPerS
	ImbalanceGain float64     `json:"imbalance_ratio"` // Before.Imbalance / After.Imbalance
	Planned       float64     `json:"planned_imbalance"`
	Replicated    map[int]int `json:"replicated,omitempty"` // expert -> replicas, for experts with more than one
}

// zipfRouter routes tokens to k distinct experts drawn with probability falling as
// popularity rank^-s, the experts' ranks shuffled once by seed (the same on every rank).
type zipfRouter struct {
	cdf  []float64
	perm []int
	k    int
}

func newZipfRouter(experts, k int, s float64, seed uint64) *zipfRouter {
	z := &zipfRouter{cdf: make([]float64, experts), k: k}
	sum := 0.0
	for i := range z.cdf {
		sum += math.Pow(float64(i+1), -s)
		z.cdf[i] = sum
	}
	for i := range z.cdf {
		z.cdf[i] /= sum
	}
	z.perm = rand.New(rand.NewPCG(seed, 0x7a1f)).Perm(experts)
	return z
}

// route fills r with t tokens' choices, weights 1/k.
func (z *zipfRouter) route(r *router.Routing, rng *rand.Rand, t int) {
	e := len(z.cdf)
	r.T, r.K, r.E, r.Dropped = t, z.k, e, 0
	r.Experts = append(r.Experts[:0], make([]int32, t*z.k)...)
	r.Weights = append(r.Weights[:0], make([]float32, t*z.k)...)
	if len(r.Probs) != e {
		r.Probs = make([]float32, e)
	}
	for i := 0; i < t; i++ {
		row := r.Experts[i*z.k : (i+1)*z.k]
		for j := range row {
		draw:
			u := rng.Float64()
			lo, hi := 0, e-1
			for lo < hi {
				m := (lo + hi) / 2
				if z.cdf[m] < u {
					lo = m + 1
				} else {
					hi = m
				}
			}
			x := int32(z.perm[lo])
			for _, y := range row[:j] {
				if y == x {
					goto draw
				}
			}
			row[j] = x
			r.Weights[i*z.k+j] = 1 / float32(z.k)
		}
	}
}

// EPLB runs o.Steps MoE steps with skewed routing on every rank of c (collectively),
// recording the experts' load and rebalancing every o.Every steps (router.Rebalance on
// the window's load, then a dispatcher for the new placement); the result on rank 0.
func EPLB(ctx context.Context, c *coll.Comm, o EPLBOpts) (*EPLBResult, error) {
	cfg, err := models.Get(o.Model)
	if err != nil {
		return nil, err
	}
	if o.Wire == 0 {
		o.Wire = dtype.BF16
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.Steps == 0 {
		o.Steps = 3 * o.Every
	}
	p, me := c.Size(), c.Rank()
	if o.Every < 2 || o.Steps < 2*o.Every {
		return nil, fmt.Errorf("bench: rebalance every %d of %d steps (want at least 2, and two periods)", o.Every, o.Steps)
	}
	hosts := make([]int, p)
	for r := range hosts {
		hosts[r] = c.Host(r)
	}
	bal := router.Balance{Slots: cfg.Experts + o.Redundant, Hosts: hosts, Groups: cfg.Groups}
	pl, err := placementOf(o.Placement, cfg.Experts, p)
	if err != nil {
		return nil, err
	}
	first := pl.Kind
	rec, err := dispatch.NewLoadRecorder(1, cfg.Experts, o.Every)
	if err != nil {
		return nil, err
	}
	dcfg := dispatch.Config{Hidden: cfg.Hidden, TopK: cfg.TopK, WireDType: o.Wire, Mode: o.Mode, MaxTokens: maxTokensOf(MoEOpts{Mode: o.Mode, Tokens: o.Tokens}), MaxBufferBytes: o.MaxBufferBytes}
	var d *dispatch.Dispatcher[float32]
	var cb *combine.Combiner[float32]
	closeStages := func() {
		if cb != nil {
			cb.Close()
		}
		if d != nil {
			d.Close()
		}
	}
	defer closeStages()
	open := func(pl *router.Placement) error {
		closeStages()
		dcfg.Placement = pl
		if d, err = dispatch.New[float32](ctx, c, dcfg); err != nil {
			return err
		}
		cb, err = combine.New[float32](ctx, d, combine.Config{})
		return err
	}
	if err := open(pl); err != nil {
		return nil, err
	}
	sc := &eplbScenario{o: o, c: c, hid: cfg.Hidden, bal: bal, pl: pl, rec: rec, open: open, zr: newZipfRouter(cfg.Experts, cfg.TopK, o.Skew, o.Seed),
		rng: rand.New(rand.NewPCG(o.Seed, uint64(me))), r: &router.Routing{}, x: make([]float32, o.Tokens*cfg.Hidden), rows: make([]int64, o.Steps*p)}
	for i := range sc.x {
		sc.x[i] = float32(i%97) / 97
	}
	sc.out = make([]float32, len(sc.x))
	sc.stages = func() (*dispatch.Dispatcher[float32], *combine.Combiner[float32]) { return d, cb }
	res := &EPLBResult{Model: cfg.Name, Ranks: p, Transport: c.Transport().Name(), Mode: o.Mode.String(), TokensPerRank: o.Tokens,
		Skew: o.Skew, Slots: bal.Slots, ExpertUS: o.ExpertUS, Every: o.Every}
	tm, err := Time(ctx, c, sc, TimeOpts{Iters: o.Steps})
	if err != nil {
		return nil, err
	}
	times, rows, pl := tm.Column(0), sc.rows, sc.pl
	res.Rebalances, res.Planned = sc.rebalances, sc.planned
	reb := []float64{sc.rebalanceS}
	if err := coll.AllReduce(ctx, c, nil, reb, dtype.Max); err != nil {
		return nil, err
	}
	if err := coll.AllReduce(ctx, c, nil, rows, dtype.Sum); err != nil {
		return nil, err
	}
	if me != 0 {
		return nil, nil
	}
	res.RebalanceUS = reb[0] / float64(max(res.Rebalances, 1)) * 1e6
	res.Policy = bal.Resolve(cfg.Experts, p).String()
	phase := func(name string, from, to int) EPLBPhase {
		ph := EPLBPhase{Placement: name, Steps: to - from}
		im := 0.0
		for i := from; i < to; i++ {
			ph.StepUS += times[i] * 1e6
			per := make([]int, p)
			for q := range per {
				per[q] = int(rows[i*p+q])
			}
			im += router.Imbalance(per)
		}
		ph.StepUS /= float64(ph.Steps)
		ph.Imbalance = im / float64(ph.Steps)
		if ph.StepUS > 0 {
			ph.TokensPerS = float64(p*o.Tokens) / (ph.StepUS / 1e6)
		}
		return ph
	}
	// The first step of each placement warms its new buffers: it is left out. After is
	// the last placement that ran two steps or more.
	last := (o.Steps - 1) / o.Every * o.Every
	if o.Steps-last < 2 {
		last -= o.Every
	}
	res.Before = phase(first.String(), 1, o.Every)
	res.After = phase("balanced", last+1, min(last+o.Every, o.Steps))
	if res.Before.TokensPerS > 0 {
		res.Speedup = res.After.TokensPerS / res.Before.TokensPerS
	}
	if res.After.Imbalance > 0 {
		res.ImbalanceGain = res.Before.Imbalance / res.After.Imbalance
	}
	res.Replicated = map[int]int{}
	for e, owners := range pl.Owners {
		if len(owners) > 1 {
			res.Replicated[e] = len(owners)
		}
	}
	return res, nil
}

// eplbScenario is the serving loop under a skewed load: every Every steps the load
// recorded so far rebalances the placement (untimed: rebalanceS), then a step is timed,
// dispatch to combine, with experts that take ExpertUS a row.
type eplbScenario struct {
	o          EPLBOpts
	c          *coll.Comm
	hid        int
	bal        router.Balance
	pl         *router.Placement
	rec        *dispatch.LoadRecorder
	open       func(*router.Placement) error
	stages     func() (*dispatch.Dispatcher[float32], *combine.Combiner[float32])
	zr         *zipfRouter
	rng        *rand.Rand
	r          *router.Routing
	x, out, y  []float32
	rows       []int64 // per step and rank: the rows this rank's experts took
	rebalanceS float64
	rebalances int
	planned    float64
}

func (sc *eplbScenario) Stages() []string { return []string{"step"} }

func (sc *eplbScenario) Step(ctx context.Context, i int, rec []float64) error {
	c, o := sc.c, sc.o
	if i > 0 && i%o.Every == 0 {
		if err := sc.rebalance(ctx); err != nil {
			return err
		}
	}
	sc.zr.route(sc.r, sc.rng, o.Tokens)
	if err := coll.Barrier(ctx, c); err != nil {
		return err
	}
	d, cb := sc.stages()
	t0 := time.Now()
	dout, h, err := d.Dispatch(ctx, sc.x, sc.r)
	if err != nil {
		return err
	}
	n := 0
	for _, k := range dout.Counts {
		n += k
	}
	sc.rows[i*c.Size()+c.Rank()] = int64(n)
	if o.ExpertUS > 0 {
		time.Sleep(time.Duration(float64(n) * o.ExpertUS * float64(time.Microsecond)))
	}
	sc.y = grow(sc.y, dout.Rows()*sc.hid)
	if err := cb.Combine(ctx, h, sc.y, sc.out); err != nil {
		return err
	}
	if rec != nil {
		rec[0] = time.Since(t0).Seconds()
	}
	return sc.rec.Record(0, h, dout.Counts)
}

// rebalance gathers the recorded load, places the experts anew and remakes the stages.
func (sc *eplbScenario) rebalance(ctx context.Context) error {
	t0 := time.Now()
	load, err := sc.rec.Gather(ctx, sc.c)
	if err != nil {
		return err
	}
	sc.bal.Prefer = sc.pl
	if sc.pl, err = router.Rebalance(load[0], sc.c.Size(), sc.bal); err != nil {
		return err
	}
	if err := sc.open(sc.pl); err != nil {
		return err
	}
	sc.rec.Reset()
	sc.rebalanceS += time.Since(t0).Seconds()
	sc.rebalances++
	sc.planned = plannedImbalance(sc.pl, load[0])
	return nil
}

// plannedImbalance is the rank imbalance that pl gives load if replicas share it evenly.
func plannedImbalance(pl *router.Placement, load []float64) float64 {
	per := make([]float64, pl.Ranks)
	total := 0.0
	for r, es := range pl.Local {
		for _, e := range es {
			per[r] += load[e] / float64(len(pl.Owners[e]))
		}
		total += per[r]
	}
	mx := 0.0
	for _, l := range per {
		mx = math.Max(mx, l)
	}
	if total == 0 {
		return 0
	}
	return mx / (total / float64(pl.Ranks))
}

func grow[E any](s []E, n int) []E {
	if cap(s) < n {
		return make([]E, n)
	}
	return s[:n]
}

// PrintEPLB writes r as a table.
func PrintEPLB(w io.Writer, r *EPLBResult) {
	fmt.Fprintf(w, "# moex bench moe --eplb: %s, %d ranks over %s, %s mode, %d tokens per rank, zipf skew %.2f, %d slots (%s), rebalance every %d steps, experts %.1f us per row\n",
		r.Model, r.Ranks, r.Transport, r.Mode, r.TokensPerRank, r.Skew, r.Slots, r.Policy, r.Every, r.ExpertUS)
	fmt.Fprintf(w, "%-12s %6s %12s %12s %15s\n", "placement", "steps", "step (us)", "tokens/s", "rank imbalance")
	for _, ph := range []EPLBPhase{r.Before, r.After} {
		fmt.Fprintf(w, "%-12s %6d %12.0f %12.0f %15.3f\n", ph.Placement, ph.Steps, ph.StepUS, ph.TokensPerS, ph.Imbalance)
	}
	fmt.Fprintf(w, "tokens/s x%.2f, imbalance /%.2f (planned %.3f); %d rebalances, %.0f us each; %d experts replicated\n",
		r.Speedup, r.ImbalanceGain, r.Planned, r.Rebalances, r.RebalanceUS, len(r.Replicated))
}
