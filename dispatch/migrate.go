package dispatch

import (
	"context"
	"errors"
	"fmt"
	"unsafe"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/router"
)

// Weights gives Migrate the bytes of this rank's experts.
type Weights struct {
	// Bytes is the size of one expert's weights, the same for every expert and rank.
	Bytes int
	// Old returns expert e's weights as this rank holds them under the old placement
	// (called for the experts it holds there); Migrate reads them.
	Old func(e int) []byte
	// New returns where expert e's weights go on this rank under the new placement
	// (called for the experts it holds there); Migrate writes them. A slice that is
	// Old(e) itself is kept in place; any other must not overlap a slice of Old.
	New func(e int) []byte
}

// Migrate moves expert weights for the change of placement from old to next, over c
// (collectively: every rank calls it with the same placements). First every rank
// checks, in one small AllGather, that the others swap the same placements with
// weights of the same size and that its own buffers are right; a rank that differs
// makes every rank return ErrMismatch, a rank with a bad buffer a *PeerInputError
// naming it, and nothing moves. Then the experts that come to a rank which did not hold
// them move in one batch of point-to-point messages (router.Moves: one message per
// moved expert, from a holder of the same host where there is one, all in flight
// together), and the experts a rank keeps are copied from Old to New where these differ.
//
// Dispatchers made for old refuse to dispatch with ranks that moved on to next (their
// fingerprints differ: ErrMismatch on every rank), so a step never delivers rows to
// experts whose weights are not there.
func Migrate(ctx context.Context, c *coll.Comm, old, next *router.Placement, w Weights) ([]router.Move, error) {
	p, me := c.Size(), c.Rank()
	if old.Ranks != p || next.Ranks != p {
		return nil, fmt.Errorf("%w: placements over %d and %d ranks on a communicator of %d", ErrConfig, old.Ranks, next.Ranks, p)
	}
	hosts := make([]int, p)
	for r := range hosts {
		hosts[r] = c.Host(r)
	}
	moves, err := router.Moves(old, next, hosts)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	code := codeOK
	if w.Bytes < 0 || w.Old == nil || w.New == nil {
		code = codeWeights
	} else {
		for _, e := range old.Local[me] {
			if len(w.Old(e)) != w.Bytes {
				code = codeWeights
			}
		}
		for _, e := range next.Local[me] {
			if len(w.New(e)) != w.Bytes {
				code = codeWeights
			}
		}
	}
	hdr := []int64{int64(code), int64(PlacementFingerprint(old)), int64(PlacementFingerprint(next)), int64(w.Bytes)}
	all := make([]int64, len(hdr)*p)
	if err := coll.AllGather(ctx, c, hdr, all); err != nil {
		return nil, err
	}
	for q := 0; q < p; q++ {
		g := all[q*len(hdr) : (q+1)*len(hdr)]
		if g[0] != codeOK {
			return nil, peerInput(q, int(g[0]))
		}
	}
	for q := 0; q < p; q++ {
		g := all[q*len(hdr) : (q+1)*len(hdr)]
		if g[1] != hdr[1] || g[2] != hdr[2] || g[3] != hdr[3] {
			return nil, fmt.Errorf("%w: rank %d migrates other placements or weights of %d bytes (fingerprints %#x to %#x, this rank's %#x to %#x, %d bytes)",
				ErrMismatch, q, g[3], uint64(g[1]), uint64(g[2]), uint64(hdr[1]), uint64(hdr[2]), w.Bytes)
		}
	}
	var ops []coll.P2P
	for _, m := range moves {
		switch me {
		case m.From:
			ops = append(ops, coll.P2P{Peer: m.To, Tag: m.Expert, Buf: w.Old(m.Expert)})
		case m.To:
			ops = append(ops, coll.P2P{Peer: m.From, Tag: m.Expert, Buf: w.New(m.Expert), Recv: true})
		}
	}
	for _, e := range next.Local[me] {
		if old.LocalIndex(me, e) < 0 {
			continue
		}
		if src, dst := w.Old(e), w.New(e); len(dst) > 0 && unsafe.SliceData(src) != unsafe.SliceData(dst) {
			copy(dst, src)
		}
	}
	if err := coll.SendRecv(ctx, c, ops); err != nil {
		return nil, err
	}
	return moves, nil
}

