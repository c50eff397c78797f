package dispatch

import (
	"slices"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/internal/ep"
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

	e *ep.Output[T]
	// gathered holds the blocks Block gathered (entry-indexed, Hidden values a row), and
	// qgathered QBlock's; which experts they hold for this dispatch is done/qdone.
	gathered  []T
	qgathered []byte
	sgathered []float32
	done      []bool
	qdone     []bool
}

// fill sets o's fields from the engine's output.
func (o *Output[T]) fill() {
	e := o.e
	o.Offsets, o.Counts = e.Offsets, e.Counts
	o.Origin, o.Source, o.Weight, o.Expert = e.Origin, e.Source, e.Weight, e.Expert
	o.done, o.qdone = resetFlags(o.done, len(e.Counts)), resetFlags(o.qdone, len(e.Counts))
}

func resetFlags(f []bool, n int) []bool {
	if cap(f) < n {
		return make([]bool, n)
	}
	f = f[:n]
	clear(f)
	return f
}

// ExpertMajor reports whether the rows themselves are expert-major (the normal mode, or
// Config.ExpertMajor): Block and QBlock then copy nothing.
func (o *Output[T]) ExpertMajor() bool { return o.e.ExpertMajor }

// Block returns local expert i's rows, Counts[i] x Hidden values, contiguous: in place
// where the rows are expert-major (ExpertMajor), else gathered, once per dispatch and
// expert, into memory of the Output's (a copy: Config.ExpertMajor makes the dispatch
// lay them out so instead). nil when Config.Quantized (QBlock). Read-only.
func (o *Output[T]) Block(i int) []T {
	e := o.e
	if e.X == nil {
		return nil
	}
	hid, a, n := e.Hidden(), e.Offsets[i], e.Counts[i]
	if e.ExpertMajor {
		return e.X[a*hid : (a+n)*hid : (a+n)*hid]
	}
	if len(o.gathered) < len(e.Row)*hid {
		o.gathered = make([]T, len(e.Row)*hid)
	}
	b := o.gathered[a*hid : (a+n)*hid : (a+n)*hid]
	if !o.done[i] {
		e.Gather(i, b)
		o.done[i] = true
	}
	return b
}

// QBlock is Block for Config.Quantized: local expert i's rows as the wire carries
// them, Counts[i] rows of Format.Payload bytes, and their scales, Format.Scales a row.
// nil unless Config.Quantized.
func (o *Output[T]) QBlock(i int) ([]byte, []float32) {
	e := o.e
	if e.Q == nil {
		return nil, nil
	}
	f := e.Format()
	a, n := e.Offsets[i], e.Counts[i]
	if e.ExpertMajor {
		return e.Q[a*f.Payload : (a+n)*f.Payload : (a+n)*f.Payload], e.Scales[a*f.Scales : (a+n)*f.Scales : (a+n)*f.Scales]
	}
	if rows := len(e.Row); len(o.qgathered) < rows*f.Payload {
		o.qgathered, o.sgathered = make([]byte, rows*f.Payload), make([]float32, rows*f.Scales)
	}
	q, s := o.qgathered[a*f.Payload:(a+n)*f.Payload:(a+n)*f.Payload], o.sgathered[a*f.Scales:(a+n)*f.Scales:(a+n)*f.Scales]
	if !o.qdone[i] {
		for k := 0; k < n; k++ {
			eq, es := e.QEntry(a + k)
			copy(q[k*f.Payload:], eq)
			copy(s[k*f.Scales:], es)
		}
		o.qdone[i] = true
	}
	return q, s
}

// QEntry returns entry j's row as the wire carries it (Config.Quantized): Format.Payload
// bytes of fp8 E4M3 or int8, and its Format.Scales float32 scales; nil for padding or
// without Config.Quantized. The slices are the dispatcher's memory: read-only.
func (o *Output[T]) QEntry(j int) ([]byte, []float32) { return o.e.QEntry(j) }

// Handle is the handle of the dispatch o holds: the one Dispatch returned with o, not
// valid once a later dispatch into the same buffers has begun.
func (o *Output[T]) Handle() Handle { return Handle{h: o.e.Handle()} }

