// Command perfdoc reruns the figures of docs/PERFORMANCE.md on the current build and
// writes the file: it builds moex, runs every `moex bench` behind a figure (each with
// --json), and prints tables with the command of each. Everything in the file comes from
// one run of it on one machine, whose facts it records.
//
//	go run ./bench/perfdoc [-out docs/PERFORMANCE.md] [-quick]
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/moex-ai/moex/bench"
	"github.com/moex-ai/moex/coll/dtype"
)

func main() {
	out := flag.String("out", "docs/PERFORMANCE.md", "file to write")
	quick := flag.Bool("quick", false, "few iterations (to check the script, not for figures)")
	against := flag.String("against", "", "a commit: run the MoE stages on its build too, side by side with this one")
	only := flag.String("only", "", "comma-separated sections to run (to check one; the document then holds only them): "+strings.Join(sectionNames, ","))
	splice := flag.Bool("splice", false, "with -only: put the sections run into the existing document in place of theirs (a new one before the run's last line), and say so there, rather than writing a document of them alone")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "perfdoc: unexpected argument %q\n", flag.Arg(0))
		os.Exit(2)
	}
	if *splice && *only == "" {
		fmt.Fprintln(os.Stderr, "perfdoc: -splice needs -only")
		os.Exit(2)
	}
	if err := run(*out, *quick, *against, *only, *splice); err != nil {
		fmt.Fprintln(os.Stderr, "perfdoc:", err)
		os.Exit(1)
	}
}

type runner struct {
	moex  string
	quick bool
	log   io.Writer
	env   []string // added to the scripts' environment (scriptEnv)
	// plots is the directory of the plots (docs/perf), and plotRef its path as the
	// document links it.
	plots, plotRef string
	// stepRows are the MoE results drawn as stacked bars.
	stepRows []*bench.MoEResult
	// base is moex built at the commit named baseName, to compare with (-against).
	base, baseName string
}

// plot returns the file for a plot named name and the Markdown that shows it.
func (r *runner) plot(name, alt string) (file, md string) {
	return filepath.Join(r.plots, name), fmt.Sprintf("![%s](%s/%s)\n\n", alt, r.plotRef, name)
}

// sectionNames name the document's sections, in order, for -only.
var sectionNames = []string{"against", "moe", "growth", "overlap", "balance", "lost", "regrow", "chaos", "step", "coalesce", "p2p", "coll", "openmpi", "twohosts", "ucx"}

func run(out string, quick bool, against, only string, splice bool) error {
	start := time.Now()
	dir, err := os.MkdirTemp("", "perfdoc")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	r := &runner{moex: filepath.Join(dir, "moex"), quick: quick, log: os.Stderr, plots: filepath.Join(filepath.Dir(out), "perf"), plotRef: "perf"}
	if err := os.MkdirAll(r.plots, 0o755); err != nil {
		return err
	}
	// -buildvcs=true: the rows' commit comes from the binary (GOFLAGS may turn it off).
	if b, err := exec.Command("go", "build", "-buildvcs=true", "-o", r.moex, "./cmd/moex").CombinedOutput(); err != nil {
		return fmt.Errorf("building moex: %v\n%s", err, b)
	}
	if against != "" {
		if r.base, err = buildAt(against, dir); err != nil {
			return err
		}
		r.baseName = shortCommit(against)
	}
	var doc bytes.Buffer
	fmt.Fprintf(&doc, "# moex performance\n\n")
	fmt.Fprintf(&doc, "Every figure below was measured by `go run ./bench/perfdoc` (docs/perf.sh) in one run on the\n")
	fmt.Fprintf(&doc, "machine described here, on the build named; the command behind each table is given with\n")
	fmt.Fprintf(&doc, "it. Times of a stage are, per iteration, its slowest rank's, every rank starting the stage\n")
	fmt.Fprintf(&doc, "together; p50 and p99 are over the iterations. This machine is shared and noisy: compare\n")
	fmt.Fprintf(&doc, "figures within one run, not across runs.\n\n")
	machine(&doc)
	sections := []func(io.Writer) error{r.against, r.moe, r.growth, r.overlap, r.balance, r.lostRank, r.regrow, r.chaos, r.moeStep, r.coalesce, r.p2p, r.coll, r.openMPI, r.twoHosts, r.ucx}
	chosen := map[string]bool{}
	for _, name := range strings.Split(only, ",") {
		if name = strings.TrimSpace(name); name != "" {
			if !slices.Contains(sectionNames, name) {
				return fmt.Errorf("-only: no section %q (want %s)", name, strings.Join(sectionNames, ","))
			}
			chosen[name] = true
		}
	}
	for i, section := range sections {
		if len(chosen) > 0 && !chosen[sectionNames[i]] {
			continue
		}
		if err := section(&doc); err != nil {
			return err
		}
	}
	took := time.Since(start).Round(time.Second)
	if splice {
		old, err := os.ReadFile(out)
		if err != nil {
			return err
		}
		b, err := spliceSections(old, doc.Bytes(), fmt.Sprintf("Sections %s were measured again with `docs/perf.sh -only %s -splice` on %s (%s).",
			only, only, buildOf(r.moex), took))
		if err != nil {
			return err
		}
		return os.WriteFile(out, b, 0o644)
	}
	fmt.Fprintf(&doc, "\nThe run took %s.\n", took)
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	return os.WriteFile(out, doc.Bytes(), 0o644)
}

