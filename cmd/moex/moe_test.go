package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Flags of --eplb out of their bounds, or given without it, are usage errors before any
// rank starts.
func TestBenchMoEEPLBFlagsRefused(t *testing.T) {
	for _, args := range [][]string{
		{"--skew", "1.2"},
		{"--redundant", "8"},
		{"--expert-us", "5"},
		{"--eplb", "1"},
		{"--eplb", "5", "--skew", "-1"},
		{"--eplb", "5", "--skew", "NaN"},
		{"--eplb", "5", "--redundant", "3"},
		{"--eplb", "5", "--act", "bf16"},
		{"--eplb", "5", "--iters", "7"},
		{"--eplb", "5", "--expert-us", "-2"},
	} {
		err := benchMoE(context.Background(), append([]string{"--model", "deepseek-v3", "--ranks", "8"}, args...))
		var ue *usageError
		require.ErrorAs(t, err, &ue, "%v", args)
		assert.Equal(t, 2, exitCode(err), "%v", args)
	}
}

// --send-partials and --push-rows are for the plain low-latency run only: elsewhere they
// would be ignored, so they are usage errors.
func TestBenchMoESendPartialsRefused(t *testing.T) {
	for _, args := range [][]string{
		{"--push-rows", "--mode", "normal"},
		{"--push-rows", "--mode", "gathered"},
		{"--push-rows", "--mode", "low-latency", "--eplb", "4"},
		{"--push-rows", "--mode", "low-latency", "--kill", "1"},
		{"--tokens-in-buffer"},
		{"--tokens-in-buffer", "--mode", "low-latency", "--push-rows"},
		{"--tokens-in-buffer", "--mode", "low-latency", "--wire-dtype", "bf16"},
		{"--tokens-in-buffer", "--mode", "low-latency", "--eplb", "4"},
		{"--send-partials", "--mode", "normal"},
		{"--send-partials", "--mode", "gathered"},
		{"--send-partials", "--mode", "low-latency", "--eplb", "4"},
		{"--send-partials", "--mode", "low-latency", "--kill", "1"},
		{"--send-partials", "--mode", "low-latency", "--levels", "two"},
		{"--max-buffer-bytes", "-2"},
		{"--max-buffer-bytes", "1099511627777"},
	} {
		err := benchMoE(context.Background(), append([]string{"--model", "tiny-qwen", "--ranks", "4"}, args...))
		var ue *usageError
		require.ErrorAs(t, err, &ue, "%v", args)
		assert.Equal(t, 2, exitCode(err), "%v", args)
	}
}

// Flags of --kill out of their bounds, or given without it, are usage errors.
func TestBenchMoEKillFlagsRefused(t *testing.T) {
	for _, args := range [][]string{
		{"--runs", "3"},
		{"--weight-bytes", "1M"},
		{"--kill", "1", "--ranks", "2"},
		{"--kill", "4", "--ranks", "4"},
		{"--kill", "1", "--ranks", "4", "--runs", "0"},
		{"--kill", "1", "--ranks", "4", "--runs", "100000"},
		{"--kill", "1", "--ranks", "4", "--mode", "gathered"},
		{"--kill", "1", "--ranks", "4", "--eplb", "4"},
		{"--kill", "1", "--ranks", "4", "--act", "bf16"},
		{"--rejoin"},
		{"--kill", "1", "--ranks", "4", "--rejoin", "--transport", "inproc"},
		{"--kill", "1", "--ranks", "4", "--plot", "x.svg"},
	} {
		err := benchMoE(context.Background(), append([]string{"--model", "tiny-qwen"}, args...))
		var ue *usageError
		require.ErrorAs(t, err, &ue, "%v", args)
	}
}

