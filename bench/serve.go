package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// ServeOpts is a serving job that heals itself (`moex bench moe --chaos`): every rank
// serves MoE steps until Until, every token checked; when a rank dies the others shrink,
// put its experts back from their replicas (dispatch.Recover) and serve on; a process
// that takes a dead rank over is admitted between steps (coll.Comm.Admit) and receives
// its experts (dispatch.Grow).
type ServeOpts struct {
	RecoverOpts
	// Until is when the job stops, the same instant on every process (a joiner's too),
	// decided by the communicator's rank 0 and broadcast at every step.
	Until time.Time
	// Snapshot, when set, is given the report so far once a second (a process killed
	// leaves its last one: moex bench moe --chaos writes them to files).
	Snapshot func(*ServeReport)
}

// ServeSecond is one second of a rank's serving: the steps it completed, the fewest ranks
// of the communicators it served on in that second, and how much of the second it was
// short of ranks (from the step that found a rank dead to the regrow that made the job
// whole again).
type ServeSecond struct {
	Steps   int     `json:"steps"`
	Ranks   int     `json:"min_ranks"`
	ShortMS float64 `json:"short_ms"`
}

// ServeReport is what one process saw of a self-healing job.
type ServeReport struct {
	Rank        int    `json:"rank"` // in the job (its transport)
	Pid         int    `json:"pid"`
	Joined      bool   `json:"joined"`
	StartUnixNS int64  `json:"start_unix_ns"` // when it began serving (its clock)
	Steps       int    `json:"steps"`
	WrongTokens int    `json:"wrong_tokens"`
	Shrinks     int    `json:"shrinks"` // deaths it recovered from (several at once count once)
	Grows       int    `json:"grows"`   // processes it admitted (or, for a joiner, 0)
	Error       string `json:"error,omitempty"`
	// CutOff: it stopped because it was on the side of a split that could not reach the
	// job's registry (coll.ErrCutOff).
	CutOff bool `json:"cut_off,omitempty"`
	// Seconds: its steps per second of wall clock, from StartUnixNS.
	Seconds []ServeSecond `json:"seconds"`
}

// errWrongTokens: a step brought tokens back wrong (counted, not fatal).
var errWrongTokens = errors.New("bench: tokens came back wrong")

