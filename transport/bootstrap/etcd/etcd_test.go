package etcd

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/bootstrap"
)

const secret = "etcd-test-secret"

// freePort is a loopback port that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// startEtcd runs a real etcd (Debian's etcd-server) on loopback for the test, and returns
// its client endpoint. Without the etcd binary the test is skipped, saying so (.ci/run
// installs it).
func startEtcd(t *testing.T) string {
	t.Helper()
	ep, _ := startStoppableEtcd(t)
	return ep
}

// startStoppableEtcd is startEtcd, with a function that kills etcd.
func startStoppableEtcd(t *testing.T) (string, func()) {
	t.Helper()
	bin, err := exec.LookPath("etcd")
	if err != nil {
		t.Skip("etcd is not installed (apt-get install etcd-server; .ci/run does): the etcd rendezvous is not tested here")
	}
	dir := t.TempDir()
	client, peer := freePort(t), freePort(t)
	ep := "127.0.0.1:" + strconv.Itoa(client)
	purl := "http://127.0.0.1:" + strconv.Itoa(peer)
	cmd := exec.Command(bin, "--name", "moex-test", "--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", "http://"+ep, "--advertise-client-urls", "http://"+ep,
		"--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl, "--initial-cluster", "moex-test="+purl)
	logf, err := os.Create(filepath.Join(dir, "etcd.log"))
	require.NoError(t, err)
	cmd.Stdout, cmd.Stderr = logf, logf
	require.NoError(t, cmd.Start())
	var once sync.Once
	stop := func() {
		once.Do(func() {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			logf.Close()
		})
	}
	t.Cleanup(stop)
	c, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 10 * time.Second, Logger: zap.NewNop()})
	require.NoError(t, err, "etcd did not start")
	defer c.Close()
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := c.Put(ctx, "/moex-test-up", "1")
		return err == nil
	}, 20*time.Second, 50*time.Millisecond, "etcd did not answer")
	return ep, stop
}

// jobKeys lists the keys etcd holds for job.
func jobKeys(t *testing.T, ep, job string) []string {
	t.Helper()
	c, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	require.NoError(t, err)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := c.Get(ctx, "/moex/"+job+"/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
	require.NoError(t, err)
	var keys []string
	for _, kv := range resp.Kvs {
		keys = append(keys, string(kv.Key))
	}
	return keys
}

func env(addr string, rank, size int) bootstrap.Env {
	return bootstrap.Env{Rank: rank, Size: size, LocalRank: -1, LocalSize: -1, Addr: addr, Registry: addr,
		Token: secret, Transport: "tcp", Timeout: 20 * time.Second}
}

// works runs an AllReduce on c and checks it.
func works(ctx context.Context, c *coll.Comm) error {
	x := []int64{int64(c.Rank() + 1)}
	if err := coll.AllReduce(ctx, c, nil, x, dtype.Sum); err != nil {
		return err
	}
	if p := int64(c.Size()); x[0] != p*(p+1)/2 {
		return fmt.Errorf("rank %d: AllReduce gave %d", c.Rank(), x[0])
	}
	return nil
}

// onRanks runs f for ranks 0..n-1 at once and returns their errors.
func onRanks(n int, f func(r int) error) []error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() { defer wg.Done(); errs[r] = f(r) }()
	}
	wg.Wait()
	return errs
}

// Four ranks meet in a real etcd, with nothing but its address and the job secret: every
// one gets a communicator whose AllReduce is right; once they close, nothing of the job is
// left in etcd (every entry was bound to a rank's lease).
func TestRendezvousInEtcd(t *testing.T) {
	ep := startEtcd(t)
	addr := "etcd://" + ep + "/meet"
	for r, err := range onRanks(4, func(r int) error {
		c, err := coll.InitEnv(context.Background(), env(addr, r, 4), coll.Config{Timeout: 20 * time.Second})
		if err != nil {
			return err
		}
		err = works(context.Background(), c)
		return errors.Join(err, c.Close())
	}) {
		require.NoError(t, err, "rank %d", r)
	}
	assert.Empty(t, jobKeys(t, ep, "meet"))
}

