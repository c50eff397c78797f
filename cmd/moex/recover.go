package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/moex-ai/moex/bench"
	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/internal/launch"
	"github.com/moex-ai/moex/models"
	"github.com/moex-ai/moex/transport"
)

// processStart is about when this process started (package variables are set before
// main runs).
var processStart = time.Now()

// MaxRecoverRuns bounds --runs.
const MaxRecoverRuns = 1000

// benchRecover runs `moex bench moe --kill R [--runs N]`: N jobs, in each of which rank R
// dies and the others recover; the phases' p50 and max.
func benchRecover(ctx context.Context, fs *flag.FlagSet, rf rankFlags, o bench.MoEOpts, ro bench.RecoverOpts, runs int, plot string, args []string) error {
	switch {
	case rf.ranks < 3:
		return &usageError{fmt.Sprintf("--kill: %d ranks; want 3 or more, so that two survive", rf.ranks)}
	case ro.Victim >= rf.ranks:
		return &usageError{fmt.Sprintf("--kill %d: no such rank of %d", ro.Victim, rf.ranks)}
	case runs < 1 || runs > MaxRecoverRuns:
		return &usageError{fmt.Sprintf("--runs %d: want 1 to %d", runs, MaxRecoverRuns)}
	case ro.WeightBytes < 0 || ro.WeightBytes > bench.MaxWeightBytes:
		return &usageError{fmt.Sprintf("--weight-bytes %d: want 1 to %d", ro.WeightBytes, bench.MaxWeightBytes)}
	case o.Act != dtype.F32 || o.Quantized || o.Naive || o.Overlap || o.Profile || o.Compute != "none" || o.Combine != 0 || o.Iters != 0:
		return &usageError{"--kill: f32 activations and identity experts only (not with --act bf16, --quantized, --naive, --overlap, --profile, --compute, --combine-dtype or --iters)"}
	case o.Mode == dispatch.Gathered:
		return &usageError{"--kill: the normal or the low-latency mode"}
	case ro.Rejoin && rf.transport != "tcp" && rf.transport != "shm":
		return &usageError{fmt.Sprintf("--rejoin: over shm or tcp (where the new process is reached), not %s", rf.transport)}
	}
	ro.Model, ro.Tokens, ro.Wire, ro.Mode = o.Model, max(o.Tokens, 1), o.Wire, o.Mode
	ro.MaxBufferBytes = o.MaxBufferBytes
	if worker() {
		return recoverRank(ctx, ro)
	}
	var results []*bench.RecoverResult
	for i := 0; i < runs; i++ {
		res, err := recoverOnce(ctx, rf, ro, args)
		if err != nil {
			return fmt.Errorf("run %d: %w", i+1, err)
		}
		results = append(results, res)
	}
	s := bench.SummarizeRecover(results)
	if plot != "" {
		if err := bench.PlotRejoin(plot, results); err != nil {
			return err
		}
	}
	if rf.json {
		return bench.PrintJSON(os.Stdout, []*bench.RecoverSummary{s})
	}
	bench.PrintRecover(os.Stdout, s)
	if ro.Rejoin {
		cfg, _ := models.Get(ro.Model)
		for _, r := range results {
			fmt.Println()
			bench.PrintRejoin(os.Stdout, r, cfg)
		}
	}
	return nil
}

// recoverOnce runs one job and returns the survivors' result.
func recoverOnce(ctx context.Context, rf rankFlags, ro bench.RecoverOpts, args []string) (*bench.RecoverResult, error) {
	if rf.transport == "inproc" {
		cs, err := coll.Local(rf.ranks, coll.Config{})
		if err != nil {
			return nil, err
		}
		defer closeAll(cs)
		results, err := onEvery(cs, func(c *coll.Comm) (*bench.RecoverResult, error) {
			sub, res, err := bench.Recover(ctx, c, ro, func() { transport.Kill(c.Transport()) })
			if sub != c {
				sub.Close()
			}
			if c.Rank() == ro.Victim {
				return nil, nil
			}
			return res, err
		})
		if err != nil {
			return nil, err
		}
		for _, r := range results {
			if r != nil {
				return r, nil
			}
		}
		return nil, errors.New("no survivor reported")
	}
	if rf.transport != "tcp" && rf.transport != "shm" && rf.transport != "ucx" {
		return nil, &usageError{fmt.Sprintf("unknown transport %q (inproc, tcp, shm, ucx)", rf.transport)}
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	var out, errOut bytes.Buffer
	lc := launch.Config{N: rf.ranks, Prog: exe, Args: append([]string{"bench", "moe"}, args...), NoPrefix: true, KeepGoing: true,
		Env: []string{"MOEX_BENCH_WORKER=1", "MOEX_TRANSPORT=" + rf.transport}, Stdout: &out, Stderr: &errOut}
	if ro.Rejoin {
		lc.Restarts, lc.ServeRegistry = 1, serveRegistry
		withRdzv(&lc, ro.Rdzv)
	}
	err = launch.Run(ctx, lc)
	var re *launch.RankError
	switch {
	case ro.Rejoin && err != nil:
		return nil, fmt.Errorf("the job ended with %v, want every rank done (the dead one's by a new process)\n%s%s", err, out.String(), errOut.String())
	case !ro.Rejoin && (!errors.As(err, &re) || re.Rank != ro.Victim || re.Signal != syscall.SIGKILL):
		return nil, fmt.Errorf("the job ended with %v, want rank %d killed by SIGKILL and the others done\n%s%s", err, ro.Victim, out.String(), errOut.String())
	}
	var res *bench.RecoverResult
	var joiner *bench.JoinerReport
	sc := bufio.NewScanner(&out)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, `{"joiner"`):
			joiner = &bench.JoinerReport{}
			if err := json.Unmarshal([]byte(line), joiner); err != nil {
				return nil, err
			}
		case strings.HasPrefix(line, "{"):
			res = &bench.RecoverResult{}
			if err := json.Unmarshal([]byte(line), res); err != nil {
				return nil, err
			}
		}
	}
	if res == nil || ro.Rejoin && (res.Rejoin == nil || joiner == nil) {
		return nil, fmt.Errorf("no survivor (or new process) reported:\n%s%s", out.String(), errOut.String())
	}
	if joiner != nil {
		tl := res.Rejoin
		tl.StartedMS = float64(joiner.StartedUnixNS-tl.KillUnixNS) / 1e6
		tl.JoinedMS = float64(joiner.JoinedUnixNS-tl.KillUnixNS) / 1e6
	}
	return res, nil
}

// recoverRank is one launched rank of --kill: it serves, dies or recovers, and the
// survivors' rank 0 prints its result as a JSON line.
func recoverRank(ctx context.Context, ro bench.RecoverOpts) error {
	c, err := coll.Init(ctx, coll.Config{})
	if err != nil {
		return err
	}
	defer c.Close()
	if c.ParentRanks() != nil { // the new process of --rejoin: Init returned the grown communicator
		rep, err := bench.Rejoined(ctx, c, ro, processStart)
		if err != nil {
			return err
		}
		return bench.PrintJSON(os.Stdout, []*bench.JoinerReport{rep})
	}
	sub, res, err := bench.Recover(ctx, c, ro, func() { _ = syscall.Kill(os.Getpid(), syscall.SIGKILL) })
	if sub != c {
		defer sub.Close()
	}
	if err != nil {
		return err
	}
	if res != nil {
		return bench.PrintJSON(os.Stdout, []*bench.RecoverResult{res})
	}
	return nil
}
