package coll

import (
	"fmt"
	"strings"
	"time"
)

// An algorithm is an entry of the registry: the operation it runs, the planner that
// makes a rank's schedule, the link model's cost, and when it can run at all. The
// executor (getPlan), the cost model (LinkCost.Estimate, chooseFit) and Algorithms read
// the registry; adding an algorithm is adding its entry (and its planner, in algos.go).
type algoEntry struct {
	op   OpKind
	algo Algo
	// plan makes this rank's schedule for the call k on shape sh.
	plan func(sh shape, t topology, k planKey) *plan
	// cost is the link model's time, in seconds, for p ranks and n bytes (per block or
	// per rank as the operation takes them). Nil: the model has none on one class of
	// link (Hier: the communicator's estimate weighs its levels).
	cost func(x costIn) float64
	// usable says whether the algorithm can run on the communicator's topology, given
	// whether the operation fits the shared areas. Nil: always.
	usable func(t topology, fits bool) bool
}

// costIn is what every cost function reads: one latency a, the ranks and bytes as
// floats, the log of the ranks, the largest power of two in them, the two extra steps
// of a non-power-of-two fold, and the link's per-byte costs.
type costIn struct {
	a, fp, fn, lg float64
	pof2          int
	p             int
	extra         float64
	beta, gamma   float64
}

// memBW is the memory copy bandwidth the model assumes for local copies (bytes/s).
const memBW = 20e9

func sharedFitsOK(_ topology, fits bool) bool { return fits }
func multiHost(t topology, _ bool) bool       { return t.hosts > 1 }
func uniformHosts(t topology, _ bool) bool    { return t.uniform }

