package launch

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The test binary doubles as the ranks: TestMain runs the helper named by LAUNCH_HELPER.
func TestMain(m *testing.M) {
	switch os.Getenv("LAUNCH_HELPER") {
	case "":
		os.Exit(m.Run())
	case "env":
		fmt.Printf("rank=%s size=%s local=%s addr=%s token=%d\n", os.Getenv("MOEX_RANK"), os.Getenv("MOEX_WORLD_SIZE"),
			os.Getenv("MOEX_LOCAL_RANK"), os.Getenv("MOEX_ADDR"), len(os.Getenv("MOEX_JOB_TOKEN")))
		fmt.Fprintf(os.Stderr, "to stderr\nno newline at end")
		os.Exit(0)
	case "fail":
		if os.Getenv("MOEX_RANK") == "1" {
			time.Sleep(50 * time.Millisecond)
			os.Exit(3)
		}
		time.Sleep(time.Minute) // the launcher must stop us
		os.Exit(0)
	case "crash":
		if os.Getenv("MOEX_RANK") == "2" {
			time.Sleep(50 * time.Millisecond)
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
		time.Sleep(time.Minute) // the launcher must stop us
		os.Exit(0)
	case "replace": // rank 1 fails (every time with LAUNCH_ALWAYS); a replacement succeeds
		if os.Getenv("MOEX_RANK") == "1" && (os.Getenv("MOEX_JOINING") != "1" || os.Getenv("LAUNCH_ALWAYS") != "") {
			os.Exit(7)
		}
		time.Sleep(200 * time.Millisecond) // longer than a stop would take
		fmt.Printf("rank %s done joining=%q registry=%v transport=%s\n", os.Getenv("MOEX_RANK"), os.Getenv("MOEX_JOINING"), os.Getenv("MOEX_REGISTRY") != "", os.Getenv("MOEX_TRANSPORT"))
		os.Exit(0)
	case "survive":
		if os.Getenv("MOEX_RANK") == "1" {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
		time.Sleep(200 * time.Millisecond) // longer than a stop would take
		fmt.Println("survived")
		os.Exit(0)
	case "blame": // ranks 0 and 2 fail first, naming rank 1, which fails last
		dir := os.Getenv("MOEX_LAUNCH_REPORT")
		switch os.Getenv("MOEX_RANK") {
		case "1":
			time.Sleep(150 * time.Millisecond)
			os.Exit(3)
		default:
			os.WriteFile(filepath.Join(dir, "rank"+os.Getenv("MOEX_RANK")), []byte("blame 1 peer\n"), 0o600)
			os.Exit(1)
		}
	case "unjoined": // rank 1 leaves before joining; the others start joining and wait
		dir, rank := os.Getenv("MOEX_LAUNCH_REPORT"), os.Getenv("MOEX_RANK")
		if rank == "1" {
			os.Exit(0)
		}
		os.WriteFile(filepath.Join(dir, "rank"+rank+".join"), nil, 0o600)
		time.Sleep(time.Minute) // the launcher must stop us
		os.Exit(0)
	case "joinedearly": // rank 1 joins and leaves while the others work on
		dir, rank := os.Getenv("MOEX_LAUNCH_REPORT"), os.Getenv("MOEX_RANK")
		os.WriteFile(filepath.Join(dir, "rank"+rank+".join"), nil, 0o600)
		os.WriteFile(filepath.Join(dir, "rank"+rank+".up"), nil, 0o600)
		if rank != "1" {
			time.Sleep(300 * time.Millisecond)
		}
		fmt.Println("done")
		os.Exit(0)
	case "stubborn":
		signal.Ignore(syscall.SIGTERM, syscall.SIGINT)
		if os.Getenv("MOEX_RANK") == "0" {
			os.Exit(1)
		}
		time.Sleep(time.Minute)
	case "leftover": // every rank leaves a segment and a window behind; rank 1 is killed
		for _, kind := range []string{"r", "w1-r"} {
			name := fmt.Sprintf("moex-launchtest-%s%s-p%d", kind, os.Getenv("MOEX_RANK"), os.Getpid())
			os.WriteFile(filepath.Join(DevShm, name), []byte("x"), 0o600)
		}
		if os.Getenv("MOEX_RANK") == "1" {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
		time.Sleep(time.Minute) // the launcher must stop us
		os.Exit(0)
	case "interrupt":
		c := make(chan os.Signal, 1)
		signal.Notify(c, os.Interrupt)
		fmt.Println("ready")
		<-c
		fmt.Println("got interrupt")
		os.Exit(0)
	}
}

type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) { s.mu.Lock(); defer s.mu.Unlock(); return s.b.Write(p) }
func (s *syncBuf) String() string              { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

func cfg(helper string, n int, out, errOut *syncBuf) Config {
	return Config{N: n, Prog: os.Args[0], Args: []string{"-test.run=^$"}, Env: []string{"LAUNCH_HELPER=" + helper},
		Stdout: out, Stderr: errOut, Grace: 300 * time.Millisecond}
}

func TestEnvAndPrefixes(t *testing.T) {
	var out, errOut syncBuf
	if err := Run(context.Background(), cfg("env", 4, &out, &errOut)); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	sort.Strings(lines)
	if len(lines) != 4 {
		t.Fatalf("output: %q", out.String())
	}
	var addr string
	for r, l := range lines {
		var gotAddr string
		var tok int
		var rank, size, local string
		if _, err := fmt.Sscanf(l, "[%d] rank=%s size=%s local=%s addr=%s token=%d", new(int), &rank, &size, &local, &gotAddr, &tok); err != nil {
			t.Fatalf("line %q: %v", l, err)
		}
		if !strings.HasPrefix(l, fmt.Sprintf("[%d] rank=%d ", r, r)) || size != "4" || local != fmt.Sprint(r) || tok != 32 {
			t.Fatalf("line %q", l)
		}
		if addr == "" {
			addr = gotAddr
		} else if gotAddr != addr {
			t.Fatalf("ranks got different rendezvous addresses: %s vs %s", addr, gotAddr)
		}
	}
	// stderr lines are prefixed too, and a last line without newline is completed.
	if c := strings.Count(errOut.String(), "] no newline at end\n"); c != 4 {
		t.Fatalf("stderr: %q", errOut.String())
	}
}

func TestFailureStopsEveryone(t *testing.T) {
	var out, errOut syncBuf
	start := time.Now()
	err := Run(context.Background(), cfg("fail", 4, &out, &errOut))
	var re *RankError
	if !errors.As(err, &re) || re.Rank != 1 || re.Code != 3 {
		t.Fatalf("got %v, want rank 1 exit 3", err)
	}
	if d := time.Since(start); d > 30*time.Second {
		t.Fatalf("other ranks were not stopped (took %v)", d)
	}
}

// A rank killed by a signal is named with the signal, and ends the job as a shell would
// report it (128 + the signal's number).
func TestCrashNamesTheSignal(t *testing.T) {
	var out, errOut syncBuf
	err := Run(context.Background(), cfg("crash", 3, &out, &errOut))
	var re *RankError
	if !errors.As(err, &re) || re.Rank != 2 || re.Signal != syscall.SIGKILL || re.ExitCode() != 137 {
		t.Fatalf("got %v, want rank 2 killed by SIGKILL, exit code 137", err)
	}
	if want := "launch: rank 2 killed by SIGKILL (killed)"; err.Error() != want {
		t.Fatalf("message %q, want %q", err, want)
	}
}

func TestStubbornRanksAreKilled(t *testing.T) {
	var out, errOut syncBuf
	err := Run(context.Background(), cfg("stubborn", 3, &out, &errOut))
	var re *RankError
	if !errors.As(err, &re) || re.Rank != 0 {
		t.Fatalf("got %v, want rank 0 failure", err)
	}
}

func TestInterruptIsForwarded(t *testing.T) {
	var out, errOut syncBuf
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		for !strings.Contains(out.String(), "[1] ready") || !strings.Contains(out.String(), "[0] ready") {
			time.Sleep(5 * time.Millisecond)
		}
		cancel()
	}()
	err := Run(ctx, cfg("interrupt", 2, &out, &errOut))
	if !errors.Is(err, ErrInterrupted) {
		t.Fatalf("got %v, want ErrInterrupted", err)
	}
	if strings.Count(out.String(), "got interrupt") != 2 {
		t.Fatalf("interrupt not delivered to every rank: %q", out.String())
	}
}

func TestBadConfig(t *testing.T) {
	if err := Run(context.Background(), Config{N: 0, Prog: "x"}); err == nil {
		t.Fatal("N=0 accepted")
	}
	if err := Run(context.Background(), Config{N: 1, Prog: "/no/such/program"}); err == nil {
		t.Fatal("missing program accepted")
	}
}

// With KeepGoing a rank killed by a signal leaves the others running to their end;
// Run returns the killed rank's error.
func TestKeepGoing(t *testing.T) {
	var out, errOut syncBuf
	c := cfg("survive", 3, &out, &errOut)
	c.KeepGoing = true
	err := Run(context.Background(), c)
	var re *RankError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, 1, re.Rank)
	assert.Equal(t, syscall.SIGKILL, re.Signal)
	assert.Equal(t, 2, strings.Count(out.String(), "survived"), out.String())
}

// With restarts, a rank that fails is replaced by a process started with MOEX_JOINING=1
// while the others run on, and the job ends well when every rank does; a rank that
// fails past the restarts ends the job as without them.
func TestRestarts(t *testing.T) {
	registry := func(token string) (string, func() error, error) {
		return "127.0.0.1:1", func() error { return nil }, nil
	}
	var out, errOut syncBuf
	c := cfg("replace", 3, &out, &errOut)
	c.Restarts, c.ServeRegistry = 2, registry
	require.NoError(t, Run(context.Background(), c))
	assert.Contains(t, out.String(), `rank 1 done joining="1" registry=true transport=shm`)
	assert.Equal(t, 3, strings.Count(out.String(), "done"), out.String())
	assert.Contains(t, errOut.String(), "launch: rank 1 exited with code 7; starting a process to take it over (restart 1 of 2)")

	out, errOut = syncBuf{}, syncBuf{}
	c = cfg("replace", 3, &out, &errOut)
	c.Restarts, c.ServeRegistry, c.Env = 1, registry, append(c.Env, "LAUNCH_ALWAYS=1")
	err := Run(context.Background(), c)
	var re *RankError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, 1, re.Rank)
	assert.Equal(t, 7, re.Code)

	c.Restarts, c.ServeRegistry = 1, nil
	assert.Error(t, Run(context.Background(), c), "restarts without a registry")
	c.ServeRegistry, c.Env = registry, append(c.Env, "MOEX_TRANSPORT=ucx")
	assert.Error(t, Run(context.Background(), c), "restarts over ucx")
	c.Restarts = MaxRestarts + 1
	assert.Error(t, Run(context.Background(), c))
}

