package dispatch

import (
	"encoding/binary"
	"math"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/router"
)

// Format is the wire format of a dispatch: how big a row is, where its parts are. A
// row's metadata is MetaBytes(m) for a row that carries m of the token's choices (the
// ones its destination holds): the rows to a rank carry what that rank needs, not the
// token's whole routing.
type Format struct {
	Hidden  int        // elements per row
	TopK    int        // routing choices per token
	Wire    dtype.Type // payload type
	Scales  int        // float32 scales per row (fp8: one per 128 elements; int8: one)
	Meta    int        // the most bytes of a row's metadata (MetaBytes(TopK))
	Payload int        // bytes of a row's activations on the wire
	Row     int        // the most bytes of a row in the normal mode (RowBytes(TopK))
}

// NewFormat returns the dispatch format of cfg (the wire type defaults to f32).
func NewFormat(cfg Config) Format {
	if cfg.WireDType == 0 {
		cfg.WireDType = dtype.F32
	}
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
	return f
}

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

// GatheredMeta is the bytes of a token's routing in the gathered mode.
func (f Format) GatheredMeta() int { return 8 + 8*f.TopK }

// CombineFormat is the wire format of the way back: a partial sum per (token, rank), or with
// SumAtOrigin each expert output as it was written.
type CombineFormat struct {
	Hidden  int        // values per row
	Partial dtype.Type // the partial sums' type
	Scales  int        // float32 scales per partial sum (fp8: one per 128 values; int8: one)
	Row     int        // bytes of a partial sum on the wire, scales included
	// Terms: the outputs travel unsummed (SumAtOrigin), TermRow bytes each, in the
	// outputs' type, with a count per row.
	Terms   bool
	TermRow int
}

// newCombineFormat returns the combine's format of partial sums for ccfg (defaults
// filled) and outputs of type out.
func newCombineFormat(hidden int, ccfg CombineConfig, out dtype.Type) CombineFormat {
	f := CombineFormat{Hidden: hidden, Partial: ccfg.PartialDType, Terms: ccfg.SumAtOrigin, TermRow: hidden * out.Size()}
	switch f.Partial {
	case dtype.FP8E4M3:
		f.Scales = dtype.FP8Scales(hidden)
	case dtype.I8:
		f.Scales = 1
	}
	f.Row = hidden * f.Partial.Size()
	if f.Scales > 0 {
		f.Row = f.ScaleAt() + 4*f.Scales
	}
	return f
}

// ScaleAt is where a partial sum's scales start: after its payload, 4-aligned.
func (f CombineFormat) ScaleAt() int { return (f.Hidden*f.Partial.Size() + 3) &^ 3 }

// Block is the bytes after the header of a block of the way back that answers n rows
// carrying m choices: a partial sum per row, or with Terms a count per row and an
// output per choice.
func (f CombineFormat) Block(n, m int) int {
	if f.Terms {
		return termsBytes(n, m, f.TermRow)
	}
	return n * f.Row
}

// termsBytes is the size of a block of n rows with m terms of rowBytes each.
func termsBytes(n, m, rowBytes int) int { return 4*n + m*rowBytes }

// Rows on the wire: activations in the wire type, and for fp8 and int8 their scales;
// packing encodes each token into the first row it writes for it and copies that
// encoding to the token's other destinations.

// encode writes one row of activations src (act values, as bytes) in the wire format:
// payload bytes and scales.
func encode(f *Format, payload []byte, scales []float32, src []byte, act dtype.Type, pow2 bool) {
	switch f.Wire {
	case act:
		copy(payload, src)
	case dtype.BF16: // from f32
		dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](payload), dtype.FromBytes[float32](src))
	case dtype.F32: // from bf16
		dtype.BF16ToF32(dtype.FromBytes[float32](payload), dtype.FromBytes[dtype.BFloat16](src))
	case dtype.FP8E4M3:
		if act == dtype.F32 {
			dtype.QuantizeFP8(payload, scales, dtype.FromBytes[float32](src), pow2)
		} else {
			dtype.QuantizeFP8(payload, scales, dtype.FromBytes[dtype.BFloat16](src), pow2)
		}
	case dtype.I8:
		if act == dtype.F32 {
			scales[0] = dtype.QuantizeI8(payload, dtype.FromBytes[float32](src))
		} else {
			scales[0] = dtype.QuantizeI8(payload, dtype.FromBytes[dtype.BFloat16](src))
		}
	}
}

