package coll

import (
	"context"
	"errors"
	"fmt"
	"github.com/moex-ai/moex/internal/launch"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/moex-ai/moex/coll/health"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// Every rank must end with an error that matches want, within the timeout.
func wantAll(t *testing.T, errs []error, want error) {
	t.Helper()
	for r, err := range errs {
		if !errors.Is(err, want) {
			t.Errorf("rank %d: got %v, want an error matching %v", r, err, want)
		}
	}
}

func quick() Config { return Config{Timeout: 5 * time.Second} }

func TestMismatchedCounts(t *testing.T) {
	for _, algo := range Algorithms[OpAllReduce] {
		start := time.Now()
		errs := world(t, 4, Config{Timeout: 5 * time.Second, Algo: map[OpKind]Algo{OpAllReduce: algo}}, func(c *Comm) error {
			n := 1000
			if c.Rank() == 2 {
				n = 1001
			}
			return AllReduce(context.Background(), c, nil, make([]float32, n), dtype.Sum)
		})
		wantAll(t, errs, ErrMismatch)
		if d := time.Since(start); d > 4*time.Second {
			t.Errorf("%v: mismatch took %v to surface (must not wait for the timeout)", algo, d)
		}
	}
}

func TestMismatchedTypes(t *testing.T) {
	errs := world(t, 3, quick(), func(c *Comm) error {
		if c.Rank() == 1 {
			return AllReduce(context.Background(), c, nil, make([]int32, 64), dtype.Sum)
		}
		return AllReduce(context.Background(), c, nil, make([]float32, 64), dtype.Sum)
	})
	wantAll(t, errs, ErrMismatch)
}

// Two ranks issue the same two operations in different orders.
func TestDifferentOrder(t *testing.T) {
	errs := world(t, 2, quick(), func(c *Comm) error {
		ctx := context.Background()
		a := make([]float64, 16)
		if c.Rank() == 0 {
			if err := AllReduce(ctx, c, nil, a, dtype.Sum); err != nil {
				return err
			}
			return Broadcast(ctx, c, a, 0)
		}
		if err := Broadcast(ctx, c, a, 0); err != nil {
			return err
		}
		return AllReduce(ctx, c, nil, a, dtype.Sum)
	})
	wantAll(t, errs, ErrMismatch)
}

// Two ranks that both believe they are the root exchange no message that could show the
// disagreement; Config.Verify catches it.
func TestRootMismatchWithVerify(t *testing.T) {
	errs := world(t, 2, Config{Timeout: 5 * time.Second, Verify: true}, func(c *Comm) error {
		return Broadcast(context.Background(), c, make([]float32, 8), c.Rank())
	})
	wantAll(t, errs, ErrMismatch)
}

func TestWrongLengthNamesTheArgument(t *testing.T) {
	errs := world(t, 3, quick(), func(c *Comm) error {
		send := make([]float32, 10)
		recv := make([]float32, 10)
		if c.Rank() == 1 {
			recv = recv[:9]
		}
		return AllReduce(context.Background(), c, send, recv, dtype.Sum)
	})
	var ae *ArgError
	if !errors.As(errs[1], &ae) || ae.Arg != "recv" {
		t.Fatalf("rank 1: got %v, want ArgError naming recv", errs[1])
	}
	// The others learn of it, quickly, as an abort caused by an invalid argument.
	for _, r := range []int{0, 2} {
		var abort *AbortError
		if !errors.As(errs[r], &abort) || abort.Rank != 1 || !errors.Is(errs[r], ErrInvalidArgument) {
			t.Fatalf("rank %d: got %v, want AbortError by rank 1 wrapping ErrInvalidArgument", r, errs[r])
		}
	}
}

func TestRootOutOfRange(t *testing.T) {
	for _, root := range []int{-1, 3, 99} {
		errs := world(t, 3, quick(), func(c *Comm) error {
			return Broadcast(context.Background(), c, make([]int64, 4), root)
		})
		for r, err := range errs {
			var ae *ArgError
			if !errors.As(err, &ae) || ae.Arg != "root" {
				if !errors.Is(err, ErrInvalidArgument) {
					t.Fatalf("root %d, rank %d: got %v, want ArgError naming root", root, r, err)
				}
			}
		}
	}
}

func TestNegativeCounts(t *testing.T) {
	errs := world(t, 3, quick(), func(c *Comm) error {
		sc := []int{1, 1, 1}
		if c.Rank() == 0 {
			sc[2] = -4
		}
		return AlltoAllv(context.Background(), c, make([]float32, 3), sc, nil, make([]float32, 3), []int{1, 1, 1}, nil)
	})
	var ae *ArgError
	if !errors.As(errs[0], &ae) || ae.Arg != "sendCounts[2]" {
		t.Fatalf("rank 0: got %v, want ArgError naming sendCounts[2]", errs[0])
	}
	wantAll(t, errs, ErrInvalidArgument)
}

func TestAlltoAllvCountsDisagree(t *testing.T) {
	body := func(c *Comm) error {
		rc := []int{2, 2, 2}
		if c.Rank() == 1 {
			rc[0] = 3 // rank 0 sends 2
		}
		err := AlltoAllv(context.Background(), c, make([]float32, 6), []int{2, 2, 2}, nil, make([]float32, 7), rc, nil)
		if err != nil {
			return err
		}
		// Ranks not involved may have finished; their next operation reports it.
		return Barrier(context.Background(), c)
	}
	for _, algo := range Algorithms[OpAlltoAllv] {
		errs := world(t, 3, Config{Timeout: 5 * time.Second, Algo: map[OpKind]Algo{OpAlltoAllv: algo}}, body)
		wantAll(t, errs, ErrMismatch)
	}
	// With Verify every rank fails the AlltoAllv itself.
	errs := world(t, 3, Config{Timeout: 5 * time.Second, Verify: true}, func(c *Comm) error {
		rc := []int{2, 2, 2}
		if c.Rank() == 1 {
			rc[0] = 3
		}
		return AlltoAllv(context.Background(), c, make([]float32, 6), []int{2, 2, 2}, nil, make([]float32, 7), rc, nil)
	})
	wantAll(t, errs, ErrMismatch)
}

func TestBadOp(t *testing.T) {
	errs := world(t, 2, quick(), func(c *Comm) error {
		return AllReduce(context.Background(), c, nil, make([]float32, 4), dtype.Op(77))
	})
	wantAll(t, errs, ErrInvalidArgument)
}

// A rank that never shows up: everyone else times out (no hang), and the communicator is
// unusable afterwards.
func TestTimeout(t *testing.T) {
	cs := newLocal(t, 4, Config{Timeout: 300 * time.Millisecond})
	start := time.Now()
	errs := runOn(cs[:3], func(c *Comm) error {
		return AllReduce(context.Background(), c, nil, make([]float32, 100), dtype.Sum)
	})
	wantAll(t, errs, ErrTimeout)
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("timeout of 300ms took %v", d)
	}
	// Rank 3 was told: its next op fails at once.
	err := Barrier(context.Background(), cs[3])
	if !errors.Is(err, ErrAborted) || !errors.Is(err, ErrTimeout) {
		t.Fatalf("rank 3 after the others timed out: %v", err)
	}
}

