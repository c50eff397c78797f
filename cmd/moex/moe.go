package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"os/exec"
	"slices"
	"strings"

	"github.com/moex-ai/moex/bench"
	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/models"
)

func benchMoE(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("moex bench moe", flag.ContinueOnError)
	describe(fs, "moex bench moe [flags]", `
The main job: one MoE layer of a real model (--model) under expert parallelism. Every
rank routes its tokens, dispatches them to the experts' ranks, runs the experts
(identity, or the model's SwiGLU with --compute ffn) and combines the outputs, step
after step. It prints tokens/s, each stage's p50/p90/p99 beside its copy floor (the
bytes each rank must move at this machine's copy speed), the bytes on the wire, the
buffers per rank, the error against the single-process reference, and a verdict line.
--sweep, --eplb, --kill and --levels run the studies their flags describe.`)
	var rf rankFlags
	rf.register(fs, 4)
	var o bench.MoEOpts
	check := moeFlags(fs, &o)
	fs.StringVar(&o.Compute, "compute", "none", "experts: none (identity) or ffn (the reference SwiGLU at the model's sizes)")
	fs.IntVar(&o.Iters, "iters", 0, "timed steps (0: about a second's worth)")
	fs.BoolVar(&o.Quantized, "quantized", false, "the experts take the fp8 or int8 rows and their scales, not rows dequantised for them (needs --wire-dtype fp8 or int8)")
	fs.BoolVar(&o.TokensInBuffer, "tokens-in-buffer", false, "low-latency mode: each timed step's tokens are written where the dispatcher's Buffer says, as the layer before would write them, so that the dispatch stages none (not where it pushes rows, nor with an fp8 or int8 wire)")
	fs.BoolVar(&o.Naive, "naive", false, "also time a naive dispatch (one message per token-expert pair)")
	fs.BoolVar(&o.Overlap, "overlap", false, "also time the step as micro-batches in a pipeline (one's rows move while another's experts compute) against one after the other")
	fs.IntVar(&o.Chunks, "chunks", 2, "micro-batches of --overlap")
	fs.IntVar(&o.Pairs, "pairs", 32, "dispatch-then-combine pairs run back to back for the pair period")
	fs.BoolVar(&o.Profile, "profile", false, "time the stages' wait for the last rank (in the AlltoAllvs, apart from moving; in the low-latency exchanges) and name the ranks waited for (MOEX_PROFILE=1)")
	var eo bench.EPLBOpts
	fs.IntVar(&eo.Every, "eplb", 0, "serve with skewed routing (--skew), record the experts' load and rebalance every N steps (router.Rebalance); prints tokens/s and rank imbalance before and after")
	fs.Float64Var(&eo.Skew, "skew", 0, "with --eplb: Zipf exponent of the experts' popularity (0: uniform)")
	fs.IntVar(&eo.Redundant, "redundant", 8, "with --eplb: physical expert slots beyond one per expert (experts + redundant must be a multiple of --ranks)")
	fs.Float64Var(&eo.ExpertUS, "expert-us", 0, "with --eplb: each (token, expert) row costs its rank this many microseconds, slept as for an accelerator (0: identity experts)")
	var ro bench.RecoverOpts
	fs.IntVar(&ro.Victim, "kill", -1, "kill this rank (SIGKILL; over inproc, its transport) after a few steps, every expert on two ranks: the survivors shrink (Comm.Shrink), recover (dispatch.Recover) and serve a step; prints the time of each phase")
	runs := fs.Int("runs", 1, "with --kill: jobs to run, for p50 and max")
	fs.BoolVar(&ro.Rejoin, "rejoin", false, "with --kill (over shm or tcp): the launcher starts a process that takes the dead rank over (moex run --restarts); the survivors serve on, admit it (Comm.Admit), move experts onto it (dispatch.Grow) and serve 20 more steps with it; prints the timeline and tokens/s at every step")
	fs.Var(bytesFlag{&ro.WeightBytes}, "weight-bytes", "with --kill: bytes of weights per expert, moved to the ranks that take an expert over (default 64K)")
	rdzv := fs.String("rdzv", "", "with --kill --rejoin or --chaos: the ranks meet in etcd at this address (etcd://host:port/name; each job adds a fresh suffix to the name), and a process started again for a dead rank takes it over through it, as under Kubernetes, rather than through moex run's registry")
	chaosFor := fs.Duration("chaos", 0, "serve for this long (10s to 24h) under moex run --restarts, the ranks healing themselves (Shrink, Recover, Admit, Grow; every token checked), while a random rank, rank 0 included, is SIGKILLed every 5 to 15 s (1 time in 4 SIGSTOPped for 1 to 3 s instead); prints kills, regrows, wrong tokens, failures, hangs, the share of the time at full strength, and steps/s before the first kill and after each regrow")
	levels := fs.String("levels", "", "ranks on several hosts: flat, two (dispatch.TwoLevel: a token crosses to a host once, its relay hands it on), auto (as dispatch.ChooseTwoLevel picks) or compare (flat, then two); prints step time and bytes within and across hosts")
	windows := fs.String("windows", "", "how the low-latency exchanges reach peers: auto (into same-host peers' memory, or put into UCX peers' registered windows), off (tag messages: MOEX_WINDOWS=0) or compare (both, one job each, and their ratio); default compare over ucx in the low-latency mode, else auto")
	list := fs.Bool("models", false, "list the models and exit")
	plot := fs.String("plot", "", "write a stacked bar of dispatch, expert compute and combine to this SVG file (with --sweep: time and buffers against the swept value)")
	sweep := fs.String("sweep", "", "ranks or tokens: run the step at 2..8 ranks (2..64 over inproc) or 1..512 tokens per rank, each in a job of its own, and print how each stage's time and each rank's buffers grow, beside DeepEP's low-latency buffer")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *list {
		for _, n := range models.Names() {
			c, _ := models.Get(n)
			fmt.Printf("%-16s hidden %5d  expert ffn %5d  experts %3d  top-%d  shared %d  %s\n", n, c.Hidden, c.ExpertFFN, c.Experts, c.TopK, c.Shared, c.Gating)
		}
		return nil
	}
	if err := check(); err != nil {
		return err
	}
	if err := rf.check(); err != nil {
		return err
	}
	if *sweep != "" {
		return benchSweep(ctx, fs, rf, *sweep, *plot)
	}
	switch {
	case o.Iters < 0 || o.Iters > 1_000_000:
		return &usageError{fmt.Sprintf("--iters %d: want 0 (automatic) to 1000000", o.Iters)}
	case o.Chunks < 1 || o.Chunks > 64:
		return &usageError{fmt.Sprintf("--chunks %d: want 1 to 64", o.Chunks)}
	case o.Pairs < 1 || o.Pairs > 1_000_000:
		return &usageError{fmt.Sprintf("--pairs %d: want 1 to 1000000", o.Pairs)}
	case o.Quantized && o.Wire != dtype.FP8E4M3 && o.Wire != dtype.I8:
		return &usageError{"--quantized: needs --wire-dtype fp8 or int8"}
	case o.TokensInBuffer && (o.Mode != dispatch.LowLatency || o.PushRows || o.Wire != o.Act):
		return &usageError{"--tokens-in-buffer: only with --mode low-latency, without --push-rows, and with the wire type of the activations"}
	case o.Overlap && o.Tokens < o.Chunks:
		return &usageError{fmt.Sprintf("--overlap: %d tokens cannot make %d micro-batches", o.Tokens, o.Chunks)}
	}
	if (eo.Every != 0 || (ro.Victim >= 0 && !ro.Rejoin) || *levels != "") && *plot != "" {
		return &usageError{"--plot: only for the plain run or --kill --rejoin (not with --eplb, --kill alone or --levels)"}
	}
	if (eo.Every != 0 || ro.Victim >= 0 || *levels != "") && (o.SendPartials || o.PushRows || o.TokensInBuffer || o.SumAtOrigin) {
		return &usageError{"--send-partials, --push-rows, --tokens-in-buffer, --sum-at-origin: only for the plain run (not with --eplb, --kill or --levels)"}
	}
	if *chaosFor != 0 || *rdzv != "" {
		ro.Rdzv = *rdzv
		if done, err := chaosFlags(ctx, rf, o, ro, *chaosFor, eo.Every != 0 || *levels != "" || *plot != "" || *runs != 1, args); done || err != nil {
			return err
		}
	}
	if eo.Every != 0 {
		if ro.Victim >= 0 {
			return &usageError{"--eplb and --kill: one at a time"}
		}
		return benchEPLB(ctx, fs, rf, o, eo, args)
	}
	if err := noneSet(fs, "--eplb", "skew", "redundant", "expert-us"); err != nil {
		return err
	}
	if ro.Victim >= 0 {
		return benchRecover(ctx, fs, rf, o, ro, *runs, *plot, args)
	}
	if *levels != "" {
		return benchLevels(ctx, rf, o, *levels, args)
	}
	if err := noneSet(fs, "--kill", "runs", "weight-bytes", "rejoin"); err != nil {
		return err
	}
	switch w := windowsFlag(*windows, rf.transport, o.Mode); w {
	case "compare":
		if *plot != "" || rf.json {
			return &usageError{"--windows compare: not with --plot or --json (run --windows auto and off)"}
		}
		return compareWindows(ctx, fs)
	case "off":
		os.Setenv("MOEX_WINDOWS", "0") // for the communicators below, and ranks launched
	case "auto":
	default:
		return &usageError{fmt.Sprintf("--windows %q: want auto, off or compare", w)}
	}
	if o.Profile {
		os.Setenv("MOEX_PROFILE", "1") // for the communicators below, and ranks launched
	}
	if !worker() && !rf.json {
		// A word on stderr before the run's seconds of silence (the table comes at the end).
		fmt.Fprintf(os.Stderr, "moex bench moe: %s, %d ranks over %s, %d tokens per rank: timing the steps...\n", o.Model, rf.ranks, rf.transport, o.Tokens)
	}
	cs, launched, err := comms(ctx, rf, append([]string{"bench", "moe"}, args...))
	if launched || err != nil {
		return err
	}
	defer closeAll(cs)
	o.LocalRanks = len(cs)
	bar := newProgress("moe: steps")
	o.Progress = bar.set
	res, err := onRank0(cs, func(c *coll.Comm) (*bench.MoEResult, error) { return bench.MoE(ctx, c, o) })
	bar.done()
	if err != nil {
		return err
	}
	if res == nil {
		return nil // a rank other than 0 of a launched job
	}
	res.Run = bench.NewRunInfo(cs[0], "moex bench moe "+strings.Join(args, " "))
	if *plot != "" {
		if err := plotModes(ctx, fs, *plot, res, o); err != nil {
			return err
		}
	}
	if rf.json {
		return bench.PrintJSON(os.Stdout, []*bench.MoEResult{res})
	}
	bench.PrintMoE(os.Stdout, res)
	return nil
}

