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
	"strings"
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
	// Restarts is how many times, over the job's life, a rank that fails is replaced by
	// a new process that takes its rank over while the others run on (they admit it:
	// coll.Comm.Admit); past them a failure ends the job as without. The launcher serves
	// the job's registry (MOEX_REGISTRY), where the replacements are found. The ranks
	// reach a replacement over shared memory (MOEX_TRANSPORT=shm, set where unset) or tcp
	// (MOEX_TRANSPORT=tcp); other transports are refused.
	Restarts int
	// ServeRegistry serves the job's registry with the job secret (with Restarts; the
	// caller supplies it, as this package stays below the bootstrap): its address, and
	// how to stop it.
	ServeRegistry func(token string) (addr string, stop func() error, err error)
	// Nodes and NodeRank: the job spans Nodes hosts, N ranks on each, and this launcher
	// (an agent, as torchrun's) starts those of node NodeRank (ranks NodeRank*N to
	// NodeRank*N+N-1); the agents meet through Rdzv. Nodes 0 is 1.
	Nodes, NodeRank int
	// Rdzv is the job's rendezvous that outlives its ranks (etcd://host:port/job): set,
	// every rank meets there (MOEX_ADDR) with the job secret from the environment
	// (MOEX_JOB_TOKEN, the same for every agent), and a rank restarted (Restarts) is
	// started again with the environment it had and MOEX_RESTARTED=1: it takes its rank
	// over through Rdzv, with no registry served here. Needed with Nodes > 1.
	Rdzv string
}

// MaxRanks bounds the ranks of a job on one host; MaxRestarts the replacements of a job;
// MaxNodes its nodes and MaxWorld its ranks on every node.
const (
	MaxRanks    = 1024
	MaxRestarts = 1000
	MaxNodes    = 4096
	MaxWorld    = 1 << 16
)

// RankError says which rank ended the job and how: the root cause (see Run).
type RankError struct {
	Rank   int
	Code   int            // exit code, or -1 when killed by a signal
	Signal syscall.Signal // the signal, when killed by one
	Blamed int            // how many other ranks' errors named it (0: none did)
	// Panicked: the rank panicked with its communicator open (it reported so through
	// MOEX_LAUNCH_REPORT); its message and stack are in its output.
	Panicked bool
	// Unjoined: the rank exited, with code 0, before joining the communicator that the
	// Waiting ranks were starting; they were stopped rather than left to wait for it.
	Unjoined bool
	Waiting  []int
}

func (e *RankError) Error() string {
	named := ""
	if e.Blamed > 0 {
		named = fmt.Sprintf(" (named by %d other rank(s) as the cause of their failure)", e.Blamed)
	}
	if e.Unjoined {
		return fmt.Sprintf("launch: rank %d exited with code %d before joining the communicator; ranks %v were waiting for it and were stopped", e.Rank, e.Code, e.Waiting)
	}
	if e.Panicked {
		how := fmt.Sprintf("exit code %d", e.Code)
		if e.Signal != 0 {
			how = "then killed by " + unix.SignalName(e.Signal)
		}
		return fmt.Sprintf("launch: rank %d panicked (%s); its message and stack are in its output above%s", e.Rank, how, named)
	}
	if e.Signal != 0 {
		return fmt.Sprintf("launch: rank %d killed by %s (%v)%s", e.Rank, unix.SignalName(e.Signal), e.Signal, named)
	}
	return fmt.Sprintf("launch: rank %d exited with code %d%s", e.Rank, e.Code, named)
}

// ExitCode is the status a shell would give the rank's end: its code, or 128 plus the
// signal's number; 1 for a rank that exited cleanly but failed the job.
func (e *RankError) ExitCode() int {
	if e.Signal != 0 {
		return 128 + int(e.Signal)
	}
	if e.Code == 0 {
		return 1
	}
	return e.Code
}

// ErrInterrupted is returned when ctx ended (Ctrl-C) before the ranks finished.
var ErrInterrupted = errors.New("launch: interrupted")