// ErrLostExperts: the ranks that are gone held every replica of some experts.
var ErrLostExperts = errors.New("dispatch: experts lost with their ranks")

// LostExpertsError names the experts whose every replica was on a lost rank; it
// matches ErrLostExperts. Their weights must come from elsewhere (a checkpoint).
type LostExpertsError struct {
	Experts []int // logical experts, ascending
	Ranks   []int // the lost ranks, in the communicator that was shrunk
}

// Error names the lost experts and ranks.
func (e *LostExpertsError) Error() string {
	return fmt.Sprintf("dispatch: experts %v had every replica on the lost ranks %v", e.Experts, e.Ranks)
}

// Is makes LostExpertsError match ErrLostExperts.
func (e *LostExpertsError) Is(target error) bool { return target == ErrLostExperts }

// Recover moves MoE serving onto the survivors of a lost rank in one collective call:
// sub is the communicator that coll.Comm.Shrink returned, old the placement over the
// communicator it was shrunk from, load the load per logical expert to balance (the
// same on every rank, from a LoadRecorder; nil: even). It keeps each expert's replicas
// on the survivors (router.Placement.Restrict), rebalances onto them (router.Rebalance
// with b; b.Slots 0 keeps the slots per rank, more where the experts no longer fit;
// b.Hosts nil takes sub's hosts; b.Prefer nil prefers what the survivors hold, so that
// few weights move) and migrates the weights (Migrate, with w as each rank holds them
// under old). It returns the new placement, over sub's ranks, for
// the dispatchers made next, and the moves.
//
// When the lost ranks held every replica of some experts, every rank returns a
// *LostExpertsError naming them, and nothing moves. Ranks that pass different old
// placements fail with ErrMismatch, also before anything moves.
func Recover(ctx context.Context, sub *coll.Comm, old *router.Placement, load []float64, b router.Balance, w Weights) (*router.Placement, []router.Move, error) {
	parents := sub.ParentRanks()
	if parents == nil || parents[len(parents)-1] >= old.Ranks {
		return nil, nil, fmt.Errorf("%w: recovering a placement of %d ranks on a communicator not shrunk from one of them (ranks %v)", ErrConfig, old.Ranks, parents)
	}
	if load == nil {
		load = make([]float64, old.Experts)
		for e := range load {
			load[e] = 1
		}
	}
	if len(load) != old.Experts {
		return nil, nil, fmt.Errorf("%w: load of %d experts for a placement of %d", ErrConfig, len(load), old.Experts)
	}
	surv, lost, err := old.Restrict(parents)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	// Every rank learns that the others recover from the same placement, and whether
	// experts were lost, before anything else happens.
	hdr := []int64{int64(PlacementFingerprint(old)), int64(len(lost))}
	all := make([]int64, 2*sub.Size())
	if err := coll.AllGather(ctx, sub, hdr, all); err != nil {
		return nil, nil, err
	}
	for q := 0; q < sub.Size(); q++ {
		if all[2*q] != hdr[0] {
			return nil, nil, fmt.Errorf("%w: rank %d recovers from another placement (fingerprint %#x, this rank's %#x)", ErrMismatch, q, uint64(all[2*q]), uint64(hdr[0]))
		}
	}
	if lost != nil {
		var gone []int
		for r, i := 0, 0; r < old.Ranks; r++ {
			if i < len(parents) && parents[i] == r {
				i++
				continue
			}
			gone = append(gone, r)
		}
		return nil, nil, &LostExpertsError{Experts: lost, Ranks: gone}
	}
	p := sub.Size()
	if b.Slots == 0 {
		per := (old.Slots() + old.Ranks - 1) / old.Ranks
		per = min(max(per, (old.Experts+p-1)/p), old.Experts)
		b.Slots = per * p
	}
	if b.Prefer == nil {
		b.Prefer = surv
	}
	if b.Hosts == nil {
		b.Hosts = make([]int, p)
		for r := range b.Hosts {
			b.Hosts[r] = sub.Host(r)
		}
	}
	next, err := router.Rebalance(load, p, b)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	moves, err := Migrate(ctx, sub, surv, next, w)
	if err != nil {
		return nil, nil, err
	}
	return next, moves, nil
}
