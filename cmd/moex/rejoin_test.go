package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/bench"
)

// moex bench moe --kill 1 --rejoin (shm, tcp): the job loses rank 1, serves on two ranks, a new
// process takes rank 1 over and the job serves on three again, every token checked by
// the ranks; the timeline's events come in their order, the steps' rates are there, and
// the plot is written.
func TestBenchRejoin(t *testing.T) {
	dir := t.TempDir()
	exe := moexBinary(t)
	for _, tr := range []string{"shm", "tcp"} {
		png := filepath.Join(dir, "rejoin-"+tr+".png")
		var o, e bytes.Buffer
		cmd := exec.Command(exe, "bench", "moe", "--model", "tiny-qwen", "--ranks", "3", "--transport", tr, "--tokens", "8",
			"--kill", "1", "--rejoin", "--json", "--plot", png)
		cmd.Stdout, cmd.Stderr = &o, &e
		require.NoError(t, cmd.Run(), "stdout:\n%s\nstderr:\n%s", o.String(), e.String())
		var s bench.RecoverSummary
		require.NoError(t, json.Unmarshal(o.Bytes(), &s), o.String())
		require.Len(t, s.Runs, 1)
		r := s.Runs[0]
		tl := r.Rejoin
		require.NotNil(t, tl, o.String())
		assert.True(t, r.DetectUS/1e3 <= r.FirstStepUS/1e3 && r.FirstStepUS/1e3 <= tl.AdmittedMS, "%+v %+v", r, tl)
		assert.True(t, tl.StartedMS > 0 && tl.StartedMS <= tl.JoinedMS && tl.AdmittedMS <= tl.GrownMS && tl.GrownMS <= tl.ServingMS, "%+v", tl)
		assert.Positive(t, tl.Moves, "experts moved onto the new process")
		assert.GreaterOrEqual(t, tl.StepsFewer, 1)
		ranks := map[int]int{}
		for _, pt := range tl.Rate {
			ranks[pt.Ranks]++
			assert.Positive(t, pt.TokensPerS)
		}
		assert.Equal(t, tl.StepsFewer, ranks[2])
		assert.Equal(t, 20, ranks[3])
		st, err := os.Stat(png)
		require.NoError(t, err)
		assert.Positive(t, st.Size())
	}
}
