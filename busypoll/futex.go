package busypoll

import (
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

const (
	futexWaitPrivate = 0 | 128
	futexWakePrivate = 1 | 128
)

// futexSleep sleeps while *w == val, for at most d, as a raw system call: the runtime does
// not see it, so the goroutine keeps its P. A wake-up, a signal or the timeout ends it.
func futexSleep(w *atomic.Uint32, val uint32, d time.Duration) {
	ts := syscall.NsecToTimespec(int64(d))
	syscall.RawSyscall6(syscall.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexWaitPrivate, uintptr(val), uintptr(unsafe.Pointer(&ts)), 0, 0)
}

// futexWake wakes the goroutine sleeping in futexSleep on w, if any.
func futexWake(w *atomic.Uint32) {
	syscall.RawSyscall6(syscall.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexWakePrivate, 1, 0, 0, 0)
}
