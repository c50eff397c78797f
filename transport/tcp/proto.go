package tcp

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moex-ai/moex/internal/wire"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/internal/core"
)

// maxEager bounds an eager frame's payload, whatever a peer claims.
const maxEager = 16 << 20

// A TypeAbort frame with a non-zero ID is a per-message notice: its code (core.Notice*)
// in Aux.

// peer is the state shared by the streams to one rank. mu guards the matching queues,
// dead and reaped.
type peer struct {
	t       *Transport
	rank    int
	streams []*stream

	mu     sync.Mutex
	posted core.Queue[*recvReq]
	unexp  core.Queue[*unexpected]
	dead   error
	reaped bool

	quit     chan struct{}
	once     sync.Once
	graceful bool
	active   atomic.Int32
}

// unexpected is a message (eager payload, or a rendezvous announcement) that arrived
// before its receive.
type unexpected struct {
	tag      transport.Tag
	eager    *obuf.Buf
	rts      bool
	senderID uint64
	length   int
}

func (p *peer) start() {
	p.quit = make(chan struct{})
	p.active.Store(int32(2 * len(p.streams)))
	for _, s := range p.streams {
		p.t.wg.Add(2)
		go s.readLoop()
		go s.writeLoop()
	}
}

func (p *peer) isQuitting() bool {
	select {
	case <-p.quit:
		return true
	default:
		return false
	}
}

// fail marks the peer dead because of err (seen by one of its goroutines) and stops its
// streams. Pending operations complete when the last goroutine has exited.
func (p *peer) fail(err error) { p.shutdown(err, false) }

// leave is this rank closing (graceful: with a bye) or crashing.
func (p *peer) leave(graceful bool) { p.shutdown(transport.ErrClosed, graceful) }

func (p *peer) shutdown(err error, graceful bool) {
	p.once.Do(func() {
		p.mu.Lock()
		p.dead = err
		p.mu.Unlock()
		p.graceful = graceful
		if graceful {
			for _, s := range p.streams {
				f := &frame{kind: fkOwned, bye: true}
				h := wire.Header{Type: wire.TypeBye, Src: uint32(p.t.rank)}
				h.Encode(f.hdr[:])
				s.enqueueCtl(f)
			}
		}
		switch {
		case err == transport.ErrClosed:
		case errors.Is(err, transport.ErrPeerLeft): // its Close: every rank logs this at a clean end
			p.t.log.Debug("moex tcp: peer left", "rank", p.t.rank, "peer", p.rank)
		default:
			p.t.log.Info("moex tcp: peer failed", "rank", p.t.rank, "peer", p.rank, "err", err)
		}
		close(p.quit)
		if !graceful {
			for _, s := range p.streams {
				_ = s.conn.Close()
			}
		}
	})
}

// exited is called by each stream goroutine on its way out; the last one reaps.
func (p *peer) exited() {
	defer p.t.wg.Done()
	if p.active.Add(-1) == 0 {
		p.reap()
	}
}

// peerErr is the error pending operations with this peer complete with.
func (p *peer) peerErr(op string) error {
	if p.dead == transport.ErrClosed && p.t.closed.Load() {
		return transport.ErrClosed
	}
	return &transport.PeerError{Rank: p.rank, Op: op, Err: p.dead}
}

