package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/models"
	"github.com/moex-ai/moex/router"
)

// RecoverOpts selects a serving run in which one rank dies (`moex bench moe --kill`).
type RecoverOpts struct {
	Model  string
	Tokens int        // tokens per rank per step
	Wire   dtype.Type // on the wire (default bf16)
	Mode   dispatch.Mode
	// MaxBufferBytes is dispatch.Config.MaxBufferBytes (0: the default).
	MaxBufferBytes int
	Victim         int // the rank that dies
	Steps          int // steps served before it dies (default 3)
	// WeightBytes is the size of one expert's weights, which Recover moves to the ranks
	// that take an expert over (default 64 KiB).
	WeightBytes int
	Seed        uint64
	// Rejoin: after the recovery the survivors serve on, admitting at every step
	// (coll.Comm.Admit) the process that takes the dead rank over (moex run --restarts
	// starts it), move experts onto it (dispatch.Grow) and serve After more steps on all
	// the ranks (default 20), the new process with them (Rejoined); Wait bounds the wait
	// for it (default a minute).
	Rejoin bool
	After  int
	Wait   time.Duration
	// Rdzv: the job meets in etcd here (etcd://host:port/name; moex bench moe --rdzv),
	// and the new process takes the rank over through it.
	Rdzv string
}

// MaxWeightBytes bounds RecoverOpts.WeightBytes.
const MaxWeightBytes = 1 << 30

// RecoverResult is the outcome of one death: the survivors' times, each the slowest
// survivor's, from the moment the victim was killed (right after a barrier that every
// rank left) to the end of each phase.
type RecoverResult struct {
	Model       string  `json:"model"`
	Transport   string  `json:"transport"`
	Mode        string  `json:"mode"`
	Ranks       int     `json:"ranks"`
	Victim      int     `json:"victim"`
	Tokens      int     `json:"tokens_per_rank"`
	WeightBytes int     `json:"weight_bytes"`
	Moves       int     `json:"expert_moves"`
	StepUS      float64 `json:"step_us"`       // a step before the death (the slowest rank's)
	DetectUS    float64 `json:"detect_us"`     // the step that fails, naming the victim
	ShrinkUS    float64 `json:"shrink_us"`     // Comm.Shrink
	RecoverUS   float64 `json:"recover_us"`    // dispatch.Recover: rebalance, weights moved
	FirstStepUS float64 `json:"first_step_us"` // new dispatcher, the first correct step
	// Rejoin is the way back (RecoverOpts.Rejoin): a new process takes the rank over.
	Rejoin *RejoinTimeline `json:"rejoin,omitempty"`
}

