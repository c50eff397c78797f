package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/moex-ai/moex/bench"
	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/internal/launch"
	"github.com/moex-ai/moex/transport/bootstrap"
)

// Bounds of --chaos.
const (
	MinChaos = 10 * time.Second
	MaxChaos = 24 * time.Hour
	// chaosEvery: a fault every 5 to 15 s; chaosStop: 1 in chaosStop faults is a
	// SIGSTOP of 1 to 3 s rather than a SIGKILL.
	chaosMin, chaosMax = 5 * time.Second, 15 * time.Second
	chaosStop          = 4
)

// benchChaos runs `moex bench moe --chaos DURATION`: a serving job (moex run --restarts)
// whose ranks heal themselves (bench.Serve), while a random rank, rank 0 included, is
// SIGKILLed every 5 to 15 s (now and then SIGSTOPped for 1 to 3 s instead); it prints the
// kills, the regrows, the wrong tokens, the processes that failed or hung, the share of
// the time at full strength and the steps per second before the first kill and after
// each regrow.
func benchChaos(ctx context.Context, rf rankFlags, o bench.MoEOpts, ro bench.RecoverOpts, d time.Duration, rdzv string, args []string) error {
	if err := checkRdzv(rdzv); err != nil {
		return err
	}
	switch {
	case d < MinChaos || d > MaxChaos:
		return &usageError{fmt.Sprintf("--chaos %v: want %v to %v", d, MinChaos, MaxChaos)}
	case rf.ranks < 3:
		return &usageError{fmt.Sprintf("--chaos: %d ranks; want 3 or more, so that two survive", rf.ranks)}
	case rf.transport != "tcp" && rf.transport != "shm":
		return &usageError{fmt.Sprintf("--chaos: over shm or tcp (where a new process is reached), not %s", rf.transport)}
	case ro.WeightBytes < 0 || ro.WeightBytes > bench.MaxWeightBytes:
		return &usageError{fmt.Sprintf("--weight-bytes %d: want 1 to %d", ro.WeightBytes, bench.MaxWeightBytes)}
	case o.Act != dtype.F32 || o.Quantized || o.Naive || o.Overlap || o.Profile || o.Compute != "none" || o.Combine != 0 || o.Iters != 0:
		return &usageError{"--chaos: f32 activations and identity experts only (not with --act bf16, --quantized, --naive, --overlap, --profile, --compute, --combine-dtype or --iters)"}
	case o.Mode == dispatch.Gathered:
		return &usageError{"--chaos: the normal or the low-latency mode"}
	}
	ro.Model, ro.Tokens, ro.Wire, ro.Mode = o.Model, max(o.Tokens, 1), o.Wire, o.Mode
	ro.MaxBufferBytes = o.MaxBufferBytes
	if worker() {
		return chaosRank(ctx, ro)
	}
	dir, err := os.MkdirTemp("", "moex-chaos")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	until := time.Now().Add(d)
	// A job that has not ended a minute after its end hangs.
	jctx, cancel := context.WithDeadline(ctx, until.Add(time.Minute))
	defer cancel()
	var errOut bytes.Buffer
	lc := launch.Config{N: rf.ranks, Prog: exe, Args: append([]string{"bench", "moe"}, args...), NoPrefix: true, KeepGoing: true,
		Restarts: launch.MaxRestarts, ServeRegistry: serveRegistry, Grace: time.Second,
		Env: []string{"MOEX_BENCH_WORKER=1", "MOEX_TRANSPORT=" + rf.transport, "MOEX_CHAOS_DIR=" + dir,
			"MOEX_CHAOS_UNTIL=" + strconv.FormatInt(until.UnixNano(), 10), "MOEX_TIMEOUT=30s"},
		Stdout: io.Discard, Stderr: &errOut}
	withRdzv(&lc, rdzv)
	every, err := chaosEvery()
	if err != nil {
		return err
	}
	kctx, stopKiller := context.WithCancel(jctx)
	kills := make(chan []time.Time, 1)
	stops := 0
	go func() { kills <- chaos(kctx, dir, rf.ranks, until, every, &stops) }()
	fmt.Fprintf(os.Stderr, "moex: chaos for %v: %d ranks over %s, a fault every %v to %v\n", d, rf.ranks, rf.transport, every.min, every.max)
	runErr := launch.Run(jctx, lc)
	stopKiller()
	killed := <-kills
	hung := errors.Is(jctx.Err(), context.DeadlineExceeded)
	// Every process's last report, the killed ones' included (they write one a second).
	files, err := filepath.Glob(filepath.Join(dir, "report-*.json"))
	if err != nil {
		return err
	}
	var reports []*bench.ServeReport
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		r := &bench.ServeReport{}
		if err := json.Unmarshal(b, r); err != nil {
			return fmt.Errorf("%s: %w", f, err)
		}
		reports = append(reports, r)
	}
	s := bench.Summarize(reports, killed, rf.ranks)
	s.Stops, s.Hung = stops, hung
	if rf.json {
		if err := bench.PrintJSON(os.Stdout, []*bench.ServeSummary{s}); err != nil {
			return err
		}
		return chaosVerdict(s, runErr, errOut.String())
	}
	fmt.Printf("# moex bench moe --chaos %v: %s, %d ranks over %s, %s mode, %d tokens per rank, every expert on 2 ranks\n",
		d, ro.Model, rf.ranks, rf.transport, ro.Mode, ro.Tokens)
	fmt.Printf("kills %d, stops %d, regrows %d, steps %d, wrong tokens %d, processes failed %d, hung %v, at full strength %.1f%% of the %d s\n",
		s.Kills, s.Stops, s.Regrows, s.Steps, s.WrongTokens, s.Errors, s.Hung, 100*s.FullShare, s.Seconds)
	fmt.Printf("steps/s before the first kill %.0f; in the 5 s after each regrow:", s.Before)
	for _, a := range s.After {
		fmt.Printf(" %.0f", a)
	}
	fmt.Println()
	return chaosVerdict(s, runErr, errOut.String())
}

