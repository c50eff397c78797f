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

var haveFMA = cpu.X86.HasAVX2 && cpu.X86.HasFMA

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
		if isF32[T]() {
			amaxBlocksF32AVX2(&asF32(src)[lo], n, &bits[0])
		} else {
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
		if isF32[T]() {
			toE4M3BlocksF32AVX2(&dst[lo], &asF32(src)[lo], n, &invs[0])
		} else {
			toE4M3BlocksBF16AVX2(&dst[lo], (*uint16)(unsafe.Pointer(&asBF16(src)[lo])), n, &invs[0])
		}
	}
	return nb
}
