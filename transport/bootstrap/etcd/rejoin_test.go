package etcd

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/bench"
	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/transport/shm"
)

func TestMain(m *testing.M) {
	if mode := os.Getenv("MOEX_ETCD_HELPER"); mode != "" {
		os.Exit(helper(mode))
	}
	code := m.Run()
	if built.path != "" {
		os.RemoveAll(filepath.Dir(built.path))
	}
	os.Exit(code)
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
	if mode == "agent" { // under moex run --rdzv: the victim kills itself; the agent starts it again
		switch {
		case c.ParentRanks() != nil:
			mode = "rejoin"
		case strconv.Itoa(c.Rank()) == os.Getenv("MOEX_VICTIM"):
			if err := steps(c, 20); err != nil {
				return fail(err)
			}
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		default:
			mode = "survive"
		}
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

// job is how a test's ranks run: over transport ("" leaves MOEX_TRANSPORT unset), each on
// the host hosts names (MOEX_HOST_ID: this machine plays several; nil: one host).
type job struct {
	addr, transport string
	n               int
	hosts           func(rank int) string
}

// rankProcess starts this test binary as rank r of the job; its standard output comes on
// the reader.
func rankProcess(t *testing.T, j job, r int, mode string) (*exec.Cmd, io.Reader) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "MOEX_ETCD_HELPER="+mode, "MOEX_RANK="+strconv.Itoa(r), "MOEX_WORLD_SIZE="+strconv.Itoa(j.n),
		"MOEX_ADDR="+j.addr, "MOEX_JOB_TOKEN="+secret, "MOEX_TIMEOUT=20s")
	if j.transport != "" {
		cmd.Env = append(cmd.Env, "MOEX_TRANSPORT="+j.transport)
	}
	if j.hosts != nil {
		cmd.Env = append(cmd.Env, "MOEX_HOST_ID="+j.hosts(r))
	}
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd, out
}

// A job of processes meets in etcd. SIGKILL rank 2: the others shrink and serve on; the
// same command started again, with nothing added, finds the running job in etcd and
// takes rank 2 over (it is refused while the others have not yet removed the dead rank's
// entry, and started again, as a restarting launcher does); every rank serves 100 steps.
// Meanwhile a process started for live rank 1 is refused at once (ErrRankLive). Three
// ranks over tcp, and with the transport left to moex (shared memory: one host); four
// on two hosts (ranks 0 and 1 on one, 2 and 3 on the other: shared memory within, tcp
// across), where the new process is reached over tcp by every rank, rank 3 (its host's)
// included.
func TestRestartedProcessRejoins(t *testing.T) {
	for _, c := range []struct {
		name      string
		transport string
		n         int
		hosts     func(int) string
	}{
		{"tcp", "tcp", 3, nil},
		{"auto", "", 3, nil},
		{"two-hosts", "", 4, func(r int) string { return "etcd-test-host-" + strconv.Itoa(r/2) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			ep := startEtcd(t)
			restartedRejoins(t, ep, job{addr: "etcd://" + ep + "/restart", transport: c.transport, n: c.n, hosts: c.hosts})
		})
	}
}