// sections splits a document at its "## " headings: the text before the first, then each
// section with its heading.
func sections(doc []byte) []string {
	parts := strings.Split(string(doc), "\n## ")
	for i := 1; i < len(parts); i++ {
		parts[i] = "## " + parts[i]
	}
	return parts
}

// spliceSections puts the sections of fresh into old in place of those with the same
// heading, a new one after old's last section (before its last line, the run's time), and
// adds note at the end.
func spliceSections(old, fresh []byte, note string) ([]byte, error) {
	s := string(old)
	at := strings.LastIndex(s, "\nThe run took")
	if at < 0 {
		return nil, fmt.Errorf("perfdoc: the document has no \"The run took\" line")
	}
	body, trailer := s[:at+1], s[at+1:]
	norm := func(p string) string { return strings.TrimRight(p, "\n") + "\n" }
	heading := func(p string) string { h, _, _ := strings.Cut(p, "\n"); return h }
	olds := sections([]byte(body))
	for i := range olds {
		olds[i] = norm(olds[i])
	}
	for _, n := range sections(fresh)[1:] {
		n = norm(n)
		if i := slices.IndexFunc(olds, func(o string) bool { return heading(o) == heading(n) }); i > 0 {
			olds[i] = n
		} else {
			olds = append(olds, n)
		}
	}
	gap := body[len(strings.TrimRight(body, "\n")):] // as the document had it before the run's time
	return []byte(strings.TrimRight(strings.Join(olds, "\n"), "\n") + gap + strings.TrimRight(trailer, "\n") + "\n" + note + "\n"), nil
}

// buildOf is the commit moex at path was built from.
func buildOf(path string) string {
	b, err := exec.Command("go", "version", "-m", path).Output()
	if err != nil {
		return "this build"
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "build" && strings.HasPrefix(f[1], "vcs.revision=") {
			return shortCommit(strings.TrimPrefix(f[1], "vcs.revision="))
		}
	}
	return "this build"
}

func machine(w io.Writer) {
	cpu := bench.CPUModel()
	mem := ""
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		mem = strings.Fields(strings.SplitN(string(b), "\n", 2)[0])[1] + " kB"
	}
	commit := "unknown"
	if b, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output(); err == nil {
		commit = strings.TrimSpace(string(b))
		if b, _ := exec.Command("git", "status", "--porcelain").Output(); len(b) > 0 {
			commit += " (with uncommitted changes)"
		}
	}
	fmt.Fprintf(w, "| | |\n| --- | --- |\n")
	fmt.Fprintf(w, "| date | %s |\n", time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	fmt.Fprintf(w, "| build | %s, %s |\n", commit, runtime.Version())
	fmt.Fprintf(w, "| CPU | %s, %d CPUs |\n", cpu, runtime.NumCPU())
	fmt.Fprintf(w, "| vector kernels | %s (dtype.Kernels) |\n", dtype.Kernels())
	fmt.Fprintf(w, "| memory | %s |\n\n", mem)
}

