package coll

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moex-ai/moex/internal/long"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/transport/bootstrap"
	"github.com/moex-ai/moex/transport/shm"
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
	if scenario == "joinanddie" { // claims its rank at the store, then dies mid start-up
		env, err := bootstrap.FromEnv()
		if err == nil {
			_, err = bootstrap.Join(ctx, env, nil)
		}
		time.Sleep(300 * time.Millisecond) // the others wait for it now
		fmt.Println("joined, dying:", err)
		os.Exit(0)
	}
	if scenario == "leave" && os.Getenv("MOEX_RANK") == "1" { // gone before it joins
		fmt.Println("rank 1 leaves before Init")
		os.Exit(0)
	}
	start := time.Now()
	procs0 := runtime.GOMAXPROCS(0) // the runtime's own choice, before Init
	c, err := Init(ctx, Config{})
	if scenario == "startup" {
		var se *bootstrap.StartupError
		var pe *PeerError
		if !errors.As(err, &se) {
			fmt.Printf("rank %s: init: %v (want a StartupError)\n", os.Getenv("MOEX_RANK"), err)
			os.Exit(1)
		}
		peer := -1
		if errors.As(err, &pe) {
			peer = pe.Rank
		}
		fmt.Printf("rank %s startup failed: missing=%v timeout=%v dup=%v peer=%d blame=%d after=%v: %v\n", os.Getenv("MOEX_RANK"), se.Missing(),
			errors.Is(err, ErrTimeout), errors.Is(err, bootstrap.ErrDuplicateRank), peer, se.Rank, time.Since(start).Round(10*time.Millisecond), err)
		os.Exit(0)
	}
	if err != nil {
		fmt.Println("init failed:", err)
		os.Exit(3)
	}
	switch scenario {
	case "subset":
		err = helperSubset(ctx, c)
	case "death":
		err = helperDeath(ctx, c)
	case "panic":
		err = helperPanic(ctx, c)
	case "killed":
		err = helperKilled(ctx, c)
	case "sharedDeath":
		err = helperSharedDeath(ctx, c)
	case "shared":
		err = helperShared(ctx, c)
	case "sharedmismatch":
		err = helperSharedMismatch(ctx, c)
	case "shrink":
		c, err = helperShrink(ctx, c)
	case "regrow":
		c, err = helperRegrow(ctx, c)
	case "stuck":
		err = helperStuck(ctx, c)
	case "launcher":
		err = helperLauncher(ctx, c)
	case "shortbcast":
		helperShortBroadcast(ctx, c)
	case "procs":
		fmt.Printf("rank %d procs=%d from=%d\n", c.Rank(), runtime.GOMAXPROCS(0), procs0)
		err = Barrier(ctx, c)
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
		if os.Getenv("MOEX_DEATH_SIGNAL") != "" {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
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
	return failedAsExpected(c, start, err, errors.As(err, &pe) && pe.Rank == 1, "a PeerError naming rank 1")
}

// helperPanic: rank 2 panics with its communicator's Close deferred, as the docs advise,
// while the others wait for it in an AllReduce: each of them fails that AllReduce with a
// PanicError naming rank 2 (and prints it); rank 2's panic goes on and kills it.
func helperPanic(ctx context.Context, c *Comm) error {
	if c.Rank() == 2 {
		defer c.Close()
		panic("rank 2 lost its way")
	}
	err := AllReduce(ctx, c, nil, make([]float32, 1024), dtype.Sum)
	var pa *PanicError
	fmt.Printf("rank %d saw: panicked=%v by=%d\n", c.Rank(), errors.As(err, &pa) && pa.Rank == 2, func() int {
		if pa != nil {
			return pa.Rank
		}
		return -1
	}())
	if err == nil {
		return errors.New("the AllReduce without rank 2 succeeded")
	}
	return err
}

// helperKilled: a serving loop of AllReduces and compute that stops on SIGTERM, as a
// server does (signal.NotifyContext); rank 1 is killed (SIGKILL) in its middle. Each survivor ends
// with an error and prints which rank it names: the dead one, whether it learnt of the
// death itself (a PeerError, or an abort that names it) or through the launcher that
// stopped it (a StoppedError).
func helperKilled(ctx context.Context, c *Comm) error {
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM)
	defer stop()
	x := make([]float32, 4096)
	for i := 0; ; i++ {
		if c.Rank() == 1 && i == 200 {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
		time.Sleep(time.Millisecond) // the experts compute: the ranks are in no collective
		if err := AllReduce(ctx, c, nil, x, dtype.Sum); err != nil {
			named := -1
			var pe *PeerError
			var se *StoppedError
			switch {
			case errors.As(err, &se):
				named = se.Rank
			case errors.As(err, &pe):
				named = pe.Rank
			}
			fmt.Printf("rank %d names rank %d: %v\n", c.Rank(), named, err)
			return err
		}
	}
}

// helperShrink: rank 1 is killed (SIGKILL) between two operations; every survivor's
// next operation fails naming it, Shrink gives each the same communicator of the
// others, whose operations give the right results. It returns the communicator to
// close.
func helperShrink(ctx context.Context, c *Comm) (*Comm, error) {
	err := checkWorks(ctx, c)
	if c.Rank() == 1 {
		if err != nil {
			return c, err
		}
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	// Rank 1 dies once its part is done: a survivor sees it in that operation or the next.
	start := time.Now()
	if err == nil {
		err = checkWorks(ctx, c)
	}
	var pe *PeerError
	if !errors.As(err, &pe) || pe.Rank != 1 {
		return c, fmt.Errorf("after the kill: got %v, want a PeerError naming rank 1", err)
	}
	sub, err := c.Shrink(ctx)
	if err != nil {
		return c, err
	}
	if err := checkWorks(ctx, sub); err != nil {
		return c, err
	}
	fmt.Printf("rank %d shrunk to %d of %d, parents %v, in %v\n", c.Rank(), sub.Rank(), sub.Size(), sub.ParentRanks(), time.Since(start).Round(time.Millisecond))
	if err := c.Close(); err != nil {
		return sub, err
	}
	return sub, nil
}

// helperRegrow: the rank MOEX_REGROW_VICTIM kills itself (SIGKILL) between two
// operations; the survivors shrink and serve on, admitting at every step whoever waits
// in the job's registry, until the process that moex run --restarts started in the dead
// rank's place has joined; then every rank, the new one included, runs 50 checked steps
// on the grown communicator.
func helperRegrow(ctx context.Context, c *Comm) (*Comm, error) {
	const steps = 100
	if os.Getenv("MOEX_JOINING") == "1" { // the new process: Init returned the grown communicator
		fmt.Printf("rank %d joined, %d ranks, parents %v\n", c.Rank(), c.Size(), c.ParentRanks())
		for i := 0; i < steps; i++ {
			if err := checkWorks(ctx, c); err != nil {
				return c, err
			}
		}
		return c, nil
	}
	victim := envInt("MOEX_REGROW_VICTIM")
	if err := checkWorks(ctx, c); err != nil {
		return c, err
	}
	if err := Barrier(ctx, c); err == nil && c.Rank() == victim {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	}
	err := checkWorks(ctx, c)
	var pe *PeerError
	if !errors.As(err, &pe) || pe.Rank != victim {
		return c, fmt.Errorf("after the death: %v, want a PeerError naming rank %d", err, victim)
	}
	sub, err := c.Shrink(ctx)
	if err != nil {
		return c, err
	}
	defer sub.Close()
	var g *Comm
	for served := 0; g == nil; served++ {
		if err := checkWorks(ctx, sub); err != nil {
			return c, fmt.Errorf("serving on %d ranks: %w", sub.Size(), err)
		}
		if g, err = sub.Admit(ctx); err != nil {
			return c, fmt.Errorf("admit after %d steps: %w", served, err)
		}
	}
	c.Close()
	for i := 0; i < steps; i++ {
		if err := checkWorks(ctx, g); err != nil {
			return g, err
		}
	}
	return g, nil
}

// helperStuck: rank 1 stops itself (SIGSTOP) between two AllReduces; the others' next
// one fails at the timeout with a TimeoutError naming rank 1 (their exit then lets the
// launcher blame rank 1, which it kills).
func helperStuck(ctx context.Context, c *Comm) error {
	x := make([]float32, 1024)
	if err := AllReduce(ctx, c, nil, x, dtype.Sum); err != nil {
		return err
	}
	if c.Rank() == 1 {
		syscall.Kill(os.Getpid(), syscall.SIGSTOP)
		select {} // stuck, even if something continues it
	}
	// The launcher stops the others (SIGTERM, then SIGKILL after its grace) as soon as the
	// first survivor exits: a survivor takes that grace to say whom it blames.
	signal.Ignore(syscall.SIGTERM)
	start := time.Now()
	err := AllReduce(ctx, c, nil, x, dtype.Sum)
	var te *TimeoutError
	if !errors.As(err, &te) || len(te.Waiting) == 0 {
		return fmt.Errorf("got %v, want a TimeoutError naming the ranks it waited for", err)
	}
	fmt.Printf("rank %d timed out waiting for ranks %v, blaming rank %d, after %v\n", c.Rank(), te.Waiting, te.blame(), time.Since(start).Round(10*time.Millisecond))
	os.Exit(1) // a survivor's failure: the launcher must blame rank 1 all the same
	return nil
}

// helperShortBroadcast: four 4 KiB Broadcasts from rank 0; in the first, the rank named
// by MOEX_SHORT_RANK passes a buffer one element short. Each rank prints the first call
// that failed (or none) and exits 0: the test reads what each saw.
func helperShortBroadcast(ctx context.Context, c *Comm) {
	short := envInt("MOEX_SHORT_RANK")
	failed := -1
	var first error
	for i := 0; i < 4 && failed < 0; i++ {
		n := 1024
		if i == 0 && c.Rank() == short {
			n--
		}
		if first = Broadcast(ctx, c, make([]float32, n), 0); first != nil {
			failed = i
		}
	}
	fmt.Printf("rank %d first failed call %d mismatch=%v: %v\n", c.Rank(), failed, errors.Is(first, ErrMismatch), first)
	c.Close()
	os.Exit(0)
}

// freeAddr is a loopback address whose port was free a moment ago.
func freeAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().String()
}

// startRanks starts ranks (given) of a job of size ranks, rendezvous at addr, as
// processes of this test binary running scenario, with env added, and returns their
// combined output once all have ended.
func startRanks(t *testing.T, addr string, ranks []int, size int, scenario string, env ...string) string {
	t.Helper()
	var mu sync.Mutex
	var out bytes.Buffer
	var wg sync.WaitGroup
	for _, r := range ranks {
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelperCollRank$")
		cmd.Env = append(os.Environ(), "MOEX_COLL_HELPER="+scenario, "MOEX_TRANSPORT=tcp", "MOEX_RANK="+fmt.Sprint(r),
			"MOEX_WORLD_SIZE="+fmt.Sprint(size), "MOEX_ADDR="+addr, "MOEX_JOB_TOKEN=startup-test")
		cmd.Env = append(cmd.Env, env...)
		wg.Add(1)
		go func() {
			defer wg.Done()
			b, _ := cmd.CombinedOutput()
			mu.Lock()
			out.Write(b)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out.String()
}

// A rank that never comes: every rank that did fails at the start-up deadline with a
// StartupError that names it.
func TestStartupMissingRank(t *testing.T) {
	t.Parallel() // most of it is the wait for the timeout
	out := startRanks(t, freeAddr(t), []int{0, 1, 2}, 4, "startup", "MOEX_TIMEOUT=2s")
	assert.Equal(t, 3, strings.Count(out, "startup failed: missing=[3] timeout=true"), out)
}

// A rank that dies during start-up fails the others at once (not at the deadline), with
// a StartupError naming it.
func TestStartupRankDies(t *testing.T) {
	addr := freeAddr(t)
	var outs [2]string
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); outs[0] = startRanks(t, addr, []int{0, 1}, 3, "startup", "MOEX_TIMEOUT=60s") }()
	outs[1] = startRanks(t, addr, []int{2}, 3, "joinanddie")
	wg.Wait()
	assert.Equal(t, 2, strings.Count(outs[0], "timeout=false dup=false peer=2"), "%s\n%s", outs[0], outs[1])
}

// Two processes claiming one rank: both fail, and so does every other rank, at once,
// with ErrDuplicateRank.
func TestStartupDuplicateRank(t *testing.T) {
	out := startRanks(t, freeAddr(t), []int{0, 1, 1}, 3, "startup", "MOEX_TIMEOUT=60s")
	assert.Equal(t, 3, strings.Count(out, "dup=true"), out)
}

// A rank with no rank 0: it fails at the start-up deadline blaming rank 0, which serves
// the store and has not come, in one sentence (no prefix repeated).
func TestStartupNoRank0(t *testing.T) {
	t.Parallel() // most of it is the wait for the timeout
	out := startRanks(t, freeAddr(t), []int{1}, 2, "startup", "MOEX_TIMEOUT=2s")
	assert.Contains(t, out, "timeout=true dup=false peer=-1 blame=0", out)
	assert.Contains(t, out, "rank 0, which serves the rendezvous store", out)
	assert.Equal(t, 1, strings.Count(out, "transport:"), "one prefix: %s", out)
}

// Rank 0 dies during the rendezvous: the others fail at once, naming it (a PeerError
// for rank 0), not with the store's EOF.
func TestStartupRank0Dies(t *testing.T) {
	addr := freeAddr(t)
	var outs [2]string
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); outs[0] = startRanks(t, addr, []int{1, 2}, 3, "startup", "MOEX_TIMEOUT=60s") }()
	outs[1] = startRanks(t, addr, []int{0}, 3, "joinanddie")
	wg.Wait()
	assert.Equal(t, 2, strings.Count(outs[0], "timeout=false dup=false peer=0 blame=0"), "%s\n%s", outs[0], outs[1])
	assert.Contains(t, outs[0], "rank 0, which serves the rendezvous store, is gone")
}

