package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/transport/bootstrap"
)

// Every rank's links reach rank 0, each with its transport and path; rank 0's own links
// carry a measured round trip and bandwidth.
func TestDiagnoseGathersEveryLink(t *testing.T) {
	cs, err := coll.Local(3, coll.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer closeAll(cs)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	reps, err := onEvery(cs, func(c *coll.Comm) (*doctorReport, error) { return diagnose(ctx, c) })
	if err != nil {
		t.Fatal(err)
	}
	rep := reps[0]
	if len(rep.links) != 6 {
		t.Fatalf("%d links, want 6: %+v", len(rep.links), rep.links)
	}
	seen := map[[2]int]bool{}
	for _, l := range rep.links {
		seen[[2]int{l.from, l.to}] = true
		if l.transport != "inproc" || !strings.HasPrefix(l.path, "inproc") || l.why == "" {
			t.Fatalf("link %+v", l)
		}
		if (l.from == 0) != (l.rttUS > 0 && l.gbs > 0) {
			t.Fatalf("measurement on the wrong links: %+v", l)
		}
	}
	if len(seen) != 6 {
		t.Fatalf("duplicate links: %v", seen)
	}
	var out bytes.Buffer
	rep.print(&out, 3, bootstrap.Env{Launcher: "none"})
	for _, want := range []string{"cpus", "cpu idle", "shared buffers  obuf.Shared works", "RDMA devices", "UCX", "links", "why", "collectives", "hosts      1 (ranks per host: 3)", "allreduce  8 B "} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("report lacks %q:\n%s", want, out.String())
		}
	}
}

// Ranks on two hosts, alternating: the doctor says so and shows the hierarchical
// AllReduce the model picks for large buffers.
func TestDoctorCollectivesTwoHosts(t *testing.T) {
	cs, err := coll.Local(4, coll.Config{Hosts: []int{0, 1, 0, 1}, Link: &coll.CostNet, HostLink: &coll.CostShm})
	if err != nil {
		t.Fatal(err)
	}
	defer closeAll(cs)
	var rep doctorReport
	rep.collectives(cs[0])
	var out bytes.Buffer
	rep.print(&out, 4, bootstrap.Env{Launcher: "none"})
	for _, want := range []string{"hosts      2 (ranks per host: 2, 2)", "64 MiB hier (buffer)"} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("report lacks %q:\n%s", want, out.String())
		}
	}
}

// `moex doctor` as a user runs it: it starts the ranks, and with MOEX_TRANSPORT=tcp on
// one host it says that shared memory would be faster.
func TestDoctorCommand(t *testing.T) {
	exe := moexBinary(t)
	out, err := exec.Command(exe, "doctor", "--ranks", "2", "--transport", "tcp").CombinedOutput()
	if err != nil {
		t.Fatalf("moex doctor: %v\n%s", err, out)
	}
	s := string(out)
	for _, want := range []string{"launcher moex, MOEX_TRANSPORT=tcp", "  0     1   0     tcp", "tcp: MOEX_TRANSPORT=tcp", "ranks on one host talk over tcp"} {
		if !strings.Contains(s, want) {
			t.Fatalf("output lacks %q:\n%s", want, s)
		}
	}

	// Two tcp ranks share the host's CPUs: with a P per CPU the doctor says to set
	// GOMAXPROCS to each rank's share; with it set so, it does not.
	share := max(1, runtime.NumCPU()/2)
	warning := fmt.Sprintf("set GOMAXPROCS=%d, each rank's share", share)
	if runtime.NumCPU() > share {
		cmd := exec.Command(exe, "doctor", "--ranks", "2", "--transport", "tcp")
		cmd.Env = append(os.Environ(), fmt.Sprintf("GOMAXPROCS=%d", runtime.NumCPU()))
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s", out)
		require.Contains(t, string(out), warning)
	} else {
		t.Logf("one CPU: GOMAXPROCS is already each rank's share, no warning to look for")
	}
	cmd := exec.Command(exe, "doctor", "--ranks", "2", "--transport", "tcp")
	cmd.Env = append(os.Environ(), fmt.Sprintf("GOMAXPROCS=%d", share))
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.NotContains(t, string(out), "set GOMAXPROCS")

	// Left to the launcher (MOEX_GOMAXPROCS=auto), the ranks run at their share.
	cmd = exec.Command(exe, "doctor", "--ranks", "2", "--transport", "tcp")
	cmd.Env = append(os.Environ(), "GOMAXPROCS=", "MOEX_GOMAXPROCS=")
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.NotContains(t, string(out), "set GOMAXPROCS")
	require.Contains(t, string(out), fmt.Sprintf("(GOMAXPROCS %d)", min(runtime.GOMAXPROCS(0), share)))
}

// doctor says what is true of ptrace under each of Yama's scopes: open, granted by
// every rank at 1, and at 2 and 3 the paths that lose the single copy and the setting
// that brings it back.
func TestDoctorPtraceFact(t *testing.T) {
	seen := map[string]bool{}
	for _, scope := range []string{"", "0", "1", "2", "3"} {
		f := ptraceFact(scope)
		assert.NotEmpty(t, f)
		assert.False(t, seen[f], "scope %q says what another scope says", scope)
		seen[f] = true
	}
	assert.Contains(t, ptraceFact("1"), "PR_SET_PTRACER_ANY")
	assert.Contains(t, ptraceFact("2"), "kernel.yama.ptrace_scope=1")
}