// reap completes every operation still pending with the peer. No stream goroutine of the
// peer runs any more, so nothing writes into a receive buffer or reads a send buffer.
func (p *peer) reap() {
	for _, s := range p.streams {
		_ = s.conn.Close()
	}
	t := p.t
	p.mu.Lock()
	p.reaped = true
	recvErr, sendErr := p.peerErr("recv"), p.peerErr("send")
	var done []func()
	p.posted.Drain(0, func(r *recvReq) { done = append(done, func() { r.Complete(0, recvErr) }) })
	// Messages the peer sent before it left stay deliverable (Irecv looks at them before it
	// looks at dead); announcements of large ones cannot be, and go. A closing transport
	// drops everything.
	var keep []*unexpected
	p.unexp.Drain(0, func(u *unexpected) {
		if u.rts || t.closed.Load() {
			t.putUnexpected(u)
		} else {
			keep = append(keep, u)
		}
	})
	for _, u := range keep {
		p.unexp.Push(0, u.tag.Key(), u)
	}
	for _, s := range p.streams {
		s.qmu.Lock()
		for f := s.ctlHead; f != nil; f = f.next {
			if f.kind == fkEager {
				sr := f.send
				done = append(done, func() { sr.Complete(0, sendErr) })
			}
		}
		if f := s.partial; f != nil && f.kind == fkEager {
			sr := f.send
			done = append(done, func() { sr.Complete(0, sendErr) })
		}
		s.ctlHead, s.ctlTail, s.partial = nil, nil, nil
		clear(s.bulk)
		s.bulk = s.bulk[:0]
		s.qmu.Unlock()
	}
	var sids, rids []uint64
	t.sends.Each(func(id uint64, sr *sendReq) {
		if sr.p == p {
			// Done here, under p.mu: a waiter's cancel must not withdraw and recycle the
			// request that the completion below is about to write.
			sr.state = ssDone
			sids = append(sids, id)
			done = append(done, func() { sr.Complete(0, sendErr) })
		}
	})
	t.recvs.Each(func(id uint64, r *recvReq) {
		if r.p == p {
			rids = append(rids, id)
			done = append(done, func() { r.Complete(0, recvErr) })
		}
	})
	for _, id := range sids {
		t.sends.Delete(id)
	}
	for _, id := range rids {
		t.recvs.Delete(id)
	}
	p.mu.Unlock()
	for _, f := range done {
		f()
	}
}

// handle processes one frame whose header the reader just consumed. It returns bye=true
// when the peer said goodbye.
func (p *peer) handle(s *stream, h *wire.Header) (bye bool, err error) {
	t := p.t
	tag := transport.Tag{Comm: h.Comm, Seq: h.Seq, Tag: h.Tag, Sig: h.Sig}
	n := int(h.Length)
	switch h.Type {
	case wire.TypeEager:
		if n > maxEager {
			return false, fmt.Errorf("%w: eager frame of %d bytes (limit %d)", transport.ErrProtocol, n, maxEager)
		}
		p.mu.Lock()
		r, ok := p.posted.Take(0, tag.Key())
		p.mu.Unlock()
		if ok {
			return false, p.deliverEager(s, h, r, tag)
		}
		b := t.pool.Get(n)
		if err := s.readInto(b.Bytes()); err != nil {
			b.Release()
			return false, readErr(err)
		}
		if err := h.Verify(b.Bytes()); err != nil {
			b.Release()
			return false, fmt.Errorf("%w: %v", transport.ErrProtocol, err)
		}
		p.mu.Lock()
		if r, ok := p.posted.Take(0, tag.Key()); ok { // posted while we were reading
			p.mu.Unlock()
			n, err := matchCheck(p.rank, r, tag, n)
			if err == nil {
				copy(r.buf, b.Bytes())
			}
			b.Release()
			s.woke = r.Complete(n, err)
			return false, nil
		}
		u := t.getUnexpected()
		u.tag, u.eager = tag, b
		p.unexp.Push(0, tag.Key(), u)
		p.mu.Unlock()
		return false, nil

	case wire.TypeRTS:
		if n != 0 {
			return false, fmt.Errorf("%w: RTS with payload", transport.ErrProtocol)
		}
		length := int(h.Aux)
		if h.Aux > wire.MaxLength {
			return false, fmt.Errorf("%w: RTS announces %d bytes", transport.ErrProtocol, h.Aux)
		}
		p.mu.Lock()
		r, ok := p.posted.Take(0, tag.Key())
		if !ok {
			u := t.getUnexpected()
			u.tag, u.rts, u.senderID, u.length = tag, true, h.ID, length
			p.unexp.Push(0, tag.Key(), u)
			p.mu.Unlock()
			return false, nil
		}
		p.matchRTSLocked(r, tag, h.ID, length)
		p.mu.Unlock()
		return false, nil

	case wire.TypeCTS:
		if n != 0 {
			return false, fmt.Errorf("%w: CTS with payload", transport.ErrProtocol)
		}
		sr := t.sends.Get(h.ID)
		if sr == nil || sr.p != p {
			return false, nil // withdrawn by the sender; the receiver got our notice
		}
		p.mu.Lock()
		if sr.state != ssAnnounced || p.dead != nil {
			p.mu.Unlock()
			return false, nil
		}
		sr.state = ssStreaming
		sr.recvID = h.Aux
		total := len(sr.buf)
		stripes := min(len(p.streams), max(1, total/minStripe))
		sr.stripes.Store(int32(stripes))
		per := (total + stripes - 1) / stripes
		for i := 0; i < stripes; i++ {
			off, end := i*per, min((i+1)*per, total)
			p.streams[i].enqueueBulk(dataJob{send: sr, off: off, end: end})
		}
		p.mu.Unlock()
		s.woke = true // let the writers we just woke have this CPU
		return false, nil

	case wire.TypeData:
		r := t.recvs.Get(h.ID)
		if r == nil || r.p != p {
			return false, fmt.Errorf("%w: data for unknown receive %#x", transport.ErrProtocol, h.ID)
		}
		off := int(h.Aux)
		if h.Aux > uint64(r.total) || n > r.total-off {
			return false, fmt.Errorf("%w: data [%d,+%d) outside a %d-byte message", transport.ErrProtocol, h.Aux, n, r.total)
		}
		dst := r.buf[off : off+n]
		if err := s.readInto(dst); err != nil {
			return false, readErr(err)
		}
		if err := h.Verify(dst); err != nil {
			return false, fmt.Errorf("%w: %v", transport.ErrProtocol, err)
		}
		// Other streams may finish the message concurrently: read what we need before our
		// bytes count, and touch r afterwards only if ours were the last.
		total, id := r.total, h.ID // r.id is written after the table publishes r
		if r.got.Add(int64(n)) == int64(total) {
			t.recvs.Delete(id)
			s.woke = r.Complete(total, nil)
		}
		return false, nil

	case wire.TypeAbort:
		reason := make([]byte, min(n, 4096))
		if err := s.readInto(reason); err != nil {
			return false, readErr(err)
		}
		if err := s.discard(n - len(reason)); err != nil {
			return false, readErr(err)
		}
		if h.ID == 0 {
			return false, fmt.Errorf("%w by rank %d: %s", transport.ErrAborted, p.rank, reason)
		}
		p.notice(h.ID, h.Aux, string(reason))
		return false, nil

	case wire.TypeBye:
		return true, nil
	}
	return false, fmt.Errorf("%w: unexpected %v frame", transport.ErrProtocol, h.Type)
}

