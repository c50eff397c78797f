package coll

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The registry gives every operation its algorithms in the order ties break (the first
// is the default), and the variable-size forms their fixed forms' (less the shared area
// for ReduceScatterv, whose blocks differ in size).
func TestRegistryAlgorithms(t *testing.T) {
	want := map[OpKind][]Algo{
		OpBarrier:        {Dissemination},
		OpBroadcast:      {Binomial, Linear},
		OpReduce:         {Binomial, Linear},
		OpAllReduce:      {Ring, RecDoubling, Rabenseifner, Hier, Shared},
		OpReduceScatter:  {Ring, RecHalving, Hier, Shared},
		OpAllGather:      {Ring, RecDoubling, Bruck, Hier, Shared},
		OpAlltoAll:       {Linear, Pairwise, Bruck, Hier, Shared},
		OpAlltoAllv:      {Linear, Pairwise, Bruck, Hier, Shared},
		OpScatter:        {Linear},
		OpGather:         {Linear},
		OpAllGatherv:     {Ring, RecDoubling, Bruck, Hier, Shared},
		OpReduceScatterv: {Ring, RecHalving, Hier},
		OpGatherv:        {Linear},
		OpScatterv:       {Linear},
	}
	assert.Equal(t, want, Algorithms)
}

// Every entry plans a schedule of its own algorithm, and every entry with a cost gives a
// positive time that grows with the bytes.
func TestRegistryEntries(t *testing.T) {
	for _, e := range registry {
		require.NotNil(t, e.plan, "%v/%v has no planner", e.op, e.algo)
		if e.usable != nil && !e.usable(newTopology([]int{0, 0, 1, 1}), true) {
			continue
		}
		k := planKey{op: e.op, algo: e.algo, dt: 1, es: 4, count: 1024}
		pl := e.plan(shape{p: 4, rank: 1, es: 4, count: 1024}, newTopology([]int{0, 0, 1, 1}), k)
		require.NotNil(t, pl, "%v/%v", e.op, e.algo)
		assert.Equal(t, e.algo, pl.algo, "%v/%v planned another algorithm", e.op, e.algo)
		if e.cost != nil {
			small, big := CostShm.Estimate(e.op, e.algo, 4, 1<<10), CostShm.Estimate(e.op, e.algo, 4, 1<<20)
			assert.Positive(t, small, "%v/%v", e.op, e.algo)
			if e.op != OpBarrier {
				assert.Greater(t, big, small, "%v/%v", e.op, e.algo)
			}
		}
	}
	assert.Zero(t, CostShm.Estimate(OpAllReduce, Linear, 4, 1<<20), "an algorithm the operation lacks has no cost")
}
