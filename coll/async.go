package coll

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/moex-ai/moex/busypoll"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/transport"
)

// Handle is a non-blocking operation in flight. Operations run in issue order on every
// rank; several in flight at once proceed concurrently. Wait for a Handle from one
// goroutine at a time.
type Handle struct {
	ev   busypoll.Event // set when the operation completes
	err  error
	busy atomic.Bool // in flight (for handles reused by the With forms)
}

func newHandle() *Handle {
	h := &Handle{}
	h.ev.Init()
	return h
}

// take readies h for another operation; it must not be in flight.
func (h *Handle) take() error {
	if h.ev.IsSet() || !h.busy.Load() {
		if h.ev.IsSet() {
			h.ev.Reset()
		} else {
			h.ev.Init()
		}
		h.err = nil
		h.busy.Store(true)
		return nil
	}
	return &ArgError{Arg: "handle", Reason: "its operation is still in flight"}
}

func (h *Handle) finish(err error) {
	h.err = err
	h.busy.Store(false)
	h.ev.Set()
}

// Wait blocks until the operation completes and returns its error. If ctx ends first,
// Wait returns a timeout/cancellation error; the operation itself goes on, bounded by the
// communicator's timeout.
func (h *Handle) Wait(ctx context.Context) error {
	if h.ev.IsSet() {
		return h.err
	}
	if err := h.ev.WaitSet(ctx); err != nil {
		return transport.CtxError(err)
	}
	return h.err
}

// Test reports whether the operation has completed.
func (h *Handle) Test() bool { return h.ev.IsSet() }

// job is a non-blocking operation waiting for, or running on, one of the
// communicator's workers.
type job struct {
	pl    *plan
	seq   uint32
	cl    call
	after func()
	h     *Handle
}

// workers run the non-blocking operations: a pool that grows to the number in flight at
// once and is stopped, and waited for, by Close. Starting no goroutine per operation
// keeps the non-blocking forms free of allocation.
type workers struct {
	jobs chan *job
	stop chan struct{}
	idle atomic.Int32 // workers waiting for a job that no submission has claimed
	wg   sync.WaitGroup
	mu   sync.Mutex
	free []*job
}

func (w *workers) init() {
	w.jobs = make(chan *job, 1024)
	w.stop = make(chan struct{})
}

// run queues j, starting a worker unless an idle one can take it.
func (c *Comm) runAsync(j *job) {
	w := &c.async
	if w.idle.Add(-1) < 0 {
		w.idle.Add(1)
		w.wg.Add(1)
		go c.worker()
	}
	w.jobs <- j
}

func (c *Comm) worker() {
	w := &c.async
	defer w.wg.Done()
	for {
		select {
		case j := <-w.jobs:
			c.runJob(j)
			w.idle.Add(1)
		case <-w.stop:
			// Whatever was queued still completes (with the communicator's error).
			for {
				select {
				case j := <-w.jobs:
					c.runJob(j)
				default:
					return
				}
			}
		}
	}
}

func (c *Comm) runJob(j *job) {
	err := c.exec(j.pl, j.seq, &j.cl)
	if j.after != nil {
		j.after()
	}
	h := j.h
	w := &c.async
	*j = job{}
	w.mu.Lock()
	w.free = append(w.free, j)
	w.mu.Unlock()
	h.finish(err)
}

func (c *Comm) getJob() *job {
	w := &c.async
	w.mu.Lock()
	defer w.mu.Unlock()
	if n := len(w.free); n > 0 {
		j := w.free[n-1]
		w.free = w.free[:n-1]
		return j
	}
	return &job{}
}

// Group collects non-blocking operations submitted together and waits for all of them:
//
//	var g coll.Group
//	g.Add(coll.IAllReduce(ctx, c, nil, a, dtype.Sum)) // nil send: in place on a
//	g.Add(coll.IAlltoAll(ctx, c, x, y))
//	err := g.Wait(ctx)
type Group struct {
	hs  []*Handle
	err error
}

// Add records an operation (pass an I-form's results directly).
func (g *Group) Add(h *Handle, err error) {
	if err != nil && g.err == nil {
		g.err = err
	}
	if h != nil {
		g.hs = append(g.hs, h)
	}
}

// Wait waits for every operation and returns the first error.
func (g *Group) Wait(ctx context.Context) error {
	err := g.err
	for _, h := range g.hs {
		if e := h.Wait(ctx); e != nil && err == nil {
			err = e
		}
	}
	g.hs, g.err = g.hs[:0], nil
	return err
}

// DefaultBucketBytes is the bucket size of Bucketer, as in PyTorch DDP.
const DefaultBucketBytes = 25 << 20

// Bucketer fuses many small AllReduces (gradients, per-layer statistics) into few large
// ones: tensors added in the same order on every rank are packed into buckets of about
// bucketBytes; each full bucket is reduced in the background while more are added; Wait
// reduces the rest and writes every result back into its tensor. Bucket buffers are
// reused across rounds.
type Bucketer[T dtype.Elem] struct {
	c      *Comm
	op     dtype.Op
	cap    int // elements per bucket
	cur    *bucket[T]
	flying []*bucket[T]
	free   []*bucket[T]
}

type bucket[T dtype.Elem] struct {
	buf   []T
	parts [][]T
	h     *Handle
}

// NewBucketer returns a bucketer over c (bucketBytes <= 0: DefaultBucketBytes).
func NewBucketer[T dtype.Elem](c *Comm, op dtype.Op, bucketBytes int) *Bucketer[T] {
	if bucketBytes <= 0 {
		bucketBytes = DefaultBucketBytes
	}
	return &Bucketer[T]{c: c, op: op, cap: max(1, bucketBytes/dtype.Of[T]().Size())}
}

func (b *Bucketer[T]) take() *bucket[T] {
	if n := len(b.free); n > 0 {
		k := b.free[n-1]
		b.free = b.free[:n-1]
		return k
	}
	return &bucket[T]{buf: make([]T, 0, b.cap)}
}

// Add queues t for reduction. t must not be touched until Wait returns.
func (b *Bucketer[T]) Add(ctx context.Context, t []T) error {
	if b.cur != nil && len(b.cur.buf)+len(t) > b.cap {
		if err := b.launch(ctx); err != nil {
			return err
		}
	}
	if b.cur == nil {
		b.cur = b.take()
	}
	b.cur.buf = append(b.cur.buf, t...)
	b.cur.parts = append(b.cur.parts, t)
	if len(b.cur.buf) >= b.cap {
		return b.launch(ctx)
	}
	return nil
}

func (b *Bucketer[T]) launch(ctx context.Context) error {
	k := b.cur
	b.cur = nil
	h, err := IAllReduce(ctx, b.c, nil, k.buf, b.op)
	if err != nil {
		k.buf, k.parts = k.buf[:0], k.parts[:0]
		b.free = append(b.free, k)
		return err
	}
	k.h = h
	b.flying = append(b.flying, k)
	return nil
}

// Wait reduces what is left, waits for every bucket and copies the results back.
func (b *Bucketer[T]) Wait(ctx context.Context) error {
	var err error
	if b.cur != nil {
		err = b.launch(ctx)
	}
	for _, k := range b.flying {
		if e := k.h.Wait(ctx); e != nil && err == nil {
			err = e
		}
		if err == nil {
			off := 0
			for _, p := range k.parts {
				off += copy(p, k.buf[off:off+len(p)])
			}
		}
		clear(k.parts)
		k.buf, k.parts, k.h = k.buf[:0], k.parts[:0], nil
		b.free = append(b.free, k)
	}
	b.flying = b.flying[:0]
	return err
}
