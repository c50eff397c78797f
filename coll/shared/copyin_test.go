package shared

import (
	"reflect"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/internal/memx"
)

func isStream(cp func(dst, src []byte) int) bool {
	return reflect.ValueOf(cp).Pointer() == reflect.ValueOf(memx.Stream).Pointer()
}

// The copy into the area streams when forced, never when turned off, and by default once
// plain copies prove inStreamRatio times slower than the operation's local copy three
// times in a row; after inStreamFor operations it tries plain copies again.
func TestCopyInAdapts(t *testing.T) {
	var c copyIn
	cp, timed := c.copier(1, 1<<20)
	assert.True(t, isStream(cp))
	assert.False(t, timed)
	cp, timed = c.copier(-1, 1<<20)
	assert.False(t, isStream(cp))
	assert.False(t, timed)
	cp, timed = c.copier(0, inTimedMin-1)
	assert.False(t, isStream(cp), "small copies stay plain")
	assert.False(t, timed)

	const n = 512 << 10
	slow := func() { c.observe(n, 200*time.Microsecond, n, 20*time.Microsecond) }
	fast := func() { c.observe(n, 25*time.Microsecond, n, 20*time.Microsecond) }
	for range 2 {
		slow()
	}
	fast() // not in a row
	for range 2 {
		slow()
	}
	cp, timed = c.copier(0, n)
	assert.False(t, isStream(cp), "two slow copies in a row are not enough")
	require.True(t, timed)
	slow()
	for i := range inStreamFor {
		cp, timed = c.copier(0, n)
		require.True(t, isStream(cp), "operation %d after three slow copies", i)
		require.False(t, timed)
	}
	cp, timed = c.copier(0, n)
	assert.False(t, isStream(cp), "plain again after inStreamFor operations")
	assert.True(t, timed)
	c.observe(n, time.Millisecond, 0, 0) // no local copy to compare with: nothing learned
	assert.Zero(t, c.slow)
}
