package coll

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
)

// A peer's abort notice, whatever its bytes: an error that matches the sentinel of its
// kind, naming a rank only as the notice says; never a panic.
func FuzzNotice(f *testing.F) {
	f.Add(kindTimeout, int32(3), "coll: timeout")
	f.Add(kindPeer, int32(-1), "")
	f.Add(kindMismatch, int32(0), "mismatch")
	f.Add(uint8(200), int32(1<<30), "?")
	f.Fuzz(func(t *testing.T, kind uint8, peer int32, reason string) {
		err := decodeNotice(kind, int(peer), reason)
		if err == nil {
			t.Fatal("a notice decoded to no error")
		}
		switch kind {
		case kindTimeout:
			assert.ErrorIs(t, err, ErrTimeout)
		case kindMismatch:
			assert.ErrorIs(t, err, ErrMismatch)
		case kindArg:
			assert.ErrorIs(t, err, ErrInvalidArgument)
		case kindPeer:
			var pe *PeerError
			assert.True(t, errors.As(err, &pe) && pe.Rank == int(peer))
		}
		_ = err.Error()
	})
}

// A stall probe's reply: at most max ranks, each one a rank a peer could name.
func FuzzProbeReply(f *testing.F) {
	f.Add([]byte{1, 2, 0, 0, 0}, uint8(4))
	f.Add([]byte{0}, uint8(2))
	f.Add([]byte{1, 0xff, 0xff, 0xff, 0xff, 3}, uint8(8))
	f.Fuzz(func(t *testing.T, body []byte, max uint8) {
		r := parseProbeReply(body, int(max))
		assert.LessOrEqual(t, len(r.waiting), int(max))
		for _, w := range r.waiting {
			assert.True(t, w >= 0 && w < 1<<31)
		}
		if len(body) > 0 {
			assert.Equal(t, body[0] == 1, r.inOp)
			assert.LessOrEqual(t, len(r.waiting), (len(body)-1)/4)
		}
	})
}
