package tcp

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/moex-ai/moex/internal/wire"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/internal/core"
)

// maxEager bounds an eager frame's payload, whatever a peer claims.
const maxEager = 16 << 20

// The protocol (matching, rendezvous, notices, cancellation, a dead peer's completion) is
// core.Engine's. This file holds tcp's edges: a peer is the core.Link over its streams, and
// handle turns the frames a stream reads into the Engine's events. A TypeAbort frame with
// a non-zero ID is a per-message notice: its code (core.Notice*) in Aux.

// sendX and recvX are tcp's state in a request: the frame that carries an eager message
// or an announcement, the stripes a pushed message still has in flight, the receive's
// clear-to-send frame.
type sendX struct {
	frame   frame
	recvID  uint64
	stripes atomic.Int32
}

type recvX struct{ cts frame }

type (
	sendReq = core.Send[sendX, recvX]
	recvReq = core.Recv[sendX, recvX]
)

// peer is the state shared by the streams to one rank.
type peer struct {
	t       *Transport
	rank    int
	streams []*stream
	c       *core.Peer[sendX, recvX]

	quit     chan struct{}
	once     sync.Once
	graceful bool
	active   atomic.Int32
}

var _ core.Link[sendX, recvX] = (*peer)(nil)

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

// Fail implements core.Link.
func (p *peer) Fail(err error) { p.fail(err) }

// leave is this rank closing (graceful: with a bye) or crashing.
func (p *peer) leave(graceful bool) { p.shutdown(transport.ErrClosed, graceful) }

