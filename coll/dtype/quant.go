package dtype

import (
	"math"
	"unsafe"
)

// Quantisation of activations for the wire: FP8 E4M3 with one float32 scale per block of
// FP8Block elements (DeepEP's layout), and int8 with one float32 scale per row. The
// kernels take and give float32 or bfloat16 (Activation) and run in one pass over each
// block or row after finding its largest magnitude.
//
// Non-finite values, defined:
//   - FP8: a block's scale comes from its largest finite magnitude; NaN stays NaN; ±Inf
//     saturates to the largest magnitude FP8 holds (±448 times the scale).
//   - int8 has no NaN: a row with a NaN gets a NaN scale and comes back all NaN; ±Inf
//     saturates to ±127 times the scale (from the largest finite magnitude).
//   - A block or row without a finite non-zero value has scale 0, codes 0, and comes back
//     zeros: its infinities saturate to the scale times the largest code, 0.

// Activation is the element type of MoE activations: float32 or bfloat16.
type Activation interface{ float32 | BFloat16 }

// FP8Block is the number of elements that share one scale in block-scaled FP8.
const FP8Block = 128

// I8Max is the largest magnitude of symmetric int8 quantisation.
const I8Max = 127

// FP8Scales is the number of scales of n elements in block-scaled FP8.
func FP8Scales(n int) int { return (n + FP8Block - 1) / FP8Block }

// asF32 and asBF16 view s as its concrete type (T is one of them; checked by the caller).
func asF32[T Activation](s []T) []float32 {
	return unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(s))), len(s))
}

func asBF16[T Activation](s []T) []BFloat16 {
	return unsafe.Slice((*BFloat16)(unsafe.Pointer(unsafe.SliceData(s))), len(s))
}

func isF32[T Activation]() bool {
	var z T
	return unsafe.Sizeof(z) == 4
}

// Convert converts src into dst (same length): float32 to bfloat16 rounds to nearest
// even, bfloat16 to float32 is exact, equal types copy.
func Convert[D, S Activation](dst []D, src []S) {
	dst = dst[:len(src)]
	switch {
	case isF32[D]() && isF32[S]():
		copy(asF32(dst), asF32(src))
	case isF32[D]():
		BF16ToF32(asF32(dst), asBF16(src))
	case isF32[S]():
		F32ToBF16(asBF16(dst), asF32(src))
	default:
		copy(asBF16(dst), asBF16(src))
	}
}

// amax returns the largest finite magnitude of src, and whether src holds a NaN.
func amax(src []float32) (m float32, nan bool) {
	k, fin, all := amaxFast(src)
	for _, v := range src[k:] {
		a := math.Float32bits(v) & 0x7fffffff
		all = max(all, a)
		if a < 0x7f800000 {
			fin = max(fin, a) // non-negative floats order as their bits
		}
	}
	return math.Float32frombits(fin), all > 0x7f800000
}

// block is the scratch of one block of bfloat16 values seen as float32.
type block [FP8Block]float32

// f32s returns src as float32s: itself, or converted into buf (len(src) <= FP8Block).
func f32s[T Activation](src []T, buf *block) []float32 {
	if isF32[T]() {
		return asF32(src)
	}
	out := buf[:len(src)]
	BF16ToF32(out, asBF16(src))
	return out
}

// fp8Scale is the scale that maps magnitude m onto FP8's largest, a power of two at or
// above it when pow2.
func fp8Scale(m float32, pow2 bool) float32 {
	s := m / FP8E4M3Max
	if pow2 && s > 0 {
		_, e := math.Frexp(float64(s))
		s = float32(math.Ldexp(1, e))
		if s/2 >= m/FP8E4M3Max { // s was a power of two already
			s /= 2
		}
	}
	return s
}

// e4m3 converts v, a float32 already scaled, to E4M3 with saturation (as ToFP8, without
// the branches of the general path): rounding to nearest even, magnitudes of 448 and
// more (infinities too) become ±448, NaN stays NaN.
func e4m3(v float32) uint8 {
	b := math.Float32bits(v)
	sign := uint8(b>>24) & 0x80
	a := b & 0x7fffffff
	switch {
	case a >= 0x43e00000: // 448 or more, Inf, NaN
		if a > 0x7f800000 {
			return sign | 0x7f
		}
		return sign | 0x7e
	case a >= 0x3c800000: // 2^-6 or more: a normal E4M3 (or 448 after rounding)
		r := a + 0x7ffff + (a>>20)&1
		return sign | uint8(r>>20-120<<3)
	}
	// Subnormal, in units of 2^-9, rounded to nearest even by the float adder (8 is the
	// smallest normal, whose code follows the largest subnormal's).
	q := math.Float32bits(math.Float32frombits(a)*512+8388608) - 0x4b000000
	return sign | uint8(q)
}

// QuantizeFP8 writes src as E4M3 bytes into dst (len(src) of them) with one scale per
// FP8Block elements into scales (FP8Scales(len(src)) of them): each block's largest
// finite magnitude maps to 448. With pow2 the scales are rounded up to powers of two
// (exact to apply, as UE8M0 scales). On amd64 it runs AVX-512 or AVX2 kernels where the
// CPU has them; every CPU gives the same bytes and scales.
func QuantizeFP8[T Activation](dst []byte, scales []float32, src []T, pow2 bool) {
	dst = dst[:len(src)]
	scales = scales[:FP8Scales(len(src))]
	quantizeFP8Blocks(dst, scales, src, pow2, quantizeFP8Fast(dst, scales, src, pow2))
}

