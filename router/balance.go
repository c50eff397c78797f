package router

import (
	"cmp"
	"fmt"
	"math"
	"slices"
)

// BalancePolicy selects how Rebalance spreads the load.
type BalancePolicy int

const (
	// BalanceAuto is hierarchical when the ranks span several hosts of equal size and the
	// groups divide among them, flat otherwise.
	BalanceAuto BalancePolicy = iota
	// BalanceFlat replicates the hottest experts and packs the replicas onto all ranks
	// as one pool, hosts aside.
	BalanceFlat
	// BalanceHierarchical follows DeepSeek EPLB's rule for ranks on several hosts: it
	// packs the expert groups onto the hosts (balancing the groups' load), replicates the
	// hottest experts of each host within that host, and packs the replicas onto the
	// host's ranks. A token then crosses to one host for all the experts of a group.
	BalanceHierarchical
)

func (p BalancePolicy) String() string {
	switch p {
	case BalanceAuto:
		return "auto"
	case BalanceFlat:
		return "flat"
	case BalanceHierarchical:
		return "hierarchical"
	}
	return fmt.Sprintf("policy(%d)", int(p))
}

// Balance says what Rebalance may use.
type Balance struct {
	// Slots is the number of physical experts: every logical expert once plus the
	// redundant ones, a multiple of the number of ranks (each rank holds Slots/Ranks).
	Slots int
	// Hosts is each rank's host (len: ranks); nil: one host.
	Hosts []int
	// Groups is the number of expert groups (DeepSeek-V3's n_group, experts in blocks of
	// Experts/Groups); 0 or 1: no groups. Used by the hierarchical policy only.
	Groups int
	Policy BalancePolicy
	// Prefer is the placement in force (over the same experts and ranks), or nil.
	// Among placements that balance the load equally well, Rebalance then keeps the
	// most replicas where Prefer has them, so that fewer weights move.
	Prefer *Placement
}

// Rebalance places len(load) logical experts on len(b.Hosts) ranks (or ranks, when
// b.Hosts is nil) in b.Slots physical slots so that the load of the busiest rank is as
// close to the mean as the slots allow. load[e] is expert e's measured load (tokens
// routed to it over a window, say); it must be finite and non-negative.
//
// Every logical expert keeps at least one slot; the redundant slots go, one at a time,
// to the expert whose replicas carry the most load each; no rank holds two replicas of
// one expert. The replicas of an expert are assumed to share its load evenly, which
// the Placement's replica rule does for tokens spread evenly over the origin ranks. The
// result is a function of its inputs alone (ties go to the lower index), so every rank
// computes the same placement from the same load.
func Rebalance(load []float64, ranks int, b Balance) (*Placement, error) {
	e := len(load)
	switch {
	case e < 1 || e > MaxExperts:
		return nil, fmt.Errorf("%w: rebalance of %d experts (want 1..%d)", ErrConfig, e, MaxExperts)
	case ranks < 1 || ranks > MaxRanks:
		return nil, fmt.Errorf("%w: rebalance onto %d ranks (want 1..%d)", ErrConfig, ranks, MaxRanks)
	case b.Slots < e || b.Slots%ranks != 0:
		return nil, fmt.Errorf("%w: %d slots for %d experts on %d ranks (want at least one per expert, a multiple of the ranks)", ErrConfig, b.Slots, e, ranks)
	case b.Slots > e*ranks:
		return nil, fmt.Errorf("%w: %d slots for %d experts on %d ranks (at most one replica of an expert per rank)", ErrConfig, b.Slots, e, ranks)
	case b.Hosts != nil && len(b.Hosts) != ranks:
		return nil, fmt.Errorf("%w: hosts of %d ranks for %d ranks", ErrConfig, len(b.Hosts), ranks)
	case b.Groups < 0 || b.Groups > 1 && e%b.Groups != 0:
		return nil, fmt.Errorf("%w: %d groups of %d experts", ErrConfig, b.Groups, e)
	case b.Prefer != nil && (b.Prefer.Experts != e || b.Prefer.Ranks != ranks):
		return nil, fmt.Errorf("%w: preferring a placement of %d experts on %d ranks for %d on %d", ErrConfig, b.Prefer.Experts, b.Prefer.Ranks, e, ranks)
	}
	for x, l := range load {
		if !(l >= 0) || math.IsInf(l, 0) {
			return nil, fmt.Errorf("%w: load %v of expert %d (want finite, non-negative)", ErrConfig, l, x)
		}
	}
	hosts := hostRanks(b.Hosts, ranks)
	hier, err := b.hierarchical(hosts, e)
	if err != nil {
		return nil, err
	}
	perRank := b.Slots / ranks
	owners := make([][]int, e)
	if !hier {
		all := make([]int, ranks)
		for r := range all {
			all[r] = r
		}
		pool := make([]int, e)
		for x := range pool {
			pool[x] = x
		}
		placePool(owners, load, pool, all, perRank, b.Prefer)
	} else {
		// Groups onto hosts, each host taking as many groups as its share of slots.
		g := max(b.Groups, 1)
		size := e / g
		gload := make([]float64, g)
		for x, l := range load {
			gload[x/size] += l
		}
		cnt := make([]int, len(hosts))
		for i := range cnt {
			cnt[i] = g / len(hosts)
		}
		for h, groups := range pack(gload, cnt, nil) {
			var pool []int
			for _, gi := range groups {
				for x := gi * size; x < (gi+1)*size; x++ {
					pool = append(pool, x)
				}
			}
			placePool(owners, load, pool, hosts[h], perRank, b.Prefer)
		}
	}
	pl := &Placement{Kind: Balanced, Experts: e, Ranks: ranks, Owners: owners}
	pl.index()
	return pl, nil
}

