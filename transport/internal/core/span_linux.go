package core

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// MapSpan maps len(fds) files side by side into one range of addresses: bytes
// [offs[i], offs[i]+stride) of fds[i] at i*stride. stride is a multiple of the page size
// (transport.SpanStride); a file may end inside its last page, as a window does, but not
// before it. UnmapSpan releases the range.
func MapSpan(fds []int, offs []int64, stride int) ([]byte, error) {
	n := len(fds)
	if n == 0 || stride <= 0 || stride%unix.Getpagesize() != 0 || len(offs) != n {
		return nil, fmt.Errorf("core: span of %d files at stride %d", n, stride)
	}
	// Reserve the range first (no access, no memory), then map each file over its part.
	base, err := unix.MmapPtr(-1, 0, nil, uintptr(n*stride), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, fmt.Errorf("core: reserving a span of %d bytes: %w", n*stride, err)
	}
	for i, fd := range fds {
		at := unsafe.Add(base, i*stride)
		if _, err := unix.MmapPtr(fd, offs[i], at, uintptr(stride), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED); err != nil {
			_ = unix.MunmapPtr(base, uintptr(n*stride))
			return nil, fmt.Errorf("core: mapping window %d of a span: %w", i, err)
		}
	}
	return unsafe.Slice((*byte)(base), n*stride), nil
}

// UnmapSpan unmaps a span MapSpan made.
func UnmapSpan(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	return unix.MunmapPtr(unsafe.Pointer(&b[0]), uintptr(len(b)))
}
