package dispatch

import (
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/router"
)

// Output is what a rank's experts receive, seen through an expert-major view of
// entries: local expert i (Handle.Placement().Local[rank][i]) has the entries
// [Offsets[i], Offsets[i]+Counts[i]), then padding up to Offsets[i+1] (Config.Align),
// and the fields below describe entry j in every mode alike.
//
// The rows themselves are reached through methods, because where they lie depends on
// the mode: Entry(j) (QEntry for Config.Quantized) is entry j's row wherever it is, and
// Block(i) (QBlock) is local expert i's rows as one matrix. In the normal mode, or with
// Config.ExpertMajor in any mode, the rows are expert-major and Block copies nothing;
// elsewhere they stay where they arrived (or, read in place, in their origins' memory:
// Dispatcher.RowsInPlace), and Block gathers them. No layout is exposed that is true in
// one mode and not in another.
//
// The combine takes one expert output row per entry, in entry order. An Output and its
// slices are the dispatcher's: valid until the dispatch that reuses its buffers starts
// (InFlight dispatches later), and read-only.
type Output[T Act] struct {
	// Offsets[i] is local expert i's first entry; Offsets has one more element than the
	// rank has local experts, the last the number of entries.
	Offsets []int
	// Counts[i] is the entries of local expert i that are real (not padding).
	Counts []int
	// Origin[j] is the rank entry j's token came from (-1 for padding), Source[j] the
	// token's index there, Weight[j] the router's weight of the choice, Expert[j] the
	// global expert it chose.
	Origin []int32
	Source []int32
	Weight []float32
	Expert []int32

	// x holds the rows, Hidden values each (nil when Config.Quantized); q and scales
	// (Config.Quantized) hold them as the wire carries them. Entry j is row row[j]
	// (-1 for padding); where the rows are read in place, x spans every rank's staging.
	x           []T
	q           []byte
	scales      []float32
	row         []int32
	expertMajor bool // row[j] == j: local expert i's rows are one block of x
	hidden      int
	format      *Format
	h           Handle
	// gathered holds the blocks Block gathered (entry-indexed, Hidden values a row), and
	// qgathered and sgathered QBlock's; which experts they hold for this dispatch is
	// done and qdone.
	gathered  []T
	qgathered []byte
	sgathered []float32
	done      []bool
	qdone     []bool
}

// fill sets o from the slot's view.
func (o *Output[T]) fill(s *slot) {
	v := &s.view
	o.x, o.q, o.scales = nil, v.q, v.scales
	if v.x != nil {
		o.x = dtype.FromBytes[T](v.x)
	}
	o.Offsets, o.Counts, o.row = v.offsets, v.counts, v.row[:s.rowsOut]
	o.Origin, o.Source, o.Weight, o.Expert = v.origin[:s.rowsOut], v.source[:s.rowsOut], v.weight[:s.rowsOut], v.expert[:s.rowsOut]
	o.expertMajor, o.hidden, o.format = v.expertMajor, s.d.cfg.Hidden, &s.d.f
	o.h = Handle{s: s, gen: s.gen, pl: s.pl}
	o.done, o.qdone = resetFlags(o.done, len(o.Counts)), resetFlags(o.qdone, len(o.Counts))
}

func resetFlags(f []bool, n int) []bool {
	if cap(f) < n {
		return make([]bool, n)
	}
	f = f[:n]
	clear(f)
	return f
}

// Handle is the handle of the dispatch o holds: the one Dispatch returned with o, not
// valid once a later dispatch into the same buffers has begun.
func (o *Output[T]) Handle() Handle { return o.h }

// Rows returns the number of entries, padding included: the expert outputs passed to the
// combine have this many rows.
func (o *Output[T]) Rows() int { return len(o.Origin) }

// ExpertMajor reports whether the rows themselves are expert-major (the normal mode, or
// Config.ExpertMajor): Block and QBlock then copy nothing.
func (o *Output[T]) ExpertMajor() bool { return o.expertMajor }

// Entry returns the activations of entry j, Hidden values (nil for padding, or when
// Config.Quantized). The slice is the dispatcher's memory: read it, do not write it.
func (o *Output[T]) Entry(j int) []T {
	r := int(o.row[j])
	if r < 0 || o.x == nil {
		return nil
	}
	return o.x[r*o.hidden : (r+1)*o.hidden : (r+1)*o.hidden]
}

// Dequantize writes the values of entry j's quantised row (Config.Quantized) into dst,
// Hidden values (zeros for padding).
func (o *Output[T]) Dequantize(j int, dst []T) {
	r := int(o.row[j])
	if r < 0 {
		clear(dst)
		return
	}
	f := o.format
	decode(f, dtype.Bytes(dst), actType[T](), o.q[r*f.Payload:(r+1)*f.Payload], o.scales[r*f.Scales:(r+1)*f.Scales])
}

// QEntry returns entry j's row as the wire carries it (Config.Quantized): Format.Payload
// bytes of fp8 E4M3 or int8, and its Format.Scales float32 scales; nil for padding or
// without Config.Quantized. The slices are the dispatcher's memory: read-only.
func (o *Output[T]) QEntry(j int) ([]byte, []float32) {
	r := int(o.row[j])
	if r < 0 || o.q == nil {
		return nil, nil
	}
	f := o.format
	return o.q[r*f.Payload : (r+1)*f.Payload : (r+1)*f.Payload], o.scales[r*f.Scales : (r+1)*f.Scales : (r+1)*f.Scales]
}

