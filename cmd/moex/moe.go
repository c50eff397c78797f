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

func benchMoE(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("moex bench moe", flag.ContinueOnError)
	var rf rankFlags
	rf.register(fs, 4)
	var o bench.MoEOpts
	check := moeFlags(fs, &o)
	fs.StringVar(&o.Compute, "compute", "none", "experts: none (identity) or ffn (the reference SwiGLU at the model's sizes)")
	fs.IntVar(&o.Iters, "iters", 0, "timed steps (0: about a second's worth)")
	fs.BoolVar(&o.Naive, "naive", false, "also time a naive dispatch (one message per token-expert pair)")
	fs.BoolVar(&o.Profile, "profile", false, "time the AlltoAllvs' wait for the last rank apart from moving (MOEX_PROFILE=1)")
	list := fs.Bool("models", false, "list the models and exit")
	if err := fs.Parse(args); err != nil {
		return &usageError{err.Error()}
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
	if o.Profile {
		os.Setenv("MOEX_PROFILE", "1") // for the communicators below, and ranks launched
	}
	cs, launched, err := comms(ctx, rf, append([]string{"bench", "moe"}, args...))
	if launched || err != nil {
		return err
	}
	defer closeAll(cs)
	o.LocalRanks = len(cs)
	res, err := onRank0(cs, func(c *coll.Comm) (*bench.MoEResult, error) { return bench.MoE(ctx, c, o) })
	if err != nil {
		return err
	}
	if res == nil {
		return nil // a rank other than 0 of a launched job
	}
	if rf.json {
		return bench.PrintJSON(os.Stdout, []*bench.MoEResult{res})
	}
	bench.PrintMoE(os.Stdout, res)
	return nil
}

// moeFlags registers the flags that choose a MoE layer and its tokens (model, tokens,
// wire type, placement) and returns the check to run after parsing, which also sets
// o.Wire.
func moeFlags(fs *flag.FlagSet, o *bench.MoEOpts) func() error {
	fs.StringVar(&o.Model, "model", "mixtral-8x7b", "model (moex bench moe -models lists them)")
	fs.IntVar(&o.Tokens, "tokens", 512, "tokens per rank")
	wire := fs.String("wire-dtype", "f32", "activations on the wire: f32 or bf16")
	fs.StringVar(&o.Placement, "placement", "contiguous", "expert placement: contiguous or roundrobin")
	return func() error {
		if _, err := models.Get(o.Model); err != nil {
			return &usageError{err.Error()}
		}
		switch *wire {
		case "f32":
			o.Wire = dtype.F32
		case "bf16":
			o.Wire = dtype.BF16
		default:
			return &usageError{fmt.Sprintf("--wire-dtype %q: want f32 or bf16", *wire)}
		}
		if o.Tokens < 0 {
			return &usageError{"--tokens must not be negative"}
		}
		return nil
	}
}