// windowsFlag is --windows with its default filled: compare over ucx in the
// low-latency mode (one-sided windows against tag messages), else auto.
func windowsFlag(v, transport string, mode dispatch.Mode) string {
	if v != "" {
		return v
	}
	if transport == "ucx" && mode == dispatch.LowLatency {
		return "compare"
	}
	return "auto"
}

// compareWindows runs the step twice, each a job of its own with the run's other flags:
// the exchanges through windows (one-sided over ucx) and as tag messages; it prints both
// and the ratio of their step times.
func compareWindows(ctx context.Context, fs *flag.FlagSet) error {
	var rs []*bench.MoEResult
	for _, w := range []string{"auto", "off"} {
		r, err := childRun(ctx, fs, map[string]string{"windows": w}, "windows")
		if err != nil {
			return err
		}
		rs = append(rs, r)
	}
	for i, r := range rs {
		fmt.Printf("== windows %s\n", []string{"auto (one-sided where the transport can)", "off (tag messages)"}[i])
		bench.PrintMoE(os.Stdout, r)
		fmt.Println()
	}
	if rs[0].StepUS > 0 {
		fmt.Printf("windows against tag messages: step %.1f us vs %.1f us (%.2fx), dispatch %.1f vs %.1f us, combine %.1f vs %.1f us\n",
			rs[0].StepUS, rs[1].StepUS, rs[1].StepUS/rs[0].StepUS, rs[0].Dispatch.MeanUS, rs[1].Dispatch.MeanUS, rs[0].Combine.MeanUS, rs[1].Combine.MeanUS)
	}
	return nil
}

