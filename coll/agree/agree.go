// Package agree is the survivors' agreement on who is dead, which coll's Shrink runs
// after a rank died: flooding consensus over the transport, whose failure detection is
// the oracle. It uses the transport alone, not the communicator's operations.
package agree

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"sync"
	"time"

	"github.com/moex-ai/moex/transport"
)

// Errors. Test with errors.Is.
var (
	// ErrAgreement: the ranks that took part did not reach one membership (they decided
	// different ones, which a message lost with a dying rank can cause).
	ErrAgreement = errors.New("coll: survivors did not agree on a membership")
	// ErrExcluded: the other ranks agreed that this rank is gone (they lost their links
	// to it).
	ErrExcluded = errors.New("coll: left out by the survivors")
)

// Config is one agreement among the ranks of a communicator.
type Config struct {
	Transport transport.Transport
	// Ranks maps each rank of the communicator to its transport rank; Rank is this one.
	Ranks []int
	Rank  int
	// ID tags the agreement's messages: the same on every rank, unique to the agreement.
	ID uint32
	// Timeout bounds the agreement.
	Timeout time.Duration
	// Hook, for tests, runs before each proposal of round round to rank to, with to = -1
	// once the round's proposals are sent, and with round 0 once this rank decided; an
	// error ends the agreement with it.
	Hook func(round uint32, to int) error
}

// Dead agrees with the other live ranks on which ranks are dead, and returns that set:
// the same on every rank that returns no error.
func Dead(ctx context.Context, cfg Config) (Set, error) {
	a := &agreement{cfg: cfg, words: (len(cfg.Ranks) + 63) / 64}
	return a.run(ctx)
}

func (a *agreement) hook(round uint32, to int) error {
	if a.cfg.Hook == nil {
		return nil
	}
	return a.cfg.Hook(round, to)
}

// Set is a set of ranks of a communicator, as bits.
type Set []uint64

func (s Set) Has(q int) bool { return s[q/64]&(1<<(q%64)) != 0 }
func (s Set) add(q int)      { s[q/64] |= 1 << (q % 64) }
func (s Set) union(o Set) {
	for i := range s {
		s[i] |= o[i]
	}
}
func (s Set) Count() int {
	n := 0
	for _, w := range s {
		n += bits.OnesCount64(w)
	}
	return n
}

// Tags of the agreement's messages (Seq is the round; decisions go with Seq 0).
const (
	agreeProposal = 1
	agreeDecision = 2
)

// agreement is one consensus on the dead ranks.
type agreement struct {
	cfg   Config
	words int // uint64 words of a Set

	tctx   context.Context // the deadline
	wctx   context.Context // every wait; cancelled when the agreement ends
	events chan agreeEvent
	// known: dead, as far as this rank knows; decided: ranks whose decision arrived (or
	// whose receive of it failed).
	known, decided Set
	wg             sync.WaitGroup
	sends          []transport.Request
	// sendBufs keeps the messages alive until their sends complete.
	sendBufs [][]byte
}

// agreeEvent is a receive that completed: a proposal of round Round, or a decision
// (Round 0), from rank From; or the failure of that receive.
type agreeEvent struct {
	from  int
	round uint32
	set   Set
	err   error
}

func (a *agreement) newSet() Set { return make(Set, a.words) }

func (a *agreement) encode(s Set) []byte {
	b := make([]byte, 8*len(s))
	for i, w := range s {
		for j := 0; j < 8; j++ {
			b[8*i+j] = byte(w >> (8 * j))
		}
	}
	return b
}

func (a *agreement) decode(b []byte) Set {
	s := a.newSet()
	for i := range s {
		for j := 0; j < 8; j++ {
			s[i] |= uint64(b[8*i+j]) << (8 * j)
		}
	}
	return s
}

func (a *agreement) tag(round uint32, kind uint32) transport.Tag {
	return transport.Tag{Comm: a.cfg.ID, Seq: round, Tag: kind}
}

