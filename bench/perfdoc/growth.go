package main

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/moex-ai/moex/bench"
)

// growth runs `moex bench moe --sweep`: how the stages' time and each rank's buffers grow
// with the ranks and the tokens, beside DeepEP's low-latency buffer.
func (r *runner) growth(w io.Writer) error {
	fmt.Fprintf(w, "## Cost growth: ranks and tokens\n\n")
	fmt.Fprintf(w, "`moex bench moe --model qwen3-30b-a3b --transport T [--ranks P | --tokens N] --mode low-latency --wire-dtype bf16\n")
	fmt.Fprintf(w, "--act bf16 --iters I --pairs I --sweep ranks|tokens --json`: the low-latency step at each point, each in a job of\n")
	fmt.Fprintf(w, "its own; times are p50 (us), buffers what each rank holds (the most of any rank), fixed when the dispatcher\n")
	fmt.Fprintf(w, "and combiner are made. DeepEP's low-latency buffer for the same tokens, hidden size and experts\n")
	fmt.Fprintf(w, "(bench.DeepEPLowLatencyBytes: two of each send and receive buffer, a message per (expert, token)) is beside it.\n\n")
	fmt.Fprintf(w, "Orders of growth per rank, with P ranks, T = MaxTokens, H the hidden size, E the experts, K the top-k and\n")
	fmt.Fprintf(w, "InFlight = 2: the dispatch's exchange holds InFlight+1 blocks of T rows per source rank, O(P·T·H) where blocks\n")
	fmt.Fprintf(w, "travel as messages; where the rows are read in place (one host) the blocks carry only metadata, O(P·T·K), beside\n")
	fmt.Fprintf(w, "InFlight stagings of this rank's T rows, O(T·H). The in-place combine holds InFlight regions with room for a\n")
	fmt.Fprintf(w, "row per choice that can reach this rank's experts, P·T·min(K, E/P) rows: O(T·min(P·K, E)·H). DeepEP's is\n")
	fmt.Fprintf(w, "O(E·T·H) whatever P. moex's grow with the ranks until P·K reaches E and then stay (the inproc sweep's last\n")
	fmt.Fprintf(w, "rows), below DeepEP's. Time grows with the ranks faster than the bytes where ranks outnumber the CPUs (this\n")
	fmt.Fprintf(w, "host has 2).\n\n")
	fmt.Fprintf(w, "The normal mode's buffers are sized per step from the counts, not fixed: on rank i, the rows it sends and\n")
	fmt.Fprintf(w, "receives (bytes to and from each other rank), the answers that come back and go out (a partial sum per row\n")
	fmt.Fprintf(w, "received, a row's worth per row sent), a row per choice handed to its experts, and Align-1 rows of padding per\n")
	fmt.Fprintf(w, "local expert. `Config.MaxBufferBytes` (default 1 GiB) bounds that sum; a step over it fails on every rank with a\n")
	fmt.Fprintf(w, "`*dispatch.BufferLimitError` naming the rank, its need and the limit, before anything moves (the Auto mode's\n")
	fmt.Fprintf(w, "grown low-latency buffers are held to the same limit). DeepEP's normal mode instead streams through fixed\n")
	fmt.Fprintf(w, "queues, one per (channel, rank) of `nvl_chunked_recv_tokens` rows (`Config.get_nvl_buffer_size_hint`: about\n")
	fmt.Fprintf(w, "channels·P·256 rows, some 290 MB at EP8 with 10 channels and H = 7168 in bf16), whatever the tokens, with the outputs\n")
	fmt.Fprintf(w, "allocated per step beside it.\n\n")
	it := "30"
	if r.quick {
		it = "3"
	}
	for _, sw := range []struct {
		what, transport, fixed, plot string
	}{
		{"ranks", "shm", "--tokens=16", "sweep-ranks-shm.svg"},
		{"ranks", "inproc", "--tokens=16", "sweep-ranks-inproc.svg"},
		{"tokens", "shm", "--ranks=8", "sweep-tokens-shm.svg"},
	} {
		var rs []*bench.MoEResult
		_, err := r.moexJSON([]string{"bench", "moe", "--model", "qwen3-30b-a3b", "--transport", sw.transport, sw.fixed, "--mode", "low-latency",
			"--wire-dtype", "bf16", "--act", "bf16", "--iters", it, "--pairs", it, "--sweep", sw.what}, func(line []byte) error {
			var res bench.MoEResult
			if err := json.Unmarshal(line, &res); err != nil {
				return err
			}
			rs = append(rs, &res)
			return nil
		})
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "### %s over %s (%s)\n\n", sw.what, sw.transport, sw.fixed[2:])
		fmt.Fprintf(w, "| ranks | tokens | dispatch p50 | combine p50 | pair | dispatch buffers | combine buffers | DeepEP LL buffer | pair x | buffers x |\n")
		fmt.Fprintf(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
		b0 := float64(rs[0].Dispatch.BufferBytes + rs[0].Combine.BufferBytes)
		for _, x := range rs {
			b := float64(x.Dispatch.BufferBytes + x.Combine.BufferBytes)
			fmt.Fprintf(w, "| %d | %d | %.0f | %.0f | %.0f | %s | %s | %s | %.2f | %.2f |\n", x.Ranks, x.TokensPerRank, x.Dispatch.P50US, x.Combine.P50US, x.PairUS,
				bench.SizeOf(x.Dispatch.BufferBytes), bench.SizeOf(x.Combine.BufferBytes), bench.SizeOf(bench.DeepEPLowLatencyBytes(x.TokensPerRank, x.Hidden, x.Experts)),
				x.PairUS/rs[0].PairUS, b/max(b0, 1))
		}
		file, md := r.plot(sw.plot, fmt.Sprintf("time and buffers against %s over %s", sw.what, sw.transport))
		if err := bench.PlotSweep(file, sw.what, rs); err != nil {
			return err
		}
		fmt.Fprintf(w, "\n%s", md)
	}
	return nil
}
