package coll

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/moex-ai/moex/coll/agree"
	"github.com/moex-ai/moex/coll/algos"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/bootstrap"
)

// Errors of Shrink. Test with errors.Is.
var (
	// ErrAgreement: the ranks that took part in a Shrink did not reach one membership
	// (they decided different ones, which a message lost with a dying rank can cause).
	// Nothing was built; call Shrink again.
	ErrAgreement = agree.ErrAgreement
	// ErrExcluded: the other ranks agreed that this rank is gone (they lost their
	// links to it), so the communicator they built leaves it out.
	ErrExcluded = agree.ErrExcluded
)

// shrinkTestHook, when set (by tests, before the ranks start), runs before each
// proposal of round round to rank to, with to = -1 once the round's proposals are
// sent, and with round 0 once this rank decided; an error ends the agreement with it.
var shrinkTestHook func(c *Comm, round uint32, to int) error

// Shrink agrees with the other live ranks on who is still alive and returns a new
// communicator of them, in the spirit of MPI ULFM's MPIX_Comm_shrink: after a rank
// died (an operation failed with a *PeerError, or an *AbortError that names one) every
// surviving rank calls Shrink, and every one that returns without an error gets a
// communicator of the same ranks, in the order of their ranks here (ParentRanks maps
// them back). c may be aborted, as it is after a death, or healthy (the result then has
// every rank). Shrink is collective over the live ranks and uses the transport alone,
// not c's operations nor the rendezvous store.
//
// The agreement is flooding consensus over the transport, whose failure detection is
// the oracle: in each round every rank sends what it knows to be dead to every rank it
// believes alive, and waits for each one's message or its failure; a rank decides when
// it heard from the same ranks in two rounds in a row (no death between them) and
// tells the others, who take its decision. A rank that dies during the agreement is
// either left out or, when it died after others had heard from it, kept; then the new
// communicator fails its first operation with a *PeerError naming it, on every rank,
// and Shrink is called again on the new communicator.
//
// In a job with a registry (moex run --restarts, etcd), Shrink removes the lost ranks'
// entries from it; where the registry does not answer and the survivors are at most half
// of c's ranks, they fail alike with a *PeerError matching ErrCutOff: a link cut in two
// leaves one side serving, the one that reaches the registry.
//
// Shrink returns an error wrapping ErrTimeout when a live rank does not take part
// within the communicator's timeout (or ctx ends), ErrExcluded when the others
// agreed that this rank is gone, and ErrAgreement when the survivors' decisions
// differ. It never hangs past the timeout. The new communicator shares c's transport
// (closed when the last communicator that shares it is closed); it does not use the
// shared-memory areas of shm (SharedMemory reports false).
func (c *Comm) Shrink(ctx context.Context) (*Comm, error) {
	if c.closed.Load() {
		return nil, ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return nil, transport.CtxError(err)
	}
	c.issueMu.Lock()
	c.shrinks++
	n := c.shrinks
	c.issueMu.Unlock()
	acfg := agree.Config{Transport: c.tr, Ranks: c.ranks, Rank: c.rank, ID: derivedID(0xfe, c.id, n), Timeout: c.cfg.Timeout}
	if hook := shrinkTestHook; hook != nil {
		acfg.Hook = func(round uint32, to int) error { return hook(c, round, to) }
	}
	dead, err := agree.Dead(ctx, acfg)
	if err != nil {
		return nil, err
	}
	var members []int
	me := -1
	for q := 0; q < c.size; q++ {
		if dead.Has(q) {
			continue
		}
		if q == c.rank {
			me = len(members)
		}
		members = append(members, q)
	}
	ranks := make([]int, len(members))
	hosts := make([]int, len(members))
	for i, q := range members {
		ranks[i], hosts[i] = c.ranks[q], c.hosts[q]
	}
	sub := newComm(c.tr, derivedID(0xfd, c.id, n), ranks, hostsDense(hosts), me, c.cfg, c.link)
	sub.why = c.why
	if sub.topo.Hosts == 1 {
		sub.link = c.intra
	}
	sub.intra = c.intra
	sub.parent = members
	sub.closeBarrier = c.closeBarrier
	sub.registry = c.registry
	if c.owned != nil {
		c.owned.refs.Add(1)
		sub.owned = c.owned
	}
	if len(members) < c.size {
		lost := make([]int, 0, c.size-len(members))
		for q := 0; q < c.size; q++ {
			if dead.Has(q) {
				lost = append(lost, q)
			}
		}
		c.log.Warn("moex: communicator shrunk", "comm", c.id, "rank", c.rank, "new_comm", sub.id, "new_rank", me, "size", len(members), "lost", lost)
		sub.listen()
		if c.registry != nil {
			if err := sub.confirmShrink(ctx, c, lost); err != nil {
				sub.Close()
				return nil, err
			}
		}
		return sub, nil
	}
	return sub.listen(), nil
}

// ErrCutOff: a Shrink that kept at most half of the ranks could not reach the job's
// registry: these ranks may be the ones cut off from the others (a link down), which
// may be shrinking too, so they stop rather than serve beside them. The error is a
// *PeerError naming a lost rank.
var ErrCutOff = errors.New("coll: cut off from the job's registry with at most half of the ranks")

// registryConfirm bounds how long Shrink waits for the job's registry.
const registryConfirm = 3 * time.Second

// confirmShrink, on a communicator sub that Shrink made from c without the ranks lost
// (of c), removes their claims from the job's registry (a driver's store keeps them: a
// process started again for one then takes it over at once, not refused while its old
// lease lives), and fails every rank of sub alike with ErrCutOff where sub holds at most
// half of c's ranks and the registry did not answer: a split in two halves must not
// leave two jobs serving, and the half that reaches the registry is the one that goes on.
func (sub *Comm) confirmShrink(ctx context.Context, c *Comm, lost []int) error {
	ok := []int64{1}
	if sub.rank == 0 {
		rctx, cancel := context.WithTimeout(ctx, min(c.cfg.Timeout/2, registryConfirm))
		var errs []error
		for _, q := range lost {
			errs = append(errs, bootstrap.ForgetRank(rctx, c.registry, c.ranks[q]))
		}
		cancel()
		if err := errors.Join(errs...); err != nil {
			c.log.Warn("moex: removing the lost ranks' entries from the registry failed", "lost", lost, "err", err)
			if 2*sub.size <= c.size {
				ok[0] = 0
			}
		}
	}
	if err := Broadcast(ctx, sub, ok, 0); err != nil {
		return err
	}
	if ok[0] == 0 {
		return &PeerError{Rank: c.ranks[lost[0]], Op: "shrink", Err: ErrCutOff}
	}
	return nil
}

// ParentRanks returns, for each rank of a communicator made by Shrink, Split or Grow
// (or Rejoin), its rank in the communicator it was made from, -1 for a rank that joined;
// nil for one made by Init, Local or New.
func (c *Comm) ParentRanks() []int { return slices.Clone(c.parent) }

// derivedID is the id of a communicator or agreement derived from parent (kind tells
// them apart; n counts the derivations of that kind), clear of the reserved ids.
func derivedID(kind OpKind, parent, n uint32) uint32 {
	id := algos.Signature(kind, 0, int(parent), int(n))
	if id >= 0xFFFFFFF0 || id <= 1 {
		id ^= 0x5a5a5a5a
	}
	return id
}
