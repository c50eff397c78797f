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

// The kernels that quantise runs of whole blocks give the very codes and scales of the
// block-at-a-time path, for float32 and bfloat16 rows with zeros, subnormals, values
// past FP8's range, infinities and NaNs, and for rows with a partial last block.
func TestQuantizeFP8RunsMatchBlocks(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	special := []float32{0, float32(math.Copysign(0, -1)), 1e-30, -1e-42, 3e38, -3e38, float32(math.Inf(1)),
		float32(math.Inf(-1)), float32(math.NaN()), 0x1p-6, 0x1p-10, 448, 449, -1e6}
	for _, n := range []int{128, 256, 7168, 64*128 + 128, 7168 + 77, 2880} {
		for _, pow2 := range []bool{false, true} {
			x := randRow(r, n, 3)
			for i := 0; i < n/16; i++ {
				x[r.IntN(n)] = special[r.IntN(len(special))]
			}
			if n >= 256 {
				clear(x[128:256]) // a block of zeros
			}
			xb := make([]BFloat16, n)
			F32ToBF16(xb, x)
			rows := map[string]func(q []byte, s []float32, fast bool){
				"f32": func(q []byte, s []float32, fast bool) {
					if fast {
						QuantizeFP8(q, s, x, pow2)
					} else {
						quantizeFP8Blocks(q, s, x, pow2, 0)
					}
				},
				"bf16": func(q []byte, s []float32, fast bool) {
					if fast {
						QuantizeFP8(q, s, xb, pow2)
					} else {
						quantizeFP8Blocks(q, s, xb, pow2, 0)
					}
				},
			}
			for name, quant := range rows {
				want, wantS := make([]byte, n), make([]float32, FP8Scales(n))
				got, gotS := make([]byte, n), make([]float32, FP8Scales(n))
				quant(want, wantS, false)
				quant(got, gotS, true)
				require.Equal(t, wantS, gotS, "%s n=%d pow2=%v: scales", name, n, pow2)
				require.Equal(t, want, got, "%s n=%d pow2=%v: codes", name, n, pow2)
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
	if haveAVX512 { // the AVX2 kernels on the same CPU
		b.Run("fp8-from-bf16-avx2", func(b *testing.B) {
			b.SetBytes(2 * n)
			haveAVX512 = false
			defer func() { haveAVX512 = true }()
			for b.Loop() {
				QuantizeFP8(q, s, xb, false)
			}
		})
	}
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

// The AVX2 kernels agree with the scalar definitions, at every length around their
// widths (so that the scalar tails run too), on values across the whole range: random
// magnitudes, subnormal ones, saturating ones, infinities and NaNs.
func TestKernelsMatchScalar(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	special := []float32{0, float32(math.Copysign(0, -1)), 448, -448, 460, 1e30, float32(math.Inf(1)), float32(math.Inf(-1)),
		float32(math.NaN()), 0x1p-6, 0x1p-7, 0x1p-10, 7.5 * 0x1p-9, 0x1.fffffep-7, 0x1.bffffep8, 0x1.bep8, 0x1.dp8, -0x1.fffffep127}
	for n := 0; n <= 67; n++ {
		x := make([]float32, n)
		for i := range x {
			if r.IntN(6) == 0 {
				x[i] = special[r.IntN(len(special))]
			} else {
				x[i] = float32(math.Ldexp(r.NormFloat64(), r.IntN(24)-16))
			}
		}
		inv := float32(1 + r.Float64()*3)
		// E4M3.
		q := make([]byte, n)
		toE4M3(q, x, inv)
		for i, v := range x {
			require.Equal(t, e4m3(v*inv), q[i], "n=%d element %d: %v", n, i, v)
		}
		y := make([]float32, n)
		scales := []float32{0.25}
		if n > 0 {
			DequantizeFP8(y, q, append(scales, make([]float32, FP8Scales(n))...)[:FP8Scales(n)])
		}
		for i := range q {
			want := FP8E4M3Val(q[i]).Float32() * 0.25
			if i >= FP8Block {
				want = FP8E4M3Val(q[i]).Float32() * 0
			}
			require.True(t, want == y[i] || math.IsNaN(float64(want)) && math.IsNaN(float64(y[i])), "n=%d dequantised %d: %v want %v", n, i, y[i], want)
		}
		// amax.
		m, nan := amax(x)
		var wm float32
		var wnan bool
		for _, v := range x {
			switch {
			case math.IsNaN(float64(v)):
				wnan = true
			case !math.IsInf(float64(v), 0):
				wm = max(wm, float32(math.Abs(float64(v))))
			}
		}
		require.Equal(t, wm, m, "n=%d amax", n)
		require.Equal(t, wnan, nan, "n=%d NaN", n)
		// int8 (finite values only: a NaN makes the whole row NaN before the kernel).
		fin := make([]float32, n)
		for i, v := range x {
			if !math.IsNaN(float64(v)) {
				fin[i] = v
			}
		}
		q8 := make([]byte, n)
		s := QuantizeI8(q8, fin)
		if s > 0 {
			for i, v := range fin {
				f := min(max(v*(1/s), -I8Max), I8Max)
				require.Equal(t, int8(math.RoundToEven(float64(f))), int8(q8[i]), "n=%d int8 %d: %v", n, i, v)
			}
			y8 := make([]float32, n)
			DequantizeI8(y8, q8, s)
			for i := range q8 {
				require.Equal(t, float32(int8(q8[i]))*s, y8[i])
			}
		}
		// axpy, f32 and bf16: one FMA rounding against a multiply and an add.
		acc := make([]float32, n)
		want := make([]float32, n)
		xb := make([]BFloat16, n)
		for i := range acc {
			acc[i] = float32(r.NormFloat64())
			want[i] = acc[i]
			xb[i] = ToBF16(fin[i])
		}
		Axpy(acc, 0.375, fin)
		for i := range acc {
			w := float32(float64(want[i]) + 0.375*float64(fin[i]))
			require.InDelta(t, w, acc[i], math.Abs(float64(w))*1e-6+1e-30, "n=%d axpy %d", n, i)
		}
		sc := make([]float32, n)
		Scale(sc, 0.375, fin)
		scb := make([]float32, n)
		ScaleBF16(scb, -1.5, xb)
		for i := range sc {
			require.Equal(t, 0.375*fin[i], sc[i], "n=%d scale %d", n, i)
			require.Equal(t, -1.5*xb[i].Float32(), scb[i], "n=%d scale bf16 %d", n, i)
		}
		acc2 := append([]float32(nil), want...)
		AxpyBF16(acc2, -1.5, xb)
		for i := range acc2 {
			w := float32(float64(want[i]) - 1.5*float64(xb[i].Float32()))
			require.InDelta(t, w, acc2[i], math.Abs(float64(w))*1e-6+1e-30, "n=%d axpy bf16 %d", n, i)
		}
	}
}

// Without AVX2 and FMA the portable loops give the same results.
func TestKernelsPortable(t *testing.T) {
	if !haveFMA {
		t.Skip("this CPU has no AVX2 and FMA: the portable loops are the only ones, and the other tests ran them")
	}
	defer func() { haveFMA = true }()
	r := rand.New(rand.NewPCG(9, 10))
	x := randRow(r, 1000, 2)
	fast := make([]byte, 1000)
	fs := make([]float32, FP8Scales(1000))
	QuantizeFP8(fast, fs, x, false)
	haveFMA = false
	slow := make([]byte, 1000)
	ss := make([]float32, FP8Scales(1000))
	QuantizeFP8(slow, ss, x, false)
	require.Equal(t, slow, fast)
	require.Equal(t, ss, fs)
}

func BenchmarkAxpy(b *testing.B) {
	const n = 7168
	x := randRow(rand.New(rand.NewPCG(1, 1)), n, 1)
	xb := make([]BFloat16, n)
	F32ToBF16(xb, x)
	acc := make([]float32, n)
	b.Run("f32", func(b *testing.B) {
		b.SetBytes(4 * n)
		for b.Loop() {
			Axpy(acc, 0.5, x)
		}
	})
	b.Run("bf16", func(b *testing.B) {
		b.SetBytes(2 * n)
		for b.Loop() {
			AxpyBF16(acc, 0.5, xb)
		}
	})
}

// WeightedSum is, bit for bit, Scale with the first row and Axpy with each next (or Axpy
// with every row, with add): for every length around the kernel's width, 0 to 20 rows
// (more than one kernel call's 16), f32 and bf16 rows, the vector paths (AVX-512 and
// AVX2 where the CPU has both) and the portable one.
func TestWeightedSumMatchesAxpy(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	check := func(t *testing.T) {
		for _, n := range []int{1, 15, 31, 32, 33, 64, 100, 7168} {
			for _, k := range []int{0, 1, 2, 8, 16, 17, 20} {
				w := make([]float32, k)
				rows := make([][]float32, k)
				rowsB := make([][]BFloat16, k)
				for j := range rows {
					w[j] = float32(r.NormFloat64())
					rows[j] = randRow(r, n+j, 3) // rows may be longer than dst
					rowsB[j] = make([]BFloat16, len(rows[j]))
					F32ToBF16(rowsB[j], rows[j])
				}
				for _, add := range []bool{false, true} {
					start := randRow(r, n, 1)
					want, got := append([]float32(nil), start...), append([]float32(nil), start...)
					wantB, gotB := append([]float32(nil), start...), append([]float32(nil), start...)
					if k == 0 && !add {
						clear(want)
						clear(wantB)
					}
					for j := 0; j < k; j++ {
						if j == 0 && !add {
							Scale(want, w[j], rows[j][:n])
							ScaleBF16(wantB, w[j], rowsB[j][:n])
						} else {
							Axpy(want, w[j], rows[j][:n])
							AxpyBF16(wantB, w[j], rowsB[j][:n])
						}
					}
					WeightedSum(got, w, rows, add)
					WeightedSum(gotB, w, rowsB, add)
					require.Equal(t, want, got, "f32: n %d, %d rows, add %v", n, k, add)
					require.Equal(t, wantB, gotB, "bf16: n %d, %d rows, add %v", n, k, add)
				}
			}
		}
	}
	t.Run("vector", check)
	if haveAVX512 { // the AVX2 kernel where the CPU has AVX-512 too
		haveAVX512 = false
		t.Run("avx2", check)
		haveAVX512 = true
	}
	if haveFMA {
		defer func() { haveFMA = true }()
		haveFMA = false
		t.Run("portable", check)
	}
}

// A token's eight expert rows summed, one pass (WeightedSum) against eight (ScaleBF16,
// AxpyBF16), rows out of the caches (a new set each time, from 64 MiB).
func BenchmarkWeightedSum(b *testing.B) {
	const n, k = 7168, 8
	sets := (64 << 20) / (2 * n * k)
	r := rand.New(rand.NewPCG(1, 1))
	pool := make([][]BFloat16, sets*k)
	for i := range pool {
		pool[i] = make([]BFloat16, n)
		F32ToBF16(pool[i], randRow(r, n, 1))
	}
	w := []float32{0.1, 0.2, 0.3, 0.1, 0.05, 0.05, 0.1, 0.1}
	acc := make([]float32, n)
	i := 0
	b.Run("fused", func(b *testing.B) {
		b.SetBytes(2 * n * k)
		for b.Loop() {
			WeightedSum(acc, w, pool[i*k:(i+1)*k], false)
			i = (i + 1) % sets
		}
	})
	b.Run("axpy", func(b *testing.B) {
		b.SetBytes(2 * n * k)
		for b.Loop() {
			rows := pool[i*k : (i+1)*k]
			ScaleBF16(acc, w[0], rows[0])
			for j := 1; j < k; j++ {
				AxpyBF16(acc, w[j], rows[j])
			}
			i = (i + 1) % sets
		}
	})
}
