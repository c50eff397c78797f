package coll

// The choice of an algorithm for an operation on a communicator: the registry's
// candidates, weighed by the link model.

import (
	"fmt"
	"github.com/moex-ai/moex/coll/algos"
	"strings"
	"time"
)

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
	cands := Algorithms[op]
	best, bestT := cands[0], time.Duration(1<<62)
	for _, a := range cands {
		// Hier needs several hosts (and for all but AlltoAll(v), as many ranks on each);
		// Shared, the operation within the shared areas.
		if e := algos.Entries[op][a]; e.Usable != nil && !e.Usable(c.topo, fits) {
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
	case op == OpAllReduce:
		return n <= c.direct.Cap() || c.allReducesAcross(n)
	case op == OpReduceScatter:
		return n*c.size <= c.direct.Cap() || c.reduceScattersAcross(n*c.size)
	}
	return false
}

// allReduceAcrossMin is the largest AllReduce buffer that goes through the shared areas
// when the ranks' buffers can be read across and every rank has a CPU: larger ones are
// combined in place in the ranks' buffers (shared.Direct.AllReduceAcross), which copies
// each byte once where the areas copy it in and out and the ring sends it twice.
// Measured (moex bench coll --op allreduce --transport shm, P=2 on 2 CPUs, best of
// three runs): 256 KiB and 1 MiB, 44 and 172 us in place against the ring's 57 and 244
// (the model's choice before), another run 43 and 165 against 157 and 449. Where the
// ranks outnumber the CPUs, the runs disagree (P=4 and 8 on 2 CPUs: either path ahead
// by up to 2x from run to run), and the areas keep what fits them.
const allReduceAcrossMin = 64 << 10

// allReducesAcross reports whether a shared-area AllReduce of n bytes runs in place in
// the ranks' buffers rather than through the areas; reduceScattersAcross, whether a
// ReduceScatter of send buffers of n bytes does (ReduceScatterAcross: those larger than
// the areas; below, the areas were as fast or faster).
func (c *Comm) allReducesAcross(n int) bool {
	if c.direct == nil {
		return false
	}
	lim := c.direct.Cap()
	if !c.crowded {
		lim = min(lim, allReduceAcrossMin)
	}
	return n > lim && c.direct.CanReduceAcross()
}

func (c *Comm) reduceScattersAcross(n int) bool {
	return c.direct != nil && n > c.direct.Cap() && c.direct.CanReduceAcross()
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
	op = algos.FixedOf(op) // n is then a block of average size
	t := c.topo
	if (op == OpAlltoAll || op == OpAlltoAllv) && t.Hosts > 1 {
		return c.estimateAlltoAllHosts(algo, n)
	}
	if algo == Hier && t.Uniform {
		m, h := len(t.Members[0]), len(t.Members)
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
	if op == OpAllReduce && algo == Shared && c.allReducesAcross(n) {
		return l.EstimateAllReduceAcross(c.size, n)
	}
	if op == OpReduceScatter && algo == Shared && c.reduceScattersAcross(n*c.size) {
		return l.EstimateReduceScatterAcross(c.size, n)
	}
	switch op {
	case OpAllReduce, OpAllGather, OpReduceScatter:
		if t.Hosts > 1 {
			l.Beta *= float64(t.Sharing(algo))
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
	p, h := c.size, t.Hosts
	m := 0
	for _, ms := range t.Members {
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
		sec = float64(algos.CeilLog2(p))*msg(net, m) + wire*float64(algos.CeilLog2(p))/2 + 3*float64(p)*fn/20e9
	case Hier:
		relayed := (h - 1) * (m - 1) // blocks a relay hands on
		sec = msg(net, m*(h-1)) + wire + local + msg(intra, m-1+relayed) + float64(relayed)*fn*intra.Beta
	default:
		return time.Duration(1 << 62)
	}
	return time.Duration(sec * 1e9)
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
		if a != AlgoAuto && !algos.Supports(o, a) {
			return nil, &ArgError{Arg: "MOEX_ALGO", Reason: fmt.Sprintf("%v has no algorithm %v (have %v)", o, a, Algorithms[o])}
		}
		m[o] = a
	}
	return m, nil
}
