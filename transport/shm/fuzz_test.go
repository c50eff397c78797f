package shm

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// A peer's set-up blob: read back as it was encoded, or refused; never a panic.
func FuzzHello(f *testing.F) {
	f.Add(hello{name: "/moex-1-2", pid: 1234, probe: 0xdeadbeef}.encode())
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, ok := decodeHello(b)
		if !ok {
			assert.Less(t, len(b), 12)
			return
		}
		assert.Equal(t, b, h.encode())
	})
}
