package coll

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moex-ai/moex/coll/dtype"
)

// TestHelperCollRank is one rank of the multi-process tests; it runs only when launched by
// them (MOEX_COLL_HELPER names the scenario).
func TestHelperCollRank(t *testing.T) {
	scenario := os.Getenv("MOEX_COLL_HELPER")
	if scenario == "" {
		t.Skip("helper rank: runs only under TestMultiProcess*")
	}
	if os.Getenv("MOEX_COLL_TWO_HOSTS") != "" {
		// Pretend even and odd ranks live on two hosts (hierarchical paths, Mux).
		os.Setenv("MOEX_HOST_ID", "pretend-host-"+fmt.Sprint(envInt("MOEX_RANK")%2))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := Init(ctx, Config{Timeout: 20 * time.Second})
	if err != nil {
		fmt.Println("init failed:", err)
		os.Exit(3)
	}
	switch scenario {
	case "subset":
		err = helperSubset(ctx, c)
	case "death":
		err = helperDeath(ctx, c)
	}
	if err != nil {
		fmt.Printf("rank %d failed: %v\n", c.Rank(), err)
		os.Exit(1)
	}
	if err := c.Close(); err != nil {
		fmt.Printf("rank %d close: %v\n", c.Rank(), err)
		os.Exit(1)
	}
	fmt.Printf("rank %d ok transport=%s\n", c.Rank(), c.Transport().Name())
	os.Exit(0)
}

func envInt(k string) int {
	var v int
	fmt.Sscan(os.Getenv(k), &v)
	return v
}

func helperSubset(ctx context.Context, c *Comm) error {
	p, r := c.Size(), c.Rank()
	if c.Hosts() > 1 {
		// Even and odd ranks on two hosts: a flat ring would cross hosts at every hop.
		if a := c.choose(OpAllReduce, 16<<20); a != Hier {
			return fmt.Errorf("ranks on %d hosts, 16 MiB AllReduce: the model chose %v, want hier", c.Hosts(), a)
		}
	}
	// AllReduce under every algorithm, f32 and bf16, small and 1 MiB.
	for _, algo := range Algorithms[OpAllReduce] {
		c.cfg.Algo = map[OpKind]Algo{OpAllReduce: algo}
		for _, n := range []int{1, 1001, 1 << 18} {
			x := make([]float32, n)
			for i := range x {
				x[i] = float32((r+i)%5 - 2)
			}
			if err := AllReduce(ctx, c, nil, x, dtype.Sum); err != nil {
				return err
			}
			for i, v := range x {
				want := float32(0)
				for q := 0; q < p; q++ {
					want += float32((q+i)%5 - 2)
				}
				if v != want {
					return fmt.Errorf("allreduce %v n=%d: [%d] = %v want %v", algo, n, i, v, want)
				}
			}
			h := make([]dtype.BFloat16, n)
			for i := range h {
				h[i] = dtype.ToBF16(float32(r + 1))
			}
			if err := AllReduce(ctx, c, nil, h, dtype.Max); err != nil {
				return err
			}
			for _, v := range h {
				if v.Float32() != float32(p) {
					return fmt.Errorf("bf16 max %v", v.Float32())
				}
			}
		}
	}
	c.cfg.Algo = map[OpKind]Algo{}
	// AlltoAllv with random uneven counts (same seed on every rank).
	rng := rand.New(rand.NewPCG(7, 7))
	for trial := 0; trial < 5; trial++ {
		m := make([][]int, p)
		for i := range m {
			m[i] = make([]int, p)
			for j := range m[i] {
				if rng.IntN(3) > 0 {
					m[i][j] = rng.IntN(50000)
				}
			}
		}
		sc, rc := make([]int, p), make([]int, p)
		st, rt := 0, 0
		for j := 0; j < p; j++ {
			sc[j], rc[j] = m[r][j], m[j][r]
			st += sc[j]
			rt += rc[j]
		}
		send, recv := make([]int32, st), make([]int32, rt)
		o := 0
		for j := 0; j < p; j++ {
			for k := 0; k < sc[j]; k++ {
				send[o] = int32(r*1e8 + j*1e6 + k)
				o++
			}
		}
		if err := AlltoAllv(ctx, c, send, sc, nil, recv, rc, nil); err != nil {
			return err
		}
		o = 0
		for i := 0; i < p; i++ {
			for k := 0; k < rc[i]; k++ {
				if recv[o] != int32(i*1e8+r*1e6+k) {
					return fmt.Errorf("alltoallv trial %d: element %d from %d wrong", trial, k, i)
				}
				o++
			}
		}
	}
	// Broadcast, AllGather, ReduceScatter, Barrier.
	b := make([]byte, 3<<20)
	if r == p-1 {
		for i := range b {
			b[i] = byte(i * 7)
		}
	}
	if err := Broadcast(ctx, c, b, p-1); err != nil {
		return err
	}
	for i := range b {
		if b[i] != byte(i*7) {
			return fmt.Errorf("broadcast byte %d", i)
		}
	}
	// Under the model's choice, then each algorithm forced (hier across the two pretend
	// hosts, or its ring fallback on one).
	for _, algos := range []map[OpKind]Algo{{}, {OpAllGather: Ring, OpReduceScatter: Ring},
		{OpAllGather: Hier, OpReduceScatter: Hier}, {OpAllGather: Bruck, OpReduceScatter: RecHalving}} {
		c.cfg.Algo = algos
		g := make([]int64, 4*p)
		if err := AllGather(ctx, c, []int64{int64(r), 1, 2, 3}, g); err != nil {
			return err
		}
		for q := 0; q < p; q++ {
			if g[4*q] != int64(q) || g[4*q+3] != 3 {
				return fmt.Errorf("allgather %v: %v", algos, g)
			}
		}
		rs := make([]float64, 10)
		in := make([]float64, 10*p)
		for i := range in {
			in[i] = float64(i)
		}
		if err := ReduceScatter(ctx, c, in, rs, dtype.Sum); err != nil {
			return err
		}
		for k, v := range rs {
			if v != float64(p*(r*10+k)) {
				return fmt.Errorf("reducescatter %v: %v", algos, rs)
			}
		}
	}
	c.cfg.Algo = map[OpKind]Algo{}
	return Barrier(ctx, c)
}

// helperDeath: rank 1 vanishes (exits without closing) in the middle of an AllReduce;
// every other rank must fail that AllReduce with an error naming rank 1, quickly.
func helperDeath(ctx context.Context, c *Comm) error {
	x := make([]float32, 1<<20)
	start := time.Now()
	err := AllReduce(ctx, c, nil, x, dtype.Sum)
	if c.Rank() == 1 {
		if err != nil {
			return err
		}
		fmt.Println("rank 1 ok (vanishing)")
		os.Exit(0)
	}
	// Rank 1 exits as soon as its part of the first AllReduce is done: a survivor still
	// reading rank 1's last message when the kernel resets rank 1's connections (it left
	// unread data behind) loses that op; one that finished it loses the next. Either way
	// the error must name rank 1.
	if err == nil {
		start = time.Now()
		err = AllReduce(ctx, c, nil, x, dtype.Sum)
	}
	var pe *PeerError
	if !errors.As(err, &pe) || pe.Rank != 1 {
		return fmt.Errorf("got %v, want a PeerError naming rank 1", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		return fmt.Errorf("took %v to notice", d)
	}
	fmt.Printf("rank %d saw: %v\n", c.Rank(), err)
	c.Close()
	fmt.Printf("rank %d ok\n", c.Rank())
	os.Exit(0)
	return nil
}

// buildMoex builds the moex command once per test binary run.
func buildMoex(t *testing.T, flags ...string) string {
	t.Helper()
	exe := filepath.Join(t.TempDir(), "moex")
	args := append([]string{"build", "-o", exe}, flags...)
	cmd := exec.Command("go", append(args, "github.com/moex-ai/moex/cmd/moex")...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building moex: %v\n%s", err, out)
	}
	return exe
}

func moexRun(t *testing.T, moex string, n int, scenario string, env ...string) string {
	t.Helper()
	cmd := exec.Command(moex, "run", "-n", fmt.Sprint(n), "--", os.Args[0], "-test.run=^TestHelperCollRank$")
	cmd.Env = append(os.Environ(), "MOEX_COLL_HELPER="+scenario, "MOEX_TRANSPORT=tcp")
	cmd.Env = append(cmd.Env, env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("moex run: %v\n%s", err, out.String())
	}
	return out.String()
}

// A subset of the collectives, over TCP, as separate processes started by `moex run`.
func TestMultiProcessTCP(t *testing.T) {
	moex := buildMoex(t)
	for _, n := range []int{3, 4} {
		out := moexRun(t, moex, n, "subset")
		if c := strings.Count(out, " ok"); c != n {
			t.Fatalf("%d ranks, %d reported ok:\n%s", n, c, out)
		}
	}
}

// A process that dies mid-collective is named in the error of every other rank.
func TestMultiProcessDeadPeer(t *testing.T) {
	moex := buildMoex(t)
	out := moexRun(t, moex, 4, "death")
	if c := strings.Count(out, " ok"); c != 4 {
		t.Fatalf("%d of 4 ranks ok:\n%s", c, out)
	}
	if c := strings.Count(out, "rank 1"); c < 3 {
		t.Fatalf("survivors did not name rank 1:\n%s", out)
	}
}

// Ranks on two (pretend) hosts under the automatic choice: shm between the ranks of a
// host, the network transport between hosts, through a transport.Mux.
func TestMultiProcessTwoHosts(t *testing.T) {
	moex := buildMoex(t)
	out := moexRun(t, moex, 4, "subset", "MOEX_TRANSPORT=auto", "MOEX_COLL_TWO_HOSTS=1")
	if c := strings.Count(out, " ok transport=shm+tcp"); c != 4 {
		t.Fatalf("want 4 ranks ok over shm+tcp:\n%s", out)
	}
}
