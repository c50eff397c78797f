package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/moex-ai/moex/bench"
	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/internal/launch"
)

const benchUsage = `usage: moex bench coll|p2p|moe|coalesce [flags]

  coll      collectives, nccl-tests style: time, bandwidth, #wrong per size
  p2p       point-to-point bandwidth and round trip
  moe       MoE dispatch and combine: tokens/s, stage percentiles, copy floors (the
            main job)
  coalesce  one MoE dispatch sent five ways, from a message per (token, expert) to
            fused and chunked: the reference for tuning AlltoAll coalescing

Run "moex bench <name> -h" for its flags.
`

func cmdBench(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return &usageError{benchUsage}
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Print(benchUsage)
		return errHelp
	case "coll":
		return benchColl(ctx, args[1:])
	case "coalesce":
		return benchCoalesce(ctx, args[1:])
	case "p2p":
		return benchP2P(ctx, args[1:])
	case "moe":
		return benchMoE(ctx, args[1:])
	}
	return &usageError{fmt.Sprintf("moex bench: unknown benchmark %q (coll, p2p, moe, coalesce)", args[0])}
}

// describe gives fs a usage text: the synopsis, what the command does, then its flags.
func describe(fs *flag.FlagSet, synopsis, text string) {
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: %s\n\n%s\n\nflags:\n", synopsis, strings.TrimSpace(text))
		fs.PrintDefaults()
	}
}

// parseBytes reads sizes like 4096, 64K, 64KiB, 16M, 1G.
func parseBytes(s string) (int, error) {
	t := strings.ToUpper(strings.TrimSpace(s))
	t = strings.TrimSuffix(strings.TrimSuffix(t, "IB"), "B")
	mul := 1
	switch {
	case strings.HasSuffix(t, "K"):
		mul, t = 1<<10, t[:len(t)-1]
	case strings.HasSuffix(t, "M"):
		mul, t = 1<<20, t[:len(t)-1]
	case strings.HasSuffix(t, "G"):
		mul, t = 1<<30, t[:len(t)-1]
	}
	n, err := strconv.Atoi(t)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("bad size %q (want e.g. 4096, 64K, 16M)", s)
	}
	return n * mul, nil
}

// aliasFlag is a second name of a flag of fs.
type aliasFlag struct {
	fs   *flag.FlagSet
	name string
}

func (a aliasFlag) String() string {
	if a.fs == nil {
		return ""
	}
	return a.fs.Lookup(a.name).Value.String()
}

func (a aliasFlag) Set(s string) error { return a.fs.Set(a.name, s) }

type bytesFlag struct{ v *int }

// String is the value for flag's usage text: "" for 0, a flag whose default the usage
// text gives itself (0 means "the default"), so that it is not said twice.
func (b bytesFlag) String() string {
	if b.v == nil || *b.v == 0 {
		return ""
	}
	return strconv.Itoa(*b.v)
}

func (b bytesFlag) Set(s string) error {
	n, err := parseBytes(s)
	if err != nil {
		return err
	}
	*b.v = n
	return nil
}

// common flags of the multi-rank benchmarks.
type rankFlags struct {
	ranks     int
	transport string
	json      bool
}

// MaxRanks bounds --ranks: every rank of a benchmark is a goroutine or a process of
// this host.
const MaxRanks = 256

// check bounds the flags.
func (r *rankFlags) check() error {
	if r.ranks < 1 || r.ranks > MaxRanks {
		return &usageError{fmt.Sprintf("--ranks %d: want 1 to %d", r.ranks, MaxRanks)}
	}
	return nil
}

func (r *rankFlags) register(fs *flag.FlagSet, defRanks int) {
	fs.IntVar(&r.ranks, "ranks", defRanks, "number of ranks")
	fs.StringVar(&r.transport, "transport", "inproc", "inproc (goroutines of this process), tcp, shm or ucx (processes launched by moex)")
	fs.BoolVar(&r.json, "json", false, "print one JSON object per line")
}

// Bounds of the size flags of bench coll and bench p2p.
const (
	MaxBenchBytes = 1 << 30
	MaxBenchIters = 10_000_000
)

// checkSizes bounds the size, factor and iteration flags.
func checkSizes(minB, maxB, factor, iters int) error {
	switch {
	case minB < 0 || maxB > MaxBenchBytes:
		return &usageError{fmt.Sprintf("--min-bytes %d, --max-bytes %d: want 0 to %d", minB, maxB, MaxBenchBytes)}
	case maxB < minB:
		return &usageError{"--max-bytes is smaller than --min-bytes"}
	case factor < 2 || factor > 1024:
		return &usageError{fmt.Sprintf("--factor %d: want 2 to 1024", factor)}
	case iters < 0 || iters > MaxBenchIters:
		return &usageError{fmt.Sprintf("--iters %d: want 0 (automatic) to %d", iters, MaxBenchIters)}
	}
	return nil
}

