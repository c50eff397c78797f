#include "textflag.h"

// The FP8 block kernels with AVX-512 (F and BW): 16 values per vector where the AVX2
// kernels of quant_amd64.s take 8, the same arithmetic and so the same bytes.

// E4M3_SETUP512 loads the constants E4M3_512 uses: Z13 0x7fffffff, Z12 1, Z11 0x7ffff,
// Z10 120<<3, Z9 the bits of 2^-6, Z8 of 448, Z7 of +Inf, Z6 512.0, Z5 2^23.
#define E4M3_SETUP512 \
	VPTERNLOGD   $0xff, Z13, Z13, Z13; \
	VPSRLD       $31, Z13, Z12; \
	VPSRLD       $1, Z13, Z13; \
	MOVL         $0x7ffff, AX; \
	VPBROADCASTD AX, Z11; \
	MOVL         $960, AX; \
	VPBROADCASTD AX, Z10; \
	MOVL         $0x3c800000, AX; \
	VPBROADCASTD AX, Z9; \
	MOVL         $0x43e00000, AX; \
	VPBROADCASTD AX, Z8; \
	MOVL         $0x7f800000, AX; \
	VPBROADCASTD AX, Z7; \
	MOVL         $0x44000000, AX; \
	VPBROADCASTD AX, Z6; \
	MOVL         $0x4b000000, AX; \
	VPBROADCASTD AX, Z5

// E4M3_512(off) stores at off(DI) the 16 E4M3 codes of the float32s in Z0 multiplied by
// Z15, as toE4M3AVX2 computes them: the sign; magnitudes clamped to 448; the normal
// rounding, or below 2^-6 the subnormal one by the float adder; 1 more where NaN. Z0, Z1,
// Z2, Z4, K1 and K2 are scratch.
#define E4M3_512(off) \
	VMULPS    Z15, Z0, Z0; \
	VPSRLD    $31, Z0, Z1; \
	VPSLLD    $7, Z1, Z1; \
	VPANDD    Z13, Z0, Z0; \
	VPCMPUD   $6, Z7, Z0, K1; \
	VPMINUD   Z8, Z0, Z0; \
	VPSRLD    $20, Z0, Z2; \
	VPANDD    Z12, Z2, Z2; \
	VPADDD    Z2, Z0, Z2; \
	VPADDD    Z11, Z2, Z2; \
	VPSRLD    $20, Z2, Z2; \
	VPSUBD    Z10, Z2, Z2; \
	VPCMPUD   $1, Z9, Z0, K2; \
	VMULPS    Z6, Z0, Z4; \
	VADDPS    Z5, Z4, Z4; \
	VPSUBD    Z5, Z4, Z4; \
	VMOVDQA32 Z4, K2, Z2; \
	VPORD     Z1, Z2, Z2; \
	VPORD     Z12, Z2, K1, Z2; \
	VPMOVDB   Z2, off(DI)

// BF16_LOAD512(addr) widens the 16 bfloat16s at addr into the float32s of Z0.
#define BF16_LOAD512(addr) \
	VPMOVZXWD addr, Z0; \
	VPSLLD    $16, Z0, Z0

// BF16_SETUP512 loads the constants BF16_STORE512 uses: Z8 1, Z7 0x7fff, Z6 0x7fffffff,
// Z16 the bits of +Inf, Z17 0x40.
#define BF16_SETUP512 \
	MOVL         $1, AX; \
	VPBROADCASTD AX, Z8; \
	MOVL         $0x7fff, AX; \
	VPBROADCASTD AX, Z7; \
	MOVL         $0x7fffffff, AX; \
	VPBROADCASTD AX, Z6; \
	MOVL         $0x7f800000, AX; \
	VPBROADCASTD AX, Z16; \
	MOVL         $0x40, AX; \
	VPBROADCASTD AX, Z17

// BF16_STORE512 stores at (DI) the 16 float32s of Z2 as bfloat16s, rounded to nearest
// even as F32ToBF16 rounds (a NaN keeps its high half, made quiet). Z3, Z4, Z5 and K3 are
// scratch.
#define BF16_STORE512 \
	VPSRLD  $16, Z2, Z3; \
	VPANDD  Z8, Z3, Z4; \
	VPADDD  Z7, Z2, Z5; \
	VPADDD  Z4, Z5, Z5; \
	VPSRLD  $16, Z5, Z5; \
	VPANDD  Z6, Z2, Z4; \
	VPCMPUD $6, Z16, Z4, K3; \
	VPORD   Z17, Z3, K3, Z5; \
	VPMOVDW Z5, (DI)

