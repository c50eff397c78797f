package main

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/bench"
	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
)

// moex flow plans one step without running ranks and draws it: every section, the links
// that cross hosts, and rows conserved (what ranks send to q is what q's experts receive,
// a token counted once per rank however many of its experts it chose there).
func TestFlow(t *testing.T) {
	hosts := []int{0, 0, 1, 1}
	m, err := coll.NewModel(4, hosts, coll.Config{})
	require.NoError(t, err)
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency, dispatch.Gathered} {
		o := bench.MoEOpts{Model: "tiny-mixtral", Tokens: 40, Mode: mode}
		pl, mc, err := bench.PlanMoE(o, 4, false)
		require.NoError(t, err)
		for q := range pl.Rows {
			in, rows := 0, 0
			for r := range pl.Rows {
				in += pl.Rows[r][q]
			}
			for _, n := range pl.ExpertRows[q] {
				rows += n
			}
			require.True(t, in > 0 && in <= rows && rows <= 2*in, "rank %d: %d rows sent to it, %d rows for its experts (top-2)", q, in, rows)
		}
		var out bytes.Buffer
		require.NoError(t, printFlow(&out, o, mc, pl, m, true))
		want := map[dispatch.Mode][]string{
			dispatch.Normal: {"2. counts (AllGather", "3. dispatch (AlltoAllv, hier)", "4. experts", "5. combine (AlltoAllv",
				"6. sum", "dispatch schedule, rank 0"},
			dispatch.LowLatency: {"2. dispatch (Exchange", "3. experts", "4. combine (Exchange", "5. sum"},
			dispatch.Gathered:   {"2. counts (AllGather", "3. dispatch (AllGatherv", "5. combine (ReduceScatterv", "6. sum"},
		}[mode]
		for _, s := range append(want, "1. route", "(* crosses hosts)", "rank 2 (host 1): experts 4-5") {
			assert.Contains(t, out.String(), s, "%v", mode)
		}
		if mode != dispatch.Normal {
			assert.NotContains(t, out.String(), "schedule, rank", "%v: no AlltoAllv schedules", mode)
		}
		if mode == dispatch.Gathered {
			assert.NotContains(t, out.String(), "flat against two levels")
		} else {
			assert.Contains(t, out.String(), "flat against two levels", "%v", mode)
			assert.Contains(t, out.String(), "the cost model chooses", "%v", mode)
		}
	}
	// On one host the low-latency combine reads the expert outputs in place: a row per
	// (token, expert) choice read in the memory of the rank that holds the expert; with
	// --send-partials (or across hosts, above) it sends partial sums.
	one, err := coll.NewModel(4, nil, coll.Config{})
	require.NoError(t, err)
	// Likewise its experts read the tokens in their origins' memory, unless --push-rows.
	for _, partials := range []bool{false, true} {
		o := bench.MoEOpts{Model: "tiny-mixtral", Tokens: 40, Mode: dispatch.LowLatency, SendPartials: partials, PushRows: partials}
		pl, mc, err := bench.PlanMoE(o, 4, true)
		require.NoError(t, err)
		var out bytes.Buffer
		require.NoError(t, printFlow(&out, o, mc, pl, one, false))
		// The buffers it will hold, before any rank runs: as the stages' functions say.
		cfg, ccfg := pl.Cfg, pl.Combine
		assert.Equal(t, partials, cfg.PushRows)
		assert.Equal(t, partials, ccfg.SendPartials)
		dB, err := dispatch.LowLatencyBytes[float32](cfg, true)
		require.NoError(t, err)
		cB, err := combine.LowLatencyBytes[float32](cfg, ccfg, true)
		require.NoError(t, err)
		assert.Contains(t, out.String(), "every rank mapping every rank's memory")
		assert.Contains(t, out.String(), fmt.Sprintf("dispatch %s, combine %s", bench.SizeOf(int64(dB)), bench.SizeOf(int64(cB))))
		if partials {
			assert.Contains(t, out.String(), "4. combine (Exchange")
			assert.Contains(t, out.String(), "2. dispatch (Exchange")
			assert.NotContains(t, out.String(), "in place")
		} else {
			assert.Contains(t, out.String(), "2. dispatch (in place")
			assert.Contains(t, out.String(), "4. combine (in place")
			assert.Equal(t, pl.Choices[1][0]*mc.Hidden*4, pl.Schedules[0].Combine.Send[1].Read, "rank 1 reads a row for each choice of its tokens that rank 0 took")
			assert.Equal(t, pl.Schedules[0].Combine.Send[1].Read+pl.Schedules[0].Combine.Send[1].Total(), pl.CombineBytes()[0][1], "the matrix sums the schedule")
		}
	}
	// Summed at the origin across hosts: the outputs come back unsummed, a count per row and
	// an output row per choice, in both point-to-point modes.
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		o := bench.MoEOpts{Model: "tiny-mixtral", Tokens: 40, Mode: mode, SumAtOrigin: true}
		pl, mc, err := bench.PlanMoE(o, 4, false)
		require.NoError(t, err)
		var out bytes.Buffer
		require.NoError(t, printFlow(&out, o, mc, pl, m, true))
		assert.Contains(t, out.String(), "summed at the origin): each rank sends its experts' outputs back unsummed", "%v", mode)
		assert.Contains(t, out.String(), "the same bits whatever the ranks, the hosts and the placement", "%v", mode)
		assert.Equal(t, 32+4*pl.Rows[0][1]+pl.Choices[0][1]*mc.Hidden*4, pl.CombineBytes()[1][0], "%v: rank 1 sends rank 0 a 32-byte header and an output per choice of its tokens there", mode)
	}
	// A real model's layers: one dispatcher and combiner for all of them, or a pair each.
	{
		o := bench.MoEOpts{Model: "mixtral-8x7b", Tokens: 4, Mode: dispatch.LowLatency}
		pl, mc, err := bench.PlanMoE(o, 4, true)
		require.NoError(t, err)
		var out bytes.Buffer
		require.NoError(t, printFlow(&out, o, mc, pl, one, false))
		dB, err := dispatch.LowLatencyBytes[float32](pl.Cfg, true)
		require.NoError(t, err)
		cB, err := combine.LowLatencyBytes[float32](pl.Cfg, pl.Combine, true)
		require.NoError(t, err)
		assert.Contains(t, out.String(), fmt.Sprintf("for the model's 32 MoE layers: %s with one dispatcher and combiner for all", bench.SizeOf(int64(dB+cB))))
		assert.Contains(t, out.String(), fmt.Sprintf("%s with a pair per layer", bench.SizeOf(32*int64(dB+cB))))
	}
	require.ErrorAs(t, cmdFlow(context.Background(), []string{"--send-partials", "--mode", "normal"}), new(*usageError))
	require.ErrorAs(t, cmdFlow(context.Background(), []string{"--push-rows", "--mode", "normal"}), new(*usageError))
	// Planned bytes agree with the format: the dispatch matrix is blocks of rows.
	pl, _, err := bench.PlanMoE(bench.MoEOpts{Model: "tiny-mixtral", Tokens: 40}, 4, false)
	require.NoError(t, err)
	b := pl.DispatchBytes()
	assert.Equal(t, 32+pl.Rows[0][1]*pl.Format.RowBytes(0)+8*pl.Choices[0][1], b[0][1], "a 32-byte header")
	assert.Greater(t, pl.Choices[0][1], pl.Rows[0][1], "tiny-mixtral's tokens choose 2 experts, some on one rank")
	assert.Zero(t, b[2][2])
	assert.True(t, strings.Contains(pl.Cfg.Mode.String(), "normal"))
}
