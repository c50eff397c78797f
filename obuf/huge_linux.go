package obuf

import (
	"sort"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// HugeThreshold is the size from which buffers are huge-page backed mappings.
const HugeThreshold = 2 << 20

const hugePage = 2 << 20

// hugeAlloc maps n bytes (rounded up to huge pages), 2 MiB aligned, advised to use huge
// pages. The mapping lives outside the Go heap; hugeFree unmaps it.
//
// It maps and unmaps by address (MmapPtr, MunmapPtr): unix.Munmap only takes back a
// slice that is exactly one unix.Mmap returned, so it refuses (EINVAL) both the trimmed
// head and tail and the aligned middle.
func hugeAlloc(n int) ([]byte, bool) {
	size := uintptr(n+hugePage-1) &^ (hugePage - 1)
	raw, err := unix.MmapPtr(-1, 0, nil, size+hugePage, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, false
	}
	base := uintptr(raw)
	off := (hugePage - base%hugePage) % hugePage
	// Give back the unaligned head and tail.
	if off > 0 {
		_ = unix.MunmapPtr(raw, off)
	}
	if tail := hugePage - off; tail > 0 {
		_ = unix.MunmapPtr(unsafe.Add(raw, off+size), tail)
	}
	m := unsafe.Slice((*byte)(unsafe.Add(raw, off)), size)
	_ = unix.Madvise(m, unix.MADV_HUGEPAGE)
	hugeMaps.add(base+off, base+off+size)
	return m[:n:n], true
}

// hugeFree unmaps a mapping of hugeAlloc (m as it returned it).
func hugeFree(m []byte) {
	size := uintptr(cap(m)+hugePage-1) &^ (hugePage - 1)
	start := uintptr(unsafe.Pointer(unsafe.SliceData(m)))
	hugeMaps.remove(start)
	_ = unix.MunmapPtr(unsafe.Pointer(unsafe.SliceData(m)), size)
}

// Huge reports whether p lies wholly in one mapping that obuf advised to use huge pages
// (a buffer of SlabMin bytes or more from a pool that is not shared): the kernel pins
// such memory a huge page at a time, so process_vm_readv and registration take it
// about twice as fast as a Go slice's 4 KiB pages. The shared arena is Locate's. It is
// cheap: a binary search over the mappings, without a lock.
func Huge(p []byte) bool {
	if len(p) == 0 {
		return false
	}
	return hugeMaps.holds(uintptr(unsafe.Pointer(unsafe.SliceData(p))), uintptr(len(p)))
}

// hugeMaps is the set of hugeAlloc's mappings, as sorted address ranges: copied on
// write under mu, read without a lock.
var hugeMaps mapSet

type addrRange struct{ start, end uintptr }

type mapSet struct {
	mu  sync.Mutex
	all atomic.Pointer[[]addrRange]
}

func (s *mapSet) add(start, end uintptr) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var old []addrRange
	if p := s.all.Load(); p != nil {
		old = *p
	}
	i := sort.Search(len(old), func(i int) bool { return old[i].start > start })
	next := make([]addrRange, 0, len(old)+1)
	next = append(append(append(next, old[:i]...), addrRange{start, end}), old[i:]...)
	s.all.Store(&next)
}

func (s *mapSet) remove(start uintptr) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.all.Load()
	if p == nil {
		return
	}
	old := *p
	next := make([]addrRange, 0, len(old))
	for _, r := range old {
		if r.start != start {
			next = append(next, r)
		}
	}
	s.all.Store(&next)
}

func (s *mapSet) holds(at, n uintptr) bool {
	p := s.all.Load()
	if p == nil {
		return false
	}
	rs := *p
	i := sort.Search(len(rs), func(i int) bool { return rs[i].start > at })
	return i > 0 && at+n <= rs[i-1].end
}
