package shm

import (
	"time"

	"golang.org/x/sys/unix"
)

// SetProgressNap sets how long the progress loop sleeps at most (see progressNap).
func SetProgressNap(d time.Duration) { progressNap = d }

// BreakArena gives t, as rank peer's arena, a file that is not one (/dev/null, empty), so
// that mapping it fails as where the peer's memfd cannot be taken, and t reads that peer's
// shared buffers across instead. Close closes it.
func BreakArena(t *Transport, peer int) error {
	fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	t.list()[peer].arena.fd = fd
	return err
}

// RawParks reports whether t's goroutines sleep holding their Ps (see rawParks).
func RawParks(t *Transport) bool { return t.rawParks() }

// FutexPark and FutexWake are futexPark and futexWake.
func FutexPark(addr *uint32, val uint32, timeout time.Duration) bool {
	return futexPark(addr, val, int64(timeout))
}

func FutexWake(addr *uint32) { futexWake(addr) }

// RefusePtrace makes the named system calls ("pidfd_getfd", "process_vm_readv") fail
// with EPERM, as the kernel refuses them to a process without ptrace rights over the
// peer, until the returned function restores them. Tests that call it must not run in
// parallel.
func RefusePtrace(calls ...string) (restore func()) {
	getfd, readv := pidfdGetfd, processVMReadv
	for _, c := range calls {
		switch c {
		case "pidfd_getfd":
			pidfdGetfd = func(int, int, int) (int, error) { return -1, unix.EPERM }
		case "process_vm_readv":
			processVMReadv = func(int, []unix.Iovec, []unix.RemoteIovec, uint) (int, error) { return 0, unix.EPERM }
		default:
			panic("RefusePtrace: " + c)
		}
	}
	return func() { pidfdGetfd, processVMReadv = getfd, readv }
}