// Two processes claim rank 0: the second says so (not "address already in use"), and
// every rank fails at once with ErrDuplicateRank.
func TestStartupTwoRank0(t *testing.T) {
	addr := freeAddr(t)
	var first string
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); first = startRanks(t, addr, []int{0, 1}, 3, "startup", "MOEX_TIMEOUT=60s") }()
	// Ranks 0 and 1 wait for rank 2 at the store; then a second rank 0 comes.
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		st, err := bootstrap.DialStore(ctx, addr, []byte("startup-test"))
		if err != nil {
			return false
		}
		defer st.Close()
		stages, err := st.Status(ctx)
		return err == nil && len(stages) == 3 && stages[0] != "" && stages[1] != ""
	}, 30*time.Second, 20*time.Millisecond, "ranks 0 and 1 at the store")
	second := startRanks(t, addr, []int{0}, 3, "startup", "MOEX_TIMEOUT=60s")
	wg.Wait()
	out := first + second
	assert.Equal(t, 3, strings.Count(out, "dup=true"), out)
	assert.Contains(t, out, "two processes claim rank 0", out)
	assert.NotContains(t, out, "address already in use", out)
}

// A rank stopped with SIGSTOP: the others fail at the timeout, each naming the ranks it
// waited for (the stopped one, or a rank that waited for it) and, at the end of the
// chain of waits, the stopped rank; moex run blames it too (its exit code: killed by
// the launcher), not a survivor.
func TestStuckRankBlamed(t *testing.T) {
	t.Parallel() // most of it is the wait for the timeout
	moex := buildMoex(t)
	out, err := moexRunKeepGoing(moex, false, 4, "stuck", "MOEX_TIMEOUT=2s")
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, out)
	assert.Equal(t, 128+int(syscall.SIGKILL), ee.ExitCode(), out)
	assert.Contains(t, out, "rank 1 killed by SIGKILL", out)
	assert.Equal(t, 3, strings.Count(out, "timed out waiting for ranks"), out)
	assert.Equal(t, 3, strings.Count(out, "blaming rank 1,"), out)
}

