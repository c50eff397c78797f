// Package dispatch is the first stage of MoE expert parallelism: it sends every token to
// the ranks that hold its experts, as one message per destination rank, and hands each
// rank its experts' inputs with an expert-major view, ready for grouped expert compute.
//
// A token bound for several experts on one rank crosses the wire once: its row is
// followed, in the same message, by the list of that rank's experts it goes to and the
// router's weights. Three modes share one API (Config.Mode):
//
//   - Normal (prefill): one small all-gather exchanges every rank's per-destination row
//     counts (with a status and a fingerprint of the configuration and placement, so
//     that a rank with bad input or another placement fails every rank in the same
//     call), then one fused, exact-size AlltoAllv moves the rows, and the receiver
//     scatters them into contiguous per-expert blocks (optionally padded for grouped
//     GEMM).
//   - LowLatency (decode): buffers sized once for Config.MaxTokens tokens per rank; no
//     counts round trip, the counts travel with the rows in one coll.Exchange; the
//     receive buffer is indexed by source rank (its size grows with ranks, not with
//     local experts). Where every rank can map every rank's memory (inproc; shm on one
//     host) each rank writes its tokens once into its own staging and the experts read
//     them there, so that no row is copied to another rank (Config.PushRows: each sender
//     writes its rows straight into the receivers' buffers instead). The experts see the
//     rows through an expert-major view (Output.Row) with a count per expert; nothing is
//     allocated from call to call.
//   - Gathered (data-parallel attention with expert parallelism): every rank's tokens
//     all-gathered (coll.AllGatherv), each rank's experts take the ones that chose them,
//     and package combine reduce-scatters the sums back (coll.ReduceScatterv).
//
// Activations are float32 or bfloat16, or opaque rows of bytes (Dispatcher[byte]) for
// engines with element types of their own. The wire is f32, bf16, fp8 E4M3 (a float32
// scale per 128 elements) or int8 (a float32 scale per token), quantised as the rows
// are packed; the experts get rows in the activation type, or the quantised rows and
// their scales (Config.Quantized). Every expert sees a token as the wire carries it,
// whichever rank holds the expert.
//
// Dispatch is Start (the send half) then Wait (the receive half); between them the
// caller may compute (two micro-batches: start B while A's experts run). InFlight
// results may be alive at once: the dispatch after them reuses the oldest's buffers, and
// its Output and Handle become stale (ErrStale); a dispatch that would reuse buffers
// still in use (not waited for, or pinned by a running combine) returns ErrBusy. The
// Handle remembers the layout for package combine.
//
// dispatch owns its buffers, the packing and the planning (plan.go, pure: it touches no
// transport); the transport and collective schedules are coll's. It must not import
// combine or models.
package ep

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/internal/memx"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
)

// Act is the element type of the activations a Dispatcher moves: float32, bfloat16, or
// byte for opaque rows (Hidden is then the bytes of a row, and the wire carries them as
// they are).
type Act interface {
	float32 | dtype.BFloat16 | byte
}

// Mode selects how a dispatch moves its rows.
type Mode int

const (
	// Normal: a counts all-gather, then an exact-size AlltoAllv (prefill).
	Normal Mode = iota
	// LowLatency: one exchange into buffers sized for MaxTokens tokens per rank, counts
	// travelling with the rows (decode).
	LowLatency
	// Gathered: every rank's tokens all-gathered (AllGatherv), each rank's experts take
	// the ones that chose them, and package combine reduce-scatters the sums back
	// (ReduceScatterv): for data-parallel attention with expert parallelism (vLLM's
	// AgRs). Every token crosses to every rank.
	Gathered
)

func (m Mode) String() string {
	switch m {
	case Normal:
		return "normal"
	case LowLatency:
		return "low-latency"
	case Gathered:
		return "gathered"
	}
	return fmt.Sprintf("mode(%d)", int(m))
}

// ParseMode accepts "normal", "low-latency" (or "ll") and "gathered".
func ParseMode(s string) (Mode, error) {
	switch s {
	case "normal":
		return Normal, nil
	case "low-latency", "lowlatency", "ll":
		return LowLatency, nil
	case "gathered", "agrs":
		return Gathered, nil
	}
	return 0, fmt.Errorf("%w: mode %q (want normal, low-latency or gathered)", ErrConfig, s)
}

// MaxLowLatencyTokens bounds Config.MaxTokens.
const MaxLowLatencyTokens = 1 << 16

