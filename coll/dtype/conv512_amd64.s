#include "textflag.h"
#include "bf16_amd64.h"

// The bfloat16 kernels with AVX-512: the conversion from float32 and the sum with its
// BF16 extension, the weighted sum of rows without. VCVTNE2PS2BF16 rounds to nearest
// even and quiets NaNs as F32ToBF16 does, but takes subnormal inputs as zeros: 32 values
// that hold a subnormal go through BF16_STORE512 instead, which rounds them.

// func f32ToBF16AVX512(dst *uint16, src *float32, n int)
// n is a positive multiple of 32.
TEXT ·f32ToBF16AVX512(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	BF16_SETUP512

cvt:
	VMOVUPS        (SI), Z0
	VMOVUPS        64(SI), Z1
	VFPCLASSPSZ    $0x20, Z0, K1 // subnormal
	VFPCLASSPSZ    $0x20, Z1, K2
	KORTESTW       K2, K1
	JNE            cvtsub
	CVT2BF16
	VMOVDQU16      Z2, (DI)

cvtnext:
	ADDQ $128, SI
	ADDQ $64, DI
	SUBQ $32, CX
	JNZ  cvt
	VZEROUPPER
	RET

cvtsub:
	BF16_STORE512(Z0, (DI))
	BF16_STORE512(Z1, 32(DI))
	JMP cvtnext

// func bf16AddAVX512(dst, src *uint16, n int)
// dst[i] = bf16(f32(dst[i]) + f32(src[i])), n a positive multiple of 32.
TEXT ·bf16AddAVX512(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	BF16_SETUP512

add:
	VPMOVZXWD      (DI), Z0
	VPMOVZXWD      32(DI), Z1
	VPMOVZXWD      (SI), Z9
	VPMOVZXWD      32(SI), Z10
	VPSLLD         $16, Z0, Z0
	VPSLLD         $16, Z1, Z1
	VPSLLD         $16, Z9, Z9
	VPSLLD         $16, Z10, Z10
	VADDPS         Z9, Z0, Z0
	VADDPS         Z10, Z1, Z1
	VFPCLASSPSZ    $0x20, Z0, K1
	VFPCLASSPSZ    $0x20, Z1, K2
	KORTESTW       K2, K1
	JNE            addsub
	CVT2BF16
	VMOVDQU16      Z2, (DI)

addnext:
	ADDQ $64, SI
	ADDQ $64, DI
	SUBQ $32, CX
	JNZ  add
	VZEROUPPER
	RET

addsub:
	BF16_STORE512(Z0, (DI))
	BF16_STORE512(Z1, 32(DI))
	JMP addnext

// func sumBF16AVX512(dst *float32, rows **uint16, w *float32, k int, n int, add int)
// As sumBF16AVX2, 64 values per chunk: dst[i] = sum over j < k of w[j]*float32(rows[j][i]),
// added in order to dst[i] (add != 0) or starting from the first product; n a positive
// multiple of 64, k at least 1.
TEXT ·sumBF16AVX512(SB), NOSPLIT, $0-48
	MOVQ dst+0(FP), DI
	MOVQ rows+8(FP), R8
	MOVQ w+16(FP), R9
	MOVQ k+24(FP), R10
	MOVQ n+32(FP), CX
	MOVQ add+40(FP), R11
	XORQ SI, SI // byte offset in the rows

wchunk:
	TESTQ R11, R11
	JNZ   wadd
	MOVQ         (R8), AX
	VBROADCASTSS (R9), Z15
	VPMOVZXWD    (AX)(SI*1), Z0
	VPMOVZXWD    32(AX)(SI*1), Z1
	VPMOVZXWD    64(AX)(SI*1), Z2
	VPMOVZXWD    96(AX)(SI*1), Z3
	VPSLLD       $16, Z0, Z0
	VPSLLD       $16, Z1, Z1
	VPSLLD       $16, Z2, Z2
	VPSLLD       $16, Z3, Z3
	VMULPS       Z15, Z0, Z0
	VMULPS       Z15, Z1, Z1
	VMULPS       Z15, Z2, Z2
	VMULPS       Z15, Z3, Z3
	MOVQ         $1, DX
	JMP          wrows

wadd:
	VMOVUPS (DI), Z0
	VMOVUPS 64(DI), Z1
	VMOVUPS 128(DI), Z2
	VMOVUPS 192(DI), Z3
	XORQ    DX, DX

wrows:
	CMPQ         DX, R10
	JGE          wstore
	MOVQ         (R8)(DX*8), AX
	VBROADCASTSS (R9)(DX*4), Z15
	VPMOVZXWD    (AX)(SI*1), Z4
	VPMOVZXWD    32(AX)(SI*1), Z5
	VPMOVZXWD    64(AX)(SI*1), Z6
	VPMOVZXWD    96(AX)(SI*1), Z7
	VPSLLD       $16, Z4, Z4
	VPSLLD       $16, Z5, Z5
	VPSLLD       $16, Z6, Z6
	VPSLLD       $16, Z7, Z7
	VFMADD231PS  Z15, Z4, Z0 // Z0 += Z4*Z15
	VFMADD231PS  Z15, Z5, Z1
	VFMADD231PS  Z15, Z6, Z2
	VFMADD231PS  Z15, Z7, Z3
	INCQ         DX
	JMP          wrows

wstore:
	VMOVUPS Z0, (DI)
	VMOVUPS Z1, 64(DI)
	VMOVUPS Z2, 128(DI)
	VMOVUPS Z3, 192(DI)
	ADDQ    $128, SI
	ADDQ    $256, DI
	SUBQ    $64, CX
	JNZ     wchunk
	VZEROUPPER
	RET

// func sumF32AVX512(dst *float32, rows **float32, w *float32, k int, n int, add int)
// sumBF16AVX512 with float32 rows; n a positive multiple of 64, k at least 1.
TEXT ·sumF32AVX512(SB), NOSPLIT, $0-48
	MOVQ dst+0(FP), DI
	MOVQ rows+8(FP), R8
	MOVQ w+16(FP), R9
	MOVQ k+24(FP), R10
	MOVQ n+32(FP), CX
	MOVQ add+40(FP), R11
	XORQ SI, SI // byte offset in the rows

fchunk:
	TESTQ R11, R11
	JNZ   fadd
	MOVQ         (R8), AX
	VBROADCASTSS (R9), Z15
	VMULPS       (AX)(SI*1), Z15, Z0
	VMULPS       64(AX)(SI*1), Z15, Z1
	VMULPS       128(AX)(SI*1), Z15, Z2
	VMULPS       192(AX)(SI*1), Z15, Z3
	MOVQ         $1, DX
	JMP          frows

fadd:
	VMOVUPS (DI), Z0
	VMOVUPS 64(DI), Z1
	VMOVUPS 128(DI), Z2
	VMOVUPS 192(DI), Z3
	XORQ    DX, DX

frows:
	CMPQ         DX, R10
	JGE          fstore
	MOVQ         (R8)(DX*8), AX
	VBROADCASTSS (R9)(DX*4), Z15
	VFMADD231PS  (AX)(SI*1), Z15, Z0 // Z0 += row*Z15
	VFMADD231PS  64(AX)(SI*1), Z15, Z1
	VFMADD231PS  128(AX)(SI*1), Z15, Z2
	VFMADD231PS  192(AX)(SI*1), Z15, Z3
	INCQ         DX
	JMP          frows

fstore:
	VMOVUPS Z0, (DI)
	VMOVUPS Z1, 64(DI)
	VMOVUPS Z2, 128(DI)
	VMOVUPS Z3, 192(DI)
	ADDQ    $256, SI
	ADDQ    $256, DI
	SUBQ    $64, CX
	JNZ     fchunk
	VZEROUPPER
	RET