// plotModes draws the step of res beside the same step in the other modes of one host's
// serving (normal and low-latency, each run as a job of its own with the run's other
// flags): the plot compares how the modes spend a step.
func plotModes(ctx context.Context, fs *flag.FlagSet, path string, res *bench.MoEResult, o bench.MoEOpts) error {
	rs := []*bench.MoEResult{res}
	for _, m := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		if m.String() == res.StepMode || m == dispatch.LowLatency && o.Tokens > dispatch.MaxLowLatencyTokens {
			continue
		}
		r, err := childRun(ctx, fs, map[string]string{"mode": m.String()}, "plot", "mode", "push-rows", "send-partials", "tokens-in-buffer")
		if err != nil {
			return err
		}
		rs = append(rs, r)
	}
	return bench.PlotMoE(path, rs)
}

// childRun runs moex bench moe --json in a process of its own, with the flags set on fs
// but those named in drop, and with set's values, and returns its result.
func childRun(ctx context.Context, fs *flag.FlagSet, set map[string]string, drop ...string) (*bench.MoEResult, error) {
	args := []string{"bench", "moe", "--json"}
	fs.Visit(func(f *flag.Flag) {
		if f.Name != "json" && !slices.Contains(drop, f.Name) {
			args = append(args, "--"+f.Name+"="+f.Value.String())
		}
	})
	for k, v := range set {
		args = append(args, "--"+k+"="+v)
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, exe, args...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("moex %s: %w", strings.Join(args, " "), err)
	}
	var res bench.MoEResult
	lines := bytes.Split(bytes.TrimSpace(out), []byte("\n"))
	if err := json.Unmarshal(lines[len(lines)-1], &res); err != nil {
		return nil, fmt.Errorf("moex %s: %w", strings.Join(args, " "), err)
	}
	return &res, nil
}

