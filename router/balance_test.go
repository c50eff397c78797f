package router

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// zipfLoad is the load of e experts whose popularity falls as rank^-s, the ranks
// shuffled with seed, total tokens in all.
func zipfLoad(e int, s float64, total float64, seed uint64) []float64 {
	w := make([]float64, e)
	sum := 0.0
	for i := range w {
		w[i] = math.Pow(float64(i+1), -s)
		sum += w[i]
	}
	rng := rand.New(rand.NewPCG(seed, 1))
	rng.Shuffle(e, func(i, j int) { w[i], w[j] = w[j], w[i] })
	for i := range w {
		w[i] *= total / sum
	}
	return w
}

// rankLoads is each rank's load under pl, each expert's load shared evenly by its replicas.
func rankLoads(pl *Placement, load []float64) []float64 {
	out := make([]float64, pl.Ranks)
	for r, es := range pl.Local {
		for _, e := range es {
			out[r] += load[e] / float64(len(pl.Owners[e]))
		}
	}
	return out
}

func imbalance(loads []float64) float64 {
	mx, sum := 0.0, 0.0
	for _, l := range loads {
		mx = math.Max(mx, l)
		sum += l
	}
	return mx / (sum / float64(len(loads)))
}

// lowerBound is the least max/mean any placement of load into slots on ranks can have:
// the busiest rank carries at least the mean, and at least the largest share of one
// replica that the best replication leaves.
func lowerBound(load []float64, slots, ranks int) float64 {
	count := Replicas(load, slots, ranks)
	total, piece := 0.0, 0.0
	for e, l := range load {
		total += l
		piece = math.Max(piece, l/float64(count[e]))
	}
	mean := total / float64(ranks)
	return math.Max(mean, piece) / mean
}

// checkPlacement asserts what every rebalanced placement must be: each expert held at
// least once and at most once per rank, each rank holding slots/ranks, the maps agreeing.
func checkPlacement(t *testing.T, pl *Placement, experts, ranks, slots int) {
	t.Helper()
	require.Equal(t, Balanced, pl.Kind)
	require.Equal(t, slots, pl.Slots())
	for e, owners := range pl.Owners {
		require.NotEmpty(t, owners, "expert %d lost", e)
		require.True(t, slices.IsSorted(owners))
		require.Len(t, slices.Compact(slices.Clone(owners)), len(owners), "expert %d twice on one rank", e)
	}
	for r, es := range pl.Local {
		require.Len(t, es, slots/ranks, "rank %d", r)
	}
	p2l, l2p := pl.PhysicalToLogical(), pl.LogicalToPhysical()
	require.Len(t, p2l, slots)
	for e, phys := range l2p {
		require.Len(t, phys, len(pl.Owners[e]))
		for _, s := range phys {
			require.Equal(t, e, p2l[s])
		}
	}
	// Physical slot s is on rank s / (slots/ranks).
	for s, e := range p2l {
		r := s / (slots / ranks)
		require.GreaterOrEqual(t, pl.LocalIndex(r, e), 0)
	}
}

func TestRebalanceSkewedLoads(t *testing.T) {
	const e, p = 256, 8
	hosts := []int{0, 0, 0, 0, 1, 1, 1, 1}
	one := make([]float64, 64)
	for i := range one {
		one[i] = 10
	}
	one[17] = 2000
	groups := make([]float64, e) // group 3 of 8 takes most of the load
	for i := range groups {
		groups[i] = 5
		if i/32 == 3 {
			groups[i] = 100 + float64(i%7)
		}
	}
	for _, tc := range []struct {
		name   string
		load   []float64
		slots  int
		b      Balance
		within float64 // of the lower bound
	}{
		{"zipf 1.2 flat", zipfLoad(e, 1.2, 1e6, 1), e + p, Balance{Policy: BalanceFlat}, 1.02},
		{"zipf 1.2 groups on 2 hosts", zipfLoad(e, 1.2, 1e6, 2), e + p, Balance{Hosts: hosts, Groups: 8}, 1.10},
		{"zipf 0.8 flat, 32 spare", zipfLoad(e, 0.8, 1e6, 3), e + 32, Balance{Policy: BalanceFlat}, 1.02},
		{"one hot expert", one, 64 + p, Balance{}, 1.02},
		{"one hot group flat", groups, e + p, Balance{Groups: 8, Policy: BalanceFlat}, 1.02},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ranks := p
			pl, err := Rebalance(tc.load, ranks, Balance{Slots: tc.slots, Hosts: tc.b.Hosts, Groups: tc.b.Groups, Policy: tc.b.Policy})
			require.NoError(t, err)
			checkPlacement(t, pl, len(tc.load), ranks, tc.slots)
			before, err := NewPlacement(Contiguous, len(tc.load), ranks)
			require.NoError(t, err)
			lb := lowerBound(tc.load, tc.slots, ranks)
			got := imbalance(rankLoads(pl, tc.load))
			t.Logf("imbalance %.3f (contiguous %.3f, lower bound %.3f)", got, imbalance(rankLoads(before, tc.load)), lb)
			assert.LessOrEqual(t, got, lb*tc.within)
		})
	}
}

