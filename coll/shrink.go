package coll

import (
	"context"
	"errors"
	"fmt"
	"github.com/moex-ai/moex/coll/algos"
	"math/bits"
	"slices"
	"sync"

	"github.com/moex-ai/moex/transport"
)

// Errors of Shrink. Test with errors.Is.
var (
	// ErrAgreement: the ranks that took part in a Shrink did not reach one membership
	// (they decided different ones, which a message lost with a dying rank can cause).
	// Nothing was built; call Shrink again.
	ErrAgreement = errors.New("coll: survivors did not agree on a membership")
	// ErrExcluded: the other ranks agreed that this rank is gone (they lost their
	// links to it), so the communicator they built leaves it out.
	ErrExcluded = errors.New("coll: left out by the survivors")
)

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
	ag := &agreement{c: c, id: derivedID(0xfe, c.id, n), words: (c.size + 63) / 64}
	dead, err := ag.run(ctx)
	if err != nil {
		return nil, err
	}
	var members []int
	me := -1
	for q := 0; q < c.size; q++ {
		if dead.has(q) {
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
	if c.owned != nil {
		c.owned.refs.Add(1)
		sub.owned = c.owned
	}
	if len(members) < c.size {
		lost := make([]int, 0, c.size-len(members))
		for q := 0; q < c.size; q++ {
			if dead.has(q) {
				lost = append(lost, q)
			}
		}
		c.log.Warn("moex: communicator shrunk", "comm", c.id, "rank", c.rank, "new_comm", sub.id, "new_rank", me, "size", len(members), "lost", lost)
	}
	return sub.listen(), nil
}

// ParentRanks returns, for each rank of a communicator made by Shrink or Split, its rank
// in the communicator it was made from; nil for one made by Init or Local.
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

// rankSet is a set of ranks of a communicator, as bits.
type rankSet []uint64

func (s rankSet) has(q int) bool { return s[q/64]&(1<<(q%64)) != 0 }
func (s rankSet) add(q int)      { s[q/64] |= 1 << (q % 64) }
func (s rankSet) union(o rankSet) {
	for i := range s {
		s[i] |= o[i]
	}
}
func (s rankSet) count() int {
	n := 0
	for _, w := range s {
		n += bits.OnesCount64(w)
	}
	return n
}

// shrinkTestHook, when set (by tests, before the ranks start), runs before each
// proposal of round round to rank to, with to = -1 once the round's proposals are
// sent, and with round 0 once this rank decided; an error ends the agreement with it.
var shrinkTestHook func(c *Comm, round uint32, to int) error

// Tags of the agreement's messages (Seq is the round; decisions go with Seq 0).
const (
	agreeProposal = 1
	agreeDecision = 2
)

// agreement is one Shrink's consensus on the dead ranks.
type agreement struct {
	c     *Comm
	id    uint32
	words int // uint64 words of a rankSet

	wctx   context.Context // every wait; cancelled when the agreement ends
	events chan agreeEvent
	wg     sync.WaitGroup
	sends  []transport.Request
	// sendBufs keeps the messages alive until their sends complete.
	sendBufs [][]byte
}

// agreeEvent is a receive that completed: a proposal of round Round, or a decision
// (Round 0), from rank From; or the failure of that receive.
type agreeEvent struct {
	from  int
	round uint32
	set   rankSet
	err   error
}

func (a *agreement) newSet() rankSet { return make(rankSet, a.words) }

func (a *agreement) encode(s rankSet) []byte {
	b := make([]byte, 8*len(s))
	for i, w := range s {
		for j := 0; j < 8; j++ {
			b[8*i+j] = byte(w >> (8 * j))
		}
	}
	return b
}

func (a *agreement) decode(b []byte) rankSet {
	s := a.newSet()
	for i := range s {
		for j := 0; j < 8; j++ {
			s[i] |= uint64(b[8*i+j]) << (8 * j)
		}
	}
	return s
}

func (a *agreement) tag(round uint32, kind uint32) transport.Tag {
	return transport.Tag{Comm: a.id, Seq: round, Tag: kind}
}

// send posts msg to rank q; a failure to post means q is gone (returned) or worse.
func (a *agreement) send(q int, round, kind uint32, s rankSet) error {
	b := a.encode(s)
	r, err := a.c.tr.Isend(a.c.ranks[q], a.tag(round, kind), b)
	if err != nil {
		return err
	}
	a.sends = append(a.sends, r)
	a.sendBufs = append(a.sendBufs, b)
	return nil
}

// recv posts a receive from rank q; its completion arrives as an event.
func (a *agreement) recv(q int, round, kind uint32) {
	b := make([]byte, 8*a.words)
	r, err := a.c.tr.Irecv(a.c.ranks[q], a.tag(round, kind), b)
	if err != nil {
		a.events <- agreeEvent{from: q, round: round, err: err}
		return
	}
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		n, err := r.Wait(a.wctx)
		ev := agreeEvent{from: q, round: round, err: err}
		if err == nil && n != len(b) {
			ev.err = fmt.Errorf("%w: %d-byte agreement message from rank %d, want %d", ErrAgreement, n, q, len(b))
		}
		if ev.err == nil {
			ev.set = a.decode(b)
		}
		select {
		case a.events <- ev:
		case <-a.wctx.Done():
		}
	}()
}

