package dispatch

import (
	"encoding/binary"
	"math"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/router"
)

// Handle remembers one dispatch's layout for package combine (and Redispatch). It is a
// small value; it is valid until the next Dispatch on its Dispatcher (Valid says so, and
// combine refuses a stale one).
type Handle struct {
	d   *Dispatcher
	gen uint64
}

// handleState is what a Handle refers to, kept in the Dispatcher and reused.
type handleState struct {
	tokens int
	r      *router.Routing
	// Incoming rows, in order (origin rank ascending, then the origin's token order):
	// originStart[s] is the first incoming row from origin s; the contributions of row i
	// (expert-major rows and weights) are rows[start[i]:start[i+1]].
	originStart []int
	start       []int32
	rows        []int32
	weights     []float32
}

// Valid reports whether h still describes its Dispatcher's buffers.
func (h Handle) Valid() bool { return h.d != nil && h.gen == h.d.gen }

// Dispatcher returns the dispatcher that made h.
func (h Handle) Dispatcher() *Dispatcher { return h.d }

// Tokens is the number of this rank's tokens.
func (h Handle) Tokens() int { return h.d.h.tokens }

// Routing is the routing h was made from.
func (h Handle) Routing() *router.Routing { return h.d.h.r }

// Incoming returns the range [start, end) of incoming rows from origin rank s.
func (h Handle) Incoming(s int) (start, end int) { return h.d.h.originStart[s], h.d.h.originStart[s+1] }

// Contributions returns, for incoming row i, the expert-major rows it was copied to and
// their router weights (in the order of the token's choices).
func (h Handle) Contributions(i int) ([]int32, []float32) {
	st := &h.d.h
	a, b := st.start[i], st.start[i+1]
	return st.rows[a:b], st.weights[a:b]
}

// RowsTo lists the tokens of this rank that went to rank q, in the order they were sent.
func (h Handle) RowsTo(q int) []int32 { return h.d.layout.Rows[q] }

// Back is the row matrix of the way back: Back()[i][j] rows go from rank i to rank j
// (diagonal zero: a rank's own rows never touch the wire).
func (h Handle) Back() [][]int { return h.d.back }

func putF32(b []byte, v float32) { binary.LittleEndian.PutUint32(b, math.Float32bits(v)) }
func getF32(b []byte) float32    { return math.Float32frombits(binary.LittleEndian.Uint32(b)) }

// packRow writes token t's row for destination rank q.
func (d *Dispatcher) packRow(dst []byte, x []float32, t, q int) {
	rt, pl, me, k := d.h.r, d.cfg.Placement, d.c.Rank(), d.cfg.TopK
	n := 0
	for j := 0; j < k; j++ {
		e := int(rt.Experts[t*k+j])
		if e < 0 || pl.RankOf(e, me, t) != q {
			continue
		}
		o := 8 + 8*n
		binary.LittleEndian.PutUint32(dst[o:], uint32(pl.LocalIndex(q, e)))
		putF32(dst[o+4:], rt.Weights[t*k+j])
		n++
	}
	binary.LittleEndian.PutUint32(dst[0:], uint32(t))
	binary.LittleEndian.PutUint32(dst[4:], uint32(n))
	row := x[t*d.cfg.Hidden : (t+1)*d.cfg.Hidden]
	payload := dst[metaBytes(k) : metaBytes(k)+d.cfg.Hidden*d.es]
	if d.cfg.WireDType == dtype.BF16 {
		dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](payload), row)
	} else {
		copy(payload, dtype.Bytes(row))
	}
}

// contrib is one (local expert, weight) pair of an incoming row.
type contrib struct {
	le int
	w  float32
}

// rowCursor walks the incoming rows in order (origin ascending, then the origin's order):
// received ones from d.recv, this rank's own straight from x.
type rowCursor struct {
	d       *Dispatcher
	x       []float32
	s, i    int // origin rank, row index within it
	off     int // offset in d.recv
	src     int
	cs      []contrib
	payload []byte    // received row (wire type)
	own     []float32 // own row
}

func (d *Dispatcher) cursor(x []float32) rowCursor {
	return rowCursor{d: d, x: x, s: 0, i: -1, cs: d.cs[:0]}
}

