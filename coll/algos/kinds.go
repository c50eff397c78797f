package algos

// Operation kinds, algorithm names and the host topology: the vocabulary that the
// planners, the cost model and the executor share.

import (
	"fmt"
	"strings"

	hostgroups "github.com/moex-ai/moex/internal/hosts"
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
	OpKindEnd
)

var opKindNames = [...]string{"", "barrier", "broadcast", "reduce", "allreduce", "reducescatter",
	"allgather", "alltoall", "alltoallv", "scatter", "gather", "exchange",
	"allgatherv", "reducescatterv", "gatherv", "scatterv"}

// fixedOf is the fixed-size form of a variable-size op (whose algorithms and cost model
// it shares), or op itself.
func FixedOf(op OpKind) OpKind {
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
	if o > 0 && o < OpKindEnd {
		return opKindNames[o]
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// ParseOpKind accepts the names String returns.
func ParseOpKind(s string) (OpKind, error) {
	s = strings.ToLower(strings.ReplaceAll(s, "_", ""))
	for o := OpBarrier; o < OpKindEnd; o++ {
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
	// (package coll/shared over transport.Areas): one copy in, one flag per rank, one copy out (larger buffers: one
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

// topology is how a communicator's ranks sit on hosts.
type Topology struct {
	Hosts   int
	Members [][]int // per host (ordered by its lowest rank): its comm ranks, ascending
	HostOf  []int   // comm rank -> index into members
	local   []int   // comm rank -> index within its host's members
	Uniform bool    // two hosts or more, each with the same number of ranks (two or more)
	// How many ranks of one host send to other hosts at once in a flat ring and in
	// recursive doubling/halving (at most; at least 1): they share the host's link.
	ringShare, xorShare int
}

func NewTopology(hosts []int) Topology {
	var t Topology
	t.HostOf, t.local, t.Members = hostgroups.Group(hosts)
	t.Hosts = len(t.Members)
	t.Uniform = t.Hosts > 1 && len(t.Members[0]) > 1
	for _, ms := range t.Members {
		t.Uniform = t.Uniform && len(ms) == len(t.Members[0])
	}
	p := len(hosts)
	count := func(peer func(r int) int) int {
		most := 1
		per := make([]int, t.Hosts)
		for r := 0; r < p; r++ {
			if q := peer(r); q >= 0 && q < p && t.HostOf[q] != t.HostOf[r] {
				per[t.HostOf[r]]++
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
func (t Topology) Sharing(algo Algo) int {
	if algo == Ring {
		return t.ringShare
	}
	return t.xorShare
}