// gone reports whether err says that the peer is dead (its process, or the link).
func gone(err error) bool {
	var pe *transport.PeerError
	return errors.As(err, &pe) && !errors.Is(err, transport.ErrMismatch) && !errors.Is(err, transport.ErrTruncated)
}

// run reaches the decision: the set of dead ranks that every deciding rank shares.
func (a *agreement) run(ctx context.Context) (rankSet, error) {
	c := a.c
	p, me := c.size, c.rank
	tctx, cancelT := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancelT()
	var cancelW context.CancelFunc
	a.wctx, cancelW = context.WithCancel(tctx)
	a.events = make(chan agreeEvent, 2*p)
	defer func() {
		// Sends first (an eager send is done once posted; one to a rank that is gone
		// fails at once), then every receive still waiting.
		for _, r := range a.sends {
			_, _ = r.Wait(tctx)
		}
		cancelW()
		a.wg.Wait()
	}()
	fail := func(err error) (rankSet, error) {
		if tctx.Err() != nil && !errors.Is(err, ErrAgreement) {
			err = fmt.Errorf("coll: agreeing on the survivors: %w", transport.CtxError(tctx.Err()))
		}
		return nil, err
	}
	known := a.newSet() // dead, as far as this rank knows
	detect := func(q int, err error) error {
		if !gone(err) {
			return err
		}
		known.add(q)
		return nil
	}
	// A decision may come from any rank at any point: a receive for one is posted at
	// each peer from the start.
	decided := a.newSet() // ranks whose decision arrived (or whose receive failed)
	for q := 0; q < p; q++ {
		if q != me {
			a.recv(q, 0, agreeDecision)
		}
	}
	var decision rankSet
	var decider = -1
	prevFrom := a.newSet()
	for q := 0; q < p; q++ {
		prevFrom.add(q)
	}
rounds:
	for round := uint32(1); ; round++ {
		if int(round) > p+1 {
			// Each round that does not decide saw a death; there are at most p-1.
			return fail(fmt.Errorf("%w: no decision after %d rounds", ErrAgreement, round-1))
		}
		msg := slices.Clone(known)
		from := a.newSet()
		from.add(me)
		props := slices.Clone(known)
		pending := 0
		for q := 0; q < p; q++ {
			if q == me || known.has(q) {
				continue
			}
			if shrinkTestHook != nil {
				if err := shrinkTestHook(c, round, q); err != nil {
					return fail(err)
				}
			}
			if err := a.send(q, round, agreeProposal, msg); err != nil {
				if err := detect(q, err); err != nil {
					return fail(err)
				}
				continue
			}
			a.recv(q, round, agreeProposal)
			pending++
		}
		if shrinkTestHook != nil {
			if err := shrinkTestHook(c, round, -1); err != nil {
				return fail(err)
			}
		}
		for pending > 0 {
			var ev agreeEvent
			select {
			case ev = <-a.events:
			case <-tctx.Done():
				return fail(tctx.Err())
			}
			if ev.round == 0 { // a decision
				decided.add(ev.from)
				if ev.err != nil {
					if err := detect(ev.from, ev.err); err != nil {
						return fail(err)
					}
					continue
				}
				decision, decider = ev.set, ev.from
				break rounds
			}
			pending--
			if ev.err != nil {
				if err := detect(ev.from, ev.err); err != nil {
					return fail(err)
				}
				continue
			}
			from.add(ev.from)
			props.union(ev.set)
		}
		if slices.Equal(from, prevFrom) {
			decision = props
			break
		}
		prevFrom = from
		known.union(props)
	}
	if shrinkTestHook != nil {
		if err := shrinkTestHook(c, 0, -1); err != nil {
			return fail(err)
		}
	}
	if decision.has(me) {
		return fail(fmt.Errorf("%w: rank %d, by the decision of rank %d", ErrExcluded, me, max(decider, me)))
	}
	// Tell every rank that may still wait (also those the decision leaves out, so that
	// they learn it at once), then hear every member's decision: the same, or there is
	// no agreement.
	for q := 0; q < p; q++ {
		if q == me || known.has(q) {
			continue
		}
		if err := a.send(q, 0, agreeDecision, decision); err != nil {
			if err := detect(q, err); err != nil {
				return fail(err)
			}
		}
	}
	waiting := 0
	for q := 0; q < p; q++ {
		if q != me && !decision.has(q) && !decided.has(q) {
			waiting++
		}
	}
	for waiting > 0 {
		var ev agreeEvent
		select {
		case ev = <-a.events:
		case <-tctx.Done():
			return fail(tctx.Err())
		}
		if ev.round != 0 || decision.has(ev.from) || decided.has(ev.from) {
			continue // a proposal of a round left behind, or a rank outside
		}
		decided.add(ev.from)
		waiting--
		switch {
		case ev.err != nil && gone(ev.err):
			// It died after the decision: the new communicator names it.
		case ev.err != nil:
			return fail(ev.err)
		case !slices.Equal(ev.set, decision):
			return fail(fmt.Errorf("%w: rank %d decided that %d ranks are gone, this rank %d", ErrAgreement, ev.from, ev.set.count(), decision.count()))
		}
	}
	return decision, nil
}
