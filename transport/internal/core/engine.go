package core

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/internal/wire"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
)

// Engine is the point-to-point protocol that the frame-based transports (shm, tcp) share:
// matching messages to receives by key, keeping the messages that arrive first, the eager
// path, the rendezvous (an announcement, the receiver's request for the data or its copy
// of it, then completion), per-message notices, cancellation with a grace period, failing
// every operation pending with a dead peer, and the request pools.
//
// It does no I/O. Each peer has a Link: the edges that put frames on the wire, move bulk
// data and declare the peer dead. The transport decodes the frames it receives and calls
// the Engine's handlers (Eager, Announced, ClearToSend, Copied, Data, Notice). X and Y are
// the link's own state in each send and receive request.
//
// A withdrawn announcement is acknowledged: a sender that cancels a send whose
// announcement is out asks the receiver to give it back and waits for the answer (the
// receiver may be reading the sender's memory). A cancelled send is thus either never
// delivered, or delivered whole.
type Engine[X, Y any] struct {
	// Rank is this process's rank; Name names the transport in logs ("moex <Name>: ...").
	Rank int
	Name string
	// EagerMax is the largest message sent eagerly; larger ones are announced.
	EagerMax int
	// Pool holds the payloads of eager messages that arrive before their receive.
	Pool *obuf.Pool
	// Closed reports that the transport is closing: pending messages are dropped.
	Closed func() bool
	// Await waits for a request (polling, or driving the transport's progress); it
	// returns ctx's error if ctx ends first.
	Await func(ctx context.Context, r *Req) error
	// GracePoller waits out a cancelled transfer already under way, for at most Grace
	// before the peer is failed.
	GracePoller *busypoll.Poller
	Grace       time.Duration
	Log         *slog.Logger

	sends     Table[Send[X, Y]]
	recvs     Table[Recv[X, Y]]
	freeSends FreeList[*Send[X, Y]]
	freeRecvs FreeList[*Recv[X, Y]]
	freeUnexp FreeList[*unexpected]
}

// Link is what the Engine needs from a transport to reach one peer. The Engine calls the
// methods marked "under the peer's lock" with Peer's lock held, so that a peer that dies
// meanwhile cannot miss what they queue; they must not call back into the Engine for the
// same peer.
type Link[X, Y any] interface {
	// Eager sends the frame h (TypeEager, the message in s.Buf). It reports whether the
	// message left s.Buf now; otherwise the link completes s (Complete(len(s.Buf), nil))
	// once it has. Under the peer's lock.
	Eager(h wire.Header, s *Send[X, Y]) bool
	// Announce sends the frame h (TypeRTS, the length in Aux, s.ID in ID). Under the
	// peer's lock.
	Announce(h wire.Header, s *Send[X, Y])
	// Withdraw removes s's frame if it is still queued, unsent, and reports whether it was.
	// Under the peer's lock.
	Withdraw(s *Send[X, Y]) bool
	// Pull fetches a matched announced message into r.Buf[:r.Total]: it asks the sender to
	// send it (a TypeCTS frame naming r's id from Engine.Register) or copies it itself
	// and then calls Engine.Pulled. Under the peer's lock.
	Pull(r *Recv[X, Y])
	// Push starts sending s.Buf to the receive recvID, which asked for it; the link calls
	// Engine.Pushed when the last byte is out. Under the peer's lock.
	Push(s *Send[X, Y], recvID uint64)
	// Notify sends a per-message notice (TypeAbort with a message id).
	Notify(id, code uint64, reason string)
	// Drop hands every eager send the link still holds to f and forgets them: the peer
	// is dead.
	Drop(f func(*Send[X, Y]))
	// Fail declares the peer dead with err; the transport then calls MarkDead and Reap.
	Fail(err error)
}

// Source is the payload of the frame being handled, as the transport reads it.
type Source interface {
	// CopyTo fills dst (the whole payload) and verifies it.
	CopyTo(dst []byte) error
	// Discard skips the payload.
	Discard() error
}

