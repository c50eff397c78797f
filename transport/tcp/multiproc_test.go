package tcp_test

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

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/internal/launch"
	"github.com/moex-ai/moex/transport/bootstrap"
	"github.com/moex-ai/moex/transport/tcp"
	"github.com/moex-ai/moex/transport/transporttest"
)

// TestHelperRank is a rank of the multi-process tests below. It does nothing unless
// launched by them (MOEX_TCP_HELPER set).
func TestHelperRank(t *testing.T) {
	if os.Getenv("MOEX_TCP_HELPER") == "" {
		t.Skip("helper rank: runs only under TestMultiProcessAllToAll")
	}
	iters, _ := strconv.Atoi(os.Getenv("MOEX_TCP_HELPER_ITERS"))
	if err := helperRank(max(iters, 1)); err != nil {
		fmt.Fprintln(os.Stderr, "rank failed:", err)
		os.Exit(1)
	}
}

func helperRank(iters int) error {
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
	cfg := tcp.Config{Rank: env.Rank, Size: env.Size, Exchange: rv.AllGather, Token: []byte(env.Token)}
	if err := cfg.ConfigFromEnv(os.Getenv); err != nil {
		return err
	}
	cfg.Poll.Oversubscribed = busypoll.Oversubscribed(env.LocalSize)
	tr, err := tcp.New(ctx, cfg)
	if err != nil {
		return err
	}
	defer tr.Close()
	n, me := env.Size, env.Rank
	size := func(src, dst int) int { return 20000 + 3000*src + 17*dst }
	per, err := transporttest.AllToAll(ctx, tr, me, n, 0, iters, size)
	if err != nil {
		return err
	}
	fmt.Printf("alltoall ok us_per_iter=%.1f poll=%s\n", float64(per.Nanoseconds())/1e3, tr.Poller().Stats())
	return nil
}

func runProcs(t testing.TB, n, iters int, mode string) (string, error) {
	var out bytes.Buffer
	err := launch.Run(context.Background(), launch.Config{
		N: n, Prog: os.Args[0], Args: []string{"-test.run=^TestHelperRank$"},
		Env:    []string{"MOEX_TCP_HELPER=1", "MOEX_TCP_HELPER_ITERS=" + strconv.Itoa(iters), "MOEX_POLL=" + mode},
		Stdout: &out, Stderr: &out,
	})
	return out.String(), err
}

// Eight processes on this two-core machine exchange all-to-all over TCP, every byte
// checked, under each receive policy: spinning must never starve the ranks.
func TestMultiProcessAllToAll(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: skipping the 8-process test")
	}
	for _, mode := range []string{"adaptive", "block"} {
		out, err := runProcs(t, 8, 20, mode)
		if err != nil {
			t.Fatalf("%s: %v\n%s", mode, err, out)
		}
		if c := strings.Count(out, "alltoall ok"); c != 8 {
			t.Fatalf("%s: %d ranks reported success:\n%s", mode, c, out)
		}
	}
}

var usRe = regexp.MustCompile(`us_per_iter=([0-9.]+)`)

// BenchmarkAllToAll8Procs reports the slowest rank's time per all-to-all (8 processes,
// 20-40 KB per pair) for each receive policy. ns/op is the whole job including start-up;
// read the us/alltoall metric.
func BenchmarkAllToAll8Procs(b *testing.B) {
	for _, mode := range []string{"adaptive", "block", "spin"} {
		b.Run(mode, func(b *testing.B) {
			worst := 0.0
			for b.Loop() {
				out, err := runProcs(b, 8, 200, mode)
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
