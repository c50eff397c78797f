// Package dispatch is the first stage of MoE expert parallelism: it sends every token to
// the ranks that hold its experts, as one message per destination rank, and hands each
// rank its experts' inputs expert-major, ready for grouped expert compute.
//
// A token bound for several experts on one rank crosses the wire once: its row is
// followed, in the same message, by the list of that rank's experts it goes to and the
// router's weights. One small all-gather exchanges every rank's per-destination row
// counts (and checks that all ranks agree on the hidden size, the wire type and the
// router), then one fused AlltoAllv moves the rows. The receiver scatters the rows into
// contiguous per-expert blocks (optionally padded to an alignment for grouped GEMM) with,
// per row, its origin rank, source index and weight. The Handle remembers the layout so
// that package combine can bring the results back, and Redispatch can move new
// activations with the same routing without the counts exchange.
//
// Buffers are reused across calls: in steady state a dispatch allocates nothing. The wire
// buffers and the expert inputs (Output.X) are obuf buffers (Config.Pool): page aligned,
// from the shared arena when every rank is on this host over shared memory (the other
// ranks read the wire buffers in place), otherwise on huge pages from 2 MiB, so that the
// shared-memory transport's single copy and RDMA registration run at full speed; Close
// gives them back. The Output and Handle of a call are valid until the next Dispatch on
// the same Dispatcher.
//
// dispatch owns its buffers and the packing; the transport and collective schedule are
// coll's. It must not import combine or models.
package dispatch

import (
	"context"
	"errors"
	"fmt"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
)

// Config describes the dispatch of one MoE layer.
type Config struct {
	Hidden    int               // elements per token row
	TopK      int               // experts per token (the router's k)
	WireDType dtype.Type        // F32 (default) or BF16 for the rows on the wire
	Placement *router.Placement // which ranks hold which experts
	// Align pads each local expert's block of rows to a multiple of Align rows (grouped
	// GEMM kernels want this); padding rows are zero with origin -1.
	Align int
	// Pool provides the wire buffers and the expert inputs (Output.X): page aligned,
	// reused across calls. Default: obuf.Shared when the communicator's collectives run
	// through shared memory (coll.Comm.SharedMemory), where the other ranks then read the
	// wire buffers in place, one copy per byte; obuf.Default (huge pages from 2 MiB)
	// otherwise.
	Pool *obuf.Pool
}

// Errors.
var (
	// ErrConfig: the configuration is invalid.
	ErrConfig = errors.New("dispatch: invalid configuration")
	// ErrInput: this rank's tokens or routing are invalid (details in the message).
	ErrInput = errors.New("dispatch: invalid input")
	// ErrMismatch: ranks disagree on hidden size, wire type, top-k or experts; every rank
	// gets it.
	ErrMismatch = coll.ErrMismatch
	// ErrStale: a Handle or Output was used after a newer Dispatch on its Dispatcher.
	ErrStale = errors.New("dispatch: handle is stale (a newer Dispatch reused its buffers)")
)

// PeerInputError says that another rank could not dispatch its tokens (every rank
// returns an error in the same call, and the communicator stays usable).
type PeerInputError struct {
	Rank int
	Code int
}

func (e *PeerInputError) Error() string {
	return fmt.Sprintf("dispatch: rank %d rejected its input (%s)", e.Rank, inputCodes[e.Code])
}

// Is makes PeerInputError match ErrInput.
func (e *PeerInputError) Is(target error) bool { return target == ErrInput }

const (
	codeOK = iota
	codeShape
	codeRouting
)

var inputCodes = []string{"ok", "tokens and routing disagree in shape", "invalid routing"}

// Output is what a rank's experts receive.
type Output struct {
	// X holds Rows() rows of Hidden float32s, expert-major: the rows of local expert i are
	// X[Offsets[i]*Hidden : Offsets[i+1]*Hidden], the first Counts[i] of them real.
	X       []float32
	Offsets []int
	Counts  []int
	// Per row: origin rank (-1 for padding), token index at the origin, router weight,
	// and the global expert id.
	Origin []int32
	Source []int32
	Weight []float32
	Expert []int32
}