// Gather copies local expert i's rows (Counts[i] of them) contiguously into dst, which
// must hold Counts[i] x Hidden values, and returns dst[:Counts[i]*Hidden]: one matrix
// per expert for kernels that want one, where the rows are not expert-major.
func (o *Output[T]) Gather(i int, dst []T) []T {
	a := o.Offsets[i]
	for k := 0; k < o.Counts[i]; k++ {
		copy(dst[k*o.hidden:(k+1)*o.hidden], o.Entry(a+k))
	}
	return dst[:o.Counts[i]*o.hidden]
}

// Block returns local expert i's rows, Counts[i] x Hidden values, contiguous: in place
// where the rows are expert-major (ExpertMajor), else gathered, once per dispatch and
// expert, into memory of the Output's (a copy: Config.ExpertMajor makes the dispatch
// lay them out so instead). nil when Config.Quantized (QBlock). Read-only.
func (o *Output[T]) Block(i int) []T {
	if o.x == nil {
		return nil
	}
	hid, a, n := o.hidden, o.Offsets[i], o.Counts[i]
	if o.expertMajor {
		return o.x[a*hid : (a+n)*hid : (a+n)*hid]
	}
	if len(o.gathered) < len(o.row)*hid {
		o.gathered = make([]T, len(o.row)*hid)
	}
	b := o.gathered[a*hid : (a+n)*hid : (a+n)*hid]
	if !o.done[i] {
		o.Gather(i, b)
		o.done[i] = true
	}
	return b
}

// QBlock is Block for Config.Quantized: local expert i's rows as the wire carries
// them, Counts[i] rows of Format.Payload bytes, and their scales, Format.Scales a row.
// nil unless Config.Quantized.
func (o *Output[T]) QBlock(i int) ([]byte, []float32) {
	if o.q == nil {
		return nil, nil
	}
	f := o.format
	a, n := o.Offsets[i], o.Counts[i]
	if o.expertMajor {
		return o.q[a*f.Payload : (a+n)*f.Payload : (a+n)*f.Payload], o.scales[a*f.Scales : (a+n)*f.Scales : (a+n)*f.Scales]
	}
	if rows := len(o.row); len(o.qgathered) < rows*f.Payload {
		o.qgathered, o.sgathered = make([]byte, rows*f.Payload), make([]float32, rows*f.Scales)
	}
	q, s := o.qgathered[a*f.Payload:(a+n)*f.Payload:(a+n)*f.Payload], o.sgathered[a*f.Scales:(a+n)*f.Scales:(a+n)*f.Scales]
	if !o.qdone[i] {
		for k := 0; k < n; k++ {
			eq, es := o.QEntry(a + k)
			copy(q[k*f.Payload:], eq)
			copy(s[k*f.Scales:], es)
		}
		o.qdone[i] = true
	}
	return q, s
}

// Handle is an opaque token for one dispatch, which the combine (and Redispatch) takes:
// a small value, valid until the dispatch that reuses its buffers starts (Valid says so,
// and the combine refuses a stale one on every rank). The zero Handle is not valid.
type Handle struct {
	s   *slot
	gen uint64
	pl  *router.Placement // the placement the dispatch used
}

// Valid reports whether h still describes its dispatcher's buffers.
func (h Handle) Valid() bool { return h.s != nil && !h.s.d.closed && h.s.valid && h.gen == h.s.gen }

// Rows is the number of entries (padding included) the dispatch delivered to this rank:
// the expert outputs passed to the combine have this many rows. 0 for the zero Handle.
func (h Handle) Rows() int {
	if h.s == nil {
		return 0
	}
	return h.s.rowsOut
}

// Tokens is the number of this rank's tokens in the dispatch: the combined output has
// this many rows. 0 for the zero Handle.
func (h Handle) Tokens() int {
	if h.s == nil {
		return 0
	}
	return h.s.tokens
}

// IncomingRows is the number of rows that came to this rank (a token once per rank,
// however many of the rank's experts it chose): Combiner.CombineRows takes one
// summed row per incoming row. 0 for the zero Handle.
func (h Handle) IncomingRows() int {
	if h.s == nil {
		return 0
	}
	return h.s.incomingRows()
}

// Contributions returns, for incoming row i, the entries it was delivered to and their
// router weights, in the order of the token's choices: how to sum the expert outputs of
// one incoming row for CombineRows. The slices are the dispatcher's, read-only.
func (h Handle) Contributions(i int) ([]int32, []float32) { return h.s.contributions(i) }

// Placement is the placement the dispatch used (nil for the zero Handle): local expert i
// of its Output is Placement().Local[rank][i].
func (h Handle) Placement() *router.Placement { return h.pl }

// Schedule returns a copy of the dispatch's schedule on this rank: what moved to and
// from every peer, and what its combine moves (with the partial sums of the combiner
// the dispatcher serves). The zero Schedule for the zero Handle.
func (h Handle) Schedule() Schedule {
	if h.s == nil {
		return Schedule{}
	}
	return h.s.sched.clone()
}

// valid reports whether h is one of d's and valid.
func (h Handle) of(d *core) bool { return h.s != nil && h.s.d == d && h.Valid() }

// incoming is the range of incoming rows from origin q.
func (s *rowMaps) incoming(q int) (int, int) { return s.originStart[q], s.originStart[q+1] }

// incomingRows is the number of incoming rows.
func (s *rowMaps) incomingRows() int { return s.originStart[len(s.originStart)-1] }

// contributions is Handle.Contributions.
func (s *rowMaps) contributions(i int) ([]int32, []float32) {
	a, b := s.start[i], s.start[i+1]
	return s.entries[a:b], s.weights[a:b]
}
