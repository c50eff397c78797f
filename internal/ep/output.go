package ep

import (
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/router"
)

// Output is what a rank's experts receive. Its rows are seen through an expert-major
// view: local expert i (global expert Expert[Offsets[i]]... or the placement's
// Local[rank][i]) has the entries [Offsets[i], Offsets[i+1]), the first Counts[i] of
// them real (the rest padding, Config.Align); entry j is row Row[j] of X (or of Q).
//
// Walk the entries, not the rows: Entry(j) is entry j's row wherever it lies, and
// Gather(i, dst) copies expert i's rows into one matrix. Only where ExpertMajor holds
// (the normal mode) are the rows themselves expert-major (Row[j] == j), so that local
// expert i's rows are one block of X; in the low-latency mode they stay where they
// arrived, MaxTokens rows per source rank, and nothing is copied; where they are read
// in place (Dispatcher.RowsInPlace), X (or Q and Scales) spans every rank's staging
// and entry j's row is its token's index at its origin in that rank's part: the rows
// are the origins' memory, to be read until the combine of this dispatch starts and
// not written.
//
// The combine takes one expert output row per entry, in entry order.
type Output[T Act] struct {
	// X holds rows of Hidden values (nil when Config.Quantized).
	X []T
	// Q and Scales (Config.Quantized) hold the rows as the wire carries them: Hidden
	// bytes of fp8 E4M3 or int8 per row, and Format.Scales float32 scales per row.
	Q      []byte
	Scales []float32
	// The view.
	Offsets []int
	Counts  []int
	Row     []int32 // per entry: its row (-1 for padding)
	// Per entry: origin rank (-1 for padding), token index at the origin, router
	// weight, and global expert id.
	Origin []int32
	Source []int32
	Weight []float32
	Expert []int32
	// ExpertMajor says the rows themselves are expert-major (entry j is row j of X or Q:
	// the normal mode), so that local expert i's rows are one block of X.
	ExpertMajor bool
	hidden      int
	format      *Format
	h           Handle
}

// fill sets o from the slot's view.
func (o *Output[T]) fill(s *slot) {
	v := &s.view
	o.X, o.Q, o.Scales = nil, v.q, v.scales
	if v.x != nil {
		o.X = dtype.FromBytes[T](v.x)
	}
	o.Offsets, o.Counts, o.Row = v.offsets, v.counts, v.row[:s.rowsOut]
	o.Origin, o.Source, o.Weight, o.Expert = v.origin[:s.rowsOut], v.source[:s.rowsOut], v.weight[:s.rowsOut], v.expert[:s.rowsOut]
	o.ExpertMajor, o.hidden, o.format = v.expertMajor, s.d.cfg.Hidden, &s.d.f
	o.h = Handle{s: s, gen: s.gen, pl: s.pl}
}

// Handle is the handle of the dispatch o holds: the one Dispatch returned with o, not
// Valid once a later dispatch into the same buffers has begun.
func (o *Output[T]) Handle() Handle { return o.h }

// Rows returns the number of entries (expert-major rows, padding included): the expert
// outputs passed to the combine have this many rows.
func (o *Output[T]) Rows() int { return len(o.Origin) }

// Entry returns the activations of entry j (nil for padding, or when quantised).
func (o *Output[T]) Entry(j int) []T {
	r := int(o.Row[j])
	if r < 0 || o.X == nil {
		return nil
	}
	return o.X[r*o.hidden : (r+1)*o.hidden]
}

// Dequantize writes the values of entry j's quantised row (Config.Quantized) into dst,
// Hidden values.
func (o *Output[T]) Dequantize(j int, dst []T) {
	r := int(o.Row[j])
	if r < 0 {
		clear(dst)
		return
	}
	f := o.format
	decode(f, dtype.Bytes(dst), actType[T](), o.Q[r*f.Payload:(r+1)*f.Payload], o.Scales[r*f.Scales:(r+1)*f.Scales])
}