// A rank killed with SIGKILL over tcp: moex run blames it, every time, not the first
// survivor to exit.
func TestKilledRankBlamed(t *testing.T) {
	moex := buildMoex(t)
	runs := 2
	if long.Enabled() {
		runs = 5
	}
	for i := 0; i < runs; i++ {
		out, err := moexRunKeepGoing(moex, false, 4, "death", "MOEX_DEATH_SIGNAL=1")
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee, out)
		assert.Equal(t, 128+int(syscall.SIGKILL), ee.ExitCode(), "run %d:\n%s", i, out)
		assert.Contains(t, out, "rank 1 killed by SIGKILL", "run %d", i)
	}
}

// A rank that panics after Init, its Close deferred: moex run names it as the rank that
// panicked, its message and stack print, and every other rank fails its AllReduce with
// a PanicError naming it, over tcp and shm, well before the 20 s timeout (the context of
// the run bounds it: a launcher that waited the timeout would fail it).
func TestPanickingRankNamed(t *testing.T) {
	moex := buildMoex(t)
	for _, tr := range []string{"tcp", "shm"} {
		// Without --keep-going the launcher stops the others at the first failure, but
		// lets the panicking rank print its stack; with it, every survivor reports.
		for _, keepGoing := range []bool{false, true} {
			what := fmt.Sprintf("%s, keep going %v", tr, keepGoing)
			out, err := moexRunKeepGoing(moex, keepGoing, 4, "panic", "MOEX_TIMEOUT=20s", "MOEX_TRANSPORT="+tr)
			var ee *exec.ExitError
			require.ErrorAs(t, err, &ee, out)
			assert.Equal(t, 2, ee.ExitCode(), "%s: the launcher's exit code is the panicking rank's:\n%s", what, out)
			assert.Contains(t, out, "rank 2 panicked (exit code 2)", what)
			assert.Contains(t, out, "panic: rank 2 lost its way", "%s: the panic's message prints", what)
			assert.Contains(t, out, "coll.helperPanic(", "%s: and its stack", what)
			assert.Regexp(t, `rank [013] saw: panicked=true by=2`, out, what)
			if keepGoing {
				for _, r := range []int{0, 1, 3} {
					assert.Contains(t, out, fmt.Sprintf("rank %d saw: panicked=true by=2", r), "%s:\n%s", what, out)
				}
			}
			assert.NotContains(t, out, "timeout", what)
		}
	}
}