// decode writes one wire row (payload and scales) into dst as act values.
func decode(f *Format, dst []byte, act dtype.Type, payload []byte, scales []float32) {
	switch f.Wire {
	case act:
		copy(dst, payload)
	case dtype.BF16: // to f32
		dtype.BF16ToF32(dtype.FromBytes[float32](dst), dtype.FromBytes[dtype.BFloat16](payload))
	case dtype.F32: // to bf16
		dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](dst), dtype.FromBytes[float32](payload))
	case dtype.FP8E4M3:
		if act == dtype.F32 {
			dtype.DequantizeFP8(dtype.FromBytes[float32](dst), payload, scales)
		} else {
			dtype.DequantizeFP8(dtype.FromBytes[dtype.BFloat16](dst), payload, scales)
		}
	case dtype.I8:
		if act == dtype.F32 {
			dtype.DequantizeI8(dtype.FromBytes[float32](dst), payload, scales[0])
		} else {
			dtype.DequantizeI8(dtype.FromBytes[dtype.BFloat16](dst), payload, scales[0])
		}
	}
}

func putF32(b []byte, v float32) { binary.LittleEndian.PutUint32(b, math.Float32bits(v)) }
func getF32(b []byte) float32    { return math.Float32frombits(binary.LittleEndian.Uint32(b)) }

// contrib is one (local expert, weight) pair of a row.
type contrib struct {
	le int
	w  float32
}

// putMeta writes the metadata of token t's row for rank q: its index, how many of q's
// experts it goes to, and each (local expert, weight), in the order of its choices. It
// returns the bytes written (MetaBytes of that count).
func putMeta(dst []byte, pl *router.Placement, rt *router.Routing, me, t, q int) int {
	k := rt.K
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
	return 8 + 8*n
}

// getMeta reads the metadata at the start of meta into cs (at most k pairs), checking
// every value read from the wire against its bounds and meta's length: it reports
// false for a row that cannot be. n is the metadata's length.
func getMeta(meta []byte, k, nLocal int, cs []contrib) (src int, out []contrib, n int, ok bool) {
	if len(meta) < 8 {
		return 0, cs, 0, false
	}
	src = int(binary.LittleEndian.Uint32(meta[0:]))
	m := int(binary.LittleEndian.Uint32(meta[4:]))
	if m > k || src < 0 || len(meta) < 8+8*m {
		return 0, cs, 0, false
	}
	for j := 0; j < m; j++ {
		le := int(binary.LittleEndian.Uint32(meta[8+8*j:]))
		if le >= nLocal {
			return 0, cs, 0, false
		}
		cs = append(cs, contrib{le, getF32(meta[12+8*j:])})
	}
	return src, cs, 8 + 8*m, true
}

// Every block of a step starts with a header: status (u32), rows (u32), fingerprint
// (u64), the dispatch's generation (u64), flags (u64).
const blockHeader = 32

// flagInPlace, in a header's flags: the block's rows are in its sender's staging, at
// their token indices, to be read in place.
const flagInPlace = 1

// flagBusy, in a low-latency header's flags: the sender cannot grow its buffers now
// (another dispatch of its is in use). The high 32 bits of the flags carry the tokens
// the sender asked to dispatch, so that every rank knows the step's largest.
const flagBusy = 2

type header struct {
	status, rows int
	fp, gen      uint64
	flags        uint64
}

func (h header) put(b []byte) {
	binary.LittleEndian.PutUint32(b[0:], uint32(h.status))
	binary.LittleEndian.PutUint32(b[4:], uint32(h.rows))
	binary.LittleEndian.PutUint64(b[8:], h.fp)
	binary.LittleEndian.PutUint64(b[16:], h.gen)
	binary.LittleEndian.PutUint64(b[24:], h.flags)
}

func readHeader(b []byte) header {
	return header{status: int(binary.LittleEndian.Uint32(b[0:])), rows: int(binary.LittleEndian.Uint32(b[4:])),
		fp: binary.LittleEndian.Uint64(b[8:]), gen: binary.LittleEndian.Uint64(b[16:]), flags: binary.LittleEndian.Uint64(b[24:])}
}
