package shm_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moex-ai/moex/internal/long"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/internal/launch"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/bootstrap"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/transporttest"
)

// TestHelperRank is a rank of the multi-process tests; it runs only when launched by them.
func TestHelperRank(t *testing.T) {
	mode := os.Getenv("MOEX_SHM_HELPER")
	if mode == "" {
		t.Skip("helper rank: runs only under TestMultiProcess* and BenchmarkAllToAllProcs")
	}
	iters, _ := strconv.Atoi(os.Getenv("MOEX_SHM_HELPER_ITERS"))
	size, _ := strconv.Atoi(os.Getenv("MOEX_SHM_HELPER_SIZE"))
	if err := helperRank(mode, max(iters, 1), size); err != nil {
		fmt.Fprintln(os.Stderr, "rank failed:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func helperRank(mode string, iters, size int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	env, err := bootstrap.FromEnv()
	if err != nil {
		return err
	}
	rv, err := bootstrap.Join(ctx, env, nil)
	if err != nil {
		return err
	}
	defer rv.Close()
	cfg := shm.Config{Rank: env.Rank, Size: env.Size, Exchange: rv.AllGather}
	if err := cfg.ConfigFromEnv(os.Getenv); err != nil {
		return err
	}
	cfg.Poll.Oversubscribed = busypoll.Oversubscribed(env.LocalSize)
	tr, err := shm.New(ctx, cfg)
	if err != nil {
		return err
	}
	defer tr.Close()
	n, me := env.Size, env.Rank
	if mode == "shared" {
		return helperShared(ctx, tr, me, n, iters)
	}
	if mode == "die" {
		// Rank 1 dies (exits without closing) while rank 0 waits for it.
		if me == 1 {
			time.Sleep(50 * time.Millisecond)
			os.Exit(0)
		}
		if me == 0 {
			r, err := tr.Irecv(1, transport.Tag{Comm: 9}, make([]byte, 8))
			if err != nil {
				return err
			}
			start := time.Now()
			_, err = r.Wait(ctx)
			fmt.Printf("rank 0: waited %v: %v\n", time.Since(start).Round(time.Millisecond), err)
			if err == nil {
				return fmt.Errorf("receive from a dead rank succeeded")
			}
		}
		return nil
	}
	if size == 0 {
		size = 20000
	}
	per, err := transporttest.AllToAll(ctx, tr, me, n, 5, iters, func(from, to int) int { return size + from*13 + to })
	if err != nil {
		return err
	}
	fmt.Printf("alltoall ok us_per_iter=%.1f mode=%s poll=%s\n", float64(per.Nanoseconds())/1e3, tr.Mode(), tr.Poller().Stats())
	return nil
}

// helperShared runs AllToAlls through the shared areas from send buffers in obuf.Shared, through the
// area's size and beyond it, and checks every byte.
func helperShared(ctx context.Context, tr *shm.Transport, me, p, iters int) error {
	d := areasOf(tr)
	if d == nil {
		return fmt.Errorf("no shared areas")
	}
	op := 0
	for _, n := range []int{64 << 10, 2 << 20} {
		n -= n % p
		b := obuf.Shared.Get(n)
		defer b.Release()
		if !b.Shared() {
			return fmt.Errorf("no shared buffer: %v", obuf.SharedErr())
		}
		for i := 0; i < iters; i++ {
			copy(b.Bytes(), sendFor(op, me, p, n))
			recv := make([]byte, n)
			if err := d.AllToAll(ctx, d.Turn(), b.Bytes(), recv, uint64(n)); err != nil {
				return fmt.Errorf("%d bytes, op %d: %w", n, op, err)
			}
			if err := checkRecv(recv, op, me, p); err != nil {
				return err
			}
			op++
		}
	}
	st := tr.Stats()
	fmt.Printf("shared ok rank=%d shared_bytes=%d cma_bytes=%d\n", me, st.SharedBytes, st.CMABytes)
	return nil
}

func runProcs(t testing.TB, n, iters, size int, env ...string) (string, error) {
	var out bytes.Buffer
	err := launch.Run(context.Background(), launch.Config{
		N: n, Prog: os.Args[0], Args: []string{"-test.run=^TestHelperRank$"},
		Env: append([]string{"MOEX_SHM_HELPER=alltoall", "MOEX_SHM_HELPER_ITERS=" + strconv.Itoa(iters),
			"MOEX_SHM_HELPER_SIZE=" + strconv.Itoa(size)}, env...),
		Stdout: &out, Stderr: &out,
	})
	return out.String(), err
}

// Eight processes on two cores exchange all-to-all through shared memory, every byte
// checked, under each receive policy and both large-message paths.
func TestMultiProcessAllToAll(t *testing.T) {
	envs := [][]string{{"MOEX_POLL=adaptive"}}
	if long.Enabled() {
		envs = append(envs, []string{"MOEX_POLL=block"}, []string{"MOEX_SHM_CMA=0"}) // the ring copies are also in TestConformanceRingCopies
	}
	for _, env := range envs {
		for _, size := range []int{100, 20000, 300000} {
			out, err := runProcs(t, 8, 10, size, env...)
			if err != nil {
				t.Fatalf("%v size %d: %v\n%s", env, size, err, out)
			}
			if c := strings.Count(out, "alltoall ok"); c != 8 {
				t.Fatalf("%v size %d: %d ranks ok:\n%s", env, size, c, out)
			}
		}
	}
}

// Processes read each other's shared send buffers in place (the memfd taken with
// pidfd_getfd), every byte checked, none read across.
func TestMultiProcessSharedBuffers(t *testing.T) {
	const p = 3
	var out bytes.Buffer
	err := launch.Run(context.Background(), launch.Config{
		N: p, Prog: os.Args[0], Args: []string{"-test.run=^TestHelperRank$"},
		Env: []string{"MOEX_SHM_HELPER=shared", "MOEX_SHM_HELPER_ITERS=5"}, Stdout: &out, Stderr: &out,
	})
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	want := uint64(5 * ((64<<10)/p + (2<<20)/p) * (p - 1)) // blocks of n/p bytes from p-1 ranks
	for r := 0; r < p; r++ {
		var shared, cma uint64
		if _, err := fmt.Sscanf(line(out.String(), fmt.Sprintf("shared ok rank=%d ", r)), "shared ok rank=%d shared_bytes=%d cma_bytes=%d", &r, &shared, &cma); err != nil {
			t.Fatalf("rank %d: %v\n%s", r, err, out.String())
		}
		if shared != want || cma != 0 {
			t.Errorf("rank %d: %d bytes read in place and %d across; want %d and 0", r, shared, cma, want)
		}
	}
}

// line returns the first line of out that contains prefix, from prefix on (the launcher
// puts the rank before each line).
func line(out, prefix string) string {
	for _, l := range strings.Split(out, "\n") {
		if i := strings.Index(l, prefix); i >= 0 {
			return l[i:]
		}
	}
	return ""
}

// A process that dies is noticed (pidfd) and fails the receive waiting for it.
func TestMultiProcessPeerDeath(t *testing.T) {
	var out bytes.Buffer
	err := launch.Run(context.Background(), launch.Config{
		N: 2, Prog: os.Args[0], Args: []string{"-test.run=^TestHelperRank$"},
		Env: []string{"MOEX_SHM_HELPER=die"}, Stdout: &out, Stderr: &out,
	})
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "rank 1") || !strings.Contains(out.String(), "exited") {
		t.Fatalf("rank 0 did not name the dead rank:\n%s", out.String())
	}
}

var usRe = regexp.MustCompile(`us_per_iter=([0-9.]+)`)

// BenchmarkAllToAllProcs: the slowest rank's time per all-to-all (processes over shared
// memory), per rank count, message size and receive policy.
func BenchmarkAllToAllProcs(b *testing.B) {
	for _, n := range []int{2, 4, 8} {
		for _, size := range []int{16 << 10, 1 << 20} {
			for _, mode := range []string{"adaptive", "block"} {
				b.Run(fmt.Sprintf("P=%d/%dKiB/%s", n, size>>10, mode), func(b *testing.B) {
					worst := 0.0
					for b.Loop() {
						out, err := runProcs(b, n, 300, size, "MOEX_POLL="+mode)
						if err != nil {
							b.Fatalf("%v\n%s", err, out)
						}
						for _, m := range usRe.FindAllStringSubmatch(out, -1) {
							v, _ := strconv.ParseFloat(m[1], 64)
							worst = max(worst, v)
						}
					}
					b.ReportMetric(worst, "us/alltoall")
				})
			}
		}
	}
}