// Rows returns the number of rows in X.
func (o *Output) Rows() int { return len(o.Origin) }

// Stats describes the last dispatch.
type Stats struct {
	RowsSent      int   // rows this rank sent to other ranks (each token once per rank)
	RowsReceived  int   // rows received from other ranks
	BytesSent     int   // bytes on the wire from this rank (excluding its own rows)
	BytesReceived int   //
	Assignments   int   // (token, expert) pairs of this rank's tokens
	RowsPerRank   []int // rows this rank sent to each rank, itself included
	Algo          coll.Algo
}

// Dispatcher moves tokens to experts over one communicator.
type Dispatcher struct {
	c   *coll.Comm
	cfg Config
	es  int // wire element size
	row int // bytes per row on the wire (metadata + payload, 8-aligned)
	gen uint64

	layout router.Layout
	hdr    []int64 // this rank's header + counts
	all    []int64 // every rank's
	matrix [][]int
	back   [][]int
	fwd    coll.VPlan
	sendS  obuf.Scratch
	recvS  obuf.Scratch
	xS     obuf.Scratch // storage of out.X
	send   []byte
	recv   []byte
	out    Output
	h      handleState
	fill   []int
	cs     []contrib
	stats  Stats
}

const hdrLen = 6 // status, hidden, wire type, top-k, experts, ranks

// New returns a dispatcher for c.
func New(c *coll.Comm, cfg Config) (*Dispatcher, error) {
	if cfg.WireDType == 0 {
		cfg.WireDType = dtype.F32
	}
	switch {
	case cfg.Hidden < 1:
		return nil, fmt.Errorf("%w: hidden size %d", ErrConfig, cfg.Hidden)
	case cfg.TopK < 1:
		return nil, fmt.Errorf("%w: top-k %d", ErrConfig, cfg.TopK)
	case cfg.WireDType != dtype.F32 && cfg.WireDType != dtype.BF16:
		return nil, fmt.Errorf("%w: wire type %v (want f32 or bf16)", ErrConfig, cfg.WireDType)
	case cfg.Placement == nil:
		return nil, fmt.Errorf("%w: no placement", ErrConfig)
	case cfg.Placement.Ranks != c.Size():
		return nil, fmt.Errorf("%w: placement over %d ranks on a communicator of %d", ErrConfig, cfg.Placement.Ranks, c.Size())
	case cfg.TopK > cfg.Placement.Experts:
		return nil, fmt.Errorf("%w: top-k %d with %d experts", ErrConfig, cfg.TopK, cfg.Placement.Experts)
	}
	if cfg.Align < 1 {
		cfg.Align = 1
	}
	if cfg.Pool == nil {
		cfg.Pool = obuf.Default
		if c.SharedMemory() {
			cfg.Pool = obuf.Shared
		}
	}
	d := &Dispatcher{c: c, cfg: cfg, es: cfg.WireDType.Size()}
	d.sendS.Pool, d.recvS.Pool, d.xS.Pool = cfg.Pool, cfg.Pool, cfg.Pool
	d.row = align8(metaBytes(cfg.TopK) + cfg.Hidden*d.es)
	p := c.Size()
	d.hdr = make([]int64, hdrLen+p)
	d.all = make([]int64, (hdrLen+p)*p)
	d.matrix, d.back = make([][]int, p), make([][]int, p)
	for i := range d.matrix {
		d.matrix[i], d.back[i] = make([]int, p), make([]int, p)
	}
	d.stats.RowsPerRank = make([]int, p)
	return d, nil
}

func align8(n int) int { return (n + 7) &^ 7 }

// metaBytes: per row, the source index, the number of local experts, then k pairs of
// (local expert index, weight).
func metaBytes(k int) int { return 8 + 8*k }

// Config returns the dispatcher's configuration.
func (d *Dispatcher) Config() Config { return d.cfg }

// Comm returns the communicator.
func (d *Dispatcher) Comm() *coll.Comm { return d.c }

// RowBytes is the size of one row on the wire.
func (d *Dispatcher) RowBytes() int { return d.row }