// etcd unreachable at start: Init fails at its deadline with a *StartupError that
// matches ErrTimeout (its text names the endpoint).
func TestEtcdUnreachable(t *testing.T) {
	addr := "etcd://127.0.0.1:" + strconv.Itoa(freePort(t)) + "/gone"
	start := time.Now()
	_, err := coll.InitEnv(context.Background(), env(addr, 0, 2), coll.Config{Timeout: 20 * time.Second, InitTimeout: 2 * time.Second})
	var se *bootstrap.StartupError
	require.ErrorAs(t, err, &se)
	require.ErrorIs(t, err, transport.ErrTimeout)
	assert.Less(t, time.Since(start), 15*time.Second, "past the start-up deadline")
}

func dial(t *testing.T, ep, job, token string, ttl time.Duration) (*KV, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := Dial(ctx, Config{Endpoints: []string{ep}, Job: job, TTL: ttl}, []byte(token))
	if err == nil {
		t.Cleanup(func() { kv.Close() })
	}
	return kv, err
}

// A process with another secret, under the name of a job whose ranks are there, is
// refused (ErrAuth); one with the job's secret is not.
func TestEtcdAnotherSecret(t *testing.T) {
	ep := startEtcd(t)
	_, err := dial(t, ep, "named", secret, DefaultTTL)
	require.NoError(t, err)
	_, err = dial(t, ep, "named", "another-secret", DefaultTTL)
	var se *bootstrap.StartupError
	require.ErrorAs(t, err, &se)
	require.ErrorIs(t, err, transport.ErrAuth)
	_, err = dial(t, ep, "named", secret, DefaultTTL)
	require.NoError(t, err)
}

// Two processes claim one rank of a starting job: the second fails with
// ErrDuplicateRank, and so does the first's wait for the others.
func TestEtcdDuplicateRank(t *testing.T) {
	ep := startEtcd(t)
	a, err := dial(t, ep, "dup", secret, DefaultTTL)
	require.NoError(t, err)
	b, err := dial(t, ep, "dup", secret, DefaultTTL)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, a.Claim(ctx, 0, 2, "first"))
	err = b.Claim(ctx, 0, 2, "second")
	var se *bootstrap.StartupError
	require.ErrorAs(t, err, &se)
	require.ErrorIs(t, err, bootstrap.ErrDuplicateRank)
	assert.Equal(t, 0, se.Rank)
	_, err = a.AllGather(ctx, "ag/1", 0, 2, []byte("x"))
	require.ErrorIs(t, err, bootstrap.ErrDuplicateRank)
}

// A rank that dies during start-up (its client gone without leaving: the lease expires)
// fails every waiting rank with a *StartupError naming it (a PeerError), within about
// the lease's TTL, not at the deadline.
func TestEtcdRankDiesDuringStartup(t *testing.T) {
	ep := startEtcd(t)
	a, err := dial(t, ep, "dies", secret, MinTTL)
	require.NoError(t, err)
	b, err := dial(t, ep, "dies", secret, MinTTL)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, a.Claim(ctx, 0, 3, "a"))
	require.NoError(t, b.Claim(ctx, 1, 3, "b"))
	require.NoError(t, b.Set(ctx, "stage/1", []byte(bootstrap.StageConnected)))
	b.crash()
	start := time.Now()
	_, err = a.AllGather(ctx, "ag/1", 0, 3, []byte("x"))
	var se *bootstrap.StartupError
	require.ErrorAs(t, err, &se)
	assert.Equal(t, 1, se.Rank)
	var pe *transport.PeerError
	require.ErrorAs(t, err, &pe)
	assert.Equal(t, 1, pe.Rank)
	assert.Less(t, time.Since(start), 20*time.Second)
	st, err := a.Status(ctx)
	require.NoError(t, err)
	assert.Equal(t, []string{"", "left at " + bootstrap.StageConnected, ""}, st)
}

// The address's forms: endpoints, default port, the job's name, the TTL; bad ones are
// an EnvError naming MOEX_ADDR.
func TestParseURL(t *testing.T) {
	u, err := bootstrap.ParseStoreURL("etcd://10.0.0.1:2379,10.0.0.2/job-1.a_b?ttl=3s")
	require.NoError(t, err)
	cfg, err := ParseURL(u)
	require.NoError(t, err)
	assert.Equal(t, Config{Endpoints: []string{"10.0.0.1:2379", "10.0.0.2:2379"}, Job: "job-1.a_b", TTL: 3 * time.Second}, cfg)
	for _, bad := range []string{"etcd://h:1/", "etcd://h:1/a/b", "etcd://h:1/j?ttl=1s", "etcd://h:1/j?ttl=x", "etcd://h:1/j?x=1", "etcd://h:1/j?ttl=1h"} {
		u, err := bootstrap.ParseStoreURL(bad)
		require.NoError(t, err, bad)
		_, err = ParseURL(u)
		var ee *transport.EnvError
		require.ErrorAs(t, err, &ee, bad)
		assert.Equal(t, "MOEX_ADDR", ee.Var)
	}
}