// bench runs `moex bench moe` with args and --json and returns its result.
func (r *runner) bench(args ...string) (*bench.MoEResult, string, error) {
	return r.benchEnv(nil, args...)
}

// benchEnv is bench with env added to moex's environment.
func (r *runner) benchEnv(env []string, args ...string) (*bench.MoEResult, string, error) {
	var res bench.MoEResult
	cmdline, err := r.moexJSONEnv(env, append([]string{"bench", "moe"}, args...), func(line []byte) error { return json.Unmarshal(line, &res) })
	if err != nil {
		return nil, cmdline, err
	}
	return &res, cmdline, nil
}

// moexJSON runs moex with args and --json and hands each line of its output to each.
func (r *runner) moexJSON(args []string, each func(line []byte) error) (string, error) {
	return r.moexJSONEnv(nil, args, each)
}

// moexJSONEnv is moexJSON with env added to moex's environment.
func (r *runner) moexJSONEnv(env, args []string, each func(line []byte) error) (string, error) {
	args = append(args[:2:2], append([]string{"--json"}, args[2:]...)...)
	cmdline := strings.TrimSpace(strings.Join(env, " ") + " moex " + strings.Join(args, " "))
	fmt.Fprintln(r.log, "#", cmdline)
	cmd := exec.Command(r.moex, args...)
	if len(env) > 0 {
		cmd.Env = append(os.Environ(), env...)
	}
	b, err := cmd.Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		return cmdline, fmt.Errorf("%s: %v\n%s", cmdline, err, stderr)
	}
	for _, line := range bytes.Split(bytes.TrimSpace(b), []byte("\n")) {
		if err := each(line); err != nil {
			return cmdline, fmt.Errorf("%s: %v in %q", cmdline, err, line)
		}
	}
	return cmdline, nil
}

func (r *runner) iters(tokens int) int {
	switch {
	case r.quick:
		return 3
	case tokens <= 1:
		return 200
	case tokens <= 16:
		return 100
	}
	return 30
}

type wire struct{ wire, act string }

// The wire types, from the activations an engine would hold; fp8 rows go to the experts
// as they are (--quantized), as DeepEP's fp8 dispatch hands fp8 rows and scales on.
var wires = []wire{{"f32", "f32"}, {"bf16", "bf16"}, {"fp8", "bf16"}}

// stages runs one `moex bench moe` of the stages alone and writes its table cells from
// the mode on (a row's first cells are the caller's).
func (r *runner) stages(w io.Writer, model, tr string, ranks, tokens, iters int, mode string, wi wire) (*bench.MoEResult, error) {
	it := fmt.Sprint(iters)
	args := []string{"--model", model, "--ranks", fmt.Sprint(ranks), "--transport", tr, "--tokens", fmt.Sprint(tokens),
		"--mode", mode, "--wire-dtype", wi.wire, "--act", wi.act, "--iters", it, "--pairs", it}
	if wi.wire == "fp8" {
		args = append(args, "--quantized")
	}
	res, _, err := r.bench(args...)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(w, "| %s | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %s | %.2fx | %.2fx | %.2fx | %.2fx |\n", mode, wi.wire,
		res.Dispatch.P50US, res.Dispatch.P99US, res.Combine.P50US, res.Combine.P99US, res.PairUS,
		bench.SizeOf(res.Dispatch.Bytes), res.Dispatch.OverP50, res.Combine.OverP50, res.Dispatch.OverStepFloor, res.Combine.OverStepFloor)
	return res, nil
}

