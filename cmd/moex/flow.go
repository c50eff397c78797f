package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/moex-ai/moex/bench"
	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/models"
)

// cmdFlow draws the data flow of one MoE step: which primitive, which link, how many
// bytes, in what order. It runs the step once with ranks as goroutines (identity
// experts) on the placement of ranks on hosts given by --hosts, and prints what every
// rank sent where.
func cmdFlow(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("moex flow", flag.ContinueOnError)
	var o bench.MoEOpts
	ranks := fs.Int("ranks", 4, "number of ranks")
	check := moeFlags(fs, &o)
	hostsFlag := fs.String("hosts", "", "host of each rank, comma separated (for example 0,0,1,1; default: one host)")
	plans := fs.Bool("plans", false, "also print each rank's AlltoAllv schedules")
	if err := fs.Parse(args); err != nil {
		return &usageError{err.Error()}
	}
	if *ranks < 1 {
		return &usageError{fmt.Sprintf("--ranks %d", *ranks)}
	}
	if err := check(); err != nil {
		return err
	}
	cfg := coll.Config{}
	if *hostsFlag != "" {
		parts := strings.Split(*hostsFlag, ",")
		if len(parts) != *ranks {
			return &usageError{fmt.Sprintf("--hosts names %d hosts for %d ranks", len(parts), *ranks)}
		}
		for _, s := range parts {
			h, err := strconv.Atoi(strings.TrimSpace(s))
			if err != nil || h < 0 {
				return &usageError{fmt.Sprintf("--hosts: %q is not a host number", s)}
			}
			cfg.Hosts = append(cfg.Hosts, h)
		}
		// Between hosts the network's costs, within them shared memory's: what a real job
		// on this placement would see.
		cfg.Link, cfg.HostLink = &coll.CostNet, &coll.CostShm
	}
	cs, err := coll.Local(*ranks, cfg)
	if err != nil {
		return err
	}
	defer closeAll(cs)
	frs, err := onEvery(cs, func(c *coll.Comm) (*bench.FlowRank, error) { return bench.Flow(ctx, c, o) })
	if err != nil {
		return err
	}
	printFlow(os.Stdout, o, cs[0], frs, *plans)
	return nil
}

func printFlow(w io.Writer, o bench.MoEOpts, c *coll.Comm, frs []*bench.FlowRank, plans bool) {
	mc, _ := models.Get(o.Model)
	p := len(frs)
	fmt.Fprintf(w, "# moex flow: one MoE step of %s (hidden %d, %d experts, top-%d, %s), %d ranks on %d host(s), %d tokens per rank, %s on the wire\n\n",
		o.Model, mc.Hidden, mc.Experts, mc.TopK, frs[0].Gating, p, c.Hosts(), o.Tokens, o.Wire)
	fmt.Fprintln(w, "1. route (every rank, local): gate, top-k, weights; experts by rank:")
	for _, fr := range frs {
		fmt.Fprintf(w, "     rank %d (host %d): experts %s\n", fr.Rank, fr.Host, spans(fr.LocalExperts))
	}
	f := frs[0]
	fmt.Fprintf(w, "\n2. counts (AllGather, %v): %d int64 per rank (a header, then rows per destination), %d B in all; skipped when the routing repeats (Redispatch)\n",
		f.CountsAlgo, f.CountsInts, f.CountsInts*8*p)
	fmt.Fprintf(w, "\n3. dispatch (AlltoAllv, %v): one message per destination rank; a row is %d B (activations, expert ids, weights), once per rank however many of its experts the token chose\n",
		f.DispatchAlgo, f.RowBytes)
	matrix(w, c, frs, func(fr *bench.FlowRank, q int) int { return fr.RowsTo[q] * fr.RowBytes })
	fmt.Fprintln(w, "\n4. experts (every rank, local): rows per local expert (expert-major blocks)")
	for _, fr := range frs {
		if len(fr.LocalExperts) > 16 {
			lo, hi, sum := fr.RowsPerExpert[0], fr.RowsPerExpert[0], 0
			for _, n := range fr.RowsPerExpert {
				lo, hi, sum = min(lo, n), max(hi, n), sum+n
			}
			fmt.Fprintf(w, "     rank %d: %d experts, %d rows, %d to %d per expert\n", fr.Rank, len(fr.LocalExperts), sum, lo, hi)
			continue
		}
		var parts []string
		for i, e := range fr.LocalExperts {
			parts = append(parts, fmt.Sprintf("e%d:%d", e, fr.RowsPerExpert[i]))
		}
		fmt.Fprintf(w, "     rank %d: %s\n", fr.Rank, strings.Join(parts, " "))
	}
	fmt.Fprintf(w, "\n5. combine (AlltoAllv, %v): each rank sums its experts' outputs per token, weighted, and sends one partial sum of %d B back per (token, rank): the dispatch matrix transposed\n",
		f.CombineAlgo, f.CombineBytes)
	matrix(w, c, frs, func(fr *bench.FlowRank, q int) int { return frs[q].RowsTo[fr.Rank] * fr.CombineBytes })
	fmt.Fprintln(w, "\n6. sum (every rank, local): its own experts' terms first, then the other ranks' partial sums in rank order (bitwise reproducible)")
	if plans {
		for _, fr := range frs {
			fmt.Fprintf(w, "\ndispatch schedule, %s", fr.DispatchPlan)
			fmt.Fprintf(w, "combine schedule, %s", fr.CombinePlan)
		}
	}
}

// matrix prints bytes from each rank (rows) to each rank (columns), and the totals
// within hosts and across them.
func matrix(w io.Writer, c *coll.Comm, frs []*bench.FlowRank, bytes func(fr *bench.FlowRank, to int) int) {
	p := len(frs)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := "     from \\ to\t"
	for q := 0; q < p; q++ {
		head += fmt.Sprintf("%d\t", q)
	}
	fmt.Fprintln(tw, head)
	within, across := 0, 0
	for _, fr := range frs {
		line := fmt.Sprintf("     %d\t", fr.Rank)
		for q := 0; q < p; q++ {
			n := bytes(fr, q)
			switch {
			case q == fr.Rank:
				line += "(local)\t"
				continue
			case c.Host(q) == c.Host(fr.Rank):
				within += n
			default:
				across += n
				line += "*"
			}
			line += sizeOf(n) + "\t"
		}
		fmt.Fprintln(tw, line)
	}
	tw.Flush()
	if c.Hosts() > 1 {
		fmt.Fprintf(w, "     within hosts %s, across hosts %s (* crosses hosts)\n", sizeOf(within), sizeOf(across))
	} else {
		fmt.Fprintf(w, "     on the wire %s\n", sizeOf(within))
	}
}

// sizeOf writes n bytes with one decimal in the largest unit that fits.
func sizeOf(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// spans writes 0,1,2,3,7 as 0-3,7.
func spans(xs []int) string {
	var parts []string
	for i := 0; i < len(xs); {
		j := i
		for j+1 < len(xs) && xs[j+1] == xs[j]+1 {
			j++
		}
		if j > i {
			parts = append(parts, fmt.Sprintf("%d-%d", xs[i], xs[j]))
		} else {
			parts = append(parts, strconv.Itoa(xs[i]))
		}
		i = j + 1
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ",")
}