// Peer is the Engine's state for one peer. Its lock orders before any lock of the link.
type Peer[X, Y any] struct {
	Rank int
	Link Link[X, Y]

	mu     sync.Mutex
	posted Queue[*Recv[X, Y]]
	unexp  Queue[*unexpected]
	dead   error
}

// NewPeer returns the state for peer rank, reached through link.
func NewPeer[X, Y any](rank int, link Link[X, Y]) *Peer[X, Y] {
	return &Peer[X, Y]{Rank: rank, Link: link, posted: NewQueue[*Recv[X, Y]](1), unexp: NewQueue[*unexpected](1)}
}

// Dead reports the error the peer was marked dead with, or nil.
func (p *Peer[X, Y]) Dead() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dead
}

// unexpected is a message (an eager payload, or an announcement) that arrived before its
// receive.
type unexpected struct {
	tag      transport.Tag
	eager    *obuf.Buf
	rts      bool
	senderID uint64
	length   int
	cookie   uint64
}

type sendState uint8

const (
	ssEager     sendState = iota + 1 // eager frame queued or being sent
	ssAnnounced                      // announcement queued or sent, not yet answered
	ssStreaming                      // the receiver asked for the data: the link pushes it
	ssDone                           // withdrawn, rejected or failed
)

// Send is a send request. The Engine owns it from Isend until Wait returns.
type Send[X, Y any] struct {
	Req
	e         *Engine[X, Y]
	P         *Peer[X, Y]
	Tag       transport.Tag
	Buf       []byte
	ID        uint64    // while announced or pushed: its id in the table of sends
	state     sendState // guarded by P.mu
	canceling bool      // guarded by P.mu
	X         X
}

// Recv is a receive request. The Engine owns it from Irecv until Wait returns.
type Recv[X, Y any] struct {
	Req
	e        *Engine[X, Y]
	P        *Peer[X, Y]
	Tag      transport.Tag
	Buf      []byte
	ID       uint64 // while registered: its id in the table of receives
	SenderID uint64 // the announcing send's id
	Total    int    // the announced length
	Cookie   uint64 // what the announcement carried besides its length (shm: an address)
	got      atomic.Int64
	Y        Y
}

// errWithdrawn completes a send whose announcement the receiver gave back.
var errWithdrawn = errors.New("send withdrawn")

// ---- the caller's side ----

// Isend starts sending buf to p under tag.
func (e *Engine[X, Y]) Isend(p *Peer[X, Y], tag transport.Tag, buf []byte) *Send[X, Y] {
	s := e.getSend()
	s.P, s.Tag, s.Buf = p, tag, buf
	h := wire.Header{Comm: tag.Comm, Src: uint32(e.Rank), Seq: tag.Seq, Tag: tag.Tag, Sig: tag.Sig}
	p.mu.Lock()
	if p.dead != nil {
		err := e.peerErr(p, "send")
		p.mu.Unlock()
		s.Complete(0, err)
		return s
	}
	if len(buf) <= e.EagerMax {
		s.state = ssEager
		h.Type, h.Length = wire.TypeEager, uint64(len(buf))
		done := p.Link.Eager(h, s)
		p.mu.Unlock()
		if done {
			s.Complete(len(buf), nil)
		}
		return s
	}
	s.state = ssAnnounced
	s.ID = e.sends.Put(s)
	h.Type, h.ID, h.Aux = wire.TypeRTS, s.ID, uint64(len(buf))
	p.Link.Announce(h, s)
	p.mu.Unlock()
	return s
}