// registry lists the algorithms of every fixed-size operation, each operation's in the
// order the cost model breaks ties (the first is the default).
var registry = []algoEntry{
	{op: OpBarrier, algo: Dissemination,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planBarrier(sh) },
		cost: func(x costIn) float64 { return x.lg * x.a }},

	{op: OpBroadcast, algo: Binomial,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planBroadcastBinomial(sh) },
		cost: func(x costIn) float64 { return x.lg * (x.a + x.fn*x.beta) }},
	{op: OpBroadcast, algo: Linear,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planBroadcastLinear(sh) },
		cost: func(x costIn) float64 { return (x.fp-1)*x.fn*x.beta + x.a }},

	{op: OpReduce, algo: Binomial,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planReduceBinomial(sh) },
		cost: func(x costIn) float64 { return x.lg * (x.a + x.fn*x.beta + x.fn*x.gamma) }},
	{op: OpReduce, algo: Linear,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planReduceLinear(sh) },
		cost: func(x costIn) float64 { return x.a + (x.fp-1)*x.fn*(x.beta+x.gamma) }},

	{op: OpAllReduce, algo: Ring,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planAllReduceRing(sh) },
		cost: func(x costIn) float64 {
			return 2*(x.fp-1)*x.a + 2*(x.fp-1)/x.fp*x.fn*x.beta + (x.fp-1)/x.fp*x.fn*x.gamma
		}},
	{op: OpAllReduce, algo: RecDoubling,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planAllReduceRecDbl(sh, RecDoubling) },
		cost: func(x costIn) float64 {
			return float64(ceilLog2(x.pof2))*(x.a+x.fn*x.beta+x.fn*x.gamma) + x.extra
		}},
	{op: OpAllReduce, algo: Rabenseifner,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planAllReduceRecDbl(sh, Rabenseifner) },
		cost: func(x costIn) float64 {
			l, f2 := float64(ceilLog2(x.pof2)), float64(x.pof2)
			return 2*l*x.a + 2*(f2-1)/f2*x.fn*x.beta + (f2-1)/f2*x.fn*x.gamma + x.extra
		}},
	{op: OpAllReduce, algo: Hier, usable: uniformHosts,
		plan: func(sh shape, t topology, _ planKey) *plan { return planAllReduceHier(sh, t) }},
	{op: OpAllReduce, algo: Shared, usable: sharedFitsOK,
		plan: func(_ shape, _ topology, k planKey) *plan { return planReduceShared(OpAllReduce, k) },
		// Two flags per rank (half a latency each); the buffer and the combined block
		// copied into the area (at the link's speed: lines the other CPUs read last),
		// the others' blocks read for combining and copied out.
		cost: func(x costIn) float64 {
			return x.a + (x.fn+x.fn/x.fp)*x.beta + 2*(x.fp-1)/x.fp*x.fn/memBW + (x.fp-1)/x.fp*x.fn*x.gamma
		}},

	{op: OpReduceScatter, algo: Ring,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planReduceScatterRing(sh) },
		cost: func(x costIn) float64 { return (x.fp-1)*x.a + (x.fp-1)*x.fn*(x.beta+x.gamma) }},
	{op: OpReduceScatter, algo: RecHalving,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planReduceScatterRecHalving(sh) },
		cost: func(x costIn) float64 {
			if isPow2(x.p) {
				return x.lg*x.a + (x.fp-1)*x.fn*(x.beta+x.gamma)
			}
			return (x.fp-1)*x.a + (x.fp-1)*x.fn*(x.beta+x.gamma) + x.a
		}},
	{op: OpReduceScatter, algo: Hier, usable: uniformHosts,
		plan: func(sh shape, t topology, _ planKey) *plan { return planReduceScatterHier(sh, t) }},
	{op: OpReduceScatter, algo: Shared, usable: sharedFitsOK,
		plan: func(_ shape, _ topology, k planKey) *plan { return planReduceShared(OpReduceScatter, k) },
		// One flag per rank; every block copied in, this rank's of every rank combined.
		cost: func(x costIn) float64 {
			return x.a/2 + x.fp*x.fn*x.beta + (x.fp-1)*x.fn/memBW + (x.fp-1)*x.fn*x.gamma
		}},

	{op: OpAllGather, algo: Ring,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planAllGatherRing(sh) },
		cost: func(x costIn) float64 { return (x.fp-1)*x.a + (x.fp-1)*x.fn*x.beta }},
	{op: OpAllGather, algo: RecDoubling,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planAllGatherRecDbl(sh) },
		cost: func(x costIn) float64 {
			t := x.lg*x.a + (x.fp-1)*x.fn*x.beta
			if !isPow2(x.p) {
				t += 2 * x.fp * x.fn / memBW // rotation copies
			}
			return t
		}},
	{op: OpAllGather, algo: Bruck,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planAllGatherBruck(sh) },
		cost: func(x costIn) float64 { return x.lg*x.a + (x.fp-1)*x.fn*x.beta + 2*x.fp*x.fn/memBW }},
	{op: OpAllGather, algo: Hier, usable: uniformHosts,
		plan: func(sh shape, t topology, _ planKey) *plan { return planAllGatherHier(sh, t) }},
	{op: OpAllGather, algo: Shared, usable: sharedFitsOK,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planAllGatherShared(sh) },
		// One flag per rank; the block copied in and the others out (or read across).
		cost: func(x costIn) float64 { return x.a/2 + x.fp*x.fn/memBW }},

	{op: OpAlltoAll, algo: Linear,
		plan: planAlltoAllOf(Linear),
		// All messages in flight at once: one latency, contention shares the link.
		cost: func(x costIn) float64 { return x.a + (x.fp-1)*x.fn*x.beta }},
	{op: OpAlltoAll, algo: Pairwise,
		plan: planAlltoAllOf(Pairwise),
		cost: func(x costIn) float64 { return (x.fp-1)*(x.a+x.fn*x.beta) + 0.1*x.a }},
	{op: OpAlltoAll, algo: Bruck,
		plan: planAlltoAllOf(Bruck),
		cost: func(x costIn) float64 { return x.lg*(x.a+x.fp/2*x.fn*x.beta) + 3*x.fp*x.fn/memBW }},
	{op: OpAlltoAll, algo: Hier, usable: multiHost,
		plan: planAlltoAllOf(Hier)},
	{op: OpAlltoAll, algo: Shared, usable: sharedFitsOK,
		plan: planAlltoAllOf(Shared),
		// One flag per rank instead of a message per peer (half a latency, for the
		// wake-ups it saves), and the blocks copied twice in memory (or once across,
		// about as fast).
		cost: func(x costIn) float64 { return x.a/2 + 2*(x.fp-1)*x.fn/memBW }},

	{op: OpScatter, algo: Linear,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planScatterLinear(sh) },
		cost: func(x costIn) float64 { return x.a + (x.fp-1)*x.fn*x.beta }},
	{op: OpGather, algo: Linear,
		plan: func(sh shape, _ topology, _ planKey) *plan { return planGatherLinear(sh) },
		cost: func(x costIn) float64 { return x.a + (x.fp-1)*x.fn*x.beta }},
}

// variableForms are the operations that run the algorithms of a fixed-size form,
// less those that cannot take blocks of different sizes.
var variableForms = []struct {
	op, fixed OpKind
	without   []Algo
}{
	{OpAlltoAllv, OpAlltoAll, nil},
	{OpAllGatherv, OpAllGather, nil},
	{OpReduceScatterv, OpReduceScatter, []Algo{Shared}},
	{OpGatherv, OpGather, nil},
	{OpScatterv, OpScatter, nil},
}

// entries indexes the registry: entries[op][algo]. The variable-size forms share their
// fixed-size forms' entries.
var entries = func() map[OpKind]map[Algo]*algoEntry {
	m := map[OpKind]map[Algo]*algoEntry{}
	for i := range registry {
		e := &registry[i]
		if m[e.op] == nil {
			m[e.op] = map[Algo]*algoEntry{}
		}
		if _, dup := m[e.op][e.algo]; dup {
			panic(fmt.Sprintf("coll: %v/%v registered twice", e.op, e.algo))
		}
		m[e.op][e.algo] = e
	}
	for _, v := range variableForms {
		m[v.op] = map[Algo]*algoEntry{}
	next:
		for a, e := range m[v.fixed] {
			for _, w := range v.without {
				if a == w {
					continue next
				}
			}
			m[v.op][a] = e
		}
	}
	return m
}()

