package combine_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport/inproc"
	"github.com/moex-ai/moex/transport/shm"
)

// The serving scenario of the recovery tests: experts, top-k, hidden size and tokens
// per rank; expert e multiplies by e+1, a factor it reads from its weights.
const (
	srvExperts, srvK, srvHid, srvTokens, srvWeightBytes = 12, 3, 16, 9, 96
)

// expertWeights is expert e's weights: its factor, then a pattern that a wrong or torn
// copy would break.
func expertWeights(e int) []byte {
	b := make([]byte, srvWeightBytes)
	binary.LittleEndian.PutUint32(b, math.Float32bits(float32(e+1)))
	for i := 4; i < len(b); i++ {
		b[i] = byte(e*13 + i)
	}
	return b
}

// store is one rank's expert weights.
type store map[int][]byte

func newStore(pl *router.Placement, rank int) store {
	s := store{}
	for _, e := range pl.Local[rank] {
		s[e] = expertWeights(e)
	}
	return s
}

// weights hands s to Migrate or Recover and gathers the new placement's store in next.
func (s store) weights(next store) dispatch.Weights {
	return dispatch.Weights{Bytes: srvWeightBytes,
		Old: func(e int) []byte { return s[e] },
		New: func(e int) []byte {
			if b, ok := s[e]; ok {
				next[e] = b // kept in place
				return b
			}
			next[e] = make([]byte, srvWeightBytes)
			return next[e]
		}}
}

// factor is expert e's factor, from its weights, which must be whole.
func (s store) factor(e int) (float32, error) {
	b, ok := s[e]
	if !ok {
		return 0, fmt.Errorf("rows for expert %d, whose weights this rank does not hold", e)
	}
	want := expertWeights(e)
	for i := range b {
		if b[i] != want[i] {
			return 0, fmt.Errorf("expert %d's weights differ at byte %d", e, i)
		}
	}
	return math.Float32frombits(binary.LittleEndian.Uint32(b)), nil
}

// server is one rank's MoE layer.
type server struct {
	d  *dispatch.Dispatcher[float32]
	cb *combine.Combiner[float32]
	ws store
}

func newServer(ctx context.Context, c *coll.Comm, pl *router.Placement, ws store, mode dispatch.Mode) (*server, error) {
	d, err := dispatch.New[float32](ctx, c, dispatch.Config{Hidden: srvHid, TopK: srvK, Placement: pl, Mode: mode, MaxTokens: srvTokens})
	if err != nil {
		return nil, err
	}
	cb, err := combine.New[float32](ctx, d, combine.Config{})
	if err != nil {
		d.Close()
		return nil, err
	}
	return &server{d: d, cb: cb, ws: ws}, nil
}

func (s *server) Close() {
	s.cb.Close()
	s.d.Close()
}

// step serves the tokens of origin id (a rank's identity that outlives a Shrink) at
// step n and checks every token's result: sum of weight x factor x token, exact in
// float32 (small integers, dyadic weights).
func (s *server) step(ctx context.Context, id, n int) error {
	rng := rand.New(rand.NewPCG(uint64(id), uint64(n)))
	r := &router.Routing{T: srvTokens, K: srvK, E: srvExperts, Experts: make([]int32, srvTokens*srvK), Weights: make([]float32, srvTokens*srvK)}
	for i := 0; i < srvTokens; i++ {
		for j, e := range rng.Perm(srvExperts)[:srvK] {
			r.Experts[i*srvK+j], r.Weights[i*srvK+j] = int32(e), []float32{0.5, 0.25, 1}[rng.IntN(3)]
		}
	}
	x := make([]float32, srvTokens*srvHid)
	for i := range x {
		x[i] = float32(rng.IntN(9) - 4)
	}
	out, h, err := s.d.Dispatch(ctx, x, r)
	if err != nil {
		return err
	}
	y := make([]float32, out.Rows()*srvHid)
	for j := 0; j < out.Rows(); j++ {
		if out.Origin[j] < 0 {
			continue
		}
		f, err := s.ws.factor(int(out.Expert[j]))
		if err != nil {
			return err
		}
		for i, v := range out.Entry(j) {
			y[j*srvHid+i] = f * v
		}
	}
	got := make([]float32, len(x))
	if err := s.cb.Combine(ctx, h, y, got); err != nil {
		return err
	}
	for t := 0; t < srvTokens; t++ {
		sum := float32(0)
		for j := 0; j < srvK; j++ {
			sum += r.Weights[t*srvK+j] * float32(r.Experts[t*srvK+j]+1)
		}
		for i := 0; i < srvHid; i++ {
			if want := sum * x[t*srvHid+i]; got[t*srvHid+i] != want {
				return fmt.Errorf("origin %d step %d token %d element %d: %v, want %v", id, n, t, i, got[t*srvHid+i], want)
			}
		}
	}
	return nil
}