// Resolve is the policy Rebalance follows for experts experts on ranks ranks:
// BalanceFlat or BalanceHierarchical (BalanceAuto resolved), or b.Policy itself where
// Rebalance would refuse it.
func (b Balance) Resolve(experts, ranks int) BalancePolicy {
	if b.Hosts != nil && len(b.Hosts) != ranks {
		return b.Policy
	}
	hier, err := b.hierarchical(hostRanks(b.Hosts, ranks), experts)
	switch {
	case err != nil:
		return b.Policy
	case hier:
		return BalanceHierarchical
	}
	return BalanceFlat
}

// hierarchical reports whether b's policy, on these hosts, is the hierarchical one.
func (b Balance) hierarchical(hosts [][]int, e int) (bool, error) {
	g := max(b.Groups, 1)
	fits := len(hosts) > 1 && g%len(hosts) == 0
	for _, h := range hosts {
		fits = fits && len(h) == len(hosts[0])
	}
	switch b.Policy {
	case BalanceAuto:
		return fits && b.fitsHosts(hosts, e), nil
	case BalanceFlat:
		return false, nil
	case BalanceHierarchical:
		if len(hosts) > 1 && !fits {
			return false, fmt.Errorf("%w: hierarchical balance of %d groups onto %d hosts (want hosts of equal size, groups a multiple of the hosts)", ErrConfig, g, len(hosts))
		}
		if len(hosts) > 1 && !b.fitsHosts(hosts, e) {
			return false, fmt.Errorf("%w: %d slots on %d hosts of %d ranks for %d experts (want %d..%d per host)", ErrConfig, b.Slots, len(hosts), len(hosts[0]), e, e/len(hosts), e/len(hosts)*len(hosts[0]))
		}
		return len(hosts) > 1, nil
	}
	return false, fmt.Errorf("%w: balance policy %v", ErrConfig, b.Policy)
}

// fitsHosts reports whether each host's share of the slots holds every expert of its
// groups once and no expert twice on one rank.
func (b Balance) fitsHosts(hosts [][]int, e int) bool {
	per, experts := b.Slots/len(hosts), e/len(hosts)
	return b.Slots%len(hosts) == 0 && per >= experts && per <= experts*len(hosts[0])
}

// hostRanks groups the ranks by host, hosts in order of their first rank.
func hostRanks(hostOf []int, ranks int) [][]int {
	if hostOf == nil {
		all := make([]int, ranks)
		for r := range all {
			all[r] = r
		}
		return [][]int{all}
	}
	idx := map[int]int{}
	var hosts [][]int
	for r, h := range hostOf {
		i, ok := idx[h]
		if !ok {
			i = len(hosts)
			idx[h] = i
			hosts = append(hosts, nil)
		}
		hosts[i] = append(hosts[i], r)
	}
	return hosts
}

