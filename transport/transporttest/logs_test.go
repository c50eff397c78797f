package transporttest

import (
	"errors"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The Recorder keeps each record's level, message and attributes: those of the call,
// those of With (every one of them) and those under a group, flattened with dots.
func TestRecorder(t *testing.T) {
	var rec Recorder
	boom := errors.New("boom")
	log := rec.Logger().With("rank", 2, "host", "a")
	log.Debug("quiet", "peer", 3)
	log.WithGroup("g").Warn("loud", "err", boom, slog.Group("sub", "n", 7))
	got := rec.Records()
	require.Len(t, got, 2)
	assert.True(t, Logged(slog.LevelDebug, "quiet")(got[0]))
	for _, key := range []string{"rank", "peer"} {
		_, ok := got[0].Int(key)
		assert.True(t, ok, "attribute %s", key)
	}
	assert.Equal(t, "a", got[0].Attrs["host"])
	assert.True(t, Logged(slog.LevelWarn, "loud")(got[1]))
	assert.ErrorIs(t, got[1].Err("g.err"), boom)
	n, ok := got[1].Int("g.sub.n")
	assert.True(t, ok)
	assert.Equal(t, int64(7), n)
	r2, _ := got[1].Int("rank")
	assert.Equal(t, int64(2), r2, "With's attributes stay unprefixed under a later group")
	assert.Equal(t, 1, rec.Count(Logged(slog.LevelWarn, "loud")))
	assert.True(t, rec.WaitFor(Logged(slog.LevelDebug, "quiet")))
}