// Recover serves o.Steps steps of o.Model on every rank of c (collectively), every
// expert on two ranks, then rank o.Victim calls kill (which must end it, as SIGKILL
// does); the survivors see the death, shrink, recover onto themselves and serve one
// more step, whose every token is checked. It returns the survivors' communicator
// (for the caller to close; c on the victim) and, on the survivors' rank 0, the
// result.
func Recover(ctx context.Context, c *coll.Comm, o RecoverOpts, kill func()) (*coll.Comm, *RecoverResult, error) {
	cfg, err := checkRecoverOpts(c, &o)
	if err != nil {
		return c, nil, err
	}
	p, me := c.Size(), c.Rank()
	pl, err := router.NewPlacement(router.RoundRobin, cfg.Experts, p)
	if err != nil {
		return c, nil, err
	}
	all := make([]int, cfg.Experts)
	for e := range all {
		all[e] = e
	}
	if err := pl.Replicate(all, 2); err != nil {
		return c, nil, err
	}
	ws := map[int][]byte{}
	for _, e := range pl.Local[me] {
		ws[e] = make([]byte, o.WeightBytes)
		ws[e][0] = byte(e)
	}
	sc := newRecoverScenario(ctx, me, cfg, o, ws)
	if err := sc.open(c, pl); err != nil {
		return c, nil, err
	}
	// The steps before the death, the last one timed.
	tm, err := Time(ctx, c, sc, TimeOpts{Warmup: o.Steps - 1, Iters: 1, Barrier: true})
	if err == nil {
		err = coll.Barrier(ctx, c)
	}
	if me == o.Victim && err == nil {
		kill()
		return c, nil, errors.New("bench: the victim outlived its kill")
	}
	before := 0.0 // a step's time before the death
	if tm != nil {
		before = tm.Stage(0).MeanUS
	}
	d, cb := sc.d, sc.cb
	step := func(d *dispatch.Dispatcher[float32], cb *combine.Combiner[float32], ws map[int][]byte) error {
		sc.d, sc.cb, sc.ws = d, cb, ws
		return sc.Step(ctx, 0, nil)
	}
	open := func(c *coll.Comm, pl *router.Placement) (*dispatch.Dispatcher[float32], *combine.Combiner[float32], error) {
		err := sc.open(c, pl)
		return sc.d, sc.cb, err
	}
	t0 := time.Now()
	if err == nil { // the death shows in the barrier or in this step
		err = step(d, cb, ws)
	}
	// Detected when the step fails; closing the old pair (unmapping the low-latency
	// mode's windows: tens of milliseconds with 8 ranks on 2 CPUs) counts as shrinking.
	tDetect := time.Since(t0)
	cb.Close()
	d.Close()
	var pe *coll.PeerError
	if !errors.As(err, &pe) || pe.Rank != c.WorldRank(o.Victim) {
		return c, nil, fmt.Errorf("bench: after rank %d's death: %v, want an error naming it", o.Victim, err)
	}
	sub, err := c.Shrink(ctx)
	if err != nil {
		return c, nil, err
	}
	tShrink := time.Since(t0)
	next := map[int][]byte{}
	npl, moves, err := dispatch.Recover(ctx, sub, pl, nil, router.Balance{}, weightsInto(o.WeightBytes, ws, next))
	if err != nil {
		return sub, nil, err
	}
	tRecover := time.Since(t0)
	d, cb, err = open(sub, npl)
	if err != nil {
		return sub, nil, err
	}
	defer d.Close()
	defer cb.Close()
	if err := step(d, cb, next); err != nil {
		return sub, nil, err
	}
	tFirst := time.Since(t0)
	times := []float64{tDetect.Seconds(), tShrink.Seconds(), tRecover.Seconds(), tFirst.Seconds()}
	if err := coll.AllReduce(ctx, sub, nil, times, dtype.Max); err != nil {
		return sub, nil, err
	}
	var res *RecoverResult
	if sub.Rank() == 0 {
		res = &RecoverResult{Model: cfg.Name, Transport: c.Transport().Name(), Mode: o.Mode.String(), Ranks: p, Victim: o.Victim,
			Tokens: o.Tokens, WeightBytes: o.WeightBytes, Moves: len(moves), StepUS: before,
			DetectUS: times[0] * 1e6, ShrinkUS: times[1] * 1e6, RecoverUS: times[2] * 1e6, FirstStepUS: times[3] * 1e6}
	}
	if !o.Rejoin {
		return sub, res, nil
	}
	g, tl, err := rejoin(ctx, sub, sc, npl, next, t0, o)
	if err != nil {
		return sub, nil, err
	}
	sub.Close()
	if res != nil {
		tl.KillUnixNS = t0.UnixNano()
		res.Rejoin = tl
	}
	return g, res, nil
}

// weightsInto hands the weights ws (of Bytes each) to Migrate, Recover or Grow and
// gathers the new placement's in next.
func weightsInto(bytes int, ws, next map[int][]byte) dispatch.Weights {
	return dispatch.Weights{Bytes: bytes, Old: func(e int) []byte { return ws[e] },
		New: func(e int) []byte {
			if b, ok := ws[e]; ok {
				next[e] = b
			} else {
				next[e] = make([]byte, bytes)
			}
			return next[e]
		}}
}

