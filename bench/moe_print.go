package bench

import (
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/moex-ai/moex/dispatch"
)

// PrintMoE writes the result as a table.
func PrintMoE(w io.Writer, r *MoEResult) {
	back := r.CombineWire + " back"
	switch {
	case r.CombineInPlace:
		back = "expert outputs read in place"
	case r.SumAtOrigin:
		back = "expert outputs back unsummed (" + r.CombineWire + "), summed at the tokens' ranks"
	}
	fmt.Fprintf(w, "# moex bench moe: %s (hidden %d, %d experts, top-%d), %d ranks over %s, %s mode, %d tokens per rank, %s activations, %s on the wire, %s, experts: %s\n",
		r.Model, r.Hidden, r.Experts, r.TopK, r.Ranks, r.Transport, modeOf(r), r.TokensPerRank, r.Act, r.Wire, back, r.Compute)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, v) }
	stage := func(name string, s Stage) {
		conv := ""
		if s.StepFloorConverts {
			conv = ", conversions included"
		}
		row(name, fmt.Sprintf("p50 %.1f us, p99 %.1f us, mean %.1f us; %s on the wire, copy floor %.1f us for %s (p50 %.2fx the floor), %.1f us in a step's cache state%s (p50 %.2fx)",
			s.P50US, s.P99US, s.MeanUS, SizeOf(s.Bytes), s.FloorUS, SizeOf(s.Moved), s.OverP50, s.StepFloorUS, conv, s.OverStepFloor))
		row(name+" tail", s.Tail.String())
	}
	row("path", r.Path)
	if note := SharedCPUsNote(r); note != "" {
		row("note", note)
	}
	row("kernels", r.Kernels)
	row("runtime", fmt.Sprintf("GOMAXPROCS %d per rank (rank 0's); %d ranks share the host's %d CPUs", r.GOMAXPROCS, r.HostRanks, r.HostCPUs))
	stage("dispatch", r.Dispatch)
	row("expert compute", fmt.Sprintf("%.1f us", r.ComputeUS))
	stage("combine", r.Combine)
	row("step", fmt.Sprintf("%.1f us (slowest rank per stage, mean of %d)", r.StepUS, r.Iters))
	row("buffers", fmt.Sprintf("dispatch %s, combine %s per rank (the most of any rank)", SizeOf(r.Dispatch.BufferBytes), SizeOf(r.Combine.BufferBytes)))
	row("tokens/s", fmt.Sprintf("%.0f", r.TokensPerS))
	if r.Compute != "ffn" {
		row("error", fmt.Sprintf("%.2e relative to the exact weighted sums (every rank's tokens; the wire's, the combine's and the activations' rounding)", r.ErrorRel))
	}
	row("dispatch+combine pair", fmt.Sprintf("%.1f us back to back (mean; p50 %.1f us, p99 %.1f us)", r.PairUS, r.PairP50US, r.PairP99US))
	row("bytes per choice", fmt.Sprintf("%d (DeepEP's count; %d choices, %s)", r.BytesPerChoice, r.Choices, SizeOf(int64(r.BytesPerChoice)*r.Choices)))
	row("load imbalance", fmt.Sprintf("experts %.2f, ranks %.2f (max/mean); aux loss %.3f", r.ExpertImbal, r.RankImbal, r.AuxLoss))
	if r.Chunks > 0 {
		row("overlap", fmt.Sprintf("%d micro-batches: %.1f us one after the other, %.1f us pipelined (%.2fx)", r.Chunks, r.SerialUS, r.OverlapUS, r.OverlapSpeedup))
	}
	if r.LastRank != nil {
		longest := 0
		for q, w := range r.WaitForUS {
			if w > r.WaitForUS[longest] {
				longest = q
			}
		}
		waited := ""
		if longest < len(r.WaitForUS) {
			waited = fmt.Sprintf("; waited longest for rank %d (%.1f us per step)", longest, r.WaitForUS[longest])
		}
		if r.StepMode == dispatch.LowLatency.String() {
			row("exchange wait", fmt.Sprintf("%.1f us per step (longest over the ranks); last to arrive most often: rank %d%s", r.WaitUS, *r.LastRank, waited))
		} else {
			row("alltoallv wait / move", fmt.Sprintf("%.1f / %.1f us per step (longest over the ranks); last to arrive most often: rank %d%s", r.WaitUS, r.MoveUS, *r.LastRank, waited))
		}
	}
	if r.NaiveUS > 0 {
		row("naive dispatch", fmt.Sprintf("%.1f us, %d messages: fused is %.1fx faster", r.NaiveUS, r.NaiveMessages, r.FusedOverNaive))
	}
	row("verdict", Verdict(r))
	tw.Flush()
}

// Verdict is the run in one line: whether the combined output is right (its error
// within what the types' rounding allows; not checked with computing experts), tokens/s,
// and how far each stage is from its copy floor.
func Verdict(r *MoEResult) string {
	check := "output not checked (computing experts)"
	if r.Compute != "ffn" {
		tol := Tolerance(r.Act, r.Wire, r.CombineWire)
		if r.ErrorRel <= tol {
			check = fmt.Sprintf("output correct (error %.1e, within %.0e for these types)", r.ErrorRel, tol)
		} else {
			check = fmt.Sprintf("OUTPUT WRONG (error %.1e, over %.0e for these types)", r.ErrorRel, tol)
		}
	}
	return fmt.Sprintf("%s; %.0f tokens/s; dispatch %.1fx, combine %.1fx their copy floor", check, r.TokensPerS, r.Dispatch.OverP50, r.Combine.OverP50)
}

// Tolerance is the relative error (Frobenius, over every token) a step's output may
// have with identity experts, from the rounding of the coarsest of its types: the
// activations, the wire and the partial sums. Measured: f32 4e-8, bf16 2e-3, int8 7e-3,
// fp8 2e-2 (deepseek-v3); the tolerance is a few times that.
func Tolerance(types ...string) float64 {
	tol := 1e-6
	for _, t := range types {
		switch t {
		case "bf16", "f16":
			tol = max(tol, 1e-2)
		case "int8", "i8":
			tol = max(tol, 3e-2)
		case "fp8", "fp8e4m3", "e4m3":
			tol = max(tol, 8e-2)
		}
	}
	return tol
}

// SizeOf writes n bytes with one decimal in the largest unit that fits (KiB, MiB).
func SizeOf(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// modeOf names the mode a result ran in: the Auto mode with the one it picked.
func modeOf(r *MoEResult) string {
	if r.StepMode != "" && r.StepMode != r.Mode {
		return r.Mode + " (" + r.StepMode + " steps)"
	}
	return r.Mode
}
