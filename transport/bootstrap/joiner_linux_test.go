package bootstrap

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/busypoll"
)

// A process that takes over a rank waits as the rank that started did: oversubscribed
// where its host's ranks (as the launcher says, or every rank of the job where it does
// not) outnumber the CPUs, as Open decides for a starting rank.
func TestJoinerPolicyAsStartingRanks(t *testing.T) {
	t.Setenv("MOEX_CPU_BIND", "none")
	t.Setenv("MOEX_GOMAXPROCS", "keep")
	cpus := runtime.NumCPU()
	for _, tc := range []struct {
		name                   string
		size, local, localRank int
	}{
		{"the launcher's count, more ranks than CPUs", 2 * cpus, cpus + 1, 1},
		{"the launcher's count, one rank", 2 * cpus, 1, 0},
		{"no count: every rank on this host", cpus + 1, -1, -1},
		{"no count, few ranks", 1, -1, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := Env{Rank: tc.size - 1, Size: tc.size, LocalSize: tc.local, LocalRank: tc.localRank}
			got, err := JoinerPolicy(env, busypoll.Config{}, nil)
			require.NoError(t, err)
			localSize := tc.local
			if localSize < 1 {
				localSize = tc.size
			}
			start, _, err := hostPolicy(env, 0, localSize, busypoll.Config{}, nil)
			require.NoError(t, err)
			assert.Equal(t, busypoll.Oversubscribed(localSize), got.Oversubscribed)
			assert.Equal(t, start, got, "a joiner's policy against a starting rank's on the same host")
		})
	}
	_, err := JoinerPolicy(Env{Rank: 0, Size: 2, LocalSize: 2}, busypoll.Config{}, nil)
	require.NoError(t, err)
	t.Setenv("MOEX_GOMAXPROCS", "bad")
	var ae *ArgError
	_, err = JoinerPolicy(Env{Rank: 0, Size: 2, LocalSize: 2}, busypoll.Config{}, nil)
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, "MOEX_GOMAXPROCS", ae.Arg)
}

// With MOEX_CPU_BIND=core a joiner binds to a core of its own, as a starting rank does
// (in a child process, whose threads the binding changes).
func TestJoinerBinds(t *testing.T) {
	if os.Getenv("MOEX_JOINER_BIND_HELPER") == "1" {
		_, err := JoinerPolicy(Env{Rank: 1, Size: 2, LocalSize: 2, LocalRank: 1}, busypoll.Config{}, nil)
		var set unix.CPUSet
		_ = unix.SchedGetaffinity(0, &set)
		fmt.Printf("result err=%v mask=%d\n", err, set.Count())
		return
	}
	if runtime.NumCPU() < 2 {
		t.Skip("one CPU: moex binds ranks to cores only where each has one")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestJoinerBinds$", "-test.count=1")
	cmd.Env = append(os.Environ(), "MOEX_JOINER_BIND_HELPER=1", "MOEX_CPU_BIND=core", "MOEX_GOMAXPROCS=keep")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	assert.Contains(t, string(out), "result err=<nil> mask=1", "the joiner's CPU mask: %s", strings.TrimSpace(string(out)))
}