// newRecoverScenario is rank me's serving of o.Model with the weights ws it holds.
func newRecoverScenario(ctx context.Context, me int, cfg models.Config, o RecoverOpts, ws map[int][]byte) *recoverScenario {
	sc := &recoverScenario{ctx: ctx, me: me, hid: cfg.Hidden, tokens: o.Tokens, zr: newZipfRouter(cfg.Experts, cfg.TopK, 0, o.Seed),
		rng: rand.New(rand.NewPCG(o.Seed, uint64(me))), r: &router.Routing{}, x: make([]float32, o.Tokens*cfg.Hidden), ws: ws,
		dcfg: dispatch.Config{Hidden: cfg.Hidden, TopK: cfg.TopK, WireDType: o.Wire, Mode: o.Mode, MaxTokens: maxTokensOf(MoEOpts{Mode: o.Mode, Tokens: o.Tokens}), MaxBufferBytes: o.MaxBufferBytes}}
	for i := range sc.x {
		sc.x[i] = float32(i%97) / 97
	}
	sc.out = make([]float32, len(sc.x))
	return sc
}

// recoverScenario serves steps on a dispatcher and combiner and checks that every token
// came back whole (identity experts, weights summing to 1).
type recoverScenario struct {
	ctx       context.Context
	me, hid   int
	tokens    int
	zr        *zipfRouter
	rng       *rand.Rand
	r         *router.Routing
	x, out, y []float32
	ws        map[int][]byte // the weights of the experts this rank holds
	dcfg      dispatch.Config
	d         *dispatch.Dispatcher[float32]
	cb        *combine.Combiner[float32]
	// wrongOK: a step whose tokens come back wrong counts them (wrong) and returns
	// errWrongTokens, rather than failing at the first.
	wrongOK bool
	wrong   int
}

// open makes the stages on c under placement pl.
func (sc *recoverScenario) open(c *coll.Comm, pl *router.Placement) error {
	sc.dcfg.Placement = pl
	d, err := dispatch.New[float32](sc.ctx, c, sc.dcfg)
	if err != nil {
		return err
	}
	cb, err := combine.New[float32](sc.ctx, d, combine.Config{})
	if err != nil {
		d.Close()
		return err
	}
	sc.d, sc.cb = d, cb
	return nil
}

// close closes the stages, if open.
func (sc *recoverScenario) close() {
	if sc.cb != nil {
		sc.cb.Close()
		sc.d.Close()
		sc.cb, sc.d = nil, nil
	}
}

func (sc *recoverScenario) Stages() []string { return []string{"step"} }

func (sc *recoverScenario) Step(ctx context.Context, _ int, rec []float64) error {
	t0 := time.Now()
	hid := sc.hid
	sc.zr.route(sc.r, sc.rng, sc.tokens)
	dout, h, err := sc.d.Dispatch(ctx, sc.x, sc.r)
	if err != nil {
		return err
	}
	sc.y = grow(sc.y, dout.Rows()*hid)
	for j := 0; j < dout.Rows(); j++ {
		if dout.Origin[j] < 0 {
			continue
		}
		if w, ok := sc.ws[int(dout.Expert[j])]; !ok || w[0] != byte(dout.Expert[j]) {
			return fmt.Errorf("bench: rank %d got rows for expert %d, whose weights it does not hold", sc.me, dout.Expert[j])
		}
		copy(sc.y[j*hid:(j+1)*hid], dout.Entry(j))
	}
	if err := sc.cb.Combine(ctx, h, sc.y, sc.out); err != nil {
		return err
	}
	sc.wrong = 0
	for i := 0; i < len(sc.out); i++ {
		if v := sc.out[i]; math.Abs(float64(v-sc.x[i])) > 0.02*math.Abs(float64(sc.x[i]))+1e-3 {
			if !sc.wrongOK {
				return fmt.Errorf("bench: token %d element %d came back as %v, want %v", i/hid, i%hid, v, sc.x[i])
			}
			sc.wrong++
			i += hid - 1 - i%hid // the token's other elements
		}
	}
	if sc.wrong > 0 {
		return fmt.Errorf("%w: %d tokens", errWrongTokens, sc.wrong)
	}
	if rec != nil {
		rec[0] = time.Since(t0).Seconds()
	}
	return nil
}

