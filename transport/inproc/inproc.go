// Package inproc is the transport between ranks that are goroutines of one process
// (coll.Local, tests, single-host engines that run every expert group in one process).
//
// It moves each byte once: a send whose receive is already posted copies straight from the
// sender's slice into the receiver's. A large send that finds no receive waits, unread,
// until one is posted, and the receiver then does the single copy (rendezvous). Only small
// messages that arrive early are copied twice (into a pooled eager buffer, then out), so
// that their sender need not wait.
//
// It owns its endpoints' matching queues; it does no I/O.
package inproc

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/internal/core"
)

// DefaultEagerLimit is the largest message copied into a pooled buffer when it arrives
// before its receive.
const DefaultEagerLimit = 16 << 10

// Config tunes a world. The zero value is usable.
type Config struct {
	EagerLimit int              // 0: DefaultEagerLimit; negative: never eager
	Poller     *busypoll.Poller // nil: an adaptive poller shared by the world
	Pool       *obuf.Pool       // nil: obuf.Default
}

type world struct {
	eps     []*Transport
	eager   int
	poller  *busypoll.Poller
	pool    *obuf.Pool
	free    core.FreeList[*req] // recycled requests: no allocation per message in steady state
	windows windows
}

// New returns n connected endpoints, endpoint i being rank i.
func New(n int, cfg Config) []*Transport {
	if n <= 0 {
		panic(fmt.Sprintf("inproc: New(%d): need at least one rank", n))
	}
	w := &world{eager: cfg.EagerLimit, poller: cfg.Poller, pool: cfg.Pool}
	if w.eager == 0 {
		w.eager = DefaultEagerLimit
	}
	if w.poller == nil {
		w.poller = busypoll.New(busypoll.Config{Oversubscribed: busypoll.Oversubscribed(n)})
	}
	if w.pool == nil {
		w.pool = obuf.Default
	}
	w.eps = make([]*Transport, n)
	for i := range w.eps {
		w.eps[i] = &Transport{w: w, rank: i, posted: core.NewQueue[*req](n), unexp: core.NewQueue[*req](n)}
	}
	return w.eps
}

// Transport is one rank's endpoint.
type Transport struct {
	w      *world
	rank   int
	closed atomic.Bool
	why    atomic.Pointer[error] // what peers are told once closed (a goodbye, or a crash)

	mu     sync.Mutex
	posted core.Queue[*req] // receives posted on this endpoint, by source
	unexp  core.Queue[*req] // messages that reached this endpoint before their receive, by source

	msgsOut, bytesOut atomic.Uint64 // sends posted, and their bytes
}

var (
	_ transport.Transport    = (*Transport)(nil)
	_ transport.PathReporter = (*Transport)(nil)
	_ transport.Counting     = (*Transport)(nil)
	_ transport.Killer       = (*Transport)(nil)
)

// Counters implements transport.Counting: the sends posted and their bytes.
func (t *Transport) Counters() transport.Counters {
	return transport.Counters{MessagesOut: t.msgsOut.Load(), BytesOut: t.bytesOut.Load()}
}

type kind uint8

const (
	kSend  kind = iota + 1 // a user's send (queued at the receiver when large)
	kRecv                  // a user's receive
	kEager                 // an early small message, copied; its send already completed
)

type req struct {
	core.Req
	w      *world
	kind   kind
	owner  *Transport // where the request is queued (receiver's endpoint)
	peer   int        // for kRecv: source; for kSend/kEager: the sender
	tag    transport.Tag
	buf    []byte
	eager  *obuf.Buf
	queued bool // in owner's posted or unexp queue (guarded by owner.mu)
}

func (w *world) get(k kind, owner *Transport, peer int, tag transport.Tag, buf []byte) *req {
	r, ok := w.free.Get()
	if !ok {
		r = &req{}
		r.Init()
	}
	r.w, r.kind, r.owner, r.peer, r.tag, r.buf = w, k, owner, peer, tag, buf
	return r
}

func (w *world) put(r *req) {
	r.Reset()
	r.owner, r.buf, r.eager, r.queued = nil, nil, nil, false
	w.free.Put(r)
}

// Rank implements transport.Transport.
func (t *Transport) Rank() int { return t.rank }

// Size implements transport.Transport.
func (t *Transport) Size() int { return len(t.w.eps) }

// Name implements transport.Transport.
func (t *Transport) Name() string { return "inproc" }

// Path implements transport.PathReporter.
func (t *Transport) Path(peer int) string { return "inproc: same process, single copy" }

// Poller returns the poller waits use (for its counters).
func (t *Transport) Poller() *busypoll.Poller { return t.w.poller }