// The watchdog stays set across operations and lets itself lapse when none runs: an
// operation after an idle spell, and one after a run of quick ones, still time out.
func TestTimeoutAfterIdle(t *testing.T) {
	cs := newLocal(t, 3, Config{Timeout: 200 * time.Millisecond})
	for i := 0; i < 50; i++ {
		if err := errors.Join(runOn(cs, func(c *Comm) error { return Barrier(context.Background(), c) })...); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(500 * time.Millisecond) // the watchdog fires with nothing running
	if err := errors.Join(runOn(cs, func(c *Comm) error { return Barrier(context.Background(), c) })...); err != nil {
		t.Fatalf("after the idle spell: %v", err)
	}
	// Rank 2 stays away: the others' next operation times out.
	errs := runOn(cs[:2], func(c *Comm) error {
		return AllReduce(context.Background(), c, nil, make([]float32, 10), dtype.Sum)
	})
	wantAll(t, errs, ErrTimeout)
}

func TestContextDeadline(t *testing.T) {
	errs := world(t, 2, Config{}, func(c *Comm) error {
		if c.Rank() == 1 {
			time.Sleep(300 * time.Millisecond)
			return Barrier(context.Background(), c)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		return Barrier(ctx, c)
	})
	if !errors.Is(errs[0], ErrTimeout) || !errors.Is(errs[0], context.DeadlineExceeded) {
		t.Fatalf("rank 0: %v", errs[0])
	}
	if !errors.Is(errs[1], ErrAborted) {
		t.Fatalf("rank 1: %v", errs[1])
	}
}

// An operation whose context is cancelled while the launcher stops the job (it wrote
// why, as moex run does before its SIGTERM) fails with a StoppedError that names the rank
// the launcher blames, and matches ErrCanceled; without a launcher's reason, a plain
// cancellation.
func TestCancelWhileStoppedNamesTheRank(t *testing.T) {
	require.Equal(t, launch.StopFile, health.StopFile, "moex run writes where coll reads")
	dir := t.TempDir()
	t.Setenv(health.ReportDirVar, dir)
	for _, stopping := range []bool{false, true} {
		if stopping {
			require.NoError(t, os.WriteFile(filepath.Join(dir, health.StopFile), []byte("3 launch: rank 3 killed by SIGKILL\n"), 0o600))
		}
		errs := world(t, 2, Config{}, func(c *Comm) error {
			ctx, cancel := context.WithCancel(context.Background())
			if c.Rank() == 0 {
				cancel()
			} else {
				defer cancel()
			}
			return Barrier(ctx, c)
		})
		var se *StoppedError
		assert.ErrorIs(t, errs[0], ErrCanceled)
		assert.ErrorIs(t, errs[0], context.Canceled)
		assert.Equal(t, stopping, errors.As(errs[0], &se), "%v", errs[0])
		if stopping {
			assert.Equal(t, 3, se.Rank)
		}
	}
}

// A rank that dies (its endpoint closes mid-operation) fails the operation on every other
// rank with an error naming it.
func TestDeadPeerNamed(t *testing.T) {
	cs := newLocal(t, 4, Config{Timeout: time.Minute})
	go func() {
		time.Sleep(50 * time.Millisecond)
		cs[2].Close()
	}()
	start := time.Now()
	errs := runOn([]*Comm{cs[0], cs[1], cs[3]}, func(c *Comm) error {
		return AllReduce(context.Background(), c, nil, make([]float32, 1<<16), dtype.Sum)
	})
	for i, err := range errs {
		var pe *PeerError
		if !errors.As(err, &pe) || pe.Rank != 2 {
			t.Errorf("survivor %d: got %v, want a PeerError naming rank 2", i, err)
		}
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("took %v to notice", d)
	}
	// Later operations fail at once too.
	if err := Barrier(context.Background(), cs[0]); !errors.Is(err, ErrAborted) {
		t.Fatalf("after the death: %v", err)
	}
}

func TestAbortUnblocks(t *testing.T) {
	cs := newLocal(t, 3, Config{})
	go func() {
		time.Sleep(30 * time.Millisecond)
		cs[0].Abort("operator said stop")
	}()
	errs := runOn(cs[1:], func(c *Comm) error {
		return AllReduce(context.Background(), c, nil, make([]float32, 8), dtype.Sum)
	})
	for r, err := range errs {
		var ae *AbortError
		if !errors.As(err, &ae) || ae.Rank != 0 {
			t.Fatalf("rank %d: %v", r+1, err)
		}
	}
}

func TestClosedComm(t *testing.T) {
	cs, err := Local(1, Config{})
	if err != nil {
		t.Fatal(err)
	}
	cs[0].Close()
	if err := Barrier(context.Background(), cs[0]); !errors.Is(err, ErrClosed) {
		t.Fatalf("got %v", err)
	}
	if err := cs[0].Close(); err != nil {
		t.Fatal(err)
	}
}

func TestAlgoOverrides(t *testing.T) {
	m, err := ParseAlgoOverrides("allreduce:ring, alltoall:bruck")
	if err != nil || m[OpAllReduce] != Ring || m[OpAlltoAll] != Bruck {
		t.Fatalf("%v %v", m, err)
	}
	for _, bad := range []string{"allreduce", "allreduce:bruck", "frobnicate:ring", "allreduce:fast"} {
		if _, err := ParseAlgoOverrides(bad); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%q: got %v", bad, err)
		}
	}
}

// The model picks the latency-bound algorithm for small messages and the bandwidth-bound
// one for large, and the choice is the same on every rank.
func TestCostModelChoices(t *testing.T) {
	cs := newLocal(t, 8, Config{})
	c := cs[0]
	small, large := c.choose(OpAllReduce, 64), c.choose(OpAllReduce, 16<<20)
	if small != RecDoubling || (large != Ring && large != Rabenseifner) {
		t.Fatalf("allreduce: small %v, large %v", small, large)
	}
	if a := c.choose(OpAllGather, 8); a == Ring {
		t.Fatalf("allgather of 8 bytes on 8 ranks chose %v", a)
	}
	for op := range Algorithms {
		for _, n := range []int{0, 8, 1 << 10, 1 << 20, 64 << 20} {
			a0 := cs[0].choose(op, n)
			for _, o := range cs[1:] {
				if o.choose(op, n) != a0 {
					t.Fatalf("%v %d: ranks disagree", op, n)
				}
			}
		}
	}
}

// A chain of waits: rank 0 waits for 3, 3 for 2, 2 for 1, and rank 1 is busy elsewhere
// (in no operation). Every rank that times out names rank 1, the end of the chain, not
// the rank it waited for directly; rank 1 is told.
func TestTimeoutNamesTheEndOfTheChain(t *testing.T) {
	cs := newLocal(t, 4, Config{Timeout: 300 * time.Millisecond})
	from := map[int]int{0: 3, 3: 2, 2: 1}
	inChain := []*Comm{cs[0], cs[2], cs[3]}
	errs := runOn(inChain, func(c *Comm) error {
		return SendRecv(context.Background(), c, []P2P{{Peer: from[c.Rank()], Buf: make([]byte, 64), Recv: true}})
	})
	for i, err := range errs {
		r := inChain[i].Rank()
		require.ErrorIs(t, err, ErrTimeout, "rank %d", r)
		var te *TimeoutError
		require.ErrorAs(t, err, &te, "rank %d", r)
		assert.Equal(t, 1, te.blame(), "rank %d: %v", r, err)
		if len(te.Stuck) > 0 { // this rank's own probe (else it heard another's)
			assert.Equal(t, []int{1}, te.Stuck, "rank %d", r)
		}
	}
	err := Barrier(context.Background(), cs[1])
	require.ErrorIs(t, err, ErrTimeout, "rank 1 was told")
}

// The probe's answers: a rank in an operation says whom it waits for; one in no
// operation says so.
func TestFindStuckFollowsReplies(t *testing.T) {
	cs := newLocal(t, 3, Config{Timeout: 5 * time.Second})
	done := make(chan error, 1)
	go func() { // rank 2 waits for rank 1, which stays away
		done <- SendRecv(context.Background(), cs[2], []P2P{{Peer: 1, Buf: make([]byte, 8), Recv: true}})
	}()
	require.Eventually(t, func() bool { return len(cs[2].waitingFor()) == 1 }, 2*time.Second, time.Millisecond)
	assert.Equal(t, []int{1}, cs[0].findStuck([]int{2}), "0 asks 2, 2 waits for 1, 1 is in no operation")
	cs[2].Abort("test over")
	require.ErrorIs(t, <-done, ErrAborted)
}

// A bad argument on one rank in a rooted operation of VerifyRootedMin bytes or more:
// every rank fails in that call, the ranks that only send included (the Broadcast's
// root, the Gather's leaves), with an AbortError by the bad rank that matches
// ErrInvalidArgument. Over shm processes and tcp the same holds: the agreement is a
// collective like any other.
func TestRootedArgErrorsInTheSameCall(t *testing.T) {
	const n = VerifyRootedMin / 4 // float32s
	cases := []struct {
		name string
		bad  int
		op   func(ctx context.Context, c *Comm) error
	}{
		{"broadcast/bad root on rank 2", 2, func(ctx context.Context, c *Comm) error {
			root := 0
			if c.Rank() == 2 {
				root = 9
			}
			return Broadcast(ctx, c, make([]float32, n), root)
		}},
		{"gather/short recv at the root", 0, func(ctx context.Context, c *Comm) error {
			recv := make([]float32, 0)
			if c.Rank() == 0 {
				recv = make([]float32, 4*n/4-1)
			}
			return Gather(ctx, c, make([]float32, n/4), recv, 0)
		}},
		{"reduce/bad op on rank 3", 3, func(ctx context.Context, c *Comm) error {
			op := dtype.Sum
			if c.Rank() == 3 {
				op = dtype.Op(77)
			}
			return Reduce(ctx, c, make([]float32, n), make([]float32, n), op, 0)
		}},
		{"scatter/short send at the root", 0, func(ctx context.Context, c *Comm) error {
			send := make([]float32, 0)
			if c.Rank() == 0 {
				send = make([]float32, n-1)
			}
			return Scatter(ctx, c, send, make([]float32, n/4), 0)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cs := newLocal(t, 4, Config{Timeout: 10 * time.Second})
			errs := runOn(cs, func(c *Comm) error { return tc.op(context.Background(), c) })
			for r, err := range errs {
				require.ErrorIs(t, err, ErrInvalidArgument, "rank %d", r)
				if r == tc.bad {
					var ae *ArgError
					require.ErrorAs(t, err, &ae, "rank %d", r)
					continue
				}
				var abort *AbortError
				require.ErrorAs(t, err, &abort, "rank %d", r)
				assert.Equal(t, tc.bad, abort.Rank, "rank %d", r)
			}
		})
	}
}

// Below VerifyRootedMin, or with NoRootedVerify, a rooted operation does not verify: the
// sequence numbers of the ranks stay in step either way (the next operation works).
func TestRootedVerifyThreshold(t *testing.T) {
	for _, cfg := range []Config{{}, {NoRootedVerify: true}} {
		cs := newLocal(t, 3, cfg)
		for _, n := range []int{16, VerifyRootedMin / 4, 16} {
			noErr(t, runOn(cs, func(c *Comm) error {
				x := make([]float32, n)
				if c.Rank() == 1 {
					x[0] = 7
				}
				if err := Broadcast(context.Background(), c, x, 1); err != nil {
					return err
				}
				if x[0] != 7 {
					return fmt.Errorf("rank %d: got %v", c.Rank(), x[0])
				}
				return AllReduce(context.Background(), c, nil, x, dtype.Sum)
			}))
		}
		v := cs[0].verifies(&call{op: OpBroadcast, dt: dtype.F32, count: VerifyRootedMin / 4})
		assert.Equal(t, !cfg.NoRootedVerify, v)
		assert.False(t, cs[0].verifies(&call{op: OpBroadcast, dt: dtype.F32, count: 16}))
		assert.False(t, cs[0].verifies(&call{op: OpAllReduce, dt: dtype.F32, count: 1 << 20}))
	}
}

// Close waits for the goroutines of the non-blocking operations still running: none is
// left once it returns, with their handles never waited for.
func TestCloseWaitsForNonBlockingOps(t *testing.T) {
	for run := 0; run < 3; run++ {
		before := goleak.IgnoreCurrent()
		cs, err := Local(3, Config{Timeout: 10 * time.Second})
		require.NoError(t, err)
		ctx := context.Background()
		for _, c := range cs {
			for i := 0; i < 8; i++ {
				_, err := IAllReduce(ctx, c, nil, make([]float32, 4096), dtype.Sum)
				require.NoError(t, err)
			}
		}
		// One rank goes first: the others' operations fail; Close still waits for them.
		for _, c := range cs {
			require.NoError(t, c.Close())
		}
		require.NoError(t, goleak.Find(before), "run %d", run)
	}
}

// The watchdog's timer goroutine sends stall probes, and Close does not wait for it: a
// probe sent while Close waits for the watchers must neither race with that wait nor
// leave a goroutine behind (goleak checks the second at the end of the package).
func TestProbeDuringClose(t *testing.T) {
	for i := 0; i < 20; i++ {
		cs, err := Local(2, Config{Timeout: time.Second})
		require.NoError(t, err)
		stop := make(chan struct{})
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				select {
				case <-stop:
					return
				default:
				}
				cs[0].sendCtl(1, health.ProbeMessage())
			}
		}()
		time.Sleep(time.Millisecond)
		assert.NoError(t, cs[0].Close())
		close(stop)
		<-done
		assert.NoError(t, cs[1].Close())
	}
}