// next advances to the next incoming row; false at the end.
func (c *rowCursor) next() bool {
	d := c.d
	p, me, k, hid := d.c.Size(), d.c.Rank(), d.cfg.TopK, d.cfg.Hidden
	pl := d.cfg.Placement
	for c.s < p {
		c.i++
		n := d.matrix[c.s][me]
		if c.s == me {
			n = len(d.layout.Rows[me])
		}
		if c.i >= n {
			c.s++
			c.i = -1
			continue
		}
		c.cs = c.cs[:0]
		if c.s == me {
			t := int(d.layout.Rows[me][c.i])
			r := d.h.r
			for j := 0; j < k; j++ {
				e := int(r.Experts[t*k+j])
				if e >= 0 && pl.RankOf(e, me, t) == me {
					c.cs = append(c.cs, contrib{pl.LocalIndex(me, e), r.Weights[t*k+j]})
				}
			}
			c.src, c.payload, c.own = t, nil, c.x[t*hid:(t+1)*hid]
			return true
		}
		row := d.recv[c.off : c.off+d.row]
		c.off += d.row
		c.src = int(binary.LittleEndian.Uint32(row[0:]))
		m := int(binary.LittleEndian.Uint32(row[4:]))
		for j := 0; j < m && j < k; j++ {
			c.cs = append(c.cs, contrib{int(binary.LittleEndian.Uint32(row[8+8*j:])), getF32(row[12+8*j:])})
		}
		c.payload, c.own = row[metaBytes(k):metaBytes(k)+hid*d.es], nil
		return true
	}
	return false
}

// unpack scatters this rank's incoming rows into expert-major blocks and records the
// handle's maps.
func (d *Dispatcher) unpack(x []float32) {
	p, me, hid := d.c.Size(), d.c.Rank(), d.cfg.Hidden
	pl := d.cfg.Placement
	nLocal := len(pl.Local[me])
	h := &d.h
	o := &d.out
	if cap(d.cs) < d.cfg.TopK {
		d.cs = make([]contrib, 0, d.cfg.TopK)
	}
	o.Counts = growInts(o.Counts, nLocal)
	clear(o.Counts)
	o.Offsets = growInts(o.Offsets, nLocal+1)
	d.fill = growInts(d.fill, nLocal)
	clear(d.fill)
	h.originStart = growInts(h.originStart, p+1)

	// Pass 1: rows per local expert.
	incoming, contribs := 0, 0
	for c := d.cursor(x); c.next(); {
		incoming++
		contribs += len(c.cs)
		for _, x := range c.cs {
			o.Counts[x.le]++
		}
	}
	total := 0
	for i, c := range o.Counts {
		o.Offsets[i] = total
		total += (c + d.cfg.Align - 1) / d.cfg.Align * d.cfg.Align
	}
	o.Offsets[nLocal] = total
	o.X = dtype.FromBytes[float32](d.xS.Bytes(total * hid * 4))
	o.Origin = growI32(o.Origin, total)
	o.Source = growI32(o.Source, total)
	o.Weight = growF32(o.Weight, total)
	o.Expert = growI32(o.Expert, total)
	h.start = growI32(h.start, incoming+1)
	h.rows = growI32(h.rows, contribs)
	h.weights = growF32(h.weights, contribs)
	// Padding rows.
	for i, c := range o.Counts {
		for r := o.Offsets[i] + c; r < o.Offsets[i+1]; r++ {
			clear(o.X[r*hid : (r+1)*hid])
			o.Origin[r], o.Source[r], o.Weight[r], o.Expert[r] = -1, -1, 0, int32(pl.Local[me][i])
		}
	}
	// Pass 2: scatter.
	row, ci := 0, 0
	lastOrigin := -1
	for c := d.cursor(x); c.next(); {
		for lastOrigin < c.s {
			lastOrigin++
			h.originStart[lastOrigin] = row
		}
		h.start[row] = int32(ci)
		for _, x := range c.cs {
			dst := o.Offsets[x.le] + d.fill[x.le]
			d.fill[x.le]++
			out := o.X[dst*hid : (dst+1)*hid]
			switch {
			case c.own != nil:
				copy(out, c.own)
			case d.cfg.WireDType == dtype.BF16:
				dtype.BF16ToF32(out, dtype.FromBytes[dtype.BFloat16](c.payload))
			default:
				copy(dtype.Bytes(out), c.payload)
			}
			o.Origin[dst], o.Source[dst], o.Weight[dst] = int32(c.s), int32(c.src), x.w
			o.Expert[dst] = int32(pl.Local[me][x.le])
			h.rows[ci], h.weights[ci] = int32(dst), x.w
			ci++
		}
		row++
	}
	for lastOrigin < p {
		lastOrigin++
		h.originStart[lastOrigin] = row
	}
	h.start[row] = int32(ci)
}

func growInts(s []int, n int) []int {
	if cap(s) < n {
		return make([]int, n)
	}
	return s[:n]
}

func growI32(s []int32, n int) []int32 {
	if cap(s) < n {
		return make([]int32, n)
	}
	return s[:n]
}

func growF32(s []float32, n int) []float32 {
	if cap(s) < n {
		return make([]float32, n)
	}
	return s[:n]
}

// Rows is the number of expert-major rows the dispatch delivered to this rank (padding
// included): the expert outputs passed to combine have this many rows.
func (h Handle) Rows() int { return len(h.d.out.Origin) }
