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

// logTicks labels 1, 2 and 5 times the powers of ten on a log axis, or every 1 to 9
// times them where that would label fewer than three.
func logTicks(lo, hi float64) []plot.Tick {
	if lo <= 0 || hi <= lo {
		return nil
	}
	mark := func(ms []float64) []plot.Tick {
		var ts []plot.Tick
		for e := math.Floor(math.Log10(lo)); math.Pow(10, e) <= hi; e++ {
			for _, m := range ms {
				if v := m * math.Pow(10, e); v >= lo*0.9999 && v <= hi*1.0001 {
					ts = append(ts, plot.Tick{Value: v, Label: fmt.Sprintf("%g", v)})
				}
			}
		}
		return ts
	}
	if ts := mark([]float64{1, 2, 5}); len(ts) >= 3 {
		return ts
	}
	return mark([]float64{1, 2, 3, 4, 5, 6, 7, 8, 9})
}

// logAxis makes a a log axis from the 1-2-5 value below the data's least to the one
// above its most, with labelled ticks, and says so in its label.
func logAxis(a *plot.Axis, label string, lo, hi float64) {
	a.Label.Text = label + " (log scale)"
	a.Scale = plot.LogScale{}
	a.Tick.Marker = plot.TickerFunc(logTicks)
	a.Min, a.Max = niceBelow(lo), niceAbove(hi)
}

// niceBelow and niceAbove round v down and up to 1, 2 or 5 times a power of ten.
func niceBelow(v float64) float64 {
	e := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{5, 2, 1} {
		if m*e <= v {
			return m * e
		}
	}
	return e
}

func niceAbove(v float64) float64 {
	e := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*e >= v {
			return m * e
		}
	}
	return 10 * e
}

// extent is the least and most Y of series (above 0), for a log axis.
func extent(series ...plotter.XYs) (float64, float64) {
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, xys := range series {
		for _, p := range xys {
			if p.Y > 0 {
				lo, hi = min(lo, p.Y), max(hi, p.Y)
			}
		}
	}
	return lo, hi
}

