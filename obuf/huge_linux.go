package obuf

import (
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
	return m[:n:n], true
}

// hugeFree unmaps a mapping of hugeAlloc (m as it returned it).
func hugeFree(m []byte) {
	size := uintptr(cap(m)+hugePage-1) &^ (hugePage - 1)
	_ = unix.MunmapPtr(unsafe.Pointer(unsafe.SliceData(m)), size)
}