// worker reports whether this process is a rank launched by a benchmark.
func worker() bool { return os.Getenv("MOEX_BENCH_WORKER") == "1" }

// comms returns this process's communicators: all of them for inproc, or this rank's
// (the benchmark relaunches itself as ranks for the other transports, and the caller
// returns launched=true in the parent).
func comms(ctx context.Context, rf rankFlags, args []string) (cs []*coll.Comm, launched bool, err error) {
	switch rf.transport {
	case "inproc":
		cs, err = coll.Local(rf.ranks, coll.Config{})
		return cs, false, err
	case "tcp", "shm", "ucx":
	default:
		return nil, false, &usageError{fmt.Sprintf("unknown transport %q (inproc, tcp, shm, ucx)", rf.transport)}
	}
	if !worker() {
		exe, err := os.Executable()
		if err != nil {
			return nil, false, err
		}
		return nil, true, launch.Run(ctx, launch.Config{
			N: rf.ranks, Prog: exe, Args: args, NoPrefix: true,
			Env: []string{"MOEX_BENCH_WORKER=1", "MOEX_TRANSPORT=" + rf.transport},
		})
	}
	c, err := coll.Init(ctx, coll.Config{})
	if err != nil {
		return nil, false, err
	}
	return []*coll.Comm{c}, false, nil
}

