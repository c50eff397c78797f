package dtype

import (
	"math"
	"unsafe"

	"golang.org/x/sys/cpu"
)

//go:noescape
func axpyF32AVX2(dst *float32, a float32, x *float32, n int)

//go:noescape
func axpyBF16AVX2(dst *float32, a float32, x *uint16, n int)

//go:noescape
func scaleF32AVX2(dst *float32, a float32, x *float32, n int)

//go:noescape
func scaleBF16AVX2(dst *float32, a float32, x *uint16, n int)

//go:noescape
func amaxAVX2(src *float32, n int) (fin, all uint32)

//go:noescape
func toE4M3AVX2(dst *byte, src *float32, n int, inv float32)

//go:noescape
func amaxBlocksBF16AVX2(src *uint16, nblocks int, out *uint32)

//go:noescape
func amaxBlocksF32AVX2(src *float32, nblocks int, out *uint32)

//go:noescape
func toE4M3BlocksBF16AVX2(dst *byte, src *uint16, nblocks int, invs *float32)

//go:noescape
func toE4M3BlocksF32AVX2(dst *byte, src *float32, nblocks int, invs *float32)

//go:noescape
func fromE4M3AVX2(dst *float32, src *byte, n int, scale float32)

//go:noescape
func toI8AVX2(dst *byte, src *float32, n int, inv float32)

//go:noescape
func fromI8AVX2(dst *float32, src *byte, n int, scale float32)

//go:noescape
func sumBF16AVX2(dst *float32, rows **uint16, w *float32, k int, n int, add int)

//go:noescape
func sumBF16AVX512(dst *float32, rows **uint16, w *float32, k int, n int, add int)

//go:noescape
func sumF32AVX512(dst *float32, rows **float32, w *float32, k int, n int, add int)

//go:noescape
func sumF32AVX2(dst *float32, rows **float32, w *float32, k int, n int, add int)

var haveFMA = cpu.X86.HasAVX2 && cpu.X86.HasFMA

// weightedSumFast does WeightedSum's longest prefix of a multiple of 32 values, at most
// 16 rows at a time (64 values at a time with AVX-512), and returns its length.
func weightedSumFast[T Activation](dst []float32, w []float32, rows [][]T, add bool) int {
	n := len(dst) &^ 31
	if !haveFMA || n == 0 || len(rows) == 0 {
		return 0
	}
	var ptrs [16]unsafe.Pointer
	for g := 0; g < len(rows); g += len(ptrs) {
		k := min(len(rows)-g, len(ptrs))
		for j := 0; j < k; j++ {
			ptrs[j] = unsafe.Pointer(&rows[g+j][:n][0])
		}
		a := 0
		if add || g > 0 {
			a = 1
		}
		n64 := 0 // the prefix the AVX-512 kernels take, 64 values at a time
		if haveAVX512 {
			n64 = n &^ 63
		}
		if n64 > 0 {
			if isBF16[T]() {
				sumBF16AVX512(&dst[0], (**uint16)(unsafe.Pointer(&ptrs[0])), &w[g], k, n64, a)
			} else {
				sumF32AVX512(&dst[0], (**float32)(unsafe.Pointer(&ptrs[0])), &w[g], k, n64, a)
			}
			if n == n64 {
				continue
			}
			for j := 0; j < k; j++ {
				ptrs[j] = unsafe.Pointer(&rows[g+j][n64])
			}
		}
		if isBF16[T]() {
			sumBF16AVX2(&dst[n64], (**uint16)(unsafe.Pointer(&ptrs[0])), &w[g], k, n-n64, a)
		} else {
			sumF32AVX2(&dst[n64], (**float32)(unsafe.Pointer(&ptrs[0])), &w[g], k, n-n64, a)
		}
	}
	return n
}

// The fast paths do the longest prefix they can and return its length (0 where the CPU
// lacks AVX2 and FMA).

func axpyF32Fast(dst []float32, a float32, x []float32) int {
	n := len(x) &^ 15
	if !haveFMA || n == 0 {
		return 0
	}
	axpyF32AVX2(&dst[0], a, &x[0], n)
	return n
}

func axpyBF16Fast(dst []float32, a float32, x []BFloat16) int {
	n := len(x) &^ 15
	if !haveFMA || n == 0 {
		return 0
	}
	axpyBF16AVX2(&dst[0], a, (*uint16)(unsafe.Pointer(&x[0])), n)
	return n
}

