package dispatch

import (
	"fmt"
	"slices"

	"github.com/moex-ai/moex/router"
)

// twoLevelPlacements are the placements of TwoLevel's stages for pl on ranks placed on
// hosts (hosts[r]: rank r's host): up, over the hosts (in order of their first rank),
// expert e on every host where a rank holds it; down, for each host, over its ranks (in
// rank order), the experts held there, renumbered, with global[k] down's expert k.
type twoLevel struct {
	hostIdx []int   // rank -> index of its host
	local   []int   // rank -> index among its host's ranks
	members [][]int // host -> its ranks
	up      *router.Placement
	down    []*router.Placement
	global  [][]int32 // host -> down's expert -> global expert
	localOf [][]int32 // host -> global expert -> down's expert (-1)
}

func newTwoLevel(pl *router.Placement, hosts []int) (*twoLevel, error) {
	if len(hosts) != pl.Ranks {
		return nil, fmt.Errorf("%w: hosts of %d ranks for a placement of %d", ErrConfig, len(hosts), pl.Ranks)
	}
	tl := &twoLevel{hostIdx: make([]int, len(hosts)), local: make([]int, len(hosts))}
	idx := map[int]int{}
	for r, h := range hosts {
		i, ok := idx[h]
		if !ok {
			i = len(tl.members)
			idx[h] = i
			tl.members = append(tl.members, nil)
		}
		tl.hostIdx[r], tl.local[r] = i, len(tl.members[i])
		tl.members[i] = append(tl.members[i], r)
	}
	for _, ms := range tl.members {
		if len(ms) != len(tl.members[0]) {
			return nil, fmt.Errorf("%w: a two-level dispatch needs hosts with equal numbers of ranks", ErrConfig)
		}
	}
	upOwners := make([][]int, pl.Experts)
	for e, owners := range pl.Owners {
		for _, r := range owners {
			if h := tl.hostIdx[r]; !slices.Contains(upOwners[e], h) {
				upOwners[e] = append(upOwners[e], h)
			}
		}
	}
	var err error
	if tl.up, err = router.PlacementOf(pl.Experts, len(tl.members), upOwners); err != nil {
		return nil, err
	}
	for _, ms := range tl.members {
		localOf := make([]int32, pl.Experts)
		var global []int32
		var owners [][]int
		for e, os := range pl.Owners {
			localOf[e] = -1
			var on []int
			for i, r := range ms {
				if slices.Contains(os, r) {
					on = append(on, i)
				}
			}
			if on != nil {
				localOf[e] = int32(len(global))
				global = append(global, int32(e))
				owners = append(owners, on)
			}
		}
		var down *router.Placement
		if len(global) > 0 {
			if down, err = router.PlacementOf(len(global), len(ms), owners); err != nil {
				return nil, err
			}
		}
		tl.down = append(tl.down, down)
		tl.global = append(tl.global, global)
		tl.localOf = append(tl.localOf, localOf)
	}
	return tl, nil
}

// HostTraffic is one MoE step's bytes on the wire within hosts and across them, for
// the flat dispatch and for the two-level one (TwoLevel), dispatch and combine apart:
// what `moex flow --hosts` prints.
type HostTraffic struct {
	Flat, TwoLevel StageTraffic
}

// StageTraffic is bytes on the wire, every rank's, within and across hosts, and the
// dispatch's rows.
type StageTraffic struct {
	DispatchWithin, DispatchAcross int64
	CombineWithin, CombineAcross   int64
	RowsWithin, RowsAcross         int
}

// Hosts computes the traffic of pl's step with ranks on hosts (hosts[r]: rank r's
// host), flat as planned and in two levels: the up stage's rows across hosts (a token
// once per remote host, with its choices there), the down stage's within (each relayed
// row once per other rank of the host with one of its experts), and the combine's
// partial sums back the same ways. Headers are left out.
func (pl *Plan) Hosts(hosts []int) (*HostTraffic, error) {
	cfg := pl.Cfg
	if cfg.Placement == nil {
		return nil, fmt.Errorf("%w: a plan without a placement", ErrConfig)
	}
	tl, err := newTwoLevel(cfg.Placement, hosts)
	if err != nil {
		return nil, err
	}
	f := pl.Format
	rowBytes := func(m int) int64 {
		if cfg.Mode == LowLatency {
			return int64(f.MetaBytes(0) + 8*m + f.Payload + f.ScaleBytes())
		}
		return int64(f.RowBytes(0) + 8*m)
	}
	ht := &HostTraffic{}
	// Flat: every (token, rank) row.
	for o, l := range pl.Layouts {
		for q, rows := range l.Rows {
			if q == o {
				continue
			}
			b := int64(len(rows))*int64(f.RowBytes(0)) + 8*int64(pl.Choices[o][q])
			if cfg.Mode == LowLatency {
				b = int64(len(rows))*int64(f.MetaBytes(0)+f.Payload+f.ScaleBytes()) + 8*int64(pl.Choices[o][q])
			}
			c := int64(len(rows) * f.Combined)
			if hosts[q] == hosts[o] {
				ht.Flat.DispatchWithin += b
				ht.Flat.CombineWithin += c
				ht.Flat.RowsWithin += len(rows)
			} else {
				ht.Flat.DispatchAcross += b
				ht.Flat.CombineAcross += c
				ht.Flat.RowsAcross += len(rows)
			}
		}
	}
	// Two-level: the up stage from each origin, in the order the relays receive.
	h := len(tl.members)
	type relayed struct {
		choices []int32 // down's expert ids
	}
	in := make([][]relayed, len(hosts)) // relay rank -> rows it relays, in arrival order
	for oh := 0; oh < h; oh++ {         // origin host (up's rank), ascending, as rows arrive
		for _, o := range tl.members[oh] {
			r := pl.routing(o)
			k := r.K
			for t := 0; t < r.T; t++ {
				per := make(map[int][]int32) // destination host -> global experts
				var order []int
				for j := 0; j < k; j++ {
					e := r.Experts[t*k+j]
					if e < 0 {
						continue
					}
					b := tl.up.RankOf(int(e), oh, t)
					if _, ok := per[b]; !ok {
						order = append(order, b)
					}
					per[b] = append(per[b], e)
				}
				for _, b := range order {
					es := per[b]
					if b != oh {
						ht.TwoLevel.DispatchAcross += rowBytes(len(es))
						ht.TwoLevel.CombineAcross += int64(f.Combined)
						ht.TwoLevel.RowsAcross++
					}
					relay := tl.members[b][tl.local[o]]
					ids := make([]int32, len(es))
					for i, e := range es {
						ids[i] = tl.localOf[b][e]
					}
					in[relay] = append(in[relay], relayed{ids})
				}
			}
		}
	}
	for relay, rows := range in {
		b := tl.hostIdx[relay]
		down := tl.down[b]
		for k, row := range rows {
			seen := map[int]int{} // local rank -> choices
			for _, e := range row.choices {
				seen[down.RankOf(int(e), tl.local[relay], k)]++
			}
			for d, m := range seen {
				if d != tl.local[relay] {
					ht.TwoLevel.DispatchWithin += rowBytes(m)
					ht.TwoLevel.CombineWithin += int64(f.Combined)
					ht.TwoLevel.RowsWithin++
				}
			}
		}
	}
	return ht, nil
}

// routing is rank o's routing (from its layout's tokens, as NewPlan kept them).
func (pl *Plan) routing(o int) *router.Routing { return pl.routings[o] }
