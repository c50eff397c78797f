package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"time"

	"github.com/moex-ai/moex/bench"
)

// balance runs `moex bench moe --eplb` on skewed routing: rank imbalance and tokens/s
// with the contiguous placement and after rebalancing.
func (r *runner) balance(w io.Writer) error {
	fmt.Fprintf(w, "## Expert load balancing\n\n")
	fmt.Fprintf(w, "`moex bench moe --model deepseek-v3 --ranks P --transport T --eplb 10 --skew 1.2 --redundant 8\n")
	fmt.Fprintf(w, "--tokens N --iters 30 [--expert-us U] --json`: routing drawn with Zipf popularity (exponent 1.2),\n")
	fmt.Fprintf(w, "the load of every physical expert recorded (dispatch.LoadRecorder) and the placement rebuilt\n")
	fmt.Fprintf(w, "every 10 steps (router.Rebalance, 8 redundant slots, preferring the placement in force). Rank\n")
	fmt.Fprintf(w, "imbalance: the most (token, expert) rows a rank's experts took in a step over the mean, averaged\n")
	fmt.Fprintf(w, "over the steps. With identity experts the step is the two stages alone; with --expert-us each\n")
	fmt.Fprintf(w, "row costs its rank that long (slept, as ranks wait for an accelerator), so that the busiest\n")
	fmt.Fprintf(w, "rank sets the pace as it does when experts compute. The first step of each placement is left\n")
	fmt.Fprintf(w, "out.\n\n")
	fmt.Fprintf(w, "| ranks | transport | tokens | us per row | imbalance before | after | tokens/s before | after | tokens/s gain | imbalance ratio |\n")
	fmt.Fprintf(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	iters := "30"
	if r.quick {
		iters = "4"
	}
	every := "10"
	if r.quick {
		every = "2"
	}
	for _, tp := range []struct {
		tr    string
		ranks int
	}{{"shm", 8}, {"tcp", 4}} {
		for _, c := range []struct{ tokens, us string }{{"128", "0"}, {"128", "1000"}} {
			var res bench.EPLBResult
			_, err := r.moexJSON([]string{"bench", "moe", "--model", "deepseek-v3", "--ranks", fmt.Sprint(tp.ranks), "--transport", tp.tr,
				"--eplb", every, "--skew", "1.2", "--redundant", "8", "--tokens", c.tokens, "--iters", iters, "--expert-us", c.us},
				func(line []byte) error { return json.Unmarshal(line, &res) })
			if err != nil {
				return err
			}
			fmt.Fprintf(w, "| %d | %s | %s | %s | %.3f | %.3f | %.0f | %.0f | %.2fx | %.2fx |\n", tp.ranks, tp.tr, c.tokens, c.us,
				res.Before.Imbalance, res.After.Imbalance, res.Before.TokensPerS, res.After.TokensPerS, res.Speedup, res.ImbalanceGain)
		}
	}
	fmt.Fprintln(w)
	return nil
}

// lostRank runs `moex bench moe --kill`: from a SIGKILL to the first correct step on
// the survivors.
func (r *runner) lostRank(w io.Writer) error {
	fmt.Fprintf(w, "## A lost rank: from SIGKILL to serving again\n\n")
	fmt.Fprintf(w, "`moex bench moe --model deepseek-v3 --ranks P --transport T --kill 3 --tokens 16 --runs 20 [--mode normal] --json`:\n")
	fmt.Fprintf(w, "every expert on two ranks, 64 KiB of weights each; rank 3 is killed with SIGKILL right after a\n")
	fmt.Fprintf(w, "barrier, and the survivors (the slowest of them) time, from then, the step that fails naming\n")
	fmt.Fprintf(w, "it, Comm.Shrink, dispatch.Recover (rebalance onto the survivors, the weights that move) and\n")
	fmt.Fprintf(w, "the first step whose every token comes back whole. ms, p50 and max over 20 jobs. Shrinking counts\n")
	fmt.Fprintf(w, "closing the old pair; the default mode (Auto) takes these 16-token steps in the low-latency mode, whose\n")
	fmt.Fprintf(w, "buffers (mapped by every rank) cost more to close and to make again than the normal mode's.\n\n")
	fmt.Fprintf(w, "| ranks | transport | mode | detect p50 | max | shrink p50 | max | recover p50 | max | first step p50 | max | expert moves |\n")
	fmt.Fprintf(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	runs := "20"
	if r.quick {
		runs = "2"
	}
	for _, tp := range []struct {
		tr    string
		ranks int
		mode  string
	}{{"shm", 8, "auto"}, {"shm", 8, "normal"}, {"tcp", 4, "auto"}, {"tcp", 4, "normal"}} {
		var s bench.RecoverSummary
		_, err := r.moexJSON([]string{"bench", "moe", "--model", "deepseek-v3", "--ranks", fmt.Sprint(tp.ranks), "--transport", tp.tr,
			"--kill", "3", "--tokens", "16", "--runs", runs, "--mode", tp.mode}, func(line []byte) error { return json.Unmarshal(line, &s) })
		if err != nil {
			return err
		}
		moves := 0
		if len(s.Runs) > 0 {
			moves = s.Runs[0].Moves
		}
		fmt.Fprintf(w, "| %d | %s | %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %d |\n", tp.ranks, tp.tr, tp.mode,
			s.P50["detect"]/1e3, s.Max["detect"]/1e3, s.P50["shrink"]/1e3, s.Max["shrink"]/1e3,
			s.P50["recover"]/1e3, s.Max["recover"]/1e3, s.P50["first_step"]/1e3, s.Max["first_step"]/1e3, moves)
	}
	fmt.Fprintln(w)
	return nil
}

// regrow runs `moex bench moe --kill R --rejoin`: from a SIGKILL back to full strength
// with a new process in the dead rank's place, beside a whole job's restart.
func (r *runner) regrow(w io.Writer) error {
	fmt.Fprintf(w, "## A lost rank comes back: from SIGKILL to full strength\n\n")
	fmt.Fprintf(w, "`moex bench moe --model deepseek-v3 --ranks 4 --transport T --kill R --rejoin --tokens 16 --runs 10 --json`:\n")
	fmt.Fprintf(w, "as above, then the launcher (moex run --restarts) starts a process that takes rank R over; the\n")
	fmt.Fprintf(w, "survivors serve on three ranks, admit it at every step (Comm.Admit: it has joined when coll.Init\n")
	fmt.Fprintf(w, "returns in it), move experts onto it (dispatch.Grow) and serve 20 steps on four, every token\n")
	fmt.Fprintf(w, "checked. ms from the kill (the new process's times by its own clock, on the same host), p50 and max\n")
	fmt.Fprintf(w, "over 10 jobs; \"back\" is from the new process's start to the first step on four ranks. Beside\n")
	fmt.Fprintf(w, "it, a whole job's restart: `moex bench moe --model deepseek-v3 --ranks 4 --transport T --tokens 16\n")
	fmt.Fprintf(w, "--iters 3 --pairs 3` from the command to its end (four processes, Init, the MoE layer, five steps),\n")
	fmt.Fprintf(w, "which takes longer here than the way back even with nothing to load; an engine's restart also reloads every rank's weights\n")
	fmt.Fprintf(w, "and loses every rank's requests and KV cache, where the survivors here serve throughout. \"Over etcd\"\n")
	fmt.Fprintf(w, "rows (with `--rdzv etcd://127.0.0.1:PORT/perfdoc`, an etcd 3.4 on this host): the ranks meet in etcd and\n")
	fmt.Fprintf(w, "the launcher starts the dead rank's process again with its own environment, which takes the rank over\n")
	fmt.Fprintf(w, "through etcd (as a restarted Kubernetes pod does), not through moex run's registry.\n\n")
	fmt.Fprintf(w, "| transport | killed | serving on 3 p50 | max | new process started p50 | joined p50 | experts moved p50 | serving on 4 p50 | max | back p50 | max | whole job restart p50 |\n")
	fmt.Fprintf(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	runs := 10
	if r.quick {
		runs = 2
	}
	etcd, stop, err := startEtcd()
	if err != nil {
		return err
	}
	defer stop()
	for _, tr := range []string{"shm", "tcp"} {
		var restart []float64
		for i := 0; i < runs; i++ {
			start := time.Now()
			if _, err := r.moexJSON([]string{"bench", "moe", "--model", "deepseek-v3", "--ranks", "4", "--transport", tr, "--tokens", "16",
				"--iters", "3", "--pairs", "3"}, func([]byte) error { return nil }); err != nil {
				return err
			}
			restart = append(restart, float64(time.Since(start).Microseconds())/1e3)
		}
		kinds := []struct{ victim, rdzv, name string }{{"2", "", tr}, {"0", "", tr}}
		if etcd != "" {
			kinds = append(kinds, struct{ victim, rdzv, name string }{"2", "etcd://" + etcd + "/perfdoc", tr + " over etcd"})
		}
		for _, k := range kinds {
			victim := k.victim
			var s bench.RecoverSummary
			args := []string{"bench", "moe", "--model", "deepseek-v3", "--ranks", "4", "--transport", tr,
				"--kill", victim, "--rejoin", "--tokens", "16", "--runs", fmt.Sprint(runs)}
			if k.rdzv != "" {
				args = append(args, "--rdzv", k.rdzv)
			}
			_, err := r.moexJSON(args, func(line []byte) error { return json.Unmarshal(line, &s) })
			if err != nil {
				return err
			}
			var first, started, joined, grown, serving, back []float64
			for _, run := range s.Runs {
				tl := run.Rejoin
				if tl == nil {
					return fmt.Errorf("perfdoc: a --rejoin run without its timeline")
				}
				first = append(first, run.FirstStepUS/1e3)
				started, joined, grown = append(started, tl.StartedMS), append(joined, tl.JoinedMS), append(grown, tl.GrownMS)
				serving, back = append(serving, tl.ServingMS), append(back, tl.ServingMS-tl.StartedMS)
			}
			fmt.Fprintf(w, "| %s | rank %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n", k.name, victim,
				p50(first), slices.Max(first), p50(started), p50(joined), p50(grown), p50(serving), slices.Max(serving), p50(back), slices.Max(back), p50(restart))
		}
	}
	fmt.Fprintln(w)
	return nil
}

// p50 is the median of v.
func p50(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[(len(s)-1)/2]
}

// chaos is the self-healing job under faults (moex bench moe --chaos).
func (r *runner) chaos(w io.Writer) error {
	d := "10m"
	if r.quick {
		d = "30s"
	}
	fmt.Fprintf(w, "## A serving job under chaos\n\n")
	fmt.Fprintf(w, "`moex bench moe --ranks 4 --transport T --tokens 16 --chaos %s --json` (mixtral-8x7b, every expert on two\n", d)
	fmt.Fprintf(w, "ranks): the ranks serve under moex run --restarts, every token checked, healing themselves (Shrink and\n")
	fmt.Fprintf(w, "dispatch.Recover when a rank dies; Admit and dispatch.Grow when a new process has taken its rank\n")
	fmt.Fprintf(w, "over), while a random rank, rank 0 included, is SIGKILLed every 5 to 15 s (one fault in four a SIGSTOP\n")
	fmt.Fprintf(w, "of 1 to 3 s instead). \"Full strength\" is the share of the time served on four ranks (the rest from the\n")
	fmt.Fprintf(w, "step that found a rank dead to the regrow that made the job whole again); the\n")
	fmt.Fprintf(w, "steps/s are the job's before the first kill, and in the five seconds after each regrow (fewer where the\n")
	fmt.Fprintf(w, "next fault came first): their median and lowest. A fault that stops a rank stalls every rank meanwhile.\n\n")
	fmt.Fprintf(w, "| transport | kills | stops | regrows | steps | wrong tokens | processes failed | hung | full strength | steps/s before | after regrows p50 | lowest |\n")
	fmt.Fprintf(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, tr := range []string{"shm", "tcp"} {
		var s bench.ServeSummary
		if _, err := r.moexJSON([]string{"bench", "moe", "--ranks", "4", "--transport", tr, "--tokens", "16", "--chaos", d},
			func(line []byte) error { return json.Unmarshal(line, &s) }); err != nil {
			return err
		}
		after, lowest := 0.0, 0.0
		if len(s.After) > 0 {
			after, lowest = p50(s.After), slices.Min(s.After)
		}
		fmt.Fprintf(w, "| %s | %d | %d | %d | %d | %d | %d | %v | %.1f%% | %.0f | %.0f | %.0f |\n", tr, s.Kills, s.Stops, s.Regrows, s.Steps,
			s.WrongTokens, s.Errors, s.Hung, 100*s.FullShare, s.Before, after, lowest)
	}
	fmt.Fprintln(w)
	return nil
}

// startEtcd starts an etcd on a free loopback port for the rows over etcd, and returns
// its client endpoint ("" where etcd is not installed) and how to stop it.
func startEtcd() (string, func(), error) {
	bin, err := exec.LookPath("etcd")
	if err != nil {
		return "", func() {}, nil
	}
	free := func() (int, error) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		defer ln.Close()
		return ln.Addr().(*net.TCPAddr).Port, nil
	}
	cp, err := free()
	if err != nil {
		return "", nil, err
	}
	pp, err := free()
	if err != nil {
		return "", nil, err
	}
	dir, err := os.MkdirTemp("", "perfdoc-etcd")
	if err != nil {
		return "", nil, err
	}
	ep, peer := fmt.Sprintf("127.0.0.1:%d", cp), fmt.Sprintf("http://127.0.0.1:%d", pp)
	cmd := exec.Command(bin, "--data-dir", filepath.Join(dir, "data"), "--listen-client-urls", "http://"+ep, "--advertise-client-urls", "http://"+ep,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", "default="+peer)
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return "", nil, err
	}
	stop := func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		os.RemoveAll(dir)
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if c, err := net.DialTimeout("tcp", ep, time.Second); err == nil {
			c.Close()
			return ep, stop, nil
		}
		if time.Now().After(deadline) {
			stop()
			return "", nil, fmt.Errorf("perfdoc: etcd at %s did not come up", ep)
		}
	}
}