func scaleF32Fast(dst []float32, a float32, x []float32) int {
	n := len(x) &^ 15
	if !haveFMA || n == 0 {
		return 0
	}
	scaleF32AVX2(&dst[0], a, &x[0], n)
	return n
}

func scaleBF16Fast(dst []float32, a float32, x []BFloat16) int {
	n := len(x) &^ 15
	if !haveFMA || n == 0 {
		return 0
	}
	scaleBF16AVX2(&dst[0], a, (*uint16)(unsafe.Pointer(&x[0])), n)
	return n
}

func amaxFast(src []float32) (n int, fin, all uint32) {
	n = len(src) &^ 7
	if !haveFMA || n == 0 {
		return 0, 0, 0
	}
	fin, all = amaxAVX2(&src[0], n)
	return n, fin, all
}

func toE4M3Fast(dst []byte, x []float32, inv float32) int {
	n := len(x) &^ 7
	if !haveFMA || n == 0 {
		return 0
	}
	toE4M3AVX2(&dst[0], &x[0], n, inv)
	return n
}

func fromE4M3Fast(dst []float32, src []byte, scale float32) int {
	n := len(src) &^ 7
	if !haveFMA || n == 0 {
		return 0
	}
	fromE4M3AVX2(&dst[0], &src[0], n, scale)
	return n
}

func toI8Fast(dst []byte, x []float32, inv float32) int {
	n := len(x) &^ 7
	if !haveFMA || n == 0 {
		return 0
	}
	toI8AVX2(&dst[0], &x[0], n, inv)
	return n
}

func fromI8Fast(dst []float32, src []byte, scale float32) int {
	n := len(src) &^ 7
	if !haveFMA || n == 0 {
		return 0
	}
	fromI8AVX2(&dst[0], &src[0], n, scale)
	return n
}

// quantizeFP8Fast quantises the whole blocks of src as QuantizeFP8 does, a run of blocks
// per call into the kernels (the largest finite magnitude of each, then the codes), and
// returns how many blocks it did.
func quantizeFP8Fast[T Activation](dst []byte, scales []float32, src []T, pow2 bool) int {
	nb := len(src) / FP8Block
	if !haveFMA || nb == 0 {
		return 0
	}
	const run = 64
	var bits [run]uint32
	var invs [run]float32
	for b := 0; b < nb; b += run {
		n := min(run, nb-b)
		lo := b * FP8Block
		switch {
		case isF32[T]() && haveAVX512:
			amaxBlocksF32AVX512(&asF32(src)[lo], n, &bits[0])
		case isF32[T]():
			amaxBlocksF32AVX2(&asF32(src)[lo], n, &bits[0])
		case haveAVX512:
			amaxBlocksBF16AVX512((*uint16)(unsafe.Pointer(&asBF16(src)[lo])), n, &bits[0])
		default:
			amaxBlocksBF16AVX2((*uint16)(unsafe.Pointer(&asBF16(src)[lo])), n, &bits[0])
		}
		for i := 0; i < n; i++ {
			sc := fp8Scale(math.Float32frombits(bits[i]), pow2)
			scales[b+i] = sc
			invs[i] = 0
			if sc > 0 {
				invs[i] = 1 / sc
			}
		}
		switch {
		case isF32[T]() && haveAVX512:
			toE4M3BlocksF32AVX512(&dst[lo], &asF32(src)[lo], n, &invs[0])
		case isF32[T]():
			toE4M3BlocksF32AVX2(&dst[lo], &asF32(src)[lo], n, &invs[0])
		case haveAVX512:
			toE4M3BlocksBF16AVX512(&dst[lo], (*uint16)(unsafe.Pointer(&asBF16(src)[lo])), n, &invs[0])
		default:
			toE4M3BlocksBF16AVX2(&dst[lo], (*uint16)(unsafe.Pointer(&asBF16(src)[lo])), n, &invs[0])
		}
		for i := 0; i < n; i++ {
			if invs[i] == 0 { // no finite non-zero value: codes 0, infinities too
				clear(dst[lo+i*FP8Block : lo+(i+1)*FP8Block])
			}
		}
	}
	return nb
}

//go:noescape
func amaxBlocksBF16AVX512(src *uint16, nblocks int, out *uint32)

//go:noescape
func toE4M3BlocksBF16AVX512(dst *byte, src *uint16, nblocks int, invs *float32)

//go:noescape
func amaxBlocksF32AVX512(src *float32, nblocks int, out *uint32)

//go:noescape
func toE4M3BlocksF32AVX512(dst *byte, src *float32, nblocks int, invs *float32)

