package bench

import (
	"fmt"
	"image/color"
	"io"
	"math"
	"os"
	"sort"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// The plots are drawn with gonum.org/v1/plot, as SVG (or PNG, for a path ending in .png).

var palette = []color.Color{
	color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
	color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
	color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
	color.RGBA{R: 0x8c, G: 0x56, B: 0x4b, A: 0xff},
	color.RGBA{R: 0x7f, G: 0x7f, B: 0x7f, A: 0xff},
}

func colorOf(i int) color.Color { return palette[i%len(palette)] }

// sizeTicks marks powers of two on a log axis of bytes, labelled 4K, 1M.
func sizeTicks(lo, hi float64) []plot.Tick {
	var ts []plot.Tick
	step := 1
	if hi/lo > 1<<12 {
		step = 2
	}
	for e := int(math.Floor(math.Log2(lo))); float64(uint64(1)<<e) <= hi*1.0001; e += step {
		v := float64(uint64(1) << e)
		if v < lo*0.9999 {
			continue
		}
		ts = append(ts, plot.Tick{Value: v, Label: shortSize(int64(v))})
	}
	return ts
}

func shortSize(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%dG", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dM", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dK", n>>10)
	}
	return fmt.Sprint(n)
}

// logTicks labels 1, 2 and 5 times the powers of ten on a log axis.
func logTicks(lo, hi float64) []plot.Tick {
	var ts []plot.Tick
	if lo <= 0 || hi <= lo {
		return ts
	}
	for e := math.Floor(math.Log10(lo)); math.Pow(10, e) <= hi; e++ {
		for _, m := range []float64{1, 2, 5} {
			v := m * math.Pow(10, e)
			if v >= lo && v <= hi {
				ts = append(ts, plot.Tick{Value: v, Label: fmt.Sprintf("%g", v)})
			}
		}
	}
	return ts
}

func logSizeAxis(p *plot.Plot, label string) {
	p.X.Label.Text = label
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.TickerFunc(sizeTicks)
}

// line adds a line with points in color i, named in the legend; dash 0 is solid, 1
// dashed, 2 dotted.
func line(p *plot.Plot, name string, i int, dash int, xys plotter.XYs) error {
	l, pts, err := plotter.NewLinePoints(xys)
	if err != nil {
		return err
	}
	l.Color, pts.Color = colorOf(i), colorOf(i)
	pts.Shape = draw.CircleGlyph{}
	pts.Radius = vg.Points(2)
	switch dash {
	case 1:
		l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
	case 2:
		l.Dashes = []vg.Length{vg.Points(1), vg.Points(2)}
	}
	p.Add(l, pts)
	p.Legend.Add(name, l)
	return nil
}

// hline adds a dashed horizontal line from x0 to x1 at y, named in the legend.
func hline(p *plot.Plot, name string, i int, x0, x1, y float64) error {
	l, err := plotter.NewLine(plotter.XYs{{X: x0, Y: y}, {X: x1, Y: y}})
	if err != nil {
		return err
	}
	l.Color = colorOf(i)
	l.Dashes = []vg.Length{vg.Points(5), vg.Points(4)}
	p.Add(l)
	p.Legend.Add(name, l)
	return nil
}

