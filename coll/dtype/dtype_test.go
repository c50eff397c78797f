package dtype

import (
	"math"
	"math/rand/v2"
	"sort"
	"testing"
)

// nearest returns the index of the value in vals (sorted, finite) nearest to x, ties to
// the even encoding; a brute-force reference for round-to-nearest-even.
func nearest(x float64, vals []float64, codes []uint32) (uint32, bool) {
	i := sort.SearchFloat64s(vals, x)
	best := -1
	for _, j := range []int{i - 1, i} {
		if j < 0 || j >= len(vals) {
			continue
		}
		if best < 0 {
			best = j
			continue
		}
		db, dj := math.Abs(vals[best]-x), math.Abs(vals[j]-x)
		if dj < db || dj == db && codes[j]&1 == 0 {
			best = j
		}
	}
	return codes[best], best >= 0
}

type table struct {
	vals  []float64
	codes []uint32
}

func finiteTable(n int, toF32 func(uint32) float32) table {
	type e struct {
		v float64
		c uint32
	}
	var es []e
	for c := 0; c < n; c++ {
		f := toF32(uint32(c))
		if math.IsNaN(float64(f)) || math.IsInf(float64(f), 0) {
			continue
		}
		if f == 0 && math.Signbit(float64(f)) {
			continue // keep +0 only; the sign of zero is checked separately
		}
		es = append(es, e{float64(f), uint32(c)})
	}
	sort.Slice(es, func(i, j int) bool { return es[i].v < es[j].v })
	var t table
	for _, x := range es {
		t.vals = append(t.vals, x.v)
		t.codes = append(t.codes, x.c)
	}
	return t
}

func TestRoundTripExhaustive(t *testing.T) {
	for c := 0; c < 1<<16; c++ {
		h := BFloat16(c)
		if f := h.Float32(); !math.IsNaN(float64(f)) && ToBF16(f) != h {
			t.Fatalf("bf16 %#04x -> %v -> %#04x", c, f, ToBF16(f))
		}
		g := Float16(c)
		if f := g.Float32(); !math.IsNaN(float64(f)) && ToF16(f) != g {
			t.Fatalf("f16 %#04x -> %v -> %#04x", c, f, ToF16(f))
		} else if math.IsNaN(float64(f)) && !math.IsNaN(float64(ToF16(f).Float32())) {
			t.Fatalf("f16 NaN %#04x lost", c)
		}
	}
	for c := 0; c < 256; c++ {
		v := FP8E4M3Val(c)
		if f := v.Float32(); !math.IsNaN(float64(f)) && ToFP8(f) != v {
			t.Fatalf("fp8 %#02x -> %v -> %#02x", c, f, ToFP8(f))
		}
	}
}

func TestKnownValues(t *testing.T) {
	cases := []struct {
		f    float32
		bf   BFloat16
		h    Float16
		fp8  FP8E4M3Val
		name string
	}{
		{1, 0x3f80, 0x3c00, 0x38, "one"},
		{-2, 0xc000, 0xc000, 0xc0, "minus two"},
		{65504, 0x4780, 0x7bff, 0x7e, "f16 max (fp8 saturates)"},
		{65520, 0x4780, 0x7c00, 0x7e, "rounds to f16 inf"},
		{448, 0x43e0, 0x5f00, 0x7e, "fp8 max"},
		{float32(math.Inf(1)), 0x7f80, 0x7c00, 0x7e, "inf (fp8 saturates)"},
		{5.960464477539063e-08, 0x3380, 0x0001, 0x00, "smallest f16 subnormal"},
		{0.001953125, 0x3b00, 0x1800, 0x01, "smallest fp8 subnormal 2^-9"},
	}
	for _, c := range cases {
		if got := ToBF16(c.f); got != c.bf {
			t.Errorf("%s: BF16 = %#04x want %#04x", c.name, got, c.bf)
		}
		if got := ToF16(c.f); got != c.h {
			t.Errorf("%s: F16 = %#04x want %#04x", c.name, got, c.h)
		}
		if got := ToFP8(c.f); got != c.fp8 {
			t.Errorf("%s: FP8 = %#02x want %#02x", c.name, got, c.fp8)
		}
	}
	if !math.IsNaN(float64(ToBF16(float32(math.NaN())).Float32())) || !math.IsNaN(float64(ToF16(float32(math.NaN())).Float32())) ||
		!math.IsNaN(float64(ToFP8(float32(math.NaN())).Float32())) {
		t.Fatal("NaN not preserved")
	}
	if ToF16(float32(math.Copysign(0, -1))) != 0x8000 || ToBF16(float32(math.Copysign(0, -1))) != 0x8000 {
		t.Fatal("negative zero lost")
	}
}