func checkRecoverOpts(c *coll.Comm, o *RecoverOpts) (models.Config, error) {
	cfg, err := models.Get(o.Model)
	if err != nil {
		return cfg, err
	}
	if o.Wire == 0 {
		o.Wire = dtype.BF16
	}
	if o.Steps == 0 {
		o.Steps = 3
	}
	if o.WeightBytes == 0 {
		o.WeightBytes = 64 << 10
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.After == 0 {
		o.After = 20
	}
	if o.Wait == 0 {
		o.Wait = time.Minute
	}
	switch {
	case o.After < 1 || o.After > 1_000_000 || o.Wait < 0 || o.Wait > time.Hour:
		return cfg, fmt.Errorf("bench: %d steps after the rank's return, a wait of %v for it (want 1 to 1000000, at most an hour)", o.After, o.Wait)
	case c.Size() < 3:
		return cfg, fmt.Errorf("bench: a death among %d ranks leaves no communicator worth the name (want 3 or more)", c.Size())
	case o.Victim < 0 || o.Victim >= c.Size():
		return cfg, fmt.Errorf("bench: victim rank %d of %d", o.Victim, c.Size())
	case o.WeightBytes < 1 || o.WeightBytes > MaxWeightBytes:
		return cfg, fmt.Errorf("bench: %d bytes of weights per expert (want 1 to %d)", o.WeightBytes, MaxWeightBytes)
	case o.Steps < 1 || o.Tokens < 1:
		return cfg, fmt.Errorf("bench: %d steps of %d tokens (want at least 1 of 1)", o.Steps, o.Tokens)
	}
	return cfg, nil
}

// RecoverSummary is the outcome of `moex bench moe --kill R --runs N`: each phase's
// p50 and max over the runs, in microseconds.
type RecoverSummary struct {
	Runs []*RecoverResult   `json:"runs"`
	P50  map[string]float64 `json:"p50_us"`
	Max  map[string]float64 `json:"max_us"`
}

// SummarizeRecover takes the p50 and max of each phase over runs.
func SummarizeRecover(runs []*RecoverResult) *RecoverSummary {
	s := &RecoverSummary{Runs: runs, P50: map[string]float64{}, Max: map[string]float64{}}
	for _, ph := range recoverPhases {
		v := make([]float64, len(runs))
		for i, r := range runs {
			v[i] = ph.of(r)
		}
		slices.Sort(v)
		if len(v) > 0 {
			s.P50[ph.name], s.Max[ph.name] = v[(len(v)-1)/2], v[len(v)-1]
		}
	}
	return s
}

var recoverPhases = []struct {
	name string
	of   func(*RecoverResult) float64
}{
	{"detect", func(r *RecoverResult) float64 { return r.DetectUS }},
	{"shrink", func(r *RecoverResult) float64 { return r.ShrinkUS }},
	{"recover", func(r *RecoverResult) float64 { return r.RecoverUS }},
	{"first_step", func(r *RecoverResult) float64 { return r.FirstStepUS }},
	{"step_before", func(r *RecoverResult) float64 { return r.StepUS }},
}

// PrintRecover writes s as a table.
func PrintRecover(w io.Writer, s *RecoverSummary) {
	if len(s.Runs) == 0 {
		return
	}
	r := s.Runs[0]
	fmt.Fprintf(w, "# moex bench moe --kill %d: %s, %d ranks over %s, %s mode, %d tokens per rank, %d B of weights per expert, every expert on 2 ranks; %d runs\n",
		r.Victim, r.Model, r.Ranks, r.Transport, r.Mode, r.Tokens, r.WeightBytes, len(s.Runs))
	fmt.Fprintln(w, "# ms from the kill to the end of: the failed step, Shrink, Recover (rebalance, weights moved), the first correct step")
	fmt.Fprintf(w, "%-6s %10s %10s %10s %12s\n", "", "detect", "shrink", "recover", "first step")
	for _, row := range []struct {
		name string
		m    map[string]float64
	}{{"p50", s.P50}, {"max", s.Max}} {
		fmt.Fprintf(w, "%-6s %10.1f %10.1f %10.1f %12.1f\n", row.name, row.m["detect"]/1e3, row.m["shrink"]/1e3, row.m["recover"]/1e3, row.m["first_step"]/1e3)
	}
	fmt.Fprintf(w, "expert moves per recovery: %d; a step before the death: %.1f ms (p50)\n", r.Moves, s.P50["step_before"]/1e3)
}
