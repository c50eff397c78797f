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
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/models"
)

// cmdFlow draws the data flow of one MoE step: which primitive, which link, how many
// bytes, in what order. It plans the step (combine.NewPlan, coll.Model) for every rank
// without running any: every rank's tokens routed as moex bench moe routes them, on the
// placement of ranks on hosts given by --hosts.
func cmdFlow(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("moex flow", flag.ContinueOnError)
	var o bench.MoEOpts
	ranks := fs.Int("ranks", 4, "number of ranks")
	check := moeFlags(fs, &o)
	hostsFlag := fs.String("hosts", "", "host of each rank, comma separated (for example 0,0,1,1; default: one host)")
	plans := fs.Bool("plans", false, "also print each rank's AlltoAllv schedules (normal mode)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *ranks < 1 || *ranks > MaxRanks {
		return &usageError{fmt.Sprintf("--ranks %d: want 1 to %d", *ranks, MaxRanks)}
	}
	if err := check(); err != nil {
		return err
	}
	var hosts []int
	if *hostsFlag != "" {
		parts := strings.Split(*hostsFlag, ",")
		if len(parts) != *ranks {
			return &usageError{fmt.Sprintf("--hosts names %d hosts for %d ranks", len(parts), *ranks)}
		}
		for _, s := range parts {
			h, err := strconv.Atoi(strings.TrimSpace(s))
			if err != nil || h < 0 || h >= *ranks {
				return &usageError{fmt.Sprintf("--hosts: %q is not a host number (0 to %d)", s, *ranks-1)}
			}
			hosts = append(hosts, h)
		}
	}
	m, err := coll.NewModel(*ranks, hosts, coll.Config{})
	if err != nil {
		return err
	}
	bar := newProgress("flow: routing and planning every rank's tokens")
	shared := m.Hosts() == 1 && *ranks > 1 // every rank maps every rank's memory
	plan, mc, err := bench.PlanMoE(o, *ranks, shared)
	bar.done()
	if err != nil {
		return err
	}
	return printFlow(os.Stdout, o, mc, plan, m, *plans)
}

func printFlow(w io.Writer, o bench.MoEOpts, mc models.Config, pl *combine.Plan, m *coll.Model, plans bool) error {
	p := len(pl.Rows)
	cfg := pl.Cfg
	fmt.Fprintf(w, "# moex flow: one MoE step of %s (hidden %d, %d experts, top-%d, %s), %d ranks on %d host(s), %d tokens per rank, %s mode, %s on the wire, %s back\n\n",
		mc.Name, mc.Hidden, mc.Experts, mc.TopK, mc.Gating, p, m.Hosts(), o.Tokens, flowMode(o, cfg.Mode), cfg.WireDType, backType(pl))
	fmt.Fprintln(w, "1. route (every rank, local): gate, top-k, weights; experts by rank:")
	for r := 0; r < p; r++ {
		fmt.Fprintf(w, "     rank %d (host %d): experts %s\n", r, m.Host(r), spans(cfg.Placement.Local[r]))
	}
	dispatchB, combineB := pl.DispatchBytes(), pl.CombineBytes()
	step := 2
	if cfg.Mode != dispatch.LowLatency {
		fmt.Fprintf(w, "\n%d. counts (AllGather, %v): %d int64 per rank (a status, a fingerprint of the configuration and placement, then rows per destination, or tokens), %d B in all; skipped by Redispatch\n",
			step, m.Algorithm(coll.OpAllGather, pl.Schedules[0].Control), pl.Schedules[0].Control/8, pl.Schedules[0].Control*p)
		step++
	}
	if err := flowDispatch(w, step, pl, m, dispatchB); err != nil {
		return err
	}
	matrix(w, m, dispatchB)
	step++
	flowExperts(w, step, pl)
	step++
	if err := flowCombine(w, step, pl, m, combineB); err != nil {
		return err
	}
	matrix(w, m, combineB)
	step++
	flowSum(w, step, pl)
	if cfg.Mode == dispatch.LowLatency {
		if err := flowBuffers(w, o, mc, pl); err != nil {
			return err
		}
	}
	if m.Hosts() > 1 && cfg.Mode != dispatch.Gathered {
		flowHosts(w, pl, m)
	}
	if plans && cfg.Mode == dispatch.Normal {
		for r := 0; r < p; r++ {
			_, d, _ := m.AlltoAllv(r, dispatchB, 1)
			_, cb, _ := m.AlltoAllv(r, combineB, 1)
			fmt.Fprintf(w, "\ndispatch schedule, %s", d)
			fmt.Fprintf(w, "combine schedule, %s", cb)
		}
	}
	return nil
}

