#include "textflag.h"
#include "bf16_amd64.h"

// The FP8 block kernels with AVX-512 (F, BW and DQ): 16 values per vector where the AVX2
// kernels of quant_amd64.s take 8, and the same bytes.

// E4M3_SETUP512 loads the constants E4M3_512 and E4M3_STORE4 use: Z5 2^20, Z6
// (20<<23)+121*8, Z7 the exponent mask, Z8 448, Z9 2^-6, Z10 0x7f, Z11 0x80, Z12
// e4m3order.
#define E4M3_SETUP512 \
	MOVL         $0x49800000, AX; \
	VPBROADCASTD AX, Z5; \
	MOVL         $0x0a0003c8, AX; \
	VPBROADCASTD AX, Z6; \
	MOVL         $0x7f800000, AX; \
	VPBROADCASTD AX, Z7; \
	MOVL         $0x43e00000, AX; \
	VPBROADCASTD AX, Z8; \
	MOVL         $0x3c800000, AX; \
	VPBROADCASTD AX, Z9; \
	MOVL         $0x7f, AX; \
	VPBROADCASTD AX, Z10; \
	MOVL         $0x80, AX; \
	VPBROADCASTD AX, Z11; \
	VPMOVZXBD    e4m3order<>(SB), Z12

// E4M3_512(R, S, T, K) turns the 16 float32s in R, multiplied by Z15, into their E4M3
// codes, one in the low byte of each of R's words, the bytes e4m3 gives. The magnitude
// m, clamped to 448, is rounded by one float addition: c, 2^20 times the power of two at
// or below max(m, 2^-6), has a unit in the last place that is E4M3's at m (its
// subnormals' below 2^-6), so the fused c+m rounds m to nearest even there, and the bits
// of c+m less c's are the code's mantissa, counted from the code of c/2^20. Then 0x7f
// where NaN, and the sign. S, T and K are scratch.
#define E4M3_512(R, S, T, K) \
	VMULPS      Z15, R, R; \
	VFPCLASSPSZ $0x81, R, K; \
	VPSRLD      $24, R, S; \
	VRANGEPS    $0x0a, Z8, R, R; \
	VMAXPS      Z9, R, T; \
	VPANDD      Z7, T, T; \
	VFMADD231PS Z5, T, R; \
	VPSUBD      T, R, R; \
	VPSRLD      $20, T, T; \
	VPADDD      T, R, R; \
	VPSUBD      Z6, R, R; \
	VMOVDQA32   Z10, K, R; \
	VPTERNLOGD  $0xf8, Z11, S, R

// E4M3_STORE4 stores at (DI) the 64 codes E4M3_512 left in Z0, Z16, Z17 and Z18, in
// that order: packed within 128-bit lanes, then the lanes' dwords put in order.
#define E4M3_STORE4 \
	VPACKUSDW Z16, Z0, Z0; \
	VPACKUSDW Z18, Z17, Z17; \
	VPACKUSWB Z17, Z0, Z0; \
	VPERMD    Z0, Z12, Z0; \
	VMOVDQU32 Z0, (DI)

// e4m3order: dword n of E4M3_STORE4's result comes from dword 4*(n%4) + n/4 of the packs.
DATA e4m3order<>+0(SB)/8, $0x0d0905010c080400
DATA e4m3order<>+8(SB)/8, $0x0f0b07030e0a0602
GLOBL e4m3order<>(SB), RODATA|NOPTR, $16

// BF16_LOAD512(addr, R) widens the 16 bfloat16s at addr into the float32s of R.
#define BF16_LOAD512(addr, R) \
	VPMOVZXWD addr, R; \
	VPSLLD    $16, R, R

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
	BF16_LOAD512((SI), Z0)
	BF16_LOAD512(32(SI), Z16)
	BF16_LOAD512(64(SI), Z17)
	BF16_LOAD512(96(SI), Z18)
	E4M3_512(Z0, Z1, Z2, K1)
	E4M3_512(Z16, Z19, Z20, K2)
	E4M3_512(Z17, Z21, Z22, K3)
	E4M3_512(Z18, Z23, Z24, K4)
	E4M3_STORE4
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
	VMOVUPS 64(SI), Z16
	VMOVUPS 128(SI), Z17
	VMOVUPS 192(SI), Z18
	E4M3_512(Z0, Z1, Z2, K1)
	E4M3_512(Z16, Z19, Z20, K2)
	E4M3_512(Z17, Z21, Z22, K3)
	E4M3_512(Z18, Z23, Z24, K4)
	E4M3_STORE4
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

