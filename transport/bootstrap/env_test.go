package bootstrap

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/transporttest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func envOf(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestParseEnvLaunchers(t *testing.T) {
	cases := []struct {
		name string
		env  map[string]string
		want Env
	}{
		{"none", map[string]string{}, Env{Rank: 0, Size: 1, LocalRank: -1, LocalSize: -1, Launcher: "none"}},
		{"moex", map[string]string{"MOEX_RANK": "2", "MOEX_WORLD_SIZE": "4", "MOEX_LOCAL_RANK": "0", "MOEX_LOCAL_SIZE": "2",
			"MOEX_ADDR": "10.0.0.1:29500", "MOEX_JOB_TOKEN": "s"},
			Env{Rank: 2, Size: 4, LocalRank: 0, LocalSize: 2, Addr: "10.0.0.1:29500", Token: "s", Launcher: "moex"}},
		{"torchrun", map[string]string{"RANK": "1", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
			"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "MOEX_JOB_TOKEN": "s"},
			Env{Rank: 1, Size: 8, LocalRank: 1, LocalSize: 4, Addr: "node0:29500", Token: "s", Launcher: "torchrun"}},
		{"openmpi", map[string]string{"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
			"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MOEX_ADDR": "127.0.0.1:1234", "MOEX_JOB_TOKEN": "s"},
			Env{Rank: 3, Size: 4, LocalRank: 3, LocalSize: 4, Addr: "127.0.0.1:1234", Token: "s", Launcher: "openmpi"}},
		{"slurm", map[string]string{"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
			"MASTER_ADDR": "n1", "MASTER_PORT": "7", "MOEX_JOB_TOKEN": "s"},
			Env{Rank: 5, Size: 16, LocalRank: 1, LocalSize: -1, Addr: "n1:7", Token: "s", Launcher: "slurm"}},
		{"torchrun static: the agent's store holds MASTER_PORT", map[string]string{"RANK": "0", "WORLD_SIZE": "2",
			"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555", "TORCHELASTIC_USE_AGENT_STORE": "True", "MOEX_JOB_TOKEN": "s"},
			Env{Rank: 0, Size: 2, LocalRank: -1, LocalSize: -1, Addr: "127.0.0.1:29556", Token: "s", Launcher: "torchrun",
				AddrNote: "MASTER_PORT+1: torchrun's agent store holds MASTER_PORT=29555"}},
		{"mpirun on one host, no address", map[string]string{"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
			"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_orte_jobfam_session_dir": "/tmp/ompi.x/pid.7",
			"OMPI_MCA_ess_base_jobid": "42"},
			Env{Rank: 1, Size: 2, LocalRank: 1, LocalSize: 2, Launcher: "openmpi", AddrFile: "/tmp/ompi.x/pid.7/moex-rendezvous-42",
				AddrNote: "through /tmp/ompi.x/pid.7/moex-rendezvous-42"}},
		{"moex wins over torchrun", map[string]string{"MOEX_RANK": "0", "MOEX_WORLD_SIZE": "2", "RANK": "1", "WORLD_SIZE": "2",
			"MOEX_ADDR": "h:1", "MASTER_ADDR": "other", "MASTER_PORT": "2", "MOEX_JOB_TOKEN": "s"},
			Env{Rank: 0, Size: 2, LocalRank: -1, LocalSize: -1, Addr: "h:1", Token: "s", Launcher: "moex"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := ParseEnv(envOf(c.env))
			if err != nil {
				t.Fatal(err)
			}
			c.want.Timeout, c.want.Transport = DefaultTimeout, "auto"
			if got != c.want {
				t.Fatalf("got  %+v\nwant %+v", got, c.want)
			}
		})
	}
}

func TestParseEnvErrors(t *testing.T) {
	base := map[string]string{"MOEX_RANK": "0", "MOEX_WORLD_SIZE": "2", "MOEX_ADDR": "h:1", "MOEX_JOB_TOKEN": "s"}
	cases := []struct {
		change  map[string]string
		wantVar string
	}{
		{map[string]string{"MOEX_RANK": "x"}, "MOEX_RANK"},
		{map[string]string{"MOEX_RANK": "-1"}, "MOEX_RANK"},
		{map[string]string{"MOEX_RANK": "2"}, "MOEX_RANK"},
		{map[string]string{"MOEX_WORLD_SIZE": "0"}, "MOEX_WORLD_SIZE"},
		{map[string]string{"MOEX_WORLD_SIZE": ""}, "MOEX_WORLD_SIZE"},
		{map[string]string{"MOEX_ADDR": ""}, "MOEX_ADDR"},
		{map[string]string{"MOEX_ADDR": "nocolon"}, "MOEX_ADDR"},
		{map[string]string{"MOEX_JOB_TOKEN": ""}, "MOEX_JOB_TOKEN"},
		{map[string]string{"MOEX_TIMEOUT": "soon"}, "MOEX_TIMEOUT"},
		{map[string]string{"MOEX_TRANSPORT": "carrier-pigeon"}, "MOEX_TRANSPORT"},
		{map[string]string{"MOEX_LOCAL_SIZE": "0"}, "MOEX_LOCAL_SIZE"},
	}
	for _, c := range cases {
		env := map[string]string{}
		for k, v := range base {
			env[k] = v
		}
		for k, v := range c.change {
			env[k] = v
		}
		_, err := ParseEnv(envOf(env))
		var ee *transport.EnvError
		if !errors.As(err, &ee) || ee.Var != c.wantVar {
			t.Errorf("%v: got %v, want EnvError naming %s", c.change, err, c.wantVar)
		}
	}
}

func TestBindHost(t *testing.T) {
	e := Env{Addr: "127.0.0.1:5"}
	if h, err := e.BindHost(); err != nil || h != "127.0.0.1" {
		t.Fatalf("loopback store: %q %v", h, err)
	}
	e = Env{Bind: "10.1.2.3", Addr: "127.0.0.1:5"}
	if h, _ := e.BindHost(); h != "10.1.2.3" {
		t.Fatalf("MOEX_BIND ignored: %q", h)
	}
	e = Env{Iface: "lo"}
	if h, err := e.BindHost(); err != nil || h != "127.0.0.1" {
		t.Fatalf("MOEX_IFACE=lo: %q %v", h, err)
	}
	e = Env{Iface: "no-such-if0"}
	var ee *transport.EnvError
	if _, err := e.BindHost(); !errors.As(err, &ee) || ee.Var != "MOEX_IFACE" {
		t.Fatalf("unknown iface: %v", err)
	}
}

func TestStoreAllGatherAndIntruder(t *testing.T) {
	var logs transporttest.Recorder
	srv, err := ServeStore("127.0.0.1:0", []byte("job"), logs.Logger())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	// An intruder with the wrong secret is refused and the job carries on.
	if _, err := DialStore(ctx, srv.Addr(), []byte("nope")); !errors.Is(err, transport.ErrAuth) {
		t.Fatalf("intruder: got %v, want ErrAuth", err)
	}

	const n = 6
	var wg sync.WaitGroup
	res := make([][][]byte, n)
	errs := make([]error, n)
	for r := 0; r < n; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			time.Sleep(time.Duration(r) * 3 * time.Millisecond)
			c, err := DialStore(ctx, srv.Addr(), []byte("job"))
			if err != nil {
				errs[r] = err
				return
			}
			defer c.Close()
			res[r], errs[r] = c.AllGather(ctx, "addr", r, n, []byte(fmt.Sprintf("rank-%d", r)))
		}(r)
	}
	wg.Wait()
	for r := 0; r < n; r++ {
		if errs[r] != nil {
			t.Fatalf("rank %d: %v", r, errs[r])
		}
		for p := 0; p < n; p++ {
			if string(res[r][p]) != fmt.Sprintf("rank-%d", p) {
				t.Fatalf("rank %d sees %q for %d", r, res[r][p], p)
			}
		}
	}
	assert.Equal(t, 1, srv.Refused())
	refused := func(r transporttest.Record) bool {
		return transporttest.Logged(slog.LevelWarn, "moex store: refused connection")(r) && errors.Is(r.Err("err"), transport.ErrAuth)
	}
	assert.Equal(t, 1, logs.Count(refused), "warnings of the refused intruder: %+v", logs.Records())
}

