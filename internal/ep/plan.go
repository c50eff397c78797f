package ep

import (
	"encoding/binary"
	"fmt"

	"github.com/cespare/xxhash/v2"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/router"
)

// The planning half of dispatch and combine: pure functions of the configuration, the
// placement and every rank's routing. The executors use them for their own rank; Plan
// runs them for every rank at once, for moex flow and for tests without processes.

// Format is the wire format of one configuration: how big a row is, where its parts are.
// A row's metadata is MetaBytes(m) for a row that carries m of the token's choices (the
// ones its destination holds): the rows to a rank carry what that rank needs, not the
// token's whole routing.
type Format struct {
	Hidden   int        // elements per row
	TopK     int        // routing choices per token
	Wire     dtype.Type // payload type
	Scales   int        // float32 scales per row (fp8: one per 128 elements; int8: one)
	Meta     int        // the most bytes of a row's metadata (MetaBytes(TopK))
	Payload  int        // bytes of a row's activations on the wire
	Row      int        // the most bytes of a row in the normal mode (RowBytes(TopK))
	Combined int        // bytes of a combined row (partial sum) on the wire, scales included
	Combine  dtype.Type // the combine's wire type
	// CombineScales is the float32 scales of a combined row (fp8: one per 128 elements;
	// int8: one), which follow its payload, 4-aligned.
	CombineScales int
}

// NewFormat returns the format of cfg (whose defaults are filled).
func NewFormat(cfg Config) Format {
	f := Format{Hidden: cfg.Hidden, TopK: cfg.TopK, Wire: cfg.WireDType}
	switch cfg.WireDType {
	case dtype.FP8E4M3:
		f.Scales = dtype.FP8Scales(cfg.Hidden)
	case dtype.I8:
		f.Scales = 1
	}
	f.Payload = cfg.Hidden * cfg.WireDType.Size()
	f.Meta = f.MetaBytes(cfg.TopK)
	f.Row = f.RowBytes(cfg.TopK)
	f.Combine = cfg.CombineDType
	f.Combined = cfg.Hidden * cfg.CombineDType.Size()
	switch cfg.CombineDType {
	case dtype.FP8E4M3:
		f.CombineScales = dtype.FP8Scales(cfg.Hidden)
	case dtype.I8:
		f.CombineScales = 1
	}
	if f.CombineScales > 0 {
		f.Combined = f.CombineScaleAt() + 4*f.CombineScales
	}
	return f
}

// CombineScaleAt is where a combined row's scales start: after its payload, 4-aligned.
func (f Format) CombineScaleAt() int { return (f.Hidden*f.Combine.Size() + 3) &^ 3 }

func align8(n int) int { return (n + 7) &^ 7 }

// MetaBytes is the bytes of the metadata of a row with m choices: its source index, m,
// and each (local expert, weight).
func (f Format) MetaBytes(m int) int { return 8 + 8*m }

// RowBytes is the bytes of a row with m choices in the normal mode: metadata, payload,
// scales (4-aligned after the payload), 8-aligned.
func (f Format) RowBytes(m int) int { return f.MetaBytes(m) + f.rowTail() }

// rowTail is the part of a normal-mode row after its metadata: the payload and the
// scales, 8-aligned (the metadata is a multiple of 8).
func (f Format) rowTail() int { return align8(f.scaleAt() + f.ScaleBytes()) }

// scaleAt is where a normal-mode row's scales start, after its metadata.
func (f Format) scaleAt() int { return (f.Payload + 3) &^ 3 }

// ScaleBytes is the bytes of a row's scales.
func (f Format) ScaleBytes() int { return 4 * f.Scales }

// WireBytesPerChoice is the bytes DeepEP counts per valid (token, expert) selection:
// the payload, its scales and 16 bytes of routing (index and weight).
func (f Format) WireBytesPerChoice() int { return f.Payload + f.ScaleBytes() + 16 }

// Fingerprint identifies what every rank must agree on to dispatch together: the
// format, the mode, the limits and the placement (every expert's replicas). Ranks whose
// fingerprints differ fail the dispatch with ErrMismatch.
func Fingerprint(cfg Config) uint64 {
	fp, _ := fingerprint(nil, cfg)
	return fp
}

