package bench

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/models"
	"github.com/moex-ai/moex/router"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

// RejoinTimeline is the way back of `moex bench moe --kill R --rejoin`, as the survivors'
// rank 0 saw it: milliseconds from the kill to each event, and the job's tokens per
// second at every step.
type RejoinTimeline struct {
	KillUnixNS int64 `json:"kill_unix_ns"`
	// StartedMS: the new process started (its own clock; the launcher's parent adds it).
	StartedMS  float64     `json:"replacement_started_ms"`
	JoinedMS   float64     `json:"replacement_joined_ms"` // its coll.Init returned (its clock)
	AdmittedMS float64     `json:"admitted_ms"`           // the survivors' Admit returned the grown communicator
	GrownMS    float64     `json:"grown_ms"`              // dispatch.Grow: experts moved onto it
	ServingMS  float64     `json:"serving_ms"`            // the first step on every rank done
	StepsFewer int         `json:"steps_on_fewer"`        // steps served on the survivors meanwhile
	Moves      int         `json:"expert_moves"`          // experts moved by Grow
	Rate       []RatePoint `json:"rate"`
}

// RatePoint is one step of a timeline: when it ended (ms from the kill), on how many
// ranks, and the job's tokens per second at its pace.
type RatePoint struct {
	MS         float64 `json:"ms"`
	Ranks      int     `json:"ranks"`
	TokensPerS float64 `json:"tokens_per_s"`
}

// JoinerReport is what the new process of --rejoin says of itself.
type JoinerReport struct {
	Joiner        bool  `json:"joiner"`
	StartedUnixNS int64 `json:"started_unix_ns"`
	JoinedUnixNS  int64 `json:"joined_unix_ns"`
}

// rejoin serves on sub (with sc, on placement npl, the weights ws) until a new process
// has been admitted, moves experts onto it, and serves o.After steps on the grown
// communicator, which it returns; every token of every step is checked.
func rejoin(ctx context.Context, sub *coll.Comm, sc *recoverScenario, npl *router.Placement, ws map[int][]byte, t0 time.Time, o RecoverOpts) (*coll.Comm, *RejoinTimeline, error) {
	tl := &RejoinTimeline{}
	ms := func() float64 { return float64(time.Since(t0).Microseconds()) / 1e3 }
	step := func(ranks int) error {
		s := time.Now()
		if err := sc.Step(ctx, 0, nil); err != nil {
			return err
		}
		took := time.Since(s)
		tl.Rate = append(tl.Rate, RatePoint{MS: ms(), Ranks: ranks, TokensPerS: float64(ranks*o.Tokens) / took.Seconds()})
		return nil
	}
	deadline := time.Now().Add(o.Wait)
	var g *coll.Comm
	for g == nil {
		if err := step(sub.Size()); err != nil {
			return nil, nil, err
		}
		tl.StepsFewer++
		var err error
		if g, err = sub.Admit(ctx); err != nil {
			return nil, nil, fmt.Errorf("bench: admitting the new process: %w", err)
		}
		if g == nil && time.Now().After(deadline) {
			return nil, nil, fmt.Errorf("bench: no process came to take the rank over within %v (moex run --restarts starts one)", o.Wait)
		}
	}
	tl.AdmittedMS = ms()
	sc.d.Close()
	sc.cb.Close()
	next := map[int][]byte{}
	gpl, moves, err := dispatch.Grow(ctx, g, npl, nil, router.Balance{}, weightsInto(o.WeightBytes, ws, next))
	if err != nil {
		g.Close()
		return nil, nil, err
	}
	tl.GrownMS, tl.Moves = ms(), len(moves)
	if err := serveGrown(ctx, g, sc, gpl, next, o.After, func(first bool) error {
		if first {
			tl.ServingMS = tl.Rate[len(tl.Rate)-1].MS
		}
		return nil
	}, step); err != nil {
		g.Close()
		return nil, nil, err
	}
	return g, tl, nil
}

// serveGrown serves steps on g under placement gpl with the weights ws, through step.
func serveGrown(ctx context.Context, g *coll.Comm, sc *recoverScenario, gpl *router.Placement, ws map[int][]byte, steps int,
	after func(first bool) error, step func(ranks int) error) error {
	sc.ws = ws
	if err := sc.open(g, gpl); err != nil {
		return err
	}
	defer sc.cb.Close()
	defer sc.d.Close()
	for i := 0; i < steps; i++ {
		if err := step(g.Size()); err != nil {
			return fmt.Errorf("bench: step %d on the grown communicator: %w", i, err)
		}
		if err := after(i == 0); err != nil {
			return err
		}
	}
	return nil
}

