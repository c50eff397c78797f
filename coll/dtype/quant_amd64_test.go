package dtype

import (
	"math"
	"math/rand/v2"
	"strconv"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The FP8 block kernels, AVX2 and AVX-512, give e4m3's byte for every bfloat16 value
// (all 65536 bit patterns, NaNs and infinities included) under scales that move them
// across E4M3's whole range, subnormals and saturation included; and for float32 rows
// of random and special values. Their largest finite magnitudes, of bfloat16 and of
// float32 blocks, are amax's.
func TestFP8BlockKernels(t *testing.T) {
	if !haveFMA {
		t.Skip("this CPU has no AVX2 and FMA: only the portable loops run, and the other tests check them")
	}
	type kernels struct {
		name   string
		toBF16 func(dst *byte, src *uint16, nblocks int, invs *float32)
		toF32  func(dst *byte, src *float32, nblocks int, invs *float32)
		amaxB  func(src *uint16, nblocks int, out *uint32)
		amaxF  func(src *float32, nblocks int, out *uint32)
	}
	ks := []kernels{{"avx2", toE4M3BlocksBF16AVX2, toE4M3BlocksF32AVX2, amaxBlocksBF16AVX2, amaxBlocksF32AVX2}}
	if haveAVX512 {
		ks = append(ks, kernels{"avx512", toE4M3BlocksBF16AVX512, toE4M3BlocksF32AVX512, amaxBlocksBF16AVX512, amaxBlocksF32AVX512})
	} else {
		t.Log("this CPU has no AVX-512 (F, BW and DQ): only the AVX2 kernels are checked")
	}
	all := make([]uint16, 1<<16)
	for i := range all {
		all[i] = uint16(i)
	}
	nb := len(all) / FP8Block
	invs := []float32{1, 0x1p-8, 0x1p-120, 0x1p+12, 1.7, 0.3, 1e-30, 0}
	r := rand.New(rand.NewPCG(11, 12))
	x := randRow(r, 64*FP8Block, 4)
	for i := 0; i < len(x); i += 7 {
		x[i] = []float32{0, float32(math.Copysign(0, -1)), 448, -464, float32(math.Inf(1)), float32(math.NaN()), 0x1p-9, -0x1p-7, 0x1.fffffep-7}[i%9]
	}
	xb := unsafe.Slice((*uint16)(unsafe.Pointer(&x[0])), 2*len(x)) // each float32 as two bfloat16s: more patterns
	for _, k := range ks {
		for _, inv := range invs {
			bi := make([]float32, nb)
			for i := range bi {
				bi[i] = inv * float32(1+i%3) // a scale per block, differing
			}
			got := make([]byte, len(all))
			k.toBF16(&got[0], &all[0], nb, &bi[0])
			for i, h := range all {
				v := math.Float32frombits(uint32(h) << 16)
				require.Equal(t, e4m3(v*bi[i/FP8Block]), got[i], "%s, bf16 %#04x times %v", k.name, h, bi[i/FP8Block])
			}
			fi := bi[:len(x)/FP8Block]
			gotF := make([]byte, len(x))
			k.toF32(&gotF[0], &x[0], len(fi), &fi[0])
			for i, v := range x {
				require.Equal(t, e4m3(v*fi[i/FP8Block]), gotF[i], "%s, f32 %v times %v", k.name, v, fi[i/FP8Block])
			}
		}
		// float32 blocks: x's random and special values, and a last block with no finite
		// value, whose amax is 0.
		xf := append(append([]float32(nil), x...), make([]float32, FP8Block)...)
		for i := len(x); i < len(xf); i++ {
			xf[i] = []float32{float32(math.NaN()), float32(math.Inf(-1)), float32(math.Inf(1))}[i%3]
		}
		bitsF := make([]uint32, len(xf)/FP8Block)
		k.amaxF(&xf[0], len(bitsF), &bitsF[0])
		for b := range bitsF {
			m, _ := amax(xf[b*FP8Block : (b+1)*FP8Block])
			require.Equal(t, math.Float32bits(m), bitsF[b], "%s, amax of float32 block %d", k.name, b)
		}
		for _, src := range [][]uint16{all, xb} {
			n := len(src) / FP8Block
			bits := make([]uint32, n)
			k.amaxB(&src[0], n, &bits[0])
			for b := range bits {
				blk := make([]float32, FP8Block)
				BF16ToF32(blk, unsafe.Slice((*BFloat16)(unsafe.Pointer(&src[b*FP8Block])), FP8Block))
				m, _ := amax(blk)
				require.Equal(t, math.Float32bits(m), bits[b], "%s, amax of block %d", k.name, b)
			}
		}
	}
}

// DequantizeFP8 into bfloat16s (AVX-512 where the CPU has it) gives, for each of the
// 256 codes under scales whose products are normal, subnormal, overflowing, zero or
// NaN, the code's value times its scale rounded as ToBF16 rounds it; and the same as
// the path without AVX-512, on a quantised row longer than one call of the kernel's;
// with AVX-512 BF16 and without. Into float32s, each code's value times its scale.
func TestDequantizeFP8BF16(t *testing.T) {
	src := make([]byte, 2*FP8Block*4)
	for i := range src {
		src[i] = byte(i)
	}
	scales := []float32{1, 0x1.8p-3, 3.7, 1e-38, 1e38, 0, float32(math.Inf(1)), 0x1p-140}
	check := func(kernel string) {
		got := make([]BFloat16, len(src))
		DequantizeFP8(got, src, scales)
		for i, q := range src {
			s := scales[i/FP8Block]
			require.Equal(t, ToBF16(FP8E4M3Val(q).Float32()*s), got[i], "%s: code %#02x times %v", kernel, q, s)
		}
	}
	check("as this CPU runs it")
	if haveBF16 { // the rounding without VCVTNE2PS2BF16 too
		haveBF16 = false
		check("without AVX-512 BF16")
		haveBF16 = true
	}
	gotF := make([]float32, len(src)) // into float32s: each code's value times its scale, exactly
	DequantizeFP8(gotF, src, scales)
	for i, q := range src {
		s := scales[i/FP8Block]
		want := FP8E4M3Val(q).Float32() * s
		if math.IsNaN(float64(want)) {
			require.True(t, math.IsNaN(float64(gotF[i])), "float32: code %#02x times %v is %v, want a NaN", q, s, gotF[i])
			continue
		}
		require.Equal(t, math.Float32bits(want), math.Float32bits(gotF[i]), "float32: code %#02x times %v", q, s)
	}
	if !haveAVX512 {
		t.Log("this CPU has no AVX-512 (F, BW and DQ): only the path without it is checked")
		return
	}
	r := rand.New(rand.NewPCG(13, 14))
	x := randRow(r, 7168+77, 3)
	xb := make([]BFloat16, len(x))
	F32ToBF16(xb, x)
	q := make([]byte, len(x))
	qs := make([]float32, FP8Scales(len(x)))
	QuantizeFP8(q, qs, xb, false)
	fast := make([]BFloat16, len(x))
	DequantizeFP8(fast, q, qs)
	haveAVX512 = false
	defer func() { haveAVX512 = true }()
	slow := make([]BFloat16, len(x))
	DequantizeFP8(slow, q, qs)
	require.Equal(t, slow, fast)
}

// QuantizeI8 and DequantizeI8 on bfloat16s give with AVX-512 what they give without it:
// every length around the kernels' widths, rows of random, zero, saturating, infinite
// and NaN values, and every code under scales with normal, subnormal and overflowing
// products (decoded with AVX-512 BF16 and without).
func TestI8BF16(t *testing.T) {
	if !haveAVX512 {
		t.Skip("this CPU has no AVX-512 (F, BW and DQ): the other tests check the only paths it runs")
	}
	avx512, bf16 := haveAVX512, haveBF16
	r := rand.New(rand.NewPCG(15, 16))
	special := []float32{0, 1e30, float32(math.Inf(1)), float32(math.Inf(-1)), -3e-39, 7}
	both := func(f func()) {
		f()
		haveAVX512 = false
		defer func() { haveAVX512 = true }()
		f()
	}
	lengths := []int{7168, 7168 + 5, 4096 + 31}
	for n := 0; n <= 100; n++ {
		lengths = append(lengths, n)
	}
	for _, n := range lengths {
		for _, kind := range []string{"random", "specials", "NaN", "zeros", "zeros and infinities"} {
			x := make([]BFloat16, n)
			for i := range x {
				switch {
				case kind == "zeros and infinities":
					if i%7 == 3 {
						x[i] = ToBF16(float32(math.Inf(1 - 2*(i%2))))
					}
				case kind == "zeros":
				case kind != "random" && r.IntN(5) == 0:
					x[i] = ToBF16(special[r.IntN(len(special))])
				default:
					x[i] = ToBF16(float32(math.Ldexp(r.NormFloat64(), r.IntN(20)-10)))
				}
			}
			if kind == "NaN" && n > 0 {
				x[r.IntN(n)] = ToBF16(float32(math.NaN()))
			}
			var q [2][]byte
			var s [2]float32
			i := 0
			both(func() {
				q[i] = make([]byte, n)
				s[i] = QuantizeI8(q[i], x)
				i++
			})
			require.Equal(t, math.Float32bits(s[1]), math.Float32bits(s[0]), "n=%d %s: scale", n, kind)
			require.Equal(t, q[1], q[0], "n=%d %s", n, kind)
			if kind == "zeros and infinities" || kind == "NaN" {
				require.Equal(t, make([]byte, n), q[0], "n=%d %s: no finite non-zero value (or a NaN), no code", n, kind)
			}
		}
	}
	// Every code, then 16 more and a tail: the AVX-512 BF16 kernel's 32 at a time, the
	// AVX-512 kernel's 16, the portable loop's rest.
	codes := make([]byte, 256+16+13)
	for i := range codes {
		codes[i] = byte(i * 7)
	}
	for _, sc := range []float32{1, 0x1.01p0, 0.0123, 1e-40, 3e36, 0} { // 1+2^-8: products halfway between bfloat16s
		var y [3][]BFloat16
		for i, kernels := range []struct{ avx512, bf16 bool }{{true, true}, {true, false}, {false, false}} {
			haveAVX512, haveBF16 = kernels.avx512 && haveAVX512, kernels.bf16 && haveBF16
			y[i] = make([]BFloat16, len(codes))
			DequantizeI8(y[i], codes, sc)
			haveAVX512, haveBF16 = avx512, bf16
		}
		require.Equal(t, y[2], y[0], "scale %v", sc)
		require.Equal(t, y[2], y[1], "scale %v, without AVX-512 BF16", sc)
	}
}

// Kernels names the kernel set that the feature checks select.
func TestKernelsName(t *testing.T) {
	want := "portable"
	if haveFMA {
		want = "avx2"
	}
	if haveAVX512 {
		want = "avx512"
	}
	if haveAVX512 && haveBF16 {
		want = "avx512-bf16"
	}
	require.Equal(t, want, Kernels())
	if haveBF16 {
		haveBF16 = false
		require.Equal(t, "avx512", Kernels())
		haveBF16 = true
	}
	if haveAVX512 {
		haveAVX512 = false
		defer func() { haveAVX512 = true }()
		require.Equal(t, "avx2", Kernels())
	}
}

// A block (FP8) or row (int8) without a finite non-zero value has scale 0 and codes 0,
// its infinities included, on every path (AVX-512, AVX2, portable), and comes back zeros.
func TestZeroScale(t *testing.T) {
	inf := float32(math.Inf(1))
	x := make([]float32, 2*FP8Block+44)
	for i := range x {
		switch {
		case i < FP8Block && i%5 == 1: // block 0: zeros and infinities
			x[i] = inf * float32(1-2*(i%2))
		case i >= FP8Block && i < 2*FP8Block: // block 1: values
			x[i] = float32(i%9) - 4
		case i >= 2*FP8Block && i%3 == 0: // block 2 (short): zeros and -Inf
			x[i] = -inf
		}
	}
	xb := make([]BFloat16, len(x))
	F32ToBF16(xb, x)
	zeros := make([]byte, FP8Block)
	check := func(t *testing.T) {
		for _, bf := range []bool{false, true} {
			q := make([]byte, len(x))
			s := make([]float32, FP8Scales(len(x)))
			if bf {
				QuantizeFP8(q, s, xb, false)
			} else {
				QuantizeFP8(q, s, x, false)
			}
			assert.Equal(t, []float32{0, 4.0 / FP8E4M3Max, 0}, s, "bf16 %v", bf)
			assert.Equal(t, zeros, q[:FP8Block], "bf16 %v: block 0", bf)
			assert.Equal(t, zeros[:44], q[2*FP8Block:], "bf16 %v: block 2", bf)
			y := make([]BFloat16, len(x))
			DequantizeFP8(y, q, s)
			for i := range y {
				if i < FP8Block || i >= 2*FP8Block {
					require.Zero(t, y[i].Float32(), "bf16 %v: dequantised %d", bf, i)
				}
			}
			q8 := make([]byte, FP8Block+5)
			var s8 float32
			if bf {
				s8 = QuantizeI8(q8, xb[:len(q8)])
			} else {
				s8 = QuantizeI8(q8, x[:len(q8)])
			}
			if s8 == 0 { // the first 133 values: block 0's and five of block 1's
				t.Fatalf("bf16 %v: int8 scale 0 with values in the row", bf)
			}
			q8 = make([]byte, FP8Block)
			if bf {
				s8 = QuantizeI8(q8, xb[:FP8Block])
			} else {
				s8 = QuantizeI8(q8, x[:FP8Block])
			}
			assert.Zero(t, s8, "bf16 %v: int8 scale", bf)
			assert.Equal(t, zeros, q8, "bf16 %v: int8 codes", bf)
		}
	}
	t.Run("best", check)
	if haveAVX512 {
		haveAVX512 = false
		t.Run("avx2", check)
		haveAVX512 = true
	}
	if haveFMA {
		avx512 := haveAVX512
		haveFMA, haveAVX512 = false, false
		t.Run("portable", check)
		haveFMA, haveAVX512 = true, avx512
	}
}

// The weighted sum of a token's eight expert rows (2048 values, as qwen3-30b-a3b's), its
// AVX-512 kernel against the AVX2 one, for bfloat16 and float32 rows, from a pool of one
// set of rows (in the caches), 2 MiB and 64 MiB of them (a new set each time).
func BenchmarkWeightedSumKernels(b *testing.B) {
	const n, k = 2048, 8
	w := []float32{0.1, 0.2, 0.3, 0.1, 0.05, 0.05, 0.1, 0.1}
	acc := make([]float32, n)
	r := rand.New(rand.NewPCG(1, 1))
	for _, pool := range []int{0, 2 << 20, 64 << 20} {
		name := "cached"
		if pool > 0 {
			name = strconv.Itoa(pool>>20) + "MiB"
		}
		bench := func(typ string, size int, sum func(set int)) {
			sets := max(1, pool/(size*n*k))
			for _, kernel := range []string{"avx512", "avx2"} {
				if kernel == "avx512" && !haveAVX512 {
					continue
				}
				b.Run(typ+"/"+name+"/"+kernel, func(b *testing.B) {
					defer func(v bool) { haveAVX512 = v }(haveAVX512)
					haveAVX512 = kernel == "avx512"
					b.SetBytes(int64(size * n * k))
					i := 0
					for b.Loop() {
						sum(i)
						i = (i + 1) % sets
					}
				})
			}
		}
		rowsB := make([][]BFloat16, max(1, pool/(2*n*k))*k)
		for i := range rowsB {
			rowsB[i] = make([]BFloat16, n)
			F32ToBF16(rowsB[i], randRow(r, n, 1))
		}
		bench("bf16", 2, func(set int) { WeightedSum(acc, w, rowsB[set*k:(set+1)*k], false) })
		rowsF := make([][]float32, max(1, pool/(4*n*k))*k)
		for i := range rowsF {
			rowsF[i] = randRow(r, n, 1)
		}
		bench("f32", 4, func(set int) { WeightedSum(acc, w, rowsF[set*k:(set+1)*k], false) })
	}
}