// placePool replicates the experts of pool into len(ranks)*perRank slots and packs the
// replicas onto ranks, filling owners; with prefer, as many replicas as the balance
// allows stay on the ranks that hold them under prefer.
func placePool(owners [][]int, load []float64, pool, ranks []int, perRank int, prefer *Placement) {
	count := Replicas(sub(load, pool), len(ranks)*perRank, len(ranks))
	var w []float64
	var ex []int
	for i, x := range pool {
		for range count[i] {
			w = append(w, load[x]/float64(count[i]))
			ex = append(ex, x)
		}
	}
	cnt := make([]int, len(ranks))
	for i := range cnt {
		cnt[i] = perRank
	}
	bins := pack(w, cnt, ex)
	rankOf := make([]int, len(bins)) // bin -> rank
	for b := range rankOf {
		rankOf[b] = ranks[b]
	}
	if prefer != nil {
		rankOf = keepInPlace(bins, w, ex, ranks, prefer)
	}
	for b, got := range bins {
		for _, i := range got {
			owners[ex[i]] = append(owners[ex[i]], rankOf[b])
		}
	}
	for _, x := range pool {
		slices.Sort(owners[x])
	}
}

// keepInPlace makes the packed bins keep as many items on the ranks prefer puts their
// experts (ex) on as it can without making the fullest bin heavier: it gives each bin
// the rank whose experts it shares most (every bin holds as many items, so any
// assignment of bins to ranks is as balanced), then swaps items of two bins where that
// keeps more in place, no bin grows past the heaviest and no bin holds an expert twice.
// It returns each bin's rank.
func keepInPlace(bins [][]int, w []float64, ex []int, ranks []int, prefer *Placement) []int {
	n := len(bins)
	score := make([][]int, n) // [bin][rank index]: items of the bin whose expert the rank holds
	for b, items := range bins {
		score[b] = make([]int, n)
		for _, i := range items {
			for ri, r := range ranks {
				if prefer.LocalIndex(r, ex[i]) >= 0 {
					score[b][ri]++
				}
			}
		}
	}
	rankOf := make([]int, n)
	binDone, rankDone := make([]bool, n), make([]bool, n)
	for range n {
		bb, br := -1, -1
		for b := 0; b < n; b++ {
			for ri := 0; ri < n; ri++ {
				if !binDone[b] && !rankDone[ri] && (bb < 0 || score[b][ri] > score[bb][br]) {
					bb, br = b, ri
				}
			}
		}
		binDone[bb], rankDone[br] = true, true
		rankOf[bb] = ranks[br]
	}
	sum := make([]float64, n)
	top := 0.0
	for b, items := range bins {
		for _, i := range items {
			sum[b] += w[i]
		}
		top = max(top, sum[b])
	}
	top *= 1 + 1e-9
	kept := func(i, b int) int {
		if prefer.LocalIndex(rankOf[b], ex[i]) >= 0 {
			return 1
		}
		return 0
	}
	holds := func(b, e, except int) bool {
		for _, k := range bins[b] {
			if k != except && ex[k] == e {
				return true
			}
		}
		return false
	}
	for improved := true; improved; {
		improved = false
		for a := range bins {
			for ia := 0; ia < len(bins[a]); ia++ {
				i := bins[a][ia]
				if kept(i, a) == 1 {
					continue
				}
			search:
				for b := range bins {
					if b == a || kept(i, b) == 0 || holds(b, ex[i], -1) {
						continue
					}
					for ib, j := range bins[b] {
						gain := 1 + kept(j, a) - kept(j, b)
						if gain <= 0 || holds(a, ex[j], i) || sum[a]-w[i]+w[j] > top || sum[b]-w[j]+w[i] > top {
							continue
						}
						bins[a][ia], bins[b][ib] = j, i
						sum[a] += w[j] - w[i]
						sum[b] += w[i] - w[j]
						improved = true
						break search
					}
				}
			}
		}
	}
	return rankOf
}

func sub(load []float64, idx []int) []float64 {
	s := make([]float64, len(idx))
	for i, x := range idx {
		s[i] = load[x]
	}
	return s
}