// Irecv posts a receive of up to len(buf) bytes from p under tag.
func (e *Engine[X, Y]) Irecv(p *Peer[X, Y], tag transport.Tag, buf []byte) *Recv[X, Y] {
	r := e.getRecv()
	r.P, r.Tag, r.Buf = p, tag, buf
	p.mu.Lock()
	if u, ok := p.unexp.Take(0, tag.Key()); ok {
		if u.rts {
			e.matchAnnouncedLocked(p, r, u.tag, u.senderID, u.length, u.cookie)
			p.mu.Unlock()
			e.putUnexpected(u)
			return r
		}
		p.mu.Unlock()
		n, err := checkMatch(p.Rank, r, u.tag, u.eager.Len())
		if err == nil {
			copy(r.Buf, u.eager.Bytes())
		}
		e.putUnexpected(u)
		r.Complete(n, err)
		return r
	}
	if p.dead != nil {
		err := e.peerErr(p, "recv")
		p.mu.Unlock()
		r.Complete(0, err)
		return r
	}
	p.posted.Push(0, tag.Key(), r)
	p.mu.Unlock()
	return r
}

// Wait implements transport.Request. If ctx ends first, a send not yet under way is
// withdrawn and Wait returns ctx's error; one under way gets the grace period to finish.
func (s *Send[X, Y]) Wait(ctx context.Context) (int, error) {
	e := s.e
	if err := e.Await(ctx, &s.Req); err != nil {
		if s.cancel() {
			e.putSend(s)
			return 0, transport.CtxError(err)
		}
		s.AwaitGrace(e.GracePoller, e.graceFor(ctx), "transfer", s.P.Link.Fail)
		if _, rerr := s.Result(); rerr == errWithdrawn {
			e.putSend(s)
			return 0, transport.CtxError(err)
		}
	}
	n, err := s.Result()
	e.putSend(s)
	return n, err
}

// cancel withdraws the send if its frame is still queued; an announcement that is out is
// asked back (Wait then waits for the answer). It reports whether the send is withdrawn.
func (s *Send[X, Y]) cancel() bool {
	p := s.P
	p.mu.Lock()
	defer p.mu.Unlock()
	if s.Test() {
		return false
	}
	switch s.state {
	case ssEager:
		if p.Link.Withdraw(s) {
			s.state = ssDone
			return true
		}
	case ssAnnounced:
		if p.Link.Withdraw(s) {
			s.state = ssDone
			s.e.sends.Delete(s.ID)
			return true
		}
		if !s.canceling && p.dead == nil && !s.e.Closed() {
			s.canceling = true
			p.Link.Notify(s.ID, NoticeCanceled, "send cancelled")
		}
	}
	return false
}

// Wait implements transport.Request. If ctx ends first, a receive not yet matched is
// withdrawn and Wait returns ctx's error; one matched gets the grace period to finish.
func (r *Recv[X, Y]) Wait(ctx context.Context) (int, error) {
	e := r.e
	if err := e.Await(ctx, &r.Req); err != nil {
		if r.cancel() {
			e.putRecv(r)
			return 0, transport.CtxError(err)
		}
		r.AwaitGrace(e.GracePoller, e.graceFor(ctx), "receive", r.P.Link.Fail)
	}
	n, err := r.Result()
	e.putRecv(r)
	return n, err
}

func (r *Recv[X, Y]) cancel() bool {
	p := r.P
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.posted.Remove(0, r)
}

// graceFor is how long a cancelled transfer already under way may take to finish before
// its peer is failed: the grace period, but only a moment when ctx ended because an
// operation made no progress for its whole timeout (a peer is stuck; waiting longer only
// delays every rank's error).
func (e *Engine[X, Y]) graceFor(ctx context.Context) time.Duration {
	if errors.Is(context.Cause(ctx), transport.ErrTimeout) {
		return min(e.Grace, 100*time.Millisecond)
	}
	return e.Grace
}

// ---- frames from the peer ----

