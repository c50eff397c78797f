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
	BF16_STORE32(cvtsub)

cvtnext:
	ADDQ $128, SI
	ADDQ $64, DI
	SUBQ $32, CX
	JNZ  cvt
	VZEROUPPER
	RET

cvtsub:
	BF16_ROUND32
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
	BF16_STORE32(addsub)

addnext:
	ADDQ $64, SI
	ADDQ $64, DI
	SUBQ $32, CX
	JNZ  add
	VZEROUPPER
	RET

addsub:
	BF16_ROUND32
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

// func amaxBlocksF32AVX512(src *float32, nblocks int, out *uint32)
// As amaxBlocksF32AVX2: out[b] = the float32 bits of the largest finite magnitude among
// the 128 float32 values of block b (0 where none is finite); nblocks > 0.
TEXT ·amaxBlocksF32AVX512(SB), NOSPLIT, $0-24
	MOVQ         src+0(FP), SI
	MOVQ         nblocks+8(FP), CX
	MOVQ         out+16(FP), DI
	MOVL         $0x7fffffff, AX
	VPBROADCASTD AX, Z14
	MOVL         $0x7f800000, AX
	VPBROADCASTD AX, Z13 // the bits of +Inf

mfb:
	VPXORD  Z8, Z8, Z8
	VPXORD  Z9, Z9, Z9
	VPANDD  (SI), Z14, Z0
	VPANDD  64(SI), Z14, Z1
	VPANDD  128(SI), Z14, Z2
	VPANDD  192(SI), Z14, Z3
	VPANDD  256(SI), Z14, Z4
	VPANDD  320(SI), Z14, Z5
	VPANDD  384(SI), Z14, Z6
	VPANDD  448(SI), Z14, Z7
	VPCMPUD $1, Z13, Z0, K1 // finite
	VPCMPUD $1, Z13, Z1, K2
	VPCMPUD $1, Z13, Z2, K3
	VPCMPUD $1, Z13, Z3, K4
	VPMAXUD Z0, Z8, K1, Z8
	VPMAXUD Z1, Z9, K2, Z9
	VPMAXUD Z2, Z8, K3, Z8
	VPMAXUD Z3, Z9, K4, Z9
	VPCMPUD $1, Z13, Z4, K1
	VPCMPUD $1, Z13, Z5, K2
	VPCMPUD $1, Z13, Z6, K3
	VPCMPUD $1, Z13, Z7, K4
	VPMAXUD Z4, Z8, K1, Z8
	VPMAXUD Z5, Z9, K2, Z9
	VPMAXUD Z6, Z8, K3, Z8
	VPMAXUD Z7, Z9, K4, Z9
	VPMAXUD Z9, Z8, Z8
	VEXTRACTI64X4 $1, Z8, Y1
	VPMAXUD Y1, Y8, Y8
	VEXTRACTI128 $1, Y8, X1
	VPMAXUD X1, X8, X8
	VPSHUFD $0x4e, X8, X1
	VPMAXUD X1, X8, X8
	VPSHUFD $0xb1, X8, X1
	VPMAXUD X1, X8, X8
	VMOVD   X8, AX
	MOVL    AX, (DI)
	ADDQ    $512, SI
	ADDQ    $4, DI
	DECQ    CX
	JNZ     mfb
	VZEROUPPER
	RET

// func fromI8BF16AVX512BF16(dst *uint16, src *byte, n int, scale float32)
// As fromI8BF16AVX512, rounding 32 values at a time with VCVTNE2PS2BF16 where none of
// the products is subnormal; n a positive multiple of 32.
TEXT ·fromI8BF16AVX512BF16(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         n+16(FP), CX
	VBROADCASTSS scale+24(FP), Z15
	BF16_SETUP512

ib:
	VPMOVSXBD   (SI), Z0
	VPMOVSXBD   16(SI), Z1
	VCVTDQ2PS   Z0, Z0
	VCVTDQ2PS   Z1, Z1
	VMULPS      Z15, Z0, Z0
	VMULPS      Z15, Z1, Z1
	BF16_STORE32(ibsub)

ibnext:
	ADDQ $32, SI
	ADDQ $64, DI
	SUBQ $32, CX
	JNZ  ib
	VZEROUPPER
	RET

ibsub:
	BF16_ROUND32
	JMP ibnext