// Rejoined is the new process's part of --rejoin: g is the communicator its coll.Init
// returned (it took rank o.Victim over), started when its process began. It receives its
// experts (dispatch.Grow) and serves o.After steps with the others, every token
// checked, and returns what it saw of itself.
func Rejoined(ctx context.Context, g *coll.Comm, o RecoverOpts, started time.Time) (*JoinerReport, error) {
	joined := time.Now()
	cfg, err := checkRecoverOpts(g, &o)
	if err != nil {
		return nil, err
	}
	next := map[int][]byte{}
	gpl, _, err := dispatch.Grow(ctx, g, nil, nil, router.Balance{}, weightsInto(o.WeightBytes, map[int][]byte{}, next))
	if err != nil {
		return nil, err
	}
	sc := newRecoverScenario(ctx, g.Rank(), cfg, o, next)
	step := func(int) error { return sc.Step(ctx, 0, nil) }
	if err := serveGrown(ctx, g, sc, gpl, next, o.After, func(bool) error { return nil }, step); err != nil {
		return nil, err
	}
	return &JoinerReport{Joiner: true, StartedUnixNS: started.UnixNano(), JoinedUnixNS: joined.UnixNano()}, nil
}

// PrintRejoin writes the timeline of r (with its new process's report j, nil if none).
func PrintRejoin(w io.Writer, r *RecoverResult, cfg models.Config) {
	tl := r.Rejoin
	if tl == nil {
		return
	}
	fmt.Fprintf(w, "# moex bench moe --kill %d --rejoin: %s, %d ranks over %s, %s mode, %d tokens per rank, %d B of weights per expert\n",
		r.Victim, cfg.Name, r.Ranks, r.Transport, r.Mode, r.Tokens, r.WeightBytes)
	fmt.Fprintln(w, "# ms from the kill")
	for _, ev := range []struct {
		what string
		ms   float64
	}{
		{"the failed step (death detected)", r.DetectUS / 1e3},
		{fmt.Sprintf("serving on %d ranks (Shrink, Recover, first step)", r.Ranks-1), r.FirstStepUS / 1e3},
		{"new process started", tl.StartedMS},
		{"new process's Init returned (joined)", tl.JoinedMS},
		{"survivors' Admit returned", tl.AdmittedMS},
		{fmt.Sprintf("experts moved onto it (dispatch.Grow, %d moves)", tl.Moves), tl.GrownMS},
		{fmt.Sprintf("serving on %d ranks again (first step)", r.Ranks), tl.ServingMS},
	} {
		fmt.Fprintf(w, "%10.1f  %s\n", ev.ms, ev.what)
	}
	fmt.Fprintf(w, "steps served on %d ranks meanwhile: %d; back on %d ranks %.1f ms after the new process started\n",
		r.Ranks-1, tl.StepsFewer, r.Ranks, tl.ServingMS-tl.StartedMS)
}

// PlotRejoin writes the job's tokens per second at every step after the kill, one line
// per run, with the moments the serving went down to P-1 ranks, the new process started
// and the serving came back to P ranks marked on the first run.
func PlotRejoin(path string, runs []*RecoverResult) error {
	if len(runs) == 0 || runs[0].Rejoin == nil {
		return fmt.Errorf("bench: no timeline to plot")
	}
	r := runs[0]
	p := plot.New()
	p.Title.Text = fmt.Sprintf("A rank killed and taken over by a new process: tokens/s after the kill\n%s, %d ranks over %s, %s mode, %d tokens per rank",
		r.Model, r.Ranks, r.Transport, r.Mode, r.Tokens)
	p.X.Label.Text = "ms since the kill"
	p.Y.Label.Text = "tokens/s (the job's, at each step's pace)"
	top := 0.0
	for i, run := range runs {
		var xys plotter.XYs
		for _, pt := range run.Rejoin.Rate {
			xys = append(xys, plotter.XY{X: pt.MS, Y: pt.TokensPerS})
			top = max(top, pt.TokensPerS)
		}
		if err := line(p, fmt.Sprintf("run %d", i+1), i, 0, xys); err != nil {
			return err
		}
	}
	tl := r.Rejoin
	for i, ev := range []struct {
		name string
		ms   float64
	}{{fmt.Sprintf("serving on %d", r.Ranks-1), r.FirstStepUS / 1e3}, {"new process started", tl.StartedMS}, {fmt.Sprintf("serving on %d again", r.Ranks), tl.ServingMS}} {
		l, err := plotter.NewLine(plotter.XYs{{X: ev.ms, Y: 0}, {X: ev.ms, Y: top}})
		if err != nil {
			return err
		}
		l.Color = colorOf(len(runs) + i)
		l.Dashes = []vg.Length{vg.Points(5), vg.Points(4)}
		p.Add(l)
		p.Legend.Add(ev.name, l)
	}
	p.Y.Min = 0
	p.Y.Tick.Marker = plot.TickerFunc(func(lo, hi float64) []plot.Tick {
		ts := plot.DefaultTicks{}.Ticks(lo, hi)
		for i := range ts {
			if ts[i].Label != "" {
				ts[i].Label = fmt.Sprintf("%gk", ts[i].Value/1e3)
			}
		}
		return ts
	})
	return saveGrid(path, 22*vg.Centimeter, 12*vg.Centimeter, [][]*plot.Plot{{p}})
}
