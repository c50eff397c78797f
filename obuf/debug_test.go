//go:build moexdebug

package obuf

import "testing"

// Reuse before completion: the owner writes to a buffer while a send reads it.
func TestDebugCatchesWriteWhileInFlight(t *testing.T) {
	p := NewPool(4)
	b := p.Get(8192)
	copy(b.Bytes(), "payload")
	b.Lend()
	b.Bytes()[0] = 'X' // the pitfall
	mustPanic(t, "write while in flight", b.Return)
}

// A write after the last release shows when the buffer is handed out again.
func TestDebugCatchesWriteAfterRelease(t *testing.T) {
	p := NewPool(4)
	b := p.Get(8192)
	stale := b.Bytes()
	b.Release()
	stale[100] = 1
	mustPanic(t, "write after release", func() { p.Get(8192) })
}

func TestDebugCleanLifecyclePasses(t *testing.T) {
	p := NewPool(4)
	b := p.Get(8192)
	b.Lend()
	b.Return()
	b.Release()
	p.Get(8192).Release()
}
