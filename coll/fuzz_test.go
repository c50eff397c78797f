package coll

import (
	"errors"
	"testing"

	"github.com/moex-ai/moex/coll/health"

	"github.com/stretchr/testify/assert"
)

// A peer's abort notice, whatever its bytes: an error that matches the sentinel of its
// kind, naming a rank only as the notice says; never a panic.
func FuzzNotice(f *testing.F) {
	f.Add(uint8(health.Timeout), int32(3), "coll: timeout")
	f.Add(uint8(health.Peer), int32(-1), "")
	f.Add(uint8(health.Mismatch), int32(0), "mismatch")
	f.Add(uint8(200), int32(1<<30), "?")
	f.Fuzz(func(t *testing.T, kind uint8, peer int32, reason string) {
		err := decodeNotice(health.Kind(kind), int(peer), reason)
		if err == nil {
			t.Fatal("a notice decoded to no error")
		}
		switch health.Kind(kind) {
		case health.Timeout:
			assert.ErrorIs(t, err, ErrTimeout)
		case health.Mismatch:
			assert.ErrorIs(t, err, ErrMismatch)
		case health.Argument:
			assert.ErrorIs(t, err, ErrInvalidArgument)
		case health.Peer:
			var pe *PeerError
			assert.True(t, errors.As(err, &pe) && pe.Rank == int(peer))
		}
		_ = err.Error()
	})
}