func restartedRejoins(t *testing.T, ep string, j job) {
	const victim = 2
	var survivors []*exec.Cmd
	for r := range j.n {
		if r != victim {
			s, _ := rankProcess(t, j, r, "survive")
			survivors = append(survivors, s)
		}
	}
	victimProc, vout := rankProcess(t, j, victim, "serve")
	_, err := bufio.NewReader(vout).ReadString('\n') // the job runs
	require.NoError(t, err)
	time.Sleep(200 * time.Millisecond)
	require.NoError(t, victimProc.Process.Kill())

	var again *exec.Cmd
	var out io.Reader
	refused := 0
	for deadline := time.Now().Add(30 * time.Second); ; refused++ {
		require.True(t, time.Now().Before(deadline), "rank %d was refused %d times", victim, refused)
		again, out = rankProcess(t, j, victim, "rejoin")
		line, err := bufio.NewReader(out).ReadString('\n')
		if err == nil {
			require.Equal(t, "joined "+strconv.Itoa(j.n), strings.TrimSpace(line))
			break
		}
		err = again.Wait()
		var ee *exec.ExitError
		require.True(t, errors.As(err, &ee) && ee.ExitCode() == exitLive, "the process for rank %d: %v", victim, err)
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("refused %d times before the others removed the dead rank's entry", refused)

	live, _ := rankProcess(t, j, 1, "rejoin")
	err = live.Wait()
	var ee *exec.ExitError
	require.True(t, errors.As(err, &ee) && ee.ExitCode() == exitLive, "a process for live rank 1: %v, want exit %d (ErrRankLive)", err, exitLive)

	require.NoError(t, again.Wait(), "the process that took rank %d over", victim)
	for i, s := range survivors {
		require.NoError(t, s.Wait(), "survivor %d", i)
	}
	assert.Eventually(t, func() bool { return len(jobKeys(t, ep, "restart")) == 0 }, 2*DefaultTTL, 100*time.Millisecond,
		"what the job left in etcd")
}

// Two moex run agents, as torchrun's, one per node (--nnodes 2, two ranks each), meet
// in a real etcd: rank 3 (node 1) kills itself after 20 steps; its agent starts it again
// with the environment it had (--restarts), it takes rank 3 over through etcd, and every
// rank serves 100 steps on four: both agents end well.
func TestAgentsRestartThroughEtcd(t *testing.T) {
	ep := startEtcd(t)
	moex := buildMoex(t)
	var outs [2]bytes.Buffer
	errs := onRanks(2, func(node int) error {
		cmd := exec.Command(moex, "run", "-n", "2", "--nnodes", "2", "--node-rank", strconv.Itoa(node), "--rdzv", "etcd://"+ep+"/agents",
			"--restarts", "1", "--grace", "1s", "--", os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "MOEX_ETCD_HELPER=agent", "MOEX_VICTIM=3", "MOEX_JOB_TOKEN="+secret, "MOEX_TIMEOUT=20s",
			"MOEX_HOST_ID=etcd-agent-node-"+strconv.Itoa(node))
		cmd.Stdout, cmd.Stderr = &outs[node], &outs[node]
		return cmd.Run()
	})
	for node, err := range errs {
		require.NoError(t, err, "node %d:\n%s", node, outs[node].String())
	}
	assert.Contains(t, outs[1].String(), "starting a process to take it over (restart 1 of 1)")
	assert.Contains(t, outs[1].String(), "[3] joined 4")
	assert.Eventually(t, func() bool { return len(jobKeys(t, ep, "agents")) == 0 }, 2*DefaultTTL, 100*time.Millisecond)
}

// ipNetns runs ip with args, failing the test on error.
func ipNetns(t *testing.T, args ...string) {
	t.Helper()
	out, err := exec.Command("ip", args...).CombinedOutput()
	require.NoError(t, err, "ip %s: %s", strings.Join(args, " "), out)
}

// Two hosts made of network namespaces joined by a veth, etcd on host A, a moex run
// agent on each (--nnodes 2, two ranks each: shared memory within a host, tcp across),
// serving MoE steps (moex bench moe's self-healing loop: dispatch and combine, every
// token checked against the reference). SIGKILL rank 2 on host B, then rank 0 on host
// A: each agent starts its rank again with the environment it had, the new process
// rejoins through etcd, and every rank serves on to the end: no wrong token, no failed
// process, each new process at least 100 steps, both agents end well, and no process's
// shared memory is left behind.
func TestTwoHostsServeThroughEtcd(t *testing.T) {
	h := twoHosts(t, "mxetcd")
	pids := t.TempDir()
	until := time.Now().Add(30 * time.Second)
	kill := func(r int, at time.Duration) {
		time.Sleep(time.Until(until.Add(-30*time.Second + at)))
		b, err := os.ReadFile(filepath.Join(pids, "rank"+strconv.Itoa(r)+".pid"))
		require.NoError(t, err, "rank %d's pid", r)
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		require.NoError(t, err)
		require.NoError(t, syscall.Kill(pid, syscall.SIGKILL), "rank %d", r)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		kill(2, 8*time.Second)
		kill(0, 16*time.Second)
	}()
	errs, outs := agents(t, h, until, pids, [2][]string{{"--restarts", "2"}, {"--restarts", "2"}})
	<-done
	for node, err := range errs {
		require.NoError(t, err, "node %d:\n%s", node, outs[node].String())
	}
	reports := append(reportsOf(t, outs[0].String()), reportsOf(t, outs[1].String())...)
	joined := map[int]bool{}
	for _, r := range reports {
		assert.Zero(t, r.WrongTokens, "rank %d", r.Rank)
		assert.Empty(t, r.Error, "rank %d", r.Rank)
		if r.Joined {
			joined[r.Rank] = true
			assert.GreaterOrEqual(t, r.Steps, 100, "rank %d, rejoined", r.Rank)
		}
	}
	assert.Equal(t, map[int]bool{0: true, 2: true}, joined, "the ranks that rejoined:\n%s\n%s", outs[0].String(), outs[1].String())
	assert.Len(t, reports, 4, "a report from every rank's last process")
	assert.Empty(t, shm.StaleSegments(), "shared memory in /dev/shm of processes gone")
}

// hosts is two hosts made of network namespaces joined by a veth, with etcd on host A at
// ipA:port.
type hosts struct {
	nsA, nsB, ipA, ipB string
	port               int
}

// twoHosts makes them (names from prefix), deleted when the test ends; it skips the test,
// saying why, where it cannot (not root, no ip, no etcd).
func twoHosts(t *testing.T, prefix string) hosts {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to make network namespaces (ip netns); not root here")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skipf("needs ip (iproute2) to make network namespaces: %v", err)
	}
	etcdBin, err := exec.LookPath("etcd")
	if err != nil {
		t.Skip("etcd is not installed (apt-get install etcd-server; .ci/run does)")
	}
	id := os.Getpid() % 200
	net := 79
	if prefix != "mxetcd" {
		net = 80
	}
	h := hosts{nsA: fmt.Sprintf("%sA%d", prefix, id), nsB: fmt.Sprintf("%sB%d", prefix, id),
		ipA: fmt.Sprintf("10.%d.%d.1", net, id), ipB: fmt.Sprintf("10.%d.%d.2", net, id), port: 32000 + id*10 + (net-79)*5}
	t.Cleanup(func() {
		_ = exec.Command("ip", "netns", "del", h.nsA).Run()
		_ = exec.Command("ip", "netns", "del", h.nsB).Run()
	})
	ipNetns(t, "netns", "add", h.nsA)
	ipNetns(t, "netns", "add", h.nsB)
	ipNetns(t, "link", "add", "v"+h.nsA, "type", "veth", "peer", "name", "v"+h.nsB)
	for _, x := range []struct{ ns, ip string }{{h.nsA, h.ipA}, {h.nsB, h.ipB}} {
		ipNetns(t, "link", "set", "v"+x.ns, "netns", x.ns)
		ipNetns(t, "-n", x.ns, "addr", "add", x.ip+"/24", "dev", "v"+x.ns)
		ipNetns(t, "-n", x.ns, "link", "set", "lo", "up")
		ipNetns(t, "-n", x.ns, "link", "set", "v"+x.ns, "up")
	}
	curl, purl := fmt.Sprintf("http://%s:%d", h.ipA, h.port), fmt.Sprintf("http://%s:%d", h.ipA, h.port+1)
	etcd := exec.Command("ip", "netns", "exec", h.nsA, etcdBin, "--name", "a", "--data-dir", filepath.Join(t.TempDir(), "etcd"),
		"--listen-client-urls", curl, "--advertise-client-urls", curl, "--listen-peer-urls", purl,
		"--initial-advertise-peer-urls", purl, "--initial-cluster", "a="+purl)
	require.NoError(t, etcd.Start())
	t.Cleanup(func() { _ = etcd.Process.Kill(); _ = etcd.Wait() })
	return h
}