// fingerprint is Fingerprint, encoding into buf (returned for reuse): one hash of one
// buffer, a few microseconds for hundreds of experts.
func fingerprint(buf []byte, cfg Config) (uint64, []byte) {
	buf = buf[:0]
	for _, v := range []int{cfg.Hidden, cfg.TopK, int(cfg.WireDType), int(cfg.CombineDType), int(cfg.Mode), cfg.MaxTokens, cfg.InFlight, b2i(cfg.SendPartials), b2i(cfg.PushRows), b2i(cfg.SumAtOrigin), cfg.MaxLocalExperts} {
		buf = binary.LittleEndian.AppendUint64(buf, uint64(v))
	}
	buf = appendPlacement(buf, cfg.Placement)
	return xxhash.Sum64(buf), buf
}

// PlacementFingerprint identifies a placement: its kind and every expert's replicas.
func PlacementFingerprint(pl *router.Placement) uint64 {
	return xxhash.Sum64(appendPlacement(nil, pl))
}

// appendPlacement appends pl's encoding: its size, kind and every expert's owners.
func appendPlacement(buf []byte, pl *router.Placement) []byte {
	for _, v := range []int{pl.Experts, pl.Ranks, int(pl.Kind)} {
		buf = binary.LittleEndian.AppendUint64(buf, uint64(v))
	}
	for _, owners := range pl.Owners {
		buf = binary.LittleEndian.AppendUint32(buf, uint32(len(owners)))
		for _, r := range owners {
			buf = binary.LittleEndian.AppendUint32(buf, uint32(r))
		}
	}
	return buf
}

// Plan is the data flow of one dispatch and its combine over every rank.
type Plan struct {
	Cfg     Config
	Format  Format
	Layouts []*router.Layout // per rank: which of its tokens go to which rank
	// Rows[i][j] is how many rows rank i sends rank j (each token once per rank,
	// however many of its experts are there); Rows[i][i] are the rows a rank keeps.
	Rows [][]int
	// Choices[i][j] is how many (token, expert) choices those rows carry.
	Choices [][]int
	// ExpertRows[r][k] is how many rows local expert k of rank r receives (one per
	// (token, expert) pair).
	ExpertRows [][]int
	routings   []*router.Routing
}

// NewPlan plans a dispatch of the given routing of every rank (routings[r] is rank r's)
// under cfg, without running anything. The wire and combine types default to f32, as a
// Dispatcher[float32]'s.
func NewPlan(cfg Config, routings []*router.Routing) (*Plan, error) {
	if cfg.WireDType == 0 {
		cfg.WireDType = dtype.F32
	}
	if cfg.CombineDType == 0 {
		cfg.CombineDType = dtype.F32
	}
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	if cfg.MaxLocalExperts == 0 {
		cfg.MaxLocalExperts = maxLocal(cfg.Placement)
	}
	p := cfg.Placement.Ranks
	if len(routings) != p {
		return nil, fmt.Errorf("%w: %d routings for %d ranks", ErrConfig, len(routings), p)
	}
	pl := &Plan{Cfg: cfg, Format: NewFormat(cfg), Layouts: make([]*router.Layout, p), Rows: make([][]int, p), Choices: make([][]int, p), ExpertRows: make([][]int, p), routings: routings}
	for r := range pl.ExpertRows {
		pl.ExpertRows[r] = make([]int, len(cfg.Placement.Local[r]))
	}
	for o, rt := range routings {
		if _, err := checkRouting(cfg, rt); err != nil {
			return nil, fmt.Errorf("rank %d: %w", o, err)
		}
		if cfg.Mode == LowLatency && rt.T > cfg.MaxTokens {
			return nil, fmt.Errorf("%w: rank %d has %d tokens, MaxTokens is %d", ErrInput, o, rt.T, cfg.MaxTokens)
		}
		l, err := router.BuildLayout(rt, cfg.Placement, o)
		if err != nil {
			return nil, fmt.Errorf("%w: rank %d: %v", ErrInput, o, err)
		}
		pl.Layouts[o] = l
		pl.Rows[o], pl.Choices[o] = make([]int, p), append([]int(nil), l.Choices...)
		for q, rows := range l.Rows {
			pl.Rows[o][q] = len(rows)
		}
		for t := 0; t < rt.T; t++ {
			for j := 0; j < rt.K; j++ {
				e := int(rt.Experts[t*rt.K+j])
				if e < 0 {
					continue
				}
				q := cfg.Placement.RankOf(e, o, t)
				pl.ExpertRows[q][cfg.Placement.LocalIndex(q, e)]++
			}
		}
	}
	return pl, nil
}