// Rows returns the number of entries, padding included: the expert outputs passed to the
// combine have this many rows.
func (o *Output[T]) Rows() int { return len(o.Origin) }

// Entry returns the activations of entry j, Hidden values (nil for padding, or when
// Config.Quantized). The slice is the dispatcher's memory: read it, do not write it.
func (o *Output[T]) Entry(j int) []T { return o.e.Entry(j) }

// Dequantize writes the values of entry j's quantised row (Config.Quantized) into dst,
// Hidden values (zeros for padding).
func (o *Output[T]) Dequantize(j int, dst []T) { o.e.Dequantize(j, dst) }

// Gather copies local expert i's rows (Counts[i] of them) contiguously into dst, which
// must hold Counts[i] x Hidden values, and returns dst[:Counts[i]*Hidden]: one matrix
// per expert for kernels that want one, where the rows are not expert-major.
func (o *Output[T]) Gather(i int, dst []T) []T { return o.e.Gather(i, dst) }

// Handle is an opaque token for one dispatch, which the combine (and Redispatch) takes:
// a small value, valid until the dispatch that reuses its buffers starts (Valid says so,
// and the combine refuses a stale one on every rank). The zero Handle is not valid.
type Handle struct {
	h ep.Handle
}

// Valid reports whether h still describes its dispatcher's buffers.
func (h Handle) Valid() bool { return h.h.Valid() }

// Rows is the number of entries (padding included) the dispatch delivered to this rank:
// the expert outputs passed to the combine have this many rows. 0 for the zero Handle.
func (h Handle) Rows() int {
	if h.h.Placement() == nil {
		return 0
	}
	return h.h.Rows()
}

// Tokens is the number of this rank's tokens in the dispatch: the combined output has
// this many rows. 0 for the zero Handle.
func (h Handle) Tokens() int {
	if h.h.Placement() == nil {
		return 0
	}
	return h.h.Tokens()
}

// IncomingRows is the number of rows that came to this rank (a token once per rank,
// however many of the rank's experts it chose): combine.Combiner.CombineRows takes one
// summed row per incoming row. 0 for the zero Handle.
func (h Handle) IncomingRows() int {
	if h.h.Placement() == nil {
		return 0
	}
	return h.h.IncomingRows()
}

// Contributions returns, for incoming row i, the entries it was delivered to and their
// router weights, in the order of the token's choices: how to sum the expert outputs of
// one incoming row for CombineRows. The slices are the dispatcher's, read-only.
func (h Handle) Contributions(i int) ([]int32, []float32) { return h.h.Contributions(i) }

// Placement is the placement the dispatch used (nil for the zero Handle): local expert i
// of its Output is Placement().Local[rank][i].
func (h Handle) Placement() *router.Placement { return h.h.Placement() }

// Schedule returns a copy of the dispatch's schedule on this rank: what moved to and
// from every peer, and what its combine moves (with the partial sums of the combiner
// the dispatcher serves). The zero Schedule for the zero Handle.
func (h Handle) Schedule() Schedule {
	if h.h.Placement() == nil {
		return Schedule{}
	}
	return scheduleOf(h.h.Schedule())
}

// Stats describes a dispatch: rows and bytes each way, the algorithm, whether the rows
// were read in place.
type Stats struct {
	RowsSent      int   // rows this rank sent to other ranks (each token once per rank)
	RowsReceived  int   // rows it received from other ranks
	BytesSent     int   // bytes on the wire from this rank (its own rows aside)
	BytesReceived int   // bytes on the wire to this rank
	Assignments   int   // (token, expert) choices of this rank's tokens
	RowsPerRank   []int // rows this rank sent to each rank, itself included
	// Algo is the normal mode's AlltoAllv algorithm.
	Algo coll.Algo
	// Pushed, in the low-latency mode, is how many ranks this rank wrote its rows into
	// directly.
	Pushed int
	// PackedBytes is what Config.ExpertMajor copied to lay out expert-major rows that
	// the mode would have left where they arrived (0 in the normal mode).
	PackedBytes int
	// Put, in the low-latency mode, is how many ranks this rank put its rows into with
	// one-sided operations (UCX windows: a put, a fence and a signal; the receiver posts
	// no receive).
	Put int
	// InPlace, in the low-latency mode: this rank wrote its tokens once into its own
	// staging and the other ranks read them there (the bytes above count those reads).
	InPlace bool
	// Mode is the mode the dispatch ran in (in the Auto mode, the one the step took).
	Mode Mode
}