// Config describes the dispatch of one MoE layer.
type Config struct {
	Hidden int // elements per token row (bytes, for opaque rows)
	TopK   int // experts per token (the router's k)
	// WireDType is the type of the rows on the wire: F32, BF16, FP8E4M3 or I8 (default:
	// the activation type; U8, and only U8, for opaque rows).
	WireDType dtype.Type
	// CombineDType is the type of the partial sums package combine sends back: F32, BF16,
	// or, to halve the bytes of bf16, FP8E4M3 (one scale per 128 elements) or I8 (one
	// scale per row), quantised once on the rank that sums them and added in float32 on
	// the token's rank (default: the activation type, F32 for opaque rows). The gathered
	// mode adds the partial sums on the way, so it takes F32 or BF16 only. Where the
	// combine reads the expert outputs in place (see SendPartials), no partial sums
	// travel and the outputs are summed as the experts wrote them.
	CombineDType dtype.Type
	Placement    *router.Placement // which ranks hold which experts
	Mode         Mode
	// MaxTokens is, in the low-latency mode, the most tokens any rank dispatches in one
	// call (required; at most MaxLowLatencyTokens). Buffers are sized for it once.
	MaxTokens int
	// InFlight is how many dispatch results may be alive at once (default 2, at most
	// 16): the dispatch after them makes the oldest stale.
	InFlight int
	// Align pads each local expert's block of rows to a multiple of Align rows (grouped
	// GEMM kernels want this); padding rows have origin -1 (and, in the normal mode,
	// zero activations).
	Align int
	// Quantized hands the experts the rows as the wire carries them (Output.Q and
	// Output.Scales, for fp8 or int8 kernels) instead of dequantised rows (Output.X).
	Quantized bool
	// PowerOfTwoScales rounds fp8 scales up to powers of two (exact to apply; the
	// UE8M0 scales some kernels want).
	PowerOfTwoScales bool
	// SendPartials makes the low-latency combine send partial sums even where every rank
	// can read every rank's memory (inproc; shm on one host), where by default the ranks
	// that sent the tokens read the expert outputs in place (combine.Combiner.Buffer).
	SendPartials bool
	// MaxLocalExperts is the most experts any rank holds in any placement the dispatcher
	// will use (UsePlacement): the combine's buffers are sized for it. Default, and
	// least: the most any rank holds in Placement.
	MaxLocalExperts int
	// SumAtOrigin makes the combine send each expert output back as the expert wrote it,
	// in the activation type, rather than each rank's partial sum of a token, and the
	// token's rank adds all of its terms in float32 in the order of its choices: the bits
	// one process computes, whatever the number of ranks and hosts and the placement (the
	// in-place combine sums so already, on one host). It costs bytes: a row per (token,
	// choice) comes back instead of one per (token, rank), and y is copied at Start. Not
	// in the gathered mode or on the two-level path, whose sums are made on the way; not
	// with CombineRows (the rows are summed already); CombineDType, if set, must be the
	// activation type. With SendPartials the outputs travel even where they could be
	// read in place.
	SumAtOrigin bool
	// PushRows makes the low-latency dispatch write each token's row into every
	// destination's memory even where every rank can map every rank's memory side by
	// side (inproc on Linux; shm on one host), where by default each rank writes its
	// tokens once into its own staging and the experts read them there in place
	// (Output.X then spans the ranks' staging).
	PushRows bool
	// Pool provides the buffers: page aligned, reused across calls. Default: obuf.Shared
	// when the communicator's collectives run through shared memory
	// (coll.Comm.SharedMemory), where the other ranks then read the wire buffers in
	// place; obuf.Default (huge pages from 2 MiB) otherwise.
	Pool *obuf.Pool
}

// Errors.
var (
	// ErrConfig: the configuration is invalid.
	ErrConfig = errors.New("dispatch: invalid configuration")
	// ErrInput: this rank's tokens or routing are invalid (details in the message).
	ErrInput = errors.New("dispatch: invalid input")
	// ErrMismatch: ranks disagree on the configuration or the placement; every rank gets
	// it, naming one that differs.
	ErrMismatch = coll.ErrMismatch
	// ErrStale: a Handle or Output was used after a newer dispatch reused its buffers.
	ErrStale = errors.New("dispatch: handle is stale (a newer dispatch reused its buffers)")
	// ErrBusy: a dispatch would reuse buffers still in use (InFlight results, the
	// oldest not waited for or pinned by a combine).
	ErrBusy = coll.ErrBusy
)

// PeerInputError says that another rank could not dispatch (or combine) its tokens:
// every rank returns an error in the same call, and the communicator stays usable.
type PeerInputError struct {
	Rank int
	Code int
}

func (e *PeerInputError) Error() string {
	c := "unknown error"
	if e.Code >= 0 && e.Code < len(inputCodes) {
		c = inputCodes[e.Code]
	}
	return fmt.Sprintf("dispatch: rank %d rejected its input (%s)", e.Rank, c)
}

// Is makes PeerInputError match ErrInput.
func (e *PeerInputError) Is(target error) bool { return target == ErrInput }