func TestRebalanceHierarchicalKeepsGroupsOnOneHost(t *testing.T) {
	const e, p, g = 64, 8, 8
	hosts := []int{0, 1, 0, 1, 0, 1, 0, 1} // alternating
	load := zipfLoad(e, 1.0, 1e5, 7)
	pl, err := Rebalance(load, p, Balance{Slots: e + 16, Hosts: hosts, Groups: g, Policy: BalanceHierarchical})
	require.NoError(t, err)
	checkPlacement(t, pl, e, p, e+16)
	for grp := 0; grp < g; grp++ {
		host := -1
		for x := grp * e / g; x < (grp+1)*e/g; x++ {
			for _, r := range pl.Owners[x] {
				if host < 0 {
					host = hosts[r]
				}
				require.Equal(t, host, hosts[r], "group %d (expert %d) spans hosts", grp, x)
			}
		}
	}
	// Each host has its share of the slots: half the groups.
	perHost := map[int]int{}
	for r, es := range pl.Local {
		perHost[hosts[r]] += len(es)
	}
	assert.Equal(t, map[int]int{0: (e + 16) / 2, 1: (e + 16) / 2}, perHost)
}

func TestRebalanceDeterministic(t *testing.T) {
	load := zipfLoad(256, 1.2, 1e6, 5)
	load[3], load[9] = load[200], load[200] // ties
	b := Balance{Slots: 288, Hosts: []int{0, 0, 0, 0, 1, 1, 1, 1}, Groups: 8}
	a, err := Rebalance(load, 8, b)
	require.NoError(t, err)
	for range 3 {
		c, err := Rebalance(slices.Clone(load), 8, b)
		require.NoError(t, err)
		require.Equal(t, a.Owners, c.Owners)
		require.Equal(t, a.PhysicalToLogical(), c.PhysicalToLogical())
	}
	// No load at all: every expert once, then the spare slots; still a valid placement.
	z, err := Rebalance(make([]float64, 256), 8, b)
	require.NoError(t, err)
	checkPlacement(t, z, 256, 8, 288)
}

func TestRebalancedPlacementRoutes(t *testing.T) {
	load := zipfLoad(16, 1.5, 1000, 9)
	pl, err := Rebalance(load, 4, Balance{Slots: 20})
	require.NoError(t, err)
	rng := rand.New(rand.NewPCG(3, 3))
	r, err := Route(&Config{Experts: 16, TopK: 4, Gating: SoftmaxTopK}, randLogits(rng, 50, 16), nil)
	require.NoError(t, err)
	for o := 0; o < 4; o++ {
		l, err := BuildLayout(r, pl, o)
		require.NoError(t, err)
		for tok := 0; tok < r.T; tok++ {
			for j := 0; j < r.K; j++ {
				e := int(r.Experts[tok*r.K+j])
				d := pl.RankOf(e, o, tok)
				require.Contains(t, pl.Owners[e], d)
				require.Contains(t, l.Dest[tok], int32(d))
			}
		}
	}
}