// Serve runs a self-healing serving job on c (see ServeOpts); c is what coll.Init
// returned, a joiner's grown communicator included (its ParentRanks are set). It returns
// this process's report, and the communicator it ended on (for the caller to close,
// unless it is c).
func Serve(ctx context.Context, c *coll.Comm, o ServeOpts) (*coll.Comm, *ServeReport, error) {
	o.Victim = 0 // nobody is told to die: the chaos kills
	cfg, err := checkRecoverOpts(c, &o.RecoverOpts)
	if err != nil {
		return c, nil, err
	}
	rep := &ServeReport{Rank: c.WorldRank(c.Rank()), Pid: os.Getpid(), Joined: c.ParentRanks() != nil, StartUnixNS: time.Now().UnixNano()}
	g := c
	pl, ws, err := firstPlacement(ctx, c, cfg.Experts, o.WeightBytes, rep.Joined)
	if err != nil {
		return g, rep, err
	}
	sc := newRecoverScenario(ctx, rep.Rank, cfg, o.RecoverOpts, ws)
	sc.wrongOK = true
	if err := sc.open(g, pl); err != nil {
		return g, rep, err
	}
	defer sc.close()
	start := time.Now()
	at := func(i int) *ServeSecond { // second i of the report
		for len(rep.Seconds) <= i {
			rep.Seconds = append(rep.Seconds, ServeSecond{Ranks: g.Size()})
		}
		return &rep.Seconds[i]
	}
	record := func(steps int) {
		s := int(time.Since(start) / time.Second)
		if len(rep.Seconds) <= s && len(rep.Seconds) > 0 && o.Snapshot != nil {
			o.Snapshot(rep) // a second ended
		}
		sec := at(s)
		sec.Steps += steps
		sec.Ranks = min(sec.Ranks, g.Size())
	}
	// The time served short of ranks, spread over the seconds it spans.
	world := c.Transport().Size()
	var shortSince time.Time
	endShort := func() {
		now := time.Now()
		for t := shortSince; !t.IsZero() && t.Before(now); {
			i := int(t.Sub(start) / time.Second)
			next := start.Add(time.Duration(i+1) * time.Second)
			if next.After(now) {
				next = now
			}
			at(i).ShortMS += float64(next.Sub(t).Microseconds()) / 1e3
			t = next
		}
		shortSince = time.Time{}
	}
	// moveTo serves on ng, under npl with the weights next, from now on.
	moveTo := func(ng *coll.Comm, npl *router.Placement, next map[int][]byte) error {
		if g != c {
			g.Close()
		}
		g, pl, sc.ws = ng, npl, next
		return sc.open(g, pl)
	}
	// heal shrinks g past the ranks that died and puts their experts back.
	heal := func(cause error) error {
		sc.close()
		sub, err := g.Shrink(ctx)
		if err != nil {
			return fmt.Errorf("bench: shrinking after %v: %w", cause, err)
		}
		next := map[int][]byte{}
		npl, _, err := dispatch.Recover(ctx, sub, pl, nil, router.Balance{}, weightsInto(o.WeightBytes, sc.ws, next))
		if err != nil {
			sub.Close()
			return fmt.Errorf("bench: recovering after %v: %w", cause, err)
		}
		rep.Shrinks++
		return moveTo(sub, npl, next)
	}
	// admit grows g with whoever took a dead rank over, and gives them experts.
	registry := true
	admit := func() error {
		ng, err := g.Admit(ctx)
		if errors.Is(err, coll.ErrNoRegistry) {
			registry = false
			return nil
		}
		if err != nil || ng == nil {
			return err
		}
		sc.close()
		next := map[int][]byte{}
		npl, _, err := dispatch.Grow(ctx, ng, pl, nil, router.Balance{}, weightsInto(o.WeightBytes, sc.ws, next))
		if err != nil {
			ng.Close()
			return err
		}
		rep.Grows++
		if err := moveTo(ng, npl, next); err != nil {
			return err
		}
		if g.Size() == world {
			endShort()
		}
		return nil
	}
	stop := []int64{0}
	for {
		stop[0] = 0
		if g.Rank() == 0 && time.Now().After(o.Until) {
			stop[0] = 1
		}
		err := coll.Broadcast(ctx, g, stop, 0)
		if err == nil && stop[0] == 1 {
			break
		}
		if err == nil {
			err = sc.Step(ctx, 0, nil)
			if errors.Is(err, errWrongTokens) {
				rep.WrongTokens += sc.wrong
				err = nil
			}
			if err == nil {
				rep.Steps++
				record(1)
			}
		}
		if err == nil && registry {
			err = admit()
		}
		if err == nil {
			continue
		}
		if pe := (*coll.PeerError)(nil); !errors.As(err, &pe) {
			rep.Error = err.Error()
			return g, rep, err
		}
		if shortSince.IsZero() {
			shortSince = time.Now()
		}
		if err := heal(err); err != nil {
			rep.Error, rep.CutOff = err.Error(), errors.Is(err, coll.ErrCutOff)
			return g, rep, err
		}
		record(0)
	}
	endShort()
	record(0)
	return g, rep, nil
}

// ServeSummary is a self-healing job's summary over every process's report.
type ServeSummary struct {
	Seconds     int     `json:"seconds"`
	Kills       int     `json:"kills"`
	Stops       int     `json:"stops"`   // SIGSTOPs (the chaos's)
	Hung        bool    `json:"hung"`    // the job had not ended a minute after its end
	Regrows     int     `json:"regrows"` // processes admitted
	Steps       int     `json:"steps"`   // the job's
	WrongTokens int     `json:"wrong_tokens"`
	Errors      int     `json:"errors"`     // processes that ended with an error (hangs end in ErrTimeout)
	FullShare   float64 `json:"full_share"` // of the time, that served on every rank (1 - the time short of ranks)
	// The job's steps per second before the first kill, and in the five seconds after
	// each regrow (fewer where the next fault comes first); 0 where there is no such
	// second.
	Before float64   `json:"steps_per_s_before"`
	After  []float64 `json:"steps_per_s_after_regrows"`
}