// QEntry returns entry j's row as the wire carries it and its scales (Config.Quantized);
// nil for padding or unquantised rows.
func (o *Output[T]) QEntry(j int) ([]byte, []float32) {
	r := int(o.Row[j])
	if r < 0 || o.Q == nil {
		return nil, nil
	}
	f := o.format
	return o.Q[r*f.Payload : (r+1)*f.Payload : (r+1)*f.Payload], o.Scales[r*f.Scales : (r+1)*f.Scales : (r+1)*f.Scales]
}

// Hidden is the values of a row.
func (o *Output[T]) Hidden() int { return o.hidden }

// Format is the wire format of the rows.
func (o *Output[T]) Format() *Format { return o.format }

// Gather copies local expert i's rows (Counts[i] of them) contiguously into dst, which
// must hold Counts[i] x Hidden values, and returns dst: for expert kernels that want one
// matrix per expert in the low-latency mode (in the normal mode the block of X already
// is one).
func (o *Output[T]) Gather(i int, dst []T) []T {
	a := o.Offsets[i]
	for k := 0; k < o.Counts[i]; k++ {
		copy(dst[k*o.hidden:(k+1)*o.hidden], o.Entry(a+k))
	}
	return dst[:o.Counts[i]*o.hidden]
}

// Handle is an opaque token for one dispatch, which the combine (and Redispatch) takes:
// a small value, valid until the dispatch that reuses its buffers starts (Valid says so,
// and the combine refuses a stale one on every rank).
type Handle struct {
	s   *slot
	gen uint64
	pl  *router.Placement // the placement the dispatch used
}

// Valid reports whether h still describes its dispatcher's buffers.
func (h Handle) Valid() bool { return h.s != nil && !h.s.d.closed && h.s.valid && h.gen == h.s.gen }

// Rows is the number of entries (expert-major rows, padding included) the dispatch
// delivered to this rank: the expert outputs passed to the combine have this many rows.
func (h Handle) Rows() int { return h.s.rowsOut }

// Tokens is the number of this rank's tokens: the combined output has this many rows.
func (h Handle) Tokens() int { return h.s.tokens }

// IncomingRows is the number of rows that came to this rank (a token once per rank,
// however many of the rank's experts it chose): Combiner.CombineRows takes one summed
// row per incoming row.
func (h Handle) IncomingRows() int { return h.s.originStart[len(h.s.originStart)-1] }

// Contributions returns, for incoming row i, the entries it was delivered to and their
// router weights (in the order of the token's choices): how to sum the expert outputs
// of one incoming row for CombineRows.
func (h Handle) Contributions(i int) ([]int32, []float32) {
	s := h.s
	a, b := s.start[i], s.start[i+1]
	return s.entries[a:b], s.weights[a:b]
}

// Placement is the placement the dispatch used (nil for a zero Handle): local expert i
// of its Output is Placement().Local[rank][i].
func (h Handle) Placement() *router.Placement { return h.pl }

// Schedule is the dispatch's schedule on this rank: what moved to and from every peer,
// and what its combine will move (with the partial sums of the combiner the dispatcher
// serves). Read-only; valid while h is.
func (h Handle) Schedule() *Schedule { return &h.s.sched }

// valid reports whether h is one of d's and valid.
func (h Handle) of(d *core) bool { return h.s != nil && h.s.d == d && h.Valid() }

// incoming is the range of incoming rows from origin q.
func (s *slot) incoming(q int) (int, int) { return s.originStart[q], s.originStart[q+1] }

// incomingRows is the number of incoming rows.
func (s *slot) incomingRows() int { return s.originStart[len(s.originStart)-1] }

// contributions is Handle.Contributions.
func (s *slot) contributions(i int) ([]int32, []float32) {
	a, b := s.start[i], s.start[i+1]
	return s.entries[a:b], s.weights[a:b]
}