// moeFlags registers the flags that choose a MoE layer and its tokens (model, tokens,
// wire type, mode, placement) and returns the check to run after parsing, which also
// sets o.Wire and o.Mode.
func moeFlags(fs *flag.FlagSet, o *bench.MoEOpts) func() error {
	fs.StringVar(&o.Model, "model", "mixtral-8x7b", "model (moex bench moe -models lists them)")
	fs.IntVar(&o.Tokens, "tokens", 512, "tokens per rank")
	wire := fs.String("wire-dtype", "f32", "activations on the wire: f32, bf16, fp8 (e4m3, a scale per 128 values) or int8 (a scale per token)")
	act := fs.String("act", "f32", "activations: f32 or bf16")
	back := fs.String("combine-dtype", "", "partial sums on the way back: f32, bf16, fp8 or int8 (default: f32 with an f32 wire, else bf16)")
	mode := fs.String("mode", "auto", "auto (the library's default: each step low-latency when every rank's tokens fit in dispatch.AutoMaxTokens, else normal), normal (counts all-gather, then an exact-size AlltoAllv), low-latency (buffers sized for --tokens, counts travel with the rows) or gathered (every token all-gathered, the sums reduce-scattered back)")
	fs.StringVar(&o.Placement, "placement", "contiguous", "expert placement: contiguous or roundrobin")
	fs.IntVar(&o.MaxBufferBytes, "max-buffer-bytes", 0, "a rank's dispatch and combine buffers: how far the auto mode grows them, and the largest normal-mode step (0: dispatch.DefaultMaxBufferBytes, 1 GiB; -1: no bound)")
	fs.BoolVar(&o.SendPartials, "send-partials", false, "low-latency mode: the combine sends partial sums even where ranks can read the expert outputs in each other's memory")
	fs.BoolVar(&o.SumAtOrigin, "sum-at-origin", false, "the combine sends the expert outputs back unsummed and each token's rank adds them in the order of its choices: the bits of one process, for more bytes")
	fs.BoolVar(&o.PushRows, "push-rows", false, "low-latency mode: the dispatch writes each token into every destination's memory even where the experts could read it in its origin's")
	return func() error {
		if _, err := models.Get(o.Model); err != nil {
			return &usageError{err.Error()}
		}
		switch *wire {
		case "f32":
			o.Wire = dtype.F32
		case "bf16":
			o.Wire = dtype.BF16
		case "fp8", "fp8e4m3", "e4m3":
			o.Wire = dtype.FP8E4M3
		case "int8", "i8":
			o.Wire = dtype.I8
		default:
			return &usageError{fmt.Sprintf("--wire-dtype %q: want f32, bf16, fp8 or int8", *wire)}
		}
		switch *act {
		case "f32":
			o.Act = dtype.F32
		case "bf16":
			o.Act = dtype.BF16
		default:
			return &usageError{fmt.Sprintf("--act %q: want f32 or bf16", *act)}
		}
		switch *back {
		case "":
		case "f32":
			o.Combine = dtype.F32
		case "bf16":
			o.Combine = dtype.BF16
		case "fp8", "fp8e4m3", "e4m3":
			o.Combine = dtype.FP8E4M3
		case "int8", "i8":
			o.Combine = dtype.I8
		default:
			return &usageError{fmt.Sprintf("--combine-dtype %q: want f32, bf16, fp8 or int8", *back)}
		}
		m, err := dispatch.ParseMode(*mode)
		if err != nil {
			return &usageError{fmt.Sprintf("--mode %q: want auto, normal, low-latency or gathered", *mode)}
		}
		o.Mode = m
		switch o.Placement {
		case "contiguous", "roundrobin", "round-robin":
		default:
			return &usageError{fmt.Sprintf("--placement %q: want contiguous or roundrobin", o.Placement)}
		}
		if o.Tokens < 0 || o.Tokens > dispatch.MaxLowLatencyTokens {
			return &usageError{fmt.Sprintf("--tokens %d: want 0 to %d", o.Tokens, dispatch.MaxLowLatencyTokens)}
		}
		if o.MaxBufferBytes < -1 || o.MaxBufferBytes > dispatch.MaxBufferBytesLimit {
			return &usageError{fmt.Sprintf("--max-buffer-bytes %d: want -1 (no bound), 0 (the default) or up to %d", o.MaxBufferBytes, dispatch.MaxBufferBytesLimit)}
		}
		if o.SumAtOrigin && o.Mode == dispatch.Gathered {
			return &usageError{"--sum-at-origin: not with --mode gathered, which adds the partial sums on the way"}
		}
		if o.SumAtOrigin && o.Combine != 0 && o.Combine != o.Act {
			return &usageError{fmt.Sprintf("--sum-at-origin: the outputs travel in the activations' type (%v), not --combine-dtype %s", o.Act, *back)}
		}
		if o.Mode == dispatch.Gathered && o.Combine != 0 && o.Combine != dtype.F32 && o.Combine != dtype.BF16 {
			return &usageError{fmt.Sprintf("--combine-dtype %s: the gathered mode adds the partial sums on the way; want f32 or bf16", *back)}
		}
		if o.SendPartials && o.Mode != dispatch.LowLatency && o.Mode != dispatch.Auto {
			return &usageError{"--send-partials: only with --mode low-latency (or auto)"}
		}
		if o.PushRows && o.Mode != dispatch.LowLatency && o.Mode != dispatch.Auto {
			return &usageError{"--push-rows: only with --mode low-latency (or auto)"}
		}
		return nil
	}
}