// Summarize takes the kills the chaos made and every process's last report (killed ones'
// included, as they left them) and lays the job out on the wall clock: a second's steps
// are the most any process served in it (every rank serves every step), and the time it
// was short of ranks the most any process counted in it.
func Summarize(reports []*ServeReport, kills []time.Time, world int) *ServeSummary {
	s := &ServeSummary{Kills: len(kills)}
	if len(reports) == 0 {
		return s
	}
	t0 := reports[0].StartUnixNS
	joined := 0
	for _, r := range reports {
		t0 = min(t0, r.StartUnixNS)
		s.WrongTokens += r.WrongTokens
		if r.Error != "" {
			s.Errors++
		}
		if r.Joined {
			joined++
		}
		s.Regrows = max(s.Regrows, r.Grows) // a process that served throughout admitted every one
	}
	s.Regrows = max(s.Regrows, joined)
	type second struct {
		steps, ranks int
		short        float64 // ms: the most any process was short of ranks in it
	}
	var secs []second
	for _, r := range reports {
		off := int((r.StartUnixNS - t0) / int64(time.Second))
		for i, sec := range r.Seconds {
			j := off + i
			for len(secs) <= j {
				secs = append(secs, second{ranks: world})
			}
			secs[j].steps = max(secs[j].steps, sec.Steps)
			secs[j].ranks = min(secs[j].ranks, sec.Ranks)
			secs[j].short = min(max(secs[j].short, sec.ShortMS), 1000)
		}
	}
	s.Seconds = len(secs)
	short := 0.0
	for _, sec := range secs {
		s.Steps += sec.steps
		short += sec.short
	}
	if s.Seconds > 0 {
		s.FullShare = 1 - short/1e3/float64(s.Seconds)
	}
	rate := func(from, to int) float64 {
		from, to = max(from, 0), min(to, len(secs))
		if to <= from {
			return 0 // no such second
		}
		n := 0
		for _, sec := range secs[from:to] {
			n += sec.steps
		}
		return float64(n) / float64(to-from)
	}
	first := len(secs)
	if len(kills) > 0 {
		first = int((kills[0].UnixNano() - t0) / int64(time.Second))
	}
	s.Before = rate(1, first) // the first second holds start-up
	// A regrow: a second at full strength throughout after one that was not; the rate is
	// that second's and the next four's (up to the next fault).
	for i := 1; i < len(secs); i++ {
		if secs[i].ranks == world && secs[i-1].ranks != world {
			end := i + 5
			for j := i + 1; j < min(end, len(secs)); j++ {
				if secs[j].ranks != world {
					end = j
					break
				}
			}
			s.After = append(s.After, rate(i, end))
		}
	}
	return s
}

// firstPlacement is the placement a process of a self-healing job starts serving with,
// and the weights of its experts: a joiner receives them (dispatch.Grow); a starting rank
// places every expert on two ranks half the job apart (with the ranks of a host numbered
// together, a host's loss, or its link's, leaves a replica of each).
func firstPlacement(ctx context.Context, c *coll.Comm, experts, weightBytes int, joined bool) (*router.Placement, map[int][]byte, error) {
	if joined {
		next := map[int][]byte{}
		pl, _, err := dispatch.Grow(ctx, c, nil, nil, router.Balance{}, weightsInto(weightBytes, map[int][]byte{}, next))
		return pl, next, err
	}
	pl, err := halfApart(experts, c.Size())
	if err != nil {
		return nil, nil, err
	}
	ws := map[int][]byte{}
	for _, e := range pl.Local[c.Rank()] {
		ws[e] = make([]byte, weightBytes)
		ws[e][0] = byte(e)
	}
	return pl, ws, nil
}

// halfApart places experts experts round-robin on ranks ranks, each with a replica on the
// rank ranks/2 further on (the next where there are two or three ranks).
func halfApart(experts, ranks int) (*router.Placement, error) {
	step := max(ranks/2, 1)
	owners := make([][]int, experts)
	for e := range owners {
		owners[e] = []int{e % ranks, (e%ranks + step) % ranks}
	}
	return router.PlacementOf(experts, ranks, owners)
}