// bench coll and bench p2p bound their flags: a huge --ranks, negative iterations, a
// factor that never grows, sizes beyond the bound or out of order, a root out of range,
// stray arguments: usage errors before anything starts. -h is not an error.
func TestBenchCollFlagsBounded(t *testing.T) {
	for _, args := range [][]string{
		{"--ranks", "100000"},
		{"--ranks", "0"},
		{"--iters", "-5"},
		{"--factor", "0"},
		{"--factor", "1"},
		{"--max-bytes", "2G"},
		{"--min-bytes", "1M", "--max-bytes", "1K"},
		{"--root", "9"},
		{"stray"},
	} {
		err := benchColl(context.Background(), args)
		var ue *usageError
		require.ErrorAs(t, err, &ue, "bench coll %v", args)
		assert.Equal(t, 2, exitCode(err), "%v", args)
	}
	for _, args := range [][]string{{"--ranks", "100000"}, {"--iters", "-1"}, {"--factor", "0"}, {"--ranks", "1"}} {
		err := benchP2P(context.Background(), args)
		var ue *usageError
		require.ErrorAs(t, err, &ue, "bench p2p %v", args)
	}
	assert.Equal(t, 0, exitCode(benchColl(context.Background(), []string{"-h"})))
}

// Every command refuses what a new user might mistype, with exit code 2 and before any
// rank starts: unknown flag values, stray arguments, ranks out of bounds; -h is exit 0.
func TestCLIHygiene(t *testing.T) {
	ctx := context.Background()
	for _, args := range [][]string{
		{"bench", "moe", "--placement", "random"},
		{"bench", "moe", "--mode", "fast"},
		{"bench", "moe", "--wire-dtype", "fp4"},
		{"bench", "moe", "--combine-dtype", "fp4"},
		{"bench", "moe", "--mode", "gathered", "--combine-dtype", "fp8"},
		{"bench", "moe", "--mode", "gathered", "--sum-at-origin"},
		{"bench", "moe", "--sum-at-origin", "--act", "bf16", "--combine-dtype", "f32"},
		{"bench", "moe", "--sum-at-origin", "--eplb", "4"},
		{"bench", "moe", "--ranks", "0"},
		{"bench", "moe", "--plot", "x.svg", "--eplb", "4"},
		{"bench", "moe", "stray"},
		{"bench", "coll", "--dtype", "f128"},
		{"bench", "coll", "--op-reduce", "median"},
		{"bench", "coll", "--op", "gatherv"},
		{"bench", "coll", "--skew", "1"},
		{"bench", "coll", "--op", "alltoallv", "--skew", "-1"},
		{"bench", "coll", "--warmup", "-1"},
		{"bench", "coalesce", "--ranks", "1"},
		{"bench", "coalesce", "--ranks", "3"},
		{"bench", "coalesce", "--tokens", "0"},
		{"bench", "coalesce", "--topk", "4"},
		{"bench", "coalesce", "--hidden", "64", "--model", "deepseek-v3"},
		{"bench", "coalesce", "--hidden", "64", "--topk", "9", "--experts", "8"},
		{"bench", "coalesce", "--min-chunk", "1M", "--max-chunk", "4K"},
		{"bench", "coalesce", "--wire-dtype", "int4"},
		{"bench", "coalesce", "--iters", "0"},
		{"bench", "coalesce", "--min-chunk", "0"},
		{"bench", "coalesce", "stray"},
		{"bench", "nope"},
		{"doctor", "stray"},
		{"doctor", "--transport", "carrier-pigeon"},
		{"flow", "stray"},
		{"env", "stray"},
		{"topo", "stray"},
		{"run", "-n", "0", "true"},
		{"run"},
	} {
		assert.Equal(t, 2, run(ctx, args), "moex %v", args)
	}
	for _, args := range [][]string{
		{"-h"}, {"bench", "-h"}, {"bench", "moe", "-h"}, {"bench", "coll", "-h"}, {"bench", "coalesce", "-h"},
		{"bench", "p2p", "-h"}, {"doctor", "-h"}, {"flow", "-h"}, {"env", "-h"}, {"topo", "-h"}, {"run", "-h"},
	} {
		assert.Equal(t, 0, run(ctx, args), "moex %v", args)
	}
}
