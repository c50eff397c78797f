package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/bench"
)

// moex bench moe --chaos over tcp, faults every 2 to 3 s (kills only): ranks are killed,
// the others heal, new processes take the ranks over, and no token comes back wrong, no
// process fails, nothing hangs; the job is at full strength most of the time.
func TestBenchChaos(t *testing.T) {
	exe := moexBinary(t)
	var o, e bytes.Buffer
	cmd := exec.Command(exe, "bench", "moe", "--model", "tiny-qwen", "--ranks", "3", "--transport", "tcp", "--tokens", "8", "--chaos", "12s", "--json")
	cmd.Env = append(cmd.Environ(), "MOEX_CHAOS_EVERY=2s-3s", "MOEX_CHAOS_STOPS=0")
	cmd.Stdout, cmd.Stderr = &o, &e
	require.NoError(t, cmd.Run(), "stdout:\n%s\nstderr:\n%s", o.String(), e.String())
	var s bench.ServeSummary
	require.NoError(t, json.Unmarshal(o.Bytes(), &s), o.String())
	assert.GreaterOrEqual(t, s.Kills, 1, "%+v", s)
	assert.GreaterOrEqual(t, s.Regrows, 1, "%+v", s)
	assert.Zero(t, s.WrongTokens)
	assert.Zero(t, s.Errors)
	assert.False(t, s.Hung)
	assert.Positive(t, s.Steps)
	assert.Greater(t, s.FullShare, 0.3, "%+v", s)
}

// --chaos refuses what it cannot run, naming the flag.
func TestBenchChaosRefuses(t *testing.T) {
	for _, args := range [][]string{
		{"--chaos", "1s"},
		{"--chaos", "20s", "--ranks", "2"},
		{"--chaos", "20s", "--transport", "inproc"},
		{"--chaos", "20s", "--kill", "1"},
		{"--chaos", "20s", "--mode", "gathered"},
		{"--chaos", "20s", "--rdzv", "zk://127.0.0.1:1/x"},
		{"--chaos", "20s", "--rdzv", "etcd://127.0.0.1:1"},
		{"--rdzv", "etcd://127.0.0.1:1/x"},
		{"--kill", "1", "--rdzv", "etcd://127.0.0.1:1/x"},
	} {
		err := benchMoE(context.Background(), args)
		var ue *usageError
		require.ErrorAs(t, err, &ue, "%v", args)
	}
}