// E4M3_DECODE512(addr, R, S) leaves in R the float32 values of the 16 E4M3 codes at
// addr times Z15 (as fromE4M3AVX2 decodes them): a code's magnitude bits shifted left by
// 20 are the float32 bits of its value times 2^-120, its subnormals too (as float32
// subnormals), so one exact multiplication by 2^120 decodes both ranges; then NaN for
// 0x7f, the sign, the scale. S and K4 are scratch; Z14 0x7f<<20, Z13 the sign bit, Z12
// 2^120, Z9 a quiet NaN.
#define E4M3_DECODE512(addr, R, S) \
	VPMOVZXBD  addr, S; \
	VPSLLD     $20, S, R; \
	VPANDD     Z14, R, R; \
	VPCMPEQD   Z14, R, K4; \
	VMULPS     Z12, R, R; \
	VMOVDQA32  Z9, K4, R; \
	VPSLLD     $24, S, S; \
	VPTERNLOGD $0xf8, Z13, S, R; \
	VMULPS     Z15, R, R

// E4M3_DECODE_SETUP512 loads the constants E4M3_DECODE512 uses.
#define E4M3_DECODE_SETUP512 \
	MOVL         $0x07f00000, AX; \
	VPBROADCASTD AX, Z14; \
	MOVL         $0x80000000, AX; \
	VPBROADCASTD AX, Z13; \
	MOVL         $0x7b800000, AX; \
	VPBROADCASTD AX, Z12; \
	MOVL         $0x7fc00000, AX; \
	VPBROADCASTD AX, Z9

// func fromE4M3BlocksBF16AVX512(dst *uint16, src *byte, nblocks int, scales *float32, cvt int)
// Block b of 128 E4M3 bytes as bfloat16s: each value's float32 times scales[b], rounded
// to nearest even (as F32ToBF16, a NaN quiet with its sign). With cvt != 0 (the CPU has
// AVX-512 BF16) 32 values without a subnormal among them are rounded by VCVTNE2PS2BF16.
TEXT ·fromE4M3BlocksBF16AVX512(SB), NOSPLIT, $0-40
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         nblocks+16(FP), CX
	MOVQ         scales+24(FP), R8
	MOVQ         cvt+32(FP), R9
	E4M3_DECODE_SETUP512
	BF16_SETUP512

dbb:
	VBROADCASTSS (R8), Z15
	ADDQ         $4, R8
	MOVQ         $4, DX

dbi:
	E4M3_DECODE512((SI), Z0, Z10)
	E4M3_DECODE512(16(SI), Z1, Z11)
	TESTQ       R9, R9
	JZ          dround
	BF16_STORE32(dround)

dnext:
	ADDQ $32, SI
	ADDQ $64, DI
	DECQ DX
	JNZ  dbi
	DECQ CX
	JNZ  dbb
	VZEROUPPER
	RET

dround:
	BF16_ROUND32
	JMP dnext

// func fromE4M3BlocksF32AVX512(dst *float32, src *byte, nblocks int, scales *float32)
// Block b of 128 E4M3 bytes as float32s: each value times scales[b] (as fromE4M3AVX2).
TEXT ·fromE4M3BlocksF32AVX512(SB), NOSPLIT, $0-32
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         nblocks+16(FP), CX
	MOVQ         scales+24(FP), R8
	E4M3_DECODE_SETUP512

fbb:
	VBROADCASTSS (R8), Z15
	ADDQ         $4, R8
	MOVQ         $4, DX

fbi:
	E4M3_DECODE512((SI), Z0, Z10)
	E4M3_DECODE512(16(SI), Z1, Z11)
	VMOVUPS Z0, (DI)
	VMOVUPS Z1, 64(DI)
	ADDQ    $32, SI
	ADDQ    $128, DI
	DECQ    DX
	JNZ     fbi
	DECQ    CX
	JNZ     fbb
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
	BF16_LOAD512((SI), Z0)
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
	BF16_STORE512(Z2, (DI))
	ADDQ      $16, SI
	ADDQ      $32, DI
	SUBQ      $16, CX
	JNZ       jbi
	VZEROUPPER
	RET