// A rank killed in the middle of serving: every survivor that prints an error names it,
// whether it learnt of the death itself or from the launcher stopping the job (its
// context cancelled on SIGTERM: a StoppedError), and the launcher names it too.
func TestKilledRankNamedBySurvivors(t *testing.T) {
	moex := buildMoex(t)
	runs := 3
	if long.Enabled() {
		runs = 12
	}
	for i := 0; i < runs; i++ {
		for _, tr := range []string{"tcp", "shm"} {
			out, err := moexRunKeepGoing(moex, false, 4, "killed", "MOEX_TIMEOUT=20s", "MOEX_TRANSPORT="+tr)
			var ee *exec.ExitError
			require.ErrorAs(t, err, &ee, out)
			assert.Contains(t, out, "rank 1 killed by SIGKILL", "%s, run %d", tr, i)
			named := regexp.MustCompile(`rank [023] names rank (-?\d+)`).FindAllStringSubmatch(out, -1)
			for _, m := range named {
				assert.Equal(t, "1", m[1], "%s, run %d: a survivor names another rank:\n%s", tr, i, out)
			}
		}
	}
}

// A rank that exits cleanly before Init: moex run names it and stops the others at once
// (their start-up deadline is a minute), rather than blaming a survivor that timed out.
func TestLeftBeforeInitNamed(t *testing.T) {
	moex := buildMoex(t)
	out, err := moexRunKeepGoing(moex, false, 4, "leave", "MOEX_TIMEOUT=60s")
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, out)
	assert.Equal(t, 1, ee.ExitCode(), out)
	assert.Regexp(t, `rank 1 exited with code 0 before joining the communicator; ranks \[[0-9 ]+\] were waiting`, out)
	assert.NotContains(t, out, "rank 2 exited", "a survivor is not to blame")
}