// haveAVX512 selects the AVX-512 FP8 block kernels (16 values per instruction where the
// AVX2 ones take 8; the same bytes).
var haveAVX512 = haveFMA && cpu.X86.HasAVX512F && cpu.X86.HasAVX512BW && cpu.X86.HasAVX512DQ

//go:noescape
func fromE4M3BlocksF32AVX512(dst *float32, src *byte, nblocks int, scales *float32)

//go:noescape
func fromE4M3BlocksBF16AVX512(dst *uint16, src *byte, nblocks int, scales *float32, cvt int)

// dequantizeFP8Fast dequantises the whole blocks of src as DequantizeFP8 does, and
// returns how many blocks it did (none unless the CPU has AVX-512).
func dequantizeFP8Fast[T Activation](dst []T, src []byte, scales []float32) int {
	nb := len(src) / FP8Block
	if !haveAVX512 || nb == 0 {
		return 0
	}
	if isF32[T]() {
		fromE4M3BlocksF32AVX512(&asF32(dst)[0], &src[0], nb, &scales[0])
		return nb
	}
	cvt := 0
	if haveBF16 {
		cvt = 1
	}
	fromE4M3BlocksBF16AVX512((*uint16)(unsafe.Pointer(&asBF16(dst)[0])), &src[0], nb, &scales[0], cvt)
	return nb
}

//go:noescape
func amaxBF16AVX512(src *uint16, n int) (fin, all uint32)

//go:noescape
func toI8BF16AVX512(dst *byte, src *uint16, n int, inv float32)

//go:noescape
func fromI8BF16AVX512(dst *uint16, src *byte, n int, scale float32)

//go:noescape
func fromI8BF16AVX512BF16(dst *uint16, src *byte, n int, scale float32)

// quantizeI8Fast is QuantizeI8 for bfloat16 rows with AVX-512, on the longest prefix of
// a multiple of 32 values; ok is false (nothing done) for other rows or CPUs. With a NaN
// in the row, or no finite non-zero value, it returns the scale (NaN, 0) and leaves dst
// to the caller.
func quantizeI8Fast[T Activation](dst []byte, src []T) (s float32, ok bool) {
	n := len(src) &^ 31
	if !haveAVX512 || isF32[T]() || n == 0 {
		return 0, false
	}
	b := (*uint16)(unsafe.Pointer(&asBF16(src)[0]))
	fin, all := amaxBF16AVX512(b, n)
	var tail block
	m, nan := amax(f32s(src[n:], &tail))
	if nan || all > 0x7f800000 {
		return float32(math.NaN()), true
	}
	m = max(m, math.Float32frombits(fin))
	s = m / I8Max
	if s == 0 {
		return 0, true // the caller clears dst
	}
	inv := 1 / s
	toI8BF16AVX512(&dst[0], b, n, inv)
	toI8(dst[n:], f32s(src[n:], &tail), inv)
	return s, true
}

// dequantizeI8Fast is DequantizeI8 into bfloat16s with AVX-512, on the longest prefix of
// a multiple of 16 values, whose length it returns (0 for other types or CPUs).
func dequantizeI8Fast[T Activation](dst []T, src []byte, scale float32) int {
	n := len(src) &^ 15
	if !haveAVX512 || isF32[T]() || n == 0 {
		return 0
	}
	n32 := 0 // the prefix the AVX-512 BF16 kernel takes, 32 values at a time
	if haveBF16 {
		n32 = n &^ 31
	}
	if n32 > 0 {
		fromI8BF16AVX512BF16((*uint16)(unsafe.Pointer(&asBF16(dst)[0])), &src[0], n32, scale)
	}
	if n > n32 {
		fromI8BF16AVX512((*uint16)(unsafe.Pointer(&asBF16(dst)[n32])), &src[n32], n-n32, scale)
	}
	return n
}

// Kernels names the vector kernels the conversions, quantisation and weighted sums run
// on this CPU: "avx512-bf16" (as "avx512", and the float32-to-bfloat16 conversion and
// the bfloat16 sum with AVX-512 BF16), "avx512" (the FP8 and int8 kernels and the
// weighted sums with AVX-512, the others with AVX2), "avx2", or "portable" (Go loops).
func Kernels() string {
	switch {
	case haveAVX512 && haveBF16:
		return "avx512-bf16"
	case haveAVX512:
		return "avx512"
	case haveFMA:
		return "avx2"
	}
	return "portable"
}
