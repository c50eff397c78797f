package dtype

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The fast saturating conversion agrees with ToFP8 on every float32 it can meet.
func TestE4M3MatchesToFP8(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	check := func(f float32) {
		if want, got := uint8(ToFP8(f)), e4m3(f); want != got {
			t.Fatalf("e4m3(%v = %#08x) = %#02x, ToFP8 gives %#02x", f, math.Float32bits(f), got, want)
		}
	}
	for _, f := range []float32{0, -0, 448, -448, 464, 480, 1e9, float32(math.Inf(1)), float32(math.Inf(-1)),
		0x1p-6, 0x1p-7, 0x1p-9, 0x1p-10, 0x1.8p-10, 0x1p-11, 7.5 * 0x1p-9, 0x1.fffffep-7, 0.5, 1.0625, 1.125, 1.1875} {
		check(f)
		check(-f)
	}
	for i := 0; i < 2_000_000; i++ {
		// Magnitudes across FP8's range and a little beyond, every mantissa.
		e := r.IntN(30) - 20
		f := float32(math.Ldexp(1+r.Float64(), e))
		if r.IntN(2) == 0 {
			f = -f
		}
		check(f)
	}
	// Every value exactly halfway between two E4M3s rounds to the even one.
	for q := 0; q < 0x7e; q++ {
		mid := (FP8E4M3Val(q).Float32() + FP8E4M3Val(q+1).Float32()) / 2
		check(mid)
	}
	assert.Equal(t, uint8(0x7f), e4m3(float32(math.NaN()))&0x7f)
}

func randRow(r *rand.Rand, n int, spread float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64() * math.Exp(r.NormFloat64()*spread))
	}
	return x
}

// fp8Bound is the largest error of one quantised element: half a step of E4M3 at its
// magnitude (3 mantissa bits: a relative 2^-4), or half a subnormal step (2^-10 of the
// scale) near zero.
func fp8Bound(x, scale float32) float64 {
	return math.Max(math.Abs(float64(x))*0x1p-4, float64(scale)*0x1p-10)
}

func TestQuantizeFP8(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{1, 127, 128, 129, 7168, 2880} {
		for _, pow2 := range []bool{false, true} {
			x := randRow(r, n, 1)
			q := make([]byte, n)
			s := make([]float32, FP8Scales(n))
			QuantizeFP8(q, s, x, pow2)
			y := make([]float32, n)
			DequantizeFP8(y, q, s)
			for b, sc := range s {
				if pow2 {
					_, e := math.Frexp(float64(sc))
					require.Equal(t, float64(sc), math.Ldexp(0.5, e), "scale %v is not a power of two", sc)
				}
				lo, hi := b*FP8Block, min((b+1)*FP8Block, n)
				m, _ := amax(x[lo:hi])
				require.LessOrEqual(t, m/sc, float32(FP8E4M3Max)*(1+1e-6), "block %d: amax/scale", b)
				if !pow2 {
					require.InDelta(t, FP8E4M3Max, m/sc, 1e-3, "block %d: amax maps onto 448", b)
				}
				for i := lo; i < hi; i++ {
					require.LessOrEqual(t, math.Abs(float64(x[i]-y[i])), fp8Bound(x[i], sc), "n=%d pow2=%v element %d: %v came back %v (scale %v)", n, pow2, i, x[i], y[i], sc)
				}
			}
			// bfloat16 in and out: the same codes from the same values.
			xb := make([]BFloat16, n)
			F32ToBF16(xb, x)
			xr := make([]float32, n)
			BF16ToF32(xr, xb)
			qb, sb, qr, sr := make([]byte, n), make([]float32, len(s)), make([]byte, n), make([]float32, len(s))
			QuantizeFP8(qb, sb, xb, pow2)
			QuantizeFP8(qr, sr, xr, pow2)
			require.Equal(t, qr, qb)
			require.Equal(t, sr, sb)
			yb, yr := make([]BFloat16, n), make([]float32, n)
			DequantizeFP8(yb, qb, sb)
			DequantizeFP8(yr, qr, sr)
			for i := range yb {
				require.Equal(t, ToBF16(yr[i]), yb[i])
			}
		}
	}
}

func TestQuantizeFP8NonFinite(t *testing.T) {
	x := []float32{1, -2, float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1)), 0.5}
	q := make([]byte, len(x))
	s := make([]float32, 1)
	QuantizeFP8(q, s, x, false)
	assert.Equal(t, float32(2)/FP8E4M3Max, s[0], "the scale comes from the largest finite magnitude")
	y := make([]float32, len(x))
	DequantizeFP8(y, q, s)
	assert.InDelta(t, 1, y[0], 1e-6)
	assert.InDelta(t, -2, y[1], 1e-6)
	assert.True(t, math.IsNaN(float64(y[2])), "NaN stays NaN")
	assert.InDelta(t, 2, y[3], 1e-6, "+Inf saturates to the block's largest")
	assert.InDelta(t, -2, y[4], 1e-6, "-Inf saturates")
	// A block of zeros: scale 0, zeros back.
	z := make([]float32, 200)
	qz, sz := make([]byte, 200), make([]float32, 2)
	QuantizeFP8(qz, sz, z, true)
	assert.Equal(t, []float32{0, 0}, sz)
	DequantizeFP8(z, qz, sz)
	assert.Equal(t, make([]float32, 200), z)
}

