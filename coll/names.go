package coll

import "github.com/moex-ai/moex/coll/algos"

// The vocabulary of coll's API, whose definitions (and the planners, the cost model and
// the registry that use them) live in package algos, which touches no transport.

// OpKind names a collective operation.
type OpKind = algos.OpKind

// The operations.
const (
	OpBarrier        = algos.OpBarrier
	OpBroadcast      = algos.OpBroadcast
	OpReduce         = algos.OpReduce
	OpAllReduce      = algos.OpAllReduce
	OpReduceScatter  = algos.OpReduceScatter
	OpAllGather      = algos.OpAllGather
	OpAlltoAll       = algos.OpAlltoAll
	OpAlltoAllv      = algos.OpAlltoAllv
	OpScatter        = algos.OpScatter
	OpGather         = algos.OpGather
	OpExchange       = algos.OpExchange
	OpAllGatherv     = algos.OpAllGatherv
	OpReduceScatterv = algos.OpReduceScatterv
	OpGatherv        = algos.OpGatherv
	OpScatterv       = algos.OpScatterv
)

// Algo names an algorithm.
type Algo = algos.Algo

// The algorithms (algos.Algo says what each is).
const (
	AlgoAuto      = algos.AlgoAuto
	Ring          = algos.Ring
	RecDoubling   = algos.RecDoubling
	Rabenseifner  = algos.Rabenseifner
	Binomial      = algos.Binomial
	Linear        = algos.Linear
	Pairwise      = algos.Pairwise
	Bruck         = algos.Bruck
	RecHalving    = algos.RecHalving
	Dissemination = algos.Dissemination
	Hier          = algos.Hier
	Shared        = algos.Shared
)

// ParseOpKind accepts the names OpKind's String returns.
func ParseOpKind(s string) (OpKind, error) { return algos.ParseOpKind(s) }

// ParseAlgo accepts the names Algo's String returns.
func ParseAlgo(s string) (Algo, error) { return algos.ParseAlgo(s) }

// LinkCost is the alpha-beta(-gamma) model of one class of link.
type LinkCost = algos.LinkCost

// The link classes' defaults (algos.CostInproc says how they were measured).
var (
	CostInproc = algos.CostInproc
	CostShm    = algos.CostShm
	CostNet    = algos.CostNet
	CostNVLink = algos.CostNVLink
	CostPCIe   = algos.CostPCIe
)

// CrowdedAlpha multiplies the per-message latency of the default link when the ranks,
// all on one host over shared memory, outnumber its CPUs.
const CrowdedAlpha = algos.CrowdedAlpha

// Algorithms lists, per operation, the algorithms it has (the first is its default).
var Algorithms = algos.Algorithms
