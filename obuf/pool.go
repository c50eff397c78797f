// Package obuf owns every byte that a transport may still read: output buffers taken from
// size-class pools, reference counted, and returned to their pool only when the last
// reference is released and no send that reads them is still in flight.
//
// The four pitfalls it exists for (see the background essay): reusing a buffer before its
// send completed; registering memory per message (RegCache registers once per buffer);
// "zero copy" that silently copies (buffers are page aligned and stable, so a transport
// can hand them to the kernel or the NIC as they are); and small messages paying large-
// message costs (size classes start at one page).
//
// Buffers of 2 MiB and more are mappings of their own, 2 MiB aligned and advised to use
// transparent huge pages: the kernel then pins them (cross-memory attach, RDMA
// registration) a huge page at a time, and process_vm_readv runs about twice as fast as
// from 4 KiB pages (measured: 25 against 9.9 GB/s at 2 MiB, cached; 11.7-13.6 against
// 5.2-5.9 for cold 512 KiB blocks). Such a buffer that no pool keeps is unmapped when the
// collector finds it unreachable. Buffers from SlabMin (256 KiB) up to 2 MiB are slices
// of such mappings, each shared by buffers of one size, unmapped once all of its buffers
// are unreachable.
//
// Buffers of a shared pool (NewSharedPool, Shared) live in shared memory instead, a memfd
// of the process that the other ranks of a host can map and read in place (Locate says
// where a slice lies in it); see NewSharedPool.
//
// Cheap invariants are always checked (release below zero, release while a send is in
// flight). Build with -tags moexdebug to also catch writes to a buffer while a send reads
// it (checksum at Lend, verified at Return) and writes after release (poison on release,
// verified on the next Get).
//
// obuf knows nothing about transports; it must not import them.
package obuf

import (
	"fmt"
	"math/bits"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"
)

// PageSize is the alignment of every pooled buffer.
const PageSize = 4096

const (
	minShift   = 12 // 4 KiB
	maxShift   = 30 // 1 GiB
	numClasses = maxShift - minShift + 1
)

// Pool is a set of size classes (powers of two from 4 KiB to 1 GiB) of page-aligned
// buffers. The zero value is not usable; call NewPool. A Pool is safe for concurrent use.
type Pool struct {
	classes  [numClasses]class
	keep     int  // free buffers kept per class
	shared   bool // buffers come from the shared arena (NewSharedPool)
	gets     atomic.Uint64
	news     atomic.Uint64
	releases atomic.Uint64
}

type class struct {
	mu   sync.Mutex
	free []*Buf
}

// NewPool returns a pool that keeps up to keep free buffers per size class (0: 16).
func NewPool(keep int) *Pool {
	if keep <= 0 {
		keep = 16
	}
	return &Pool{keep: keep}
}

// NewSharedPool returns a pool whose buffers live in shared memory that the other
// processes of the job on this host can map and read in place (a memfd of this process,
// 4 KiB pages unless the host gives shared memory huge pages). A transport that knows
// (shm: AlltoAll, AlltoAllv and AllGather through its shared areas) then moves a block
// with one copy, from the sender's buffer straight into the receiver's, where a private
// buffer costs two copies or the kernel's cross-memory copy: like NCCL's registered user
// buffers, for the buffers a job sends from again and again. Where the arena cannot be
// made (SharedErr), the pool hands out private buffers, which work everywhere, only
// slower.
func NewSharedPool(keep int) *Pool {
	p := NewPool(keep)
	p.shared = true
	return p
}

// Default is the process-wide pool.
var Default = NewPool(0)

// Shared is the process-wide shared pool (NewSharedPool).
var Shared = NewSharedPool(0)

// PoolStats counts pool traffic.
type PoolStats struct {
	Gets, Allocs, Releases uint64 // buffers handed out, made, and given back
}

// Stats returns the pool's counters. Allocs stops growing in steady state.
func (p *Pool) Stats() PoolStats {
	return PoolStats{Gets: p.gets.Load(), Allocs: p.news.Load(), Releases: p.releases.Load()}
}

// Capacity is the capacity of a buffer of n bytes from a pool (Get): n rounded up to its
// size class, or n itself beyond the largest class.
func Capacity(n int) int {
	if c := classOf(n); c < numClasses {
		return 1 << (c + minShift)
	}
	return n
}

func classOf(n int) int {
	if n <= 1<<minShift {
		return 0
	}
	return bits.Len(uint(n-1)) - minShift
}

// Buf is a pooled buffer. It starts with one reference (the caller's).
type Buf struct {
	b        []byte // whole class-sized, page-aligned storage
	huge     bool   // backed by a mapping that asked for transparent huge pages
	shared   bool   // mapped from the shared arena
	n        int
	class    int // -1: not pooled (larger than the biggest class)
	refs     atomic.Int32
	inflight atomic.Int32
	pool     *Pool
	dbg      debugState
}