func (r *runner) moe(w io.Writer) error {
	fmt.Fprintf(w, "## MoE serving: the normal and low-latency modes, wire types, decode to prefill\n\n")
	fmt.Fprintf(w, "`moex bench moe --model M --ranks P --transport T --tokens N --mode MODE --wire-dtype W --act A\n")
	fmt.Fprintf(w, "--iters I --pairs I [--quantized] --json`, experts as identity (the stages alone). f32 rows travel\n")
	fmt.Fprintf(w, "from f32 activations and come back in f32; bf16 and fp8 rows from bf16 activations, back in bf16\n")
	fmt.Fprintf(w, "(DeepEP's fp8 dispatch, bf16 combine), the fp8 rows handed to the experts with their scales\n")
	fmt.Fprintf(w, "(--quantized). Columns: each stage's p50 and p99 (us); the pair: one\n")
	fmt.Fprintf(w, "dispatch then one combine, back to back, without a barrier (us); the dispatch's bytes on\n")
	fmt.Fprintf(w, "the wire (every rank); each stage's p50 over its copy floor, the time of copying once, with\n")
	fmt.Fprintf(w, "every CPU, what the stage must move (the dispatch: its bytes on the wire; the combine: the\n")
	fmt.Fprintf(w, "expert outputs it reads, one row per (token, expert) choice, as DeepEP counts it), best of\n")
	fmt.Fprintf(w, "a few tries with the buffers in the caches; and over its floor in a step, every rank copying\n")
	fmt.Fprintf(w, "its share of those bytes once right after the experts ran, timed as the stage is (the\n")
	fmt.Fprintf(w, "slowest rank, p50): the cost of the bytes alone where the stage runs, so that the rest is\n")
	fmt.Fprintf(w, "the stage's protocol, its waiting and its writes into other ranks' memory. The fp8\n")
	fmt.Fprintf(w, "dispatch's step floor also quantises each of the rank's tokens once (and dequantises each\n")
	fmt.Fprintf(w, "row received where the experts take bf16 rows), work the copy floor, bytes alone, leaves\n")
	fmt.Fprintf(w, "out. Over shm the\n")
	fmt.Fprintf(w, "low-latency dispatch stages each token once in its origin's memory and the experts read it\n")
	fmt.Fprintf(w, "there, and its combine reads the expert outputs in place (the experts write them where\n")
	fmt.Fprintf(w, "combine.Combiner.Buffer says); their bytes are those read in other ranks' memory. The normal\n")
	fmt.Fprintf(w, "mode, and every mode over tcp, sends the rows and the partial sums.\n\n")
	type key struct {
		model, transport string
		tokens           int
		wire             string
	}
	pairs := map[key]map[string]float64{}
	bytesOf := map[key]int64{}
	var order []key
	for _, model := range []string{"deepseek-v3", "qwen3-30b-a3b"} {
		for _, tp := range []struct {
			tr    string
			ranks int
		}{{"shm", 8}, {"tcp", 4}} {
			fmt.Fprintf(w, "### %s, %d ranks over %s\n\n", model, tp.ranks, tp.tr)
			fmt.Fprintf(w, "| tokens | mode | wire | dispatch p50 | p99 | combine p50 | p99 | pair | dispatch bytes | dispatch / floor | combine / floor | dispatch / step floor | combine / step floor |\n")
			fmt.Fprintf(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
			for _, tokens := range []int{1, 16, 128} {
				for _, wi := range wires {
					for _, mode := range []string{"normal", "low-latency"} {
						fmt.Fprintf(w, "| %d ", tokens)
						res, err := r.stages(w, model, tp.tr, tp.ranks, tokens, r.iters(tokens), mode, wi)
						if err != nil {
							return err
						}
						k := key{model, tp.tr, tokens, wi.wire}
						if pairs[k] == nil {
							pairs[k] = map[string]float64{}
							order = append(order, k)
						}
						pairs[k][mode] = res.PairUS
						if tokens == 128 && wi.wire == "bf16" && tp.tr == "shm" {
							r.stepRows = append(r.stepRows, res)
						}
						pairs[k][mode+"/sum"] = res.Dispatch.P50US + res.Combine.P50US
						if mode == "low-latency" {
							bytesOf[k] = res.Dispatch.Bytes
						}
					}
				}
			}
			fmt.Fprintln(w)
		}
	}
	file, md := r.plot("moe-stages.svg", "dispatch, compute and combine per model and mode")
	if err := bench.PlotMoE(file, r.stepRows); err != nil {
		return err
	}
	fmt.Fprintf(w, "The stages at 128 tokens per rank, bf16, 8 ranks over shm (p50 of each stage, from the tables above):\n\n%s", md)
	fmt.Fprintf(w, "### Low-latency against normal, fp8 against bf16\n\n")
	fmt.Fprintf(w, "From the tables above: the normal mode's time over the low-latency mode's, for the pair and for\n")
	fmt.Fprintf(w, "the stages' p50s added; the low-latency dispatch's bytes on the wire with fp8 over bf16.\n\n")
	fmt.Fprintf(w, "| model | transport | tokens | wire | pair normal / low-latency | stages normal / low-latency | fp8 bytes / bf16 |\n")
	fmt.Fprintf(w, "| --- | --- | --- | --- | --- | --- | --- |\n")
	for _, k := range order {
		pr := pairs[k]
		ratio := ""
		if k.wire == "fp8" {
			if b := bytesOf[key{k.model, k.transport, k.tokens, "bf16"}]; b > 0 {
				ratio = fmt.Sprintf("%.3f", float64(bytesOf[k])/float64(b))
			}
		}
		fmt.Fprintf(w, "| %s | %s | %d | %s | %.2fx | %.2fx | %s |\n", k.model, k.transport, k.tokens, k.wire,
			pr["normal"]/pr["low-latency"], pr["normal/sum"]/pr["low-latency/sum"], ratio)
	}
	fmt.Fprintln(w)
	if err := r.inPlace(w); err != nil {
		return err
	}
	if err := r.combineTypes(w); err != nil {
		return err
	}
	if err := r.dispatchInPlace(w); err != nil {
		return err
	}
	if err := r.fewRanks(w); err != nil {
		return err
	}
	return r.sharedCPUs(w)
}

// sharedCPUs measures decode where ranks share CPUs, with GOMAXPROCS kept at the host's
// CPUs and set to a rank's share of them.
func (r *runner) sharedCPUs(w io.Writer) error {
	fmt.Fprintf(w, "### Ranks that share CPUs: GOMAXPROCS\n\n")
	fmt.Fprintf(w, "Where ranks outnumber CPUs (4 ranks on %d CPUs) or each has one CPU of its own (2 ranks, which\n", runtime.NumCPU())
	fmt.Fprintf(w, "`moex bench` binds), each rank's Go runtime still has a P per CPU of the host. With a P idle,\n")
	fmt.Fprintf(w, "every goroutine that a message wakes makes the runtime wake a thread to look for more work,\n")
	fmt.Fprintf(w, "on CPUs the other ranks need. Over tcp, where each message passes from a socket reader to\n")
	fmt.Fprintf(w, "its waiter, a GOMAXPROCS of the rank's share of the CPUs (1 here) saves that, and `moex bench`\n")
	fmt.Fprintf(w, "and `moex run` set it so (MOEX_GOMAXPROCS=auto): every tcp figure here ran with it. Over shm,\n")
	fmt.Fprintf(w, "where waiters poll memory while the transport's goroutines run beside them, it costs more\n")
	fmt.Fprintf(w, "than it saves, and auto leaves the Ps alone. `MOEX_GOMAXPROCS=keep | GOMAXPROCS=1 moex bench moe\n")
	fmt.Fprintf(w, "--model deepseek-v3 --ranks P --transport T --tokens N --mode low-latency --wire-dtype bf16 --act\n")
	fmt.Fprintf(w, "bf16 --iters I --pairs I --json` (us).\n\n")
	fmt.Fprintf(w, "| transport | ranks | tokens | GOMAXPROCS | dispatch p50 | p99 | combine p50 | p99 | pair |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	type setting struct {
		tr            string
		ranks, tokens int
	}
	for _, st := range []setting{{"tcp", 4, 1}, {"tcp", 4, 128}, {"tcp", 2, 1}, {"shm", 8, 1}} {
		for _, procs := range []string{"", "1"} {
			env := []string{"MOEX_GOMAXPROCS=keep"}
			if procs != "" {
				env = []string{"GOMAXPROCS=" + procs}
			}
			it := fmt.Sprint(r.iters(st.tokens))
			res, _, err := r.benchEnv(env, "--model", "deepseek-v3", "--ranks", fmt.Sprint(st.ranks), "--transport", st.tr,
				"--tokens", fmt.Sprint(st.tokens), "--mode", "low-latency", "--wire-dtype", "bf16", "--act", "bf16", "--iters", it, "--pairs", it)
			if err != nil {
				return err
			}
			shown := fmt.Sprint(res.GOMAXPROCS) // rank 0's, as the ranks ran
			if procs == "" {
				shown += " (keep)"
			}
			fmt.Fprintf(w, "| %s | %d | %d | %s | %.0f | %.0f | %.0f | %.0f | %.0f |\n", st.tr, st.ranks, st.tokens, shown,
				res.Dispatch.P50US, res.Dispatch.P99US, res.Combine.P50US, res.Combine.P99US, res.PairUS)
		}
	}
	fmt.Fprintf(w, "\n")
	return nil
}

// inPlace runs the low-latency combine reading the expert outputs in place against the
// same mode sending partial sums (--send-partials), at 128 tokens, 8 ranks over shm.
func (r *runner) inPlace(w io.Writer) error {
	fmt.Fprintf(w, "### The low-latency combine in place against partial sums\n\n")
	fmt.Fprintf(w, "`moex bench moe --model deepseek-v3 --ranks 8 --transport shm --tokens 128 --mode low-latency\n")
	fmt.Fprintf(w, "--wire-dtype W --act A --iters I --pairs I [--send-partials] --json`: the expert outputs read where the\n")
	fmt.Fprintf(w, "experts wrote them, each token summed in one pass by the rank that needs it, against partial sums\n")
	fmt.Fprintf(w, "written into the origins' memory and summed there. Combine p50 and its ratios to the floors\n")
	fmt.Fprintf(w, "(as above), and the pair (us).\n\n")
	fmt.Fprintf(w, "| wire | combine | combine p50 | combine / floor | combine / step floor | pair |\n| --- | --- | --- | --- | --- | --- |\n")
	for _, wi := range wires[:2] {
		for _, partials := range []bool{false, true} {
			it := fmt.Sprint(r.iters(128))
			args := []string{"--model", "deepseek-v3", "--ranks", "8", "--transport", "shm", "--tokens", "128", "--mode", "low-latency",
				"--wire-dtype", wi.wire, "--act", wi.act, "--iters", it, "--pairs", it}
			how := "in place"
			if partials {
				args, how = append(args, "--send-partials"), "partial sums"
			}
			res, _, err := r.bench(args...)
			if err != nil {
				return err
			}
			fmt.Fprintf(w, "| %s | %s | %.0f | %.2fx | %.2fx | %.0f |\n", wi.wire, how, res.Combine.P50US, res.Combine.OverP50, res.Combine.OverStepFloor, res.PairUS)
		}
	}
	fmt.Fprintln(w)
	return nil
}

// combineTypes runs the low-latency combine over tcp with its partial sums in bf16, fp8
// and int8, and with the outputs sent unsummed (--sum-at-origin): bytes against time
// where a link is the bottleneck.
func (r *runner) combineTypes(w io.Writer) error {
	fmt.Fprintf(w, "### The combine over a link: partial sums in bf16, fp8 or int8, or the outputs unsummed\n\n")
	fmt.Fprintf(w, "`moex bench moe --model M --ranks 4 --transport tcp --tokens 128 --mode low-latency --wire-dtype bf16\n")
	fmt.Fprintf(w, "--act bf16 --iters I --pairs I [--combine-dtype B | --sum-at-origin] --json`: each rank's partial sum of\n")
	fmt.Fprintf(w, "a token in bf16, or quantised once to fp8 (a scale per 128 values) or int8 (a scale per row), and the\n")
	fmt.Fprintf(w, "expert outputs sent back unsummed (bf16) for the token's rank to add in the order of its choices\n")
	fmt.Fprintf(w, "(the bits of one process). Combine p50 and p99 (us), its bytes on the wire (every rank), the\n")
	fmt.Fprintf(w, "pair (us), and the step's error against the exact weighted sums (identity experts; the bf16 rows',\n")
	fmt.Fprintf(w, "the partial sums' and the bf16 output's rounding; MoEResult.ErrorRel). The rows go in bf16: with\n")
	fmt.Fprintf(w, "identity experts a rank's partial sum of fp8 rows is a multiple of an fp8 row, which fp8 holds\n")
	fmt.Fprintf(w, "exactly, so an fp8 wire would hide the partial sums' error.\n\n")
	fmt.Fprintf(w, "| model | back | combine p50 | p99 | combine bytes | pair | error |\n| --- | --- | --- | --- | --- | --- | --- |\n")
	for _, model := range []string{"deepseek-v3", "qwen3-30b-a3b"} {
		for _, back := range []string{"bf16", "fp8", "int8", "unsummed"} {
			it := fmt.Sprint(r.iters(128))
			args := []string{"--model", model, "--ranks", "4", "--transport", "tcp", "--tokens", "128", "--mode", "low-latency",
				"--wire-dtype", "bf16", "--act", "bf16", "--iters", it, "--pairs", it}
			if back == "unsummed" {
				args = append(args, "--sum-at-origin")
			} else {
				args = append(args, "--combine-dtype", back)
			}
			res, _, err := r.bench(args...)
			if err != nil {
				return err
			}
			fmt.Fprintf(w, "| %s | %s | %.0f | %.0f | %s | %.0f | %.2e |\n", model, back, res.Combine.P50US, res.Combine.P99US, bench.SizeOf(res.Combine.Bytes), res.PairUS, res.ErrorRel)
		}
	}
	fmt.Fprintln(w)
	return nil
}

// dispatchInPlace runs the low-latency dispatch three ways at 128 tokens, bf16, over shm:
// each rank writing its rows into every destination's memory (--push-rows), its tokens
// staged once in its own memory and read there by the experts (the default), and the
// tokens written into that staging beforehand (--tokens-in-buffer); with 8 ranks, and
// with no more ranks than CPUs.
func (r *runner) dispatchInPlace(w io.Writer) error {
	few := min(8, max(2, runtime.NumCPU()))
	fmt.Fprintf(w, "### The low-latency dispatch: rows pushed, staged in place, or written in place\n\n")
	fmt.Fprintf(w, "`moex bench moe --model deepseek-v3 --ranks P --transport shm --tokens 128 --mode low-latency\n")
	fmt.Fprintf(w, "--wire-dtype bf16 --act bf16 --iters I --pairs I [--push-rows | --tokens-in-buffer] --json`: each rank\n")
	fmt.Fprintf(w, "writing each token into the memory of every rank it goes to (pushed); each rank writing each token\n")
	fmt.Fprintf(w, "once into its own staging, where the experts read it (staged, the default); the tokens written\n")
	fmt.Fprintf(w, "into that staging before the timed dispatch, as the layer before the MoE would write them\n")
	fmt.Fprintf(w, "(Dispatcher.Buffer), so that the dispatch moves headers only. The pair always passes the tokens in\n")
	fmt.Fprintf(w, "a buffer of their own. Dispatch p50 and its ratios to the floors (as above), and the pair (us).\n\n")
	fmt.Fprintf(w, "| ranks | rows | dispatch p50 | p99 | dispatch / floor | dispatch / step floor | pair |\n| --- | --- | --- | --- | --- | --- | --- |\n")
	for _, ranks := range []int{8, few} {
		for _, how := range []string{"pushed", "staged", "written in place"} {
			it := fmt.Sprint(r.iters(128))
			args := []string{"--model", "deepseek-v3", "--ranks", fmt.Sprint(ranks), "--transport", "shm", "--tokens", "128", "--mode", "low-latency",
				"--wire-dtype", "bf16", "--act", "bf16", "--iters", it, "--pairs", it}
			switch how {
			case "pushed":
				args = append(args, "--push-rows")
			case "written in place":
				args = append(args, "--tokens-in-buffer")
			}
			res, _, err := r.bench(args...)
			if err != nil {
				return err
			}
			fmt.Fprintf(w, "| %d | %s | %.0f | %.0f | %.2fx | %.2fx | %.0f |\n", ranks, how, res.Dispatch.P50US, res.Dispatch.P99US, res.Dispatch.OverP50, res.Dispatch.OverStepFloor, res.PairUS)
		}
	}
	fmt.Fprintln(w)
	return nil
}

// fewRanks runs the low-latency and normal modes at 128 tokens with no more ranks than
// CPUs (at most 8), where a rank waiting for another does not also wait for a CPU.
func (r *runner) fewRanks(w io.Writer) error {
	ranks := min(8, max(2, runtime.NumCPU()))
	fmt.Fprintf(w, "### %d ranks over shm, no more ranks than CPUs\n\n", ranks)
	fmt.Fprintf(w, "Where ranks outnumber CPUs (8 ranks above, %d CPUs here) a rank waits for a CPU as well as for the rows:\n", runtime.NumCPU())
	fmt.Fprintf(w, "the stage's time includes the scheduler's turns. Here each rank has a CPU. `moex bench moe --model deepseek-v3 --ranks %d\n", ranks)
	fmt.Fprintf(w, "--transport shm --tokens 128 --mode MODE --wire-dtype W --act bf16 --iters I --pairs I [--quantized]\n")
	fmt.Fprintf(w, "--json`; columns as above.\n\n")
	fmt.Fprintf(w, "| mode | wire | dispatch p50 | p99 | combine p50 | p99 | pair | dispatch bytes | dispatch / floor | combine / floor | dispatch / step floor | combine / step floor |\n")
	fmt.Fprintf(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	pair := map[string]float64{}
	for _, wi := range wires[1:] {
		for _, mode := range []string{"normal", "low-latency"} {
			res, err := r.stages(w, "deepseek-v3", "shm", ranks, 128, 2*r.iters(128), mode, wi)
			if err != nil {
				return err
			}
			pair[wi.wire+"/"+mode] = res.PairUS
		}
	}
	fmt.Fprintf(w, "\nThe pair, normal over low-latency: ")
	for i, wi := range wires[1:] {
		if i > 0 {
			fmt.Fprintf(w, "; ")
		}
		fmt.Fprintf(w, "%s %.2fx", wi.wire, pair[wi.wire+"/normal"]/pair[wi.wire+"/low-latency"])
	}
	fmt.Fprintf(w, ".\n\n")
	return nil
}

func (r *runner) overlap(w io.Writer) error {
	fmt.Fprintf(w, "## Overlap: two micro-batches, one's rows moving while the other's experts compute\n\n")
	fmt.Fprintf(w, "`moex bench moe --model qwen3-30b-a3b --compute ffn --overlap --chunks 2 --tokens 128 --act bf16\n")
	fmt.Fprintf(w, "--wire-dtype bf16 --mode MODE --ranks P --transport T --iters I`: the reference SwiGLU experts at\n")
	fmt.Fprintf(w, "the model's sizes; the step as two micro-batches one after the other against the two in\n")
	fmt.Fprintf(w, "combine.Pipeline (us, the slowest rank, mean). (DeepSeek-V3's experts, 45 GiB of float32\n")
	fmt.Fprintf(w, "weights, do not fit this machine.) The moving share is the two stages' p50s over the serial\n")
	fmt.Fprintf(w, "step's time: the most that overlap can hide. Here the reference experts run on the same two\n")
	fmt.Fprintf(w, "CPUs that move the rows, so there is little to hide and nothing idle to hide it on.\n\n")
	fmt.Fprintf(w, "| ranks | transport | mode | one after the other | pipelined | speed-up | moving share |\n| --- | --- | --- | --- | --- | --- | --- |\n")
	iters := "10"
	if r.quick {
		iters = "2"
	}
	for _, tp := range []struct {
		tr    string
		ranks int
	}{{"shm", 8}, {"tcp", 4}} {
		for _, mode := range []string{"normal", "low-latency"} {
			res, _, err := r.bench("--model", "qwen3-30b-a3b", "--compute", "ffn", "--overlap", "--chunks", "2", "--tokens", "128",
				"--act", "bf16", "--wire-dtype", "bf16", "--mode", mode, "--ranks", fmt.Sprint(tp.ranks), "--transport", tp.tr,
				"--iters", iters, "--pairs", iters)
			if err != nil {
				return err
			}
			fmt.Fprintf(w, "| %d | %s | %s | %.0f | %.0f | %.2fx | %.1f%% |\n", tp.ranks, tp.tr, mode, res.SerialUS, res.OverlapUS, res.OverlapSpeedup,
				100*(res.Dispatch.P50US+res.Combine.P50US)/res.StepUS)
		}
	}
	fmt.Fprintln(w)
	return nil
}
