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

	"github.com/moex-ai/moex/bench"
	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/internal/launch"
	"github.com/moex-ai/moex/transport"
)

// MaxRecoverRuns bounds --runs.
const MaxRecoverRuns = 1000

// benchRecover runs `moex bench moe --kill R [--runs N]`: N jobs, in each of which rank R
// dies and the others recover; the phases' p50 and max.
func benchRecover(ctx context.Context, fs *flag.FlagSet, rf rankFlags, o bench.MoEOpts, ro bench.RecoverOpts, runs int, args []string) error {
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
	if rf.json {
		return bench.PrintJSON(os.Stdout, []*bench.RecoverSummary{s})
	}
	bench.PrintRecover(os.Stdout, s)
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
	var out bytes.Buffer
	err = launch.Run(ctx, launch.Config{N: rf.ranks, Prog: exe, Args: append([]string{"bench", "moe"}, args...), NoPrefix: true, KeepGoing: true,
		Env: []string{"MOEX_BENCH_WORKER=1", "MOEX_TRANSPORT=" + rf.transport}, Stdout: &out})
	var re *launch.RankError
	if !errors.As(err, &re) || re.Rank != ro.Victim || re.Signal != syscall.SIGKILL {
		return nil, fmt.Errorf("the job ended with %v, want rank %d killed by SIGKILL and the others done\n%s", err, ro.Victim, out.String())
	}
	sc := bufio.NewScanner(&out)
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, "{") {
			var r bench.RecoverResult
			if err := json.Unmarshal([]byte(line), &r); err != nil {
				return nil, err
			}
			return &r, nil
		}
	}
	return nil, fmt.Errorf("no survivor reported:\n%s", out.String())
}

// recoverRank is one launched rank of --kill: it serves, dies or recovers, and the
// survivors' rank 0 prints its result as a JSON line.
func recoverRank(ctx context.Context, ro bench.RecoverOpts) error {
	c, err := coll.Init(ctx, coll.Config{})
	if err != nil {
		return err
	}
	defer c.Close()
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
