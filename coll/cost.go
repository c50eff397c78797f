package coll

import (
	"fmt"
	"strings"
	"time"
)

// OpKind names a collective operation.
type OpKind uint8

const (
	OpBarrier OpKind = iota + 1
	OpBroadcast
	OpReduce
	OpAllReduce
	OpReduceScatter
	OpAllGather
	OpAlltoAll
	OpAlltoAllv
	OpScatter
	OpGather
	// OpExchange: an AlltoAllv whose block sizes travel with the data (Exchange).
	OpExchange
	// The variable-size forms.
	OpAllGatherv
	OpReduceScatterv
	OpGatherv
	OpScatterv
	opKindEnd
)

var opKindNames = [...]string{"", "barrier", "broadcast", "reduce", "allreduce", "reducescatter",
	"allgather", "alltoall", "alltoallv", "scatter", "gather", "exchange",
	"allgatherv", "reducescatterv", "gatherv", "scatterv"}

// fixedOf is the fixed-size form of a variable-size op (whose algorithms and cost model
// it shares), or op itself.
func fixedOf(op OpKind) OpKind {
	switch op {
	case OpAllGatherv:
		return OpAllGather
	case OpReduceScatterv:
		return OpReduceScatter
	case OpGatherv:
		return OpGather
	case OpScatterv:
		return OpScatter
	}
	return op
}

