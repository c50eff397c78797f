package router

import (
	"fmt"
	"slices"
	"sort"
)

// PlacementKind names a placement scheme.
type PlacementKind int

const (
	// Contiguous: rank r holds experts [r*E/P, (r+1)*E/P) (the usual EP layout).
	Contiguous PlacementKind = iota + 1
	// RoundRobin: expert e lives on rank e mod P.
	RoundRobin
	// Balanced: made by Rebalance from measured load, with replicas of the hot experts,
	// or what Restrict leaves of a placement.
	Balanced
)

func (k PlacementKind) String() string {
	switch k {
	case Contiguous:
		return "contiguous"
	case RoundRobin:
		return "round-robin"
	case Balanced:
		return "balanced"
	}
	return fmt.Sprintf("placement(%d)", int(k))
}

// Placement says which ranks hold which experts. An expert may have several replicas (hot
// experts); every replica holds the same weights.
//
// Replica rule: a token of origin rank o with index t (on that rank) that goes to expert e
// uses the replica on o itself if there is one (no wire at all), and otherwise replica
// number (o + t) mod replicas, in the order of Owners[e] (ranks ascending), which spreads
// the hot expert's tokens evenly and deterministically.
type Placement struct {
	Kind    PlacementKind // how it was made
	Experts int           // experts placed
	Ranks   int           // ranks they are placed on
	Owners  [][]int       // expert -> ranks holding it, ascending
	Local   [][]int       // rank -> experts it holds, in local order (ascending)
	local   []int32       // [rank*Experts+expert]: local index, -1 where not held
}

// Bounds of a placement.
const (
	MaxExperts = 1 << 16
	MaxRanks   = 1 << 14
)

// NewPlacement places e experts on p ranks.
func NewPlacement(kind PlacementKind, e, p int) (*Placement, error) {
	if e < 1 || p < 1 || e > MaxExperts || p > MaxRanks {
		return nil, fmt.Errorf("%w: %d experts on %d ranks (at most %d experts, %d ranks)", ErrConfig, e, p, MaxExperts, MaxRanks)
	}
	pl := &Placement{Kind: kind, Experts: e, Ranks: p, Owners: make([][]int, e)}
	for x := 0; x < e; x++ {
		var r int
		switch kind {
		case Contiguous:
			// Even split: the first e%p ranks take one more.
			q, rem := e/p, e%p
			if x < rem*(q+1) {
				r = x / (q + 1)
			} else {
				r = rem + (x-rem*(q+1))/max(q, 1)
			}
		case RoundRobin:
			r = x % p
		default:
			return nil, fmt.Errorf("%w: unknown placement %v", ErrConfig, kind)
		}
		pl.Owners[x] = []int{r}
	}
	pl.index()
	return pl, nil
}

// PlacementOf makes a placement (of kind Balanced) from each expert's ranks: every expert
// on at least one rank, no rank twice.
func PlacementOf(experts, ranks int, owners [][]int) (*Placement, error) {
	if experts < 1 || ranks < 1 || experts > MaxExperts || ranks > MaxRanks || len(owners) != experts {
		return nil, fmt.Errorf("%w: %d owner lists for %d experts on %d ranks", ErrConfig, len(owners), experts, ranks)
	}
	pl := &Placement{Kind: Balanced, Experts: experts, Ranks: ranks, Owners: make([][]int, experts)}
	for e, rs := range owners {
		if len(rs) == 0 {
			return nil, fmt.Errorf("%w: expert %d on no rank", ErrConfig, e)
		}
		pl.Owners[e] = slices.Clone(rs)
		slices.Sort(pl.Owners[e])
		for i, r := range pl.Owners[e] {
			if r < 0 || r >= ranks || (i > 0 && r == pl.Owners[e][i-1]) {
				return nil, fmt.Errorf("%w: expert %d on ranks %v of %d", ErrConfig, e, rs, ranks)
			}
		}
	}
	pl.index()
	return pl, nil
}

