//go:build ucx

package combine_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/ucx"
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
	ctx, c := helperComm(t)
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
	// Windows where the lanes do RMA, or everywhere with MOEX_WINDOWS=1.
	u, ok := c.Transport().(*ucx.Transport)
	require.True(t, ok, "transport %T", c.Transport())
	oneSided := os.Getenv("MOEX_WINDOWS") == "1"
	if !oneSided {
		oneSided = true
		for q := 0; q < p; q++ {
			oneSided = oneSided && (q == c.Rank() || u.NativeRMA(q))
		}
	}
	if c.Rank() == 0 {
		fmt.Printf("rank 0 to 1: %s\n", u.Path(1))
	}
	if want := os.Getenv("MOEX_EXPECT_ONESIDED"); want != "" {
		require.Equal(t, want == "1", oneSided, "rank %d: one-sided windows", c.Rank())
	}
	if !oneSided {
		// UCX would emulate RMA: the exchanges fall back to tag messages.
		require.NotZero(t, after.MessagesIn-before.MessagesIn, "rank %d: no tag receive posted", c.Rank())
		require.Zero(t, after.RMAOps-before.RMAOps, "rank %d: one-sided operations", c.Rank())
		require.Zero(t, d.Stats().Put, "rank %d: ranks put into", c.Rank())
	} else {
		require.Zero(t, after.MessagesIn-before.MessagesIn, "rank %d: tag receives posted in %d steps", c.Rank(), steps)
		require.NotZero(t, after.RMAOps-before.RMAOps, "rank %d: nothing put", c.Rank())
		require.Equal(t, p-1, d.Stats().Put, "rank %d: ranks put into", c.Rank())
	}
	fmt.Printf("rank %d ok, %d one-sided operations a step\n", c.Rank(), (after.RMAOps-before.RMAOps)/steps)
}

// The low-latency dispatch and combine over UCX windows, as processes, at P=2, 4 and 8,
// over UCX's tcp (RMA emulated over active messages: MOEX_WINDOWS=1 asks for windows
// all the same), its shared memory (RMA and atomics native) and its default choice
// (tcp between processes here, since moex asks for peer-failure reports): every token
// against the reference on every wire type, no tag receive on the data path. Over tcp
// without MOEX_WINDOWS=1 the exchanges fall back to tag messages.
func TestLowLatencyOneSidedUCX(t *testing.T) {
	exe := filepath.Join(t.TempDir(), "moex")
	out, err := exec.Command("go", "build", "-tags", "ucx", "-o", exe, "github.com/moex-ai/moex/cmd/moex").CombinedOutput()
	require.NoError(t, err, "building moex: %s", out)
	type run struct {
		tls, windows string
		oneSided     string // MOEX_EXPECT_ONESIDED: 1, 0, or "" (as UCX's lanes say)
		ps           []int
	}
	for _, r := range []run{{"tcp", "1", "1", []int{2, 4, 8}}, {"sm", "auto", "1", []int{2, 4, 8}}, {"all", "1", "1", []int{2, 4, 8}}, {"tcp", "auto", "0", []int{4}}} {
		for _, p := range r.ps {
			t.Run(fmt.Sprintf("UCX_TLS=%s/MOEX_WINDOWS=%s/P=%d", r.tls, r.windows, p), func(t *testing.T) {
				cmd := exec.Command(exe, "run", "-n", fmt.Sprint(p), "--", os.Args[0], "-test.run=^TestHelperOneSidedRank$")
				cmd.Env = append(os.Environ(), "MOEX_COMBINE_HELPER=onesided", "MOEX_TRANSPORT=ucx", "UCX_TLS="+r.tls,
					"MOEX_WINDOWS="+r.windows, "MOEX_EXPECT_ONESIDED="+r.oneSided)
				out, err := cmd.CombinedOutput()
				require.NoError(t, err, "moex run: %s", out)
				require.Equal(t, p, strings.Count(string(out), " ok, "), "ranks ok:\n%s", out)
				t.Logf("%s", strings.SplitN(string(out), "\n", 2)[0])
			})
		}
	}
}
