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
	r := plan.Routing(me)
	x := models.Floats(cfg.Tokens(o.Seed, me, o.Tokens))
	out := make([]float32, len(x))
	var y []float32
	identity := func(do *dispatch.Output[float32]) {
		y = grow(y, do.Rows()*cfg.Hidden)
		for j := 0; j < do.Rows(); j++ {
			if e := do.Entry(j); e != nil {
				copy(y[j*cfg.Hidden:], e)
			}
		}
	}
	var step func(rec []float64) error
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
		step = func(rec []float64) error {
			t0 := time.Now()
			do, h, err := d.Dispatch(ctx, x, r)
			if err != nil {
				return err
			}
			t1 := time.Now()
			identity(do)
			t2 := time.Now()
			if err := cb.Combine(ctx, h, y, out); err != nil {
				return err
			}
			rec[0], rec[1] = t1.Sub(t0).Seconds(), time.Since(t2).Seconds()
			return nil
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
		step = func(rec []float64) error {
			t0 := time.Now()
			do, h, err := d.Dispatch(ctx, x, r)
			if err != nil {
				return err
			}
			t1 := time.Now()
			identity(do)
			t2 := time.Now()
			if err := cb.Combine(ctx, h, y, out); err != nil {
				return err
			}
			rec[0], rec[1] = t1.Sub(t0).Seconds(), time.Since(t2).Seconds()
			return nil
		}
	}
	var scratch [2]float64
	for i := 0; i < 2; i++ {
		if err := step(scratch[:]); err != nil {
			return nil, err
		}
	}
	iters := o.Iters
	if iters <= 0 {
		iters = 10
	}
	times := make([]float64, 2*iters)
	for i := 0; i < iters; i++ {
		if err := coll.Barrier(ctx, c); err != nil {
			return nil, err
		}
		if err := step(times[2*i : 2*i+2]); err != nil {
			return nil, err
		}
	}
	if err := coll.AllReduce(ctx, c, nil, times, dtype.Max); err != nil {
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
	d, cmb := make([]float64, iters), make([]float64, iters)
	step2 := 0.0
	for i := 0; i < iters; i++ {
		d[i], cmb[i] = times[2*i], times[2*i+1]
		step2 += d[i] + cmb[i]
	}
	res.DispatchP50, res.CombineP50 = percentile(d, 0.5)*1e6, percentile(cmb, 0.5)*1e6
	res.StepUS = step2 / float64(iters) * 1e6
	return res, nil
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
