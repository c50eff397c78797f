package obuf

import (
	"fmt"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The shared arena: one memfd per process, from which the buffers of shared pools
// (NewSharedPool, Shared) are mapped. Other processes of the job on this host can take
// the file (pidfd_getfd) and map it, and so read a buffer in place: one copy from the
// sender's buffer into the receiver's where private memory needs two (into shared memory,
// out of it) or the kernel's cross-memory copy.
//
// The file only grows: a buffer keeps its range of the file for as long as it lives, a
// freed range has its pages punched out (the memory goes back; the size stays) and is
// reused for the next buffer of the same size. A mapping another process made of the
// file therefore stays valid for as long as it keeps it: it never reads beyond the end.
type arena struct {
	mu    sync.Mutex
	fd    int   // -1 until the first shared buffer
	size  int64 // the file's size
	err   error // why the arena could not be made (then shared pools hand out private buffers)
	free  map[int64][]int64
	spans atomic.Pointer[[]sharedSpan] // live mappings, sorted by start; copied on change
}

type sharedSpan struct {
	start, end uintptr
	off        int64
}

var theArena = arena{fd: -1}

// ArenaName is the name of the shared arena's memfd (as /proc/PID/fd shows it:
// "memfd:moex-obuf").
const ArenaName = "moex-obuf"

func sharedRound(n int) int64 { return (int64(n) + PageSize - 1) &^ (PageSize - 1) }

// sharedAlloc maps n bytes of the arena (rounded up to pages) and returns them with their
// offset in the file.
func sharedAlloc(n int) ([]byte, int64, error) {
	a := &theArena
	size := sharedRound(max(n, 1))
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.fd < 0 {
		if a.err != nil {
			return nil, 0, a.err
		}
		fd, err := unix.MemfdCreate(ArenaName, unix.MFD_CLOEXEC)
		if err != nil {
			a.err = fmt.Errorf("obuf: memfd_create: %w", err)
			return nil, 0, a.err
		}
		a.fd, a.free = fd, map[int64][]int64{}
	}
	var off int64
	if k := len(a.free[size]); k > 0 {
		off = a.free[size][k-1]
		a.free[size] = a.free[size][:k-1]
	} else {
		// Large buffers at offsets aligned to their size (up to 2 MiB), where the host
		// gives shared memory huge pages.
		align := min(size, int64(hugePage))
		off = (a.size + align - 1) &^ (align - 1)
		if err := unix.Ftruncate(a.fd, off+size); err != nil {
			return nil, 0, fmt.Errorf("obuf: growing the shared arena to %d bytes: %w", off+size, err)
		}
		a.size = off + size
	}
	p, err := unix.MmapPtr(a.fd, off, nil, uintptr(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		a.free[size] = append(a.free[size], off)
		return nil, 0, fmt.Errorf("obuf: mapping %d bytes of the shared arena: %w", size, err)
	}
	m := unsafe.Slice((*byte)(p), size)
	if size >= hugePage {
		_ = unix.Madvise(m, unix.MADV_HUGEPAGE)
	}
	a.setSpan(sharedSpan{start: uintptr(p), end: uintptr(p) + uintptr(size), off: off}, true)
	return m[:n:n], off, nil
}

// sharedFree unmaps a buffer of sharedAlloc (s: where it is mapped, the length asked of
// sharedAlloc and its offset), gives its pages back and keeps its range for the next
// buffer of its size.
func sharedFree(s sharedMapping) {
	a := &theArena
	size := sharedRound(max(s.n, 1))
	a.mu.Lock()
	defer a.mu.Unlock()
	a.setSpan(sharedSpan{start: uintptr(s.p)}, false)
	_ = unix.MunmapPtr(s.p, uintptr(size))
	if err := unix.Fallocate(a.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, s.off, size); err != nil {
		return // the range keeps its pages: do not hand it out again
	}
	a.free[size] = append(a.free[size], s.off)
}

// sharedMapping is what the collector's cleanup needs to free a shared buffer (nothing
// that points at the Buf).
type sharedMapping struct {
	p   unsafe.Pointer
	n   int
	off int64
}

// setSpan adds or (add false) removes the span starting at s.start. Caller holds a.mu.
func (a *arena) setSpan(s sharedSpan, add bool) {
	var old []sharedSpan
	if p := a.spans.Load(); p != nil {
		old = *p
	}
	next := make([]sharedSpan, 0, len(old)+1)
	for _, x := range old {
		if x.start != s.start {
			next = append(next, x)
		}
	}
	if add {
		next = append(next, s)
		sort.Slice(next, func(i, j int) bool { return next[i].start < next[j].start })
	}
	a.spans.Store(&next)
}

// SharedFD returns the shared arena's file descriptor in this process, or -1 while no
// shared buffer has been made. Another process that may trace this one (the permission
// cross-memory attach needs) can take it with pidfd_getfd and map it.
func SharedFD() int {
	theArena.mu.Lock()
	defer theArena.mu.Unlock()
	return theArena.fd
}

// SharedErr returns why shared pools hand out private buffers (memfd_create failed), or
// nil.
func SharedErr() error {
	theArena.mu.Lock()
	defer theArena.mu.Unlock()
	return theArena.err
}

// Locate reports whether p lies wholly inside one live buffer of a shared pool, and where
// it starts in the shared arena's file. It takes no lock: a transport may ask for every
// message.
func Locate(p []byte) (off int64, ok bool) {
	if len(p) == 0 {
		return 0, false
	}
	sp := theArena.spans.Load()
	if sp == nil {
		return 0, false
	}
	spans := *sp
	s := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	e := s + uintptr(len(p))
	i := sort.Search(len(spans), func(i int) bool { return spans[i].start > s })
	if i == 0 {
		return 0, false
	}
	x := spans[i-1]
	if e > x.end {
		return 0, false
	}
	return x.off + int64(s-x.start), true
}

// ArenaFile reports whether fd (of this process) is a shared arena's memfd, as the one a
// transport took from another process should be.
func ArenaFile(fd int) bool {
	link, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
	return err == nil && link == "/memfd:"+ArenaName+" (deleted)"
}