// Replicate adds replicas of the hot experts so that each has `replicas` copies, on the
// ranks that follow its owner (mod P).
func (pl *Placement) Replicate(hot []int, replicas int) error {
	if replicas < 1 || replicas > pl.Ranks {
		return fmt.Errorf("%w: %d replicas on %d ranks", ErrConfig, replicas, pl.Ranks)
	}
	for _, e := range hot {
		if e < 0 || e >= pl.Experts {
			return fmt.Errorf("%w: hot expert %d of %d", ErrConfig, e, pl.Experts)
		}
		base := pl.Owners[e][0]
		set := map[int]bool{}
		for _, r := range pl.Owners[e] {
			set[r] = true
		}
		for k := 1; len(set) < replicas; k++ {
			set[(base+k)%pl.Ranks] = true
		}
		pl.Owners[e] = pl.Owners[e][:0]
		for r := range set {
			pl.Owners[e] = append(pl.Owners[e], r)
		}
		sort.Ints(pl.Owners[e])
	}
	pl.index()
	return nil
}

func (pl *Placement) index() {
	pl.Local = make([][]int, pl.Ranks)
	for e, owners := range pl.Owners {
		for _, r := range owners {
			pl.Local[r] = append(pl.Local[r], e)
		}
	}
	pl.local = make([]int32, pl.Ranks*pl.Experts)
	for i := range pl.local {
		pl.local[i] = -1
	}
	for r, es := range pl.Local {
		for i, e := range es {
			pl.local[r*pl.Experts+e] = int32(i)
		}
	}
}

// Restrict is pl on the ranks in keep (ascending ranks of pl; rank i of the result is
// keep[i]): every expert keeps its replicas on those ranks, the others go. The
// experts left with no replica are returned in lost (ascending); the placement is
// nil then. The result is of kind Balanced, unless keep is every rank.
func (pl *Placement) Restrict(keep []int) (res *Placement, lost []int, err error) {
	if len(keep) == 0 || len(keep) > pl.Ranks {
		return nil, nil, fmt.Errorf("%w: keeping %d of %d ranks", ErrConfig, len(keep), pl.Ranks)
	}
	index := make([]int, pl.Ranks)
	for i := range index {
		index[i] = -1
	}
	for i, r := range keep {
		if r < 0 || r >= pl.Ranks || (i > 0 && r <= keep[i-1]) {
			return nil, nil, fmt.Errorf("%w: ranks to keep %v (want ascending ranks of %d)", ErrConfig, keep, pl.Ranks)
		}
		index[r] = i
	}
	res = &Placement{Kind: Balanced, Experts: pl.Experts, Ranks: len(keep), Owners: make([][]int, pl.Experts)}
	if len(keep) == pl.Ranks {
		res.Kind = pl.Kind
	}
	for e, owners := range pl.Owners {
		for _, r := range owners {
			if index[r] >= 0 {
				res.Owners[e] = append(res.Owners[e], index[r])
			}
		}
		if len(res.Owners[e]) == 0 {
			lost = append(lost, e)
		}
	}
	if lost != nil {
		return nil, lost, nil
	}
	res.index()
	return res, nil, nil
}

// RankOf returns the rank that serves expert e for token t of origin rank o.
func (pl *Placement) RankOf(e, o, t int) int {
	owners := pl.Owners[e]
	if len(owners) == 1 {
		return owners[0]
	}
	for _, r := range owners {
		if r == o {
			return r
		}
	}
	return owners[(o+t)%len(owners)]
}

// Slots is the number of physical experts: every replica apart.
func (pl *Placement) Slots() int {
	n := 0
	for _, es := range pl.Local {
		n += len(es)
	}
	return n
}

// PhysicalToLogical numbers the physical experts rank by rank, each rank's in local
// order, and returns the logical expert of each (DeepSeek EPLB's phy2log).
func (pl *Placement) PhysicalToLogical() []int {
	m := make([]int, 0, pl.Slots())
	for _, es := range pl.Local {
		m = append(m, es...)
	}
	return m
}

// LogicalToPhysical returns, per logical expert, the physical experts (numbered as by
// PhysicalToLogical) that hold it, ascending; len of each is its replica count.
func (pl *Placement) LogicalToPhysical() [][]int {
	m := make([][]int, pl.Experts)
	for s, e := range pl.PhysicalToLogical() {
		m[e] = append(m[e], s)
	}
	return m
}