// backType names what travels back: the partial sums' type, or the outputs unsummed.
func backType(pl *combine.Plan) string {
	if pl.Combine.SumAtOrigin {
		return "the outputs unsummed"
	}
	return pl.Combine.PartialDType.String() + " partial sums"
}

// fields describes a block of a stage from rank 0's schedule: each field and its bytes,
// for the block rank 0 sends rank 1 (the planner's numbers, which the executors move).
func fields(st dispatch.Stage) string {
	if len(st.Send) < 2 {
		return ""
	}
	b := st.Send[1]
	var parts []string
	for i, name := range st.Fields {
		parts = append(parts, fmt.Sprintf("%s %d B", name, b.Bytes[i]))
	}
	s := fmt.Sprintf("rank 0's block for rank 1: %d rows, %d choices: %s", b.Rows, b.Choices, strings.Join(parts, ", "))
	if b.InPlace {
		s += fmt.Sprintf(", %d B read in place", b.Read)
	}
	return s
}

func flowDispatch(w io.Writer, step int, pl *combine.Plan, m *coll.Model, bytes [][]int) error {
	cfg, f := pl.Cfg, pl.Format
	sc := pl.Schedules[0]
	switch cfg.Mode {
	case dispatch.Normal:
		algo, _, err := m.AlltoAllv(0, bytes, 1)
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "\n%d. dispatch (AlltoAllv, %v): one message per destination rank, a status header and rows of %d B plus 8 B per choice they carry (activations %d B, scales %d B, source index and choice count 8 B, then the (local expert, weight) of each choice the destination holds), each token once per rank however many of its experts it chose there; %s\n",
			step, algo, f.RowBytes(0), f.Payload, f.ScaleBytes(), fields(sc.Dispatch))
	case dispatch.LowLatency:
		if len(sc.Dispatch.Send) > 1 && sc.Dispatch.Send[1].InPlace {
			fmt.Fprintf(w, "\n%d. dispatch (in place, every rank on one host, no counts round trip): each rank writes each of its tokens once into its own staging, %d B of activations and %d B of scales (sized for %d tokens per rank); one block per destination rank carries a status header and per row %d B of metadata plus 8 B per choice it carries; the experts read the rows in their origins' memory, every rank's staging mapped side by side; %s. Read in other ranks' memory:\n",
				step, f.Payload, f.ScaleBytes(), cfg.MaxTokens, f.MetaBytes(0), fields(sc.Dispatch))
			return nil
		}
		fmt.Fprintf(w, "\n%d. dispatch (Exchange, no counts round trip): one block per destination rank, a status header, then per row %d B of activations, %d B of scales and %d B of metadata plus 8 B per choice it carries, into buffers sized for %d tokens per rank; written straight into the memory of ranks on the same host (windows), sent as messages to the others; %s\n",
			step, f.Payload, f.ScaleBytes(), f.MetaBytes(0), cfg.MaxTokens, fields(sc.Dispatch))
	case dispatch.Gathered:
		fmt.Fprintf(w, "\n%d. dispatch (AllGatherv x3, %v): every token to every rank: its routing (%d B), row (%d B) and scales (%d B); %s\n",
			step, m.Algorithm(coll.OpAllGatherv, pl.Layouts[0].Tokens()*(f.GatheredMeta()+f.Payload)), f.GatheredMeta(), f.Payload, f.ScaleBytes(), fields(sc.Dispatch))
	}
	return nil
}

func flowExperts(w io.Writer, step int, pl *combine.Plan) {
	fmt.Fprintf(w, "\n%d. experts (every rank, local): rows per local expert (an expert-major view)\n", step)
	for r := range pl.Rows {
		local := pl.Cfg.Placement.Local[r]
		if len(local) > 16 {
			lo, hi, sum := pl.ExpertRows[r][0], pl.ExpertRows[r][0], 0
			for _, n := range pl.ExpertRows[r] {
				lo, hi, sum = min(lo, n), max(hi, n), sum+n
			}
			fmt.Fprintf(w, "     rank %d: %d experts, %d rows, %d to %d per expert\n", r, len(local), sum, lo, hi)
			continue
		}
		var parts []string
		for i, e := range local {
			parts = append(parts, fmt.Sprintf("e%d:%d", e, pl.ExpertRows[r][i]))
		}
		fmt.Fprintf(w, "     rank %d: %s\n", r, strings.Join(parts, " "))
	}
}