func TestRebalanceBadInput(t *testing.T) {
	load := zipfLoad(16, 1, 100, 1)
	nan := slices.Clone(load)
	nan[4] = math.NaN()
	neg := slices.Clone(load)
	neg[2] = -1
	for _, tc := range []struct {
		name  string
		load  []float64
		ranks int
		b     Balance
	}{
		{"no experts", nil, 4, Balance{Slots: 4}},
		{"no ranks", load, 0, Balance{Slots: 16}},
		{"fewer slots than experts", load, 4, Balance{Slots: 12}},
		{"slots not a multiple of ranks", load, 4, Balance{Slots: 18}},
		{"more slots than one per expert per rank", load, 2, Balance{Slots: 34}},
		{"NaN load", nan, 4, Balance{Slots: 16}},
		{"negative load", neg, 4, Balance{Slots: 16}},
		{"hosts of other ranks", load, 4, Balance{Slots: 16, Hosts: []int{0, 1}}},
		{"groups not dividing experts", load, 4, Balance{Slots: 16, Groups: 3}},
		{"hierarchical on unequal hosts", load, 4, Balance{Slots: 16, Hosts: []int{0, 0, 0, 1}, Groups: 4, Policy: BalanceHierarchical}},
		{"hierarchical, groups not a multiple of hosts", load, 4, Balance{Slots: 16, Hosts: []int{0, 0, 1, 1}, Groups: 1, Policy: BalanceHierarchical}},
		{"unknown policy", load, 4, Balance{Slots: 16, Policy: 9}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Rebalance(tc.load, tc.ranks, tc.b)
			require.ErrorIs(t, err, ErrConfig)
		})
	}
}

func TestReplicas(t *testing.T) {
	assert.Equal(t, []int{4, 1, 2, 1}, Replicas([]float64{100, 10, 40, 20}, 8, 8))
	// The limit caps a replica count; the rest go to the next hottest.
	assert.Equal(t, []int{3, 1, 3, 1}, Replicas([]float64{100, 10, 40, 20}, 8, 3))
}

func TestPackTradesRatherThanDoubling(t *testing.T) {
	// The light replica of kind 0 finds the only bin with room holding kind 0 already:
	// it trades places with the item of kind 1.
	bins := pack([]float64{9, 8, 1}, []int{2, 1}, []int{0, 1, 0})
	assert.Equal(t, [][]int{{0, 1}, {2}}, bins)
	// Without kinds the heaviest goes first into the lightest bin with room.
	assert.Equal(t, [][]int{{0, 3}, {1, 2}}, pack([]float64{9, 8, 1, 0.5}, []int{2, 2}, nil))
}

// Moves sends an expert only to ranks that did not hold it, from a rank that did, of
// the same host where one holds it, and spreads one expert's moves over its holders.
func TestMoves(t *testing.T) {
	old := &Placement{Kind: Balanced, Experts: 4, Ranks: 4, Owners: [][]int{{0, 2}, {1}, {2}, {3}}}
	old.index()
	next := &Placement{Kind: Balanced, Experts: 4, Ranks: 4, Owners: [][]int{{0, 1, 3}, {1}, {2}, {3, 0}}}
	next.index()
	moves, err := Moves(old, next, []int{0, 0, 1, 1})
	require.NoError(t, err)
	// Expert 0 to rank 1 (host 0): from rank 0, host 0; to rank 3 (host 1): from rank 2.
	// Expert 3 to rank 0: its only holder, rank 3, of the other host.
	assert.Equal(t, []Move{{Expert: 0, From: 0, To: 1}, {Expert: 0, From: 2, To: 3}, {Expert: 3, From: 3, To: 0}}, moves)

	flat, err := Moves(old, next, nil)
	require.NoError(t, err)
	assert.Equal(t, []Move{{Expert: 0, From: 0, To: 1}, {Expert: 0, From: 2, To: 3}, {Expert: 3, From: 3, To: 0}}, flat,
		"one host: the moves of expert 0 go round its holders")

	none, err := Moves(next, next, nil)
	require.NoError(t, err)
	assert.Empty(t, none, "nothing moves without a change")

	other := &Placement{Kind: Balanced, Experts: 4, Ranks: 2, Owners: [][]int{{0}, {1}, {0}, {1}}}
	other.index()
	_, err = Moves(old, other, nil)
	assert.ErrorIs(t, err, ErrConfig)
	_, err = Moves(old, next, []int{0})
	assert.ErrorIs(t, err, ErrConfig)
}

// Resolve names the policy Rebalance follows.
func TestBalanceResolve(t *testing.T) {
	assert.Equal(t, BalanceFlat, Balance{Slots: 16}.Resolve(12, 4))
	assert.Equal(t, BalanceHierarchical, Balance{Slots: 16, Hosts: []int{0, 0, 1, 1}, Groups: 4}.Resolve(12, 4))
	assert.Equal(t, BalanceFlat, Balance{Slots: 16, Hosts: []int{0, 0, 1, 1}, Groups: 4, Policy: BalanceFlat}.Resolve(12, 4))
	assert.Equal(t, BalanceAuto, Balance{Slots: 16, Hosts: []int{0, 1}}.Resolve(12, 4), "hosts of the wrong length: as given")
}