func statsOf(s ep.Stats) Stats {
	st := Stats{RowsSent: s.RowsSent, RowsReceived: s.RowsReceived, BytesSent: s.BytesSent, BytesReceived: s.BytesReceived,
		Assignments: s.Assignments, Algo: s.Algo, Pushed: s.Pushed, Put: s.Put, PackedBytes: s.PackedBytes, InPlace: s.InPlace, Mode: Mode(s.Mode)}
	st.RowsPerRank = slices.Clone(s.RowsPerRank)
	return st
}

// Schedule is one rank's part of a step, as the planner lays it out and the executors
// move it: for every peer, the block this rank sends it and the block it receives from
// it, in the dispatch and in the combine, field by field.
type Schedule struct {
	Mode  Mode // the mode the step ran in (in the Auto mode, the one it chose)
	Rank  int  // this rank
	Ranks int  // the ranks of the step
	// Control is the bytes every rank contributes to the step's control all-gather
	// before the dispatch (the normal and gathered modes' counts; 0 in the low-latency
	// mode, whose counts travel with the rows).
	Control  int
	Dispatch Stage
	Combine  Stage
}

// Stage is one exchange of a step: a block to and from every peer.
type Stage struct {
	// Fields names the parts of a block, which travel apart (the low-latency mode's
	// exchange fields, the gathered mode's all-gathers) or as one (a block of an
	// AlltoAllv).
	Fields []string
	// Send[q] is what this rank sends rank q, Recv[q] what it receives from q. Send[Rank]
	// and Recv[Rank] are this rank's own rows: they move only where the mode sends a rank
	// its own block (the low-latency exchange).
	Send, Recv []Block
}

// Block is what moves between two ranks in one stage.
type Block struct {
	Rows    int    // rows: tokens (dispatch), partial sums or rows of terms (combine)
	Choices int    // the (token, expert) choices the rows carry
	Bytes   [3]int // bytes of each field
	// Off is where each field starts in this rank's buffer of that field (the
	// AlltoAllv's send or receive buffer, a gathered buffer); 0 where every block has a
	// buffer of its own (the low-latency exchange).
	Off [3]int
	// InPlace: the rows stay where their sender wrote them and the receiver reads them
	// there (the low-latency mode on one host); Bytes counts only what moves.
	InPlace bool
	// Read is the bytes the receiver reads in place in the sender's memory.
	Read int
}

// Total is the bytes of the block's fields.
func (b Block) Total() int { return b.Bytes[0] + b.Bytes[1] + b.Bytes[2] }

// Sent is the bytes this rank (me) puts on the wire for its peers in the stage, its own
// block aside.
func (st Stage) Sent(me int) int { return sumOff(st.Send, me) }

// Received is the bytes this rank (me) takes from its peers in the stage, its own block
// aside.
func (st Stage) Received(me int) int { return sumOff(st.Recv, me) }

func sumOff(bs []Block, me int) int {
	n := 0
	for q, b := range bs {
		if q != me {
			n += b.Total()
		}
	}
	return n
}

// ScheduleOf copies the engine's schedule (for package combine's Plan too).
func scheduleOf(s *ep.Schedule) Schedule {
	return Schedule{Mode: Mode(s.Mode), Rank: s.Rank, Ranks: s.Ranks, Control: s.Control,
		Dispatch: stageOf(s.Dispatch), Combine: stageOf(s.Combine)}
}

func stageOf(st ep.Stage) Stage {
	out := Stage{Fields: slices.Clone(st.Fields), Send: make([]Block, len(st.Send)), Recv: make([]Block, len(st.Recv))}
	for i, b := range st.Send {
		out.Send[i] = Block(b)
	}
	for i, b := range st.Recv {
		out.Recv[i] = Block(b)
	}
	return out
}
