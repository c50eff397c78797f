// Package launch starts the ranks of a job on this host, the way `torchrun --standalone`
// does: it picks a rendezvous port, generates a job secret, sets each rank's environment,
// prefixes every line of output with the rank, stops every rank when one fails, and
// forwards interrupts. `moex run` and the multi-process tests use it.
//
// It owns the child processes and the goroutines that copy their output; Run returns only
// when all of them are gone.
package launch

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Config describes a local job.
type Config struct {
	N    int      // ranks
	Prog string   // program to run
	Args []string // its arguments
	// Env is added to every rank's environment (after os.Environ()).
	Env []string
	// RankEnv, when set, adds variables for one rank (tests use it to give ranks
	// different MOEX_HOST_ID values).
	RankEnv func(rank int) []string
	Stdout  io.Writer // default os.Stdout
	Stderr  io.Writer // default os.Stderr
	// NoPrefix turns off the "[rank] " line prefix.
	NoPrefix bool
	// Grace is how long ranks get between SIGTERM and SIGKILL once the job is stopping
	// (default 5s).
	Grace time.Duration
	// KeepGoing lets the other ranks run on when one fails, for jobs whose survivors
	// carry on without it (coll.Comm.Shrink). Run still returns the first failure,
	// once every rank has ended.
	KeepGoing bool
}

// MaxRanks bounds the ranks of a job on one host.
const MaxRanks = 1024

// RankError says which rank ended the job and how: the root cause (see Run).
type RankError struct {
	Rank   int
	Code   int            // exit code, or -1 when killed by a signal
	Signal syscall.Signal // the signal, when killed by one
	Blamed int            // how many other ranks' errors named it (0: none did)
}

func (e *RankError) Error() string {
	named := ""
	if e.Blamed > 0 {
		named = fmt.Sprintf(" (named by %d other rank(s) as the cause of their failure)", e.Blamed)
	}
	if e.Signal != 0 {
		return fmt.Sprintf("launch: rank %d killed by %s (%v)%s", e.Rank, unix.SignalName(e.Signal), e.Signal, named)
	}
	return fmt.Sprintf("launch: rank %d exited with code %d%s", e.Rank, e.Code, named)
}

// ExitCode is the status a shell would give the rank's end: its code, or 128 plus the
// signal's number.
func (e *RankError) ExitCode() int {
	if e.Signal != 0 {
		return 128 + int(e.Signal)
	}
	return e.Code
}

// ErrInterrupted is returned when ctx ended (Ctrl-C) before the ranks finished.
var ErrInterrupted = errors.New("launch: interrupted")