// benchEPLB runs `moex bench moe --eplb N`.
func benchEPLB(ctx context.Context, fs *flag.FlagSet, rf rankFlags, o bench.MoEOpts, eo bench.EPLBOpts, args []string) error {
	cfg, _ := models.Get(o.Model)
	switch {
	case eo.Every < 2 || eo.Every > 1_000_000:
		return &usageError{fmt.Sprintf("--eplb %d: want 2 to 1000000 steps", eo.Every)}
	case o.Iters != 0 && (o.Iters < 2*eo.Every || o.Iters > 10_000_000):
		return &usageError{fmt.Sprintf("--iters %d: want at least two periods of --eplb (%d) and at most 10000000", o.Iters, 2*eo.Every)}
	case eo.Skew < 0 || eo.Skew > 10 || math.IsNaN(eo.Skew):
		return &usageError{fmt.Sprintf("--skew %v: want 0 to 10", eo.Skew)}
	case eo.Redundant < 0 || (cfg.Experts+eo.Redundant)%rf.ranks != 0 || cfg.Experts+eo.Redundant > cfg.Experts*rf.ranks:
		return &usageError{fmt.Sprintf("--redundant %d: %d experts + %d slots must be a multiple of %d ranks, at most one replica of an expert per rank", eo.Redundant, cfg.Experts, eo.Redundant, rf.ranks)}
	case eo.ExpertUS < 0 || eo.ExpertUS > 1e6 || math.IsNaN(eo.ExpertUS):
		return &usageError{fmt.Sprintf("--expert-us %v: want 0 to 1000000", eo.ExpertUS)}
	case o.Act != dtype.F32 || o.Quantized || o.Naive || o.Overlap || o.Profile || o.Compute != "none":
		return &usageError{"--eplb: f32 activations and identity or --expert-us experts only (not with --act bf16, --quantized, --naive, --overlap, --profile or --compute)"}
	case o.Combine != 0:
		return &usageError{"--eplb: not with --combine-dtype"}
	}
	eo.Model, eo.Tokens, eo.Wire, eo.Mode, eo.Steps, eo.Placement = o.Model, o.Tokens, o.Wire, o.Mode, o.Iters, o.Placement
	eo.MaxBufferBytes = o.MaxBufferBytes
	cs, launched, err := comms(ctx, rf, append([]string{"bench", "moe"}, args...))
	if launched || err != nil {
		return err
	}
	defer closeAll(cs)
	res, err := onRank0(cs, func(c *coll.Comm) (*bench.EPLBResult, error) { return bench.EPLB(ctx, c, eo) })
	if err != nil || res == nil {
		return err
	}
	if rf.json {
		return bench.PrintJSON(os.Stdout, []*bench.EPLBResult{res})
	}
	bench.PrintEPLB(os.Stdout, res)
	return nil
}