func flowCombine(w io.Writer, step int, pl *combine.Plan, m *coll.Model, bytes [][]int) error {
	cfg, cf := pl.Cfg, pl.CombineFormat
	st := pl.Schedules[0].Combine
	inPlace := len(st.Send) > 1 && st.Send[1].InPlace
	switch {
	case inPlace:
		fmt.Fprintf(w, "\n%d. combine (in place, every rank on one host): the expert outputs stay where the experts wrote them (combine.Combiner.Buffer); each rank reads its tokens' terms there, a row of %d B per (token, expert) choice, and sums them; an Exchange carries only every rank's status header; %s. Read in other ranks' memory:\n",
			step, cf.TermRow, fields(st))
	case pl.Combine.SumAtOrigin:
		how := "Exchange"
		if cfg.Mode == dispatch.Normal {
			algo, _, err := m.AlltoAllv(0, bytes, 1)
			if err != nil {
				return err
			}
			how = fmt.Sprintf("AlltoAllv, %v", algo)
		}
		fmt.Fprintf(w, "\n%d. combine (%s, summed at the origin): each rank sends its experts' outputs back unsummed, a row of %d B per (token, expert) choice and a 4 B count per (token, rank), after a status header; %s\n",
			step, how, cf.TermRow, fields(st))
	case cfg.Mode == dispatch.Normal:
		algo, _, err := m.AlltoAllv(0, bytes, 1)
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "\n%d. combine (AlltoAllv, %v): each rank sums its experts' outputs per token, weighted, and sends one partial sum of %d B back per (token, rank), after a status header: the dispatch matrix transposed; %s\n",
			step, algo, cf.Row, fields(st))
	case cfg.Mode == dispatch.LowLatency:
		fmt.Fprintf(w, "\n%d. combine (Exchange): each rank sums its experts' outputs per token, weighted, and writes one partial sum of %d B per (token, rank) into its origin's buffer, after a status header; %s\n",
			step, cf.Row, fields(st))
	case cfg.Mode == dispatch.Gathered:
		fmt.Fprintf(w, "\n%d. combine (ReduceScatterv, %v): each rank sums its experts' outputs for every token (zeros for the ones none of them took), %d B per token, and the reduce-scatter sums them into each token's rank; %s\n",
			step, m.Algorithm(coll.OpReduceScatterv, pl.Layouts[0].Tokens()*cf.Row), cf.Row, fields(st))
	}
	return nil
}

func flowSum(w io.Writer, step int, pl *combine.Plan) {
	st := pl.Schedules[0].Combine
	inPlace := len(st.Send) > 1 && st.Send[1].InPlace
	switch {
	case pl.Cfg.Mode == dispatch.Gathered:
		fmt.Fprintf(w, "\n%d. sum: the reduce-scatter's, in its order\n", step)
	case inPlace:
		fmt.Fprintf(w, "\n%d. sum (every rank, as it reads): each token's terms in one pass, in float32, in the order of its choices, as one process adds them (the same bits whatever the ranks and the placement)\n", step)
	case pl.Combine.SumAtOrigin:
		fmt.Fprintf(w, "\n%d. sum (every rank, local): each token's terms in one pass, in float32, in the order of its choices, as one process adds them (the same bits whatever the ranks, the hosts and the placement)\n", step)
	default:
		fmt.Fprintf(w, "\n%d. sum (every rank, local): its own experts' terms first, then the other ranks' partial sums in rank order (bitwise reproducible)\n", step)
	}
}

func flowBuffers(w io.Writer, o bench.MoEOpts, mc models.Config, pl *combine.Plan) error {
	cfg := pl.Cfg
	dB, cB, err := llBytes(cfg, pl.Combine, o.Act, pl.Shared)
	if err != nil {
		return err
	}
	how := "where blocks travel as messages"
	if pl.Shared {
		how = "every rank mapping every rank's memory"
	}
	fmt.Fprintf(w, "\nbuffers per rank, made once for %d tokens per rank and %d dispatches in flight (%s; address space: a page takes memory when first written): dispatch %s, combine %s (dispatch.LowLatencyBytes, combine.LowLatencyBytes)\n",
		cfg.MaxTokens, cfg.InFlight, how, bench.SizeOf(int64(dB)), bench.SizeOf(int64(cB)))
	if mc.Layers > 1 {
		fmt.Fprintf(w, "for the model's %d MoE layers: %s with one dispatcher and combiner for all (Dispatcher.UsePlacement before each layer), %s with a pair per layer\n",
			mc.Layers, bench.SizeOf(int64(dB+cB)), bench.SizeOf(int64(mc.Layers)*int64(dB+cB)))
	}
	return nil
}

