package main

import (
	"context"
	"flag"
	"fmt"
	"os"

	"github.com/moex-ai/moex/bench"
	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/models"
)

// benchCoalesce runs `moex bench coalesce`: the coalescing study.
func benchCoalesce(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("moex bench coalesce", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), `usage: moex bench coalesce [flags]

Sends one MoE dispatch (every rank's tokens to the ranks of their top-k experts) five
ways and measures each: (a) a message per (token, expert) pair, (b) per (token, rank),
(c) per expert, (d) one fused message per rank, as moex's dispatch sends it, and (e) the
fused message split into chunks of 4 KiB to 4 MiB. It reports messages, system calls
(tcp) or ring frames (shm), CPU seconds per GB, p50 and p99 of the slowest rank, and
tokens/s, and recommends a chunk size for this machine and transport.

`)
		fs.PrintDefaults()
	}
	var rf rankFlags
	rf.register(fs, 4)
	var o bench.CoalesceOpts
	fs.StringVar(&o.Model, "model", "deepseek-v3", "model ("+fmt.Sprint(models.Names())+"); see --hidden")
	fs.IntVar(&o.Hidden, "hidden", 0, "a layer of no model: hidden size (with --topk and --experts; tokens go to experts drawn uniformly)")
	fs.IntVar(&o.TopK, "topk", 8, "with --hidden: experts per token")
	fs.IntVar(&o.Experts, "experts", 256, "with --hidden: routed experts")
	fs.IntVar(&o.Tokens, "tokens", 128, "tokens per rank")
	wire := fs.String("wire-dtype", "bf16", "payload element type: f32, bf16 or fp8 (bytes only: nothing is converted)")
	fs.Var(bytesFlag{&o.MinChunk}, "min-chunk", "smallest chunk of the chunked way (default 4K)")
	fs.Var(bytesFlag{&o.MaxChunk}, "max-chunk", "largest chunk (default 4M); sizes double in between")
	fs.IntVar(&o.Iters, "iters", 20, "timed dispatches per way")
	fs.IntVar(&o.Warmup, "warmup", 3, "untimed dispatches per way first")
	plot := fs.String("plot", "", "write the coalescing curve (time and CPU against chunk size) to this SVG file")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := rf.check(); err != nil {
		return err
	}
	if rf.ranks < 2 {
		return &usageError{"coalesce needs --ranks 2 or more"}
	}
	switch *wire {
	case "f32":
		o.Wire = dtype.F32
	case "bf16":
		o.Wire = dtype.BF16
	case "fp8":
		o.Wire = dtype.FP8E4M3
	default:
		return &usageError{fmt.Sprintf("--wire-dtype %q: want f32, bf16 or fp8", *wire)}
	}
	explicit := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { explicit[f.Name] = true })
	cfg, err := models.Get(o.Model)
	switch {
	case o.Hidden == 0 && (explicit["topk"] || explicit["experts"]):
		return &usageError{"--topk and --experts describe a layer of no model: give --hidden too"}
	case o.Hidden != 0 && explicit["model"]:
		return &usageError{"--model and --hidden: give one"}
	case o.Hidden == 0 && err != nil:
		return &usageError{err.Error()}
	case o.Hidden < 0 || o.Hidden > 1<<16:
		return &usageError{fmt.Sprintf("--hidden %d: want 1 to 65536", o.Hidden)}
	case o.Hidden > 0 && (o.Experts < 1 || o.Experts > 1<<14 || o.TopK < 1 || o.TopK > o.Experts):
		return &usageError{fmt.Sprintf("--topk %d, --experts %d: want 1 <= topk <= experts <= 16384", o.TopK, o.Experts)}
	case o.Tokens < 1 || o.Tokens > 1<<16:
		return &usageError{fmt.Sprintf("--tokens %d: want 1 to 65536", o.Tokens)}
	case o.Iters < 1 || o.Iters > 100_000:
		return &usageError{fmt.Sprintf("--iters %d: want 1 to 100000", o.Iters)}
	case o.Warmup < 0 || o.Warmup > 10_000:
		return &usageError{fmt.Sprintf("--warmup %d: want 0 to 10000", o.Warmup)}
	case (explicit["min-chunk"] || o.MinChunk != 0) && (o.MinChunk < 256 || o.MinChunk > 1<<30),
		(explicit["max-chunk"] || o.MaxChunk != 0) && (o.MaxChunk < 256 || o.MaxChunk > 1<<30):
		return &usageError{"--min-chunk, --max-chunk: want 256 bytes to 1 GiB"}
	case o.MinChunk != 0 && o.MaxChunk != 0 && o.MaxChunk < o.MinChunk:
		return &usageError{"--max-chunk is smaller than --min-chunk"}
	}
	experts := o.Experts
	if o.Hidden == 0 { // the model's layer: --topk and --experts (their defaults) unused
		experts, o.TopK, o.Experts = cfg.Experts, 0, 0
	} else {
		o.Model = ""
	}
	if experts%rf.ranks != 0 {
		return &usageError{fmt.Sprintf("--ranks %d: %d experts must divide evenly among the ranks", rf.ranks, experts)}
	}
	if o.Warmup == 0 {
		o.Warmup = -1 // none: CoalesceOpts' zero means its default
	}
	cs, launched, err := comms(ctx, rf, append([]string{"bench", "coalesce"}, args...))
	if launched || err != nil {
		return err
	}
	defer closeAll(cs)
	bar := newProgress("coalesce: ways")
	o.Progress = bar.set
	res, err := onRank0(cs, func(c *coll.Comm) (*bench.CoalesceResult, error) {
		return bench.Coalesce(ctx, c, o, c.Rank() == 0 || len(cs) == 1)
	})
	bar.done()
	if err != nil || res == nil {
		return err
	}
	if *plot != "" {
		if err := bench.PlotCoalesce(*plot, res); err != nil {
			return err
		}
	}
	if rf.json {
		return bench.PrintJSON(os.Stdout, []*bench.CoalesceResult{res})
	}
	bench.PrintCoalesce(os.Stdout, res)
	return nil
}