// agents runs a moex run agent per host (--nnodes 2, two ranks each) of moex bench moe's
// self-healing loop until until, with args added to moex run's and env to the ranks';
// it returns each agent's error and output.
func agents(t *testing.T, h hosts, until time.Time, pids string, args [2][]string, env ...string) ([]error, [2]*bytes.Buffer) {
	t.Helper()
	moex := buildMoex(t)
	outs := [2]*bytes.Buffer{{}, {}}
	errs := onRanks(2, func(node int) error {
		ns, ip := h.nsA, h.ipA
		if node == 1 {
			ns, ip = h.nsB, h.ipB
		}
		run := append([]string{"netns", "exec", ns, moex, "run", "-n", "2", "--nnodes", "2", "--node-rank", strconv.Itoa(node),
			"--rdzv", fmt.Sprintf("etcd://%s:%d/twohosts", h.ipA, h.port), "--grace", "1s"}, args[node]...)
		run = append(run, "--", moex, "bench", "moe", "--model", "tiny-qwen", "--ranks", "4", "--transport", "tcp", "--tokens", "8", "--chaos", "30s")
		cmd := exec.Command("ip", run...)
		cmd.Env = append(os.Environ(), "MOEX_BENCH_WORKER=1", "MOEX_CHAOS_DIR="+pids, "MOEX_CHAOS_UNTIL="+strconv.FormatInt(until.UnixNano(), 10),
			"MOEX_JOB_TOKEN="+secret, "MOEX_TIMEOUT=20s", "MOEX_BIND="+ip, "MOEX_HOST_ID=host-"+ns)
		cmd.Env = append(cmd.Env, env...)
		cmd.Stdout, cmd.Stderr = outs[node], outs[node]
		return cmd.Run()
	})
	return errs, outs
}