func flowHosts(w io.Writer, pl *combine.Plan, m *coll.Model) {
	p := len(pl.Rows)
	hosts := make([]int, p)
	for r := range hosts {
		hosts[r] = m.Host(r)
	}
	ht, err := pl.Hosts(hosts)
	if err != nil {
		fmt.Fprintf(w, "\ntwo levels (dispatch.TwoLevel): not here (%v)\n", err)
		return
	}
	two, why := dispatch.ChooseTwoLevel(m.Comm(0), pl.Cfg)
	choice := "flat"
	if two {
		choice = "two levels"
	}
	fmt.Fprintf(w, "\nflat against two levels (dispatch.TwoLevel: a token crosses to another host once, with its choices there, and that host's relay hands it on; each host's sum comes back once):\n")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "     \tdispatch within\tdispatch across\tcombine within\tcombine across\trows across\t")
	for _, row := range []struct {
		name string
		t    combine.StageTraffic
	}{{"flat", ht.Flat}, {"two levels", ht.TwoLevel}} {
		fmt.Fprintf(tw, "     %s\t%s\t%s\t%s\t%s\t%d\t\n", row.name, bench.SizeOf(row.t.DispatchWithin), bench.SizeOf(row.t.DispatchAcross),
			bench.SizeOf(row.t.CombineWithin), bench.SizeOf(row.t.CombineAcross), row.t.RowsAcross)
	}
	tw.Flush()
	fmt.Fprintf(w, "     across hosts, two levels over flat: %.2f of the bytes; the cost model chooses %s (%s)\n",
		float64(ht.TwoLevel.DispatchAcross+ht.TwoLevel.CombineAcross)/float64(max(ht.Flat.DispatchAcross+ht.Flat.CombineAcross, 1)), choice, why)
}

// llBytes is what the low-latency stages of cfg and ccfg hold per rank with act
// activations.
func llBytes(cfg dispatch.Config, ccfg combine.Config, act dtype.Type, shared bool) (d, c int, err error) {
	if act == dtype.BF16 {
		return llBytesOf[dtype.BFloat16](cfg, ccfg, shared)
	}
	return llBytesOf[float32](cfg, ccfg, shared)
}

func llBytesOf[T combine.Act](cfg dispatch.Config, ccfg combine.Config, shared bool) (d, c int, err error) {
	if d, err = dispatch.LowLatencyBytes[T](cfg, shared); err != nil {
		return 0, 0, err
	}
	c, err = combine.LowLatencyBytes[T](cfg, ccfg, shared)
	return d, c, err
}

// matrix prints bytes from each rank (rows) to each rank (columns), and the totals
// within hosts and across them.
func matrix(w io.Writer, m *coll.Model, bytes [][]int) {
	p := len(bytes)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := "     from \\ to\t"
	for q := 0; q < p; q++ {
		head += fmt.Sprintf("%d\t", q)
	}
	fmt.Fprintln(tw, head)
	within, across := 0, 0
	for r := 0; r < p; r++ {
		line := fmt.Sprintf("     %d\t", r)
		for q := 0; q < p; q++ {
			n := bytes[r][q]
			switch {
			case q == r:
				line += "(local)\t"
				continue
			case m.Host(q) == m.Host(r):
				within += n
			default:
				across += n
				line += "*"
			}
			line += bench.SizeOf(int64(n)) + "\t"
		}
		fmt.Fprintln(tw, line)
	}
	tw.Flush()
	if m.Hosts() > 1 {
		fmt.Fprintf(w, "     within hosts %s, across hosts %s (* crosses hosts)\n", bench.SizeOf(int64(within)), bench.SizeOf(int64(across)))
	} else {
		fmt.Fprintf(w, "     on the wire %s\n", bench.SizeOf(int64(within)))
	}
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

// flowMode names the mode of the step: the Auto mode with the one it picks.
func flowMode(o bench.MoEOpts, m dispatch.Mode) string {
	if o.Mode == dispatch.Auto {
		return fmt.Sprintf("auto (%v)", m)
	}
	return m.String()
}