// LocalIndex returns e's index among rank r's experts, or -1.
func (pl *Placement) LocalIndex(r, e int) int { return int(pl.local[r*pl.Experts+e]) }

// Layout is the dispatch plan of one rank's tokens: for each destination rank, the tokens
// that go there (each once, however many of its experts live there), in token order.
type Layout struct {
	Ranks int // ranks of the placement
	// Rows[d] lists the token indices sent to rank d, ascending.
	Rows [][]int32
	// Dest[t] lists the ranks token t goes to (each once).
	Dest [][]int32
	// Choices[d] counts the (token, expert) pairs whose expert rank d holds.
	Choices []int
	// Assignments counts (token, expert) pairs that are not dropped.
	Assignments int
	// TokensPerExpert counts assignments per expert from this rank.
	TokensPerExpert []int
	// ChoiceRank[t*K+j] is the rank that choice j of token t goes to (-1: dropped).
	ChoiceRank []int32
}

// BuildLayout computes the layout of origin rank o's routing under pl.
func BuildLayout(r *Routing, pl *Placement, o int) (*Layout, error) {
	l := &Layout{}
	return l, BuildLayoutInto(l, r, pl, o)
}

// BuildLayoutInto is BuildLayout reusing l's storage.
func BuildLayoutInto(l *Layout, r *Routing, pl *Placement, o int) error {
	if r.E != pl.Experts {
		return fmt.Errorf("%w: routing over %d experts, placement of %d", ErrConfig, r.E, pl.Experts)
	}
	l.Ranks = pl.Ranks
	if cap(l.Rows) < pl.Ranks {
		l.Rows = make([][]int32, pl.Ranks)
	}
	l.Rows = l.Rows[:pl.Ranks]
	for d := range l.Rows {
		l.Rows[d] = l.Rows[d][:0]
	}
	if cap(l.Dest) < r.T {
		l.Dest = make([][]int32, r.T)
	}
	l.Dest = l.Dest[:r.T]
	l.ChoiceRank = grow(l.ChoiceRank, r.T*r.K)
	l.TokensPerExpert = grow(l.TokensPerExpert, r.E)
	clear(l.TokensPerExpert)
	l.Choices = grow(l.Choices, pl.Ranks)
	clear(l.Choices)
	l.Assignments = 0
	for t := 0; t < r.T; t++ {
		dest := l.Dest[t][:0]
		for j := 0; j < r.K; j++ {
			e := int(r.Experts[t*r.K+j])
			l.ChoiceRank[t*r.K+j] = -1
			if e < 0 {
				continue
			}
			if e >= r.E {
				return fmt.Errorf("%w: token %d routed to expert %d of %d", ErrConfig, t, e, r.E)
			}
			l.Assignments++
			l.TokensPerExpert[e]++
			d := int32(pl.RankOf(e, o, t))
			l.ChoiceRank[t*r.K+j] = d
			l.Choices[d]++
			// Insert d in order, once (a token has at most K destinations).
			i := 0
			for i < len(dest) && dest[i] < d {
				i++
			}
			if i < len(dest) && dest[i] == d {
				continue
			}
			dest = append(dest, 0)
			copy(dest[i+1:], dest[i:])
			dest[i] = d
		}
		l.Dest[t] = dest
		for _, d := range dest {
			l.Rows[d] = append(l.Rows[d], int32(t))
		}
	}
	return nil
}

// Tokens is the number of tokens laid out.
func (l *Layout) Tokens() int { return len(l.Dest) }

// RowCounts returns the number of rows sent to each rank.
func (l *Layout) RowCounts(dst []int) []int {
	dst = grow(dst, l.Ranks)
	for d := range l.Rows {
		dst[d] = len(l.Rows[d])
	}
	return dst
}

// Imbalance is max/mean of the per-rank loads (1 = perfectly balanced; 0 for no load).
func Imbalance(loads []int) float64 {
	total, mx := 0, 0
	for _, n := range loads {
		total += n
		mx = max(mx, n)
	}
	if total == 0 {
		return 0
	}
	return float64(mx) / (float64(total) / float64(len(loads)))
}
