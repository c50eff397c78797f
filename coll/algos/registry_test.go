package algos

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
	for _, e := range Registry {
		require.NotNil(t, e.Plan, "%v/%v has no planner", e.Op, e.Algo)
		if e.Usable != nil && !e.Usable(NewTopology([]int{0, 0, 1, 1}), true) {
			continue
		}
		k := PlanKey{Op: e.Op, Algo: e.Algo, Dt: 1, Es: 4, Count: 1024}
		pl := e.Plan(Shape{P: 4, Rank: 1, Es: 4, Count: 1024}, NewTopology([]int{0, 0, 1, 1}), k)
		require.NotNil(t, pl, "%v/%v", e.Op, e.Algo)
		assert.Equal(t, e.Algo, pl.Algo, "%v/%v planned another algorithm", e.Op, e.Algo)
		if e.Cost != nil {
			small, big := CostShm.Estimate(e.Op, e.Algo, 4, 1<<10), CostShm.Estimate(e.Op, e.Algo, 4, 1<<20)
			assert.Positive(t, small, "%v/%v", e.Op, e.Algo)
			if e.Op != OpBarrier {
				assert.Greater(t, big, small, "%v/%v", e.Op, e.Algo)
			}
		}
	}
	assert.Zero(t, CostShm.Estimate(OpAllReduce, Linear, 4, 1<<20), "an algorithm the operation lacks has no cost")
}