// Eager handles an eager message of n bytes under tag. It reports whether it woke a parked
// waiter; an error (from src) means the peer's stream cannot be trusted: fail the peer.
func (e *Engine[X, Y]) Eager(p *Peer[X, Y], tag transport.Tag, n int, src Source) (woke bool, err error) {
	p.mu.Lock()
	r, ok := p.posted.Take(0, tag.Key())
	p.mu.Unlock()
	if ok {
		return e.deliver(p, r, tag, n, src)
	}
	b := e.Pool.Get(n)
	if err := src.CopyTo(b.Bytes()); err != nil {
		b.Release()
		return false, err
	}
	p.mu.Lock()
	if r, ok := p.posted.Take(0, tag.Key()); ok { // posted while the payload was read
		p.mu.Unlock()
		k, err := checkMatch(p.Rank, r, tag, n)
		if err == nil {
			copy(r.Buf, b.Bytes())
		}
		b.Release()
		return r.Complete(k, err), nil
	}
	u := e.getUnexpected()
	u.tag, u.eager = tag, b
	p.unexp.Push(0, tag.Key(), u)
	p.mu.Unlock()
	return false, nil
}

// deliver reads an eager payload straight into the receive it matched.
func (e *Engine[X, Y]) deliver(p *Peer[X, Y], r *Recv[X, Y], tag transport.Tag, n int, src Source) (bool, error) {
	k, err := checkMatch(p.Rank, r, tag, n)
	if err != nil {
		if derr := src.Discard(); derr != nil {
			r.Complete(0, err)
			return false, derr
		}
		return r.Complete(0, err), nil
	}
	if err := src.CopyTo(r.Buf[:n]); err != nil {
		// Matched but not complete: registered, the receive completes when the peer is
		// reaped.
		p.mu.Lock()
		r.ID = e.recvs.Put(r)
		p.mu.Unlock()
		return false, err
	}
	return r.Complete(k, nil), nil
}

// Announced handles the announcement of a message of size bytes (as the wire says it;
// more than wire.MaxLength is a protocol error), the peer's send senderID, with what it
// carried besides (cookie).
func (e *Engine[X, Y]) Announced(p *Peer[X, Y], tag transport.Tag, senderID, size, cookie uint64) error {
	if size > wire.MaxLength {
		return fmt.Errorf("%w: RTS announces %d bytes", transport.ErrProtocol, size)
	}
	length := int(size)
	p.mu.Lock()
	defer p.mu.Unlock()
	if r, ok := p.posted.Take(0, tag.Key()); ok {
		e.matchAnnouncedLocked(p, r, tag, senderID, length, cookie)
		return nil
	}
	u := e.getUnexpected()
	u.tag, u.rts, u.senderID, u.length, u.cookie = tag, true, senderID, length, cookie
	p.unexp.Push(0, tag.Key(), u)
	return nil
}

// matchAnnouncedLocked pairs an announced message with receive r: the link pulls it, or a
// notice rejects it. Under p.mu.
func (e *Engine[X, Y]) matchAnnouncedLocked(p *Peer[X, Y], r *Recv[X, Y], tag transport.Tag, senderID uint64, length int, cookie uint64) {
	if _, err := checkMatch(p.Rank, r, tag, length); err != nil {
		p.Link.Notify(senderID, RejectNotice(err), err.Error())
		r.Complete(0, err)
		return
	}
	r.Total, r.SenderID, r.Cookie = length, senderID, cookie
	r.got.Store(0)
	p.Link.Pull(r)
}

// Register gives r an id the peer's data frames name, until it completes (Data) or the
// peer is reaped. Links call it from Pull before asking for the data.
func (e *Engine[X, Y]) Register(r *Recv[X, Y]) uint64 {
	r.ID = e.recvs.Put(r)
	return r.ID
}

// Pulled completes a receive whose Pull copied the message itself (err: the copy failed),
// and returns whether a parked waiter woke. The link tells the sender (Copied) itself.
func (e *Engine[X, Y]) Pulled(r *Recv[X, Y], err error) bool {
	if err != nil {
		return r.Complete(0, err)
	}
	return r.Complete(r.Total, nil)
}

