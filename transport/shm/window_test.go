package shm_test

import (
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport/shm"
)

// A window is made whole when it is mapped up to 64 MiB; a larger one takes only the
// pages its users touch (a board sized for the worst case must not take its size).
func TestWindowPagesAsTouched(t *testing.T) {
	ts := start(t, 2, nil)
	allocated := func(desc []byte) int64 {
		var st syscall.Stat_t
		require.NoError(t, syscall.Stat(filepath.Join(shm.DevShm, string(desc[8:])), &st))
		return st.Blocks * 512
	}
	small, sdesc, err := ts[0].NewWindow(1 << 20)
	require.NoError(t, err)
	defer small.Close()
	assert.GreaterOrEqual(t, allocated(sdesc), int64(1<<20), "a small window is made whole")

	big, bdesc, err := ts[0].NewWindow(256 << 20)
	require.NoError(t, err)
	defer big.Close()
	assert.Less(t, allocated(bdesc), int64(1<<20), "a 256 MiB window takes its pages as they are touched")
	// The peer maps it without making it either.
	other, _, err := ts[1].NewWindow(4096)
	require.NoError(t, err)
	defer other.Close()
	require.NoError(t, other.Map(0, bdesc))
	require.Len(t, other.Remote(0), 256<<20)
	assert.Less(t, allocated(bdesc), int64(1<<20), "mapped by the peer")
	mem := big.Local()
	for i := 0; i < 4<<20; i += 4096 {
		mem[i] = 1
	}
	got := allocated(bdesc)
	assert.GreaterOrEqual(t, got, int64(4<<20))
	assert.Less(t, got, int64(8<<20))
	assert.Equal(t, byte(1), other.Remote(0)[4096], "the peer sees the page")
	small.Seal()
	big.Seal()
	other.Seal()
}