// send posts msg to rank q; a failure to post means q is gone (returned) or worse.
func (a *agreement) send(q int, round, kind uint32, s Set) error {
	b := a.encode(s)
	r, err := a.cfg.Transport.Isend(a.cfg.Ranks[q], a.tag(round, kind), b)
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
	r, err := a.cfg.Transport.Irecv(a.cfg.Ranks[q], a.tag(round, kind), b)
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
func (a *agreement) run(ctx context.Context) (Set, error) {
	p, me := len(a.cfg.Ranks), a.cfg.Rank
	tctx, cancelT := context.WithTimeout(ctx, a.cfg.Timeout)
	defer cancelT()
	var cancelW context.CancelFunc
	a.tctx = tctx
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
	a.known = a.newSet()
	// A decision may come from any rank at any point: a receive for one is posted at
	// each peer from the start.
	a.decided = a.newSet()
	for q := 0; q < p; q++ {
		if q != me {
			a.recv(q, 0, agreeDecision)
		}
	}
	decision, decider, err := a.rounds()
	if err == nil {
		err = a.hook(0, -1)
	}
	if err != nil {
		return a.fail(err)
	}
	if decision.Has(me) {
		return a.fail(fmt.Errorf("%w: rank %d, by the decision of rank %d", ErrExcluded, me, max(decider, me)))
	}
	if err := a.confirm(decision); err != nil {
		return a.fail(err)
	}
	return decision, nil
}

// fail is the error that ends the agreement: the deadline's where it passed.
func (a *agreement) fail(err error) (Set, error) {
	if a.tctx.Err() != nil && !errors.Is(err, ErrAgreement) {
		err = fmt.Errorf("coll: agreeing on the survivors: %w", transport.CtxError(a.tctx.Err()))
	}
	return nil, err
}

// detect takes err of an operation with rank q: q is dead (nil), or err is worse.
func (a *agreement) detect(q int, err error) error {
	if !gone(err) {
		return err
	}
	a.known.add(q)
	return nil
}

// next is the next receive that completed.
func (a *agreement) next() (agreeEvent, error) {
	select {
	case ev := <-a.events:
		return ev, nil
	case <-a.tctx.Done():
		return agreeEvent{}, a.tctx.Err()
	}
}

// rounds runs the rounds of proposals until this rank decides (it heard from the same
// ranks in two rounds in a row) or takes another rank's decision (decider).
func (a *agreement) rounds() (decision Set, decider int, err error) {
	p := len(a.cfg.Ranks)
	prevFrom := a.newSet()
	for q := 0; q < p; q++ {
		prevFrom.add(q)
	}
	for round := uint32(1); ; round++ {
		if int(round) > p+1 {
			// Each round that does not decide saw a death; there are at most p-1.
			return nil, -1, fmt.Errorf("%w: no decision after %d rounds", ErrAgreement, round-1)
		}
		from, props, pending, err := a.propose(round)
		if err != nil {
			return nil, -1, err
		}
		for ; pending > 0; pending-- {
			ev, err := a.next()
			if err != nil {
				return nil, -1, err
			}
			if ev.round == 0 { // a decision
				a.decided.add(ev.from)
				if ev.err == nil {
					return ev.set, ev.from, nil
				}
				if err := a.detect(ev.from, ev.err); err != nil {
					return nil, -1, err
				}
				pending++ // still waiting for the proposals
				continue
			}
			if ev.err != nil {
				if err := a.detect(ev.from, ev.err); err != nil {
					return nil, -1, err
				}
				continue
			}
			from.add(ev.from)
			props.union(ev.set)
		}
		if slices.Equal(from, prevFrom) {
			return props, -1, nil
		}
		prevFrom = from
		a.known.union(props)
	}
}

// propose sends round's proposal (the ranks known dead) to every rank believed alive
// and posts the receives of theirs; it returns who this rank heard from so far (itself),
// the union of the proposals (its own), and how many receives are pending.
func (a *agreement) propose(round uint32) (from, props Set, pending int, err error) {
	p, me := len(a.cfg.Ranks), a.cfg.Rank
	msg := slices.Clone(a.known)
	from = a.newSet()
	from.add(me)
	props = slices.Clone(a.known)
	for q := 0; q < p; q++ {
		if q == me || a.known.Has(q) {
			continue
		}
		if err := a.hook(round, q); err != nil {
			return nil, nil, 0, err
		}
		if err := a.send(q, round, agreeProposal, msg); err != nil {
			if err := a.detect(q, err); err != nil {
				return nil, nil, 0, err
			}
			continue
		}
		a.recv(q, round, agreeProposal)
		pending++
	}
	return from, props, pending, a.hook(round, -1)
}

// confirm tells every rank that may still wait (also those the decision leaves out, so
// that they learn it at once), then hears every member's decision: the same, or there
// is no agreement.
func (a *agreement) confirm(decision Set) error {
	p, me := len(a.cfg.Ranks), a.cfg.Rank
	for q := 0; q < p; q++ {
		if q == me || a.known.Has(q) {
			continue
		}
		if err := a.send(q, 0, agreeDecision, decision); err != nil {
			if err := a.detect(q, err); err != nil {
				return err
			}
		}
	}
	waiting := 0
	for q := 0; q < p; q++ {
		if q != me && !decision.Has(q) && !a.decided.Has(q) {
			waiting++
		}
	}
	for waiting > 0 {
		ev, err := a.next()
		if err != nil {
			return err
		}
		if ev.round != 0 || decision.Has(ev.from) || a.decided.Has(ev.from) {
			continue // a proposal of a round left behind, or a rank outside
		}
		a.decided.add(ev.from)
		waiting--
		switch {
		case ev.err != nil && gone(ev.err):
			// It died after the decision: the new communicator names it.
		case ev.err != nil:
			return ev.err
		case !slices.Equal(ev.set, decision):
			return fmt.Errorf("%w: rank %d decided that %d ranks are gone, this rank %d", ErrAgreement, ev.from, ev.set.Count(), decision.Count())
		}
	}
	return nil
}