// Stats describes the last dispatch.
func (d *Dispatcher) Stats() Stats { return d.stats }

// Plan returns the AlltoAllv schedule of the last dispatch (for moex flow and debugging).
func (d *Dispatcher) Plan() *coll.VPlan { return &d.fwd }

// CountsExchange is how many int64 every rank contributes to the counts all-gather that
// precedes a dispatch whose routing changed (a header, then a row count per rank).
func (d *Dispatcher) CountsExchange() int { return len(d.hdr) }

// Dispatch sends this rank's T tokens x (T x Hidden, row-major) to the experts r chose.
// Every rank must call it (a rank with no tokens passes empty x and routing).
func (d *Dispatcher) Dispatch(ctx context.Context, x []float32, r *router.Routing) (*Output, Handle, error) {
	d.gen++
	code, inErr := d.check(x, r)
	if code == codeOK {
		if err := router.BuildLayoutInto(&d.layout, r, d.cfg.Placement, d.c.Rank()); err != nil {
			code, inErr = codeRouting, fmt.Errorf("%w: %v", ErrInput, err)
		}
	}
	// Counts exchange: every rank's header and per-destination row counts.
	p := d.c.Size()
	d.hdr[0], d.hdr[1], d.hdr[2] = int64(code), int64(d.cfg.Hidden), int64(d.cfg.WireDType)
	d.hdr[3], d.hdr[4], d.hdr[5] = int64(d.cfg.TopK), int64(d.cfg.Placement.Experts), int64(p)
	for q := 0; q < p; q++ {
		d.hdr[hdrLen+q] = 0
		if code == codeOK {
			d.hdr[hdrLen+q] = int64(len(d.layout.Rows[q]))
		}
	}
	if err := coll.AllGather(ctx, d.c, d.hdr, d.all); err != nil {
		return nil, Handle{}, err
	}
	w := hdrLen + p
	for q := 0; q < p; q++ {
		h := d.all[q*w : q*w+hdrLen]
		if h[1] != d.hdr[1] || h[2] != d.hdr[2] || h[3] != d.hdr[3] || h[4] != d.hdr[4] || h[5] != d.hdr[5] {
			return nil, Handle{}, fmt.Errorf("%w: rank %d dispatches hidden=%d wire=%v top-k=%d experts=%d ranks=%d; this rank hidden=%d wire=%v top-k=%d experts=%d ranks=%d",
				ErrMismatch, q, h[1], dtype.Type(h[2]), h[3], h[4], h[5], d.hdr[1], d.cfg.WireDType, d.hdr[3], d.hdr[4], d.hdr[5])
		}
	}
	if inErr != nil {
		return nil, Handle{}, inErr
	}
	for q := 0; q < p; q++ {
		if c := d.all[q*w]; c != codeOK {
			return nil, Handle{}, &PeerInputError{Rank: q, Code: int(c)}
		}
	}
	for i := 0; i < p; i++ {
		for j := 0; j < p; j++ {
			n := int(d.all[i*w+hdrLen+j])
			if i == j {
				n = 0 // a rank's own rows never touch the wire
			}
			d.matrix[i][j], d.back[j][i] = n, n
		}
	}
	if err := d.c.ReplanAlltoAllv(&d.fwd, d.matrix, d.row); err != nil {
		return nil, Handle{}, err
	}
	d.h.tokens, d.h.r = len(x)/d.cfg.Hidden, r
	if err := d.move(ctx, x); err != nil {
		return nil, Handle{}, err
	}
	return &d.out, Handle{d: d, gen: d.gen}, nil
}

// Abandon takes part in a dispatch that this rank cannot make (its router failed, for
// instance): the other ranks' Dispatch returns a PeerInputError naming this rank, in the
// same call, instead of waiting; the communicator stays usable. It returns cause.
func (d *Dispatcher) Abandon(ctx context.Context, cause error) error {
	d.gen++
	p := d.c.Size()
	d.hdr[0], d.hdr[1], d.hdr[2] = codeRouting, int64(d.cfg.Hidden), int64(d.cfg.WireDType)
	d.hdr[3], d.hdr[4], d.hdr[5] = int64(d.cfg.TopK), int64(d.cfg.Placement.Experts), int64(p)
	for q := 0; q < p; q++ {
		d.hdr[hdrLen+q] = 0
	}
	if err := coll.AllGather(ctx, d.c, d.hdr, d.all); err != nil {
		return errors.Join(cause, err)
	}
	return cause
}

