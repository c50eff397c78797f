package ep

import (
	"encoding/binary"
	"math"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/router"
)

// Rows on the wire: activations in the wire type, and for fp8 and int8 their scales;
// packing encodes each token into the first row it writes for it and copies that
// encoding to the token's other destinations (beginPack, put).

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
// returns the bytes written (f.MetaBytes of that count).
func (d *core) putMeta(dst []byte, pl *router.Placement, rt *router.Routing, t, q int) int {
	me, k := d.c.Rank(), d.cfg.TopK
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
