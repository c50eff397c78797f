//go:build ucx

package combine_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport"
)

// The MoE stages between processes over UCX (whatever lanes UCX_TLS gives it; CI runs
// tcp): every mode, wire type and activation type, checked as over shm and tcp.
func TestMoEProcessesUCX(t *testing.T) {
	exe := filepath.Join(t.TempDir(), "moex")
	out, err := exec.Command("go", "build", "-tags", "ucx", "-o", exe, "github.com/moex-ai/moex/cmd/moex").CombinedOutput()
	require.NoError(t, err, "building moex: %s", out)
	cmd := exec.Command(exe, "run", "-n", "4", "--", os.Args[0], "-test.run=^TestHelperMoERank$")
	cmd.Env = append(os.Environ(), "MOEX_COMBINE_HELPER=ucx", "MOEX_TRANSPORT=ucx")
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "moex run: %s", out)
	require.Equal(t, 4, strings.Count(string(out), " ok"), "ranks ok:\n%s", out)
}

// Serving through a SIGKILL over UCX (CI: UCX_TLS=tcp): the survivors shrink, recover
// and serve on, every token checked.
func TestServingSurvivesKillUCX(t *testing.T) {
	exe := filepath.Join(t.TempDir(), "moex")
	out, err := exec.Command("go", "build", "-tags", "ucx", "-o", exe, "github.com/moex-ai/moex/cmd/moex").CombinedOutput()
	require.NoError(t, err, "building moex: %s", out)
	serveKilled(t, exe, "ucx")
}

// TestHelperOneSidedRank is one rank of TestLowLatencyOneSidedUCX, started by `moex run`.
func TestHelperOneSidedRank(t *testing.T) {
	if os.Getenv("MOEX_COMBINE_HELPER") != "onesided" {
		t.Skip("helper rank: runs only under TestLowLatencyOneSidedUCX")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := coll.Init(ctx, coll.Config{})
	require.NoError(t, err)
	defer c.Close()
	p := c.Size()
	tokens := make([]int, p)
	for i := range tokens {
		tokens[i] = 5 + 3*i
	}
	tokens[p-1] = 0 // a rank with no tokens
	s := scenario{p: p, hid: 40, k: min(3, p), experts: 2 * p, tokens: tokens, dropEvery: 5, seed: 3, maxTokens: 5 + 3*p}
	pl, err := router.NewPlacement(router.Contiguous, s.experts, p)
	require.NoError(t, err)
	// Every wire type, every token against the reference, both activation types.
	for _, wire := range []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3, dtype.I8} {
		cfg := step{Config: dispatch.Config{WireDType: wire, Placement: pl, Mode: dispatch.LowLatency}}
		require.NoError(t, checkRank[float32](c, s, cfg, 2, coll.AlgoAuto), "rank %d, %v on the wire", c.Rank(), wire)
		require.NoError(t, checkRank[dtype.BFloat16](c, s, cfg, 1, coll.AlgoAuto), "rank %d, %v on the wire, bf16", c.Rank(), wire)
	}
	// The data path posts no tag receive: steps of dispatch and combine, counted at the
	// transport, after one to warm up.
	cfg := dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, Mode: dispatch.LowLatency, MaxTokens: s.maxTokens}
	d, cb, err := newPairOf[float32](ctx, c, cfg, combine.Config{})
	require.NoError(t, err)
	defer d.Close()
	defer cb.Close()
	r, x := s.routing(c.Rank())
	out := make([]float32, len(x))
	stepOnce := func() {
		o, h, err := d.Dispatch(ctx, x, r)
		require.NoError(t, err)
		y := make([]float32, o.Rows()*s.hid)
		require.NoError(t, cb.Combine(ctx, h, y, out))
	}
	stepOnce()
	before, ok := transport.CountersOf(c.Transport())
	require.True(t, ok, "the transport counts its traffic")
	const steps = 20
	for range steps {
		stepOnce()
	}
	after, _ := transport.CountersOf(c.Transport())
	require.Zero(t, after.MessagesIn-before.MessagesIn, "rank %d: tag receives posted in %d steps", c.Rank(), steps)
	require.NotZero(t, after.RMAOps-before.RMAOps, "rank %d: nothing put", c.Rank())
	require.Equal(t, p-1, d.Stats().Put, "rank %d: ranks put into", c.Rank())
	fmt.Printf("rank %d ok, %d one-sided operations a step\n", c.Rank(), (after.RMAOps-before.RMAOps)/steps)
}

// The low-latency dispatch and combine over UCX windows, as processes, at P=2, 4 and 8,
// over UCX's tcp (RMA emulated), its shared memory (RMA and atomics native) and its
// default choice: every token against the reference on every wire type, no tag receive
// on the data path.
func TestLowLatencyOneSidedUCX(t *testing.T) {
	exe := filepath.Join(t.TempDir(), "moex")
	out, err := exec.Command("go", "build", "-tags", "ucx", "-o", exe, "github.com/moex-ai/moex/cmd/moex").CombinedOutput()
	require.NoError(t, err, "building moex: %s", out)
	for _, tls := range []string{"tcp", "sm", ""} {
		for _, p := range []int{2, 4, 8} {
			t.Run(fmt.Sprintf("UCX_TLS=%s/P=%d", tls, p), func(t *testing.T) {
				cmd := exec.Command(exe, "run", "-n", fmt.Sprint(p), "--", os.Args[0], "-test.run=^TestHelperOneSidedRank$")
				cmd.Env = append(os.Environ(), "MOEX_COMBINE_HELPER=onesided", "MOEX_TRANSPORT=ucx", "UCX_TLS="+tls)
				if tls == "" {
					cmd.Env = append(cmd.Env[:len(cmd.Env)-1], "UCX_TLS=all")
				}
				out, err := cmd.CombinedOutput()
				require.NoError(t, err, "moex run: %s", out)
				require.Equal(t, p, strings.Count(string(out), " ok, "), "ranks ok:\n%s", out)
			})
		}
	}
}
