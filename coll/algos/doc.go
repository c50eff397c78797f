// Package algos holds the collective algorithms of package coll as pure planners: each
// turns (operation, algorithm, ranks, rank, sizes, root, the ranks' hosts) into one rank's
// schedule of steps (the transfers posted together, and the copies and reductions around
// them), which coll's executor runs on a transport. Beside them are the vocabulary they
// share (OpKind, Algo, the hosts' topology), the alpha-beta cost model of each algorithm
// (LinkCost.Estimate) and the registry that lists, per operation, its algorithms, their
// planners, costs and the topologies they run on.
//
// Nothing here touches a transport, a goroutine or the clock: plans are tested without
// processes, cached, and printed by moex flow.
package algos