// noneSet refuses the named flags (without their dashes) when they were given on the
// command line: they belong to the mode that flag names.
func noneSet(fs *flag.FlagSet, mode string, names ...string) error {
	var err error
	fs.Visit(func(f *flag.Flag) {
		for _, n := range names {
			if f.Name == n && err == nil {
				err = &usageError{fmt.Sprintf("--%s: only with %s", n, mode)}
			}
		}
	})
	return err
}

// benchLevels runs `moex bench moe --levels flat|two|auto|compare`.
func benchLevels(ctx context.Context, rf rankFlags, o bench.MoEOpts, levels string, args []string) error {
	var runs []string
	switch levels {
	case "flat", "two", "auto":
		runs = []string{levels}
	case "compare":
		runs = []string{"flat", "two"}
	default:
		return &usageError{fmt.Sprintf("--levels %q: want flat, two, auto or compare", levels)}
	}
	switch {
	case o.Act != dtype.F32 || o.Quantized || o.Naive || o.Overlap || o.Profile || o.Compute != "none":
		return &usageError{"--levels: f32 activations and identity experts only (not with --act bf16, --quantized, --naive, --overlap, --profile or --compute)"}
	case o.Mode == dispatch.Gathered:
		return &usageError{"--levels: the normal or the low-latency mode"}
	case o.Tokens < 1:
		return &usageError{"--levels: at least one token per rank"}
	}
	cs, launched, err := comms(ctx, rf, append([]string{"bench", "moe"}, args...))
	if launched || err != nil {
		return err
	}
	defer closeAll(cs)
	var out []*bench.LevelsResult
	for _, l := range runs {
		res, err := onRank0(cs, func(c *coll.Comm) (*bench.LevelsResult, error) { return bench.Levels(ctx, c, o, l) })
		if err != nil {
			return err
		}
		if res != nil {
			out = append(out, res)
		}
	}
	if len(out) == 0 {
		return nil
	}
	if rf.json {
		return bench.PrintJSON(os.Stdout, out)
	}
	bench.PrintLevels(os.Stdout, out)
	return nil
}

// benchSweep runs `moex bench moe --sweep ranks|tokens`: the same command, without
// --sweep, --plot and --json, at each point, as a job of its own, and prints the table
// (or its rows as JSON) and draws the plot.
func benchSweep(ctx context.Context, fs *flag.FlagSet, rf rankFlags, what, plot string) error {
	values, err := bench.SweepValues(what, rf.transport)
	if err != nil {
		return &usageError{err.Error()}
	}
	if err := noneSet(fs, "a plain run (not --sweep)", "eplb", "kill", "levels", "naive", "overlap", "profile"); err != nil {
		return err
	}
	swept := map[string]string{"ranks": "ranks", "tokens": "tokens"}[what]
	var rs []*bench.MoEResult
	for _, v := range values {
		res, err := childRun(ctx, fs, map[string]string{swept: fmt.Sprint(v)}, "sweep", "plot", swept)
		if err != nil {
			return err
		}
		rs = append(rs, res)
	}
	if plot != "" {
		if err := bench.PlotSweep(plot, what, rs); err != nil {
			return err
		}
	}
	if rf.json {
		return bench.PrintJSON(os.Stdout, rs)
	}
	bench.PrintSweep(os.Stdout, what, rs)
	return nil
}
