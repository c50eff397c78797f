package health

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// A stall probe's reply: at most max ranks, each one a rank a peer could name.
func FuzzProbeReply(f *testing.F) {
	f.Add([]byte{1, 2, 0, 0, 0}, uint8(4))
	f.Add([]byte{0}, uint8(2))
	f.Add([]byte{1, 0xff, 0xff, 0xff, 0xff, 3}, uint8(8))
	f.Fuzz(func(t *testing.T, body []byte, max uint8) {
		r := ParseReply(body, int(max))
		assert.LessOrEqual(t, len(r.Waiting), int(max))
		for _, w := range r.Waiting {
			assert.True(t, w >= 0 && w < 1<<31)
		}
		if len(body) > 0 {
			assert.Equal(t, body[0] == 1, r.InOp)
			assert.LessOrEqual(t, len(r.Waiting), (len(body)-1)/4)
		}
	})
}
