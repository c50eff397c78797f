package bench

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/models"
	"github.com/moex-ai/moex/router"
)

// LevelsResult is one run of `moex bench moe --levels`: the MoE step across hosts, flat
// or in two levels (dispatch.TwoLevel), with the bytes the step puts within and across
// hosts (from the planner: every rank's, dispatch and combine together).
type LevelsResult struct {
	Model          string  `json:"model"`
	Ranks          int     `json:"ranks"`
	Hosts          int     `json:"hosts"`
	Transport      string  `json:"transport"`
	Mode           string  `json:"mode"`
	TokensPerRank  int     `json:"tokens_per_rank"`
	Wire           string  `json:"wire_dtype"`
	Levels         string  `json:"levels"`        // "flat" or "two-level": what ran
	Chosen         string  `json:"model_chooses"` // what dispatch.ChooseTwoLevel picks here
	Why            string  `json:"why"`
	DispatchP50    float64 `json:"dispatch_p50_us"`
	CombineP50     float64 `json:"combine_p50_us"`
	StepUS         float64 `json:"step_us"`               // dispatch then combine, the slowest rank, mean
	AcrossBytes    int64   `json:"across_hosts_bytes"`    // dispatch and combine
	DispatchAcross int64   `json:"dispatch_across_bytes"` // the dispatch alone
	WithinBytes    int64   `json:"within_hosts_bytes"`
	Iters          int     `json:"iters"`
}