// A 4 KiB Broadcast with one buffer one element short, a non-root rank's or the root's,
// between processes over tcp and shm: every rank fails that call or its next one (a
// second Broadcast), with ErrMismatch; nobody finishes the four calls.
func TestShortBroadcastProcesses(t *testing.T) {
	moex := buildMoex(t)
	for _, tr := range []string{"tcp", "shm"} {
		for _, short := range []int{1, 0} {
			out, err := moexRunKeepGoing(moex, false, 4, "shortbcast", "MOEX_TIMEOUT=20s", "MOEX_TRANSPORT="+tr, fmt.Sprintf("MOEX_SHORT_RANK=%d", short))
			require.NoError(t, err, out)
			for r := 0; r < 4; r++ {
				assert.Regexp(t, fmt.Sprintf(`rank %d first failed call [01] mismatch=true`, r), out, "%s, short rank %d", tr, short)
			}
		}
	}
}

// buildMoex builds the moex command with flags, once per set of flags for the test
// binary (linking it again for every test cost a second or two each).
func buildMoex(t *testing.T, flags ...string) string {
	t.Helper()
	key := strings.Join(flags, " ")
	builtMu.Lock()
	defer builtMu.Unlock()
	if exe, ok := built[key]; ok {
		return exe
	}
	if builtDir == "" {
		dir, err := os.MkdirTemp("", "moex-coll-test-")
		require.NoError(t, err)
		builtDir = dir
	}
	exe := filepath.Join(builtDir, fmt.Sprintf("moex%d", len(built)))
	args := append([]string{"build", "-o", exe}, flags...)
	cmd := exec.Command("go", append(args, "github.com/moex-ai/moex/cmd/moex")...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building moex: %v\n%s", err, out)
	}
	built[key] = exe
	return exe
}

