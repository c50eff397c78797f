package core

import "sync"

// FreeList is a stack of values for reuse: the request structs a transport recycles so
// that steady-state operations allocate nothing. Unlike sync.Pool it keeps its values
// across garbage collections, which would otherwise put allocations back on the hot
// path. The zero value is ready; it is safe for concurrent use.
type FreeList[T any] struct {
	mu   sync.Mutex
	free []T
}

// Get returns a value put back earlier, or ok false when there is none.
func (l *FreeList[T]) Get() (v T, ok bool) {
	l.mu.Lock()
	if n := len(l.free); n > 0 {
		v, ok = l.free[n-1], true
		var zero T
		l.free[n-1] = zero
		l.free = l.free[:n-1]
	}
	l.mu.Unlock()
	return v, ok
}

// Put keeps v for a later Get.
func (l *FreeList[T]) Put(v T) {
	l.mu.Lock()
	l.free = append(l.free, v)
	l.mu.Unlock()
}

// Drain removes every value, calling f on each (to release what they hold).
func (l *FreeList[T]) Drain(f func(T)) {
	l.mu.Lock()
	free := l.free
	l.free = nil
	l.mu.Unlock()
	for _, v := range free {
		f(v)
	}
}
