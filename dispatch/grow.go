package dispatch

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/router"
)

// Grow moves MoE serving onto a grown communicator in one collective call, the way back
// from Recover: g is what coll.Comm.Admit (or Grow) returned on the live ranks and
// coll.Init (or Rejoin) on the process that took a rank over, old the placement over the communicator it grew from (the live
// ranks pass the one they serve with; a joiner passes nil and learns it), load the load
// per logical expert to balance (the live ranks pass the same; nil: even; a joiner's is
// ignored). The lowest live rank sends every rank the placement and the load; every rank
// places the experts on all of g's ranks (router.Rebalance with b; b.Slots 0 keeps the
// slots per rank of old, more where the experts no longer fit; b.Hosts nil takes g's
// hosts; b.Prefer nil prefers what the live ranks hold, so that only the joiners' experts
// move), and migrates the weights (Migrate: the joiners receive theirs; w is each rank's,
// a joiner's Old never called). It returns the new placement, over g's ranks, for the
// dispatchers made next, and the moves.
//
// Live ranks that pass different placements fail with ErrMismatch on every rank, before
// anything moves.
func Grow(ctx context.Context, g *coll.Comm, old *router.Placement, load []float64, b router.Balance, w Weights) (*router.Placement, []router.Move, error) {
	parents := g.ParentRanks()
	if len(parents) != g.Size() {
		return nil, nil, fmt.Errorf("%w: growing onto a communicator that coll.Comm.Grow did not make", ErrConfig)
	}
	root := slices.IndexFunc(parents, func(q int) bool { return q >= 0 })
	joined := parents[g.Rank()] < 0
	if !joined && old == nil {
		return nil, nil, fmt.Errorf("%w: a live rank grows from no placement", ErrConfig)
	}
	if !joined && load != nil && len(load) != old.Experts {
		return nil, nil, fmt.Errorf("%w: load of %d experts for a placement of %d", ErrConfig, len(load), old.Experts)
	}
	// The lowest live rank's placement and load, to every rank; the live ranks check
	// theirs against it.
	var msg []int64
	if g.Rank() == root {
		msg = encodeGrow(old, load)
	}
	size := []int64{int64(len(msg))}
	if err := coll.Broadcast(ctx, g, size, root); err != nil {
		return nil, nil, err
	}
	if size[0] < 3 || size[0] > 3+int64(router.MaxExperts)*(2+int64(router.MaxRanks)) {
		return nil, nil, fmt.Errorf("%w: a placement of %d words", ErrMismatch, size[0])
	}
	if g.Rank() != root {
		msg = make([]int64, size[0])
	}
	if err := coll.Broadcast(ctx, g, msg, root); err != nil {
		return nil, nil, err
	}
	theirs, theirLoad, err := decodeGrow(msg)
	if err != nil {
		return nil, nil, err
	}
	same := int64(1)
	if !joined && PlacementFingerprint(old) != PlacementFingerprint(theirs) {
		same = 0
	}
	all := make([]int64, g.Size())
	if err := coll.AllGather(ctx, g, []int64{same}, all); err != nil {
		return nil, nil, err
	}
	if q := slices.Index(all, 0); q >= 0 {
		return nil, nil, fmt.Errorf("%w: rank %d grows from another placement than rank %d's", ErrMismatch, q, root)
	}
	old, load = theirs, theirLoad
	// old over g's ranks: each live rank keeps what it holds, a joiner holds nothing.
	index := make([]int, old.Ranks)
	for i, q := range parents {
		if q >= 0 {
			if q >= old.Ranks {
				return nil, nil, fmt.Errorf("%w: growing a placement of %d ranks onto a communicator grown from more", ErrConfig, old.Ranks)
			}
			index[q] = i
		}
	}
	owners := make([][]int, old.Experts)
	for e, rs := range old.Owners {
		for _, r := range rs {
			owners[e] = append(owners[e], index[r])
		}
	}
	held, err := router.PlacementOf(old.Experts, g.Size(), owners)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	p := g.Size()
	if b.Slots == 0 {
		per := (old.Slots() + old.Ranks - 1) / old.Ranks
		per = min(max(per, (old.Experts+p-1)/p), old.Experts)
		b.Slots = per * p
	}
	if b.Prefer == nil {
		b.Prefer = held
	}
	if b.Hosts == nil {
		b.Hosts = make([]int, p)
		for r := range b.Hosts {
			b.Hosts[r] = g.Host(r)
		}
	}
	next, err := router.Rebalance(load, p, b)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	moves, err := Migrate(ctx, g, held, next, w)
	if err != nil {
		return nil, nil, err
	}
	return next, moves, nil
}

// encodeGrow writes a placement and a load (nil: even) as words: experts, ranks, kind,
// each expert's owners (count, then ranks), then each expert's load.
func encodeGrow(pl *router.Placement, load []float64) []int64 {
	msg := []int64{int64(pl.Experts), int64(pl.Ranks), int64(pl.Kind)}
	for _, rs := range pl.Owners {
		msg = append(msg, int64(len(rs)))
		for _, r := range rs {
			msg = append(msg, int64(r))
		}
	}
	for e := 0; e < pl.Experts; e++ {
		l := 1.0
		if load != nil {
			l = load[e]
		}
		msg = append(msg, int64(math.Float64bits(l)))
	}
	return msg
}

func decodeGrow(msg []int64) (*router.Placement, []float64, error) {
	bad := fmt.Errorf("%w: a malformed placement from the lowest live rank", ErrMismatch)
	if len(msg) < 3 {
		return nil, nil, bad
	}
	e, ranks := int(msg[0]), int(msg[1])
	if e < 1 || e > router.MaxExperts || ranks < 1 || ranks > router.MaxRanks {
		return nil, nil, bad
	}
	owners := make([][]int, e)
	at := 3
	for x := range owners {
		if at >= len(msg) || msg[at] < 1 || msg[at] > int64(ranks) || at+1+int(msg[at]) > len(msg) {
			return nil, nil, bad
		}
		n := int(msg[at])
		for _, r := range msg[at+1 : at+1+n] {
			owners[x] = append(owners[x], int(r))
		}
		at += 1 + n
	}
	if len(msg) != at+e {
		return nil, nil, bad
	}
	load := make([]float64, e)
	for x := range load {
		load[x] = math.Float64frombits(uint64(msg[at+x]))
	}
	pl, err := router.PlacementOf(e, ranks, owners)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %v", ErrMismatch, err)
	}
	pl.Kind = router.PlacementKind(msg[2]) // as the live ranks made it (their fingerprint has it)
	return pl, load, nil
}