// FreeAddr returns a loopback address with a port that was free a moment ago.
func FreeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// NewToken returns a random job secret.
func NewToken() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Run starts the ranks and waits for all of them. If a rank fails, the others are stopped
// (unless KeepGoing) and the root cause is returned as *RankError: a rank killed by a
// signal the launcher did not send, else the rank the others' errors name (they report
// it through MOEX_LAUNCH_REPORT), else the first rank that failed. If ctx ends, every rank gets SIGINT,
// then SIGKILL after the grace period, and Run returns ErrInterrupted.
func Run(ctx context.Context, cfg Config) error {
	if cfg.N < 1 || cfg.N > MaxRanks {
		return fmt.Errorf("launch: want 1 to %d ranks, got %d", MaxRanks, cfg.N)
	}
	if cfg.Prog == "" {
		return errors.New("launch: no program")
	}
	if cfg.Stdout == nil {
		cfg.Stdout = os.Stdout
	}
	if cfg.Stderr == nil {
		cfg.Stderr = os.Stderr
	}
	if cfg.Grace <= 0 {
		cfg.Grace = 5 * time.Second
	}
	addr, err := FreeAddr()
	if err != nil {
		return fmt.Errorf("launch: picking a rendezvous port: %w", err)
	}
	// The ranks report whom they blame for an abort here (coll: MOEX_LAUNCH_REPORT), so
	// that the job's failure names the root cause, not the first survivor to exit.
	reports, err := os.MkdirTemp("", "moex-launch")
	if err != nil {
		return fmt.Errorf("launch: %w", err)
	}
	defer os.RemoveAll(reports)
	token := NewToken()
	var outMu sync.Mutex
	var copiers sync.WaitGroup
	cmds := make([]*exec.Cmd, cfg.N)
	for r := 0; r < cfg.N; r++ {
		cmd := exec.Command(cfg.Prog, cfg.Args...)
		cmd.Env = append(os.Environ(),
			"MOEX_RANK="+strconv.Itoa(r),
			"MOEX_WORLD_SIZE="+strconv.Itoa(cfg.N),
			"MOEX_LOCAL_RANK="+strconv.Itoa(r),
			"MOEX_LOCAL_SIZE="+strconv.Itoa(cfg.N),
			"MOEX_ADDR="+addr,
			"MOEX_JOB_TOKEN="+token,
			"MOEX_LAUNCH_REPORT="+reports,
		)
		if os.Getenv("MOEX_CPU_BIND") == "" {
			// Binding ranks to cores is the launcher's policy: a core each when the host
			// has enough (coll leaves placement alone unless told).
			cmd.Env = append(cmd.Env, "MOEX_CPU_BIND=auto")
		}
		if os.Getenv("MOEX_GOMAXPROCS") == "" && os.Getenv("GOMAXPROCS") == "" {
			// So is each rank's share of the CPUs where its transport needs it
			// (bootstrap.ProcsShare); a GOMAXPROCS the user set wins.
			cmd.Env = append(cmd.Env, "MOEX_GOMAXPROCS=auto")
		}
		cmd.Env = append(cmd.Env, cfg.Env...)
		if cfg.RankEnv != nil {
			cmd.Env = append(cmd.Env, cfg.RankEnv(r)...)
		}
		// Own process group, so that we decide who gets which signal; and die with us.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		prefix := ""
		if !cfg.NoPrefix {
			prefix = "[" + strconv.Itoa(r) + "] "
		}
		// Our own pipes rather than StdoutPipe: Wait then never races the copiers, which
		// read until every writer (the rank and anything it spawned) is gone.
		// Without prefixes, a stderr that is a file (a terminal) is the ranks' own: what
		// they draw there (a progress bar, no newline) shows as they draw it.
		direct, _ := cfg.Stderr.(*os.File)
		if !cfg.NoPrefix {
			direct = nil
		}
		var readers [2]*os.File
		for i, set := range []func(*os.File){func(f *os.File) { cmd.Stdout = f }, func(f *os.File) { cmd.Stderr = f }} {
			if i == 1 && direct != nil {
				cmd.Stderr = direct
				continue
			}
			pr, pw, err := os.Pipe()
			if err != nil {
				if readers[0] != nil {
					readers[0].Close()
					cmd.Stdout.(*os.File).Close()
				}
				killAll(cmds[:r])
				return err
			}
			readers[i] = pr
			set(pw)
		}
		err := cmd.Start()
		cmd.Stdout.(*os.File).Close()
		if direct == nil {
			cmd.Stderr.(*os.File).Close()
		}
		if err != nil {
			for _, rd := range readers {
				if rd != nil {
					rd.Close()
				}
			}
			killAll(cmds[:r])
			return fmt.Errorf("launch: starting rank %d: %w", r, err)
		}
		copiers.Add(1)
		go copyLines(&copiers, &outMu, cfg.Stdout, readers[0], prefix)
		if direct == nil {
			copiers.Add(1)
			go copyLines(&copiers, &outMu, cfg.Stderr, readers[1], prefix)
		}
		cmds[r] = cmd
	}

	type exit struct {
		rank int
		err  error
	}
	exits := make(chan exit, cfg.N)
	for r, cmd := range cmds {
		go func() { exits <- exit{r, cmd.Wait()} }()
	}
	var first error
	exited := make([]bool, cfg.N)
	ends := make([]error, cfg.N) // each rank's end, in order of rank
	var order []int              // ranks in the order they ended
	stopping, killed := false, false
	var killTimer <-chan time.Time
	stop := func(sig syscall.Signal) {
		if stopping {
			return
		}
		stopping = true
		for r, c := range cmds {
			if !exited[r] {
				_ = syscall.Kill(-c.Process.Pid, sig)
			}
		}
		killTimer = time.After(cfg.Grace)
	}
	done := ctx.Done()
	for left := cfg.N; left > 0; {
		select {
		case e := <-exits:
			left--
			exited[e.rank] = true
			ends[e.rank] = e.err
			order = append(order, e.rank)
			if e.err != nil && first == nil && !stopping {
				first = rankError(e.rank, e.err)
				if !cfg.KeepGoing {
					stop(syscall.SIGTERM)
				}
			}
		case <-done:
			done = nil
			if first == nil {
				first = ErrInterrupted
			}
			stop(syscall.SIGINT)
		case <-killTimer:
			killTimer = nil
			killed = true
			killAll(cmds)
		}
	}
	copiers.Wait()
	if first == nil || errors.Is(first, ErrInterrupted) {
		return first
	}
	return rootCause(ends, order, killed, reports, first)
}

