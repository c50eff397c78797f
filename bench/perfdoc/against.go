package main

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
)

// buildAt builds moex as it was at commit (git archive into dir) and returns the binary.
func buildAt(commit, dir string) (string, error) {
	src := filepath.Join(dir, "src-"+commit)
	if err := os.MkdirAll(src, 0o755); err != nil {
		return "", err
	}
	archive := exec.Command("git", "archive", commit)
	untar := exec.Command("tar", "-x", "-C", src)
	pipe, err := archive.StdoutPipe()
	if err != nil {
		return "", err
	}
	untar.Stdin = pipe
	if err := untar.Start(); err != nil {
		return "", err
	}
	if err := archive.Run(); err != nil {
		return "", fmt.Errorf("git archive %s: %w", commit, err)
	}
	if err := untar.Wait(); err != nil {
		return "", fmt.Errorf("unpacking %s: %w", commit, err)
	}
	exe := filepath.Join(dir, "moex-"+commit)
	build := exec.Command("go", "build", "-buildvcs=false", "-o", exe, "./cmd/moex")
	build.Dir = src
	if b, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building moex at %s: %v\n%s", commit, err, b)
	}
	return exe, nil
}

// against runs the MoE stages on this build and on the build at r.base, alternating
// them, and writes both side by side.
func (r *runner) against(w io.Writer) error {
	if r.base == "" {
		return nil
	}
	fmt.Fprintf(w, "## This build against %s\n\n", r.baseName)
	fmt.Fprintf(w, "`moex bench moe --model M --ranks P --transport T --tokens N --mode MODE --wire-dtype W --act A\n")
	fmt.Fprintf(w, "--iters I --pairs I --json` on both builds, in turns (old, new, old, new, ...: %d each), experts as\n", turnsOf(r))
	fmt.Fprintf(w, "identity; each stage's p50 (us): the median and the best over the turns of each build, and new over old\n")
	fmt.Fprintf(w, "for both (below 1: faster now). The host is shared: a stage of tens of microseconds moves by half from\n")
	fmt.Fprintf(w, "turn to turn, so the best says more of what each build can do.\n\n")
	fmt.Fprintf(w, "| model | ranks | transport | tokens | mode | wire | dispatch old | new | new / old | best old | best new | new / old | combine old | new | new / old | best old | best new | new / old |\n")
	fmt.Fprintf(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	type cfg struct {
		model, tr     string
		ranks, tokens int
		mode          string
		wi            wire
	}
	var cfgs []cfg
	for _, tokens := range []int{1, 128} {
		for _, mode := range []string{"normal", "low-latency"} {
			cfgs = append(cfgs, cfg{"deepseek-v3", "shm", 8, tokens, mode, wire{"bf16", "bf16"}})
		}
	}
	cfgs = append(cfgs, cfg{"deepseek-v3", "shm", 8, 128, "low-latency", wire{"fp8", "bf16"}},
		cfg{"deepseek-v3", "tcp", 4, 128, "low-latency", wire{"bf16", "bf16"}},
		cfg{"deepseek-v3", "tcp", 4, 128, "normal", wire{"bf16", "bf16"}},
		cfg{"qwen3-30b-a3b", "shm", 8, 16, "low-latency", wire{"bf16", "bf16"}},
		// The Auto mode: over shm a step of 128 tokens grows the low-latency buffers once
		// and runs there; over tcp it tries the low-latency exchange, then runs normal.
		cfg{"deepseek-v3", "shm", 8, 1, "auto", wire{"bf16", "bf16"}},
		cfg{"deepseek-v3", "shm", 8, 128, "auto", wire{"bf16", "bf16"}},
		cfg{"deepseek-v3", "tcp", 4, 128, "auto", wire{"bf16", "bf16"}})
	turns := turnsOf(r)
	cur := r.moex
	defer func() { r.moex = cur }()
	for _, c := range cfgs {
		it := fmt.Sprint(r.iters(c.tokens))
		args := []string{"--model", c.model, "--ranks", fmt.Sprint(c.ranks), "--transport", c.tr, "--tokens", fmt.Sprint(c.tokens),
			"--mode", c.mode, "--wire-dtype", c.wi.wire, "--act", c.wi.act, "--iters", it, "--pairs", it}
		if c.wi.wire == "fp8" {
			args = append(args, "--quantized")
		}
		var disp, comb [2][]float64 // [old, new]
		for turn := 0; turn < turns; turn++ {
			for b, exe := range []string{r.base, cur} {
				r.moex = exe
				res, _, err := r.bench(args...)
				if err != nil {
					return err
				}
				disp[b] = append(disp[b], res.Dispatch.P50US)
				comb[b] = append(comb[b], res.Combine.P50US)
			}
		}
		cells := func(v [2][]float64) string {
			m0, m1, b0, b1 := median(v[0]), median(v[1]), slices.Min(v[0]), slices.Min(v[1])
			return fmt.Sprintf("%.0f | %.0f | %.2f | %.0f | %.0f | %.2f", m0, m1, m1/m0, b0, b1, b1/b0)
		}
		fmt.Fprintf(w, "| %s | %d | %s | %d | %s | %s | %s | %s |\n", c.model, c.ranks, c.tr, c.tokens, c.mode, c.wi.wire, cells(disp), cells(comb))
	}
	fmt.Fprintln(w)
	return nil
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}

// shortCommit names commit as git does.
func shortCommit(commit string) string {
	if b, err := exec.Command("git", "rev-parse", "--short", commit).Output(); err == nil {
		return strings.TrimSpace(string(b))
	}
	return commit
}

// turnsOf is how many turns each build runs in the comparison.
func turnsOf(r *runner) int {
	if r.quick {
		return 1
	}
	return 5
}