func (p *peer) shutdown(err error, graceful bool) {
	p.once.Do(func() {
		p.t.eng.MarkDead(p.c, err)
		p.graceful = graceful
		if graceful {
			for _, s := range p.streams {
				f := &frame{kind: fkOwned, bye: true}
				h := wire.Header{Type: wire.TypeBye, Src: uint32(p.t.rank)}
				h.Encode(f.hdr[:])
				s.enqueueCtl(f)
			}
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
		for _, s := range p.streams {
			_ = s.conn.Close()
		}
		// No stream goroutine of the peer runs any more, so nothing writes into a receive
		// buffer or reads a send buffer.
		p.t.eng.Reap(p.c)
	}
}

// ---- core.Link ----

// Eager implements core.Link.
func (p *peer) Eager(h wire.Header, s *sendReq) bool {
	if p.t.checksum {
		h.SetChecksum(s.Buf)
	}
	f := &s.X.frame
	f.kind, f.payload, f.send = fkEager, s.Buf, s
	h.Encode(f.hdr[:])
	return p.streams[0].send(f)
}

// Announce implements core.Link.
func (p *peer) Announce(h wire.Header, s *sendReq) {
	f := &s.X.frame
	f.kind, f.payload, f.send = fkRTS, nil, s
	h.Encode(f.hdr[:])
	p.streams[0].send(f)
}

// Withdraw implements core.Link.
func (p *peer) Withdraw(s *sendReq) bool { return p.streams[0].removeCtl(&s.X.frame) }

// Pull implements core.Link: ask the sender for the data.
func (p *peer) Pull(r *recvReq) {
	id := p.t.eng.Register(r)
	h := wire.Header{Type: wire.TypeCTS, Comm: r.Tag.Comm, Src: uint32(p.t.rank), Seq: r.Tag.Seq, Tag: r.Tag.Tag,
		Sig: r.Tag.Sig, ID: r.SenderID, Aux: id}
	r.Y.cts.kind = fkCTS
	h.Encode(r.Y.cts.hdr[:])
	p.streams[0].send(&r.Y.cts)
}

// Push implements core.Link: stripe the message over the streams.
func (p *peer) Push(s *sendReq, recvID uint64) {
	s.X.recvID = recvID
	total := len(s.Buf)
	stripes := min(len(p.streams), max(1, total/minStripe))
	s.X.stripes.Store(int32(stripes))
	per := (total + stripes - 1) / stripes
	for i := 0; i < stripes; i++ {
		off, end := i*per, min((i+1)*per, total)
		p.streams[i].enqueueBulk(dataJob{send: s, off: off, end: end})
	}
}

// Notify implements core.Link.
func (p *peer) Notify(id, code uint64, reason string) {
	f := &frame{kind: fkOwned, payload: []byte(reason)}
	h := wire.Header{Type: wire.TypeAbort, Src: uint32(p.t.rank), ID: id, Aux: code, Length: uint64(len(reason))}
	h.Encode(f.hdr[:])
	p.streams[0].send(f)
}

// Drop implements core.Link.
func (p *peer) Drop(fn func(*sendReq)) {
	for _, s := range p.streams {
		s.qmu.Lock()
		for f := s.ctlHead; f != nil; f = f.next {
			if f.kind == fkEager {
				fn(f.send)
			}
		}
		if f := s.partial; f != nil && f.kind == fkEager {
			fn(f.send)
		}
		s.ctlHead, s.ctlTail, s.partial = nil, nil, nil
		clear(s.bulk)
		s.bulk = s.bulk[:0]
		s.qmu.Unlock()
	}
}

// ---- frames in ----

// payloadSource is core.Source over the frame a stream's reader is handling.
type payloadSource struct {
	s *stream
	h *wire.Header
}

// CopyTo implements core.Source.
func (ps *payloadSource) CopyTo(dst []byte) error {
	if err := ps.s.readInto(dst); err != nil {
		return readErr(err)
	}
	if err := ps.h.Verify(dst); err != nil {
		return fmt.Errorf("%w: %v", transport.ErrProtocol, err)
	}
	return nil
}

// Discard implements core.Source.
func (ps *payloadSource) Discard() error {
	if err := ps.s.discard(int(ps.h.Length)); err != nil {
		return readErr(err)
	}
	return nil
}

// handle processes one frame whose header the reader just consumed. It returns bye=true
// when the peer said goodbye.
func (p *peer) handle(s *stream, h *wire.Header) (bye bool, err error) {
	e := &p.t.eng
	tag := transport.Tag{Comm: h.Comm, Seq: h.Seq, Tag: h.Tag, Sig: h.Sig}
	n := int(h.Length)
	s.src.h = h
	switch h.Type {
	case wire.TypeEager:
		if n > maxEager {
			return false, fmt.Errorf("%w: eager frame of %d bytes (limit %d)", transport.ErrProtocol, n, maxEager)
		}
		s.woke, err = e.Eager(p.c, tag, n, &s.src)
		return false, err

	case wire.TypeRTS:
		if n != 0 {
			return false, fmt.Errorf("%w: RTS with payload", transport.ErrProtocol)
		}
		return false, e.Announced(p.c, tag, h.ID, h.Aux, 0)

	case wire.TypeCTS:
		if n != 0 {
			return false, fmt.Errorf("%w: CTS with payload", transport.ErrProtocol)
		}
		e.ClearToSend(p.c, h.ID, h.Aux)
		s.woke = true // let the writers just woken have this CPU
		return false, nil

	case wire.TypeData:
		s.woke, err = e.Data(p.c, h.ID, h.Aux, n, &s.src)
		return false, err

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
		e.Notice(p.c, h.ID, h.Aux, string(reason))
		return false, nil

	case wire.TypeBye:
		return true, nil
	}
	return false, fmt.Errorf("%w: unexpected %v frame", transport.ErrProtocol, h.Type)
}

// ---- the Transport's calls ----

// Isend implements transport.Transport.
func (t *Transport) Isend(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	p, err := t.peerFor(peer)
	switch {
	case err != nil:
		return nil, err
	case p == nil:
		return t.self.Isend(0, tag, buf)
	}
	return t.eng.Isend(p.c, tag, buf), nil
}

// IsendBatch implements transport.Batcher: the messages to one peer are queued while
// they are posted and leave together, the eager ones (and the announcements of the
// others) in one writev where each Isend would write its own.
func (t *Transport) IsendBatch(peer int, tags []transport.Tag, bufs [][]byte, reqs []transport.Request) error {
	p, err := t.peerFor(peer)
	if err != nil {
		clear(reqs[:len(bufs)])
		return err
	}
	if p != nil && len(bufs) > 1 {
		s := p.streams[0]
		s.corks.Add(1)
		defer s.uncork()
	}
	return transport.IsendEach(t, peer, tags, bufs, reqs)
}

// Irecv implements transport.Transport.
func (t *Transport) Irecv(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	p, err := t.peerFor(peer)
	switch {
	case err != nil:
		return nil, err
	case p == nil:
		return t.self.Irecv(0, tag, buf)
	}
	return t.eng.Irecv(p.c, tag, buf), nil
}

// peerFor checks peer and returns its state; nil for this rank.
func (t *Transport) peerFor(peer int) (*peer, error) {
	if err := transport.CheckPeer(peer, t.size); err != nil {
		return nil, err
	}
	if t.closed.Load() {
		return nil, transport.ErrClosed
	}
	if peer == t.rank {
		return nil, nil
	}
	if p := t.peers[peer].Load(); p != nil {
		return p, nil
	}
	return nil, &transport.PeerError{Rank: peer, Op: "connect", Err: errNotConnected}
}

// errNotConnected: a replacement was not connected to the peer (it was not a member of
// the job that admitted it).
var errNotConnected = fmt.Errorf("%w: not connected (the rank was not alive when this one joined)", transport.ErrPeerClosed)

// await waits for a request on the wait poller (the readers do the spinning).
func (t *Transport) await(ctx context.Context, r *core.Req) error { return r.Await(ctx, t.waitPoller) }