func logSizeAxis(p *plot.Plot, label string) {
	p.X.Label.Text = label + " (log scale)"
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
// .png, else SVG. Each plot's legend is drawn beside it, in a column of its own to the
// right of the grid, so that no legend covers data; the title, if any, is the first
// plot's, drawn across the top.
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
	// The legends come out of the plots, and the widest sets the column's width.
	legends := make([][]plot.Legend, len(rows))
	var legendW vg.Length
	for j, row := range rows {
		for _, p := range row {
			l := p.Legend
			l.Top, l.Left, l.XOffs, l.YOffs = true, true, 0, 0
			legends[j] = append(legends[j], l)
			p.Legend = plot.NewLegend()
			legendW = max(legendW, l.Rectangle(dc).Size().X)
		}
	}
	if legendW > 0 {
		legendW += vg.Millimeter * 4
	}
	title := rows[0][0].Title
	rows[0][0].Title.Text = ""
	if title.Text != "" {
		th := title.TextStyle.Rectangle(title.Text).Size().Y + vg.Millimeter*3
		title.TextStyle.XAlign, title.TextStyle.YAlign = draw.XCenter, draw.YTop
		dc.FillText(title.TextStyle, vg.Point{X: dc.Center().X, Y: dc.Max.Y - vg.Millimeter}, title.Text)
		dc = draw.Crop(dc, 0, 0, 0, -th)
	}
	grid := draw.Crop(dc, 0, -legendW, 0, 0)
	t := draw.Tiles{Rows: len(rows), Cols: len(rows[0]), PadX: vg.Millimeter * 4, PadY: vg.Millimeter * 4,
		PadTop: vg.Millimeter * 2, PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 2}
	canvases := plot.Align(rows, t, grid)
	for j := range rows {
		for i, p := range rows[j] {
			if p == nil {
				continue
			}
			p.Draw(canvases[j][i])
			tile := canvases[j][i]
			aside := draw.Canvas{Canvas: dc.Canvas, Rectangle: vg.Rectangle{
				Min: vg.Point{X: dc.Max.X - legendW + vg.Millimeter*3, Y: tile.Min.Y},
				Max: vg.Point{X: dc.Max.X, Y: tile.Max.Y - vg.Millimeter*2}}}
			legends[j][i].Draw(aside)
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
	tp.Title.Text = fmt.Sprintf("One MoE dispatch sent five ways: time and CPU against the chunk size\n%s, %d ranks over %s, %d tokens per rank",
		r.Model, r.Ranks, r.Transport, r.TokensPerRank)
	logSizeAxis(tp, "chunk size, bytes")
	logSizeAxis(cp, "chunk size, bytes")
	cp.Y.Label.Text = "CPU seconds per GB moved"
	cp.Y.Min = 0
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
	if err := line(tp, "chunked, p50", 0, 0, p50); err != nil {
		return err
	}
	if err := line(tp, "chunked, p99", 0, 2, p99); err != nil {
		return err
	}
	if err := line(cp, "chunked", 0, 0, cpu); err != nil {
		return err
	}
	flat := plotter.XYs{}
	for i, x := range r.Rows {
		if x.Way == WayChunked {
			continue
		}
		flat = append(flat, plotter.XY{Y: x.P50US})
		if err := hline(tp, x.Way+", p50", i+1, x0, x1, x.P50US); err != nil {
			return err
		}
		if err := hline(cp, x.Way, i+1, x0, x1, x.CPUSecGB); err != nil {
			return err
		}
	}
	lo, hi := extent(p50, p99, flat)
	logAxis(&tp.Y, "dispatch time, us", lo, hi)
	return saveGrid(path, 20*vg.Centimeter, 20*vg.Centimeter, [][]*plot.Plot{{tp}, {cp}})
}

// PlotColl writes bandwidth against size (top: bus bandwidth per operation and
// transport, with the copy floor's bandwidth dashed) and the latency percentiles of the
// slowest rank (bottom).
func PlotColl(path string, rows []CollResult) error {
	bw, lat := plot.New(), plot.New()
	bw.Title.Text = "moex bench coll: bus bandwidth, and the slowest rank's time, against the size"
	if rows[0].Run != nil {
		bw.Title.Text += "\n" + rows[0].Run.CPU
	}
	logSizeAxis(bw, "size, bytes per rank")
	logSizeAxis(lat, "size, bytes per rank")
	bw.Y.Label.Text = "bus bandwidth, GB/s"
	bw.Y.Min = 0
	var all []plotter.XYs
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
		all = append(all, p50, p90, p99)
		for j, s := range []struct {
			n  string
			xy plotter.XYs
		}{{"p50", p50}, {"p90", p90}, {"p99", p99}} {
			if err := line(lat, name+" "+s.n, i, j, s.xy); err != nil {
				return err
			}
		}
	}
	lo, hi := extent(all...)
	logAxis(&lat.Y, "time, us", lo, hi)
	return saveGrid(path, 22*vg.Centimeter, 22*vg.Centimeter, [][]*plot.Plot{{bw}, {lat}})
}

// PlotMoE compares runs of one MoE step (in different modes, or with different tokens
// per rank): a stacked bar per run, dispatch, expert compute and combine (the p50 of the
// slowest rank per stage, compute its mean), with the step's total above it and each
// run's copy floor of its two stages marked.
func PlotMoE(path string, rs []*MoEResult) error {
	if len(rs) == 0 {
		return fmt.Errorf("bench: plot: no results")
	}
	r0 := rs[0]
	p := plot.New()
	p.Title.Text = fmt.Sprintf("One MoE step per run: dispatch, expert compute, combine (p50 of the slowest rank)\n%s, %d ranks over %s, %s on the wire",
		r0.Model, r0.Ranks, r0.Transport, r0.Wire)
	p.Y.Label.Text = "time per step, us"
	p.Y.Min = 0
	d, e, c := make(plotter.Values, len(rs)), make(plotter.Values, len(rs)), make(plotter.Values, len(rs))
	names := make([]string, len(rs))
	var totals plotter.XYLabels
	var floors plotter.XYs
	top := 0.0
	for i, r := range rs {
		d[i], e[i], c[i] = r.Dispatch.P50US, r.ComputeUS, r.Combine.P50US
		mode := r.Mode
		if r.StepMode != "" && r.StepMode != r.Mode {
			mode += " (" + r.StepMode + " steps)"
		}
		names[i] = fmt.Sprintf("%s\n%d tokens per rank", mode, r.TokensPerRank)
		total := d[i] + e[i] + c[i]
		top = max(top, total)
		totals.XYs = append(totals.XYs, plotter.XY{X: float64(i), Y: total})
		totals.Labels = append(totals.Labels, fmt.Sprintf("%.0f us", total))
		floors = append(floors, plotter.XY{X: float64(i), Y: r.Dispatch.FloorUS + r.Combine.FloorUS})
	}
	w := vg.Points(50)
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
	fl, err := plotter.NewScatter(floors)
	if err != nil {
		return err
	}
	fl.Shape = draw.BoxGlyph{}
	fl.Color, fl.Radius = color.Black, vg.Points(3)
	p.Add(fl)
	p.Legend.Add("copy floor of the two stages", fl)
	labels, err := plotter.NewLabels(totals)
	if err != nil {
		return err
	}
	for i := range labels.TextStyle {
		labels.TextStyle[i].XAlign = draw.XCenter
		labels.Offset = vg.Point{Y: vg.Points(4)}
	}
	p.Add(labels)
	p.Y.Max = 1.12 * top
	p.NominalX(names...)
	return saveGrid(path, vg.Length(max(20, 6*len(rs)+12))*vg.Centimeter, 13*vg.Centimeter, [][]*plot.Plot{{p}})
}
