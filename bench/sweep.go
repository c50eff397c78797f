package bench

import (
	"fmt"
	"io"
	"math"
	"text/tabwriter"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

// A sweep runs the MoE step at each of a range of ranks or tokens per rank and shows how
// each stage's time and each rank's buffers grow (moex bench moe --sweep).

// SweepValues are the points of a sweep over what ("ranks" or "tokens"): ranks 2 to 8
// where each rank is a process (shm, tcp, ucx), 2 to 64 in powers of two for goroutine
// ranks (inproc); tokens 1 to 512 in powers of two.
func SweepValues(what, transport string) ([]int, error) {
	switch what {
	case "ranks":
		if transport == "inproc" {
			return []int{2, 4, 8, 16, 32, 64}, nil
		}
		return []int{2, 3, 4, 5, 6, 7, 8}, nil
	case "tokens":
		return []int{1, 2, 4, 8, 16, 32, 64, 128, 256, 512}, nil
	}
	return nil, fmt.Errorf("bench: sweep %q: want ranks or tokens", what)
}

// DeepEPLowLatencyBytes is what DeepEP's low-latency mode allocates per rank for a
// dispatch of up to tokens tokens per rank of hidden bf16 values among experts experts,
// by the layout of its low-latency buffer (two of each, odd and even): a send buffer of
// a message per token, or per (expert, token) for the combine, and a receive buffer of
// a message per (local expert, source rank, token), that is per (expert, token), for
// the dispatch and for the combine. A dispatch message is a 16-byte header and the
// larger of a bf16 row and an fp8 row with its scales; a combine message a bf16 row. It
// grows with the experts and the tokens, not with the ranks.
func DeepEPLowLatencyBytes(tokens, hidden, experts int) int64 {
	scales := hidden / 128
	dispatchMsg := int64(16 + max(2*hidden, hidden+4*scales))
	combineMsg := int64(2*hidden + 4*scales)
	t, e := int64(tokens), int64(experts)
	send := max(t*dispatchMsg, e*t*combineMsg)
	recv := max(e*t*dispatchMsg, e*t*combineMsg)
	return 2 * (send + recv)
}

// PrintSweep writes a sweep's table: per point, each stage's p50 and mean, the pair,
// each rank's buffers, DeepEP's low-latency buffer for the same shape, and the growth
// of each from the first point.
func PrintSweep(w io.Writer, what string, rs []*MoEResult) {
	if len(rs) == 0 {
		return
	}
	r0 := rs[0]
	fmt.Fprintf(w, "# moex bench moe --sweep %s: %s (hidden %d, %d experts, top-%d) over %s, %s mode, %s on the wire\n",
		what, r0.Model, r0.Hidden, r0.Experts, r0.TopK, r0.Transport, r0.Mode, r0.Wire)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "ranks\ttokens\tstep mode\tdispatch p50 (us)\tmean\tcombine p50 (us)\tmean\tpair (us)\tdispatch buffers\tcombine buffers\tDeepEP LL buffer\tstep x\tbuffers x\t")
	first := rs[0].PairUS
	firstB := float64(r0.Dispatch.BufferBytes + r0.Combine.BufferBytes)
	for _, r := range rs {
		b := float64(r.Dispatch.BufferBytes + r.Combine.BufferBytes)
		fmt.Fprintf(tw, "%d\t%d\t%s\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%s\t%s\t%s\t%.2f\t%.2f\t\n", r.Ranks, r.TokensPerRank, r.StepMode,
			r.Dispatch.P50US, r.Dispatch.MeanUS, r.Combine.P50US, r.Combine.MeanUS, r.PairUS,
			SizeOf(r.Dispatch.BufferBytes), SizeOf(r.Combine.BufferBytes), SizeOf(DeepEPLowLatencyBytes(r.TokensPerRank, r.Hidden, r.Experts)),
			r.PairUS/first, b/math.Max(firstB, 1))
	}
	tw.Flush()
	fmt.Fprintf(w, "# buffers: what each rank holds (the most of any rank), fixed at New in the low-latency mode, the largest step's so far in the normal one; DeepEP LL buffer: DeepEPLowLatencyBytes for the same tokens, hidden and experts; x: over the first row\n")
}

// PlotSweep draws a sweep: each stage's p50 (top) and each rank's buffers beside
// DeepEP's low-latency buffer (bottom) against the swept value, on log axes.
func PlotSweep(path, what string, rs []*MoEResult) error {
	if len(rs) == 0 {
		return fmt.Errorf("bench: plot: no results")
	}
	x := func(r *MoEResult) float64 {
		if what == "ranks" {
			return float64(r.Ranks)
		}
		return float64(r.TokensPerRank)
	}
	tp, mp := plot.New(), plot.New()
	r0 := rs[0]
	xLabel := "tokens per rank"
	if what == "ranks" {
		xLabel = "ranks"
	}
	tp.Title.Text = fmt.Sprintf("One MoE step against the %s: each stage's p50 (the slowest rank), each rank's buffers\n%s over %s, %s mode", xLabel, r0.Model, r0.Transport, r0.Mode)
	lo, hi := x(rs[0]), x(rs[len(rs)-1])
	for _, p := range []*plot.Plot{tp, mp} {
		p.X.Label.Text = xLabel + " (log scale)"
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = plot.TickerFunc(func(_, _ float64) []plot.Tick {
			ts := make([]plot.Tick, len(rs))
			for i, r := range rs {
				ts[i] = plot.Tick{Value: x(r), Label: fmt.Sprint(x(r))}
			}
			return ts
		})
		// Room either side, so that the first and last labels are whole.
		p.X.Min, p.X.Max = lo/1.3, hi*1.3
	}
	var tys, mys []plotter.XYs
	series := func(f func(r *MoEResult) float64) plotter.XYs {
		xys := make(plotter.XYs, 0, len(rs))
		for _, r := range rs {
			if v := f(r); v > 0 {
				xys = append(xys, plotter.XY{X: x(r), Y: v})
			}
		}
		return xys
	}
	mib := func(b int64) float64 { return float64(b) / (1 << 20) }
	for i, s := range []struct {
		name string
		f    func(r *MoEResult) float64
	}{{"dispatch", func(r *MoEResult) float64 { return r.Dispatch.P50US }}, {"combine", func(r *MoEResult) float64 { return r.Combine.P50US }}} {
		xys := series(s.f)
		tys = append(tys, xys)
		if err := line(tp, s.name, i, 0, xys); err != nil {
			return err
		}
	}
	for i, s := range []struct {
		name string
		dash int
		f    func(r *MoEResult) float64
	}{
		{"dispatch buffers", 0, func(r *MoEResult) float64 { return mib(r.Dispatch.BufferBytes) }},
		{"combine buffers", 0, func(r *MoEResult) float64 { return mib(r.Combine.BufferBytes) }},
		{"DeepEP LL buffer", 1, func(r *MoEResult) float64 { return mib(DeepEPLowLatencyBytes(r.TokensPerRank, r.Hidden, r.Experts)) }},
	} {
		xys := series(s.f)
		mys = append(mys, xys)
		if err := line(mp, s.name, i, s.dash, xys); err != nil {
			return err
		}
	}
	ylo, yhi := extent(tys...)
	logAxis(&tp.Y, "p50, us", ylo, yhi)
	ylo, yhi = extent(mys...)
	logAxis(&mp.Y, "MiB per rank", ylo, yhi)
	return saveGrid(path, 20*vg.Centimeter, 20*vg.Centimeter, [][]*plot.Plot{{tp}, {mp}})
}