// deliverEager reads an eager payload straight into the matched receive.
func (p *peer) deliverEager(s *stream, h *wire.Header, r *recvReq, tag transport.Tag) error {
	n := int(h.Length)
	k, err := matchCheck(p.rank, r, tag, n)
	if err != nil {
		if derr := s.discard(n); derr != nil {
			return readErr(derr)
		}
		r.Complete(0, err)
		return nil
	}
	if err := s.readInto(r.buf[:n]); err != nil {
		// The receive is matched but not complete: reap completes it once we are gone.
		p.mu.Lock()
		r.id = p.t.recvs.Put(r)
		p.mu.Unlock()
		return readErr(err)
	}
	if err := h.Verify(r.buf[:n]); err != nil {
		p.mu.Lock()
		r.id = p.t.recvs.Put(r)
		p.mu.Unlock()
		return fmt.Errorf("%w: %v", transport.ErrProtocol, err)
	}
	s.woke = r.Complete(k, nil)
	return nil
}

// matchCheck checks a message against the receive it matched.
func matchCheck(peerRank int, r *recvReq, tag transport.Tag, n int) (int, error) {
	if err := core.CheckMatch(peerRank, r.tag, tag, n, len(r.buf)); err != nil {
		return 0, err
	}
	return n, nil
}

// matchRTSLocked pairs an announced message with receive r: clear to send, or a notice
// that rejects it.
func (p *peer) matchRTSLocked(r *recvReq, tag transport.Tag, senderID uint64, length int) {
	t := p.t
	if _, err := matchCheck(p.rank, r, tag, length); err != nil {
		code := core.RejectNotice(err)
		p.streams[0].send(p.noticeFrame(senderID, code, err.Error()))
		r.Complete(0, err)
		return
	}
	r.total = length
	r.senderID = senderID
	r.got.Store(0)
	r.id = t.recvs.Put(r)
	h := wire.Header{Type: wire.TypeCTS, Comm: tag.Comm, Src: uint32(t.rank), Seq: tag.Seq, Tag: tag.Tag,
		Sig: tag.Sig, ID: senderID, Aux: r.id}
	h.Encode(r.cts.hdr[:])
	p.streams[0].send(&r.cts)
}

