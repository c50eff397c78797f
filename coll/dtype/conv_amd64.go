package dtype

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

//go:noescape
func f32ToBF16AVX2(dst *uint16, src *float32, n int)

//go:noescape
func bf16ToF32AVX2(dst *float32, src *uint16, n int)

var haveAVX2 = cpu.X86.HasAVX2

//go:noescape
func f32ToBF16AVX512(dst *uint16, src *float32, n int)

//go:noescape
func bf16AddAVX512(dst, src *uint16, n int)

// haveBF16 selects the AVX-512 bfloat16 kernels, which round with VCVTNE2PS2BF16.
var haveBF16 = cpu.X86.HasAVX512F && cpu.X86.HasAVX512BW && cpu.X86.HasAVX512DQ && cpu.X86.HasAVX512BF16

// f32ToBF16Fast converts the longest prefix it can with AVX-512 or AVX2 and returns its
// length.
func f32ToBF16Fast(dst []BFloat16, src []float32) int {
	if n := len(src) &^ 31; haveBF16 && n > 0 {
		f32ToBF16AVX512((*uint16)(unsafe.Pointer(&dst[0])), &src[0], n)
		return n
	}
	n := len(src) &^ 15
	if !haveAVX2 || n == 0 {
		return 0
	}
	f32ToBF16AVX2((*uint16)(unsafe.Pointer(&dst[0])), &src[0], n)
	return n
}

func bf16ToF32Fast(dst []float32, src []BFloat16) int {
	n := len(src) &^ 15
	if !haveAVX2 || n == 0 {
		return 0
	}
	bf16ToF32AVX2(&dst[0], (*uint16)(unsafe.Pointer(&src[0])), n)
	return n
}

//go:noescape
func bf16AddAVX2(dst, src *uint16, n int)

// bf16SumFast adds the longest prefix it can with AVX-512 or AVX2 and returns its
// length.
func bf16SumFast(d, s []BFloat16) int {
	if n := len(d) &^ 31; haveBF16 && n > 0 {
		bf16AddAVX512((*uint16)(unsafe.Pointer(&d[0])), (*uint16)(unsafe.Pointer(&s[0])), n)
		return n
	}
	n := len(d) &^ 15
	if !haveAVX2 || n == 0 {
		return 0
	}
	bf16AddAVX2((*uint16)(unsafe.Pointer(&d[0])), (*uint16)(unsafe.Pointer(&s[0])), n)
	return n
}