// Status codes that travel with a dispatch, a combine or a Migrate.
const (
	CodeOK      = iota
	CodeShape   // tokens and routing disagree in shape
	CodeRouting // invalid routing, or the rank abandoned the step
	CodeTooMany // more tokens than MaxTokens
	CodeStale   // combine: a stale handle
	CodeOutput  // combine: expert outputs or output of the wrong length
	CodeWeights // Migrate: expert weights of the wrong size
	codeEnd
)

var inputCodes = []string{"ok", "tokens and routing disagree in shape", "invalid routing",
	"more tokens than MaxTokens", "stale dispatch handle", "buffers of the wrong length", "expert weights of the wrong size"}

// Stats describes the last dispatch.
type Stats struct {
	RowsSent      int   // rows this rank sent to other ranks (each token once per rank)
	RowsReceived  int   // rows received from other ranks
	BytesSent     int   // bytes on the wire from this rank (excluding its own rows)
	BytesReceived int   //
	Assignments   int   // (token, expert) pairs of this rank's tokens
	RowsPerRank   []int // rows this rank sent to each rank, itself included
	// Algo is the AlltoAllv algorithm of the normal mode; Pushed, in the low-latency
	// mode, says how many ranks this rank wrote its rows into directly.
	Algo   coll.Algo
	Pushed int
	// InPlace, in the low-latency mode: this rank wrote its tokens once into its own
	// staging and the other ranks read them there (the bytes above count those reads).
	InPlace bool
}

// core is the part of a dispatcher that does not depend on the activation type: what
// package combine reads through a Handle.
type core struct {
	c     *coll.Comm
	cfg   Config
	f     Format
	fp    uint64
	fpBuf []byte // UsePlacement's encoding of the configuration
	gen   uint64 // dispatches begun
	cores []*slotCore
	x     *coll.Exchange // low-latency
	// rowsPer is, when the low-latency dispatch's rows are read in place, the rows of
	// each source rank's part of the view (MaxTokens rounded up so that a part is whole
	// pages); 0 when they are pushed.
	rowsPer int
	llc     int // the host's last-level cache, bytes (0: unknown)
	stats   Stats
	closed  bool
	// arrival (the normal mode, set by TwoLevel for its up stage): the rows stay in
	// arrival order, one per incoming row (X row i is incoming row i), and the entries
	// point at them, instead of a copy per entry in expert-major blocks.
	arrival bool
}

// slot states.
const (
	slotIdle    = iota
	slotStarted // a dispatch was started and not waited for
)

// slotCore is one result's layout.
type slotCore struct {
	idx    int
	gen    uint64 // the dispatch it holds
	state  int
	pins   int  // running combines
	valid  bool // holds a complete dispatch
	tokens int
	r      *router.Routing
	pl     *router.Placement // the placement it was dispatched with
	fp     uint64            // and its fingerprint
	layout router.Layout
	// Incoming rows, in order (origin rank ascending, then the origin's token order):
	// originStart[s] is the first incoming row from origin s; the entries of row i (and
	// their router weights) are entries[start[i]:start[i+1]].
	originStart []int
	start       []int32
	entries     []int32
	weights     []float32
	rowsOut     int // entries (expert-major rows), padding included
	// Normal mode: the row matrix; back[i][j] rows go from i to j in the combine, with
	// backTerms[i][j] expert outputs (the choices they carry).
	matrix, back, backTerms [][]int
	// Low-latency mode: rows received from each rank.
	from []int
	// In place (rowsPer > 0): this rank's staging for the slot, the rows' payloads and
	// their scales (nil without scales), and whether the staging is free to write: no
	// rank reads what this rank last wrote there (its combine has completed since).
	stage     [2]*coll.Board
	stageFree bool
}

// Dispatcher moves tokens to experts over one communicator.
type Dispatcher[T Act] struct {
	*core
	act   dtype.Type
	slots []*slot[T]
	stage obuf.Scratch // this rank's tokens in the wire format (when it is not T's)
	// The tokens being packed (beginPack, put) or staged (stageRows): x, where each
	// token's encoding went first, and the staged encodings, stRow bytes per token with
	// the scales at stPer.
	stX          []T
	loc          []tokLoc
	st           []byte
	stPer, stRow int
	cs           []contrib
	fill         []int
}