// rootCause picks the rank to blame for a failed job: a rank killed by a signal the
// launcher did not send (SIGKILL from the OOM killer or an operator, SIGSEGV...), else
// the rank the others' reports blame most (a rank that hung or died, named by the
// survivors' errors), else the first rank that failed.
func rootCause(ends []error, order []int, killed bool, reports string, first error) error {
	for _, r := range order {
		var re *RankError
		if e := rankError(r, ends[r]); errors.As(e, &re) && re.Signal != 0 &&
			re.Signal != syscall.SIGTERM && re.Signal != syscall.SIGINT && (re.Signal != syscall.SIGKILL || !killed) {
			return re
		}
	}
	votes := map[int]int{}
	waited := map[int]bool{} // ranks that timed out waiting: alive, so not the cause
	for r := range ends {
		b, err := os.ReadFile(filepath.Join(reports, "rank"+strconv.Itoa(r)))
		if err != nil {
			continue
		}
		var blamed int
		var kind string
		if n, _ := fmt.Sscanf(string(b), "blame %d %s", &blamed, &kind); n >= 1 && blamed >= 0 && blamed < len(ends) && blamed != r {
			votes[blamed]++
			if kind == "timeout" {
				waited[r] = true
			}
		}
	}
	for r := range waited {
		if len(votes) > 1 {
			delete(votes, r)
		}
	}
	best := -1
	for r, v := range votes {
		if best < 0 || v > votes[best] || v == votes[best] && r < best {
			best = r
		}
	}
	if best >= 0 {
		if ends[best] == nil { // it exited cleanly, but the others named it
			return &RankError{Rank: best, Code: 0, Blamed: votes[best]}
		}
		e := rankError(best, ends[best])
		var re *RankError
		if errors.As(e, &re) {
			re.Blamed = votes[best]
		}
		return e
	}
	return first
}

func rankError(rank int, err error) error {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return &RankError{Rank: rank, Code: -1, Signal: ws.Signal()}
		}
		return &RankError{Rank: rank, Code: ee.ExitCode()}
	}
	return fmt.Errorf("launch: rank %d: %w", rank, err)
}

func killAll(cmds []*exec.Cmd) {
	for _, c := range cmds {
		if c != nil && c.Process != nil {
			_ = syscall.Kill(-c.Process.Pid, syscall.SIGKILL)
		}
	}
}

// copyLines copies r to w line by line, each prefixed, under mu so lines never interleave.
func copyLines(wg *sync.WaitGroup, mu *sync.Mutex, w io.Writer, r *os.File, prefix string) {
	defer wg.Done()
	defer r.Close()
	br := bufio.NewReaderSize(r, 64<<10)
	for {
		line, err := br.ReadBytes('\n')
		if len(line) > 0 {
			if line[len(line)-1] != '\n' {
				line = append(line, '\n')
			}
			mu.Lock()
			_, _ = io.WriteString(w, prefix)
			_, _ = w.Write(line)
			mu.Unlock()
		}
		if err != nil {
			return
		}
	}
}
