package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"

	"github.com/moex-ai/moex/bench"
)

// The sections below the MoE serving ones: the step with and without coalescing, point
// to point, the collectives, Open MPI on the same host, and two pretend hosts.

func (r *runner) moeStep(w io.Writer) error {
	fmt.Fprintf(w, "## The MoE step against a naive dispatch\n\n")
	fmt.Fprintf(w, "`moex bench moe --model M --ranks 4 --transport T --tokens 512 --naive --iters I --json`, experts\n")
	fmt.Fprintf(w, "as identity, f32: the fused, coalesced dispatch (one message per destination) against a naive one\n")
	fmt.Fprintf(w, "(one message per (token, expert) pair, all posted at once into preallocated buffers).\n\n")
	fmt.Fprintf(w, "| model | transport | dispatch | combine | tokens/s | naive dispatch | naive / fused |\n| --- | --- | --- | --- | --- | --- | --- |\n")
	it := "10"
	if r.quick {
		it = "2"
	}
	for _, model := range []string{"mixtral-8x7b", "tiny-mixtral"} {
		for _, tr := range []string{"shm", "tcp"} {
			res, _, err := r.bench("--model", model, "--ranks", "4", "--transport", tr, "--tokens", "512", "--naive", "--iters", it, "--pairs", it)
			if err != nil {
				return err
			}
			fmt.Fprintf(w, "| %s | %s | %.0f us | %.0f us | %.0f | %.0f us | %.1fx |\n", model, tr, res.Dispatch.P50US, res.Combine.P50US,
				res.TokensPerS, res.NaiveUS, res.FusedOverNaive)
		}
	}
	fmt.Fprintln(w)
	return nil
}

func (r *runner) p2p(w io.Writer) error {
	fmt.Fprintf(w, "## Point to point\n\n")
	fmt.Fprintf(w, "`moex bench p2p --transport T --min-bytes 8 --max-bytes 16M --factor 8 --json`: two ranks, one\n")
	fmt.Fprintf(w, "message at a time; the round trip of 8 bytes and the one-way bandwidth of back-to-back messages.\n\n")
	trs := []string{"inproc", "shm", "tcp"}
	rows := map[int]map[string]bench.P2PResult{}
	var sizes []int
	for _, tr := range trs {
		_, err := r.moexJSON([]string{"bench", "p2p", "--transport", tr, "--min-bytes", "8", "--max-bytes", "16M", "--factor", "8"}, func(line []byte) error {
			var res bench.P2PResult
			if err := json.Unmarshal(line, &res); err != nil {
				return err
			}
			if rows[res.Bytes] == nil {
				rows[res.Bytes] = map[string]bench.P2PResult{}
				sizes = append(sizes, res.Bytes)
			}
			rows[res.Bytes][tr] = res
			return nil
		})
		if err != nil {
			return err
		}
	}
	fmt.Fprintf(w, "| bytes | memcpy | inproc | shm | tcp |\n| --- | --- | --- | --- | --- |\n")
	for _, n := range sizes {
		fmt.Fprintf(w, "| %s | %.1f GB/s", bench.SizeOf(int64(n)), rows[n]["inproc"].MemcpyGBs)
		for _, tr := range trs {
			res := rows[n][tr]
			if n <= 64 {
				fmt.Fprintf(w, " | %.1f us round trip", res.RTTUS)
			} else {
				fmt.Fprintf(w, " | %.2f GB/s", res.GBs)
			}
		}
		fmt.Fprintln(w, " |")
	}
	fmt.Fprintln(w)
	return nil
}