// Restrict keeps the replicas on the kept ranks, renumbered, and names the experts
// left without one.
func TestRestrict(t *testing.T) {
	pl, err := NewPlacement(Contiguous, 8, 4) // rank r: experts 2r, 2r+1
	require.NoError(t, err)
	require.NoError(t, pl.Replicate([]int{0, 2, 3}, 2)) // 0 on ranks 0, 1; 2 and 3 on 1, 2
	got, lost, err := pl.Restrict([]int{1, 2})
	require.NoError(t, err)
	assert.Nil(t, got)
	assert.Equal(t, []int{1, 6, 7}, lost, "expert 1 lived on rank 0 alone, 6 and 7 on rank 3")

	full, err := NewPlacement(RoundRobin, 8, 4)
	require.NoError(t, err)
	require.NoError(t, full.Replicate([]int{0, 1, 2, 3, 4, 5, 6, 7}, 2))
	got, lost, err = full.Restrict([]int{0, 2, 3})
	require.NoError(t, err)
	require.Nil(t, lost)
	assert.Equal(t, Balanced, got.Kind)
	assert.Equal(t, 3, got.Ranks)
	for e, owners := range full.Owners {
		var kept []int
		for _, r := range owners {
			if i := []int{0, -1, 1, 2}[r]; i >= 0 {
				kept = append(kept, i)
			}
		}
		assert.Equal(t, kept, got.Owners[e], "expert %d", e)
		for _, r := range kept {
			assert.GreaterOrEqual(t, got.LocalIndex(r, e), 0)
		}
	}
	same, lost, err := full.Restrict([]int{0, 1, 2, 3})
	require.NoError(t, err)
	require.Nil(t, lost)
	assert.Equal(t, full.Owners, same.Owners)
	assert.Equal(t, full.Kind, same.Kind)

	for _, keep := range [][]int{nil, {0, 0}, {2, 1}, {4}, {0, 1, 2, 3, 4}} {
		_, _, err := full.Restrict(keep)
		assert.ErrorIs(t, err, ErrConfig, "%v", keep)
	}
}

// movesTo counts the replicas of next on ranks that do not hold the expert in cur.
func movesTo(t *testing.T, cur, next *Placement) int {
	m, err := Moves(cur, next, nil)
	require.NoError(t, err)
	return len(m)
}

// With Prefer, Rebalance balances exactly as well and moves fewer replicas: none when
// the placement in force is already the balanced one (even with its ranks renamed),
// and fewer than without after a change of load or the loss of replicas.
func TestRebalancePrefer(t *testing.T) {
	const e, p = 64, 8
	load := zipfLoad(e, 1.2, 1e5, 3)
	b := Balance{Slots: 80}
	base, err := Rebalance(load, p, b)
	require.NoError(t, err)

	// The same placement with its ranks renamed (rank r becomes 7-r): nothing moves.
	renamed := &Placement{Kind: Balanced, Experts: e, Ranks: p, Owners: make([][]int, e)}
	for x, owners := range base.Owners {
		for _, r := range owners {
			renamed.Owners[x] = append(renamed.Owners[x], p-1-r)
		}
		slices.Sort(renamed.Owners[x])
	}
	renamed.index()
	bp := b
	bp.Prefer = renamed
	same, err := Rebalance(load, p, bp)
	require.NoError(t, err)
	assert.Zero(t, movesTo(t, renamed, same))
	assert.InDelta(t, imbalance(rankLoads(base, load)), imbalance(rankLoads(same, load)), 1e-12)

	// The load shifts: as balanced as without Prefer, with fewer moves.
	shifted := zipfLoad(e, 1.2, 1e5, 4)
	fresh, err := Rebalance(shifted, p, b)
	require.NoError(t, err)
	bp.Prefer = base
	sticky, err := Rebalance(shifted, p, bp)
	require.NoError(t, err)
	assert.InDelta(t, imbalance(rankLoads(fresh, shifted)), imbalance(rankLoads(sticky, shifted)), 1e-9)
	assert.Less(t, movesTo(t, base, sticky), movesTo(t, base, fresh))
	t.Logf("after a shift of load: %d moves preferring the placement in force, %d without", movesTo(t, base, sticky), movesTo(t, base, fresh))

	bad := b
	bad.Prefer = &Placement{Experts: e, Ranks: p - 1}
	_, err = Rebalance(load, p, bad)
	assert.ErrorIs(t, err, ErrConfig)
}