// chaosVerdict fails a chaos run that hung, lost tokens or a process.
func chaosVerdict(s *bench.ServeSummary, runErr error, stderr string) error {
	switch {
	case s.Hung:
		return fmt.Errorf("the job hung: still running a minute after its end\n%s", tail(stderr, 40))
	case s.WrongTokens > 0 || s.Errors > 0:
		return fmt.Errorf("%d wrong tokens, %d processes failed (%v)\n%s", s.WrongTokens, s.Errors, runErr, tail(stderr, 40))
	}
	return nil
}

// faultEvery is how often the chaos strikes, and whether it also stops ranks.
type faultEvery struct {
	min, max time.Duration
	stops    bool
}

// chaosEvery is the chaos's pace: every 5 to 15 s, with stops; MOEX_CHAOS_EVERY=MIN-MAX
// (Go durations, at least 1s) and MOEX_CHAOS_STOPS=0 change it for tests.
func chaosEvery() (faultEvery, error) {
	f := faultEvery{chaosMin, chaosMax, os.Getenv("MOEX_CHAOS_STOPS") != "0"}
	if v := os.Getenv("MOEX_CHAOS_EVERY"); v != "" {
		lo, hi, ok := strings.Cut(v, "-")
		a, err1 := time.ParseDuration(lo)
		b, err2 := time.ParseDuration(hi)
		if !ok || err1 != nil || err2 != nil || a < time.Second || b <= a || b > time.Hour {
			return f, &usageError{fmt.Sprintf("MOEX_CHAOS_EVERY=%q: want MIN-MAX, Go durations from 1s, MIN below MAX (such as 2s-4s)", v)}
		}
		f.min, f.max = a, b
	}
	return f, nil
}

// tail is the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// chaos SIGKILLs a random rank's process every.min to every.max apart until until (one
// fault in chaosStop SIGSTOPs it for 1 to 3 s instead, with every.stops), finding the processes by the pid
// files the ranks write in dir; it returns when each kill was made.
func chaos(ctx context.Context, dir string, ranks int, until time.Time, every faultEvery, stops *int) []time.Time {
	var kills []time.Time
	for {
		wait := every.min + rand.N(every.max-every.min)
		if time.Now().Add(wait + every.min).After(until) { // the last regrow has time to end
			return kills
		}
		select {
		case <-ctx.Done():
			return kills
		case <-time.After(wait):
		}
		r := rand.N(ranks)
		b, err := os.ReadFile(filepath.Join(dir, "rank"+strconv.Itoa(r)+".pid"))
		pid, perr := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || perr != nil || pid <= 0 {
			continue
		}
		if every.stops && rand.N(chaosStop) == 0 {
			if syscall.Kill(pid, syscall.SIGSTOP) == nil {
				*stops++
				time.Sleep(time.Second + rand.N(2*time.Second))
				_ = syscall.Kill(pid, syscall.SIGCONT)
			}
			continue
		}
		if syscall.Kill(pid, syscall.SIGKILL) == nil {
			kills = append(kills, time.Now())
		}
	}
}