func TestQuantizeI8(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for _, n := range []int{1, 100, 7168} {
		x := randRow(r, n, 0.5)
		q := make([]byte, n)
		s := QuantizeI8(q, x)
		m, _ := amax(x)
		require.InDelta(t, m/I8Max, s, 1e-9)
		y := make([]float32, n)
		DequantizeI8(y, q, s)
		for i := range x {
			require.LessOrEqual(t, math.Abs(float64(x[i]-y[i])), float64(s)/2*(1+1e-5), "element %d", i)
		}
		xb := make([]BFloat16, n)
		F32ToBF16(xb, x)
		yb := make([]BFloat16, n)
		sb := QuantizeI8(q, xb)
		DequantizeI8(yb, q, sb)
		for i := range xb {
			require.LessOrEqual(t, math.Abs(float64(xb[i].Float32()-yb[i].Float32())), float64(sb)/2*1.01+math.Abs(float64(xb[i].Float32()))/256)
		}
	}
	// Non-finite rows.
	x := []float32{1, float32(math.Inf(1)), -4, float32(math.Inf(-1))}
	q := make([]byte, 4)
	s := QuantizeI8(q, x)
	assert.Equal(t, float32(4)/I8Max, s)
	y := make([]float32, 4)
	DequantizeI8(y, q, s)
	assert.Equal(t, []float32{float32(int8(q[0])) * s, 4, -4, -4}, y)
	x[2] = float32(math.NaN())
	s = QuantizeI8(q, x)
	assert.True(t, math.IsNaN(float64(s)), "a row with a NaN has a NaN scale")
	DequantizeI8(y, q, s)
	for _, v := range y {
		assert.True(t, math.IsNaN(float64(v)), "and comes back all NaN")
	}
}

func TestConvert(t *testing.T) {
	x := []float32{1.5, -3.25, 1e-3, float32(math.Inf(1))}
	b := make([]BFloat16, 4)
	Convert(b, x)
	for i := range x {
		assert.Equal(t, ToBF16(x[i]), b[i])
	}
	y := make([]float32, 4)
	Convert(y, b)
	for i := range y {
		assert.Equal(t, b[i].Float32(), y[i])
	}
	z := make([]float32, 4)
	Convert(z, x)
	assert.Equal(t, x, z)
	c := make([]BFloat16, 4)
	Convert(c, b)
	assert.Equal(t, b, c)
}

func BenchmarkQuantize(b *testing.B) {
	const n = 7168
	x := randRow(rand.New(rand.NewPCG(1, 1)), n, 1)
	xb := make([]BFloat16, n)
	F32ToBF16(xb, x)
	q := make([]byte, n)
	s := make([]float32, FP8Scales(n))
	y := make([]float32, n)
	yb := make([]BFloat16, n)
	b.Run("copy-f32", func(b *testing.B) {
		b.SetBytes(4 * n)
		for b.Loop() {
			copy(y, x)
		}
	})
	b.Run("f32-to-bf16", func(b *testing.B) {
		b.SetBytes(4 * n)
		for b.Loop() {
			F32ToBF16(yb, x)
		}
	})
	b.Run("fp8-from-f32", func(b *testing.B) {
		b.SetBytes(4 * n)
		for b.Loop() {
			QuantizeFP8(q, s, x, false)
		}
	})
	b.Run("fp8-from-bf16", func(b *testing.B) {
		b.SetBytes(2 * n)
		for b.Loop() {
			QuantizeFP8(q, s, xb, false)
		}
	})
	b.Run("fp8-to-bf16", func(b *testing.B) {
		b.SetBytes(2 * n)
		for b.Loop() {
			DequantizeFP8(yb, q, s)
		}
	})
	b.Run("fp8-to-f32", func(b *testing.B) {
		b.SetBytes(4 * n)
		for b.Loop() {
			DequantizeFP8(y, q, s)
		}
	})
	b.Run("i8-from-bf16", func(b *testing.B) {
		b.SetBytes(2 * n)
		for b.Loop() {
			QuantizeI8(q, xb)
		}
	})
	b.Run("i8-to-bf16", func(b *testing.B) {
		b.SetBytes(2 * n)
		for b.Loop() {
			DequantizeI8(yb, q, 0.1)
		}
	})
}