// replicated places every expert on two ranks.
func replicated(t testing.TB, p int) *router.Placement {
	pl, err := router.NewPlacement(router.RoundRobin, srvExperts, p)
	require.NoError(t, err)
	all := make([]int, srvExperts)
	for e := range all {
		all[e] = e
	}
	require.NoError(t, pl.Replicate(all, 2))
	return pl
}

// serveThroughDeath serves steps on c, one rank dying at step dieAt (kill makes it
// vanish); the survivors shrink, recover the placement onto themselves and serve the
// remaining steps, every token checked. It returns the survivor's communicator and
// the time from the failed step's start to the first good one's end.
func serveThroughDeath(ctx context.Context, c *coll.Comm, pl *router.Placement, mode dispatch.Mode, victim, dieAt, steps int, kill func()) (*coll.Comm, time.Duration, error) {
	id := c.Rank()
	ws := newStore(pl, id)
	srv, err := newServer(ctx, c, pl, ws, mode)
	if err != nil {
		return c, 0, err
	}
	for n := 0; n < dieAt; n++ {
		if err := srv.step(ctx, id, n); err != nil {
			srv.Close()
			return c, 0, fmt.Errorf("step %d: %w", n, err)
		}
	}
	// The victim dies once it left the barrier, which the others may not have left yet:
	// they see the death there or in the next step.
	err = coll.Barrier(ctx, c)
	if id == victim && err == nil {
		kill()
		return c, 0, nil
	}
	start := time.Now()
	if err == nil {
		err = srv.step(ctx, id, dieAt)
	}
	srv.Close()
	var pe *coll.PeerError
	if !errors.As(err, &pe) || pe.Rank != c.WorldRank(victim) {
		return c, 0, fmt.Errorf("the step after the death: %v, want a PeerError naming rank %d", err, victim)
	}
	sub, err := c.Shrink(ctx)
	if err != nil {
		return c, 0, fmt.Errorf("shrink: %w", err)
	}
	next := store{}
	npl, _, err := dispatch.Recover(ctx, sub, pl, nil, router.Balance{}, ws.weights(next))
	if err != nil {
		return sub, 0, fmt.Errorf("recover onto ranks %v: %w", sub.ParentRanks(), err)
	}
	srv, err = newServer(ctx, sub, npl, next, mode)
	if err != nil {
		return sub, 0, err
	}
	defer srv.Close()
	var took time.Duration
	for n := dieAt; n < steps; n++ {
		if err := srv.step(ctx, id, n); err != nil {
			return sub, 0, fmt.Errorf("step %d after recovery: %w", n, err)
		}
		if n == dieAt {
			took = time.Since(start)
		}
	}
	return sub, took, nil
}

// A rank dies between two steps: the survivors shrink, move onto a placement of
// themselves with one call, and the next step delivers every token to experts whose
// weights are there, with the reference result; in both modes.
func TestServingSurvivesLostRank(t *testing.T) {
	const p, victim = 4, 2
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		t.Run(mode.String(), func(t *testing.T) {
			pl := replicated(t, p)
			errs := onRanks(t, p, coll.Config{}, false, func(c *coll.Comm) error {
				sub, _, err := serveThroughDeath(context.Background(), c, pl, mode, victim, 2, 4,
					func() { c.Transport().(*inproc.Transport).Kill() })
				if sub != c {
					sub.Close()
				}
				return err
			})
			for r, err := range errs {
				assert.NoError(t, err, "rank %d", r)
			}
		})
	}
}