// New returns a dispatcher for c. In the low-latency mode it is collective (every rank
// calls it with the same configuration): it makes the exchange's buffers.
func New[T Act](ctx context.Context, c *coll.Comm, cfg Config) (*Dispatcher[T], error) {
	act := actType[T]()
	cfg, err := Defaults[T](cfg)
	if err != nil {
		return nil, err
	}
	if cfg.Placement.Ranks != c.Size() {
		return nil, fmt.Errorf("%w: placement over %d ranks on a communicator of %d", ErrConfig, cfg.Placement.Ranks, c.Size())
	}
	if cfg.Pool == nil {
		cfg.Pool = obuf.Default
		if c.SharedMemory() {
			cfg.Pool = obuf.Shared
		}
	}
	co := &core{c: c, cfg: cfg, f: NewFormat(cfg), fp: Fingerprint(cfg), llc: memx.LastLevelCache()}
	d := &Dispatcher[T]{core: co, act: act}
	d.stage.Pool = cfg.Pool
	p := c.Size()
	for i := 0; i < cfg.InFlight; i++ {
		sc := &slotCore{idx: i}
		if cfg.Mode == Normal {
			sc.matrix, sc.back, sc.backTerms = make([][]int, p), make([][]int, p), make([][]int, p)
			for j := range sc.matrix {
				sc.matrix[j], sc.back[j], sc.backTerms[j] = make([]int, p), make([]int, p), make([]int, p)
			}
		}
		co.cores = append(co.cores, sc)
		s := &slot[T]{d: d, sc: sc}
		s.out.co, s.out.sc = co, sc
		s.sendS.Pool, s.recvS.Pool, s.xS.Pool = cfg.Pool, cfg.Pool, cfg.Pool
		s.hdr = make([]int64, hdrLen+p)
		s.all = make([]int64, (hdrLen+p)*p)
		d.slots = append(d.slots, s)
	}
	co.stats.RowsPerRank = make([]int, p)
	if cfg.Mode == LowLatency {
		x, err := c.NewExchange(ctx, llExchange(cfg, co.f))
		if err != nil {
			return nil, err
		}
		co.x = x
		if !cfg.PushRows && p > 1 {
			if err := co.openStaging(ctx); err != nil {
				x.Close()
				return nil, err
			}
		}
	}
	return d, nil
}

// Defaults returns cfg as New[T] would use it: the wire type defaulting to T's, the
// combine type to T's (f32 for opaque rows), InFlight to 2, Align to 1, and every field
// checked (ErrConfig).
func Defaults[T Act](cfg Config) (Config, error) {
	act := actType[T]()
	if cfg.WireDType == 0 {
		cfg.WireDType = act
	}
	if cfg.CombineDType == 0 {
		cfg.CombineDType = act
		if act == dtype.U8 {
			cfg.CombineDType = dtype.F32
		}
	}
	if err := cfg.fill(); err != nil {
		return cfg, err
	}
	switch {
	case act == dtype.U8 && cfg.WireDType != dtype.U8:
		return cfg, fmt.Errorf("%w: opaque rows travel as they are (wire type u8), not %v", ErrConfig, cfg.WireDType)
	case act != dtype.U8 && cfg.WireDType == dtype.U8:
		return cfg, fmt.Errorf("%w: wire type u8 is for opaque rows (Dispatcher[byte])", ErrConfig)
	case cfg.Quantized && cfg.WireDType != dtype.FP8E4M3 && cfg.WireDType != dtype.I8:
		return cfg, fmt.Errorf("%w: Quantized needs an fp8 or int8 wire, not %v", ErrConfig, cfg.WireDType)
	case cfg.MaxLocalExperts < 0 || cfg.MaxLocalExperts > cfg.Placement.Experts:
		return cfg, fmt.Errorf("%w: MaxLocalExperts %d (want 0 to the %d experts)", ErrConfig, cfg.MaxLocalExperts, cfg.Placement.Experts)
	case cfg.MaxLocalExperts > 0 && cfg.MaxLocalExperts < maxLocal(cfg.Placement):
		return cfg, fmt.Errorf("%w: MaxLocalExperts %d, but a rank holds %d experts", ErrConfig, cfg.MaxLocalExperts, maxLocal(cfg.Placement))
	case cfg.SumAtOrigin && act == dtype.U8:
		return cfg, fmt.Errorf("%w: SumAtOrigin with opaque rows (the combine's outputs are float32 or bfloat16)", ErrConfig)
	case cfg.SumAtOrigin && cfg.CombineDType != act:
		return cfg, fmt.Errorf("%w: SumAtOrigin sends the outputs in the activation type %v, not the combine type %v", ErrConfig, act, cfg.CombineDType)
	}
	if cfg.MaxLocalExperts == 0 {
		cfg.MaxLocalExperts = maxLocal(cfg.Placement)
	}
	return cfg, nil
}

// maxLocal is the most experts any rank of pl holds.
func maxLocal(pl *router.Placement) int {
	n := 0
	for _, l := range pl.Local {
		n = max(n, len(l))
	}
	return n
}