// Scan returns the keys with a prefix and their values, in key order, without waiting;
// Delete removes a key.
func TestStoreScanDelete(t *testing.T) {
	srv, err := ServeStore("127.0.0.1:0", []byte("job"), nil)
	require.NoError(t, err)
	defer srv.Close()
	ctx := context.Background()
	c, err := DialStore(ctx, srv.Addr(), []byte("job"))
	require.NoError(t, err)
	defer c.Close()
	keys, vals, err := c.Scan(ctx, "join/")
	require.NoError(t, err)
	assert.Empty(t, keys)
	assert.Empty(t, vals)
	for _, k := range []string{"join/3/b", "other", "join/1/a", "join/3/a"} {
		require.NoError(t, c.Set(ctx, k, []byte("v-"+k)))
	}
	keys, vals, err = c.Scan(ctx, "join/")
	require.NoError(t, err)
	assert.Equal(t, []string{"join/1/a", "join/3/a", "join/3/b"}, keys)
	assert.Equal(t, [][]byte{[]byte("v-join/1/a"), []byte("v-join/3/a"), []byte("v-join/3/b")}, vals)
	require.NoError(t, c.Delete(ctx, "join/3/a"))
	require.NoError(t, c.Delete(ctx, "join/9/none"))
	keys, _, err = c.Scan(ctx, "join/3")
	require.NoError(t, err)
	assert.Equal(t, []string{"join/3/b"}, keys)
}