// func toE4M3BlocksBF16AVX512(dst *byte, src *uint16, nblocks int, invs *float32)
// Block b of 128 bfloat16 values, multiplied by invs[b], as E4M3 bytes.
TEXT ·toE4M3BlocksBF16AVX512(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ nblocks+16(FP), CX
	MOVQ invs+24(FP), R8
	E4M3_SETUP512

xbb:
	VBROADCASTSS (R8), Z15
	ADDQ         $4, R8
	MOVQ         $2, DX

xbi:
	BF16_LOAD512((SI))
	E4M3_512(0)
	BF16_LOAD512(32(SI))
	E4M3_512(16)
	BF16_LOAD512(64(SI))
	E4M3_512(32)
	BF16_LOAD512(96(SI))
	E4M3_512(48)
	ADDQ      $128, SI
	ADDQ      $64, DI
	DECQ      DX
	JNZ       xbi
	DECQ      CX
	JNZ       xbb
	VZEROUPPER
	RET

// func toE4M3BlocksF32AVX512(dst *byte, src *float32, nblocks int, invs *float32)
// Block b of 128 float32 values, multiplied by invs[b], as E4M3 bytes.
TEXT ·toE4M3BlocksF32AVX512(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ nblocks+16(FP), CX
	MOVQ invs+24(FP), R8
	E4M3_SETUP512

xfb:
	VBROADCASTSS (R8), Z15
	ADDQ         $4, R8
	MOVQ         $2, DX

xfi:
	VMOVUPS (SI), Z0
	E4M3_512(0)
	VMOVUPS 64(SI), Z0
	E4M3_512(16)
	VMOVUPS 128(SI), Z0
	E4M3_512(32)
	VMOVUPS 192(SI), Z0
	E4M3_512(48)
	ADDQ    $256, SI
	ADDQ    $64, DI
	DECQ    DX
	JNZ     xfi
	DECQ    CX
	JNZ     xfb
	VZEROUPPER
	RET

// func amaxBlocksBF16AVX512(src *uint16, nblocks int, out *uint32)
// As amaxBlocksBF16AVX2: out[b] = the float32 bits of the largest finite magnitude among
// the 128 bfloat16 values of block b; nblocks > 0.
TEXT ·amaxBlocksBF16AVX512(SB), NOSPLIT, $0-24
	MOVQ         src+0(FP), SI
	MOVQ         nblocks+8(FP), CX
	MOVQ         out+16(FP), DI
	MOVL         $0x7fff, AX
	VPBROADCASTW AX, Z14
	MOVL         $0x7f80, AX
	VPBROADCASTW AX, Z13 // the bits of +Inf

ybb:
	VPANDD       (SI), Z14, Z0
	VPANDD       64(SI), Z14, Z1
	VPANDD       128(SI), Z14, Z2
	VPANDD       192(SI), Z14, Z3
	VPCMPUW      $1, Z13, Z0, K1 // finite
	VPCMPUW      $1, Z13, Z1, K2
	VPCMPUW      $1, Z13, Z2, K3
	VPCMPUW      $1, Z13, Z3, K4
	VMOVDQU16.Z  Z0, K1, Z0 // zero where not finite
	VMOVDQU16.Z  Z1, K2, Z1
	VMOVDQU16.Z  Z2, K3, Z2
	VMOVDQU16.Z  Z3, K4, Z3
	VPMAXUW      Z1, Z0, Z0
	VPMAXUW      Z3, Z2, Z2
	VPMAXUW      Z2, Z0, Z0
	VEXTRACTI64X4 $1, Z0, Y1
	VPMAXUW      Y1, Y0, Y0
	VEXTRACTI128 $1, Y0, X1
	VPMAXUW      X1, X0, X0
	VPSHUFD      $0x4e, X0, X1
	VPMAXUW      X1, X0, X0
	VPSHUFD      $0xb1, X0, X1
	VPMAXUW      X1, X0, X0
	VPSRLD       $16, X0, X1
	VPMAXUW      X1, X0, X0
	VMOVD        X0, AX
	SHLL         $16, AX
	MOVL         AX, (DI)
	ADDQ         $256, SI
	ADDQ         $4, DI
	DECQ         CX
	JNZ          ybb
	VZEROUPPER
	RET

// func fromE4M3BlocksBF16AVX512(dst *uint16, src *byte, nblocks int, scales *float32)
// Block b of 128 E4M3 bytes as bfloat16s: each value's float32 (as fromE4M3AVX2) times
// scales[b], rounded to nearest even (as F32ToBF16, a NaN quiet with its sign).
TEXT ·fromE4M3BlocksBF16AVX512(SB), NOSPLIT, $0-32
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         nblocks+16(FP), CX
	MOVQ         scales+24(FP), R8
	MOVL         $0x7f, AX
	VPBROADCASTD AX, Z14
	MOVL         $0x80, AX
	VPBROADCASTD AX, Z13
	MOVL         $0x3c000000, AX // 120<<23
	VPBROADCASTD AX, Z12
	MOVL         $8, AX
	VPBROADCASTD AX, Z11
	MOVL         $0x3b000000, AX // 2^-9
	VPBROADCASTD AX, Z10
	MOVL         $0x7fc00000, AX
	VPBROADCASTD AX, Z9
	BF16_SETUP512

dbb:
	VBROADCASTSS (R8), Z15
	ADDQ         $4, R8
	MOVQ         $8, DX

dbi:
	VPMOVZXBD (SI), Z0
	VPANDD    Z14, Z0, Z1     // x & 0x7f
	VPANDD    Z13, Z0, Z0
	VPSLLD    $24, Z0, Z0     // sign
	VPSLLD    $20, Z1, Z2
	VPADDD    Z12, Z2, Z2     // normal bits
	VCVTDQ2PS Z1, Z3
	VMULPS    Z10, Z3, Z3     // subnormal value
	VPCMPUD   $1, Z11, Z1, K1 // x < 8
	VMOVDQA32 Z3, K1, Z2
	VPCMPEQD  Z14, Z1, K2     // x == 0x7f: NaN
	VMOVDQA32 Z9, K2, Z2
	VPORD     Z0, Z2, Z2
	VMULPS    Z15, Z2, Z2     // the float32 value
	BF16_STORE512
	ADDQ      $16, SI
	ADDQ      $32, DI
	DECQ      DX
	JNZ       dbi
	DECQ      CX
	JNZ       dbb
	VZEROUPPER
	RET

// func amaxBF16AVX512(src *uint16, n int) (fin, all uint32)
// As amaxAVX2 on bfloat16 values: the float32 bits of the largest finite magnitude, and
// of the largest of all (above those of +Inf: a NaN); n a multiple of 32.
TEXT ·amaxBF16AVX512(SB), NOSPLIT, $0-24
	MOVQ         src+0(FP), SI
	MOVQ         n+8(FP), CX
	MOVL         $0x7fff, AX
	VPBROADCASTW AX, Z14
	MOVL         $0x7f80, AX
	VPBROADCASTW AX, Z13
	VPXORD       Z0, Z0, Z0 // finite
	VPXORD       Z1, Z1, Z1 // all

zbi:
	VPANDD      (SI), Z14, Z2
	VPMAXUW     Z2, Z1, Z1
	VPCMPUW     $1, Z13, Z2, K1
	VMOVDQU16.Z Z2, K1, Z2
	VPMAXUW     Z2, Z0, Z0
	ADDQ        $64, SI
	SUBQ        $32, CX
	JNZ         zbi
	VEXTRACTI64X4 $1, Z0, Y2
	VPMAXUW      Y2, Y0, Y0
	VEXTRACTI64X4 $1, Z1, Y2
	VPMAXUW      Y2, Y1, Y1
	VPERM2I128   $0x20, Y1, Y0, Y2 // low halves: finite, all
	VPERM2I128   $0x31, Y1, Y0, Y3 // high halves
	VPMAXUW      Y3, Y2, Y2        // X: finite's 8 words; high lane: all's
	VPSHUFD      $0x4e, Y2, Y3
	VPMAXUW      Y3, Y2, Y2
	VPSHUFD      $0xb1, Y2, Y3
	VPMAXUW      Y3, Y2, Y2
	VPSRLD       $16, Y2, Y3
	VPMAXUW      Y3, Y2, Y2
	VMOVD        X2, AX
	SHLL         $16, AX
	MOVL         AX, fin+16(FP)
	VEXTRACTI128 $1, Y2, X2
	VMOVD        X2, AX
	SHLL         $16, AX
	MOVL         AX, all+20(FP)
	VZEROUPPER
	RET

// func toI8BF16AVX512(dst *byte, src *uint16, n int, inv float32)
// dst[i] = int8 of src[i]*inv clamped to ±127, rounded to nearest even (as toI8AVX2);
// n a multiple of 16. The values are not NaN.
TEXT ·toI8BF16AVX512(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         n+16(FP), CX
	VBROADCASTSS inv+24(FP), Z15
	MOVL         $0x42fe0000, AX // 127.0
	VPBROADCASTD AX, Z14
	MOVL         $0xc2fe0000, AX // -127.0
	VPBROADCASTD AX, Z13

ibi:
	BF16_LOAD512((SI))
	VMULPS    Z15, Z0, Z0
	VMAXPS    Z13, Z0, Z0
	VMINPS    Z14, Z0, Z0
	VCVTPS2DQ Z0, Z0
	VPMOVDB   Z0, (DI)
	ADDQ      $32, SI
	ADDQ      $16, DI
	SUBQ      $16, CX
	JNZ       ibi
	VZEROUPPER
	RET

// func fromI8BF16AVX512(dst *uint16, src *byte, n int, scale float32)
// dst[i] = float32(int8(src[i]))*scale rounded to bfloat16 as F32ToBF16 rounds; n a
// multiple of 16.
TEXT ·fromI8BF16AVX512(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         n+16(FP), CX
	VBROADCASTSS scale+24(FP), Z15
	BF16_SETUP512

jbi:
	VPMOVSXBD (SI), Z0
	VCVTDQ2PS Z0, Z2
	VMULPS    Z15, Z2, Z2
	BF16_STORE512
	ADDQ      $16, SI
	ADDQ      $32, DI
	SUBQ      $16, CX
	JNZ       jbi
	VZEROUPPER
	RET