// chaosRank is one launched rank of --chaos: it says its pid, serves until the job's end
// (healing itself), writing its report so far once a second (report-RANK-PID.json in
// MOEX_CHAOS_DIR), and prints its last as a JSON line.
func chaosRank(ctx context.Context, ro bench.RecoverOpts) error {
	ns, err := strconv.ParseInt(os.Getenv("MOEX_CHAOS_UNTIL"), 10, 64)
	dir := os.Getenv("MOEX_CHAOS_DIR")
	if err != nil || dir == "" {
		return errors.New("moex: a --chaos rank without MOEX_CHAOS_UNTIL and MOEX_CHAOS_DIR")
	}
	if err := os.WriteFile(filepath.Join(dir, "rank"+os.Getenv("MOEX_RANK")+".pid"), []byte(strconv.Itoa(os.Getpid())), 0o600); err != nil {
		return err
	}
	c, err := coll.Init(ctx, coll.Config{})
	if err != nil {
		return err
	}
	defer c.Close()
	save := func(rep *bench.ServeReport) error {
		b, err := json.Marshal(rep)
		if err != nil {
			return err
		}
		name := filepath.Join(dir, fmt.Sprintf("report-%d-%d.json", rep.Rank, os.Getpid()))
		if err := os.WriteFile(name+".tmp", b, 0o600); err != nil {
			return err
		}
		return os.Rename(name+".tmp", name)
	}
	g, rep, err := bench.Serve(ctx, c, bench.ServeOpts{RecoverOpts: ro, Until: time.Unix(0, ns), Snapshot: func(r *bench.ServeReport) { _ = save(r) }})
	if g != c {
		defer g.Close()
	}
	if rep != nil {
		if serr := save(rep); serr != nil && err == nil {
			err = serr
		}
		if perr := bench.PrintJSON(io.Writer(os.Stdout), []*bench.ServeReport{rep}); perr != nil && err == nil {
			err = perr
		}
	}
	return err
}

// chaosFlags runs --chaos (done), or checks --rdzv for --kill --rejoin; others: flags
// set that --chaos does not take.
func chaosFlags(ctx context.Context, rf rankFlags, o bench.MoEOpts, ro bench.RecoverOpts, d time.Duration, others bool, args []string) (bool, error) {
	if d != 0 {
		if others || ro.Victim >= 0 || ro.Rejoin || o.SendPartials || o.PushRows || o.TokensInBuffer || o.SumAtOrigin {
			return true, &usageError{"--chaos: not with --eplb, --kill, --runs, --rejoin, --levels, --plot, --send-partials, --push-rows, --tokens-in-buffer or --sum-at-origin"}
		}
		return true, benchChaos(ctx, rf, o, ro, d, ro.Rdzv, args)
	}
	if ro.Victim < 0 || !ro.Rejoin {
		return true, &usageError{"--rdzv: only with --kill --rejoin or --chaos"}
	}
	return false, checkRdzv(ro.Rdzv)
}

// checkRdzv checks --rdzv: empty, or etcd://host:port/name.
func checkRdzv(rdzv string) error {
	if rdzv == "" {
		return nil
	}
	if u, err := bootstrap.ParseStoreURL(rdzv); err != nil || u.Scheme != "etcd" || len(u.Path) < 2 || u.RawQuery != "" {
		return &usageError{fmt.Sprintf("--rdzv %q: want etcd://host:port/name", rdzv)}
	}
	return nil
}

// withRdzv makes lc's job meet in etcd at rdzv (a fresh name under it, so that no job
// meets an earlier one's entries) with a fresh secret, and restart its ranks through it.
func withRdzv(lc *launch.Config, rdzv string) {
	if rdzv == "" {
		return
	}
	lc.Rdzv = rdzv + "-" + launch.NewToken()[:12]
	lc.ServeRegistry = nil
	lc.Env = append(lc.Env, "MOEX_JOB_TOKEN="+launch.NewToken())
}
