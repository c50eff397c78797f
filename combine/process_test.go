package combine_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/moex-ai/moex/internal/long"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport/shm"
)

// helperComm is a helper rank's communicator (coll.Init, from moex run's environment)
// and a context for its work, both ended when the test ends.
func helperComm(t *testing.T) (context.Context, *coll.Comm) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	c, err := coll.Init(ctx, coll.Config{})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return ctx, c
}

// TestHelperMoERank is one rank of TestMoEProcesses, started by `moex run`.
func TestHelperMoERank(t *testing.T) {
	tr := os.Getenv("MOEX_COMBINE_HELPER")
	if tr == "" {
		t.Skip("helper rank: runs only under TestMoEProcesses")
	}
	ctx, c := helperComm(t)
	p := c.Size()
	tokens := make([]int, p)
	for i := range tokens {
		tokens[i] = 13 + 7*i
	}
	tokens[1] = 0 // a rank with no tokens
	small := scenario{p: p, hid: 9, k: 3, experts: 2 * p, tokens: tokens, dropEvery: 7, seed: 1, maxTokens: 13 + 7*(p-1)}
	// Rows of 8 KiB: every rank's send buffer is larger than the area (read in place from
	// the shared arena in the normal mode).
	big := scenario{p: p, hid: 2048, k: 2, experts: 2 * p, tokens: []int{200, 150, 220, 180}[:p], seed: 2, maxTokens: 220}
	algo := coll.AlgoAuto
	if tr == "shm" {
		algo = coll.Shared
	}
	for _, mode := range modes {
		for _, wire := range []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3} {
			pl, err := router.NewPlacement(router.Contiguous, small.experts, p)
			require.NoError(t, err)
			cfg := step{Config: dispatch.Config{WireDType: wire, Placement: pl, Mode: mode}}
			require.NoError(t, checkRank[float32](c, small, cfg, 2, algo), "rank %d, %v, %v on the wire", c.Rank(), mode, wire)
			require.NoError(t, checkRank[dtype.BFloat16](c, small, cfg, 1, algo), "rank %d, %v, %v on the wire, bf16", c.Rank(), mode, wire)
			if wire != dtype.BF16 {
				require.NoError(t, checkRank[float32](c, big, cfg, 1, algo), "rank %d, hidden %d, %v, %v on the wire", c.Rank(), big.hid, mode, wire)
			}
		}
	}
	// The Auto mode (MaxTokens 16 by default) grows its low-latency buffers for the
	// scenario's larger ranks (up to 34 tokens: to 64) on every process alike, and both
	// rounds deliver what they must: over shm the grown rows are read in place.
	{
		pl, err := router.NewPlacement(router.Contiguous, small.experts, p)
		require.NoError(t, err)
		require.NoError(t, checkRank[float32](c, small, step{Config: dispatch.Config{Placement: pl}}, 2, coll.AlgoAuto), "rank %d, auto", c.Rank())
	}
	// Partial sums in fp8 and int8, and the outputs sent unsummed (SumAtOrigin), between
	// processes.
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		pl, err := router.NewPlacement(router.RoundRobin, small.experts, p)
		require.NoError(t, err)
		for _, cfg := range []step{
			{dispatch.Config{Placement: pl, Mode: mode}, combine.Config{PartialDType: dtype.FP8E4M3, SendPartials: mode == dispatch.LowLatency}},
			{dispatch.Config{Placement: pl, Mode: mode}, combine.Config{PartialDType: dtype.I8}},
			{dispatch.Config{Placement: pl, Mode: mode}, combine.Config{SumAtOrigin: true, SendPartials: mode == dispatch.LowLatency}},
		} {
			require.NoError(t, checkRank[float32](c, small, cfg, 2, coll.AlgoAuto), "rank %d, %v, %v back, sum at origin %v", c.Rank(), mode, cfg.Back.PartialDType, cfg.Back.SumAtOrigin)
			require.NoError(t, checkRank[dtype.BFloat16](c, small, cfg, 1, coll.AlgoAuto), "rank %d, %v, %v back, sum at origin %v, bf16", c.Rank(), mode, cfg.Back.PartialDType, cfg.Back.SumAtOrigin)
		}
	}
	if tr == "shm" {
		// The normal mode's buffers are shared, so the others read them in place.
		st, ok := c.Transport().(*shm.Transport)
		require.True(t, ok, "transport %T", c.Transport())
		require.NotZero(t, st.Stats().SharedBytes, "rank %d: no bytes read in place from the dispatchers' shared buffers", c.Rank())
	}
	// The low-latency mode's experts read the tokens in their origins' memory over shm
	// (PushRows: each rank writes them into every peer's memory), and it sends messages
	// over tcp and ucx; its combine reads in place over shm.
	pl, err := router.NewPlacement(router.Contiguous, 2*p, p)
	require.NoError(t, err)
	r := &router.Routing{T: 2, K: 2, E: 2 * p, Experts: []int32{0, int32(2*p - 1), 1, 2}, Weights: []float32{1, 1, 1, 1}}
	for _, push := range []bool{true, false} {
		d, err := dispatch.New[float32](ctx, c, dispatch.Config{Hidden: 16, TopK: 2, Placement: pl, Mode: dispatch.LowLatency, MaxTokens: 4, PushRows: push})
		require.NoError(t, err)
		_, _, err = d.Dispatch(ctx, make([]float32, 32), r)
		require.NoError(t, err)
		want := 0
		if tr == "shm" && push {
			want = p - 1
		}
		assert.Equal(t, want, d.Stats().Pushed, "ranks written into directly over %s, PushRows %v", tr, push)
		assert.Equal(t, tr == "shm" && !push, d.RowsInPlace(), "rows read in place over %s, PushRows %v", tr, push)
		assert.Equal(t, tr == "shm" && !push, d.Stats().InPlace)
		require.NoError(t, d.Close())
	}
	d, err := dispatch.New[float32](ctx, c, dispatch.Config{Hidden: 16, TopK: 2, Placement: pl, Mode: dispatch.LowLatency, MaxTokens: 4})
	require.NoError(t, err)
	defer d.Close()
	// Its combine reads the expert outputs in place over shm (every rank on this host).
	cb, err := combine.New[float32](ctx, d, combine.Config{})
	require.NoError(t, err)
	defer cb.Close()
	require.Equal(t, tr == "shm", cb.InPlace(), "combine in place over %s", tr)
	// A bad handle on one rank fails every rank's combine, in every mode, and the pair
	// and the communicator serve on.
	require.NoError(t, badHandles(ctx, c, 1), "rank %d over %s", c.Rank(), tr)
	fmt.Printf("rank %d ok\n", c.Rank())
}