// reportsOf reads the ranks' reports in an agent's output.
func reportsOf(t *testing.T, out string) []*bench.ServeReport {
	t.Helper()
	var reports []*bench.ServeReport
	for _, line := range strings.Split(out, "\n") {
		if _, js, ok := strings.Cut(line, "] {"); ok {
			r := &bench.ServeReport{}
			require.NoError(t, json.Unmarshal([]byte("{"+js), r), line)
			reports = append(reports, r)
		}
	}
	return reports
}

// Two hosts (network namespaces, etcd on host A), a moex run agent on each serving MoE
// steps, every token checked; host B's link goes down mid-serving. The ranks on both
// sides find their peers across dead within seconds (MOEX_TCP_DEAD) and shrink: host
// A's, which reach etcd, serve on to the end (no wrong token, no error); host B's, two of
// four that cannot reach etcd, stop with a PeerError matching coll.ErrCutOff rather than
// serve beside them. Nothing hangs.
func TestHostCutOff(t *testing.T) {
	h := twoHosts(t, "mxcut")
	pids := t.TempDir()
	until := time.Now().Add(30 * time.Second)
	go func() {
		time.Sleep(10 * time.Second)
		_ = exec.Command("ip", "-n", h.nsB, "link", "set", "v"+h.nsB, "down").Run()
	}()
	errs, outs := agents(t, h, until, pids, [2][]string{nil, {"--keep-going"}}, "MOEX_TCP_DEAD=3s")
	require.NoError(t, errs[0], "host A:\n%s", outs[0].String())
	require.Error(t, errs[1], "host B's ranks stop:\n%s", outs[1].String())
	a, b := reportsOf(t, outs[0].String()), reportsOf(t, outs[1].String())
	require.Len(t, a, 2, outs[0].String())
	for _, r := range a {
		assert.Empty(t, r.Error, "rank %d", r.Rank)
		assert.Zero(t, r.WrongTokens, "rank %d", r.Rank)
		assert.Equal(t, 1, r.Shrinks, "rank %d", r.Rank)
	}
	require.Len(t, b, 2, outs[1].String())
	for _, r := range b {
		assert.True(t, r.CutOff, "rank %d: %s", r.Rank, r.Error)
		assert.Zero(t, r.WrongTokens, "rank %d", r.Rank)
	}
}

var built struct {
	sync.Once
	path string
	err  error
	out  []byte
}

// buildMoex builds the moex command once for the package's tests.
func buildMoex(t *testing.T) string {
	t.Helper()
	built.Do(func() {
		dir, err := os.MkdirTemp("", "etcd-test-moex")
		if err != nil {
			built.err = err
			return
		}
		built.path = filepath.Join(dir, "moex")
		built.out, built.err = exec.Command("go", "build", "-o", built.path, "../../../cmd/moex").CombinedOutput()
	})
	require.NoError(t, built.err, "build: %s", built.out)
	return built.path
}

// moex bench moe --kill 1 --rejoin --rdzv: the ranks meet in etcd and the launcher starts
// the dead rank's process again with its own environment, which takes the rank over
// through etcd: the timeline comes back whole, the new process started, joined, admitted,
// and serving on three ranks again.
func TestBenchRejoinThroughEtcd(t *testing.T) {
	ep := startEtcd(t)
	var o, e bytes.Buffer
	cmd := exec.Command(buildMoex(t), "bench", "moe", "--model", "tiny-qwen", "--ranks", "3", "--transport", "tcp", "--tokens", "8",
		"--kill", "1", "--rejoin", "--json", "--rdzv", "etcd://"+ep+"/bench")
	cmd.Stdout, cmd.Stderr = &o, &e
	require.NoError(t, cmd.Run(), "stdout:\n%s\nstderr:\n%s", o.String(), e.String())
	var s bench.RecoverSummary
	require.NoError(t, json.Unmarshal(o.Bytes(), &s), o.String())
	require.Len(t, s.Runs, 1)
	tl := s.Runs[0].Rejoin
	require.NotNil(t, tl)
	assert.True(t, tl.StartedMS > 0 && tl.StartedMS <= tl.JoinedMS && tl.AdmittedMS <= tl.GrownMS && tl.GrownMS <= tl.ServingMS, "%+v", tl)
}