func TestStoreGetHonoursContext(t *testing.T) {
	srv, err := ServeStore("127.0.0.1:0", []byte("job"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	c, err := DialStore(context.Background(), srv.Addr(), []byte("job"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := c.Get(ctx, "never"); !errors.Is(err, transport.ErrTimeout) {
		t.Fatalf("got %v, want ErrTimeout", err)
	}
}

func TestDialStoreGivesUp(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := DialStore(ctx, addr, []byte("x")); !errors.Is(err, transport.ErrTimeout) {
		t.Fatalf("got %v, want ErrTimeout", err)
	}
}

// A start-up cancelled (the launcher stopping the job) while waiting for rank 0's store
// is a cancellation, not a timeout.
func TestDialStoreCancelled(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	_, err := DialStore(ctx, addr, []byte("x"))
	assert.ErrorIs(t, err, transport.ErrCanceled)
	assert.NotErrorIs(t, err, transport.ErrTimeout)
}

// Open MPI without an address: on several hosts (no shared session directory), or with
// no session directory in the environment, it is an EnvError naming MOEX_ADDR.
func TestParseEnvOpenMPINeedsAddress(t *testing.T) {
	base := map[string]string{"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
		"OMPI_MCA_orte_jobfam_session_dir": "/tmp/s", "OMPI_MCA_ess_base_jobid": "1"}
	_, err := ParseEnv(envOf(base))
	var ee *transport.EnvError
	require.ErrorAs(t, err, &ee)
	assert.Equal(t, "MOEX_ADDR", ee.Var)
	base["OMPI_COMM_WORLD_LOCAL_SIZE"] = "4"
	delete(base, "OMPI_MCA_orte_jobfam_session_dir")
	_, err = ParseEnv(envOf(base))
	require.ErrorAs(t, err, &ee)
	assert.Equal(t, "MOEX_ADDR", ee.Var)
	base["PMIX_SERVER_TMPDIR"] = "/tmp/p" // Open MPI 5 names it so
	e, err := ParseEnv(envOf(base))
	require.NoError(t, err)
	assert.Equal(t, "/tmp/p/moex-rendezvous-1", e.AddrFile)
}

// The file rendezvous: rank 0 publishes a loopback store and a fresh secret in a 0600
// file, the others (started first, or later) find it, and the file is gone once start-up
// is over.
func TestJoinByFile(t *testing.T) {
	const size = 3
	file := filepath.Join(t.TempDir(), "moex-rendezvous-7")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rvs := make([]*Rendezvous, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := size - 1; r >= 0; r-- { // the others first: they wait for the file
		wg.Add(1)
		go func() {
			defer wg.Done()
			env := Env{Rank: r, Size: size, LocalRank: r, LocalSize: size, AddrFile: file, Launcher: "openmpi"}
			if rvs[r], errs[r] = Join(ctx, env, nil); errs[r] != nil {
				return
			}
			got, err := rvs[r].AllGather(ctx, []byte{byte(r)})
			if err == nil && !bytes.Equal(bytes.Join(got, nil), []byte{0, 1, 2}) {
				err = fmt.Errorf("rank %d gathered %v", r, got)
			}
			if err == nil && r == 0 {
				var st os.FileInfo
				if st, err = os.Stat(file); err == nil && st.Mode().Perm() != 0o600 {
					err = fmt.Errorf("rendezvous file mode %v", st.Mode())
				}
			}
			if err == nil {
				err = rvs[r].Ready(ctx)
			}
			errs[r] = err
		}()
		time.Sleep(20 * time.Millisecond)
	}
	wg.Wait()
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
		assert.NotEmpty(t, rvs[r].Env.Token, "rank %d has the secret", r)
		assert.Equal(t, rvs[0].Env.Token, rvs[r].Env.Token)
		assert.Equal(t, rvs[0].Env.Addr, rvs[r].Env.Addr)
		require.NoError(t, rvs[r].Close())
	}
	_, err := os.Stat(file)
	assert.ErrorIs(t, err, os.ErrNotExist, "the file outlived start-up")
}

// A rank that finds no file within its deadline fails start-up with a StartupError.
func TestJoinByFileDeadline(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := Join(ctx, Env{Rank: 1, Size: 2, AddrFile: filepath.Join(t.TempDir(), "none")}, nil)
	var se *StartupError
	require.ErrorAs(t, err, &se)
}

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// A program that does not import the etcd driver, given an etcd address, fails at once
// with ErrNoDriver and an EnvError naming the variable (its text names the import); an
// unknown scheme likewise.
func TestStoreURLWithoutDriver(t *testing.T) {
	for _, v := range []string{"MOEX_ADDR", "MOEX_REGISTRY"} {
		for _, addr := range []string{"etcd://127.0.0.1:2379/job", "zk://127.0.0.1:2181/job"} {
			vars := map[string]string{"MOEX_RANK": "0", "MOEX_WORLD_SIZE": "2", "MOEX_ADDR": "127.0.0.1:29500", "MOEX_JOB_TOKEN": "s"}
			vars[v] = addr
			_, err := ParseEnv(func(k string) string { return vars[k] })
			require.ErrorIs(t, err, ErrNoDriver, "%s=%s", v, addr)
			var ee *transport.EnvError
			require.ErrorAs(t, err, &ee, "%s=%s", v, addr)
			assert.Equal(t, v, ee.Var)
		}
	}
	_, err := DialKV(context.Background(), "etcd://127.0.0.1:2379/job", nil)
	require.ErrorIs(t, err, ErrNoDriver)
}