// Levels runs o's MoE step (identity experts, f32 activations) on every rank of c
// (collectively): flat, in two levels, or as the model chooses (levels "flat", "two",
// "auto"); the result on rank 0.
func Levels(ctx context.Context, c *coll.Comm, o MoEOpts, levels string) (*LevelsResult, error) {
	cfg, err := models.Get(o.Model)
	if err != nil {
		return nil, err
	}
	if o.Wire == 0 {
		o.Wire = dtype.F32
	}
	if o.Combine == 0 {
		o.Combine = defaultCombine(o.Wire)
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	plan, _, err := PlanMoE(o, c.Size(), false)
	if err != nil {
		return nil, err
	}
	p, me := c.Size(), c.Rank()
	hosts := make([]int, p)
	for r := range hosts {
		hosts[r] = c.Host(r)
	}
	dcfg := plan.Cfg
	chosen, why := dispatch.ChooseTwoLevel(c, dcfg)
	two := false
	switch levels {
	case "flat":
	case "two", "two-level":
		two = true
	case "auto":
		two = chosen
	default:
		return nil, fmt.Errorf("bench: levels %q (want flat, two or auto)", levels)
	}
	sc := &levelsScenario{r: plan.Routing(me), x: models.Floats(cfg.Tokens(o.Seed, me, o.Tokens)), hid: cfg.Hidden}
	sc.out = make([]float32, len(sc.x))
	if two {
		d, err := dispatch.NewTwoLevel[float32](ctx, c, dcfg)
		if err != nil {
			return nil, err
		}
		defer d.Close()
		cb, err := combine.NewTwoLevel[float32](ctx, d, plan.Combine)
		if err != nil {
			return nil, err
		}
		defer cb.Close()
		sc.dispatch = func(ctx context.Context) (*dispatch.Output[float32], func() error, error) {
			do, h, err := d.Dispatch(ctx, sc.x, sc.r)
			return do, func() error { return cb.Combine(ctx, h, sc.y, sc.out) }, err
		}
	} else {
		d, err := dispatch.New[float32](ctx, c, dcfg)
		if err != nil {
			return nil, err
		}
		defer d.Close()
		cb, err := combine.New[float32](ctx, d, plan.Combine)
		if err != nil {
			return nil, err
		}
		defer cb.Close()
		sc.dispatch = func(ctx context.Context) (*dispatch.Output[float32], func() error, error) {
			do, h, err := d.Dispatch(ctx, sc.x, sc.r)
			return do, func() error { return cb.Combine(ctx, h, sc.y, sc.out) }, err
		}
	}
	iters := o.Iters
	if iters <= 0 {
		iters = 10
	}
	tm, err := Time(ctx, c, sc, TimeOpts{Warmup: 2, Iters: iters, Barrier: true})
	if err != nil {
		return nil, err
	}
	if me != 0 {
		return nil, nil
	}
	ht, err := plan.Hosts(hosts)
	if err != nil {
		return nil, err
	}
	res := &LevelsResult{Model: cfg.Name, Ranks: p, Hosts: c.Hosts(), Transport: c.Transport().Name(), Mode: o.Mode.String(),
		TokensPerRank: o.Tokens, Wire: o.Wire.String(), Levels: "flat", Chosen: "flat", Why: why, Iters: iters}
	tr := ht.Flat
	if two {
		res.Levels, tr = "two-level", ht.TwoLevel
	}
	if chosen {
		res.Chosen = "two-level"
	}
	res.AcrossBytes = tr.DispatchAcross + tr.CombineAcross
	res.DispatchAcross = tr.DispatchAcross
	res.WithinBytes = tr.DispatchWithin + tr.CombineWithin
	res.DispatchP50, res.CombineP50 = tm.Stage(0).P50US, tm.Stage(1).P50US
	res.StepUS = mean(tm.Steps()) * 1e6
	return res, nil
}

// levelsScenario is the flat or two-level step with identity experts: the dispatch and
// the combine timed apart.
type levelsScenario struct {
	r      *router.Routing
	x, out []float32
	y      []float32
	hid    int
	// dispatch runs the dispatch and returns its output and the combine to run after.
	dispatch func(ctx context.Context) (*dispatch.Output[float32], func() error, error)
}

func (sc *levelsScenario) Stages() []string { return []string{"dispatch", "combine"} }

func (sc *levelsScenario) Step(ctx context.Context, _ int, rec []float64) error {
	t0 := time.Now()
	do, combineFn, err := sc.dispatch(ctx)
	if err != nil {
		return err
	}
	t1 := time.Now()
	sc.y = grow(sc.y, do.Rows()*sc.hid)
	for j := 0; j < do.Rows(); j++ {
		if e := do.Entry(j); e != nil {
			copy(sc.y[j*sc.hid:], e)
		}
	}
	t2 := time.Now()
	if err := combineFn(); err != nil {
		return err
	}
	if rec != nil {
		rec[0], rec[1] = t1.Sub(t0).Seconds(), time.Since(t2).Seconds()
	}
	return nil
}

// PrintLevels writes the runs as a table, and each two-level run's speed-up over the
// flat run before it.
func PrintLevels(w io.Writer, rs []*LevelsResult) {
	if len(rs) == 0 {
		return
	}
	r := rs[0]
	fmt.Fprintf(w, "# moex bench moe --levels: %s, %d ranks on %d hosts over %s, %s mode, %d tokens per rank, %s on the wire\n",
		r.Model, r.Ranks, r.Hosts, r.Transport, r.Mode, r.TokensPerRank, r.Wire)
	fmt.Fprintf(w, "# the model chooses %s: %s\n", r.Chosen, r.Why)
	fmt.Fprintf(w, "%-10s %14s %14s %12s %14s %14s\n", "levels", "dispatch p50", "combine p50", "step (us)", "across hosts", "within hosts")
	var flat *LevelsResult
	for _, x := range rs {
		fmt.Fprintf(w, "%-10s %14.0f %14.0f %12.0f %14s %14s\n", x.Levels, x.DispatchP50, x.CombineP50, x.StepUS, SizeOf(x.AcrossBytes), SizeOf(x.WithinBytes))
		if x.Levels == "flat" {
			flat = x
		} else if flat != nil {
			fmt.Fprintf(w, "two-level over flat: step %.2fx faster, %.2f of the bytes across hosts\n", flat.StepUS/x.StepUS, float64(x.AcrossBytes)/float64(max(flat.AcrossBytes, 1)))
		}
	}
}
