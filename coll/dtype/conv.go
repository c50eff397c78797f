package dtype

import "math"

// Conversions between the narrow float formats and float32. Every conversion to a narrow
// format rounds to nearest, ties to even, as IEEE 754 and the hardware that produces these
// formats do. NaN stays NaN (quiet), infinities stay infinite where the format has them.

// BF16 converts f to bfloat16.
func ToBF16(f float32) BFloat16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep the sign, force a quiet NaN
		return BFloat16(b>>16 | 0x0040)
	}
	return BFloat16((b + 0x7fff + (b>>16)&1) >> 16)
}

// Float32 returns h as a float32 (exact).
func (h BFloat16) Float32() float32 { return math.Float32frombits(uint32(h) << 16) }

// F16 converts f to IEEE binary16, with subnormals; values beyond the range become ±Inf.
func ToF16(f float32) Float16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int(b>>23) & 0xff
	mant := b & 0x7fffff
	if exp == 0xff {
		if mant == 0 {
			return Float16(sign | 0x7c00)
		}
		return Float16(sign | 0x7e00 | uint16(mant>>13))
	}
	e := exp - 127 + 15
	if e >= 0x1f {
		return Float16(sign | 0x7c00)
	}
	if e <= 0 {
		if e < -10 {
			return Float16(sign)
		}
		return Float16(sign | uint16(rne(mant|0x800000, uint32(14-e))))
	}
	// Normal: a carry out of the mantissa correctly bumps the exponent (up to Inf).
	return Float16(sign | uint16(rne(uint32(e)<<23|mant, 13)))
}

// rne shifts m right by s bits, rounding to nearest, ties to even.
func rne(m, s uint32) uint32 {
	q := m >> s
	rem := m & (1<<s - 1)
	half := uint32(1) << (s - 1)
	if rem > half || rem == half && q&1 == 1 {
		q++
	}
	return q
}

// Float32 returns h as a float32 (exact).
func (h Float16) Float32() float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h & 0x3ff)
	switch exp {
	case 0:
		if mant == 0 {
			return math.Float32frombits(sign)
		}
		e := uint32(127 - 15 + 1)
		for mant&0x400 == 0 {
			mant <<= 1
			e--
		}
		return math.Float32frombits(sign | e<<23 | (mant&0x3ff)<<13)
	case 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | mant<<13)
	}
	return math.Float32frombits(sign | (exp+112)<<23 | mant<<13)
}

// FP8 limits.
const (
	FP8E4M3Max = 448
	fp8NaN     = 0x7f
)

// FP8 converts f to OCP E4M3 (fn), saturating: magnitudes beyond 448 (including Inf)
// become ±448, as scaled FP8 quantisation expects; NaN becomes NaN.
func ToFP8(f float32) FP8E4M3Val {
	b := math.Float32bits(f)
	sign := uint8(b>>24) & 0x80
	if b&0x7fffffff > 0x7f800000 {
		return FP8E4M3Val(sign | fp8NaN)
	}
	a := b & 0x7fffffff
	exp := int(a>>23) - 127
	mant := a & 0x7fffff
	var q uint32
	switch {
	case exp > 8:
		return FP8E4M3Val(sign | 0x7e)
	case exp >= -6: // normal in E4M3
		q = rne(uint32(exp+7)<<23|mant, 20)
	case exp >= -10 && a != 0: // subnormal: units of 2^-9
		q = rne(mant|0x800000, uint32(14-exp))
	default:
		return FP8E4M3Val(sign)
	}
	if q >= fp8NaN { // rounded past 448
		q = 0x7e
	}
	return FP8E4M3Val(sign | uint8(q))
}

// Float32 returns v as a float32 (exact).
func (v FP8E4M3Val) Float32() float32 {
	sign := uint32(v&0x80) << 24
	e := uint32(v>>3) & 0xf
	m := uint32(v & 7)
	if e == 0xf && m == 7 {
		return math.Float32frombits(sign | 0x7fc00000)
	}
	if e == 0 {
		f := float32(m) / 512
		if sign != 0 {
			return -f
		}
		return f
	}
	return math.Float32frombits(sign | (e-7+127)<<23 | m<<20)
}

// F32ToBF16 converts src into dst (same length). On amd64 with AVX2 it runs 16 values at
// a time in assembly (conv_amd64.s); the rest, and other machines, take this loop.
func F32ToBF16(dst []BFloat16, src []float32) {
	dst = dst[:len(src)]
	k := f32ToBF16Fast(dst, src)
	dst, src = dst[k:], src[k:]
	for i, f := range src {
		b := math.Float32bits(f)
		if b&0x7fffffff > 0x7f800000 {
			dst[i] = BFloat16(b>>16 | 0x0040)
			continue
		}
		dst[i] = BFloat16((b + 0x7fff + (b>>16)&1) >> 16)
	}
}

// BF16ToF32 converts src into dst (same length), with AVX2 where available.
func BF16ToF32(dst []float32, src []BFloat16) {
	dst = dst[:len(src)]
	k := bf16ToF32Fast(dst, src)
	dst, src = dst[k:], src[k:]
	for i, h := range src {
		dst[i] = math.Float32frombits(uint32(h) << 16)
	}
}

// F32ToF16 converts src into dst (same length).
func F32ToF16(dst []Float16, src []float32) {
	dst = dst[:len(src)]
	for i, f := range src {
		dst[i] = ToF16(f)
	}
}

// F16ToF32 converts src into dst (same length).
func F16ToF32(dst []float32, src []Float16) {
	dst = dst[:len(src)]
	for i, h := range src {
		dst[i] = h.Float32()
	}
}

// F32ToFP8 quantises src into dst with a scale: dst[i] = ToFP8(src[i] / scale).
func F32ToFP8(dst []FP8E4M3Val, src []float32, scale float32) {
	dst = dst[:len(src)]
	inv := 1 / scale
	for i, f := range src {
		dst[i] = ToFP8(f * inv)
	}
}

// FP8ToF32 dequantises src into dst: dst[i] = src[i] * scale.
func FP8ToF32(dst []float32, src []FP8E4M3Val, scale float32) {
	dst = dst[:len(src)]
	for i, v := range src {
		dst[i] = v.Float32() * scale
	}
}