// Replicas gives each of len(load) experts a replica count, at least 1 and at most
// limit, summing to slots (at most len(load)*limit), so that the largest load per
// replica is as small as it can be: each slot past the first of every expert goes to
// the expert whose replicas carry the most each (ties to the lower index).
func Replicas(load []float64, slots, limit int) []int {
	count := make([]int, len(load))
	for i := range count {
		count[i] = 1
	}
	for s := len(load); s < slots; s++ {
		best := -1
		for i, l := range load {
			if count[i] >= limit {
				continue
			}
			if best < 0 || l*float64(count[best]) > load[best]*float64(count[i]) {
				best = i
			}
		}
		if best < 0 {
			break
		}
		count[best]++
	}
	return count
}

// pack puts items of weight w into len(cnt) bins, bin b taking exactly cnt[b] items
// (the counts sum to len(w)), heaviest item first into the lightest bin with room
// (ties to the lower index). With kind non-nil, no bin takes two items of one kind;
// where that leaves no bin for an item, it trades places with an item of another bin.
// It returns each bin's item indices.
func pack(w []float64, cnt []int, kind []int) [][]int {
	order := make([]int, len(w))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(w[b], w[a]) })
	bins := make([][]int, len(cnt))
	sum := make([]float64, len(cnt))
	has := func(b, k int) bool {
		if kind == nil {
			return false
		}
		for _, i := range bins[b] {
			if kind[i] == k {
				return true
			}
		}
		return false
	}
	kindOf := func(i int) int {
		if kind == nil {
			return -1
		}
		return kind[i]
	}
	for _, i := range order {
		best := -1
		for b := range bins {
			if len(bins[b]) < cnt[b] && !has(b, kindOf(i)) && (best < 0 || sum[b] < sum[best]) {
				best = b
			}
		}
		if best < 0 {
			// Every bin with room holds this kind: move an item j of another kind from
			// a bin q without this kind into a bin r with room that lacks j's kind,
			// and put i in its place.
			best = trade(bins, cnt, kindOf, has, i, sum, w)
		}
		bins[best] = append(bins[best], i)
		sum[best] += w[i]
	}
	return bins
}

func trade(bins [][]int, cnt []int, kindOf func(int) int, has func(int, int) bool, i int, sum, w []float64) int {
	for r := range bins {
		if len(bins[r]) >= cnt[r] {
			continue
		}
		for q := range bins {
			if q == r || has(q, kindOf(i)) {
				continue
			}
			for n, j := range bins[q] {
				if has(r, kindOf(j)) {
					continue
				}
				bins[q] = append(bins[q][:n], bins[q][n+1:]...)
				sum[q] -= w[j]
				bins[r] = append(bins[r], j)
				sum[r] += w[j]
				return q
			}
		}
	}
	// Unreachable while no kind has more items than there are bins.
	panic("router: no bin for a replica")
}

// Move is one expert's weights going from a rank that holds them to one that will.
type Move struct {
	Expert, From, To int // the expert, and the ranks its weights go from and to
}

// Moves plans the weight transfers for a change of placement from old to next: for
// every expert that next puts on a rank which old did not, one move from a rank that
// holds it under old, preferring a rank of the same host (hosts: each rank's host; nil:
// one host), then spreading the moves of one expert over its old holders. Experts a
// rank keeps do not move. The plan is a function of its inputs, the same on every rank,
// in order of expert, then destination.
func Moves(old, next *Placement, hosts []int) ([]Move, error) {
	switch {
	case old.Experts != next.Experts || old.Ranks != next.Ranks:
		return nil, fmt.Errorf("%w: moving %d experts on %d ranks to %d on %d", ErrConfig, old.Experts, old.Ranks, next.Experts, next.Ranks)
	case hosts != nil && len(hosts) != old.Ranks:
		return nil, fmt.Errorf("%w: hosts of %d ranks for %d ranks", ErrConfig, len(hosts), old.Ranks)
	}
	var moves []Move
	for e, to := range next.Owners {
		from := old.Owners[e]
		n := 0
		for _, r := range to {
			if old.LocalIndex(r, e) >= 0 {
				continue
			}
			src := from[(e+n)%len(from)]
			if hosts != nil && hosts[src] != hosts[r] {
				for k := range from {
					if q := from[(e+n+k)%len(from)]; hosts[q] == hosts[r] {
						src = q
						break
					}
				}
			}
			moves = append(moves, Move{Expert: e, From: src, To: r})
			n++
		}
	}
	return moves, nil
}
