#include "textflag.h"

// func f32ToBF16AVX2(dst *uint16, src *float32, n int)
// n is a positive multiple of 16. Round to nearest even; NaN -> quiet NaN (sign kept).
TEXT ·f32ToBF16AVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	VPCMPEQD  Y15, Y15, Y15 // 0xffffffff
	VPSRLD    $31, Y15, Y14 // 0x00000001
	VPSRLD    $17, Y15, Y13 // 0x00007fff
	VPSRLD    $1, Y15, Y12  // 0x7fffffff
	VPSLLD    $24, Y15, Y11
	VPSRLD    $1, Y11, Y11  // 0x7f800000
	VPSLLD    $6, Y14, Y10  // 0x00000040

loop:
	VMOVDQU   (SI), Y0
	VMOVDQU   32(SI), Y1

	VPSRLD    $16, Y0, Y2
	VPAND     Y14, Y2, Y3
	VPADDD    Y13, Y0, Y4
	VPADDD    Y3, Y4, Y4
	VPSRLD    $16, Y4, Y4
	VPAND     Y12, Y0, Y5
	VPCMPGTD  Y11, Y5, Y5
	VPOR      Y10, Y2, Y6
	VPBLENDVB Y5, Y6, Y4, Y4

	VPSRLD    $16, Y1, Y2
	VPAND     Y14, Y2, Y3
	VPADDD    Y13, Y1, Y7
	VPADDD    Y3, Y7, Y7
	VPSRLD    $16, Y7, Y7
	VPAND     Y12, Y1, Y5
	VPCMPGTD  Y11, Y5, Y5
	VPOR      Y10, Y2, Y6
	VPBLENDVB Y5, Y6, Y7, Y7

	VPACKUSDW Y7, Y4, Y8
	VPERMQ    $0xD8, Y8, Y8
	VMOVDQU   Y8, (DI)

	ADDQ $64, SI
	ADDQ $32, DI
	SUBQ $16, CX
	JNZ  loop
	VZEROUPPER
	RET

// func bf16ToF32AVX2(dst *float32, src *uint16, n int)
// n is a positive multiple of 16.
TEXT ·bf16ToF32AVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX

loop2:
	VPMOVZXWD (SI), Y0
	VPMOVZXWD 16(SI), Y1
	VPSLLD    $16, Y0, Y0
	VPSLLD    $16, Y1, Y1
	VMOVDQU   Y0, (DI)
	VMOVDQU   Y1, 32(DI)
	ADDQ $32, SI
	ADDQ $64, DI
	SUBQ $16, CX
	JNZ  loop2
	VZEROUPPER
	RET

// func bf16AddAVX2(dst, src *uint16, n int)
// dst[i] = bf16(f32(dst[i]) + f32(src[i])), n a positive multiple of 16.
TEXT ·bf16AddAVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	VPCMPEQD  Y15, Y15, Y15
	VPSRLD    $31, Y15, Y14 // 1
	VPSRLD    $17, Y15, Y13 // 0x7fff
	VPSRLD    $1, Y15, Y12  // 0x7fffffff
	VPSLLD    $24, Y15, Y11
	VPSRLD    $1, Y11, Y11  // 0x7f800000
	VPSLLD    $6, Y14, Y10  // 0x40

loop3:
	VPMOVZXWD (DI), Y0
	VPMOVZXWD 16(DI), Y1
	VPMOVZXWD (SI), Y2
	VPMOVZXWD 16(SI), Y3
	VPSLLD    $16, Y0, Y0
	VPSLLD    $16, Y1, Y1
	VPSLLD    $16, Y2, Y2
	VPSLLD    $16, Y3, Y3
	VADDPS    Y2, Y0, Y0
	VADDPS    Y3, Y1, Y1

	VPSRLD    $16, Y0, Y2
	VPAND     Y14, Y2, Y3
	VPADDD    Y13, Y0, Y4
	VPADDD    Y3, Y4, Y4
	VPSRLD    $16, Y4, Y4
	VPAND     Y12, Y0, Y5
	VPCMPGTD  Y11, Y5, Y5
	VPOR      Y10, Y2, Y6
	VPBLENDVB Y5, Y6, Y4, Y4

	VPSRLD    $16, Y1, Y2
	VPAND     Y14, Y2, Y3
	VPADDD    Y13, Y1, Y7
	VPADDD    Y3, Y7, Y7
	VPSRLD    $16, Y7, Y7
	VPAND     Y12, Y1, Y5
	VPCMPGTD  Y11, Y5, Y5
	VPOR      Y10, Y2, Y6
	VPBLENDVB Y5, Y6, Y7, Y7

	VPACKUSDW Y7, Y4, Y8
	VPERMQ    $0xD8, Y8, Y8
	VMOVDQU   Y8, (DI)

	ADDQ $32, SI
	ADDQ $32, DI
	SUBQ $16, CX
	JNZ  loop3
	VZEROUPPER
	RET
