package etcd

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
)

func TestMain(m *testing.M) {
	if mode := os.Getenv("MOEX_ETCD_HELPER"); mode != "" {
		os.Exit(helper(mode))
	}
	os.Exit(m.Run())
}

// Exit codes of a helper process.
const (
	exitLive  = 3 // coll.Init refused it: its rank lives
	exitError = 1
)

// helper is a rank's process, started with the job's ordinary environment (MOEX_RANK,
// MOEX_WORLD_SIZE, MOEX_ADDR=etcd://..., MOEX_JOB_TOKEN): "serve" runs AllReduces until
// it is killed; "once" checks one AllReduce and closes.
func helper(mode string) int {
	ctx := context.Background()
	c, err := coll.Init(ctx, coll.Config{Timeout: 20 * time.Second})
	if errors.Is(err, coll.ErrRankLive) {
		return exitLive
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "init:", err)
		return exitError
	}
	defer c.Close()
	for {
		if err := works(ctx, c); err != nil {
			fmt.Fprintln(os.Stderr, "serving:", err)
			return exitError
		}
		if mode == "once" {
			return 0
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// rankProcess starts this test binary as rank r of n in the job at addr.
func rankProcess(t *testing.T, addr string, r, n int, mode string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "MOEX_ETCD_HELPER="+mode, "MOEX_RANK="+strconv.Itoa(r), "MOEX_WORLD_SIZE="+strconv.Itoa(n),
		"MOEX_ADDR="+addr, "MOEX_JOB_TOKEN="+secret, "MOEX_TRANSPORT=tcp", "MOEX_TIMEOUT=20s")
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	return cmd
}

// A job of three ranks meets in etcd, rank 2 in a process of its own. SIGKILL it: the
// other two shrink and serve on; the same command started again, with nothing added,
// finds the running job in etcd and takes rank 2 over (coll.Init returns the grown
// communicator once they Admit it), and all three serve. A process then started for a
// live rank is refused at once (ErrRankLive).
func TestRestartedProcessRejoins(t *testing.T) {
	ep := startEtcd(t)
	addr := "etcd://" + ep + "/restart"
	const n, victim = 3, 2
	victimProc := rankProcess(t, addr, victim, n, "serve")
	t.Cleanup(func() { _ = victimProc.Process.Kill(); _ = victimProc.Wait() })

	ctx := context.Background()
	var once sync.Once
	shrunk := make(chan struct{})
	var again *exec.Cmd
	errs := onRanks(2, func(r int) error {
		c, err := coll.InitEnv(ctx, env(addr, r, n), coll.Config{Timeout: 20 * time.Second})
		if err != nil {
			return err
		}
		defer c.Close()
		for i := 0; i < 20; i++ {
			if err := works(ctx, c); err != nil {
				return fmt.Errorf("before the kill: %w", err)
			}
		}
		if r == 0 {
			if err := victimProc.Process.Kill(); err != nil {
				return err
			}
		}
		var err2 error
		for err2 == nil {
			err2 = works(ctx, c)
		}
		var pe *coll.PeerError
		if !errors.As(err2, &pe) || pe.Rank != victim {
			return fmt.Errorf("after the kill: %v, want a PeerError naming rank %d", err2, victim)
		}
		sub, err := c.Shrink(ctx)
		if err != nil {
			return err
		}
		defer sub.Close()
		if err := works(ctx, sub); err != nil { // serving on two
			return err
		}
		once.Do(func() { close(shrunk) })
		if r == 0 {
			again = rankProcess(t, addr, victim, n, "once") // the same command, again
		}
		deadline := time.Now().Add(20 * time.Second)
		for time.Now().Before(deadline) {
			g, err := sub.Admit(ctx)
			if err != nil {
				return fmt.Errorf("admit: %w", err)
			}
			if g == nil {
				if err := works(ctx, sub); err != nil {
					return err
				}
				time.Sleep(10 * time.Millisecond)
				continue
			}
			defer g.Close()
			if g.Size() != n {
				return fmt.Errorf("grown to %d ranks", g.Size())
			}
			if r == 0 { // a process for a live rank is refused at once
				live := rankProcess(t, addr, 1, n, "once")
				err := live.Wait()
				var ee *exec.ExitError
				if !errors.As(err, &ee) || ee.ExitCode() != exitLive {
					return fmt.Errorf("a process for live rank 1 ended with %v, want exit %d (ErrRankLive)", err, exitLive)
				}
			}
			return works(ctx, g)
		}
		return errors.New("nobody was admitted within 20 s")
	})
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
	<-shrunk
	require.NotNil(t, again)
	require.NoError(t, again.Wait(), "the process started again for rank %d", victim)
	assert.Eventually(t, func() bool { return len(jobKeys(t, ep, "restart")) == 0 }, 2*DefaultTTL, 100*time.Millisecond,
		"what the job left in etcd: %v", jobKeys(t, ep, "restart"))
}