// saveGrid draws plots in a grid of rows and writes one file: PNG when path ends in
// .png, else SVG.
func saveGrid(path string, w, h vg.Length, rows [][]*plot.Plot) error {
	var c interface {
		vg.CanvasSizer
		io.WriterTo
	}
	if strings.HasSuffix(strings.ToLower(path), ".png") {
		c = vgimg.PngCanvas{Canvas: vgimg.New(w, h)}
	} else {
		c = vgsvg.New(w, h)
	}
	dc := draw.New(c)
	t := draw.Tiles{Rows: len(rows), Cols: len(rows[0]), PadX: vg.Millimeter * 4, PadY: vg.Millimeter * 4,
		PadTop: vg.Millimeter * 2, PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 2}
	canvases := plot.Align(rows, t, dc)
	for j := range rows {
		for i, p := range rows[j] {
			if p != nil {
				p.Draw(canvases[j][i])
			}
		}
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := c.WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// PlotCoalesce writes the coalescing curve: p50 and p99 time (top) and CPU seconds per GB
// (bottom) against the chunk size, with the unchunked ways as dashed lines.
func PlotCoalesce(path string, r *CoalesceResult) error {
	tp, cp := plot.New(), plot.New()
	tp.Title.Text = fmt.Sprintf("coalescing: %s, %d ranks over %s, %d tokens per rank", r.Model, r.Ranks, r.Transport, r.TokensPerRank)
	logSizeAxis(tp, "chunk size (bytes)")
	logSizeAxis(cp, "chunk size (bytes)")
	tp.Y.Label.Text = "dispatch time (us)"
	cp.Y.Label.Text = "CPU s per GB"
	tp.Legend.Top, cp.Legend.Top = true, true
	tp.Legend.XOffs, cp.Legend.XOffs = -vg.Millimeter*2, -vg.Millimeter*2
	var p50, p99, cpu plotter.XYs
	for _, x := range r.Rows {
		if x.Way == WayChunked {
			p50 = append(p50, plotter.XY{X: float64(x.ChunkBytes), Y: x.P50US})
			p99 = append(p99, plotter.XY{X: float64(x.ChunkBytes), Y: x.P99US})
			cpu = append(cpu, plotter.XY{X: float64(x.ChunkBytes), Y: x.CPUSecGB})
		}
	}
	if len(p50) == 0 {
		return fmt.Errorf("bench: plot: no chunked rows")
	}
	x0, x1 := p50[0].X, p50[len(p50)-1].X
	if err := line(tp, "chunked p50", 0, 0, p50); err != nil {
		return err
	}
	if err := line(tp, "chunked p99", 0, 2, p99); err != nil {
		return err
	}
	if err := line(cp, "chunked", 0, 0, cpu); err != nil {
		return err
	}
	for i, x := range r.Rows {
		if x.Way == WayChunked {
			continue
		}
		if err := hline(tp, x.Way+" p50", i+1, x0, x1, x.P50US); err != nil {
			return err
		}
		if err := hline(cp, x.Way, i+1, x0, x1, x.CPUSecGB); err != nil {
			return err
		}
	}
	tp.Y.Scale, tp.Y.Tick.Marker = plot.LogScale{}, plot.TickerFunc(logTicks)
	return saveGrid(path, 18*vg.Centimeter, 20*vg.Centimeter, [][]*plot.Plot{{tp}, {cp}})
}

// PlotColl writes bandwidth against size (top: bus bandwidth per operation and
// transport, with the copy floor's bandwidth dashed) and the latency percentiles of the
// slowest rank (bottom).
func PlotColl(path string, rows []CollResult) error {
	bw, lat := plot.New(), plot.New()
	bw.Title.Text = "moex bench coll"
	logSizeAxis(bw, "size (bytes per rank)")
	logSizeAxis(lat, "size (bytes per rank)")
	bw.Y.Label.Text = "bus bandwidth (GB/s)"
	lat.Y.Label.Text = "time (us)"
	lat.Y.Scale, lat.Y.Tick.Marker = plot.LogScale{}, plot.TickerFunc(logTicks)
	bw.Legend.Top, lat.Legend.Top = true, true
	type key struct{ op, tr, bufs string }
	series := map[key][]CollResult{}
	var keys []key
	for _, r := range rows {
		if r.Bytes <= 0 {
			continue // a log axis has no 0
		}
		k := key{r.Op, r.Transport, r.Buffers}
		if _, ok := series[k]; !ok {
			keys = append(keys, k)
		}
		series[k] = append(series[k], r)
	}
	if len(keys) == 0 {
		return fmt.Errorf("bench: plot: no rows above 0 bytes")
	}
	for i, k := range keys {
		rs := series[k]
		sort.Slice(rs, func(a, b int) bool { return rs[a].Bytes < rs[b].Bytes })
		var b, floor, p50, p90, p99 plotter.XYs
		for _, r := range rs {
			x := float64(r.Bytes)
			b = append(b, plotter.XY{X: x, Y: r.BusBW})
			if r.FloorUS > 0 && r.TimeUS > 0 {
				floor = append(floor, plotter.XY{X: x, Y: r.BusBW * r.TimeUS / r.FloorUS})
			}
			p50 = append(p50, plotter.XY{X: x, Y: max(r.P50US, 1e-3)})
			p90 = append(p90, plotter.XY{X: x, Y: max(r.P90US, 1e-3)})
			p99 = append(p99, plotter.XY{X: x, Y: max(r.P99US, 1e-3)})
		}
		name := k.op + " " + k.tr
		if k.bufs != "" && k.bufs != "obuf" {
			name += " " + k.bufs
		}
		if err := line(bw, name, i, 0, b); err != nil {
			return err
		}
		if len(floor) > 0 {
			if err := line(bw, name+" copy floor", i, 1, floor); err != nil {
				return err
			}
		}
		for j, s := range []struct {
			n  string
			xy plotter.XYs
		}{{"p50", p50}, {"p90", p90}, {"p99", p99}} {
			if err := line(lat, name+" "+s.n, i, j, s.xy); err != nil {
				return err
			}
		}
	}
	return saveGrid(path, 18*vg.Centimeter, 22*vg.Centimeter, [][]*plot.Plot{{bw}, {lat}})
}

// PlotMoE writes one stacked bar per result: dispatch, expert compute and combine (the
// p50 of the slowest rank per stage, compute its mean), labelled by model and mode.
func PlotMoE(path string, rs []*MoEResult) error {
	if len(rs) == 0 {
		return fmt.Errorf("bench: plot: no results")
	}
	p := plot.New()
	p.Title.Text = "MoE layer step: dispatch, expert compute, combine"
	p.Y.Label.Text = "time (us)"
	p.Legend.Top = true
	d, e, c := make(plotter.Values, len(rs)), make(plotter.Values, len(rs)), make(plotter.Values, len(rs))
	names := make([]string, len(rs))
	for i, r := range rs {
		d[i], e[i], c[i] = r.Dispatch.P50US, r.ComputeUS, r.Combine.P50US
		names[i] = fmt.Sprintf("%s\n%s %s, %d tok", r.Model, r.Mode, r.Wire, r.TokensPerRank)
	}
	w := vg.Points(24)
	var prev *plotter.BarChart
	for i, s := range []struct {
		n string
		v plotter.Values
	}{{"dispatch", d}, {"expert compute", e}, {"combine", c}} {
		b, err := plotter.NewBarChart(s.v, w)
		if err != nil {
			return err
		}
		b.Color, b.LineStyle.Width = colorOf(i), 0
		if prev != nil {
			b.StackOn(prev)
		}
		prev = b
		p.Add(b)
		p.Legend.Add(s.n, b)
	}
	p.NominalX(names...)
	return p.Save(vg.Length(max(12, 3*len(rs)))*vg.Centimeter, 12*vg.Centimeter, path)
}
