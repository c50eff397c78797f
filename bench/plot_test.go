package bench

import (
	"image"
	"image/png"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// plotDir is where TestPlotsRender writes its PNGs: MOEX_PLOT_DIR to keep and look at
// them, else a temporary directory.
func plotDir(t *testing.T) string {
	if d := os.Getenv("MOEX_PLOT_DIR"); d != "" {
		require.NoError(t, os.MkdirAll(d, 0o755))
		return d
	}
	return t.TempDir()
}

// Results with the shapes of real runs, for the plots.
func plotResults() (*CoalesceResult, []CollResult, []*MoEResult, []*MoEResult) {
	co := &CoalesceResult{Model: "deepseek-v3", Ranks: 4, Transport: "shm", TokensPerRank: 128, Rows: []CoalesceRow{
		{Way: WayPair, P50US: 9100, P99US: 12000, CPUSecGB: 1.9, Messages: 3000},
		{Way: WayTokenRank, P50US: 5200, P99US: 7000, CPUSecGB: 0.9, Messages: 380},
		{Way: WayExpert, P50US: 6100, P99US: 8000, CPUSecGB: 1.2, Messages: 190},
		{Way: WayFused, P50US: 2544.5, P99US: 3100, CPUSecGB: 0.22, Messages: 12},
	}}
	for i, c := range []int{4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20} {
		co.Rows = append(co.Rows, CoalesceRow{Way: WayChunked, ChunkBytes: c, P50US: 4200 - float64(i)*330, P99US: 5400 - float64(i)*380, CPUSecGB: 0.6 - float64(i)*0.07, Messages: int64(12 + 3000>>i)})
	}
	var coll []CollResult
	for i, b := range []int{64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20} {
		for j, op := range []string{"allreduce", "alltoall"} {
			t := float64(b) / 1e3 * float64(1+j) / float64(3+i)
			coll = append(coll, CollResult{Op: op, Transport: "shm", Bytes: b, TimeUS: t, P50US: t, P90US: 1.2 * t, P99US: 1.5 * t, BusBW: float64(b) / t / 1e3, FloorUS: 0.7 * t})
		}
	}
	moe := func(mode, step string, tokens int, d, c float64) *MoEResult {
		return &MoEResult{Model: "mixtral-8x7b", Ranks: 4, Transport: "shm", Mode: mode, StepMode: step, Wire: "f32", TokensPerRank: tokens,
			Hidden: 4096, Experts: 8, TopK: 2, Dispatch: Stage{P50US: d, FloorUS: d / 5, BufferBytes: int64(tokens) << 16},
			Combine: Stage{P50US: c, FloorUS: c / 4, BufferBytes: int64(tokens) << 15}, ComputeUS: 1100}
	}
	modes := []*MoEResult{moe("normal", "normal", 512, 8004, 8293), moe("low-latency", "low-latency", 512, 1900, 3300)}
	var sweep []*MoEResult
	for _, tok := range []int{1, 2, 4, 8, 16, 32, 64, 128, 256, 512} {
		sweep = append(sweep, moe("auto", "normal", tok, 40+15*float64(tok), 50+16*float64(tok)))
	}
	return co, coll, modes, sweep
}

// Every plot renders to a PNG of the size asked, with something drawn on it. (Run with
// MOEX_PLOT_DIR=dir to keep them: titles, labels and legends are checked by looking.)
func TestPlotsRender(t *testing.T) {
	dir := plotDir(t)
	co, coll, modes, sweep := plotResults()
	for name, draw := range map[string]func(string) error{
		"coalesce.png":     func(p string) error { return PlotCoalesce(p, co) },
		"coll.png":         func(p string) error { return PlotColl(p, coll) },
		"moe.png":          func(p string) error { return PlotMoE(p, modes) },
		"sweep-tokens.png": func(p string) error { return PlotSweep(p, "tokens", sweep) },
	} {
		path := filepath.Join(dir, name)
		require.NoError(t, draw(path), name)
		f, err := os.Open(path)
		require.NoError(t, err)
		img, err := png.Decode(f)
		f.Close()
		require.NoError(t, err, name)
		b := img.Bounds()
		assert.Greater(t, b.Dx(), 300, name)
		assert.Greater(t, b.Dy(), 200, name)
		assert.Greater(t, inked(img), 0.01, "%s: little is drawn", name)
	}
}

// inked is the share of the image's pixels that are not white.
func inked(img image.Image) float64 {
	b := img.Bounds()
	n := 0
	for y := b.Min.Y; y < b.Max.Y; y++ {
		for x := b.Min.X; x < b.Max.X; x++ {
			if r, g, bl, _ := img.At(x, y).RGBA(); r < 0xf000 || g < 0xf000 || bl < 0xf000 {
				n++
			}
		}
	}
	return float64(n) / float64(b.Dx()*b.Dy())
}