func (r *runner) coll(w io.Writer) error {
	fmt.Fprintf(w, "## Collectives\n\n")
	fmt.Fprintf(w, "`moex bench coll --op OP --ranks P --transport T --min-bytes 64K --max-bytes 4M --factor 4 --json`\n")
	fmt.Fprintf(w, "(f32, buffers from obuf): time per operation, the algorithm the cost model chose, and the copy floor\n")
	fmt.Fprintf(w, "(every byte of the operation copied once with every CPU).\n\n")
	fmt.Fprintf(w, "| op | transport | ranks | bytes per rank | time | p99 | algorithm | copy floor | time / floor |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	var plots string
	for _, op := range []string{"alltoall", "allreduce"} {
		var rows []bench.CollResult
		for _, tp := range []struct {
			tr    string
			ranks int
		}{{"shm", 4}, {"shm", 8}, {"tcp", 4}} {
			args := []string{"bench", "coll", "--op", op, "--ranks", fmt.Sprint(tp.ranks), "--transport", tp.tr, "--min-bytes", "64K", "--max-bytes", "4M", "--factor", "4"}
			if r.quick {
				args = append(args, "--iters", "5")
			}
			_, err := r.moexJSON(args, func(line []byte) error {
				var res bench.CollResult
				if err := json.Unmarshal(line, &res); err != nil {
					return err
				}
				floor, ratio := "–", "–"
				if res.FloorUS > 0 {
					floor, ratio = fmt.Sprintf("%.0f us", res.FloorUS), fmt.Sprintf("%.2fx", res.TimeUS/res.FloorUS)
				}
				fmt.Fprintf(w, "| %s | %s | %d | %s | %.0f us | %.0f us | %s | %s | %s |\n", op, tp.tr, tp.ranks, bench.SizeOf(int64(res.Bytes)), res.TimeUS, res.P99US, res.Algo, floor, ratio)
				res.Transport = fmt.Sprintf("%s P=%d", tp.tr, tp.ranks)
				rows = append(rows, res)
				return nil
			})
			if err != nil {
				return err
			}
		}
		file, md := r.plot(op+".svg", op+": bandwidth and latency percentiles against size")
		if err := bench.PlotColl(file, rows); err != nil {
			return err
		}
		plots += md
	}
	fmt.Fprintf(w, "\n%s", plots)
	return nil
}

// coalesce runs the coalescing study for two models over shm and tcp.
func (r *runner) coalesce(w io.Writer) error {
	fmt.Fprintf(w, "## Coalescing: one dispatch sent five ways\n\n")
	fmt.Fprintf(w, "`moex bench coalesce --model M --ranks 4 --transport T --tokens 128 --json --plot FILE`: the same\n")
	fmt.Fprintf(w, "dispatch (bf16 rows, 128 tokens per rank) sent as a message per (token, expert) pair, per\n")
	fmt.Fprintf(w, "(token, rank), per expert, one fused message per rank (moex's dispatch), and fused split in\n")
	fmt.Fprintf(w, "chunks. Per dispatch, every rank together: messages; tcp's system calls (writes and reads) or\n")
	fmt.Fprintf(w, "shm's ring frames; CPU seconds per GB moved; p50 and p99 of the slowest rank; tokens/s at\n")
	fmt.Fprintf(w, "the p50; #wrong counts received rows that are not their sender's.\n\n")
	iters := "20"
	if r.quick {
		iters = "3"
	}
	for _, model := range []string{"deepseek-v3", "mixtral-8x7b"} {
		for _, tr := range []string{"shm", "tcp"} {
			file, md := r.plot(fmt.Sprintf("coalesce-%s-%s.svg", model, tr), "coalescing curve")
			var res bench.CoalesceResult
			_, err := r.moexJSON([]string{"bench", "coalesce", "--model", model, "--ranks", "4", "--transport", tr, "--tokens", "128", "--iters", iters, "--plot", file},
				func(line []byte) error { return json.Unmarshal(line, &res) })
			if err != nil {
				return err
			}
			counted := "syscalls"
			if tr == "shm" {
				counted = "frames"
			}
			fmt.Fprintf(w, "### %s, 4 ranks over %s\n\n", model, tr)
			fmt.Fprintf(w, "| way | chunk | messages | %s | CPU s/GB | p50 | p99 | tokens/s | #wrong |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n", counted)
			for _, x := range res.Rows {
				chunk, n := "–", x.Syscalls
				if x.ChunkBytes > 0 {
					chunk = bench.SizeOf(int64(x.ChunkBytes))
				}
				if tr == "shm" {
					n = x.Frames
				}
				fmt.Fprintf(w, "| %s | %s | %d | %.0f | %.2f | %.0f us | %.0f us | %.0f | %d |\n", x.Way, chunk, x.Messages, n, x.CPUSecGB, x.P50US, x.P99US, x.TokensPerS, x.Wrong)
			}
			fmt.Fprintf(w, "\nRecommended: %s.\n\n%s", res.Reason, md)
		}
	}
	return nil
}

func (r *runner) openMPI(w io.Writer) error {
	rounds := "3"
	if r.quick {
		rounds = "1"
	}
	fmt.Fprintf(w, "## Against Open MPI and MPICH on one host\n\n")
	fmt.Fprintf(w, "`bench/peers/compare.sh %s` (it installs Open MPI and MPICH from Debian's packages when missing):\n", rounds)
	fmt.Fprintf(w, "each MPI's MPI_Allreduce and MPI_Reduce_scatter_block (f32 sum), MPI_Allgather and MPI_Alltoall against\n")
	fmt.Fprintf(w, "`moex bench coll --transport shm`, the same ranks and sizes (bytes: the buffer of an AllReduce, the send\n")
	fmt.Fprintf(w, "buffer of a ReduceScatter, the receive buffer of an AllGather or AlltoAll), run in turn; times are the\n")
	fmt.Fprintf(w, "medians of the rounds. Each side runs twice, on equal pages: moex with its obuf buffers (2 MiB pages from\n")
	fmt.Fprintf(w, "256 KiB) against each MPI with its buffers on 2 MiB pages (`_huge`, MPI_COLL_HUGE=1), and moex on Go\n")
	fmt.Fprintf(w, "slices (`moex_heap`, --heap) against each MPI on malloc'd buffers (`_mlc`, 4 KiB pages here); `vs_mpi_huge`\n")
	fmt.Fprintf(w, "and `vs_mpi_malloc` are the better MPI's median over moex's (above 1, moex is faster).\n\n")
	fmt.Fprintf(w, "The copy floor (`floor_us`; `moex_f` and `mpi_f` are the fractions of it each side reaches) is the time\n")
	fmt.Fprintf(w, "this host needs to read and write, once each, with as many threads as it has CPUs and nothing to wait\n")
	fmt.Fprintf(w, "for, the bytes the operation must move on every rank (bench.CopyFloor, AllGatherFloor, ReduceScatterFloor,\n")
	fmt.Fprintf(w, "AllReduceFloor): an AlltoAll or AllGather copies the P-1 blocks each rank lacks into its buffer; a\n")
	fmt.Fprintf(w, "ReduceScatter reads each rank's block of every buffer (the whole send buffer's worth of bytes per rank)\n")
	fmt.Fprintf(w, "and writes the block once; an AllReduce is a ReduceScatter, then every rank copies the P-1 combined\n")
	fmt.Fprintf(w, "blocks it lacks. No implementation that moves each byte once with synchronisation can beat it: a\n")
	fmt.Fprintf(w, "target above the floor (\"2x the better MPI\" where the MPI is already near it) is impossible, and the\n")
	fmt.Fprintf(w, "note says so. MPICH busy-polls, which with more ranks than CPUs starves the ranks it waits for.\n\n")
	if err := r.script(w, "bench/peers/compare.sh", rounds); err != nil {
		return err
	}
	fmt.Fprintf(w, "### The MoE step against the same step written with MPI\n\n")
	fmt.Fprintf(w, "`bench/peers/moe_compare.sh %s`: `moex bench moe` against bench/peers/mpi_moe.c (pack each token once per\n", rounds)
	fmt.Fprintf(w, "destination rank, MPI_Alltoall of the counts, MPI_Alltoallv of the rows, unpack expert-major; the partial\n")
	fmt.Fprintf(w, "sums back the same way), shared memory, experts as the identity, alternating, the best mean of each stage;\n")
	fmt.Fprintf(w, "`default` leaves the mode unset (Auto) with f32 rows against MPI with f32 rows, `ll-bf16` is the low-latency\n")
	fmt.Fprintf(w, "mode with bf16 rows against MPI with 2-byte rows. The MPI step runs on malloc'd buffers (`mpi`, 4 KiB\n")
	fmt.Fprintf(w, "pages here) and on 2 MiB pages (`mpi_huge`, MPI_MOE_HUGE=1), the pages of moex's buffers; ratio = MPI's\n")
	fmt.Fprintf(w, "mean over moex's (`ratio_huge`: on equal pages).\n\n")
	if err := r.script(w, "bench/peers/moe_compare.sh", rounds); err != nil {
		return err
	}
	fmt.Fprintf(w, "### Over TCP against torch's gloo\n\n")
	fmt.Fprintf(w, "`bench/peers/gloo_compare.sh %s`: all_reduce and all_to_all_single of torch.distributed's gloo backend\n", rounds)
	fmt.Fprintf(w, "(Debian's python3-torch) against `moex bench coll --transport tcp`, loopback, alternating, the best of each;\n")
	fmt.Fprintf(w, "ratio = gloo's time over moex's.\n\n")
	return r.script(w, "bench/peers/gloo_compare.sh", rounds)
}

func (r *runner) twoHosts(w io.Writer) error {
	fmt.Fprintf(w, "## Two hosts: the hierarchical AllReduce\n\n")
	fmt.Fprintf(w, "`bench/hosts/twohosts.sh 8 2gbit 64K 4M`: two network namespaces as two hosts, joined by a veth\n")
	fmt.Fprintf(w, "shaped with tc tbf to 2 Gbit/s, four ranks in each (shared memory within, TCP between); AllReduce\n")
	fmt.Fprintf(w, "with the cost model's choice and each algorithm forced, ranks in blocks and alternating.\n\n")
	if err := r.script(w, "bench/hosts/twohosts.sh", "8", "2gbit", "64K", "4M"); err != nil {
		return err
	}
	fmt.Fprintf(w, "## Two hosts: AlltoAll and the MoE step in two levels\n\n")
	fmt.Fprintf(w, "The same two namespaces, the link shaped to 1 Gbit/s. `OP=alltoall bench/hosts/twohosts.sh 8 1gbit 1M 1M`:\n")
	fmt.Fprintf(w, "AlltoAll of 1 MiB per rank, the model's choice, flat (linear) and two-level (hier) forced; link_MiB is\n")
	fmt.Fprintf(w, "what crossed the veth, both ways, during the run.\n\n")
	if err := r.scriptEnv(w, []string{"OP=alltoall"}, "bench/hosts/twohosts.sh", "8", "1gbit", "1M", "1M"); err != nil {
		return err
	}
	fmt.Fprintf(w, "`OP=levels MODEL=M TOKENS=N ITERS=5 bench/hosts/twohosts.sh 8 1gbit`: the MoE step (bf16 on the wire,\n")
	fmt.Fprintf(w, "identity experts) flat, in two levels (dispatch.TwoLevel) and as the cost model chooses, each in a\n")
	fmt.Fprintf(w, "job of its own: p50 of dispatch and combine, the step's mean, the planner's bytes across hosts for a\n")
	fmt.Fprintf(w, "dispatch and for a dispatch and its combine, and the bytes through the veth during the job.\n\n")
	for _, m := range []string{"deepseek-v3", "mixtral-8x7b"} {
		for _, tokens := range []string{"128", "512"} {
			iters := "5"
			if r.quick {
				iters = "1"
			}
			if err := r.scriptEnv(w, []string{"OP=levels", "MODEL=" + m, "TOKENS=" + tokens, "ITERS=" + iters}, "bench/hosts/twohosts.sh", "8", "1gbit"); err != nil {
				return err
			}
			if r.quick {
				return nil
			}
		}
	}
	return nil
}

// scriptEnv is script with variables added to the environment (shown in the document).
func (r *runner) scriptEnv(w io.Writer, env []string, name string, args ...string) error {
	old := r.env
	r.env = env
	defer func() { r.env = old }()
	return r.script(w, name, args...)
}

// script runs a script of the repository and puts its output in the document; where it
// cannot run here (no root for network namespaces, no network for packages), the
// document says so and why.
func (r *runner) script(w io.Writer, name string, args ...string) error {
	cmdline := strings.Join(append(append(slices.Clone(r.env), name), args...), " ")
	fmt.Fprintln(r.log, "#", cmdline)
	cmd := exec.Command(name, args...)
	cmd.Env = append(os.Environ(), r.env...)
	out, err := cmd.Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		fmt.Fprintf(w, "Not run here: `%s` failed (%v): %s\n\n", cmdline, err, strings.TrimSpace(lastLine(string(stderr))))
		return nil
	}
	fmt.Fprintf(w, "```\n%s\n```\n\n", strings.TrimSpace(string(out)))
	return nil
}

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	return s
}
