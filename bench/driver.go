package bench

import (
	"context"
	"fmt"
	"slices"
	"time"

	"gonum.org/v1/gonum/stat"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
)

// A Scenario is one benchmark on a communicator: set up once (by its constructor), then
// stepped by Time, which times each of its stages on every rank; its floors and its
// report are its own. moe, levels, eplb, coalesce and recover are scenarios.
type Scenario interface {
	// Stages names the parts of a step that Time times, in order (one at least).
	Stages() []string
	// Step runs one step. i counts the steps from the first timed one (negative in the
	// warm-up); rec, nil in the warm-up, receives each stage's seconds on this rank.
	Step(ctx context.Context, i int, rec []float64) error
}

// TimeOpts says how Time runs a scenario.
type TimeOpts struct {
	Warmup int // untimed steps first
	// Iters is how many steps are timed; 0: as many as take about a second, 5 to 200
	// (the slowest rank's first step decides, on every rank alike).
	Iters int
	// Barrier puts a barrier before every timed step, so that its stages start
	// together on every rank.
	Barrier bool
	// Progress, when set, is called on rank 0 after each timed step.
	Progress func(done, total int)
}

// Timing is what Time measured: for every timed step and stage, the slowest rank's
// seconds (a stage takes as long as its slowest rank).
type Timing struct {
	Stages []string
	Iters  int
	times  []float64 // [iteration*len(Stages) + stage]
	ranks  []float64 // every rank's: [rank][iteration*len(Stages) + stage]
}

// Time runs sc on every rank of c (collectively) and returns its timing, the same on
// every rank.
func Time(ctx context.Context, c *coll.Comm, sc Scenario, o TimeOpts) (*Timing, error) {
	ns := len(sc.Stages())
	for i := -o.Warmup; i < 0; i++ {
		if err := sc.Step(ctx, i, nil); err != nil {
			return nil, err
		}
	}
	iters := o.Iters
	if iters <= 0 {
		start := time.Now()
		if err := sc.Step(ctx, -1, nil); err != nil {
			return nil, err
		}
		per := []float64{time.Since(start).Seconds()}
		if err := coll.AllReduce(ctx, c, nil, per, dtype.Max); err != nil {
			return nil, err
		}
		iters = int(min(200, max(5, 1/max(per[0], 1e-6))))
	}
	t := &Timing{Stages: sc.Stages(), Iters: iters, times: make([]float64, ns*iters)}
	for i := 0; i < iters; i++ {
		if o.Barrier {
			if err := coll.Barrier(ctx, c); err != nil {
				return nil, err
			}
		}
		if err := sc.Step(ctx, i, t.times[ns*i:ns*(i+1)]); err != nil {
			return nil, err
		}
		if c.Rank() == 0 && o.Progress != nil {
			o.Progress(i+1, iters)
		}
	}
	// Every rank's times, for the slowest (a stage takes as long as its slowest rank) and
	// for who came late in the slow steps (Tail).
	t.ranks = make([]float64, c.Size()*len(t.times))
	if err := coll.AllGather(ctx, c, t.times, t.ranks); err != nil {
		return nil, err
	}
	for r := 0; r < c.Size(); r++ {
		for j, v := range t.ranks[r*len(t.times) : (r+1)*len(t.times)] {
			t.times[j] = max(t.times[j], v)
		}
	}
	return t, nil
}

// Column is stage k's seconds, step by step.
func (t *Timing) Column(k int) []float64 {
	ns := len(t.Stages)
	v := make([]float64, t.Iters)
	for i := range v {
		v[i] = t.times[ns*i+k]
	}
	return v
}

// Steps is every step's seconds: its stages' summed.
func (t *Timing) Steps() []float64 {
	ns := len(t.Stages)
	v := make([]float64, t.Iters)
	for i := range v {
		for k := 0; k < ns; k++ {
			v[i] += t.times[ns*i+k]
		}
	}
	return v
}

// Stage is stage k's mean, p50 and p99, and who its tail waited for.
func (t *Timing) Stage(k int) Stage {
	st := stageOf(t.Column(k))
	st.Tail = t.Tail(k)
	return st
}

// Tail is what the slow steps of a stage waited for.
type Tail struct {
	// Steps is how many timed steps took more than twice the stage's p50.
	Steps int `json:"steps"`
	// Late is the rank that arrived last in the most of them, LateIn in how many: a
	// rank that enters a stage late waits for nobody, so its own time in it is the
	// shortest of the ranks'; the others' include the wait for it. -1 without slow steps.
	Late   int `json:"late_rank"`
	LateIn int `json:"late_in"`
}

func (tl Tail) String() string {
	if tl.Steps == 0 {
		return "no step over 2x p50"
	}
	return fmt.Sprintf("%d step(s) over 2x p50, rank %d arrived last in %d", tl.Steps, tl.Late, tl.LateIn)
}

// Tail says who stage k's slow steps waited for.
func (t *Timing) Tail(k int) Tail {
	if len(t.ranks) == 0 {
		return Tail{Late: -1}
	}
	return tailOf(t.Column(k), len(t.ranks)/len(t.times), func(r, i int) float64 {
		return t.ranks[r*len(t.times)+len(t.Stages)*i+k]
	})
}

// tailOf finds, among the steps of slowest (each step's slowest rank) over twice their
// p50, the rank whose own time was the shortest (the one that came last) most often;
// at(r, i) is rank r's time in step i.
func tailOf(slowest []float64, ranks int, at func(r, i int) float64) Tail {
	tl := Tail{Late: -1}
	p50 := percentile(slowest, 0.5)
	late := make([]int, ranks)
	for i, v := range slowest {
		if v <= 2*p50 {
			continue
		}
		tl.Steps++
		first := 0
		for r := 1; r < ranks; r++ {
			if at(r, i) < at(first, i) {
				first = r
			}
		}
		late[first]++
	}
	for r, n := range late {
		if n > tl.LateIn {
			tl.Late, tl.LateIn = r, n
		}
	}
	return tl
}

// stageOf is the figures of times (seconds): mean, p50 and p99 in microseconds.
func stageOf(times []float64) Stage {
	return Stage{MeanUS: mean(times) * 1e6, P50US: percentile(times, 0.50) * 1e6, P99US: percentile(times, 0.99) * 1e6}
}

// mean is v's mean (0 for none).
func mean(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	return stat.Mean(v, nil)
}

// percentile is the q-th quantile of v: the smallest value with at least q of v at or
// below it (gonum's empirical quantile).
func percentile(v []float64, q float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return stat.Quantile(q, stat.Empirical, s, nil)
}