// Random float32 inputs, each checked against a brute-force nearest-even search.
func TestRoundToNearestEven(t *testing.T) {
	bfT := finiteTable(1<<16, func(c uint32) float32 { return BFloat16(c).Float32() })
	hT := finiteTable(1<<16, func(c uint32) float32 { return Float16(c).Float32() })
	pT := finiteTable(256, func(c uint32) float32 { return FP8E4M3Val(c).Float32() })
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 200000; i++ {
		var f float32
		switch i % 3 {
		case 0:
			f = math.Float32frombits(rng.Uint32())
		case 1:
			f = float32(rng.NormFloat64() * 100)
		default:
			// exact midpoints between neighbouring f16 values
			j := rng.IntN(len(hT.vals) - 1)
			f = float32((hT.vals[j] + hT.vals[j+1]) / 2)
		}
		if math.IsNaN(float64(f)) || math.IsInf(float64(f), 0) {
			continue
		}
		x := float64(f)
		ax := math.Abs(x)
		sign := math.Signbit(x)
		check := func(name string, got uint32, tb table, max float64, signBit uint32, overflow uint32) {
			want, _ := nearest(ax, tb.vals, tb.codes)
			if ax > max {
				want = overflow
			}
			if sign && want != 0 || sign && ax == 0 {
				want |= signBit
			} else if sign {
				want |= signBit
			}
			if got != want {
				t.Fatalf("%s(%g): got %#x want %#x", name, f, got, want)
			}
		}
		// Overflow points: values at or beyond the midpoint between max and the next power.
		if ax < 3.3895313892515355e+38 {
			check("BF16", uint32(ToBF16(f)), bfT, 3.3895313892515355e+38, 0x8000, 0x7f80)
		}
		check("F16", uint32(ToF16(f)), hT, 65519.99999, 0x8000, 0x7c00)
		check("FP8", uint32(ToFP8(f)), pT, 448, 0x80, 0x7e)
	}
}

func ref(t Type, op Op, a, b float64) float64 {
	switch op {
	case Sum, Avg:
		return a + b
	case Prod:
		return a * b
	case Min:
		return math.Min(a, b)
	}
	return math.Max(a, b)
}

func get(t Type, b []byte, i int) float64 {
	switch t {
	case F32:
		return float64(FromBytes[float32](b)[i])
	case F64:
		return FromBytes[float64](b)[i]
	case I32:
		return float64(FromBytes[int32](b)[i])
	case I64:
		return float64(FromBytes[int64](b)[i])
	case U8:
		return float64(b[i])
	case I8:
		return float64(FromBytes[int8](b)[i])
	case BF16:
		return float64(FromBytes[BFloat16](b)[i].Float32())
	case F16:
		return float64(FromBytes[Float16](b)[i].Float32())
	}
	return float64(FromBytes[FP8E4M3Val](b)[i].Float32())
}

func set(t Type, b []byte, i int, v float64) {
	switch t {
	case F32:
		FromBytes[float32](b)[i] = float32(v)
	case F64:
		FromBytes[float64](b)[i] = v
	case I32:
		FromBytes[int32](b)[i] = int32(v)
	case I64:
		FromBytes[int64](b)[i] = int64(v)
	case U8:
		b[i] = uint8(v)
	case I8:
		FromBytes[int8](b)[i] = int8(v)
	case BF16:
		FromBytes[BFloat16](b)[i] = ToBF16(float32(v))
	case F16:
		FromBytes[Float16](b)[i] = ToF16(float32(v))
	case FP8E4M3:
		FromBytes[FP8E4M3Val](b)[i] = ToFP8(float32(v))
	}
}

// narrowRound rounds a float64 result as the kernel's type stores it.
func roundAs(t Type, v float64) float64 {
	buf := make([]byte, 8)
	set(t, buf, 0, v)
	return get(t, buf, 0)
}

func TestReduceAgainstReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, typ := range Types {
		for _, op := range Ops {
			n := 1000 + 3
			a := make([]byte, n*typ.Size())
			b := make([]byte, n*typ.Size())
			for i := 0; i < n; i++ {
				// Small integers keep integer products and sums in range.
				set(typ, a, i, float64(rng.IntN(11)-5))
				set(typ, b, i, float64(rng.IntN(11)-5))
				if typ == U8 {
					set(typ, a, i, float64(rng.IntN(11)))
					set(typ, b, i, float64(rng.IntN(11)))
				}
				if typ.Floating() && i%2 == 0 {
					set(typ, a, i, rng.NormFloat64())
				}
			}
			want := make([]float64, n)
			for i := range want {
				want[i] = roundAs(typ, ref(typ, op, get(typ, a, i), get(typ, b, i)))
			}
			d := append([]byte(nil), a...)
			Reduce(typ, op, d, b)
			d2 := append([]byte(nil), b...)
			Reduce(typ, op, d2, a)
			for i := range want {
				if got := get(typ, d, i); got != want[i] {
					t.Fatalf("%v %v [%d]: %v op %v = %v, want %v", typ, op, i, get(typ, a, i), get(typ, b, i), got, want[i])
				}
			}
			if string(d) != string(d2) {
				t.Fatalf("%v %v is not commutative bit for bit", typ, op)
			}
		}
	}
}

func TestFinishAvg(t *testing.T) {
	f := []float32{3, 6, -9}
	Finish(F32, Avg, Bytes(f), 3)
	if f[0] != 1 || f[1] != 2 || f[2] != -3 {
		t.Fatal(f)
	}
	i := []int32{7, -7}
	Finish(I32, Avg, Bytes(i), 2)
	if i[0] != 3 || i[1] != -3 {
		t.Fatal(i)
	}
	h := []BFloat16{ToBF16(6)}
	Finish(BF16, Avg, Bytes(h), 4)
	if h[0].Float32() != 1.5 {
		t.Fatal(h[0].Float32())
	}
	s := []float32{6}
	Finish(F32, Sum, Bytes(s), 4) // not avg: untouched
	if s[0] != 6 {
		t.Fatal(s)
	}
}

func TestOfAndParse(t *testing.T) {
	type myFloat float32
	if Of[float32]() != F32 || Of[BFloat16]() != BF16 || Of[myFloat]() != F32 || Of[int8]() != I8 ||
		Of[uint8]() != U8 || Of[FP8E4M3Val]() != FP8E4M3 || Of[int64]() != I64 || Of[Float16]() != F16 {
		t.Fatal("Of")
	}
	for _, typ := range Types {
		if got, err := Parse(typ.String()); err != nil || got != typ {
			t.Fatalf("Parse(%v) = %v %v", typ, got, err)
		}
	}
	if _, err := Parse("complex128"); err == nil {
		t.Fatal("bad type accepted")
	}
	for _, op := range Ops {
		if got, err := ParseOp(op.String()); err != nil || got != op {
			t.Fatal(op)
		}
	}
}

func TestConvertSlices(t *testing.T) {
	src := []float32{1, -2.5, 3.14159, 1e-3, 65504}
	bf := make([]BFloat16, len(src))
	F32ToBF16(bf, src)
	back := make([]float32, len(src))
	BF16ToF32(back, bf)
	for i := range src {
		if bf[i] != ToBF16(src[i]) || back[i] != bf[i].Float32() {
			t.Fatal(i)
		}
	}
	fp := make([]FP8E4M3Val, len(src))
	F32ToFP8(fp, src, 256)
	FP8ToF32(back, fp, 256)
	for i := range src {
		if rel := math.Abs(float64(back[i]-src[i])) / math.Abs(float64(src[i])); src[i]/256 > 0.02 && rel > 0.07 {
			t.Fatalf("fp8 %v -> %v", src[i], back[i])
		}
	}
}