func (o OpKind) String() string {
	if o > 0 && o < opKindEnd {
		return opKindNames[o]
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// ParseOpKind accepts the names String returns.
func ParseOpKind(s string) (OpKind, error) {
	s = strings.ToLower(strings.ReplaceAll(s, "_", ""))
	for o := OpBarrier; o < opKindEnd; o++ {
		if o.String() == s {
			return o, nil
		}
	}
	return 0, fmt.Errorf("coll: unknown operation %q", s)
}

// Algo names an algorithm.
type Algo uint8

const (
	AlgoAuto Algo = iota
	Ring
	RecDoubling
	Rabenseifner
	Binomial
	Linear
	Pairwise
	Bruck
	RecHalving
	Dissemination
	Hier
	// Shared moves the blocks through the shared-memory areas of the ranks' segments
	// (transport.SharedAreas): one copy in, one flag per rank, one copy out (larger buffers: one
	// copy across). AlltoAll, AllGather, and AlltoAllv planned from the whole count
	// matrix (the MoE dispatch and combine); only when every rank of the communicator
	// is on one host, over shm, and the buffers fit the area or cross-memory attach
	// works.
	Shared
	algoEnd
)

var algoNames = [...]string{"auto", "ring", "recdbl", "rabenseifner", "binomial", "linear",
	"pairwise", "bruck", "rechalving", "dissemination", "hier", "shared"}

func (a Algo) String() string {
	if a < algoEnd {
		return algoNames[a]
	}
	return fmt.Sprintf("algo(%d)", uint8(a))
}

// ParseAlgo accepts the names String returns.
func ParseAlgo(s string) (Algo, error) {
	for a := AlgoAuto; a < algoEnd; a++ {
		if a.String() == strings.ToLower(s) {
			return a, nil
		}
	}
	return 0, fmt.Errorf("coll: unknown algorithm %q", s)
}

// LinkCost is the alpha-beta(-gamma) model of one class of link.
type LinkCost struct {
	Alpha time.Duration // per message
	Beta  float64       // seconds per byte on the wire (1 / bandwidth)
	Gamma float64       // seconds per byte reduced
}

// Link classes, and their defaults, measured on the 2-core development machine with the
// transport benchmarks (inproc: 0.6us ping-pong, ~25 GB/s; tcp loopback: ~16us round
// trip, ~3-5 GB/s; reductions: ~20 GB/s f32 sums). Configure or measure for real links.
//
// Between hosts the network's speed comes from the NIC that carries the traffic (sysfs;
// transport/topo), or MOEX_NET_GBITS / Config.NetGbits. CostNVLink and CostPCIe are the
// classes of GPU memory moved between GPUs of one host (UCX's cuda_ipc over NVLink, or
// through PCIe): set them as Config.HostLink for ranks whose buffers live on GPUs.
var (
	CostInproc = LinkCost{Alpha: 1 * time.Microsecond, Beta: 1 / 20e9, Gamma: 1 / 20e9}
	CostShm    = LinkCost{Alpha: 3 * time.Microsecond, Beta: 1 / 8e9, Gamma: 1 / 20e9}
	CostNet    = LinkCost{Alpha: 15 * time.Microsecond, Beta: 1 / 3e9, Gamma: 1 / 20e9}
	CostNVLink = LinkCost{Alpha: 5 * time.Microsecond, Beta: 1 / 300e9, Gamma: 1 / 1000e9}
	CostPCIe   = LinkCost{Alpha: 8 * time.Microsecond, Beta: 1 / 25e9, Gamma: 1 / 1000e9}
)

// CrowdedAlpha multiplies the per-message latency of the default link when the ranks, all
// on one host over shared memory, outnumber its CPUs: a rank that waits for a peer gives
// up its CPU, and the peer must be switched in before the step completes, so every step
// of an algorithm costs context switches. Measured with moex bench coll over shm on 2
// CPUs (AllReduce, best of 4, alternating): 4 ranks, 64 KiB: shared (2 steps) 50us,
// rabenseifner (4) 62us; 1 MiB: 460 against 1065us; 8 ranks, 64 KiB: 117 against 264us,
// where the model at 3us a message chose the multi-step algorithms.
const CrowdedAlpha = 8

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

// choose picks the algorithm for op: the override if configured, else the cheapest by the
// model (ties go to the first listed).
func (c *Comm) choose(op OpKind, n int) Algo { return c.chooseFit(op, n, c.sharedFits(op, n)) }

// chooseFit is choose, told whether the operation fits the shared areas.
func (c *Comm) chooseFit(op OpKind, n int, fits bool) Algo {
	if a, ok := c.cfg.Algo[op]; ok && a != AlgoAuto {
		if a == Shared && !fits {
			return Algorithms[op][0] // not on one host over shm, or too large for the area
		}
		return a
	}
	algos := Algorithms[op]
	best, bestT := algos[0], time.Duration(1<<62)
	for _, a := range algos {
		// Hier needs several hosts (and for all but AlltoAll(v), as many ranks on each);
		// Shared, the operation within the shared areas.
		if e := entries[op][a]; e.usable != nil && !e.usable(c.topo, fits) {
			continue
		}
		if t := c.estimate(op, a, n); t < bestT {
			best, bestT = a, t
		}
	}
	return best
}

// sharedFits reports whether op on n bytes (per block) can run through the shared areas.
// An AlltoAllv can only when every rank knows the whole count matrix (a VPlan, which
// asks chooseFit itself).
func (c *Comm) sharedFits(op OpKind, n int) bool {
	switch {
	case c.direct == nil:
		return false
	case op == OpAlltoAll:
		return c.direct.Fits(n * c.size)
	case op == OpAllGather, op == OpAllGatherv:
		return c.direct.Fits(n)
	case op == OpAllReduce: // the buffer through the area, never read across
		return n <= c.direct.Cap()
	case op == OpReduceScatter:
		return n*c.size <= c.direct.Cap()
	}
	return false
}

// Algorithm returns the algorithm this communicator runs op with for bytes (AllReduce,
// Broadcast, Reduce: the whole buffer; AllGather, ReduceScatter, AlltoAll: one rank's
// block): the MOEX_ALGO override if there is one, else the cost model's choice.
func (c *Comm) Algorithm(op OpKind, bytes int) Algo { return c.choose(op, bytes) }

// estimate is the model's time for op with algo on this communicator. Ranks on several
// hosts: flat algorithms pay the network for every step, and when several ranks of a
// host send across at once (a ring whose order alternates hosts, the far steps of
// recursive doubling) they share the host's link; the hierarchical algorithms
// (AllReduce, AllGather, ReduceScatter) pay the host-local cost within hosts and the
// network only between them.
func (c *Comm) estimate(op OpKind, algo Algo, n int) time.Duration {
	op = fixedOf(op) // n is then a block of average size
	t := c.topo
	if (op == OpAlltoAll || op == OpAlltoAllv) && t.hosts > 1 {
		return c.estimateAlltoAllHosts(algo, n)
	}
	if algo == Hier && t.uniform {
		m, h := len(t.members[0]), len(t.members)
		net := c.link
		net.Beta *= float64(m) // a host's m ranks cross at once
		switch op {
		case OpAllGather, OpReduceScatter:
			// n is one rank's block: H blocks per message within the host, one across.
			grp := c.intra
			grp.Alpha *= time.Duration(h) // a message per block of the group
			return grp.Estimate(op, Ring, m, h*n) + net.Estimate(op, Ring, h, n)
		}
		chunk := n / m
		return c.intra.Estimate(OpReduceScatter, Ring, m, chunk) + net.Estimate(OpAllReduce, Ring, h, chunk) +
			c.intra.Estimate(OpAllGather, Ring, m, chunk)
	}
	l := c.link
	switch op {
	case OpAllReduce, OpAllGather, OpReduceScatter:
		if t.hosts > 1 {
			l.Beta *= float64(t.sharing(algo))
		}
	}
	return l.Estimate(op, algo, c.size, n)
}

// MessageShare is the part of a link's latency (Alpha) that every message on it costs
// apart from the others, when many are in flight at once: framing, system calls, the
// receiver's wake-ups. It makes the cost model count messages per link.
const MessageShare = 0.25

// estimateAlltoAllHosts is the model of an AlltoAll(v) of n-byte blocks on ranks that
// span hosts. Every host's link carries the blocks its m ranks send to the P-m ranks
// elsewhere, whatever the algorithm; the algorithms differ in how many messages carry
// them: flat, a message per block (m(P-m) on the link; Bruck's log2(P) rounds, each of
// a message per rank); two-level (Hier), one per rank and remote host (m(H-1)), then the
// relays hand each rank of their host its blocks over the host's transport.
func (c *Comm) estimateAlltoAllHosts(algo Algo, n int) time.Duration {
	t := c.topo
	p, h := c.size, t.hosts
	m := 0
	for _, ms := range t.members {
		m = max(m, len(ms))
	}
	net, intra := c.link, c.intra
	msg := func(l LinkCost, k int) float64 { return l.Alpha.Seconds() * (1 + MessageShare*float64(max(k-1, 0))) }
	fn := float64(n)
	wire := float64(m*(p-m)) * fn * net.Beta // the blocks on a host's link
	local := float64(m-1) * fn * intra.Beta  // to the ranks of this host, directly
	var sec float64
	switch algo {
	case Linear:
		sec = msg(net, m*(p-m)) + wire + local
	case Pairwise:
		sec = float64(p-1)*net.Alpha.Seconds() + wire + local
	case Bruck:
		sec = float64(ceilLog2(p))*msg(net, m) + wire*float64(ceilLog2(p))/2 + 3*float64(p)*fn/20e9
	case Hier:
		relayed := (h - 1) * (m - 1) // blocks a relay hands on
		sec = msg(net, m*(h-1)) + wire + local + msg(intra, m-1+relayed) + float64(relayed)*fn*intra.Beta
	default:
		return time.Duration(1 << 62)
	}
	return time.Duration(sec * 1e9)
}

// topology is how a communicator's ranks sit on hosts.
type topology struct {
	hosts   int
	members [][]int // per host (ordered by its lowest rank): its comm ranks, ascending
	hostOf  []int   // comm rank -> index into members
	local   []int   // comm rank -> index within its host's members
	uniform bool    // two hosts or more, each with the same number of ranks (two or more)
	// How many ranks of one host send to other hosts at once in a flat ring and in
	// recursive doubling/halving (at most; at least 1): they share the host's link.
	ringShare, xorShare int
}

func newTopology(hosts []int) topology {
	t := topology{hostOf: make([]int, len(hosts)), local: make([]int, len(hosts))}
	idx := map[int]int{}
	for r, h := range hosts {
		i, ok := idx[h]
		if !ok {
			i = len(t.members)
			idx[h] = i
			t.members = append(t.members, nil)
		}
		t.hostOf[r], t.local[r] = i, len(t.members[i])
		t.members[i] = append(t.members[i], r)
	}
	t.hosts = len(t.members)
	t.uniform = t.hosts > 1 && len(t.members[0]) > 1
	for _, ms := range t.members {
		t.uniform = t.uniform && len(ms) == len(t.members[0])
	}
	p := len(hosts)
	count := func(peer func(r int) int) int {
		most := 1
		per := make([]int, t.hosts)
		for r := 0; r < p; r++ {
			if q := peer(r); q >= 0 && q < p && t.hostOf[q] != t.hostOf[r] {
				per[t.hostOf[r]]++
			}
		}
		for _, n := range per {
			most = max(most, n)
		}
		return most
	}
	t.ringShare = count(func(r int) int { return (r + 1) % p })
	t.xorShare = 1
	for mask := 1; mask < p; mask <<= 1 {
		t.xorShare = max(t.xorShare, count(func(r int) int { return r ^ mask }))
	}
	return t
}

// sharing is how many ranks of one host send to other hosts in the same step of a flat
// AllReduce, AllGather or ReduceScatter with algo (recursive doubling and halving, and
// Bruck's doubling distances, counted as partners r^mask).
func (t topology) sharing(algo Algo) int {
	if algo == Ring {
		return t.ringShare
	}
	return t.xorShare
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