// The MoE dispatch and combine between processes, over shared memory (through the
// shared areas in the normal mode, the plans say so, and written into the peers' memory
// in the low-latency mode) and over tcp, deliver what the scenario implies.
func TestMoEProcesses(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("shared memory and the launcher's process handling: Linux only")
	}
	exe := filepath.Join(t.TempDir(), "moex")
	out, err := exec.Command("go", "build", "-o", exe, "github.com/moex-ai/moex/cmd/moex").CombinedOutput()
	require.NoError(t, err, "building moex: %s", out)
	transports := []string{"shm"}
	if long.Enabled() {
		transports = append(transports, "tcp") // the quick cut has tcp in TestServingSurvivesKill
	}
	for _, tr := range transports {
		t.Run(tr, func(t *testing.T) {
			cmd := exec.Command(exe, "run", "-n", "4", "--", os.Args[0], "-test.run=^TestHelperMoERank$")
			cmd.Env = append(os.Environ(), "MOEX_COMBINE_HELPER="+tr, "MOEX_TRANSPORT="+tr)
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "moex run: %s", out)
			require.Equal(t, 4, strings.Count(string(out), " ok"), "ranks ok:\n%s", out)
			require.Empty(t, shm.StaleSegments(), "segments left in /dev/shm by processes gone")
		})
	}
}
