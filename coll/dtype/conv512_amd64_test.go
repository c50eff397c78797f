package dtype

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// The AVX-512 bfloat16 kernels round every float32 as ToBF16 does: each bfloat16 pattern
// with the low halves at and around its rounding boundaries (ties, NaN payloads,
// overflow to infinity, subnormals), in order (runs of 32 all subnormal or none) and
// shuffled (subnormals among normal values, taking the kernel's other path); and add
// every bfloat16 pattern to others, normal, subnormal and opposite, as the scalar sum.
func TestBF16KernelsAVX512(t *testing.T) {
	if !haveBF16 {
		t.Skip("this CPU has no AVX-512 BF16: F32ToBF16 and the bfloat16 sum run the AVX2 kernels, which TestBF16SliceKernels checks")
	}
	lows := []uint32{0, 1, 0x7fff, 0x8000, 0x8001, 0xffff}
	src := make([]float32, 0, len(lows)<<16)
	for h := uint32(0); h < 1<<16; h++ {
		for _, l := range lows {
			src = append(src, math.Float32frombits(h<<16|l))
		}
	}
	rng := rand.New(rand.NewPCG(21, 22))
	check := func(order string) {
		got := make([]BFloat16, len(src))
		F32ToBF16(got, src)
		for i, f := range src {
			require.Equal(t, ToBF16(f), got[i], "%s: float32 %#08x", order, math.Float32bits(f))
		}
	}
	check("in order")
	rng.Shuffle(len(src), func(i, j int) { src[i], src[j] = src[j], src[i] })
	check("shuffled")

	a := make([]BFloat16, 1<<16)
	for i := range a {
		a[i] = BFloat16(i)
	}
	others := map[string]func(BFloat16) BFloat16{
		"shuffled": nil,
		"negated":  func(x BFloat16) BFloat16 { return x ^ 0x8000 },
		"near":     func(x BFloat16) BFloat16 { return (x ^ 0x8000) + 1 }, // sums near zero: subnormal
		"tiny":     func(x BFloat16) BFloat16 { return x&0x807f | 1 },     // subnormal addends
	}
	for name, other := range others {
		b := make([]BFloat16, len(a))
		for i := range b {
			if other == nil {
				b[i] = BFloat16(rng.Uint32())
			} else {
				b[i] = other(a[i])
			}
		}
		d := append([]BFloat16(nil), a...)
		Reduce(BF16, Sum, Bytes(d), Bytes(b))
		for i := range d {
			want := ToBF16(a[i].Float32() + b[i].Float32())
			if math.IsNaN(float64(want.Float32())) {
				require.True(t, math.IsNaN(float64(d[i].Float32())), "%s: %#04x + %#04x = %#04x, want a NaN", name, a[i], b[i], d[i])
				continue
			}
			require.Equal(t, want, d[i], "%s: %#04x + %#04x", name, a[i], b[i])
		}
	}
}