// Algorithms lists, for every operation, the algorithms it can run, in the order the
// cost model breaks ties (the first is the default), from the registry.
var Algorithms = func() map[OpKind][]Algo {
	m := map[OpKind][]Algo{}
	for _, e := range registry {
		m[e.op] = append(m[e.op], e.algo)
	}
	for _, v := range variableForms {
		for _, a := range m[v.fixed] {
			if _, ok := entries[v.op][a]; ok {
				m[v.op] = append(m[v.op], a)
			}
		}
	}
	return m
}()

// entryOf returns op's entry for algo, or op's default where it has no such algorithm.
func entryOf(op OpKind, algo Algo) *algoEntry {
	if e, ok := entries[op][algo]; ok {
		return e
	}
	if as := Algorithms[op]; len(as) > 0 {
		return entries[op][as[0]]
	}
	return nil
}

// planAlltoAllOf is the AlltoAll planner of algo: blocks of count elements to every rank.
func planAlltoAllOf(algo Algo) func(sh shape, t topology, k planKey) *plan {
	return func(sh shape, t topology, k planKey) *plan {
		pl := &plan{op: OpAlltoAll, algo: algo}
		b := k.count * k.es
		l := evenLayout(sh.p, b)
		switch algo {
		case Shared:
			// No steps: execShared runs it.
		case Pairwise:
			planAlltoAllPairwise(pl, sh.p, sh.rank, l)
		case Bruck:
			m := make([][]int, sh.p)
			for i := range m {
				m[i] = make([]int, sh.p)
				for j := range m[i] {
					m[i][j] = b
				}
			}
			planAlltoAllBruck(pl, sh.p, sh.rank, l, m)
		case Hier:
			planAlltoAllHier(pl, t, sh.rank, l, func(int, int) int { return b })
		default:
			planAlltoAllLinear(pl, sh.p, sh.rank, l)
		}
		return pl
	}
}

// Estimate predicts the time of op with algo on p ranks for n bytes (per rank input for
// AllReduce/Broadcast/Reduce; per block for AllGather, ReduceScatter and AlltoAll).
func (c LinkCost) Estimate(op OpKind, algo Algo, p, n int) time.Duration {
	e, ok := entries[op][algo]
	if p <= 1 || !ok || e.cost == nil {
		return 0
	}
	a := c.Alpha.Seconds()
	fn := float64(n)
	pof2 := floorPow2(p)
	x := costIn{a: a, fp: float64(p), fn: fn, lg: float64(ceilLog2(p)), pof2: pof2, p: p, beta: c.Beta, gamma: c.Gamma}
	if pof2 != p { // non-power-of-two fold: two more full-size steps
		x.extra = 2 * (a + fn*c.Beta)
	}
	return time.Duration(e.cost(x) * 1e9)
}

// ParseAlgoOverrides parses MOEX_ALGO: "op:algo[,op:algo...]".
func ParseAlgoOverrides(s string) (map[OpKind]Algo, error) {
	m := map[OpKind]Algo{}
	if strings.TrimSpace(s) == "" {
		return m, nil
	}
	for _, part := range strings.Split(s, ",") {
		op, al, ok := strings.Cut(strings.TrimSpace(part), ":")
		if !ok {
			return nil, &ArgError{Arg: "MOEX_ALGO", Reason: fmt.Sprintf("%q: want op:algo", part)}
		}
		o, err := ParseOpKind(op)
		if err != nil {
			return nil, &ArgError{Arg: "MOEX_ALGO", Reason: err.Error()}
		}
		a, err := ParseAlgo(al)
		if err != nil {
			return nil, &ArgError{Arg: "MOEX_ALGO", Reason: err.Error()}
		}
		if a != AlgoAuto && !supports(o, a) {
			return nil, &ArgError{Arg: "MOEX_ALGO", Reason: fmt.Sprintf("%v has no algorithm %v (have %v)", o, a, Algorithms[o])}
		}
		m[o] = a
	}
	return m, nil
}

func supports(op OpKind, a Algo) bool {
	for _, x := range Algorithms[op] {
		if x == a {
			return true
		}
	}
	return false
}

// planAllGather is the AllGather (and AllGatherv) planner of algo.
func planAllGather(algo Algo, sh shape, t topology) *plan {
	return entryOf(OpAllGatherv, algo).plan(sh, t, planKey{})
}

// planReduceScatter is the ReduceScatter (and ReduceScatterv) planner of algo, but for
// the shared areas' (planReduceShared).
func planReduceScatter(algo Algo, sh shape, t topology) *plan {
	return entryOf(OpReduceScatterv, algo).plan(sh, t, planKey{})
}
