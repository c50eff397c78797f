package etcd

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
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

// afterGrow is how many steps every rank runs once the job is whole again.
const afterGrow = 100

// helper is a rank's process, started with the job's ordinary environment (MOEX_RANK,
// MOEX_WORLD_SIZE, MOEX_ADDR=etcd://..., MOEX_JOB_TOKEN): "serve" runs AllReduces until
// its communicator fails; "survive" serves until a peer dies, shrinks, serves on while
// it admits a process for the dead rank, then runs afterGrow steps with it; "rejoin"
// (a process started again for the dead rank) prints "joined" once coll.Init returns and
// runs those afterGrow steps.
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
	fail := func(err error) int {
		fmt.Fprintf(os.Stderr, "rank %d (%s): %v\n", c.Rank(), mode, err)
		return exitError
	}
	steps := func(c *coll.Comm, n int) error {
		for range n {
			if err := works(ctx, c); err != nil {
				return err
			}
			time.Sleep(5 * time.Millisecond)
		}
		return nil
	}
	switch mode {
	case "rejoin":
		fmt.Println("joined", c.Size())
		if err := steps(c, afterGrow); err != nil {
			return fail(err)
		}
		return 0
	case "serve":
		fmt.Println("serving")
		return fail(steps(c, 1<<30))
	}
	err = steps(c, 1<<30) // until a peer dies
	var pe *coll.PeerError
	if !errors.As(err, &pe) {
		return fail(fmt.Errorf("serving: %w, want a PeerError", err))
	}
	sub, err := c.Shrink(ctx)
	if err != nil {
		return fail(err)
	}
	defer sub.Close()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		g, err := sub.Admit(ctx)
		if err != nil {
			return fail(err)
		}
		if g == nil {
			if err := steps(sub, 1); err != nil {
				return fail(err)
			}
			continue
		}
		defer g.Close()
		if g.Size() != c.Size() {
			return fail(fmt.Errorf("grown to %d ranks", g.Size()))
		}
		if err := steps(g, afterGrow); err != nil {
			return fail(err)
		}
		return 0
	}
	return fail(errors.New("nobody was admitted within 30 s"))
}

// rankProcess starts this test binary as rank r of n of the job at addr, over transport
// ("" leaves MOEX_TRANSPORT unset); its standard output comes on the reader.
func rankProcess(t *testing.T, addr, transport string, r, n int, mode string) (*exec.Cmd, io.Reader) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "MOEX_ETCD_HELPER="+mode, "MOEX_RANK="+strconv.Itoa(r), "MOEX_WORLD_SIZE="+strconv.Itoa(n),
		"MOEX_ADDR="+addr, "MOEX_JOB_TOKEN="+secret, "MOEX_TIMEOUT=20s")
	if transport != "" {
		cmd.Env = append(cmd.Env, "MOEX_TRANSPORT="+transport)
	}
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd, out
}

// A job of three processes meets in etcd. SIGKILL rank 2: the others shrink and serve on;
// the same command started again, with nothing added, finds the running job in etcd and
// takes rank 2 over (it is refused while the others have not yet removed the dead rank's
// entry, and started again, as a restarting launcher does); all three serve 100 steps.
// Meanwhile a process started for live rank 1 is refused at once (ErrRankLive). Over tcp,
// and with the transport left to moex (shared memory: one host).
func TestRestartedProcessRejoins(t *testing.T) {
	for _, tr := range []string{"tcp", ""} {
		name := tr
		if name == "" {
			name = "auto"
		}
		t.Run(name, func(t *testing.T) { restartedRejoins(t, tr) })
	}
}

func restartedRejoins(t *testing.T, tr string) {
	ep := startEtcd(t)
	addr := "etcd://" + ep + "/restart"
	const n, victim = 3, 2
	survivors := make([]*exec.Cmd, 2)
	for r := range survivors {
		survivors[r], _ = rankProcess(t, addr, tr, r, n, "survive")
	}
	victimProc, vout := rankProcess(t, addr, tr, victim, n, "serve")
	_, err := bufio.NewReader(vout).ReadString('\n') // the job runs
	require.NoError(t, err)
	time.Sleep(200 * time.Millisecond)
	require.NoError(t, victimProc.Process.Kill())

	var again *exec.Cmd
	var out io.Reader
	refused := 0
	for deadline := time.Now().Add(30 * time.Second); ; refused++ {
		require.True(t, time.Now().Before(deadline), "rank %d was refused %d times", victim, refused)
		again, out = rankProcess(t, addr, tr, victim, n, "rejoin")
		line, err := bufio.NewReader(out).ReadString('\n')
		if err == nil {
			require.Equal(t, "joined "+strconv.Itoa(n), strings.TrimSpace(line))
			break
		}
		err = again.Wait()
		var ee *exec.ExitError
		require.True(t, errors.As(err, &ee) && ee.ExitCode() == exitLive, "the process for rank %d: %v", victim, err)
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("refused %d times before the others removed the dead rank's entry", refused)

	live, _ := rankProcess(t, addr, tr, 1, n, "rejoin")
	err = live.Wait()
	var ee *exec.ExitError
	require.True(t, errors.As(err, &ee) && ee.ExitCode() == exitLive, "a process for live rank 1: %v, want exit %d (ErrRankLive)", err, exitLive)

	require.NoError(t, again.Wait(), "the process that took rank %d over", victim)
	for r, s := range survivors {
		require.NoError(t, s.Wait(), "rank %d", r)
	}
	assert.Eventually(t, func() bool { return len(jobKeys(t, ep, "restart")) == 0 }, 2*DefaultTTL, 100*time.Millisecond,
		"what the job left in etcd")
}