func (p *peer) noticeFrame(id, code uint64, reason string) *frame {
	f := &frame{kind: fkOwned, payload: []byte(reason)}
	h := wire.Header{Type: wire.TypeAbort, Src: uint32(p.t.rank), ID: id, Aux: code, Length: uint64(len(reason))}
	h.Encode(f.hdr[:])
	return f
}

// notice handles a per-message notice from the peer.
func (p *peer) notice(id, code uint64, reason string) {
	t := p.t
	switch code {
	case core.NoticeTruncated, core.NoticeMismatch:
		sr := t.sends.Get(id)
		if sr == nil || sr.p != p {
			return
		}
		p.mu.Lock()
		if sr.state != ssAnnounced {
			p.mu.Unlock()
			return
		}
		sr.state = ssDone
		t.sends.Delete(id)
		p.mu.Unlock()
		sr.Complete(0, core.Rejected(p.rank, code, reason))
	case core.NoticeCanceled:
		canceled := &transport.PeerError{Rank: p.rank, Op: "recv", Err: fmt.Errorf("%w: the sender withdrew the message", transport.ErrCanceled)}
		p.mu.Lock()
		// Still unmatched: forget the announcement.
		for i := 0; i < len(p.unexp.Entries(0)); i++ {
			u := p.unexp.Entries(0)[i].V
			if u.rts && u.senderID == id {
				p.unexp.Remove(0, u)
				t.putUnexpected(u)
				p.mu.Unlock()
				return
			}
		}
		var victim *recvReq
		t.recvs.Each(func(_ uint64, r *recvReq) {
			if r.p == p && r.senderID == id {
				victim = r
			}
		})
		if victim != nil {
			t.recvs.Delete(victim.id)
		}
		p.mu.Unlock()
		if victim != nil {
			victim.Complete(0, canceled)
		}
	}
}

// ---- requests ----

type sendState uint8

const (
	ssEager     sendState = iota + 1 // eager frame queued or being written
	ssAnnounced                      // RTS queued or sent, no CTS yet
	ssStreaming                      // data frames queued or being written
	ssDone
)

type sendReq struct {
	core.Req
	t       *Transport
	p       *peer
	tag     transport.Tag
	buf     []byte
	id      uint64
	recvID  uint64
	state   sendState // guarded by p.mu
	stripes atomic.Int32
	frame   frame
}

type recvReq struct {
	core.Req
	t        *Transport
	p        *peer
	tag      transport.Tag
	buf      []byte
	id       uint64
	senderID uint64
	total    int
	got      atomic.Int64
	cts      frame
}

func (t *Transport) getSend() *sendReq {
	s, ok := t.freeSends.Get()
	if !ok {
		s = &sendReq{t: t}
		s.Init()
	}
	return s
}

func (t *Transport) putSend(s *sendReq) {
	s.Reset()
	s.p, s.buf, s.id, s.recvID, s.state = nil, nil, 0, 0, 0
	s.frame.payload, s.frame.send, s.frame.next = nil, nil, nil
	t.freeSends.Put(s)
}

func (t *Transport) getRecv() *recvReq {
	r, ok := t.freeRecvs.Get()
	if !ok {
		r = &recvReq{t: t}
		r.cts.kind = fkCTS
		r.Init()
	}
	return r
}

func (t *Transport) putRecv(r *recvReq) {
	r.Reset()
	r.p, r.buf, r.id, r.senderID, r.total = nil, nil, 0, 0, 0
	t.freeRecvs.Put(r)
}

func (t *Transport) getUnexpected() *unexpected {
	if u, ok := t.freeUnexp.Get(); ok {
		return u
	}
	return new(unexpected)
}

func (t *Transport) putUnexpected(u *unexpected) {
	if u.eager != nil {
		u.eager.Release()
	}
	*u = unexpected{}
	t.freeUnexp.Put(u)
}