// DispatchBytes[i][j] is what rank i puts on the wire for rank j in the dispatch (zero
// on the diagonal: a rank's own rows never travel), headers included. In the gathered
// mode, every token of i goes to every j: the volume of the all-gather, whatever its
// algorithm.
func (pl *Plan) DispatchBytes() [][]int {
	f := pl.Format
	switch pl.Cfg.Mode {
	case LowLatency:
		return pl.bytes(func(i, j int) int {
			return llMeta(f, pl.Rows[i][j], pl.Choices[i][j]) + pl.Rows[i][j]*(f.Payload+f.ScaleBytes())
		})
	case Gathered:
		return pl.bytes(func(i, j int) int { return pl.Layouts[i].Tokens() * (f.GatheredMeta() + f.Payload + f.ScaleBytes()) })
	}
	return pl.bytes(func(i, j int) int { return normalBlock(f, pl.Rows[i][j], pl.Choices[i][j]) })
}

// normalBlock is the bytes of a normal-mode block of n rows carrying m choices.
func normalBlock(f Format, n, m int) int { return blockHeader + n*f.RowBytes(0) + 8*m }

// llMeta is the bytes of a low-latency block's header and metadata: n rows carrying m
// choices.
func llMeta(f Format, n, m int) int { return BlockHeader + n*f.MetaBytes(0) + 8*m }

// CombineBytes[i][j] is what rank i puts on the wire for rank j in the combine: the
// partial sums of the rows j sent i (with SumAtOrigin, a count per row and an output
// row, in the activation type, per choice they carry); in the gathered mode, of every
// token of j (the volume of the reduce-scatter).
func (pl *Plan) CombineBytes() [][]int {
	f := pl.Format
	switch {
	case pl.Cfg.Mode == Gathered:
		return pl.bytes(func(i, j int) int { return pl.Layouts[j].Tokens() * f.Combined })
	case pl.Cfg.SumAtOrigin: // the combine type is the activations' (Defaults)
		return pl.bytes(func(i, j int) int {
			return BlockHeader + 4*pl.Rows[j][i] + pl.Choices[j][i]*f.Hidden*f.Combine.Size()
		})
	}
	return pl.bytes(func(i, j int) int { return BlockHeader + pl.Rows[j][i]*f.Combined })
}

// InPlaceBytes[i][j] is what rank j reads in rank i's memory in a low-latency combine
// that reads the expert outputs in place (every rank on one host; combine.Combiner
// .Buffer): an output row of actBytes per value for every choice of j's tokens that i's
// experts took.
func (pl *Plan) InPlaceBytes(actBytes int) [][]int {
	return pl.bytes(func(i, j int) int { return pl.Choices[j][i] * pl.Cfg.Hidden * actBytes })
}

// bytes is the matrix of per(i, j) off the diagonal.
func (pl *Plan) bytes(per func(i, j int) int) [][]int {
	p := len(pl.Rows)
	m := make([][]int, p)
	for i := range m {
		m[i] = make([]int, p)
		for j := range m[i] {
			if i != j {
				m[i][j] = per(i, j)
			}
		}
	}
	return m
}

// checkRouting validates a rank's routing against cfg (shapes, expert ids), returning
// the number of tokens.
func checkRouting(cfg Config, r *router.Routing) (int, error) {
	switch {
	case r == nil:
		return 0, fmt.Errorf("%w: nil routing", ErrInput)
	case r.T < 0:
		return 0, fmt.Errorf("%w: %d tokens", ErrInput, r.T)
	case r.K != cfg.TopK || len(r.Experts) != r.T*r.K || len(r.Weights) != r.T*r.K:
		return 0, fmt.Errorf("%w: routing with k=%d (%d choices, %d weights) for %d tokens, top-k %d", ErrInput, r.K, len(r.Experts), len(r.Weights), r.T, cfg.TopK)
	case r.E != cfg.Placement.Experts:
		return 0, fmt.Errorf("%w: routing over %d experts, placement of %d", ErrInput, r.E, cfg.Placement.Experts)
	}
	for i, e := range r.Experts {
		if e < -1 || int(e) >= r.E {
			return 0, fmt.Errorf("%w: token %d choice %d is expert %d (have %d)", ErrInput, i/r.K, i%r.K, e, r.E)
		}
	}
	return r.T, nil
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