// onEvery runs f on every local communicator concurrently and returns their results
// (indexed like cs) and the first error.
func onEvery[T any](cs []*coll.Comm, f func(c *coll.Comm) (T, error)) ([]T, error) {
	outs := make([]T, len(cs))
	errs := make(chan error, len(cs))
	for i, c := range cs {
		go func() {
			var err error
			outs[i], err = f(c)
			errs <- err
		}()
	}
	var first error
	for range cs {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return outs, first
}

// onRank0 runs f on every local communicator and returns rank 0's result (the zero value
// in a launched rank other than 0, which prints nothing).
func onRank0[T any](cs []*coll.Comm, f func(c *coll.Comm) (T, error)) (T, error) {
	outs, err := onEvery(cs, f)
	for i, c := range cs {
		if c.Rank() == 0 {
			return outs[i], err
		}
	}
	var zero T
	return zero, err
}

func closeAll(cs []*coll.Comm) {
	for _, c := range cs {
		c.Close()
	}
}

func benchColl(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("moex bench coll", flag.ContinueOnError)
	describe(fs, "moex bench coll [flags]", `
Times one collective at sizes from --min-bytes to --max-bytes, nccl-tests style: per
size, the out-of-place and in-place forms, time (mean, p50, p90, p99 of the slowest
rank), algorithm and bus bandwidth, the results checked (#wrong), and the copy speed
of this machine in the same run. The ranks are goroutines (--transport inproc) or
processes that moex starts (shm, tcp, ucx).`)
	var rf rankFlags
	rf.register(fs, 4)
	opName := fs.String("op", "allreduce", "allreduce, alltoall, alltoallv, allgather, reducescatter, broadcast, reduce")
	o := bench.CollOpts{MinBytes: 64 << 10, MaxBytes: 16 << 20}
	fs.Var(bytesFlag{&o.MinBytes}, "min-bytes", "smallest size (per rank buffer)")
	fs.Var(bytesFlag{&o.MaxBytes}, "max-bytes", "largest size")
	fs.IntVar(&o.Factor, "factor", 2, "size multiplier between rows")
	fs.IntVar(&o.Iters, "iters", 0, "timed iterations per size (0: about 0.2 s worth)")
	fs.IntVar(&o.Root, "root", 0, "root of broadcast and reduce")
	redop := fs.String("op-reduce", "sum", "reduction: sum, prod, min, max or avg")
	fs.Var(aliasFlag{fs, "op-reduce"}, "redop", "the same as --op-reduce")
	dt := fs.String("dtype", "f32", "element type: f32, f64, i32, i64, u8, i8, bf16, f16 or fp8e4m3")
	fs.Float64Var(&o.Skew, "skew", 0, "alltoallv: every rank sends block j a share (j+1)^-skew of its buffer (0: equal blocks)")
	fs.IntVar(&o.Warmup, "warmup", 20, "untimed operations per size before the timed ones")
	plot := fs.String("plot", "", "write bandwidth and latency percentiles against size to this SVG file")
	check := fs.Bool("check", true, "check the results (#wrong column)")
	fs.BoolVar(&o.Heap, "heap", false, "allocate buffers with make (4 KiB pages) instead of obuf (huge pages from 256 KiB)")
	fs.BoolVar(&o.Shared, "shared", false, "take the buffers from obuf.Shared: shared memory that the other ranks of the host read in place (shm: one copy per byte)")
	fs.BoolVar(&o.Profile, "profile", false, "time the wait for the last rank apart from the operation (MOEX_PROFILE=1), and name that rank")
	straggle := fs.String("straggle", "", "RANK:DURATION: that rank sleeps so long before every timed operation (for example 3:200us)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := rf.check(); err != nil {
		return err
	}
	if err := checkSizes(o.MinBytes, o.MaxBytes, o.Factor, o.Iters); err != nil {
		return err
	}
	if o.Root < 0 || o.Root >= rf.ranks {
		return &usageError{fmt.Sprintf("--root %d: want 0 to %d", o.Root, rf.ranks-1)}
	}
	op, err := coll.ParseOpKind(*opName)
	if err != nil {
		return &usageError{err.Error()}
	}
	switch op {
	case coll.OpAllReduce, coll.OpAlltoAll, coll.OpAlltoAllv, coll.OpAllGather, coll.OpReduceScatter, coll.OpBroadcast, coll.OpReduce:
	default:
		return &usageError{fmt.Sprintf("--op %s: not benchmarked (allreduce, alltoall, alltoallv, allgather, reducescatter, broadcast, reduce)", op)}
	}
	o.Op, o.Check = op, *check
	if o.DType, err = dtype.Parse(*dt); err != nil {
		return &usageError{err.Error()}
	}
	switch {
	case o.Skew != 0 && op != coll.OpAlltoAllv:
		return &usageError{"--skew: alltoallv only"}
	case o.Skew < 0 || o.Skew > 10 || o.Skew != o.Skew:
		return &usageError{fmt.Sprintf("--skew %v: want 0 to 10", o.Skew)}
	case o.Warmup < 0 || o.Warmup > 100_000:
		return &usageError{fmt.Sprintf("--warmup %d: want 0 to 100000", o.Warmup)}
	}
	if o.Warmup == 0 {
		o.Warmup = -1 // none: Coll's zero means its default
	}
	if o.RedOp, err = dtype.ParseOp(*redop); err != nil {
		return &usageError{err.Error()}
	}
	if *straggle != "" {
		r, d, ok := strings.Cut(*straggle, ":")
		rank, err1 := strconv.Atoi(r)
		delay, err2 := time.ParseDuration(d)
		if !ok || err1 != nil || err2 != nil || rank < 0 || rank >= rf.ranks || delay < 0 {
			return &usageError{fmt.Sprintf("--straggle %q: want RANK:DURATION with RANK in [0,%d)", *straggle, rf.ranks)}
		}
		o.StraggleRank, o.StraggleDelay = rank, delay
	}
	if o.Profile {
		os.Setenv("MOEX_PROFILE", "1") // for the communicators below, and ranks launched
	}
	cs, launched, err := comms(ctx, rf, append([]string{"bench", "coll"}, args...))
	if launched || err != nil {
		return err
	}
	defer closeAll(cs)
	bar := newProgress("coll: sizes")
	o.Progress = bar.set
	rows, err := onRank0(cs, func(c *coll.Comm) ([]bench.CollResult, error) { return bench.Coll(ctx, c, o) })
	bar.done()
	if err != nil {
		return err
	}
	if len(rows) > 0 {
		ri := bench.NewRunInfo(cs[0], "moex bench coll "+strings.Join(args, " "))
		for i := range rows {
			rows[i].Run = ri
		}
	}
	if *plot != "" && len(rows) > 0 {
		if err := bench.PlotColl(*plot, rows); err != nil {
			return err
		}
	}
	if rf.json {
		return bench.PrintJSON(os.Stdout, rows)
	}
	bench.PrintColl(os.Stdout, rows)
	return nil
}

func benchP2P(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("moex bench p2p", flag.ContinueOnError)
	describe(fs, "moex bench p2p [flags]", `
Measures point-to-point bandwidth (one direction, messages from --min-bytes to
--max-bytes) and the round trip of small messages between two ranks over a transport.`)
	var rf rankFlags
	rf.register(fs, 2)
	minB, maxB := 8, 16<<20
	fs.Var(bytesFlag{&minB}, "min-bytes", "smallest message")
	fs.Var(bytesFlag{&maxB}, "max-bytes", "largest message")
	factor := fs.Int("factor", 8, "size multiplier between rows")
	iters := fs.Int("iters", 0, "messages per size (0: automatic)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := rf.check(); err != nil {
		return err
	}
	if rf.ranks < 2 {
		return &usageError{"p2p needs --ranks 2 or more"}
	}
	if err := checkSizes(minB, maxB, *factor, *iters); err != nil {
		return err
	}
	var sizes []int
	for s := max(minB, 1); s <= maxB; s *= max(*factor, 2) {
		sizes = append(sizes, s)
	}
	cs, launched, err := comms(ctx, rf, append([]string{"bench", "p2p"}, args...))
	if launched || err != nil {
		return err
	}
	defer closeAll(cs)
	rows, err := onRank0(cs, func(c *coll.Comm) ([]bench.P2PResult, error) { return bench.P2P(ctx, c, sizes, *iters) })
	if err != nil {
		return err
	}
	if rf.json {
		return bench.PrintJSON(os.Stdout, rows)
	}
	bench.PrintP2P(os.Stdout, rows)
	return nil
}