// A job of more ranks than the bound is refused before anything starts.
func TestTooManyRanks(t *testing.T) {
	var out, errOut syncBuf
	assert.Error(t, Run(context.Background(), cfg("env", MaxRanks+1, &out, &errOut)))
	assert.Empty(t, out.String())
}

// The launcher blames the rank the others' reports name, with its own exit code, not
// the first rank to exit.
func TestBlameNamedRank(t *testing.T) {
	var out, errOut syncBuf
	c := cfg("blame", 3, &out, &errOut)
	c.KeepGoing = true
	err := Run(context.Background(), c)
	var re *RankError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, 1, re.Rank)
	assert.Equal(t, 3, re.Code)
	assert.Equal(t, 2, re.Blamed)
	assert.Contains(t, re.Error(), "named by 2 other rank(s)")
}

// A rank that exits cleanly before joining while the others join: the launcher stops
// them and names it, rather than letting them wait out their start-up deadline.
func TestUnjoinedRankNamed(t *testing.T) {
	var out, errOut syncBuf
	err := Run(context.Background(), cfg("unjoined", 4, &out, &errOut))
	var re *RankError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, 1, re.Rank)
	assert.True(t, re.Unjoined)
	require.NotEmpty(t, re.Waiting, "the ranks seen joining when rank 1 was found gone")
	assert.Subset(t, []int{0, 2, 3}, re.Waiting)
	assert.Equal(t, 1, re.ExitCode(), "a job that failed exits non-zero")
}

// A rank that leaves after joining, or a job whose ranks never join, is no failure.
func TestCleanExitsAreNoFailure(t *testing.T) {
	var out, errOut syncBuf
	require.NoError(t, Run(context.Background(), cfg("joinedearly", 4, &out, &errOut)))
	assert.Equal(t, 4, strings.Count(out.String(), "] done\n"), out.String())
}

// Shared-memory files that ranks leave behind (a rank killed, or stopped before it could
// unlink them) are gone once Run returns; others' are left alone.
func TestLeftoverSegmentsRemoved(t *testing.T) {
	other := filepath.Join(DevShm, fmt.Sprintf("moex-launchtest-r9-p%d", os.Getpid()))
	require.NoError(t, os.WriteFile(other, []byte("x"), 0o600))
	defer os.Remove(other)
	var out, errOut syncBuf
	err := Run(context.Background(), cfg("leftover", 3, &out, &errOut))
	var re *RankError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, 1, re.Rank)
	left, _ := filepath.Glob(filepath.Join(DevShm, "moex-launchtest-*"))
	assert.Equal(t, []string{other}, left, "only the file of a process outside the job is left")
}
