package bench

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A sweep's points: processes 2..8, goroutines 2..64, tokens 1..512; anything else is
// an error.
func TestSweepValues(t *testing.T) {
	v, err := SweepValues("ranks", "shm")
	require.NoError(t, err)
	assert.Equal(t, []int{2, 3, 4, 5, 6, 7, 8}, v)
	v, err = SweepValues("ranks", "inproc")
	require.NoError(t, err)
	assert.Equal(t, 64, v[len(v)-1])
	v, err = SweepValues("tokens", "tcp")
	require.NoError(t, err)
	assert.Equal(t, []int{1, 512}, []int{v[0], v[len(v)-1]})
	_, err = SweepValues("experts", "shm")
	assert.Error(t, err)
}

// DeepEP's low-latency buffer grows with the tokens and the experts, linearly, and is
// double-buffered: for qwen3-30b-a3b's shape (hidden 2048, 128 experts) at 128 tokens,
// the combine's messages (a bf16 row and 16 4-byte scale pairs: 4160 bytes) set both the
// send and the receive buffer at 128 experts x 128 tokens, twice each.
func TestDeepEPLowLatencyBytes(t *testing.T) {
	one := DeepEPLowLatencyBytes(128, 2048, 128)
	assert.Equal(t, int64(2*2*128*128*4160), one)
	assert.Equal(t, 2*one, DeepEPLowLatencyBytes(256, 2048, 128))
	assert.Equal(t, 2*one, DeepEPLowLatencyBytes(128, 2048, 256))
}

// The sweep's table has a row per point, with its growth over the first.
func TestPrintSweep(t *testing.T) {
	rs := []*MoEResult{
		{Model: "m", Ranks: 2, TokensPerRank: 16, Hidden: 2048, Experts: 128, StepMode: "low-latency", PairUS: 100,
			Dispatch: Stage{P50US: 40, BufferBytes: 1 << 20}, Combine: Stage{P50US: 50, BufferBytes: 1 << 20}},
		{Model: "m", Ranks: 4, TokensPerRank: 16, Hidden: 2048, Experts: 128, StepMode: "low-latency", PairUS: 250,
			Dispatch: Stage{P50US: 90, BufferBytes: 2 << 20}, Combine: Stage{P50US: 120, BufferBytes: 2 << 20}},
	}
	var b strings.Builder
	PrintSweep(&b, "ranks", rs)
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	require.Len(t, lines, 5, b.String()) // title, header, two rows, note
	assert.Contains(t, lines[3], "2.50") // the step grew 2.5x
	assert.Contains(t, lines[3], "2.00") // the buffers 2x
}
