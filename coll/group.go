package coll

// Helpers over the non-blocking collectives: a Group of handles, and a Bucketer that
// coalesces small AllReduces.

import (
	"context"

	"github.com/moex-ai/moex/coll/dtype"
)

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