// Isend implements transport.Transport.
func (t *Transport) Isend(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	if err := transport.CheckPeer(peer, t.size); err != nil {
		return nil, err
	}
	if t.closed.Load() {
		return nil, transport.ErrClosed
	}
	if peer == t.rank {
		return t.self.Isend(0, tag, buf)
	}
	p := t.peers[peer]
	s := t.getSend()
	s.p, s.tag, s.buf = p, tag, buf
	f := &s.frame
	f.send = s
	h := wire.Header{Comm: tag.Comm, Src: uint32(t.rank), Seq: tag.Seq, Tag: tag.Tag, Sig: tag.Sig}
	eager := len(buf) <= t.eager
	if eager {
		h.Type, h.Length = wire.TypeEager, uint64(len(buf))
		if t.checksum {
			h.SetChecksum(buf)
		}
		f.kind, f.payload = fkEager, buf
	} else {
		h.Type, h.Aux = wire.TypeRTS, uint64(len(buf))
		f.kind, f.payload = fkRTS, nil
	}
	p.mu.Lock()
	if p.dead != nil {
		err := p.peerErr("send")
		p.mu.Unlock()
		s.Complete(0, err)
		return s, nil
	}
	if eager {
		s.state = ssEager
	} else {
		s.state = ssAnnounced
		s.id = t.sends.Put(s)
		h.ID = s.id
	}
	h.Encode(f.hdr[:])
	st := p.streams[0]
	done := st.send(f)
	p.mu.Unlock()
	if done && eager {
		s.Complete(len(buf), nil)
	}
	return s, nil
}

// Irecv implements transport.Transport.
func (t *Transport) Irecv(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	if err := transport.CheckPeer(peer, t.size); err != nil {
		return nil, err
	}
	if t.closed.Load() {
		return nil, transport.ErrClosed
	}
	if peer == t.rank {
		return t.self.Irecv(0, tag, buf)
	}
	p := t.peers[peer]
	r := t.getRecv()
	r.p, r.tag, r.buf = p, tag, buf
	p.mu.Lock()
	if u, ok := p.unexp.Take(0, tag.Key()); ok {
		if u.rts {
			p.matchRTSLocked(r, u.tag, u.senderID, u.length)
			p.mu.Unlock()
			t.putUnexpected(u)
			return r, nil
		}
		p.mu.Unlock()
		n, err := matchCheck(peer, r, u.tag, u.eager.Len())
		if err == nil {
			copy(r.buf, u.eager.Bytes())
		}
		t.putUnexpected(u)
		r.Complete(n, err)
		return r, nil
	}
	if p.dead != nil {
		err := p.peerErr("recv")
		p.mu.Unlock()
		r.Complete(0, err)
		return r, nil
	}
	p.posted.Push(0, tag.Key(), r)
	p.mu.Unlock()
	return r, nil
}

// Wait implements transport.Request.
func (s *sendReq) Wait(ctx context.Context) (int, error) {
	t := s.t
	if err := s.Await(ctx, t.waitPoller); err != nil {
		if s.cancel() {
			t.putSend(s)
			return 0, transport.CtxError(err)
		}
		s.AwaitGrace(t.waitPoller, t.graceFor(ctx), "transfer", s.p.fail)
	}
	n, err := s.Result()
	t.putSend(s)
	return n, err
}

// cancel withdraws the send if it is not yet being transferred.
func (s *sendReq) cancel() bool {
	p := s.p
	st := p.streams[0]
	p.mu.Lock()
	defer p.mu.Unlock()
	if s.Test() {
		return false
	}
	switch s.state {
	case ssEager:
		if st.removeCtl(&s.frame) {
			s.state = ssDone
			return true
		}
	case ssAnnounced:
		s.state = ssDone
		s.t.sends.Delete(s.id)
		if !st.removeCtl(&s.frame) {
			// The RTS is out: tell the receiver we withdrew it.
			st.send(p.noticeFrame(s.id, core.NoticeCanceled, "send cancelled"))
		}
		return true
	}
	return false
}

// graceFor is how long a cancelled transfer already on the wire may take to finish
// before its peer is declared dead (which completes it): the grace period, but only a
// moment when ctx ended because an operation made no progress for its whole timeout (a
// peer is stuck; waiting longer only delays every rank's error).
func (t *Transport) graceFor(ctx context.Context) time.Duration {
	if errors.Is(context.Cause(ctx), transport.ErrTimeout) {
		return min(t.grace, 100*time.Millisecond)
	}
	return t.grace
}

// Wait implements transport.Request.
func (r *recvReq) Wait(ctx context.Context) (int, error) {
	t := r.t
	if err := r.Await(ctx, t.waitPoller); err != nil {
		if r.cancel() {
			t.putRecv(r)
			return 0, transport.CtxError(err)
		}
		r.AwaitGrace(t.waitPoller, t.graceFor(ctx), "receive", r.p.fail)
	}
	n, err := r.Result()
	t.putRecv(r)
	return n, err
}

func (r *recvReq) cancel() bool {
	p := r.p
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.posted.Remove(0, r)
}
