package dispatch

import (
	"fmt"
	"slices"
	"time"

	"github.com/moex-ai/moex/coll"
	hostgroups "github.com/moex-ai/moex/internal/hosts"
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
	tl := &twoLevel{}
	tl.hostIdx, tl.local, tl.members = hostgroups.Group(hosts)
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

// HostTraffic is one step's bytes on the wire within and across hosts, flat and
// two-level (Plan.Hosts): what moex flow --hosts prints.
type HostTraffic struct {
	Flat     StageTraffic // the flat dispatch and combine
	TwoLevel StageTraffic // the two-level ones
}

// StageTraffic is bytes on the wire, every rank's, within and across hosts, and the
// dispatch's rows.
type StageTraffic struct {
	DispatchWithin, DispatchAcross int64 // the dispatch's bytes within hosts and across
	CombineWithin, CombineAcross   int64 // the combine's
	RowsWithin, RowsAcross         int   // the dispatch's rows within hosts and across
}

// Hosts computes the traffic of the step with ranks on hosts (hosts[r]: rank r's host),
// flat as planned and in two levels (TwoLevel). Headers are left out.
func (pl *Plan) Hosts(hosts []int) (*HostTraffic, error) {
	cfg := pl.Cfg
	if cfg.Placement == nil {
		return nil, fmt.Errorf("%w: a plan without a placement", ErrConfig)
	}
	tl, err := newTwoLevel(cfg.Placement, hosts)
	if err != nil {
		return nil, err
	}
	f, cf := pl.Format, pl.CombineFormat
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
			c := int64(cf.Block(len(rows), pl.Choices[o][q])) // with SumAtOrigin, a count per row and an output per choice
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
			r := pl.Routing(o)
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
						ht.TwoLevel.CombineAcross += int64(cf.Row)
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
					ht.TwoLevel.CombineWithin += int64(cf.Row)
					ht.TwoLevel.RowsWithin++
				}
			}
		}
	}
	return ht, nil
}

// ChooseTwoLevel reports whether the two-level dispatch (TwoLevel) is expected to take
// less time than the flat one for cfg on c, and says why. It models a token's TopK
// choices as drawn evenly from the experts: the flat dispatch sends the row to every
// rank of another host that holds one of them, the two-level one to every other host
// that does (then its relay hands it to the host's ranks, over the host's link); the
// combine's partial sums take the same ways back. Each way is priced with c's cost
// model (coll.Comm.LinkCosts; MOEX_NET_GBITS sets the network's speed), per row and
// per message on a host's link. Ranks on one host, or hosts of unequal sizes: flat.
func ChooseTwoLevel(c *coll.Comm, cfg Config) (bool, string) {
	p := c.Size()
	if cfg.Placement == nil || cfg.Placement.Ranks != p {
		return false, "flat: no placement over this communicator"
	}
	hosts := make([]int, p)
	for r := range hosts {
		hosts[r] = c.Host(r)
	}
	tl, err := newTwoLevel(cfg.Placement, hosts)
	if err != nil || len(tl.members) < 2 {
		return false, "flat: the ranks are on one host, or on hosts of unequal sizes"
	}
	net, host := c.LinkCosts()
	e, k := cfg.Placement.Experts, min(cfg.TopK, cfg.Placement.Experts)
	// hit is the chance that a token's k choices include one of n given experts.
	hit := func(n int) float64 {
		miss := 1.0
		for i := 0; i < k; i++ {
			miss *= float64(e-n-i) / float64(e-i)
			if miss <= 0 {
				return 1
			}
		}
		return 1 - miss
	}
	held := make([]int, p) // experts whose first replica each rank holds
	for _, owners := range cfg.Placement.Owners {
		held[owners[0]]++
	}
	me := c.Rank()
	home := tl.hostIdx[me]
	var flatRows, twoRows, relayed float64
	for b, ms := range tl.members {
		if b == home {
			continue
		}
		n := 0
		for _, q := range ms {
			flatRows += hit(held[q])
			n += held[q]
			if q != ms[tl.local[me]] {
				relayed += hit(held[q])
			}
		}
		twoRows += hit(n)
	}
	f := NewFormat(cfg)
	back := newCombineFormat(cfg.Hidden, CombineConfig{PartialDType: f.Wire}, f.Wire)
	row := float64(f.RowBytes(k/len(tl.members)+1) + back.Row) // a row there and its partial sum back
	m := len(tl.members[0])
	tokens := float64(max(cfg.MaxTokens, 1))
	msg := func(l coll.LinkCost, n int) float64 {
		return l.Alpha.Seconds() * (1 + coll.MessageShare*float64(max(n-1, 0)))
	}
	h := len(tl.members)
	// A host's link carries its m ranks' rows; a relay's rows cross the host's link too.
	flat := 2*msg(net, m*(p-m)) + tokens*flatRows*float64(m)*row*net.Beta
	two := 2*msg(net, m*(h-1)) + tokens*twoRows*float64(m)*row*net.Beta +
		2*msg(host, (h-1)*(m-1)) + tokens*relayed*row*host.Beta + tokens*twoRows*row/20e9
	why := fmt.Sprintf("a token to %.2f ranks of other hosts flat, to %.2f hosts in two levels (model: flat %v, two-level %v per step of %d tokens)",
		flatRows, twoRows, time.Duration(flat*1e9).Round(time.Microsecond), time.Duration(two*1e9).Round(time.Microsecond), int(tokens))
	if two < flat {
		return true, "two-level: " + why
	}
	return false, "flat: " + why
}
