package coll

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/internal/race"
	"github.com/moex-ai/moex/transport/bootstrap"
)

// helperLauncher: one AllReduce of the ranks' numbers, checked, and a line that says
// which launcher's variables the rank read.
func helperLauncher(ctx context.Context, c *Comm) error {
	x := []int64{int64(c.Rank())}
	if err := AllReduce(ctx, c, nil, x, dtype.Sum); err != nil {
		return err
	}
	p := int64(c.Size())
	if x[0] != p*(p-1)/2 {
		return fmt.Errorf("allreduce gave %d, want %d", x[0], p*(p-1)/2)
	}
	env, _ := bootstrap.FromEnv()
	fmt.Printf("launched rank %d of %d by %s: allreduce ok\n", c.Rank(), c.Size(), env.Launcher)
	return nil
}

// launcherEnv is this process's environment without moex's and the launchers' job
// variables: what a user's shell would hand the launcher.
func launcherEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch {
		case strings.HasPrefix(k, "MOEX_"), strings.HasPrefix(k, "OMPI_"), strings.HasPrefix(k, "PMIX_"),
			k == "RANK", k == "WORLD_SIZE", k == "MASTER_ADDR", k == "MASTER_PORT", k == "LOCAL_RANK":
			continue
		}
		env = append(env, kv)
	}
	return append(env, extra...)
}

// A moex program under real torchrun (Debian's python3-torch): the standalone form, and
// the static form whose agent serves its own store on --master_port (moex takes the next
// port), with 2 and 4 ranks.
func TestUnderTorchrun(t *testing.T) {
	if race.Enabled {
		t.Skip("not under -race: torchrun's Python takes seconds per job; .ci/run runs this test without -race")
	}
	torchrun, err := exec.LookPath("torchrun")
	if err != nil {
		t.Skip("torchrun not found (Debian: apt-get install python3-torch; .ci/run installs it)")
	}
	for _, n := range []int{2, 4} {
		for _, form := range []string{"standalone", "static"} {
			t.Run(fmt.Sprintf("%s/%d", form, n), func(t *testing.T) {
				t.Parallel() // most of a job is Python importing torch: two at once on two CPUs
				args := []string{"--nnodes", "1", "--nproc_per_node", fmt.Sprint(n)}
				if form == "standalone" {
					args = []string{"--standalone", "--nproc_per_node", fmt.Sprint(n)}
				} else {
					args = append(args, "--master_addr", "127.0.0.1", "--master_port", fmt.Sprint(freePortPair(t)))
				}
				// -r 1 -t 1: torch 1.13's agent crashes on Python 3.11 without them.
				args = append(args, "-r", "1", "-t", "1", "--no_python", os.Args[0], "-test.run=^TestHelperCollRank$")
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				defer cancel()
				cmd := exec.CommandContext(ctx, torchrun, args...)
				cmd.Env = launcherEnv("MOEX_COLL_HELPER=launcher", "MOEX_JOB_TOKEN=torchrun-test", "MOEX_TRANSPORT=tcp")
				out, err := cmd.CombinedOutput()
				require.NoError(t, err, "%s", out)
				assert.Equal(t, n, strings.Count(string(out), "by torchrun: allreduce ok"), "%s", out)
			})
		}
	}
}

// A moex program under mpirun with no address and no secret: on one host the ranks
// rendezvous through a file in mpirun's private session directory.
func TestUnderMpirun(t *testing.T) {
	mpirun, err := exec.LookPath("mpirun")
	if err != nil {
		t.Skip("mpirun not found (Debian: apt-get install openmpi-bin; .ci/run installs it)")
	}
	for _, n := range []int{2, 4} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, mpirun, "--allow-run-as-root", "--oversubscribe", "-np", fmt.Sprint(n),
				os.Args[0], "-test.run=^TestHelperCollRank$")
			cmd.Env = launcherEnv("MOEX_COLL_HELPER=launcher")
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "%s", out)
			assert.Equal(t, n, strings.Count(string(out), "by openmpi: allreduce ok"), "%s", out)
		})
	}
}

// freePortPair returns a loopback port that is free, and whose next port is free too, as
// torchrun's static form needs (its agent's store takes the port, moex's the next one).
func freePortPair(t *testing.T) int {
	t.Helper()
	for try := 0; try < 50; try++ {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		port := ln.Addr().(*net.TCPAddr).Port
		next, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port+1))
		ln.Close()
		if err == nil {
			next.Close()
			return port
		}
	}
	require.FailNow(t, "no two free loopback ports in a row in 50 tries")
	return 0
}