// ClearToSend handles the receiver's request for the data of send sendID, into its
// receive recvID.
func (e *Engine[X, Y]) ClearToSend(p *Peer[X, Y], sendID, recvID uint64) {
	s := e.sends.Get(sendID)
	if s == nil || s.P != p {
		return // withdrawn; the receiver got our notice
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if s.state != ssAnnounced || p.dead != nil {
		return
	}
	s.state = ssStreaming
	p.Link.Push(s, recvID)
}

// Pushed completes send s, whose data the link has sent whole.
func (e *Engine[X, Y]) Pushed(s *Send[X, Y]) bool {
	e.sends.Delete(s.ID)
	return s.Complete(len(s.Buf), nil)
}

// Copied handles the receiver's word that it copied send sendID's buffer itself.
func (e *Engine[X, Y]) Copied(p *Peer[X, Y], sendID uint64) bool {
	s := e.sends.Get(sendID)
	if s == nil || s.P != p {
		return false
	}
	p.mu.Lock()
	if s.state != ssAnnounced {
		p.mu.Unlock()
		return false
	}
	s.state = ssDone
	e.sends.Delete(sendID)
	p.mu.Unlock()
	return s.Complete(len(s.Buf), nil)
}

// Data handles n bytes of the message into receive recvID at offset off. Frames of one
// message may be handled concurrently (from several streams).
func (e *Engine[X, Y]) Data(p *Peer[X, Y], recvID uint64, off uint64, n int, src Source) (woke bool, err error) {
	r := e.recvs.Get(recvID)
	if r == nil || r.P != p {
		return false, fmt.Errorf("%w: data for unknown receive %#x", transport.ErrProtocol, recvID)
	}
	total := r.Total
	if off > uint64(total) || n > total-int(off) {
		return false, fmt.Errorf("%w: data [%d,+%d) outside a %d-byte message", transport.ErrProtocol, off, n, total)
	}
	if err := src.CopyTo(r.Buf[off : int(off)+n]); err != nil {
		return false, err
	}
	// Other streams may finish the message concurrently: touch r afterwards only if these
	// bytes were the last.
	if r.got.Add(int64(n)) == int64(total) {
		e.recvs.Delete(recvID)
		return r.Complete(total, nil), nil
	}
	return false, nil
}

// Notice handles a per-message notice from the peer.
func (e *Engine[X, Y]) Notice(p *Peer[X, Y], id, code uint64, reason string) {
	switch code {
	case NoticeTruncated, NoticeMismatch, NoticeCancelAck:
		s := e.sends.Get(id)
		if s == nil || s.P != p {
			return
		}
		p.mu.Lock()
		if s.state != ssAnnounced {
			p.mu.Unlock()
			return
		}
		s.state = ssDone
		e.sends.Delete(id)
		p.mu.Unlock()
		err := errWithdrawn
		if code != NoticeCancelAck {
			err = Rejected(p.Rank, code, reason)
		}
		s.Complete(0, err)
	case NoticeCanceled:
		// Still unmatched: forget it and give it back. Otherwise the transfer is under
		// way, and its completion answers the sender.
		p.mu.Lock()
		for _, en := range p.unexp.Entries(0) {
			if u := en.V; u.rts && u.senderID == id {
				p.unexp.Remove(0, u)
				p.mu.Unlock()
				e.putUnexpected(u)
				p.Link.Notify(id, NoticeCancelAck, "")
				return
			}
		}
		p.mu.Unlock()
	}
}

// ---- failure ----

// MarkDead records that p is dead with err; operations started from now on complete with
// a PeerError at once. It reports whether p was alive. Call Reap once nothing of the
// link's touches a buffer of p's requests any more.
func (e *Engine[X, Y]) MarkDead(p *Peer[X, Y], err error) bool {
	p.mu.Lock()
	first := p.dead == nil
	if first {
		p.dead = err
	}
	p.mu.Unlock()
	if !first {
		return false
	}
	switch {
	case err == transport.ErrClosed:
	case errors.Is(err, transport.ErrPeerLeft): // its Close: every rank logs this at a clean end
		e.Log.Debug("moex "+e.Name+": peer left", "rank", e.Rank, "peer", p.Rank)
	default:
		e.Log.Info("moex "+e.Name+": peer failed", "rank", e.Rank, "peer", p.Rank, "err", err)
	}
	return true
}

// Reap completes every operation pending with dead peer p with a PeerError (ErrClosed when
// this transport is closing). Messages p sent before it died stay deliverable;
// announcements cannot be, and go.
func (e *Engine[X, Y]) Reap(p *Peer[X, Y]) {
	var recvs []*Recv[X, Y]
	var sends []*Send[X, Y]
	p.mu.Lock()
	recvErr, sendErr := e.peerErr(p, "recv"), e.peerErr(p, "send")
	p.posted.Drain(0, func(r *Recv[X, Y]) { recvs = append(recvs, r) })
	var keep []*unexpected
	p.unexp.Drain(0, func(u *unexpected) {
		if u.rts || e.Closed() {
			e.putUnexpected(u)
		} else {
			keep = append(keep, u)
		}
	})
	for _, u := range keep {
		p.unexp.Push(0, u.tag.Key(), u)
	}
	// Done under p.mu: a waiter's cancel must not withdraw and recycle a request that is
	// about to be completed here.
	sends = e.sends.Extract(func(s *Send[X, Y]) bool { return s.P == p }, sends)
	for _, s := range sends {
		s.state = ssDone
	}
	recvs = e.recvs.Extract(func(r *Recv[X, Y]) bool { return r.P == p }, recvs)
	p.mu.Unlock()
	p.Link.Drop(func(s *Send[X, Y]) { sends = append(sends, s) })
	for _, r := range recvs {
		r.Complete(0, recvErr)
	}
	for _, s := range sends {
		s.Complete(0, sendErr)
	}
}

// PeerErr is the error an operation with dead peer p completes with.
func (e *Engine[X, Y]) PeerErr(p *Peer[X, Y], op string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return e.peerErr(p, op)
}

func (e *Engine[X, Y]) peerErr(p *Peer[X, Y], op string) error {
	if p.dead == transport.ErrClosed && e.Closed() {
		return transport.ErrClosed
	}
	return &transport.PeerError{Rank: p.Rank, Op: op, Err: p.dead}
}

// ---- pools ----

func checkMatch[X, Y any](peerRank int, r *Recv[X, Y], tag transport.Tag, n int) (int, error) {
	if err := CheckMatch(peerRank, r.Tag, tag, n, len(r.Buf)); err != nil {
		return 0, err
	}
	return n, nil
}

func (e *Engine[X, Y]) getSend() *Send[X, Y] {
	s, ok := e.freeSends.Get()
	if !ok {
		s = &Send[X, Y]{e: e}
		s.Init()
	}
	return s
}

func (e *Engine[X, Y]) putSend(s *Send[X, Y]) {
	s.Reset()
	s.P, s.Buf, s.ID, s.state, s.canceling = nil, nil, 0, 0, false
	e.freeSends.Put(s)
}

func (e *Engine[X, Y]) getRecv() *Recv[X, Y] {
	r, ok := e.freeRecvs.Get()
	if !ok {
		r = &Recv[X, Y]{e: e}
		r.Init()
	}
	return r
}

func (e *Engine[X, Y]) putRecv(r *Recv[X, Y]) {
	r.Reset()
	r.P, r.Buf, r.ID, r.SenderID, r.Total, r.Cookie = nil, nil, 0, 0, 0, 0
	e.freeRecvs.Put(r)
}

func (e *Engine[X, Y]) getUnexpected() *unexpected {
	if u, ok := e.freeUnexp.Get(); ok {
		return u
	}
	return new(unexpected)
}

func (e *Engine[X, Y]) putUnexpected(u *unexpected) {
	if u.eager != nil {
		u.eager.Release()
	}
	*u = unexpected{}
	e.freeUnexp.Put(u)
}