// UsePlacement makes the dispatches started after it use pl, another layer's placement,
// for instance: one dispatcher and combiner, their buffers made once, serve every layer
// whose configuration differs only in its placement. Results already started keep the
// placement they were dispatched with (Handle.Config), and so does Redispatch. Every rank
// must use the same placement for a dispatch, or it fails on every rank with
// ErrMismatch. pl must span the communicator's ranks, have at least TopK experts, and
// give no rank more than MaxLocalExperts of them (ErrConfig); it must not change while
// in use.
func (d *core) UsePlacement(pl *router.Placement) error {
	switch {
	case pl == nil:
		return fmt.Errorf("%w: no placement", ErrConfig)
	case pl == d.cfg.Placement:
		return nil
	case pl.Ranks != d.c.Size():
		return fmt.Errorf("%w: placement over %d ranks on a communicator of %d", ErrConfig, pl.Ranks, d.c.Size())
	case pl.Experts < d.cfg.TopK:
		return fmt.Errorf("%w: top-k %d with %d experts", ErrConfig, d.cfg.TopK, pl.Experts)
	case maxLocal(pl) > d.cfg.MaxLocalExperts:
		return fmt.Errorf("%w: a rank holds %d experts, MaxLocalExperts is %d", ErrConfig, maxLocal(pl), d.cfg.MaxLocalExperts)
	}
	d.cfg.Placement = pl
	d.fp, d.fpBuf = fingerprint(d.fpBuf, d.cfg)
	return nil
}

// llExchange is the low-latency mode's exchange: per block a header and the rows'
// metadata, their payloads and their scales, each for MaxTokens rows.
func llExchange(cfg Config, f Format) coll.ExchangeConfig {
	return coll.ExchangeConfig{Slots: cfg.InFlight, Fields: []int{
		BlockHeader + cfg.MaxTokens*f.Meta, cfg.MaxTokens * f.Payload, cfg.MaxTokens * f.ScaleBytes()}}
}

// LowLatencyBytes is the memory (Dispatcher.Bytes) that a Dispatcher[T] of cfg in the
// low-latency mode holds on each rank of cfg.Placement once every slot has taken a
// dispatch of MaxTokens tokens: where every rank maps every rank's memory (shared: one
// host, over shm or inproc; the experts then read the rows in place unless PushRows), or
// where blocks travel as messages (coll.ExchangeBytes says what a mix adds). It runs
// nothing, so that an engine can size its other buffers first (moex flow prints it).
func LowLatencyBytes[T Act](cfg Config, shared bool) (int, error) {
	cfg, err := Defaults[T](cfg)
	if err != nil {
		return 0, err
	}
	if cfg.Mode != LowLatency {
		return 0, fmt.Errorf("%w: LowLatencyBytes of the %v mode", ErrConfig, cfg.Mode)
	}
	p, f := cfg.Placement.Ranks, NewFormat(cfg)
	n := coll.ExchangeBytes(llExchange(cfg, f), p, shared)
	perSrc := cfg.MaxTokens // rows per source rank in the experts' view
	if rows := stagingRows(f, cfg.MaxTokens, p); shared && !cfg.PushRows && p > 1 && rows > 0 {
		n += cfg.InFlight * rows * (f.Payload + f.ScaleBytes())
		perSrc = rows
	}
	if act := actType[T](); !cfg.Quantized && f.Wire != act { // the rows decoded for the experts
		n += cfg.InFlight * obuf.Capacity(p*perSrc*cfg.Hidden*int(sizeOf[T]()))
	}
	return n, nil
}

// maxStaging bounds the staging of one slot (every rank's part) for the rows read in
// place; above it the rows are pushed.
const maxStaging = 4 << 30

// stagingRows is how many rows each rank's part of a slot's staging holds: MaxTokens,
// rounded up so that the payloads (and the scales) of a part fill whole pages, the parts
// then lying side by side as one array of rows; 0 where every rank's parts together
// would pass maxStaging (the rows are then pushed).
func stagingRows(f Format, maxTokens, p int) int {
	pg := os.Getpagesize()
	unit := pg / gcd(f.Payload, pg)
	if sb := f.ScaleBytes(); sb > 0 {
		u := pg / gcd(sb, pg)
		unit = unit / gcd(unit, u) * u
	}
	rows := (maxTokens + unit - 1) / unit * unit
	if rows*(f.Payload+f.ScaleBytes())*p > maxStaging {
		return 0
	}
	return rows
}

// openStaging makes each slot's staging where every rank can map every rank's side by
// side (coll.Comm.NewSpanBoard), so that the experts read the rows in place; where some
// rank cannot, every rank pushes its rows instead.
func (d *core) openStaging(ctx context.Context) error {
	f := &d.f
	rows := stagingRows(*f, d.cfg.MaxTokens, d.c.Size())
	if rows == 0 {
		return nil
	}
	for _, sc := range d.cores {
		for i, size := range []int{rows * f.Payload, rows * f.ScaleBytes()} {
			if size == 0 {
				continue
			}
			b, err := d.c.NewSpanBoard(ctx, size)
			if errors.Is(err, coll.ErrNoBoard) {
				d.closeStaging()
				return nil
			}
			if err != nil {
				d.closeStaging()
				return err
			}
			sc.stage[i] = b
		}
		sc.stageFree = true
	}
	d.rowsPer = rows
	return nil
}