// Isend implements transport.Transport.
func (t *Transport) Isend(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	if err := transport.CheckPeer(peer, len(t.w.eps)); err != nil {
		return nil, err
	}
	if t.closed.Load() {
		return nil, transport.ErrClosed
	}
	t.msgsOut.Add(1)
	t.bytesOut.Add(uint64(len(buf)))
	s := t.w.get(kSend, nil, t.rank, tag, buf)
	dst := t.w.eps[peer]
	dst.mu.Lock()
	if dst.closed.Load() {
		dst.mu.Unlock()
		s.Complete(0, &transport.PeerError{Rank: peer, Op: "send", Err: dst.leftWith()})
		return s, nil
	}
	if r, ok := dst.posted.Take(t.rank, tag.Key()); ok {
		r.queued = false
		dst.mu.Unlock()
		n, err := deliver(r, tag, buf)
		r.Complete(n, err)
		s.Complete(len(buf), nil)
		return s, nil
	}
	if len(buf) <= t.w.eager {
		e := t.w.get(kEager, dst, t.rank, tag, nil)
		e.eager = t.w.pool.Get(len(buf))
		copy(e.eager.Bytes(), buf)
		e.queued = true
		dst.unexp.Push(t.rank, tag.Key(), e)
		dst.mu.Unlock()
		s.Complete(len(buf), nil)
		return s, nil
	}
	s.owner, s.queued = dst, true
	dst.unexp.Push(t.rank, tag.Key(), s)
	dst.mu.Unlock()
	return s, nil
}

// Irecv implements transport.Transport.
func (t *Transport) Irecv(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	if err := transport.CheckPeer(peer, len(t.w.eps)); err != nil {
		return nil, err
	}
	r := t.w.get(kRecv, t, peer, tag, buf)
	t.mu.Lock()
	if t.closed.Load() {
		t.mu.Unlock()
		t.w.put(r)
		return nil, transport.ErrClosed
	}
	if m, ok := t.unexp.Take(peer, tag.Key()); ok {
		m.queued = false
		t.mu.Unlock()
		if m.kind == kEager {
			n, err := deliver(r, m.tag, m.eager.Bytes())
			m.eager.Release()
			t.w.put(m)
			r.Complete(n, err)
		} else {
			n, err := deliver(r, m.tag, m.buf)
			r.Complete(n, err)
			m.Complete(len(m.buf), nil)
		}
		return r, nil
	}
	if t.w.eps[peer].closed.Load() {
		t.mu.Unlock()
		r.Complete(0, &transport.PeerError{Rank: peer, Op: "recv", Err: t.w.eps[peer].leftWith()})
		return r, nil
	}
	r.owner, r.queued = t, true
	t.posted.Push(peer, tag.Key(), r)
	t.mu.Unlock()
	return r, nil
}

// deliver copies a matched message into receive r.
func deliver(r *req, tag transport.Tag, msg []byte) (int, error) {
	if err := core.CheckMatch(r.peer, r.tag, tag, len(msg), len(r.buf)); err != nil {
		return 0, err
	}
	return copy(r.buf, msg), nil
}

// Wait implements transport.Request.
func (r *req) Wait(ctx context.Context) (int, error) {
	w := r.w
	if err := r.Await(ctx, w.poller); err != nil {
		if !r.cancel() {
			// Already matched: the copy is under way and finishes without help.
			r.AwaitUncancelable(w.poller)
		} else {
			w.put(r)
			return 0, transport.CtxError(err)
		}
	}
	n, err := r.Result()
	w.put(r)
	return n, err
}

// cancel withdraws a request still waiting in a queue.
func (r *req) cancel() bool {
	o := r.owner
	if o == nil {
		return false
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if !r.queued {
		return false
	}
	r.queued = false
	var ok bool
	if r.kind == kRecv {
		ok = o.posted.Remove(r.peer, r)
	} else {
		ok = o.unexp.Remove(r.peer, r)
	}
	return ok
}

// Close implements transport.Transport. Pending requests of this rank complete with
// ErrClosed; receives that other ranks posted from this rank complete with a PeerError.
// Small messages this rank sent before closing stay deliverable.
func (t *Transport) Close() error { return t.close(transport.ErrPeerLeft) }

// leftWith is the error peers get for this closed endpoint.
func (t *Transport) leftWith() error {
	if p := t.why.Load(); p != nil {
		return *p
	}
	return transport.ErrPeerLeft
}

// Kill closes the endpoint as a crash would look to its peers: their errors do not say
// that it left on purpose (for tests).
func (t *Transport) Kill() { _ = t.close(transport.ErrPeerClosed) }

func (t *Transport) close(why error) error {
	t.why.CompareAndSwap(nil, &why)
	if t.closed.Swap(true) {
		return nil
	}
	gone := &transport.PeerError{Rank: t.rank, Op: "recv", Err: why}
	for _, o := range t.w.eps {
		if o == t {
			continue
		}
		o.mu.Lock()
		var drop []*req
		o.posted.Drain(t.rank, func(r *req) { r.queued = false; drop = append(drop, r) })
		// Large sends of ours still queued at o fail here; eager copies stay.
		var keep []*req
		o.unexp.Drain(t.rank, func(m *req) {
			if m.kind == kEager {
				keep = append(keep, m)
			} else {
				m.queued = false
				m.Complete(0, transport.ErrClosed)
			}
		})
		for _, m := range keep {
			o.unexp.Push(t.rank, m.tag.Key(), m)
		}
		o.mu.Unlock()
		for _, r := range drop {
			r.Complete(0, gone)
		}
	}
	t.mu.Lock()
	for p := range t.w.eps {
		t.posted.Drain(p, func(r *req) { r.queued = false; r.Complete(0, transport.ErrClosed) })
		t.unexp.Drain(p, func(m *req) {
			m.queued = false
			if m.kind == kEager {
				m.eager.Release()
				t.w.put(m)
			} else {
				m.Complete(0, &transport.PeerError{Rank: t.rank, Op: "send", Err: why})
			}
		})
	}
	t.mu.Unlock()
	return nil
}