// Redispatch moves new activations x with the routing of h (same tokens, same experts):
// no counts exchange, the plans and maps of h are reused. Every rank must call it.
func (d *Dispatcher) Redispatch(ctx context.Context, h Handle, x []float32) (*Output, error) {
	if h.d != d || !h.Valid() {
		return nil, ErrStale
	}
	if len(x) != d.h.tokens*d.cfg.Hidden {
		return nil, fmt.Errorf("%w: %d values for %d tokens of %d", ErrInput, len(x), d.h.tokens, d.cfg.Hidden)
	}
	return &d.out, d.move(ctx, x)
}

func (d *Dispatcher) check(x []float32, r *router.Routing) (int, error) {
	if r == nil {
		return codeRouting, fmt.Errorf("%w: nil routing", ErrInput)
	}
	if len(x)%d.cfg.Hidden != 0 {
		return codeShape, fmt.Errorf("%w: %d values is not a whole number of %d-wide rows", ErrInput, len(x), d.cfg.Hidden)
	}
	if t := len(x) / d.cfg.Hidden; t != r.T {
		return codeShape, fmt.Errorf("%w: %d tokens but a routing of %d", ErrInput, t, r.T)
	}
	if r.K != d.cfg.TopK || len(r.Experts) != r.T*r.K || len(r.Weights) != r.T*r.K {
		return codeRouting, fmt.Errorf("%w: routing with k=%d (%d choices) for top-k %d", ErrInput, r.K, len(r.Experts), d.cfg.TopK)
	}
	if r.E != d.cfg.Placement.Experts {
		return codeRouting, fmt.Errorf("%w: routing over %d experts, placement of %d", ErrInput, r.E, d.cfg.Placement.Experts)
	}
	for i, e := range r.Experts {
		if e < -1 || int(e) >= r.E {
			return codeRouting, fmt.Errorf("%w: token %d choice %d is expert %d (have %d)", ErrInput, i/r.K, i%r.K, e, r.E)
		}
	}
	return codeOK, nil
}

// move packs, exchanges and unpacks.
func (d *Dispatcher) move(ctx context.Context, x []float32) error {
	p, me := d.c.Size(), d.c.Rank()
	d.send = d.sendS.Bytes(d.fwd.SendBytes())
	d.recv = d.recvS.Bytes(d.fwd.RecvBytes())
	// Pack: per destination rank (ascending), its rows in token order. Our own rows are
	// not packed: they are unpacked straight from x.
	off := 0
	d.stats.RowsSent, d.stats.Assignments = 0, d.layout.Assignments
	for q := 0; q < p; q++ {
		d.stats.RowsPerRank[q] = len(d.layout.Rows[q])
		if q == me {
			continue
		}
		for _, t := range d.layout.Rows[q] {
			d.packRow(d.send[off:off+d.row], x, int(t), q)
			off += d.row
		}
		d.stats.RowsSent += len(d.layout.Rows[q])
	}
	if err := d.c.RunAlltoAllv(ctx, &d.fwd, d.send, d.recv); err != nil {
		return err
	}
	d.stats.BytesSent, d.stats.BytesReceived = d.fwd.SendBytes(), d.fwd.RecvBytes()
	d.stats.RowsReceived = d.fwd.RecvBytes() / d.row
	d.stats.Algo = d.fwd.Algo
	d.unpack(x)
	return nil
}

// Close gives the dispatcher's buffers back to their pool. The last Output and Handle
// are invalid afterwards, and the Dispatcher must not be used again.
func (d *Dispatcher) Close() {
	d.gen++
	d.send, d.recv, d.out.X = nil, nil, nil
	d.sendS.Release()
	d.recvS.Release()
	d.xS.Release()
}