// quantizeFP8Blocks is QuantizeFP8 one block at a time, from block first on.
func quantizeFP8Blocks[T Activation](dst []byte, scales []float32, src []T, pow2 bool, first int) {
	var buf block
	for b := first; b < len(scales); b++ {
		lo, hi := b*FP8Block, min((b+1)*FP8Block, len(src))
		x := f32s(src[lo:hi], &buf)
		m, _ := amax(x)
		s := fp8Scale(m, pow2)
		scales[b] = s
		if s == 0 {
			clear(dst[lo:hi]) // infinities too: saturated to 448 times 0
			continue
		}
		toE4M3(dst[lo:hi], x, 1/s)
	}
}

// toE4M3 writes x[i]*inv as E4M3 into dst: e4m3 unrolled into the loop (AVX2 where
// available).
func toE4M3(dst []byte, x []float32, inv float32) {
	dst = dst[:len(x)]
	k := toE4M3Fast(dst, x, inv)
	dst, x = dst[k:], x[k:]
	for i, v := range x {
		b := math.Float32bits(v * inv)
		sign := uint8(b>>24) & 0x80
		a := b & 0x7fffffff
		var q uint8
		switch {
		case a >= 0x43e00000:
			q = 0x7e
			if a > 0x7f800000 {
				q = 0x7f
			}
		case a >= 0x3c800000:
			q = uint8((a+0x7ffff+(a>>20)&1)>>20 - 120<<3)
		default:
			q = uint8(math.Float32bits(math.Float32frombits(a)*512+8388608) - 0x4b000000)
		}
		dst[i] = sign | q
	}
}

// DequantizeFP8 writes the values of src (E4M3 bytes with FP8Scales(len(src)) scales)
// into dst: each code's value times its block's scale, in float32, rounded as ToBF16
// rounds for bfloat16. Vector kernels give the same values on every CPU.
func DequantizeFP8[T Activation](dst []T, src []byte, scales []float32) {
	dst = dst[:len(src)]
	scales = scales[:FP8Scales(len(src))]
	t := fp8Table
	var buf block
	for b := dequantizeFP8Fast(dst, src, scales); b < len(scales); b++ {
		s := scales[b]
		lo, hi := b*FP8Block, min((b+1)*FP8Block, len(src))
		in := src[lo:hi]
		out := buf[:len(in)]
		if isF32[T]() {
			out = asF32(dst[lo:hi])
		}
		k := fromE4M3Fast(out, in, s)
		for i, q := range in[k:] {
			out[k+i] = t[q] * s
		}
		if !isF32[T]() {
			F32ToBF16(asBF16(dst[lo:hi]), out)
		}
	}
}

// QuantizeI8 writes src as symmetric int8 into dst (len(src) bytes) and returns its
// scale: the largest finite magnitude maps to 127, values round to nearest even, and
// infinities saturate. A row with a NaN has scale NaN and codes 0; a row without a
// finite non-zero value has scale 0 and codes 0 (its infinities too). Every CPU gives
// the same bytes.
func QuantizeI8[T Activation](dst []byte, src []T) float32 {
	dst = dst[:len(src)]
	if s, ok := quantizeI8Fast(dst, src); ok {
		if s != s || s == 0 {
			clear(dst)
		}
		return s
	}
	var buf block
	var m float32
	for lo := 0; lo < len(src); lo += FP8Block {
		bm, nan := amax(f32s(src[lo:min(lo+FP8Block, len(src))], &buf))
		if nan {
			clear(dst)
			return float32(math.NaN())
		}
		m = max(m, bm)
	}
	s := m / I8Max
	if s == 0 {
		clear(dst)
		return 0
	}
	inv := 1 / s
	for lo := 0; lo < len(src); lo += FP8Block {
		hi := min(lo+FP8Block, len(src))
		toI8(dst[lo:hi], f32s(src[lo:hi], &buf), inv)
	}
	return s
}

// toI8 writes x[i]*inv into out as int8, clamped to ±127 (infinities saturate) and
// rounded to nearest even; x holds no NaN.
func toI8(out []byte, x []float32, inv float32) {
	k := toI8Fast(out, x, inv)
	for i, v := range x[k:] {
		f := min(max(v*inv, -I8Max), I8Max)
		out[k+i] = byte(math.Float32bits(f+12582912) - 0x4b400000)
	}
}

// DequantizeI8 writes the values of src (int8 with scale) into dst.
func DequantizeI8[T Activation](dst []T, src []byte, scale float32) {
	dst = dst[:len(src)]
	var buf block
	for lo := dequantizeI8Fast(dst, src, scale); lo < len(src); lo += FP8Block {
		hi := min(lo+FP8Block, len(src))
		in := src[lo:hi]
		out := buf[:len(in)]
		if isF32[T]() {
			out = asF32(dst[lo:hi])
		}
		k := fromI8Fast(out, in, scale)
		for i, q := range in[k:] {
			out[k+i] = float32(int8(q)) * scale
		}
		if !isF32[T]() {
			F32ToBF16(asBF16(dst[lo:hi]), out)
		}
	}
}
