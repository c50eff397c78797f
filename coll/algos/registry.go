package algos

import (
	"fmt"
	"time"
)

// An algorithm is an entry of the registry: the operation it runs, the planner that
// makes a rank's schedule, the link model's cost, and when it can run at all. The
// executor (getPlan), the cost model (LinkCost.Estimate, chooseFit) and Algorithms read
// the registry; adding an algorithm is adding its entry (and its planner, in algos.go).
type algoEntry struct {
	Op   OpKind
	Algo Algo
	// plan makes this rank's schedule for the call k on shape sh.
	Plan func(sh Shape, t Topology, k PlanKey) *Plan
	// cost is the link model's time, in seconds, for p ranks and n bytes (per block or
	// per rank as the operation takes them). Nil: the model has none on one class of
	// link (Hier: the communicator's estimate weighs its levels).
	Cost func(x costIn) float64
	// usable says whether the algorithm can run on the communicator's topology, given
	// whether the operation fits the shared areas. Nil: always.
	Usable func(t Topology, fits bool) bool
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

func sharedFitsOK(_ Topology, fits bool) bool { return fits }
func multiHost(t Topology, _ bool) bool       { return t.Hosts > 1 }
func uniformHosts(t Topology, _ bool) bool    { return t.Uniform }

// registry lists the algorithms of every fixed-size operation, each operation's in the
// order the cost model breaks ties (the first is the default).
var Registry = []algoEntry{
	{Op: OpBarrier, Algo: Dissemination,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return planBarrier(sh) },
		Cost: func(x costIn) float64 { return x.lg * x.a }},

	{Op: OpBroadcast, Algo: Binomial,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return planBroadcastBinomial(sh) },
		Cost: func(x costIn) float64 { return x.lg * (x.a + x.fn*x.beta) }},
	{Op: OpBroadcast, Algo: Linear,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return planBroadcastLinear(sh) },
		Cost: func(x costIn) float64 { return (x.fp-1)*x.fn*x.beta + x.a }},

	{Op: OpReduce, Algo: Binomial,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return planReduceBinomial(sh) },
		Cost: func(x costIn) float64 { return x.lg * (x.a + x.fn*x.beta + x.fn*x.gamma) }},
	{Op: OpReduce, Algo: Linear,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return planReduceLinear(sh) },
		Cost: func(x costIn) float64 { return x.a + (x.fp-1)*x.fn*(x.beta+x.gamma) }},

	{Op: OpAllReduce, Algo: Ring,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return PlanAllReduceRing(sh) },
		Cost: func(x costIn) float64 {
			return 2*(x.fp-1)*x.a + 2*(x.fp-1)/x.fp*x.fn*x.beta + (x.fp-1)/x.fp*x.fn*x.gamma
		}},
	{Op: OpAllReduce, Algo: RecDoubling,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return planAllReduceRecDbl(sh, RecDoubling) },
		Cost: func(x costIn) float64 {
			return float64(CeilLog2(x.pof2))*(x.a+x.fn*x.beta+x.fn*x.gamma) + x.extra
		}},
	{Op: OpAllReduce, Algo: Rabenseifner,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return planAllReduceRecDbl(sh, Rabenseifner) },
		Cost: func(x costIn) float64 {
			l, f2 := float64(CeilLog2(x.pof2)), float64(x.pof2)
			return 2*l*x.a + 2*(f2-1)/f2*x.fn*x.beta + (f2-1)/f2*x.fn*x.gamma + x.extra
		}},
	{Op: OpAllReduce, Algo: Hier, Usable: uniformHosts,
		Plan: func(sh Shape, t Topology, _ PlanKey) *Plan { return PlanAllReduceHier(sh, t) }},
	{Op: OpAllReduce, Algo: Shared, Usable: sharedFitsOK,
		Plan: func(_ Shape, _ Topology, k PlanKey) *Plan { return planReduceShared(OpAllReduce, k) },
		// Two flags per rank (half a latency each); the buffer and the combined block
		// copied into the area (at the link's speed: lines the other CPUs read last),
		// the others' blocks read for combining and copied out.
		Cost: func(x costIn) float64 {
			return x.a + (x.fn+x.fn/x.fp)*x.beta + 2*(x.fp-1)/x.fp*x.fn/memBW + (x.fp-1)/x.fp*x.fn*x.gamma
		}},

	{Op: OpReduceScatter, Algo: Ring,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return PlanReduceScatterRing(sh) },
		Cost: func(x costIn) float64 { return (x.fp-1)*x.a + (x.fp-1)*x.fn*(x.beta+x.gamma) }},
	{Op: OpReduceScatter, Algo: RecHalving,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return planReduceScatterRecHalving(sh) },
		Cost: func(x costIn) float64 {
			if isPow2(x.p) {
				return x.lg*x.a + (x.fp-1)*x.fn*(x.beta+x.gamma)
			}
			return (x.fp-1)*x.a + (x.fp-1)*x.fn*(x.beta+x.gamma) + x.a
		}},
	{Op: OpReduceScatter, Algo: Hier, Usable: uniformHosts,
		Plan: func(sh Shape, t Topology, _ PlanKey) *Plan { return PlanReduceScatterHier(sh, t) }},
	{Op: OpReduceScatter, Algo: Shared, Usable: sharedFitsOK,
		Plan: func(_ Shape, _ Topology, k PlanKey) *Plan { return planReduceShared(OpReduceScatter, k) },
		// One flag per rank; every block copied in, this rank's of every rank combined,
		// at memory speed: the copy is into this rank's own area, and the combining reads
		// blocks the caches hold as the copies left them. Measured (moex bench coll --op
		// reducescatter --transport shm, 2 CPUs, MOEX_ALGO forcing each): 256 KiB to 1
		// MiB sent per rank, P=2 13-49 us against the ring's 36-169, P=4 110-230 against
		// 80-477, P=8 even; the ring's costs, with the link's beta, put it ahead.
		Cost: func(x costIn) float64 {
			return x.a/2 + x.fp*x.fn/memBW + (x.fp-1)*x.fn/memBW
		}},

	{Op: OpAllGather, Algo: Ring,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return PlanAllGatherRing(sh) },
		Cost: func(x costIn) float64 { return (x.fp-1)*x.a + (x.fp-1)*x.fn*x.beta }},
	{Op: OpAllGather, Algo: RecDoubling,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return planAllGatherRecDbl(sh) },
		Cost: func(x costIn) float64 {
			t := x.lg*x.a + (x.fp-1)*x.fn*x.beta
			if !isPow2(x.p) {
				t += 2 * x.fp * x.fn / memBW // rotation copies
			}
			return t
		}},
	{Op: OpAllGather, Algo: Bruck,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return PlanAllGatherBruck(sh) },
		Cost: func(x costIn) float64 { return x.lg*x.a + (x.fp-1)*x.fn*x.beta + 2*x.fp*x.fn/memBW }},
	{Op: OpAllGather, Algo: Hier, Usable: uniformHosts,
		Plan: func(sh Shape, t Topology, _ PlanKey) *Plan { return PlanAllGatherHier(sh, t) }},
	{Op: OpAllGather, Algo: Shared, Usable: sharedFitsOK,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return planAllGatherShared(sh) },
		// One flag per rank; the block copied in and the others out (or read across).
		Cost: func(x costIn) float64 { return x.a/2 + x.fp*x.fn/memBW }},

	{Op: OpAlltoAll, Algo: Linear,
		Plan: planAlltoAllOf(Linear),
		// All messages in flight at once: one latency, contention shares the link.
		Cost: func(x costIn) float64 { return x.a + (x.fp-1)*x.fn*x.beta }},
	{Op: OpAlltoAll, Algo: Pairwise,
		Plan: planAlltoAllOf(Pairwise),
		Cost: func(x costIn) float64 { return (x.fp-1)*(x.a+x.fn*x.beta) + 0.1*x.a }},
	{Op: OpAlltoAll, Algo: Bruck,
		Plan: planAlltoAllOf(Bruck),
		Cost: func(x costIn) float64 { return x.lg*(x.a+x.fp/2*x.fn*x.beta) + 3*x.fp*x.fn/memBW }},
	{Op: OpAlltoAll, Algo: Hier, Usable: multiHost,
		Plan: planAlltoAllOf(Hier)},
	{Op: OpAlltoAll, Algo: Shared, Usable: sharedFitsOK,
		Plan: planAlltoAllOf(Shared),
		// One flag per rank instead of a message per peer (half a latency, for the
		// wake-ups it saves), and the blocks copied twice in memory (or once across,
		// about as fast).
		Cost: func(x costIn) float64 { return x.a/2 + 2*(x.fp-1)*x.fn/memBW }},

	{Op: OpScatter, Algo: Linear,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return PlanScatterLinear(sh) },
		Cost: func(x costIn) float64 { return x.a + (x.fp-1)*x.fn*x.beta }},
	{Op: OpGather, Algo: Linear,
		Plan: func(sh Shape, _ Topology, _ PlanKey) *Plan { return PlanGatherLinear(sh) },
		Cost: func(x costIn) float64 { return x.a + (x.fp-1)*x.fn*x.beta }},
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
var Entries = func() map[OpKind]map[Algo]*algoEntry {
	m := map[OpKind]map[Algo]*algoEntry{}
	for i := range Registry {
		e := &Registry[i]
		if m[e.Op] == nil {
			m[e.Op] = map[Algo]*algoEntry{}
		}
		if _, dup := m[e.Op][e.Algo]; dup {
			panic(fmt.Sprintf("coll: %v/%v registered twice", e.Op, e.Algo))
		}
		m[e.Op][e.Algo] = e
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
	for _, e := range Registry {
		m[e.Op] = append(m[e.Op], e.Algo)
	}
	for _, v := range variableForms {
		for _, a := range m[v.fixed] {
			if _, ok := Entries[v.op][a]; ok {
				m[v.op] = append(m[v.op], a)
			}
		}
	}
	return m
}()

// entryOf returns op's entry for algo, or op's default where it has no such algorithm.
func EntryOf(op OpKind, algo Algo) *algoEntry {
	if e, ok := Entries[op][algo]; ok {
		return e
	}
	if as := Algorithms[op]; len(as) > 0 {
		return Entries[op][as[0]]
	}
	return nil
}

// planAlltoAllOf is the AlltoAll planner of algo: blocks of count elements to every rank.
func planAlltoAllOf(algo Algo) func(sh Shape, t Topology, k PlanKey) *Plan {
	return func(sh Shape, t Topology, k PlanKey) *Plan {
		pl := &Plan{Op: OpAlltoAll, Algo: algo}
		b := k.Count * k.Es
		l := EvenLayout(sh.P, b)
		switch algo {
		case Shared:
			// No steps: execShared runs it.
		case Pairwise:
			PlanAlltoAllPairwise(pl, sh.P, sh.Rank, l)
		case Bruck:
			m := make([][]int, sh.P)
			for i := range m {
				m[i] = make([]int, sh.P)
				for j := range m[i] {
					m[i][j] = b
				}
			}
			PlanAlltoAllBruck(pl, sh.P, sh.Rank, l, m)
		case Hier:
			PlanAlltoAllHier(pl, t, sh.Rank, l, func(int, int) int { return b })
		default:
			PlanAlltoAllLinear(pl, sh.P, sh.Rank, l)
		}
		return pl
	}
}

// Estimate predicts the time of op with algo on p ranks for n bytes (per rank input for
// AllReduce/Broadcast/Reduce; per block for AllGather, ReduceScatter and AlltoAll).
func (c LinkCost) Estimate(op OpKind, algo Algo, p, n int) time.Duration {
	e, ok := Entries[op][algo]
	if p <= 1 || !ok || e.Cost == nil {
		return 0
	}
	a := c.Alpha.Seconds()
	fn := float64(n)
	pof2 := floorPow2(p)
	x := costIn{a: a, fp: float64(p), fn: fn, lg: float64(CeilLog2(p)), pof2: pof2, p: p, beta: c.Beta, gamma: c.Gamma}
	if pof2 != p { // non-power-of-two fold: two more full-size steps
		x.extra = 2 * (a + fn*c.Beta)
	}
	return time.Duration(e.Cost(x) * 1e9)
}

// EstimateAllReduceAcross predicts the time of the shared-area AllReduce that runs in
// place in the ranks' buffers (for buffers past 64 KiB, or past the areas, where they can
// be read across) on p ranks for n bytes: two flags per rank; every rank reads its block of the others' buffers to combine and the
// others' combined blocks, and writes its whole buffer, at memory speed.
func (c LinkCost) EstimateAllReduceAcross(p, n int) time.Duration {
	if p <= 1 {
		return 0
	}
	fp, fn := float64(p), float64(n)
	sec := c.Alpha.Seconds() + (2*(fp-1)/fp*fn+fn)/memBW + (fp-1)/fp*fn*c.Gamma
	return time.Duration(sec * 1e9)
}

// EstimateReduceScatterAcross predicts the time of the shared-area ReduceScatter that
// reads every rank's send buffer in place (for buffers larger than the areas) on p ranks
// for blocks of n bytes: every rank reads its block of the others' buffers and of its
// own and writes its block, at memory speed; it combines each chunk while the read left
// it in the caches, which costs next to nothing beside the reads (measured with moex
// bench coll --op reducescatter --transport shm: P=2, 4 MiB, 300 us against the 315 this
// gives; with the combining at memory speed too it would say 420).
func (c LinkCost) EstimateReduceScatterAcross(p, n int) time.Duration {
	if p <= 1 {
		return 0
	}
	fp, fn := float64(p), float64(n)
	sec := c.Alpha.Seconds() + (fp*fn+fn)/memBW
	return time.Duration(sec * 1e9)
}

func Supports(op OpKind, a Algo) bool {
	for _, x := range Algorithms[op] {
		if x == a {
			return true
		}
	}
	return false
}

// planAllGather is the AllGather (and AllGatherv) planner of algo.
func PlanAllGather(algo Algo, sh Shape, t Topology) *Plan {
	return EntryOf(OpAllGatherv, algo).Plan(sh, t, PlanKey{})
}

// planReduceScatter is the ReduceScatter (and ReduceScatterv) planner of algo, but for
// the shared areas' (planReduceShared).
func PlanReduceScatter(algo Algo, sh Shape, t Topology) *Plan {
	return EntryOf(OpReduceScatterv, algo).Plan(sh, t, PlanKey{})
}
