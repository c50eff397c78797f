package combine

import (
	"fmt"

	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/internal/ep"
	"github.com/moex-ai/moex/router"
)

// Plan is one step (a dispatch and its combine) over every rank, planned without running
// anything: every rank's Schedule, as its executors lay it out. moex flow prints it;
// tests compare what the executors move with it.
type Plan struct {
	Cfg     dispatch.Config // the dispatch's configuration, defaults filled, in the step's mode
	Combine Config          // the combine's, defaults filled
	Format  dispatch.Format
	// CombineFormat is the way back's wire format.
	CombineFormat Format
	// Shared: every rank maps every rank's memory (one host): the low-latency mode then
	// reads the rows and the outputs in place, unless PushRows or SendPartials.
	Shared bool
	// Layouts[r] says which of rank r's tokens go to which rank.
	Layouts []*router.Layout
	// Rows[i][j] is how many rows rank i sends rank j (each token once per rank, however
	// many of its experts are there); Rows[i][i] are the rows a rank keeps.
	Rows [][]int
	// Choices[i][j] is how many (token, expert) choices those rows carry.
	Choices [][]int
	// ExpertRows[r][k] is how many rows local expert k of rank r receives (one per
	// (token, expert) choice).
	ExpertRows [][]int
	// Schedules[r] is rank r's schedule.
	Schedules []dispatch.Schedule

	e *ep.Plan
}

// NewPlan plans a step of every rank's routing (routings[r] is rank r's) under dcfg and
// cfg for activations and outputs of type T (the defaults of dispatch.New[T] and New[T]);
// shared says every rank maps every rank's memory (one host), where the low-latency mode
// reads rows and outputs in place. In the Auto mode the step is planned in the mode it
// would run in.
func NewPlan[T Act](dcfg dispatch.Config, cfg Config, routings []*router.Routing, shared bool) (*Plan, error) {
	e, err := ep.NewPlan[T](hooks.engineConfig(dcfg), ep.CombineConfig(cfg), routings, shared)
	if err != nil {
		return nil, err
	}
	pl := &Plan{Cfg: hooks.config(e.Cfg), Combine: Config(e.Combine), Format: dispatch.Format(e.Format),
		CombineFormat: Format(e.CombineFormat), Shared: e.Shared, Layouts: e.Layouts, Rows: e.Rows,
		Choices: e.Choices, ExpertRows: e.ExpertRows, Schedules: make([]dispatch.Schedule, len(e.Schedules)), e: e}
	for r, s := range e.Schedules {
		pl.Schedules[r] = hooks.schedule(s)
	}
	return pl, nil
}

// DispatchBytes[i][j] is what rank j takes of rank i's rows in the dispatch (zero on the
// diagonal: a rank's own rows never travel): the block i sends j, headers included, and
// what j reads in place in i's memory. In the gathered mode every token of i goes to
// every j: the volume of the all-gather, whatever its algorithm.
func (pl *Plan) DispatchBytes() [][]int { return pl.e.DispatchBytes() }

// CombineBytes[i][j] is what rank j takes of rank i's answers in the combine: the block i
// sends j (the partial sums of the rows j sent i; with SumAtOrigin, a count per row and
// an output per choice; in the gathered mode, the partial sums of every token of j: the
// volume of the reduce-scatter), and what j reads in place in i's memory.
func (pl *Plan) CombineBytes() [][]int { return pl.e.CombineBytes() }

// Routing is rank o's routing, as the plan was made from it.
func (pl *Plan) Routing(o int) *router.Routing { return pl.e.Routing(o) }

// Hosts computes the traffic of the step with ranks on hosts (hosts[r]: rank r's host),
// flat as planned and in two levels (dispatch.TwoLevel). Headers are left out.
func (pl *Plan) Hosts(hosts []int) (*HostTraffic, error) {
	if pl.e == nil {
		return nil, fmt.Errorf("%w: a Plan not made by NewPlan", dispatch.ErrConfig)
	}
	h, err := pl.e.Hosts(hosts)
	if err != nil {
		return nil, err
	}
	return &HostTraffic{Flat: StageTraffic(h.Flat), TwoLevel: StageTraffic(h.TwoLevel)}, nil
}

// HostTraffic is one step's bytes on the wire within and across hosts, flat and
// two-level (Plan.Hosts): what moex flow --hosts prints.
type HostTraffic struct {
	Flat     StageTraffic // the flat dispatch and combine
	TwoLevel StageTraffic // the two-level ones
}

// StageTraffic is bytes on the wire, every rank's, within and across hosts, and the
// dispatch's rows.
type StageTraffic struct {
	DispatchWithin, DispatchAcross int64 // the dispatch's bytes within hosts and across
	CombineWithin, CombineAcross   int64 // the combine's
	RowsWithin, RowsAcross         int   // the dispatch's rows within hosts and across
}
