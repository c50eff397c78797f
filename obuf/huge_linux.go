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
func hugeAlloc(n int) ([]byte, bool) {
	size := (n + hugePage - 1) &^ (hugePage - 1)
	raw, err := unix.Mmap(-1, 0, size+hugePage, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, false
	}
	base := uintptr(unsafe.Pointer(&raw[0]))
	off := int((hugePage - base%hugePage) % hugePage)
	// Give back the unaligned head and tail.
	if off > 0 {
		_ = unix.Munmap(raw[:off])
	}
	if tail := len(raw) - off - size; tail > 0 {
		_ = unix.Munmap(raw[off+size:])
	}
	m := raw[off : off+size : off+size]
	_ = unix.Madvise(m, unix.MADV_HUGEPAGE)
	return m[:n:n], true
}

func hugeFree(m []byte) { _ = unix.Munmap(m[:cap(m)]) }