var (
	builtMu  sync.Mutex
	built    = map[string]string{}
	builtDir string // removed by TestMain
)

func moexRun(t *testing.T, moex string, n int, scenario string, env ...string) string {
	t.Helper()
	out, err := moexRunKeepGoing(moex, false, n, scenario, env...)
	if err != nil {
		t.Fatalf("moex run: %v\n%s", err, out)
	}
	return out
}

// moexRunKeepGoing runs the ranks under `moex run [--keep-going]` and returns their
// output and the launcher's error.
func moexRunKeepGoing(moex string, keepGoing bool, n int, scenario string, env ...string) (string, error) {
	args := []string{"run", "-n", fmt.Sprint(n), "--grace", "500ms"}
	if keepGoing {
		args = append(args, "--keep-going")
	}
	cmd := exec.Command(moex, append(args, "--", os.Args[0], "-test.run=^TestHelperCollRank$")...)
	cmd.Env = append(os.Environ(), "MOEX_COLL_HELPER="+scenario, "MOEX_TRANSPORT=tcp")
	cmd.Env = append(cmd.Env, env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// shrinkRun runs the shrink scenario on 4 ranks: the launcher reports rank 1 killed,
// and the three survivors shrink to ranks 0, 2 and 3 and end over transport.
func shrinkRun(t *testing.T, moex, transport string, env ...string) {
	t.Helper()
	out, err := moexRunKeepGoing(moex, true, 4, "shrink", env...)
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, out)
	assert.Equal(t, 128+int(syscall.SIGKILL), ee.ExitCode(), "the launcher's exit code is the killed rank's:\n%s", out)
	assert.Equal(t, 3, strings.Count(out, "parents [0 2 3]"), out)
	assert.Equal(t, 3, strings.Count(out, " ok transport="+transport+"\n"), out)
}

// A rank killed with SIGKILL: the survivors shrink their communicator and carry on,
// over tcp and over shared memory.
// A rank of a 4-process job (over shm, and over tcp) is killed (SIGKILL); moex run
// --restarts starts a process in its place, the survivors admit it while they serve, and
// every rank, the new one included, ends its checked steps on the grown communicator:
// the job exits 0. Rank 0 too: the registry is the launcher's, not rank 0's.
func TestMultiProcessRegrow(t *testing.T) {
	moex := buildMoex(t)
	for _, tr := range []string{"shm", "tcp"} {
		for _, victim := range []int{1, 0} {
			cmd := exec.Command(moex, "run", "-n", "4", "--grace", "500ms", "--restarts", "1", "--", os.Args[0], "-test.run=^TestHelperCollRank$")
			cmd.Env = append(os.Environ(), "MOEX_COLL_HELPER=regrow", "MOEX_TRANSPORT="+tr, fmt.Sprintf("MOEX_REGROW_VICTIM=%d", victim))
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "%s, victim %d:\n%s", tr, victim, out)
			for r := 0; r < 4; r++ {
				require.Contains(t, string(out), fmt.Sprintf("rank %d ok transport=%s", r, tr), "%s, victim %d:\n%s", tr, victim, out)
			}
			require.Contains(t, string(out), fmt.Sprintf("launch: rank %d killed by SIGKILL", victim))
			require.Contains(t, string(out), "starting a process to take it over (restart 1 of 1)")
			require.Contains(t, string(out), fmt.Sprintf("rank %d joined, 4 ranks", victim))
		}
	}
	assert.Empty(t, shm.StaleSegments(), "segments in /dev/shm of processes gone")
}