func (d *core) closeStaging() {
	for _, sc := range d.cores {
		for i, b := range sc.stage {
			if b != nil {
				b.Close()
				sc.stage[i] = nil
			}
		}
	}
	d.rowsPer = 0
}

func gcd(a, b int) int {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// RowsInPlace reports whether the low-latency dispatch writes each token once into
// its origin's staging, where the experts read it (Config.PushRows unset, and every rank
// can map every rank's staging side by side).
func (d *core) RowsInPlace() bool { return d.rowsPer > 0 }

// fill checks cfg and fills its defaults (the wire and combine types are set).
func (cfg *Config) fill() error {
	if cfg.InFlight == 0 {
		cfg.InFlight = 2
	}
	if cfg.Align < 1 {
		cfg.Align = 1
	}
	switch {
	case cfg.Hidden < 1 || cfg.Hidden > 1<<24:
		return fmt.Errorf("%w: hidden size %d", ErrConfig, cfg.Hidden)
	case cfg.TopK < 1 || cfg.TopK > 64:
		return fmt.Errorf("%w: top-k %d (want 1..64)", ErrConfig, cfg.TopK)
	case cfg.WireDType != dtype.F32 && cfg.WireDType != dtype.BF16 && cfg.WireDType != dtype.FP8E4M3 && cfg.WireDType != dtype.I8 && cfg.WireDType != dtype.U8:
		return fmt.Errorf("%w: wire type %v (want f32, bf16, fp8 or int8)", ErrConfig, cfg.WireDType)
	case cfg.CombineDType != dtype.F32 && cfg.CombineDType != dtype.BF16 && cfg.CombineDType != dtype.FP8E4M3 && cfg.CombineDType != dtype.I8:
		return fmt.Errorf("%w: combine type %v (want f32, bf16, fp8 or int8)", ErrConfig, cfg.CombineDType)
	case cfg.Mode != LowLatency && (cfg.SendPartials || cfg.PushRows):
		return fmt.Errorf("%w: SendPartials and PushRows are for the low-latency mode, not the %v mode", ErrConfig, cfg.Mode)
	case cfg.Mode == Gathered && cfg.SumAtOrigin:
		return fmt.Errorf("%w: SumAtOrigin in the gathered mode, whose reduce-scatter adds the partial sums on the way", ErrConfig)
	case cfg.Mode == Gathered && cfg.CombineDType != dtype.F32 && cfg.CombineDType != dtype.BF16:
		return fmt.Errorf("%w: combine type %v in the gathered mode, whose reduce-scatter adds the partial sums on the way (want f32 or bf16)", ErrConfig, cfg.CombineDType)
	case cfg.Placement == nil:
		return fmt.Errorf("%w: no placement", ErrConfig)
	case cfg.TopK > cfg.Placement.Experts:
		return fmt.Errorf("%w: top-k %d with %d experts", ErrConfig, cfg.TopK, cfg.Placement.Experts)
	case cfg.Mode != Normal && cfg.Mode != LowLatency && cfg.Mode != Gathered:
		return fmt.Errorf("%w: mode %v", ErrConfig, cfg.Mode)
	case cfg.Mode == LowLatency && (cfg.MaxTokens < 1 || cfg.MaxTokens > MaxLowLatencyTokens):
		return fmt.Errorf("%w: the low-latency mode needs MaxTokens in 1..%d, not %d", ErrConfig, MaxLowLatencyTokens, cfg.MaxTokens)
	case cfg.InFlight < 1 || cfg.InFlight > 16:
		return fmt.Errorf("%w: InFlight %d (want 1..16)", ErrConfig, cfg.InFlight)
	case cfg.Align > 1<<16:
		return fmt.Errorf("%w: alignment %d", ErrConfig, cfg.Align)
	}
	return nil
}

func actType[T Act]() dtype.Type {
	var z T
	switch any(z).(type) {
	case float32:
		return dtype.F32
	case dtype.BFloat16:
		return dtype.BF16
	}
	return dtype.U8
}

// Config returns the dispatcher's configuration (defaults filled).
func (d *core) Config() Config { return d.cfg }

// Format returns the wire format.
func (d *core) Format() Format { return d.f }

// Comm returns the communicator.
func (d *core) Comm() *coll.Comm { return d.c }

// RowBytes is the most bytes of one row on the wire in the normal mode (metadata, payload
// and scales, for a row that carries all TopK choices; Format.RowBytes sizes a row by
// its choices).
func (d *core) RowBytes() int { return d.f.Row }

// Stats describes the last dispatch.
func (d *core) Stats() Stats { return d.stats }

// Owner identifies the dispatcher, whatever its activation type (Handle.Owner).
func (d *core) Owner() any { return d }

// Exchange is the low-latency mode's exchange (nil in the normal mode).
func (d *core) Exchange() *coll.Exchange { return d.x }

// CountsExchange is how many int64 every rank contributes to the counts all-gather of
// the normal mode (a header, then a row count per rank).
func (d *core) CountsExchange() int { return hdrLen + d.c.Size() }

// Plan returns the AlltoAllv schedule of the last normal-mode dispatch (for moex flow
// and debugging).
func (d *Dispatcher[T]) Plan() *coll.VPlan {
	return &d.slots[int((d.gen+uint64(len(d.slots))-1)%uint64(len(d.slots)))].fwd
}

// Pending is a dispatch whose rows are on their way: Wait completes it.
type Pending[T Act] struct {
	s   *slot[T]
	gen uint64
}

// Dispatch sends this rank's T tokens x (T x Hidden, row-major) to the experts r chose
// and returns what this rank's experts receive. Every rank must call it (a rank with no
// tokens passes empty x and routing). It is Start followed by Wait.
func (d *Dispatcher[T]) Dispatch(ctx context.Context, x []T, r *router.Routing) (*Output[T], Handle, error) {
	p, err := d.Start(ctx, x, r)
	if err != nil {
		return nil, Handle{}, err
	}
	return p.Wait(ctx)
}

// Start is the send half of Dispatch: it checks the input, plans, packs and sends, and
// returns without waiting for the other ranks' rows. x and r must stay unchanged until
// Wait returns.
func (d *Dispatcher[T]) Start(ctx context.Context, x []T, r *router.Routing) (*Pending[T], error) {
	s, err := d.take()
	if err != nil {
		return nil, err
	}
	code, inErr := d.check(x, r)
	return d.startSlot(ctx, s, x, r, code, inErr, false)
}

// take reserves the next slot, unless its buffers are still in use.
func (d *Dispatcher[T]) take() (*slot[T], error) {
	if d.closed {
		return nil, fmt.Errorf("%w: dispatcher closed", coll.ErrClosed)
	}
	s := d.slots[int(d.gen%uint64(len(d.slots)))]
	switch {
	case s.sc.state == slotStarted:
		return nil, fmt.Errorf("%w: dispatch %d would reuse the buffers of dispatch %d, not waited for (InFlight %d)", ErrBusy, d.gen+1, s.sc.gen, len(d.slots))
	case s.sc.pins > 0:
		return nil, fmt.Errorf("%w: dispatch %d would reuse the buffers of dispatch %d, whose combine runs (InFlight %d)", ErrBusy, d.gen+1, s.sc.gen, len(d.slots))
	}
	d.gen++
	s.sc.gen, s.sc.valid = d.gen, false
	s.sc.pl, s.sc.fp = d.cfg.Placement, d.fp
	return s, nil
}

func (d *Dispatcher[T]) startSlot(ctx context.Context, s *slot[T], x []T, r *router.Routing, code int, inErr error, reuse bool) (*Pending[T], error) {
	var err error
	switch d.cfg.Mode {
	case LowLatency:
		err = s.startLL(ctx, x, r, code, inErr, reuse)
	case Gathered:
		err = s.startGathered(ctx, x, r, code, inErr, reuse)
	default:
		err = s.startNormal(ctx, x, r, code, inErr, reuse)
	}
	if err != nil {
		return nil, err
	}
	s.sc.state = slotStarted
	s.pending = Pending[T]{s: s, gen: s.sc.gen}
	return &s.pending, nil
}

// Wait is the receive half of Dispatch: it waits for the other ranks' rows and returns
// this rank's experts' inputs and the handle for combine.
func (p *Pending[T]) Wait(ctx context.Context) (*Output[T], Handle, error) {
	s := p.s
	if p.gen != s.sc.gen || s.sc.state != slotStarted {
		return nil, Handle{}, fmt.Errorf("%w: Wait called twice, or after the dispatcher moved on", ErrStale)
	}
	var err error
	switch s.d.cfg.Mode {
	case LowLatency:
		err = s.waitLL(ctx)
	case Gathered:
		err = s.waitGathered(ctx)
	default:
		err = s.waitNormal(ctx)
	}
	s.sc.state = slotIdle
	if err != nil {
		return nil, Handle{}, err
	}
	s.sc.valid = true
	return &s.out, Handle{d: s.d.core, s: s.sc, gen: s.sc.gen, pl: s.sc.pl, fp: s.sc.fp}, nil
}

// Abandon takes part in a dispatch that this rank cannot make (its router failed, for
// instance): the other ranks' Dispatch returns a PeerInputError naming this rank, in the
// same call, instead of waiting; the communicator stays usable. It returns cause.
func (d *Dispatcher[T]) Abandon(ctx context.Context, cause error) error {
	s, err := d.take()
	if err != nil {
		return errors.Join(cause, err)
	}
	p, err := d.startSlot(ctx, s, nil, nil, CodeRouting, cause, false)
	if err != nil {
		return errors.Join(cause, err)
	}
	if _, _, err := p.Wait(ctx); err != nil && !errors.Is(err, cause) {
		return errors.Join(cause, err)
	}
	return cause
}

// Redispatch moves new activations x with the routing of h (same tokens, same experts):
// the layout and plan of h are reused (in the normal mode: no counts exchange), and h
// and its Output stay valid. Every rank must call it.
func (d *Dispatcher[T]) Redispatch(ctx context.Context, h Handle, x []T) (*Output[T], error) {
	if h.d != d.core || !h.Valid() {
		return nil, ErrStale
	}
	if h.s.state == slotStarted || h.s.pins > 0 {
		return nil, fmt.Errorf("%w: the dispatch's buffers are in use", ErrBusy)
	}
	s := d.slots[h.s.idx]
	code, inErr := CodeOK, error(nil)
	if len(x) != h.s.tokens*d.cfg.Hidden {
		code, inErr = CodeShape, fmt.Errorf("%w: %d values for %d tokens of %d", ErrInput, len(x), h.s.tokens, d.cfg.Hidden)
	}
	p, err := d.startSlot(ctx, s, x, h.s.r, code, inErr, true)
	if err != nil {
		return nil, err
	}
	out, _, err := p.Wait(ctx)
	return out, err
}

// check validates this rank's input, returning its status code.
func (d *Dispatcher[T]) check(x []T, r *router.Routing) (int, error) {
	t, err := checkRouting(d.cfg, r)
	if err != nil {
		return CodeRouting, err
	}
	if len(x) != t*d.cfg.Hidden {
		return CodeShape, fmt.Errorf("%w: %d values for %d tokens of %d", ErrInput, len(x), t, d.cfg.Hidden)
	}
	if d.cfg.Mode == LowLatency && t > d.cfg.MaxTokens {
		return CodeTooMany, fmt.Errorf("%w: %d tokens, MaxTokens is %d", ErrInput, t, d.cfg.MaxTokens)
	}
	return CodeOK, nil
}

// Close gives the dispatcher's buffers back to their pool. Outputs and Handles are
// invalid afterwards, and the Dispatcher must not be used again.
func (d *Dispatcher[T]) Close() error {
	if d.closed {
		return nil
	}
	d.closed = true
	d.gen++
	for _, s := range d.slots {
		s.sc.valid = false
		s.release()
	}
	d.stage.Release()
	d.closeStaging()
	if d.x != nil {
		return d.x.Close()
	}
	return nil
}

// Bytes is the memory this rank holds for the dispatcher's buffers (address space: a
// page takes memory when first written). In the low-latency mode most of it is fixed by
// New: the exchange (coll.Exchange.Bytes: InFlight+1 blocks per source rank, each with
// room for MaxTokens rows and their metadata, so that it grows with the ranks and
// MaxTokens, not with the experts) and, where the experts read the rows in place, the
// staging of this rank's tokens (InFlight of them); LowLatencyBytes says it beforehand.
// Besides, in every mode, scratch buffers grow to the largest dispatch so far, at their
// pool's capacity: the wire buffers of the normal mode, and the rows decoded for the
// experts where the wire type is not the activations'. The caller's memory (tokens,
// routing) does not count. It is 0 after Close.
func (d *Dispatcher[T]) Bytes() int {
	if d.closed {
		return 0
	}
	n := d.stage.Cap()
	if d.x != nil {
		n += d.x.Bytes()
	}
	for _, sc := range d.cores {
		for _, b := range sc.stage {
			if b != nil {
				n += b.Size()
			}
		}
	}
	for _, s := range d.slots {
		n += s.sendS.Cap() + s.recvS.Cap() + s.xS.Cap()
	}
	return n
}

// MaxRows is the most expert-major rows (entries, padding included) a low-latency
// dispatch can deliver to this rank: the size of the largest expert outputs Combine
// takes. 0 in the normal mode (no bound).
func (d *core) MaxRows() int {
	if d.cfg.Mode != LowLatency {
		return 0
	}
	nLocal := d.cfg.MaxLocalExperts
	per := min(d.cfg.TopK, nLocal)
	return d.c.Size()*d.cfg.MaxTokens*per + nLocal*(d.cfg.Align-1)
}
