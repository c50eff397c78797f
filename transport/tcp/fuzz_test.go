package tcp

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A connection's hello from the wire: exactly the 20 bytes a rank sends, read back as
// sent, or an error; never a panic.
func FuzzHello(f *testing.F) {
	f.Add(hello{rank: 1, size: 4, stream: 0, streams: 1}.encode())
	f.Add([]byte(helloMagic))
	f.Add([]byte("XXXX0123456789abcdef"))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := decodeHello(b)
		if err != nil {
			return
		}
		require.Len(t, b, 20)
		assert.Equal(t, b, h.encode())
	})
}