func TestMultiProcessShrink(t *testing.T) {
	moex := buildMoex(t)
	for _, tr := range []string{"tcp", "shm"} {
		t.Run(tr, func(t *testing.T) { shrinkRun(t, moex, tr, "MOEX_TRANSPORT="+tr) })
	}
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

// Under moex run, ranks that share the host's CPUs over tcp run with GOMAXPROCS at their
// share of them; over shm, or with MOEX_GOMAXPROCS=keep, they keep the runtime's choice;
// a GOMAXPROCS the user sets wins.
func TestMultiProcessGOMAXPROCS(t *testing.T) {
	moex := buildMoex(t)
	const n = 4
	line := regexp.MustCompile(`rank \d+ procs=(\d+) from=(\d+)\n`)
	for _, tc := range []struct {
		name string
		env  []string
		want func(from int) int // GOMAXPROCS after Init, from the runtime's choice before
	}{
		{"tcp", []string{"GOMAXPROCS=", "MOEX_GOMAXPROCS="}, func(from int) int {
			return min(from, max(1, min(runtime.NumCPU(), from)/n))
		}},
		{"tcp keep", []string{"GOMAXPROCS=", "MOEX_GOMAXPROCS=keep"}, func(from int) int { return from }},
		{"tcp user", []string{"GOMAXPROCS=3", "MOEX_GOMAXPROCS="}, func(int) int { return 3 }},
		{"shm", []string{"GOMAXPROCS=", "MOEX_GOMAXPROCS=", "MOEX_TRANSPORT=shm"}, func(from int) int { return from }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := moexRun(t, moex, n, "procs", tc.env...)
			ms := line.FindAllStringSubmatch(out, -1)
			require.Len(t, ms, n, out)
			for _, m := range ms {
				procs, _ := strconv.Atoi(m[1])
				from, _ := strconv.Atoi(m[2])
				assert.Equal(t, tc.want(from), procs, "GOMAXPROCS after Init, from %d before: %s", from, m[0])
			}
			assert.Equal(t, n, strings.Count(out, " ok transport="), out)
		})
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

// The subset over shared memory, and AlltoAll through the shared areas (coll/shared):
// 3 ranks (not a power of two) and 4; with the default areas and with small ones (so
// that 1 MiB blocks are read across, and the boundary moves).
//
// The quick cut runs the subset and the default areas with 3 ranks and the small areas
// with 4; -long runs every combination.
func TestMultiProcessShm(t *testing.T) {
	moex := buildMoex(t)
	// 2 ranks: a CPU each here, so AllReduces past 64 KiB are combined in place (read
	// across); 3 and 4: crowded, through the areas up to their size.
	out := moexRun(t, moex, 2, "shared", "MOEX_TRANSPORT=shm")
	if c := strings.Count(out, " ok transport=shm"); c != 2 {
		t.Fatalf("shared, 2 ranks: %d reported ok:\n%s", c, out)
	}
	for _, n := range []int{3, 4} {
		if n == 3 || long.Enabled() {
			out := moexRun(t, moex, n, "subset", "MOEX_TRANSPORT=shm")
			if c := strings.Count(out, " ok transport=shm"); c != n {
				t.Fatalf("subset, %d ranks, %d reported ok over shm:\n%s", n, c, out)
			}
		}
		for _, area := range []string{"", "16"} {
			if (n == 3) != (area == "") && !long.Enabled() {
				continue
			}
			out := moexRun(t, moex, n, "shared", "MOEX_TRANSPORT=shm", "MOEX_SHM_AREA="+area)
			if c := strings.Count(out, " ok transport=shm"); c != n {
				t.Fatalf("shared, %d ranks, MOEX_SHM_AREA=%q: %d reported ok:\n%s", n, area, c, out)
			}
		}
	}
}

// A process that dies before an AlltoAll through the shared areas is named in the error
// of every other rank.
func TestMultiProcessShmDeadPeer(t *testing.T) {
	moex := buildMoex(t)
	out := moexRun(t, moex, 4, "sharedDeath", "MOEX_TRANSPORT=shm")
	if c := strings.Count(out, " ok"); c != 4 {
		t.Fatalf("%d of 4 ranks ok:\n%s", c, out)
	}
}

// Ranks that issue different AlltoAlls through the shared areas all fail with
// ErrMismatch.
func TestMultiProcessShmMismatch(t *testing.T) {
	moex := buildMoex(t)
	out := moexRun(t, moex, 3, "sharedmismatch", "MOEX_TRANSPORT=shm")
	if c := strings.Count(out, " ok"); c != 3 {
		t.Fatalf("%d of 3 ranks ok:\n%s", c, out)
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
