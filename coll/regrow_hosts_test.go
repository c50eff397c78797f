package coll

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport/bootstrap"
)

// TestHelperRegistry serves a job's registry at MOEX_REGISTRY_HELPER until its stdin
// closes: the launcher's part in TestMultiProcessRegrowTwoHosts.
func TestHelperRegistry(t *testing.T) {
	addr := os.Getenv("MOEX_REGISTRY_HELPER")
	if addr == "" {
		t.Skip("helper process: runs only under TestMultiProcessRegrowTwoHosts")
	}
	srv, err := bootstrap.ServeStore(addr, []byte(os.Getenv("MOEX_JOB_TOKEN")), nil)
	require.NoError(t, err)
	fmt.Println("serving", srv.Addr())
	_, _ = io.Copy(io.Discard, os.Stdin)
	require.NoError(t, srv.Close())
}

// netns runs ip with args, failing the test on error.
func netns(t *testing.T, args ...string) {
	t.Helper()
	out, err := exec.Command("ip", args...).CombinedOutput()
	require.NoError(t, err, "ip %s: %s", strings.Join(args, " "), out)
}

// Two hosts made of network namespaces joined by a veth, two ranks of a 4-rank job in
// each, over tcp: rank 2 (host B) is killed mid-serving, the survivors shrink and serve,
// a new process takes rank 2 over on host B through the job's registry (on host A), and
// every rank, the new one included, ends 50 checked steps on the grown communicator.
func TestMultiProcessRegrowTwoHosts(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to make network namespaces (ip netns); not root here")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skipf("needs ip (iproute2) to make network namespaces: %v", err)
	}
	id := os.Getpid() % 200
	nsA, nsB := fmt.Sprintf("mxgrowA%d", id), fmt.Sprintf("mxgrowB%d", id)
	ipA, ipB := fmt.Sprintf("10.78.%d.1", id), fmt.Sprintf("10.78.%d.2", id)
	t.Cleanup(func() {
		_ = exec.Command("ip", "netns", "del", nsA).Run()
		_ = exec.Command("ip", "netns", "del", nsB).Run()
	})
	netns(t, "netns", "add", nsA)
	netns(t, "netns", "add", nsB)
	netns(t, "link", "add", "v"+nsA, "type", "veth", "peer", "name", "v"+nsB)
	for _, h := range []struct{ ns, ip string }{{nsA, ipA}, {nsB, ipB}} {
		netns(t, "link", "set", "v"+h.ns, "netns", h.ns)
		netns(t, "-n", h.ns, "addr", "add", h.ip+"/24", "dev", "v"+h.ns)
		netns(t, "-n", h.ns, "link", "set", "lo", "up")
		netns(t, "-n", h.ns, "link", "set", "v"+h.ns, "up")
	}
	var tok [16]byte
	_, _ = rand.Read(tok[:])
	token := hex.EncodeToString(tok[:])
	port := 31000 + id*10
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()

	// The registry, on host A, as moex run --restarts would serve it.
	reg := exec.CommandContext(ctx, "ip", "netns", "exec", nsA, os.Args[0], "-test.run=^TestHelperRegistry$")
	reg.Env = append(os.Environ(), fmt.Sprintf("MOEX_REGISTRY_HELPER=%s:%d", ipA, port+1), "MOEX_JOB_TOKEN="+token)
	stdin, err := reg.StdinPipe()
	require.NoError(t, err)
	stdout, err := reg.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, reg.Start())
	defer func() {
		stdin.Close()
		_ = reg.Wait()
	}()
	sc := bufio.NewScanner(stdout)
	require.True(t, sc.Scan(), "the registry did not start")
	require.Contains(t, sc.Text(), "serving")
	go func() { _, _ = io.Copy(io.Discard, stdout) }()

	const n, victim = 4, 2
	start := func(r int, joining bool) (*exec.Cmd, *bytes.Buffer) {
		ns, ip := nsA, ipA
		if r >= n/2 {
			ns, ip = nsB, ipB
		}
		cmd := exec.CommandContext(ctx, "ip", "netns", "exec", ns, os.Args[0], "-test.run=^TestHelperCollRank$")
		cmd.Env = append(os.Environ(), "MOEX_COLL_HELPER=regrow", fmt.Sprintf("MOEX_REGROW_VICTIM=%d", victim),
			fmt.Sprintf("MOEX_RANK=%d", r), fmt.Sprintf("MOEX_WORLD_SIZE=%d", n), fmt.Sprintf("MOEX_ADDR=%s:%d", ipA, port),
			fmt.Sprintf("MOEX_REGISTRY=%s:%d", ipA, port+1), "MOEX_JOB_TOKEN="+token, "MOEX_BIND="+ip, "MOEX_HOST_ID=host-"+ns,
			"MOEX_TRANSPORT=tcp", "MOEX_TIMEOUT=60s")
		if joining {
			cmd.Env = append(cmd.Env, "MOEX_JOINING=1")
		}
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		require.NoError(t, cmd.Start())
		return cmd, &out
	}
	var wg sync.WaitGroup
	outs := make([]*bytes.Buffer, n+1)
	errs := make([]error, n+1)
	for r := 0; r < n; r++ {
		cmd, out := start(r, false)
		outs[r] = out
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = cmd.Wait()
			if r == victim && errs[r] != nil { // as moex run --restarts: a new process for the rank
				cmd, out := start(r, true)
				outs[n] = out
				errs[n] = cmd.Wait()
			}
		}()
	}
	wg.Wait()
	for r := 0; r < n; r++ {
		if r == victim {
			require.Error(t, errs[r], "the victim was killed")
			continue
		}
		require.NoError(t, errs[r], "rank %d:\n%s", r, outs[r])
		require.Contains(t, outs[r].String(), fmt.Sprintf("rank %d ok transport=tcp", r))
	}
	require.NotNil(t, outs[n], "no new process was started")
	require.NoError(t, errs[n], "the new process:\n%s", outs[n])
	require.Contains(t, outs[n].String(), fmt.Sprintf("rank %d joined, %d ranks", victim, n))
	require.Contains(t, outs[n].String(), fmt.Sprintf("rank %d ok transport=tcp", victim))
}
