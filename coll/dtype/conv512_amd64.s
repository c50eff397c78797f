#include "textflag.h"
#include "bf16_amd64.h"

// The bfloat16 kernels with AVX-512 and its BF16 extension. VCVTNE2PS2BF16 rounds to
// nearest even and quiets NaNs as F32ToBF16 does, but takes subnormal inputs as zeros:
// 32 values that hold a subnormal go through BF16_STORE512 instead, which rounds them.

// CVT2BF16 is VCVTNE2PS2BF16 Z0, Z1, Z2 (Intel order: zmm2, zmm1, zmm0), which Go's
// assembler does not know: Z2's low 16 words are Z0's float32s as bfloat16s, its high
// 16 Z1's. The bytes are those binutils gives.
#define CVT2BF16 \
	BYTE $0x62; BYTE $0xf2; BYTE $0x77; BYTE $0x48; BYTE $0x72; BYTE $0xd0

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