// Get returns a buffer of length n (capacity rounded up to its size class) holding one
// reference. Its contents are unspecified.
func (p *Pool) Get(n int) *Buf {
	if n < 0 {
		panic(fmt.Sprintf("obuf: Get(%d): negative length", n))
	}
	p.gets.Add(1)
	c := classOf(n)
	var b *Buf
	if c < numClasses {
		cl := &p.classes[c]
		cl.mu.Lock()
		if k := len(cl.free); k > 0 {
			b = cl.free[k-1]
			cl.free[k-1] = nil
			cl.free = cl.free[:k-1]
		}
		cl.mu.Unlock()
		if b != nil {
			b.dbg.onGet(b)
		} else {
			b = newBuf(1<<(c+minShift), c, p)
			p.news.Add(1)
		}
	} else {
		b = newBuf(n, -1, p)
		p.news.Add(1)
	}
	b.n = n
	b.refs.Store(1)
	return b
}

func newBuf(n, class int, p *Pool) *Buf {
	b := &Buf{class: class, pool: p}
	if p.shared {
		if m, off, err := sharedAlloc(n); err == nil {
			b.b = m
			b.shared = true
			runtime.AddCleanup(b, sharedFree, sharedMapping{p: unsafe.Pointer(unsafe.SliceData(m)), n: n, off: off})
			return b
		}
	}
	if n >= SlabMin && n < HugeThreshold && n&(n-1) == 0 { // a size class
		if m, s, ok := slabAlloc(n); ok {
			b.b = m
			b.huge = true
			runtime.AddCleanup(b, slabFree, s)
			return b
		}
	}
	if n >= HugeThreshold {
		if m, ok := hugeAlloc(n); ok {
			b.b = m
			b.huge = true
			runtime.AddCleanup(b, hugeFree, m)
			return b
		}
	}
	b.b = alignedAlloc(n)
	return b
}

func alignedAlloc(n int) []byte {
	raw := make([]byte, n+PageSize)
	off := int(-uintptr(unsafe.Pointer(unsafe.SliceData(raw))) & (PageSize - 1))
	return raw[off : off+n : off+n]
}

// Bytes returns the buffer's contents (length n as asked of Get). The slice does not keep
// the buffer: hold the *Buf while the bytes are in use, since a huge buffer that the
// collector finds unreachable is unmapped.
func (b *Buf) Bytes() []byte { return b.b[:b.n] }

// Len returns the length asked of Get.
func (b *Buf) Len() int { return b.n }

// Huge reports whether the buffer is backed by (transparent) huge pages where the kernel
// grants them: buffers of SlabMin bytes or more are.
func (b *Buf) Huge() bool { return b.huge }

// Shared reports whether the buffer lives in the shared arena (see NewSharedPool), where
// the other processes of the job on this host can read it in place.
func (b *Buf) Shared() bool { return b.shared }

// Cap returns the size of the buffer's storage.
func (b *Buf) Cap() int { return len(b.b) }

// Resize changes the length within the capacity.
func (b *Buf) Resize(n int) {
	if n < 0 || n > len(b.b) {
		panic(fmt.Sprintf("obuf: Resize(%d) outside capacity %d", n, len(b.b)))
	}
	b.n = n
}

// Refs returns the current reference count.
func (b *Buf) Refs() int { return int(b.refs.Load()) }

// InFlight returns the number of sends that still read the buffer.
func (b *Buf) InFlight() int { return int(b.inflight.Load()) }

// Retain adds a reference.
func (b *Buf) Retain() *Buf {
	if b.refs.Add(1) <= 1 {
		panic("obuf: Retain of a released buffer")
	}
	return b
}

// Lend marks the buffer as read by one more in-flight send and takes a reference for it.
// The transport (or whoever posted the send) calls Return when the send has completed.
func (b *Buf) Lend() {
	b.Retain()
	if b.inflight.Add(1) == 1 {
		b.dbg.onLend(b)
	}
}

// Return ends one in-flight send started by Lend and drops its reference.
func (b *Buf) Return() {
	n := b.inflight.Add(-1)
	if n < 0 {
		panic("obuf: Return without a matching Lend")
	}
	if n == 0 {
		b.dbg.onReturn(b)
	}
	b.Release()
}

// Release drops a reference; the last one returns the buffer to its pool. Releasing more
// often than retained, or dropping the last reference while a send is still in flight,
// panics: both mean a transport could read memory that someone else now owns.
func (b *Buf) Release() {
	n := b.refs.Add(-1)
	if n > 0 {
		return
	}
	if n < 0 {
		panic("obuf: double release")
	}
	if b.inflight.Load() != 0 {
		panic("obuf: buffer released while a send still reads it")
	}
	p := b.pool
	p.releases.Add(1)
	if b.class < 0 {
		return
	}
	b.dbg.onRelease(b)
	cl := &p.classes[b.class]
	cl.mu.Lock()
	if len(cl.free) < p.keep {
		cl.free = append(cl.free, b)
	}
	cl.mu.Unlock()
}
