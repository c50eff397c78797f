// Package core holds what every moex transport shares: the completion state of a request,
// per-peer matching queues, and a table of request ids for rendezvous protocols.
//
// It owns no I/O. Each transport embeds Req in its own request type and drives it.
package core

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/transport"
)

// Req is the completion half of a request. The zero value is not ready: call Init once.
type Req struct {
	ev  busypoll.Event
	n   int
	err error
}

// Init prepares r for its first use.
func (r *Req) Init() { r.ev.Init() }

// Reset prepares r for reuse.
func (r *Req) Reset() {
	r.ev.Reset()
	r.n, r.err = 0, nil
}

// Complete records the result and wakes the waiter. Call it once per use. It reports
// whether a parked waiter was woken (see busypoll.Event.Set).
func (r *Req) Complete(n int, err error) bool {
	r.n, r.err = n, err
	return r.ev.Set()
}

// Test reports whether the request completed.
func (r *Req) Test() bool { return r.ev.IsSet() }

// Result returns what Complete recorded; valid once Test is true.
func (r *Req) Result() (int, error) { return r.n, r.err }

// Await waits for completion under p. It returns ctx's error if ctx ends first; the caller
// then cancels the operation.
func (r *Req) Await(ctx context.Context, p *busypoll.Poller) error {
	return p.Wait(ctx, &r.ev, r.ev.IsSet)
}

// AwaitUncancelable waits without a context, for operations that cannot be withdrawn and
// are known to finish (a copy in progress, a transfer the peer is draining).
func (r *Req) AwaitUncancelable(p *busypoll.Poller) {
	_ = p.Wait(context.Background(), &r.ev, r.ev.IsSet)
}

// AwaitGrace waits for a request whose transfer is already under way and could not be
// cancelled. If it has not completed within grace, fail gets a timeout error (the
// transport declares the peer dead, which completes the request) and the wait goes on.
func (r *Req) AwaitGrace(p *busypoll.Poller, grace time.Duration, what string, fail func(error)) {
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if r.Await(ctx, p) != nil {
		fail(fmt.Errorf("%w: a cancelled %s did not finish within %v", transport.ErrTimeout, what, grace))
		r.AwaitUncancelable(p)
	}
}

// Entry is an element of a Queue.
type Entry[T any] struct {
	Key transport.Key
	V   T
}

// Queue holds, per peer, a FIFO of items to be matched by key: posted receives, or
// messages that arrived before their receive. Lookups scan, which is right for the few
// outstanding operations per peer that collectives keep, and allocates nothing once the
// slices have grown. Not safe for concurrent use: the owner locks.
type Queue[T comparable] struct {
	per [][]Entry[T]
}

// NewQueue returns a queue for n peers.
func NewQueue[T comparable](n int) Queue[T] { return Queue[T]{per: make([][]Entry[T], n)} }

// Push appends v under key for peer.
func (q *Queue[T]) Push(peer int, k transport.Key, v T) {
	q.per[peer] = append(q.per[peer], Entry[T]{k, v})
}

// Take removes and returns the oldest item for peer with key k.
func (q *Queue[T]) Take(peer int, k transport.Key) (T, bool) {
	s := q.per[peer]
	for i := range s {
		if s[i].Key == k {
			v := s[i].V
			q.per[peer] = remove(s, i)
			return v, true
		}
	}
	var zero T
	return zero, false
}

// Remove removes v from peer's queue and reports whether it was there.
func (q *Queue[T]) Remove(peer int, v T) bool {
	s := q.per[peer]
	for i := range s {
		if s[i].V == v {
			q.per[peer] = remove(s, i)
			return true
		}
	}
	return false
}

// Drain removes every item of peer and passes each to f, oldest first.
func (q *Queue[T]) Drain(peer int, f func(T)) {
	s := q.per[peer]
	q.per[peer] = s[:0]
	for i := range s {
		f(s[i].V)
		var zero Entry[T]
		s[i] = zero
	}
}

// Entries returns peer's queue, oldest first. The slice is the queue's own: do not keep it
// across changes to the queue.
func (q *Queue[T]) Entries(peer int) []Entry[T] { return q.per[peer] }

// Len returns the number of items queued for peer.
func (q *Queue[T]) Len(peer int) int { return len(q.per[peer]) }

func remove[T any](s []Entry[T], i int) []Entry[T] {
	copy(s[i:], s[i+1:])
	var zero Entry[T]
	s[len(s)-1] = zero
	return s[:len(s)-1]
}

// Table maps request ids carried on the wire to requests. Ids combine a slot index with
// a generation, so a stale or forged id from a peer is rejected instead of reaching a
// recycled request. Safe for concurrent use.
type Table[T any] struct {
	mu    sync.Mutex
	slots []slot[T]
	free  []uint32
}

type slot[T any] struct {
	gen uint32
	v   *T
}

// Put stores v and returns its id (never zero).
func (t *Table[T]) Put(v *T) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	var i uint32
	if n := len(t.free); n > 0 {
		i = t.free[n-1]
		t.free = t.free[:n-1]
	} else {
		t.slots = append(t.slots, slot[T]{})
		i = uint32(len(t.slots) - 1)
	}
	s := &t.slots[i]
	s.gen++
	if s.gen == 0 {
		s.gen = 1
	}
	s.v = v
	return uint64(s.gen)<<32 | uint64(i)
}

// Get returns the request with id, or nil when the id is unknown or stale.
func (t *Table[T]) Get(id uint64) *T {
	t.mu.Lock()
	defer t.mu.Unlock()
	i, gen := uint32(id), uint32(id>>32)
	if int(i) >= len(t.slots) || t.slots[i].gen != gen {
		return nil
	}
	return t.slots[i].v
}

// Delete forgets id; later lookups of it return nil.
func (t *Table[T]) Delete(id uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	i, gen := uint32(id), uint32(id>>32)
	if int(i) >= len(t.slots) || t.slots[i].gen != gen || t.slots[i].v == nil {
		return
	}
	t.slots[i].v = nil
	t.free = append(t.free, i)
}

// Each calls f for every live entry (under the table's lock: f must not call back).
func (t *Table[T]) Each(f func(id uint64, v *T)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.slots {
		if t.slots[i].v != nil {
			f(uint64(t.slots[i].gen)<<32|uint64(i), t.slots[i].v)
		}
	}
}

// Extract removes every live entry for which match reports true and appends it to dst,
// under one hold of the table's lock: a concurrent Get or Delete sees each either before
// or after, never both.
func (t *Table[T]) Extract(match func(v *T) bool, dst []*T) []*T {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.slots {
		if v := t.slots[i].v; v != nil && match(v) {
			dst = append(dst, v)
			t.slots[i].v = nil
			t.free = append(t.free, uint32(i))
		}
	}
	return dst
}