// With the driver imported, MOEX_ADDR=etcd://... is read, and is the registry too.
func TestEnvWithDriver(t *testing.T) {
	vars := map[string]string{"MOEX_RANK": "0", "MOEX_WORLD_SIZE": "2", "MOEX_ADDR": "etcd://127.0.0.1:2379/j", "MOEX_JOB_TOKEN": "s"}
	e, err := bootstrap.ParseEnv(func(k string) string { return vars[k] })
	require.NoError(t, err)
	assert.Equal(t, vars["MOEX_ADDR"], e.Addr)
	assert.Equal(t, vars["MOEX_ADDR"], e.Registry)
}

// etcd lost while the job serves: the ranks serve on (nothing of a step goes through
// it), Admit finds nobody, and a process started to take a rank over fails at its
// start-up deadline with a *StartupError (its text names etcd's address).
func TestEtcdLostWhileServing(t *testing.T) {
	ep, stop := startStoppableEtcd(t)
	addr := "etcd://" + ep + "/lost"
	cs := make([]*coll.Comm, 2)
	for r, err := range onRanks(2, func(r int) (err error) {
		cs[r], err = coll.InitEnv(context.Background(), env(addr, r, 2), coll.Config{Timeout: 10 * time.Second})
		return err
	}) {
		require.NoError(t, err, "rank %d", r)
	}
	stop()
	for r, err := range onRanks(2, func(r int) error {
		for range 50 {
			if err := works(context.Background(), cs[r]); err != nil {
				return err
			}
		}
		g, err := cs[r].Admit(context.Background())
		if g != nil {
			return fmt.Errorf("admitted %d ranks without etcd", g.Size())
		}
		return err
	}) {
		require.NoError(t, err, "rank %d serves on", r)
	}
	_, err := coll.InitEnv(context.Background(), env(addr, 1, 2), coll.Config{Timeout: 10 * time.Second, InitTimeout: 2 * time.Second})
	var se *bootstrap.StartupError
	require.ErrorAs(t, err, &se)
	require.ErrorIs(t, err, transport.ErrTimeout)
	for r, err := range onRanks(2, func(r int) error { return cs[r].Close() }) {
		assert.NoError(t, err, "rank %d closes (its lease expires: etcd is gone)", r)
	}
}

// A dead process of an earlier job of the same name left a start-up entry behind (its
// lease not yet expired; its claim removed, as the survivors' Shrink removes it): a new
// job's all-gather never takes it for the new process's, whose claim clears it.
func TestEtcdStaleEntryIgnored(t *testing.T) {
	ep := startEtcd(t)
	old, err := dial(t, ep, "stale", secret, DefaultTTL)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, old.Claim(ctx, 1, 2, "old"))
	require.NoError(t, old.Set(ctx, byRank(1)+"ag/1", []byte("old")))
	old.crash()
	cleaner, err := dial(t, ep, "stale", secret, DefaultTTL)
	require.NoError(t, err)
	require.NoError(t, cleaner.Delete(ctx, bootstrap.MemberPrefix+"1"))

	a, err := dial(t, ep, "stale", secret, DefaultTTL)
	require.NoError(t, err)
	b, err := dial(t, ep, "stale", secret, DefaultTTL)
	require.NoError(t, err)
	require.NoError(t, a.Claim(ctx, 0, 2, "a"))
	got := make(chan [][]byte, 1)
	go func() {
		vals, err := a.AllGather(ctx, "ag/1", 0, 2, []byte("a"))
		assert.NoError(t, err)
		got <- vals
	}()
	time.Sleep(300 * time.Millisecond) // rank 0 waits, the stale entry there
	require.NoError(t, b.Claim(ctx, 1, 2, "b"))
	vals, err := b.AllGather(ctx, "ag/1", 1, 2, []byte("b"))
	require.NoError(t, err)
	assert.Equal(t, [][]byte{[]byte("a"), []byte("b")}, vals)
	assert.Equal(t, [][]byte{[]byte("a"), []byte("b")}, <-got)
}
