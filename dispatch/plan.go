package dispatch

import (
	"fmt"

	"github.com/moex-ai/moex/coll/dtype"

	"github.com/moex-ai/moex/router"
)

// Plan is one step (a dispatch and its combine) over every rank, planned without running
// anything: every rank's Schedule, as its executors lay it out. moex flow prints it;
// tests compare what the executors move with it.
type Plan struct {
	Cfg     Config        // the dispatch's configuration, defaults filled, in the step's mode
	Combine CombineConfig // the combine's, defaults filled
	Format  Format        // the dispatch's wire format
	// CombineFormat is the way back's wire format.
	CombineFormat CombineFormat
	// Shared: every rank maps every rank's memory (one host): the low-latency mode then
	// reads the rows and the outputs in place, unless PushRows or SendPartials.
	Shared  bool
	Layouts []*router.Layout // per rank: which of its tokens go to which rank
	// Rows[i][j] is how many rows rank i sends rank j (each token once per rank,
	// however many of its experts are there); Rows[i][i] are the rows a rank keeps.
	Rows [][]int
	// Choices[i][j] is how many (token, expert) choices those rows carry.
	Choices [][]int
	// ExpertRows[r][k] is how many rows local expert k of rank r receives (one per
	// (token, expert) pair).
	ExpertRows [][]int
	// Schedules[r] is rank r's schedule.
	Schedules []Schedule
	routings  []*router.Routing
	out       dtype.Type // the outputs' type
}

// NewPlan plans a step of the given routing of every rank (routings[r] is rank r's)
// under cfg and ccfg for activations and outputs of type T (the defaults of New[T] and
// NewCombiner[T]), without running anything. In the Auto mode the step is planned in
// the mode it runs in, with the buffers it grows to (Config.MaxBufferBytes): for a
// dispatcher and combiner whose other dispatches are combined.
func NewPlan[T Out](cfg Config, ccfg CombineConfig, routings []*router.Routing, shared bool) (*Plan, error) {
	cfg, err := Defaults[T](cfg)
	if err != nil {
		return nil, err
	}
	// The protocol the step runs in, as the dispatcher's mode picks it (the Auto mode:
	// the one a step of the largest rank's tokens takes, with the buffers it grows to).
	most := 0
	for _, rt := range routings {
		if rt != nil {
			most = max(most, rt.T)
		}
	}
	cfg, ccfg = policies[cfg.Mode].step(cfg, ccfg, outType[T](), most, shared)
	po := policies[cfg.Mode]
	ccfg, err = combineDefaults(cfg, ccfg, outType[T]())
	if err != nil {
		return nil, err
	}
	p := cfg.Placement.Ranks
	if len(routings) != p {
		return nil, fmt.Errorf("%w: %d routings for %d ranks", ErrConfig, len(routings), p)
	}
	pl := &Plan{Cfg: cfg, Combine: ccfg, Format: NewFormat(cfg), CombineFormat: newCombineFormat(cfg.Hidden, ccfg, outType[T]()), Shared: shared,
		Layouts: make([]*router.Layout, p), Rows: make([][]int, p), Choices: make([][]int, p), ExpertRows: make([][]int, p), routings: routings, out: outType[T]()}
	for r := range pl.ExpertRows {
		pl.ExpertRows[r] = make([]int, len(cfg.Placement.Local[r]))
	}
	for o, rt := range routings {
		if _, err := checkRouting(cfg, rt); err != nil {
			return nil, fmt.Errorf("rank %d: %w", o, err)
		}
		if n := po.capacity(cfg); n > 0 && rt.T > n {
			return nil, fmt.Errorf("%w: rank %d has %d tokens, MaxTokens is %d", ErrInput, o, rt.T, n)
		}
		l, err := router.BuildLayout(rt, cfg.Placement, o)
		if err != nil {
			return nil, fmt.Errorf("%w: rank %d: %v", ErrInput, o, err)
		}
		pl.Layouts[o] = l
		pl.Rows[o], pl.Choices[o] = make([]int, p), append([]int(nil), l.Choices...)
		for q, rows := range l.Rows {
			pl.Rows[o][q] = len(rows)
		}
		for t := 0; t < rt.T; t++ {
			for j := 0; j < rt.K; j++ {
				e := int(rt.Experts[t*rt.K+j])
				if e < 0 {
					continue
				}
				q := cfg.Placement.RankOf(e, o, t)
				pl.ExpertRows[q][cfg.Placement.LocalIndex(q, e)]++
			}
		}
	}
	pl.schedule()
	return pl, nil
}

// schedule makes every rank's schedule, as its executors lay it out.
func (pl *Plan) schedule() {
	p := len(pl.Rows)
	cfg := pl.Cfg
	po := policies[cfg.Mode]
	rowsInPlace, outsInPlace := po.inPlace(cfg, pl.Combine, pl.out, pl.Shared)
	plan := po.plan()
	pl.Schedules = make([]Schedule, p)
	for me := range pl.Schedules {
		k := &counts{rowsTo: pl.Rows[me], choicesTo: pl.Choices[me], rowsFrom: make([]int, p), choicesFrom: make([]int, p),
			tokens: make([]int, p), sentInPlace: rowsInPlace, fromInPlace: make([]bool, p)}
		for q := 0; q < p; q++ {
			k.rowsFrom[q], k.choicesFrom[q] = pl.Rows[q][me], pl.Choices[q][me]
			k.tokens[q] = pl.Layouts[q].Tokens()
			k.fromInPlace[q] = rowsInPlace && pl.Rows[q][me] > 0
		}
		planStep(&pl.Schedules[me], cfg.Mode, plan, me, p, pl.Format, pl.CombineFormat, k, outsInPlace)
	}
}

// DispatchBytes[i][j] is what rank j takes of rank i's rows in the dispatch (zero on the
// diagonal: a rank's own rows never travel): the block i sends j, headers included, and
// what j reads in place in i's memory. In the gathered mode every token of i goes to
// every j: the volume of the all-gather, whatever its algorithm.
func (pl *Plan) DispatchBytes() [][]int {
	return pl.matrix(func(s *Schedule, j int) Block { return s.Dispatch.Send[j] })
}

// CombineBytes[i][j] is what rank j takes of rank i's answers in the combine: the block i
// sends j (the partial sums of the rows j sent i; with SumAtOrigin, a count per row and
// an output per choice; in the gathered mode, the partial sums of every token of j: the
// volume of the reduce-scatter), and what j reads in place in i's memory.
func (pl *Plan) CombineBytes() [][]int {
	return pl.matrix(func(s *Schedule, j int) Block { return s.Combine.Send[j] })
}

func (pl *Plan) matrix(block func(s *Schedule, j int) Block) [][]int {
	p := len(pl.Schedules)
	m := make([][]int, p)
	for i := range m {
		m[i] = make([]int, p)
		for j := range m[i] {
			if i != j {
				b := block(&pl.Schedules[i], j)
				m[i][j] = b.Total() + b.Read
			}
		}
	}
	return m
}

// Routing is rank o's routing, as the plan was made from it.
func (pl *Plan) Routing(o int) *router.Routing { return pl.routings[o] }