func BenchmarkReduce(b *testing.B) {
	for _, size := range []int{64 << 10, 1 << 20} {
		src := make([]byte, size)
		dst := make([]byte, size)
		b.Run("copy/"+sizeName(size), func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				copy(dst, src)
			}
		})
		for _, typ := range []Type{F32, F64, BF16, I32} {
			b.Run(typ.String()+"-sum/"+sizeName(size), func(b *testing.B) {
				b.SetBytes(int64(size))
				b.ReportAllocs()
				for b.Loop() {
					Reduce(typ, Sum, dst, src)
				}
			})
		}
		b.Run("f32-sum-plain-loop/"+sizeName(size), func(b *testing.B) {
			d, s := FromBytes[float32](dst), FromBytes[float32](src)
			b.SetBytes(int64(size))
			for b.Loop() {
				for i := range d {
					d[i] += s[i]
				}
			}
		})
	}
}

func BenchmarkConvert(b *testing.B) {
	n := 1 << 18
	src := make([]float32, n)
	for i := range src {
		src[i] = float32(i) * 0.001
	}
	bf := make([]BFloat16, n)
	back := make([]float32, n)
	b.Run("f32-to-bf16", func(b *testing.B) {
		b.SetBytes(int64(4 * n))
		for b.Loop() {
			F32ToBF16(bf, src)
		}
	})
	b.Run("bf16-to-f32", func(b *testing.B) {
		b.SetBytes(int64(4 * n))
		for b.Loop() {
			BF16ToF32(back, bf)
		}
	})
	b.Run("copy-f32", func(b *testing.B) {
		b.SetBytes(int64(4 * n))
		for b.Loop() {
			copy(back, src)
		}
	})
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return "1MiB"
	}
	return "64KiB"
}

// The vector kernels agree with the scalar conversion on every bf16 pattern and on
// random, special and boundary float32 inputs, at every length and alignment.
func TestBF16SliceKernels(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	specials := []float32{0, float32(math.Copysign(0, -1)), 1, -1, float32(math.Inf(1)), float32(math.Inf(-1)),
		float32(math.NaN()), math.Float32frombits(0x7f800001), math.Float32frombits(0xffc00001),
		math.Float32frombits(0x3f808000), math.Float32frombits(0x3f818000), math.Float32frombits(0x7f7fffff)}
	for n := 0; n < 70; n++ {
		for off := 0; off < 3; off++ {
			src := make([]float32, n+off)
			for i := range src {
				if rng.IntN(4) == 0 {
					src[i] = specials[rng.IntN(len(specials))]
				} else {
					src[i] = math.Float32frombits(rng.Uint32())
				}
			}
			s := src[off:]
			got := make([]BFloat16, len(s))
			F32ToBF16(got, s)
			for i, f := range s {
				if got[i] != ToBF16(f) {
					t.Fatalf("n=%d off=%d [%d]: %#08x -> %#04x, want %#04x", n, off, i, math.Float32bits(f), got[i], ToBF16(f))
				}
			}
			back := make([]float32, len(s))
			BF16ToF32(back, got)
			for i := range got {
				if math.Float32bits(back[i]) != math.Float32bits(got[i].Float32()) {
					t.Fatalf("n=%d [%d]: back %#08x", n, i, math.Float32bits(back[i]))
				}
			}
		}
	}
	all := make([]BFloat16, 1<<16)
	for i := range all {
		all[i] = BFloat16(i)
	}
	f := make([]float32, len(all))
	BF16ToF32(f, all)
	for i := range all {
		if math.Float32bits(f[i]) != uint32(i)<<16 {
			t.Fatalf("%#04x", i)
		}
	}
}

func TestBF16SumKernelMatchesScalar(t *testing.T) {
	rng := rand.New(rand.NewPCG(8, 9))
	for n := 0; n < 100; n++ {
		a, b := make([]BFloat16, n), make([]BFloat16, n)
		for i := range a {
			a[i], b[i] = BFloat16(rng.Uint32()), BFloat16(rng.Uint32())
		}
		want := make([]BFloat16, n)
		for i := range want {
			want[i] = ToBF16(a[i].Float32() + b[i].Float32())
		}
		Reduce(BF16, Sum, Bytes(a), Bytes(b))
		for i := range a {
			if a[i] != want[i] && !(math.IsNaN(float64(a[i].Float32())) && math.IsNaN(float64(want[i].Float32()))) {
				t.Fatalf("n=%d [%d]: %#04x want %#04x", n, i, a[i], want[i])
			}
		}
	}
}