// lookup is the value of the last name=value in env ("" where there is none).
func lookup(env []string, name string) string {
	v := ""
	for _, kv := range env {
		if k, val, ok := strings.Cut(kv, "="); ok && k == name {
			v = val
		}
	}
	return v
}

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
// (unless KeepGoing) and the root cause is returned as *RankError: a rank that exited,
// even cleanly, before joining a communicator the others were starting (they would wait
// for it until their start-up deadline); else a rank killed by a signal the launcher did
// not send; else the rank the others' errors name (they report it through
// MOEX_LAUNCH_REPORT); else the first rank that failed. If ctx ends, every rank gets
// SIGINT, then SIGKILL after the grace period, and Run returns ErrInterrupted.
func Run(ctx context.Context, cfg Config) error {
	if cfg.N < 1 || cfg.N > MaxRanks {
		return fmt.Errorf("launch: want 1 to %d ranks, got %d", MaxRanks, cfg.N)
	}
	if cfg.Prog == "" {
		return errors.New("launch: no program")
	}
	if cfg.Restarts < 0 || cfg.Restarts > MaxRestarts {
		return fmt.Errorf("launch: want 0 to %d restarts, got %d", MaxRestarts, cfg.Restarts)
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
	nodes := max(cfg.Nodes, 1)
	switch {
	case nodes > MaxNodes || cfg.NodeRank < 0 || cfg.NodeRank >= nodes || nodes*cfg.N > MaxWorld:
		return fmt.Errorf("launch: node %d of %d, %d ranks each: want 1 to %d nodes, node below their number, at most %d ranks in all", cfg.NodeRank, nodes, cfg.N, MaxNodes, MaxWorld)
	case nodes > 1 && cfg.Rdzv == "":
		return errors.New("launch: ranks on several nodes meet through a rendezvous that every agent reaches (Rdzv: etcd://host:port/job)")
	}
	token := NewToken()
	if cfg.Rdzv != "" {
		if token = lookup(append(os.Environ(), cfg.Env...), "MOEX_JOB_TOKEN"); token == "" {
			return errors.New("launch: with a rendezvous (--rdzv) every agent must give its ranks the same job secret: export MOEX_JOB_TOKEN (for example $(head -c16 /dev/urandom | xxd -p)) before starting each")
		}
	}
	addr, err := FreeAddr()
	if err != nil {
		return fmt.Errorf("launch: picking a rendezvous port: %w", err)
	}
	// The ranks report here whom they blame for an abort, and when they begin and finish
	// joining (coll: MOEX_LAUNCH_REPORT), so that the job's failure names the root cause,
	// not the first survivor to exit.
	reports, err := os.MkdirTemp("", "moex-launch")
	if err != nil {
		return fmt.Errorf("launch: %w", err)
	}
	defer os.RemoveAll(reports)
	j := &job{cfg: cfg, addr: addr, token: token, reports: reports, cmds: make([]*exec.Cmd, nodes*cfg.N), base: cfg.NodeRank * cfg.N}
	if cfg.Rdzv != "" {
		j.addr = cfg.Rdzv
	}
	if cfg.Restarts > 0 && cfg.Rdzv == "" {
		// The registry outlives every rank: the replacements say there where they listen.
		if cfg.ServeRegistry == nil {
			return errors.New("launch: restarts without a registry to serve (Config.ServeRegistry)")
		}
		switch tr := lookup(append(os.Environ(), cfg.Env...), "MOEX_TRANSPORT"); tr {
		case "", "shm", "tcp":
		default:
			return fmt.Errorf("launch: restarts need the ranks to reach a new process over shm or tcp, not MOEX_TRANSPORT=%s (leave it unset: the job then runs over shm)", tr)
		}
		addr, stop, err := cfg.ServeRegistry(j.token)
		if err != nil {
			return fmt.Errorf("launch: serving the job's registry: %w", err)
		}
		defer stop()
		j.registry = addr
	}
	for r := j.base; r < j.base+cfg.N; r++ {
		if err := j.start(r, false); err != nil {
			killAll(j.cmds)
			j.copiers.Wait()
			return err
		}
	}
	err = j.wait(ctx)
	j.removeSegments()
	return err
}

// DevShm is where moex's shared-memory files are (package transport/shm's segments and
// windows, named "moex-...-p<pid>" after the process that made them).
var DevShm = "/dev/shm"

// removeSegments removes the shared-memory files the ranks made and left behind: a rank
// killed, or stopped between making a window and every peer mapping it, cannot unlink its
// own. Every rank has ended when it runs.
func (j *job) removeSegments() {
	for _, c := range j.all {
		if c == nil || c.Process == nil {
			continue
		}
		left, _ := filepath.Glob(filepath.Join(DevShm, "moex-*-p"+strconv.Itoa(c.Process.Pid)))
		for _, f := range left {
			_ = os.Remove(f)
		}
	}
}

// job is one Run: its ranks' processes and the goroutines that copy their output.
type job struct {
	cfg     Config
	base    int    // the first rank this launcher starts (Config.NodeRank*N)
	addr    string // the rendezvous store's
	token   string
	reports string      // MOEX_LAUNCH_REPORT
	cmds    []*exec.Cmd // each rank's process (its latest), by rank of the job; nil for other nodes' ranks
	all     []*exec.Cmd // every process started, replacements included
	// registry is the job's registry's address (Restarts); restarted counts the
	// replacements started.
	registry  string
	restarted int
	outMu     sync.Mutex // one line at a time on the shared outputs
	copiers   sync.WaitGroup
}

// env is rank r's environment.
func (j *job) env(r int) []string {
	env := append(os.Environ(),
		"MOEX_RANK="+strconv.Itoa(r),
		"MOEX_WORLD_SIZE="+strconv.Itoa(len(j.cmds)),
		"MOEX_LOCAL_RANK="+strconv.Itoa(r-j.base),
		"MOEX_LOCAL_SIZE="+strconv.Itoa(j.cfg.N),
		"MOEX_ADDR="+j.addr,
		"MOEX_JOB_TOKEN="+j.token,
		"MOEX_LAUNCH_REPORT="+j.reports,
	)
	if os.Getenv("MOEX_CPU_BIND") == "" {
		// Binding ranks to cores is the launcher's policy: a core each when the host has
		// enough (coll leaves placement alone unless told).
		env = append(env, "MOEX_CPU_BIND=auto")
	}
	if os.Getenv("MOEX_GOMAXPROCS") == "" && os.Getenv("GOMAXPROCS") == "" {
		// So is each rank's share of the CPUs where its transport needs it
		// (bootstrap.ProcsShare); a GOMAXPROCS the user set wins.
		env = append(env, "MOEX_GOMAXPROCS=auto")
	}
	if j.registry != "" {
		env = append(env, "MOEX_REGISTRY="+j.registry)
		if lookup(append(os.Environ(), j.cfg.Env...), "MOEX_TRANSPORT") == "" {
			// Every rank is on this host: a new process joins them over shared memory,
			// and it must know that the job runs over it.
			env = append(env, "MOEX_TRANSPORT=shm")
		}
	}
	env = append(env, j.cfg.Env...)
	if j.cfg.RankEnv != nil {
		env = append(env, j.cfg.RankEnv(r)...)
	}
	return env
}

// start starts rank r (joining: a process that takes it over in the running job) and
// the goroutines that copy its output. On error nothing of rank r is left behind.
func (j *job) start(r int, joining bool) error {
	cmd := exec.Command(j.cfg.Prog, j.cfg.Args...)
	cmd.Env = j.env(r)
	switch {
	case joining && j.cfg.Rdzv != "":
		cmd.Env = append(cmd.Env, "MOEX_RESTARTED=1") // it finds the running job at the rendezvous
	case joining:
		cmd.Env = append(cmd.Env, "MOEX_JOINING=1")
	}
	// Own process group, so that we decide who gets which signal; and die with us.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	prefix := ""
	if !j.cfg.NoPrefix {
		prefix = "[" + strconv.Itoa(r) + "] "
	}
	// Our own pipes rather than StdoutPipe: Wait then never races the copiers, which read
	// until every writer (the rank and anything it spawned) is gone. Without prefixes, a
	// stderr that is a file (a terminal) is the ranks' own: what they draw there (a
	// progress bar, no newline) shows as they draw it.
	direct, _ := j.cfg.Stderr.(*os.File)
	if !j.cfg.NoPrefix {
		direct = nil
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("launch: rank %d's output: %w", r, err)
	}
	cmd.Stdout = outW
	var errR *os.File
	if direct != nil {
		cmd.Stderr = direct
	} else {
		var errW *os.File
		if errR, errW, err = os.Pipe(); err != nil {
			outR.Close()
			outW.Close()
			return fmt.Errorf("launch: rank %d's output: %w", r, err)
		}
		cmd.Stderr = errW
		defer errW.Close()
	}
	err = cmd.Start()
	outW.Close() // the child has its own copies
	if err != nil {
		outR.Close()
		if errR != nil {
			errR.Close()
		}
		return fmt.Errorf("launch: starting rank %d: %w", r, err)
	}
	j.copiers.Add(1)
	go copyLines(&j.copiers, &j.outMu, j.cfg.Stdout, outR, prefix)
	if errR != nil {
		j.copiers.Add(1)
		go copyLines(&j.copiers, &j.outMu, j.cfg.Stderr, errR, prefix)
	}
	j.cmds[r] = cmd
	j.all = append(j.all, cmd)
	return nil
}

// wait waits for every rank, stopping the job on the first failure (see Run).
func (j *job) wait(ctx context.Context) error {
	n := len(j.cmds)
	type exit struct {
		rank int
		err  error
	}
	exits := make(chan exit, j.cfg.N+j.cfg.Restarts)
	for r, cmd := range j.cmds {
		if cmd != nil {
			go func() { exits <- exit{r, cmd.Wait()} }()
		}
	}
	var first error
	exited := make([]bool, n)
	ends := make([]error, n) // each rank's end, in order of rank
	var order []int          // ranks in the order they ended
	stopping, killed := false, false
	var killTimer, settle <-chan time.Time
	stop := func(sig syscall.Signal) {
		if stopping {
			return
		}
		stopping = true
		for r, c := range j.cmds {
			// A rank that panicked is printing its stack and exits by itself (the kill
			// timer still ends it after the grace period).
			if c != nil && !exited[r] && !j.panicked(r) {
				_ = syscall.Kill(-c.Process.Pid, sig)
			}
		}
		killTimer = time.After(j.cfg.Grace)
	}
	// A rank that exits cleanly before it has joined leaves the others waiting for it
	// once they start joining; look for that on every exit and, while such a rank
	// exists, a few times a second.
	var deserters *time.Ticker
	var desertTick <-chan time.Time
	defer func() {
		if deserters != nil {
			deserters.Stop()
		}
	}()
	checkDeserted := func() {
		if stopping || first != nil {
			return
		}
		if e := j.deserted(exited, ends); e != nil {
			first = e
			stop(syscall.SIGTERM)
		}
	}
	done := ctx.Done()
	for left := j.cfg.N; left > 0; {
		select {
		case e := <-exits:
			left--
			if e.err != nil && first == nil && !stopping && j.restarted < j.cfg.Restarts {
				// A new process takes the rank over; the others run on and admit it.
				j.restarted++
				fmt.Fprintf(j.cfg.Stderr, "%v; starting a process to take it over (restart %d of %d)\n", rankError(e.rank, e.err), j.restarted, j.cfg.Restarts)
				if err := j.start(e.rank, true); err == nil {
					left++
					cmd := j.cmds[e.rank]
					go func() { exits <- exit{e.rank, cmd.Wait()} }()
					continue
				} else {
					fmt.Fprintf(j.cfg.Stderr, "launch: %v\n", err)
				}
			}
			exited[e.rank] = true
			ends[e.rank] = e.err
			order = append(order, e.rank)
			if e.err != nil && first == nil && !stopping {
				first = rankError(e.rank, e.err)
				if !j.cfg.KeepGoing {
					// The others learn of a rank's end by themselves, in milliseconds:
					// give them that long to fail naming it, then stop them, saying why
					// (coll adds it to the error of an operation they cancel on SIGTERM).
					j.writeStop(rootCause(ends, order, false, j.reports, first))
					settle = time.After(min(j.cfg.Grace, StopSettle))
				}
			}
			if e.err == nil && !j.joined(e.rank) && deserters == nil {
				deserters = time.NewTicker(50 * time.Millisecond)
				desertTick = deserters.C
			}
			checkDeserted()
		case <-desertTick:
			checkDeserted()
		case <-done:
			done = nil
			if first == nil {
				first = ErrInterrupted
			}
			stop(syscall.SIGINT)
		case <-settle:
			settle = nil
			stop(syscall.SIGTERM)
		case <-killTimer:
			killTimer = nil
			killed = true
			killAll(j.cmds)
		}
	}
	j.copiers.Wait()
	var re *RankError
	if first == nil || errors.Is(first, ErrInterrupted) || errors.As(first, &re) && re.Unjoined {
		return first
	}
	return rootCause(ends, order, killed, j.reports, first)
}

// joined says whether rank r finished joining its communicator (coll writes rankN.up).
func (j *job) joined(r int) bool {
	_, err := os.Stat(filepath.Join(j.reports, "rank"+strconv.Itoa(r)+".up"))
	return err == nil
}

// joining says whether rank r began joining and has not finished (coll writes
// rankN.join first).
func (j *job) joining(r int) bool {
	_, err := os.Stat(filepath.Join(j.reports, "rank"+strconv.Itoa(r)+".join"))
	return err == nil && !j.joined(r)
}

// deserted finds a rank that exited cleanly without joining while others, still
// running, are joining: they wait for a rank that is gone.
func (j *job) deserted(exited []bool, ends []error) error {
	var waiting []int
	for r := range exited {
		if !exited[r] && j.joining(r) {
			waiting = append(waiting, r)
		}
	}
	if len(waiting) == 0 {
		return nil
	}
	for r := range exited {
		if exited[r] && ends[r] == nil && !j.joined(r) {
			return &RankError{Rank: r, Unjoined: true, Waiting: waiting}
		}
	}
	return nil
}

// StopSettle is how long the launcher lets the other ranks fail by themselves after a
// rank failed (they learn of a dead or aborting peer in milliseconds, and their errors
// then name it) before it stops them with SIGTERM.
const StopSettle = 250 * time.Millisecond

// StopFile is where the ranks read why the launcher stops the job, as "RANK TEXT"
// (coll/health.StopFile, StopReason).
const StopFile = "stop"

// writeStop writes why the job is stopping, for the ranks to read: the rank blamed and
// the error that blames it.
func (j *job) writeStop(why error) {
	rank := -1
	var re *RankError
	if errors.As(why, &re) {
		rank = re.Rank
	}
	_ = os.WriteFile(filepath.Join(j.reports, StopFile), []byte(fmt.Sprintf("%d %v\n", rank, why)), 0o600)
}

// panicked says whether rank r reported that it panicked (coll's Close, deferred in the
// function that panicked, reports it before the panic goes on).
func (j *job) panicked(r int) bool {
	blamed, kind := report(j.reports, r)
	return blamed == r && kind == "panic"
}

// report reads what rank r reported of its abort: the rank it blames and the kind;
// -1 and "" where it reported nothing.
func report(reports string, r int) (int, string) {
	b, err := os.ReadFile(filepath.Join(reports, "rank"+strconv.Itoa(r)))
	if err != nil {
		return -1, ""
	}
	blamed, kind := -1, ""
	if n, _ := fmt.Sscanf(string(b), "blame %d %s", &blamed, &kind); n < 1 {
		return -1, ""
	}
	return blamed, kind
}

// rootCause picks the rank to blame for a failed job: a rank that reported it panicked,
// else a rank killed by a signal the launcher did not send (SIGKILL from the OOM killer
// or an operator, SIGSEGV...), else the rank the others' reports blame most (a rank that
// hung or died, named by the survivors' errors), else the first rank that failed.
func rootCause(ends []error, order []int, killed bool, reports string, first error) error {
	for _, r := range order {
		if blamed, kind := report(reports, r); blamed == r && kind == "panic" {
			re := &RankError{Rank: r, Code: 2, Panicked: true}
			if e := rankError(r, ends[r]); errors.As(e, &re) {
				re.Panicked = true
			}
			return re
		}
	}
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
		if blamed, kind := report(reports, r); blamed >= 0 && blamed < len(ends) && blamed != r {
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