// Without a replica of every expert of the lost rank, every survivor's Recover names
// the lost experts, and nothing moves.
func TestRecoverNamesLostExperts(t *testing.T) {
	const p, victim = 4, 1
	pl, err := router.NewPlacement(router.Contiguous, srvExperts, p)
	require.NoError(t, err)
	require.NoError(t, pl.Replicate([]int{3}, 2)) // rank 1's experts 3, 4, 5: 3 also on rank 2
	errs := onRanks(t, p, coll.Config{}, false, func(c *coll.Comm) error {
		ctx := context.Background()
		if c.Rank() == victim {
			c.Transport().(*inproc.Transport).Kill()
			return nil
		}
		if err := coll.Barrier(ctx, c); err == nil {
			return errors.New("a barrier with a dead rank succeeded")
		}
		sub, err := c.Shrink(ctx)
		if err != nil {
			return err
		}
		defer sub.Close()
		ws := newStore(pl, c.Rank())
		next := store{}
		_, _, err = dispatch.Recover(ctx, sub, pl, nil, router.Balance{}, ws.weights(next))
		var le *dispatch.LostExpertsError
		if !errors.As(err, &le) || !errors.Is(err, dispatch.ErrLostExperts) {
			return fmt.Errorf("got %v, want a LostExpertsError", err)
		}
		if fmt.Sprint(le.Experts) != "[4 5]" || fmt.Sprint(le.Ranks) != "[1]" {
			return fmt.Errorf("lost experts %v of ranks %v, want [4 5] of [1]", le.Experts, le.Ranks)
		}
		if len(next) != 0 {
			return fmt.Errorf("weights written: %v", next)
		}
		return coll.Barrier(ctx, sub) // still usable
	})
	for r, err := range errs {
		assert.NoError(t, err, "rank %d", r)
	}
}

// TestHelperServeRank is one rank of TestServingSurvivesKill, started by `moex run
// --keep-going`: rank 1 is killed with SIGKILL between two steps.
func TestHelperServeRank(t *testing.T) {
	if os.Getenv("MOEX_SERVE_HELPER") == "" {
		t.Skip("helper rank: runs only under TestServingSurvivesKill")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := coll.Init(ctx, coll.Config{Timeout: 30 * time.Second})
	require.NoError(t, err)
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		var took time.Duration
		pl := replicated(t, c.Size())
		next, took, err := serveThroughDeath(ctx, c, pl, mode, 1, 3, 6, func() { _ = syscall.Kill(os.Getpid(), syscall.SIGKILL) })
		require.NoError(t, err, "rank %d, %v", c.Rank(), mode)
		require.NoError(t, c.Close())
		c = next
		fmt.Printf("rank %d recovered in %v (%v)\n", c.Rank(), took.Round(time.Millisecond), mode)
		// The second round runs on the survivors, who lose one more.
		if c.Size() < 3 {
			break
		}
	}
	require.NoError(t, c.Close())
	fmt.Printf("served on %s\n", c.Transport().Name())
}

// Processes serve MoE steps; one is killed with SIGKILL; the survivors shrink,
// rebalance onto themselves and serve on with the reference result for every token,
// twice in a row (4 ranks, then 3), over shared memory and tcp.
func TestServingSurvivesKill(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("shared memory and the launcher's process handling: Linux only")
	}
	exe := filepath.Join(t.TempDir(), "moex")
	out, err := exec.Command("go", "build", "-o", exe, "github.com/moex-ai/moex/cmd/moex").CombinedOutput()
	require.NoError(t, err, "building moex: %s", out)
	for _, tr := range []string{"shm", "tcp"} {
		t.Run(tr, func(t *testing.T) { serveKilled(t, exe, tr) })
	}
}

func serveKilled(t *testing.T, exe, tr string, env ...string) {
	cmd := exec.Command(exe, "run", "--keep-going", "-n", "4", "--", os.Args[0], "-test.run=^TestHelperServeRank$")
	cmd.Env = append(append(os.Environ(), "MOEX_SERVE_HELPER=1", "MOEX_TRANSPORT="+tr), env...)
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, "%s", out)
	assert.Equal(t, 128+int(syscall.SIGKILL), ee.ExitCode(), "the killed rank's code:\n%s", out)
	assert.Equal(t, 3, strings.Count(string(out), "(normal)"), "%s", out)
	assert.Equal(t, 2, strings.Count(string(out), "(low-latency)"), "%s", out)
	assert.Equal(t, 2, strings.Count(string(out), "served on "+tr), "%s", out)
	assert.Empty(t, shm.StaleSegments(), "segments left in /dev/shm by processes gone")
}
