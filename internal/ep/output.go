package ep

import (
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/router"
)

// Output is what a rank's experts receive. Its rows are seen through an expert-major
// view: local expert i's entries are [Offsets[i], Offsets[i+1]), the first Counts[i] of
// them real (the rest padding, Config.Align); entry j is row Row[j] of X (or of Q). In
// the normal mode the rows themselves are expert-major (Row[j] == j); in the
// low-latency mode they stay where they arrived, MaxTokens rows per source rank, and
// nothing is copied. Where the low-latency rows are read in place
// (Dispatcher.RowsInPlace), X (or Q and Scales) spans every rank's staging, at least
// MaxTokens rows per source rank, and entry j's row is its token's index at its origin
// in that rank's part: the rows are the origins' memory, to be read until the combine of
// this dispatch starts and not written.
//
// Package combine takes one expert output row per entry, in entry order.
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
	co          *core
	sc          *slotCore
}

// Handle is the handle of the dispatch o holds: the one Dispatch returned with o, not
// Valid once a later dispatch into the same buffers has begun.
func (o *Output[T]) Handle() Handle {
	if o.sc == nil {
		return Handle{}
	}
	return Handle{d: o.co, s: o.sc, gen: o.sc.gen, pl: o.sc.pl, fp: o.sc.fp}
}

// Rows returns the number of entries (expert-major rows, padding included): the expert
// outputs passed to combine have this many rows.
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

// Handle remembers one dispatch's layout for package combine (and Redispatch). It is a
// small value, valid until the dispatch that reuses its buffers starts (Valid says so,
// and combine refuses a stale one).
type Handle struct {
	d   *core
	s   *slotCore
	gen uint64
	pl  *router.Placement // the placement the dispatch used
	fp  uint64
}

// Valid reports whether h still describes its dispatcher's buffers.
func (h Handle) Valid() bool { return h.d != nil && !h.d.closed && h.s.valid && h.gen == h.s.gen }

// Generation is the dispatch's number on its dispatcher (1 for the first).
func (h Handle) Generation() uint64 { return h.gen }

// Config returns the dispatcher's configuration, with the placement the dispatch used.
func (h Handle) Config() Config {
	cfg := h.d.cfg
	cfg.Placement = h.pl
	return cfg
}

// Format returns the dispatcher's wire format.
func (h Handle) Format() Format { return h.d.f }

// Fingerprint is the fingerprint of the dispatcher's configuration and the dispatch's
// placement.
func (h Handle) Fingerprint() uint64 { return h.fp }

// Owner reports whether h was made by the dispatcher that d is (any activation type).
func (h Handle) Owner() any { return h.d }

// Tokens is the number of this rank's tokens.
func (h Handle) Tokens() int { return h.s.tokens }

// Routing is the routing h was made from.
func (h Handle) Routing() *router.Routing { return h.s.r }

// Incoming returns the range [start, end) of incoming rows from origin rank s.
func (h Handle) Incoming(s int) (start, end int) { return h.s.originStart[s], h.s.originStart[s+1] }

// IncomingRows is the number of rows that came to this rank (a token once per rank,
// however many of the rank's experts it chose).
func (h Handle) IncomingRows() int { return h.s.originStart[len(h.s.originStart)-1] }

// Contributions returns, for incoming row i, the entries it was delivered to and their
// router weights (in the order of the token's choices).
func (h Handle) Contributions(i int) ([]int32, []float32) {
	st := h.s
	a, b := st.start[i], st.start[i+1]
	return st.entries[a:b], st.weights[a:b]
}

// Map returns Incoming and Contributions whole: originStart (P+1 values: rank s's rows
// are [originStart[s], originStart[s+1])), start (IncomingRows()+1 values) and the
// entries and weights of every incoming row i, [start[i], start[i+1]). Read-only.
func (h Handle) Map() (originStart []int, start, entries []int32, weights []float32) {
	st := h.s
	n := st.originStart[len(st.originStart)-1]
	c := st.start[n]
	return st.originStart, st.start[:n+1], st.entries[:c], st.weights[:c]
}

// Slot is the index, in [0, InFlight), of the buffers h's dispatch holds: dispatches
// InFlight apart share them.
func (h Handle) Slot() int { return h.s.idx }

// Dests lists the ranks token t of this rank went to, ascending (each once).
func (h Handle) Dests(t int) []int32 { return h.s.layout.Dest[t] }

// ChoiceRanks returns the rank each of token t's choices went to, in the order of its
// choices (-1 for a dropped choice).
func (h Handle) ChoiceRanks(t int) []int32 {
	k := h.s.r.K
	return h.s.layout.ChoiceRank[t*k : (t+1)*k]
}

// RowsTo lists the tokens of this rank that went to rank q, in the order they were sent.
func (h Handle) RowsTo(q int) []int32 { return h.s.layout.Rows[q] }

// Back is the row matrix of the way back in the normal mode: Back()[i][j] rows go from
// rank i to rank j (diagonal zero: a rank's own rows never touch the wire).
func (h Handle) Back() [][]int { return h.s.back }

// BackTerms is, in the normal mode, the matrix of the expert outputs on the way back:
// BackTerms()[i][j] of them (the choices the rows carry) go from rank i to rank j
// (diagonal zero).
func (h Handle) BackTerms() [][]int { return h.s.backTerms }

// ChoicesTo is the number of this rank's (token, choice) pairs that went to rank q: the
// expert outputs q computes for this rank's tokens.
func (h Handle) ChoicesTo(q int) int { return h.s.layout.Choices[q] }

// Rows is the number of entries (expert-major rows, padding included) the dispatch
// delivered to this rank: the expert outputs passed to combine have this many rows.
func (h Handle) Rows() int { return h.s.rowsOut }

// Done tells the dispatcher that every rank has finished reading the rows of h's
// dispatch, so that this rank may write its staging again (the rows read in place,
// Dispatcher.RowsInPlace). Package combine calls it when its Wait succeeds: every rank
// has then started its combine of h, and experts read no row of a dispatch after the
// combine of it starts. A dispatch into a slot whose last rows were never marked done
// pushes its rows instead.
func (h Handle) Done() {
	if h.Valid() {
		h.s.stageFree = true
	}
}

// Pin keeps the dispatch's buffers and layout from being reused until Unpin: a
// dispatch that would reuse them returns ErrBusy. Package combine pins its handle while
// a combine runs.
func (h Handle) Pin() { h.s.pins++ }

// Unpin undoes Pin.
func (h Handle) Unpin() { h.s.pins-- }

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

// Local returns the global ids of the experts this rank held in h's dispatch (its
// placement's Local[rank]): local expert i of the Output is expert Local()[i]. Nil for a
// zero Handle.
func (h Handle) Local() []int {
	if h.d == nil {
		return nil
	}
	if l := h.pl.Local[h.d.c.Rank()]; l != nil {
		return l
	}
	return []int{}
}

// Placement is the placement h's dispatch used (nil for a zero Handle).
func (h Handle) Placement() *router.Placement { return h.pl }
