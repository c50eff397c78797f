package bench

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/router"
)

// The five ways move the same rows: every row arrives intact, and the counts of messages
// and bytes relate as coalescing says.
func TestCoalesceWays(t *testing.T) {
	const p, tokens, hidden, k, experts = 4, 24, 96, 4, 16
	o := CoalesceOpts{Hidden: hidden, TopK: k, Experts: experts, Tokens: tokens, Iters: 2, Warmup: 1, MinChunk: 1 << 10, MaxChunk: 8 << 10}
	res := onRanks(t, p, coll.Config{}, func(c *coll.Comm) (*CoalesceResult, error) {
		return Coalesce(context.Background(), c, o, c.Rank() == 0)
	})
	require.NotNil(t, res)
	require.Len(t, res.Rows, 4+4) // pair, token-rank, expert, fused, chunks of 1, 2, 4, 8 KiB
	by := map[string]CoalesceRow{}
	for _, r := range res.Rows {
		assert.Zero(t, r.Wrong, "%s %d: rows that arrived wrong", r.Way, r.ChunkBytes)
		assert.Positive(t, r.P50US, r.Way)
		if r.Way != WayChunked {
			by[r.Way] = r
		}
	}
	// The expected counts, from every rank's routing.
	pl, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	var pairs, tokenRanks, perExpert, fused int64
	for me := 0; me < p; me++ {
		r := routeSynthetic(tokens, k, experts, 1, me)
		dests := map[int]bool{}
		exp := map[int]bool{}
		for t := 0; t < tokens; t++ {
			seen := map[int]bool{}
			for j := 0; j < k; j++ {
				e := int(r.Experts[t*k+j])
				q := pl.RankOf(e, me, t)
				if q == me {
					continue
				}
				pairs++
				exp[e] = true
				if !seen[q] {
					seen[q] = true
					tokenRanks++
					dests[q] = true
				}
			}
		}
		perExpert += int64(len(exp))
		fused += int64(len(dests))
	}
	rb := int64(res.RowBytes)
	assert.Equal(t, int64(8+hidden*2), rb) // bf16 by default
	assert.Equal(t, pairs, by[WayPair].Messages)
	assert.Equal(t, pairs*rb, by[WayPair].Bytes)
	assert.Equal(t, tokenRanks, by[WayTokenRank].Messages)
	assert.Equal(t, tokenRanks*rb, by[WayTokenRank].Bytes)
	assert.Equal(t, perExpert, by[WayExpert].Messages)
	assert.Equal(t, pairs*rb, by[WayExpert].Bytes, "per expert, a token goes once per expert")
	assert.Equal(t, fused, by[WayFused].Messages)
	assert.Equal(t, tokenRanks*rb, by[WayFused].Bytes, "fused, a token goes once per rank")
	for _, r := range res.Rows {
		if r.Way == WayChunked {
			assert.Equal(t, by[WayFused].Bytes, r.Bytes)
			assert.GreaterOrEqual(t, r.Messages, by[WayFused].Messages)
		}
	}
	assert.NotEmpty(t, res.Reason)

	svg := filepath.Join(t.TempDir(), "c.svg")
	require.NoError(t, PlotCoalesce(svg, res))
	b, err := os.ReadFile(svg)
	require.NoError(t, err)
	assert.Contains(t, string(b), "<svg")
}

// checkRows finds a row whose payload is another token's, and a torn row.
func TestCheckRows(t *testing.T) {
	const rb = 8 + 16
	row := func(src, tok int) []byte {
		b := make([]byte, rb)
		b[0] = byte(tok)
		for j := 0; j < 16; j++ {
			b[8+j] = payloadByte(src, tok*16+j)
		}
		return b
	}
	good := append(row(2, 3), row(2, 5)...)
	assert.Zero(t, checkRows(good, rb, 2))
	bad := append(row(2, 3), row(2, 5)...)
	bad[rb] = 4 // the second row claims token 4
	assert.Equal(t, 1, checkRows(bad, rb, 2))
	assert.Equal(t, 1, checkRows(good[:rb+3], rb, 2), "a partial row")
	assert.Equal(t, 2, checkRows(good, rb, 1), "rows from another rank")
}

// The recommendation: the fused way when splitting buys nothing, a chunk when it is
// faster, and chunks as large as the fused messages count as fused.
func TestRecommendChunk(t *testing.T) {
	rows := []CoalesceRow{
		{Way: WayPair, P50US: 900, Messages: 100},
		{Way: WayFused, P50US: 100, CPUSecGB: 1, Messages: 12},
		{Way: WayChunked, ChunkBytes: 4 << 10, P50US: 300, CPUSecGB: 3, Messages: 400},
		{Way: WayChunked, ChunkBytes: 1 << 20, P50US: 80, CPUSecGB: 0.5, Messages: 12},
	}
	k, quoted, why := recommendChunk(rows)
	assert.Zero(t, k, why)
	assert.Same(t, &rows[3], quoted, "the 1 MiB chunks split nothing: theirs is the fastest unsplit run, and its figures are quoted")
	rows[2].P50US, rows[2].CPUSecGB = 50, 0.9
	k, quoted, why = recommendChunk(rows)
	assert.Equal(t, 4<<10, k, why)
	assert.Same(t, &rows[2], quoted)
}

// The figures a recommendation quotes are one run's, named: the fused row's p50 is not
// quoted with another run's CPU (bench coalesce once gave the 2 MiB chunked row's p50
// 2385 us and 0.18 s/GB as the fused row's 2544.5 and 0.22).
func TestRecommendChunkQuotesOneRun(t *testing.T) {
	rows := []CoalesceRow{
		{Way: WayFused, P50US: 2544.5, CPUSecGB: 0.22, Messages: 12},
		{Way: WayChunked, ChunkBytes: 2 << 20, P50US: 2385, CPUSecGB: 0.25, Messages: 12},
		{Way: WayChunked, ChunkBytes: 4 << 20, P50US: 2600, CPUSecGB: 0.18, Messages: 12},
		{Way: WayChunked, ChunkBytes: 64 << 10, P50US: 4000, CPUSecGB: 0.9, Messages: 800},
	}
	k, quoted, why := recommendChunk(rows)
	assert.Zero(t, k, why)
	require.Same(t, &rows[1], quoted)
	assert.Contains(t, why, "p50 2385 us")
	assert.Contains(t, why, "0.25 s/GB", "the CPU of the run whose p50 it quotes, not the least of any run")
	assert.Contains(t, why, "2.0 MiB chunks, which split nothing")
}
