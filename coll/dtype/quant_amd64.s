#include "textflag.h"

// Kernels of quant.go and axpy.go with AVX2 and FMA. Every n is a positive multiple of
// the stated width; the callers do the rest.

// Pack the low byte of each dword of a 128-bit lane into its first 4 bytes.
DATA lowbytes<>+0(SB)/8, $0x808080800c080400
DATA lowbytes<>+8(SB)/8, $0x8080808080808080
DATA lowbytes<>+16(SB)/8, $0x808080800c080400
DATA lowbytes<>+24(SB)/8, $0x8080808080808080
GLOBL lowbytes<>(SB), RODATA|NOPTR, $32

// Dword indices that bring dword 4 (the second lane's packed bytes) next to dword 0.
DATA lanes<>+0(SB)/8, $0x0000000400000000
DATA lanes<>+8(SB)/8, $0x0000000000000000
DATA lanes<>+16(SB)/8, $0x0000000000000000
DATA lanes<>+24(SB)/8, $0x0000000000000000
GLOBL lanes<>(SB), RODATA|NOPTR, $32

// func axpyF32AVX2(dst *float32, a float32, x *float32, n int)
// dst[i] += a*x[i]; n a multiple of 16.
TEXT ·axpyF32AVX2(SB), NOSPLIT, $0-32
	MOVQ         dst+0(FP), DI
	VBROADCASTSS a+8(FP), Y15
	MOVQ         x+16(FP), SI
	MOVQ         n+24(FP), CX

axf:
	VMOVUPS     (SI), Y0
	VMOVUPS     32(SI), Y1
	VFMADD213PS (DI), Y15, Y0  // Y0 = Y15*Y0 + dst
	VFMADD213PS 32(DI), Y15, Y1
	VMOVUPS     Y0, (DI)
	VMOVUPS     Y1, 32(DI)
	ADDQ        $64, SI
	ADDQ        $64, DI
	SUBQ        $16, CX
	JNZ         axf
	VZEROUPPER
	RET

// func axpyBF16AVX2(dst *float32, a float32, x *uint16, n int)
// dst[i] += a*float32(x[i]); n a multiple of 16.
TEXT ·axpyBF16AVX2(SB), NOSPLIT, $0-32
	MOVQ         dst+0(FP), DI
	VBROADCASTSS a+8(FP), Y15
	MOVQ         x+16(FP), SI
	MOVQ         n+24(FP), CX

axb:
	VPMOVZXWD   (SI), Y0
	VPMOVZXWD   16(SI), Y1
	VPSLLD      $16, Y0, Y0
	VPSLLD      $16, Y1, Y1
	VFMADD213PS (DI), Y15, Y0
	VFMADD213PS 32(DI), Y15, Y1
	VMOVUPS     Y0, (DI)
	VMOVUPS     Y1, 32(DI)
	ADDQ        $32, SI
	ADDQ        $64, DI
	SUBQ        $16, CX
	JNZ         axb
	VZEROUPPER
	RET

// func amaxAVX2(src *float32, n int) (fin, all uint32)
// The largest magnitude bits of the finite values, and of all values; n a multiple of 8.
TEXT ·amaxAVX2(SB), NOSPLIT, $0-24
	MOVQ      src+0(FP), SI
	MOVQ      n+8(FP), CX
	VPCMPEQD  Y15, Y15, Y15
	VPSRLD    $1, Y15, Y14  // 0x7fffffff
	VPSLLD    $24, Y15, Y13
	VPSRLD    $1, Y13, Y13  // 0x7f800000
	VPXOR     Y0, Y0, Y0    // finite max
	VPXOR     Y1, Y1, Y1    // max

am:
	VPAND     (SI), Y14, Y2
	VPMAXUD   Y2, Y1, Y1
	VPCMPGTD  Y2, Y13, Y3   // 0x7f800000 > a: finite
	VPAND     Y3, Y2, Y2
	VPMAXUD   Y2, Y0, Y0
	ADDQ      $32, SI
	SUBQ      $8, CX
	JNZ       am
	VEXTRACTI128 $1, Y0, X2
	VPMAXUD   X2, X0, X0
	VPSHUFD   $0x4e, X0, X2
	VPMAXUD   X2, X0, X0
	VPSHUFD   $0xb1, X0, X2
	VPMAXUD   X2, X0, X0
	VEXTRACTI128 $1, Y1, X2
	VPMAXUD   X2, X1, X1
	VPSHUFD   $0x4e, X1, X2
	VPMAXUD   X2, X1, X1
	VPSHUFD   $0xb1, X1, X2
	VPMAXUD   X2, X1, X1
	VMOVD     X0, AX
	MOVL      AX, fin+16(FP)
	VMOVD     X1, AX
	MOVL      AX, all+20(FP)
	VZEROUPPER
	RET

// func toE4M3AVX2(dst *byte, src *float32, n int, inv float32)
// dst[i] = E4M3 of src[i]*inv, saturating (as toE4M3); n a multiple of 8. Magnitudes are
// clamped to 448 first (the normal path then gives 0x7e); a NaN gets a low bit of 1 too.
TEXT ·toE4M3AVX2(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         n+16(FP), CX
	VBROADCASTSS inv+24(FP), Y15
	VPCMPEQD     Y13, Y13, Y13
	VPSRLD       $31, Y13, Y12       // 1
	VPSRLD       $1, Y13, Y13        // 0x7fffffff
	MOVL         $0x7ffff, AX
	VMOVD        AX, X11
	VPBROADCASTD X11, Y11
	MOVL         $960, AX            // 120<<3
	VMOVD        AX, X10
	VPBROADCASTD X10, Y10
	MOVL         $0x3c800000, AX     // 2^-6
	VMOVD        AX, X9
	VPBROADCASTD X9, Y9
	MOVL         $0x43e00000, AX     // 448
	VMOVD        AX, X8
	VPBROADCASTD X8, Y8
	MOVL         $0x7f800000, AX
	VMOVD        AX, X7
	VPBROADCASTD X7, Y7
	MOVL         $0x44000000, AX     // 512.0
	VMOVD        AX, X6
	VPBROADCASTD X6, Y6
	MOVL         $0x4b000000, AX     // 2^23
	VMOVD        AX, X5
	VPBROADCASTD X5, Y5
	VMOVDQU      lowbytes<>(SB), Y3
	VMOVDQU      lanes<>(SB), Y2

e4:
	VMULPS      (SI), Y15, Y0        // v
	VPSRLD      $31, Y0, Y1
	VPSLLD      $7, Y1, Y1           // sign byte
	VPAND       Y13, Y0, Y0          // a = |v| bits
	VPCMPGTD    Y7, Y0, Y14          // NaN
	VPSRLD      $31, Y14, Y14
	VPOR        Y14, Y1, Y1          // the sign, and 1 where NaN
	VPMINUD     Y8, Y0, Y0           // a = min(a, 448)
	// Normal: (a + 0x7ffff + ((a>>20)&1)) >> 20, minus 120<<3.
	VPSRLD      $20, Y0, Y14
	VPAND       Y12, Y14, Y14
	VPADDD      Y14, Y0, Y14
	VPADDD      Y11, Y14, Y14
	VPSRLD      $20, Y14, Y14
	VPSUBD      Y10, Y14, Y14        // qn
	// Subnormal: bits(a*512 + 2^23) - 0x4b000000.
	VMULPS      Y6, Y0, Y4
	VADDPS      Y5, Y4, Y4
	VPSUBD      Y5, Y4, Y4           // qs
	VPCMPGTD    Y0, Y9, Y0           // a < 2^-6
	VBLENDVPS   Y0, Y4, Y14, Y14     // q = mask ? qs : qn
	VPOR        Y1, Y14, Y14
	VPSHUFB     Y3, Y14, Y14
	VPERMD      Y14, Y2, Y14
	VMOVQ       X14, (DI)
	ADDQ        $32, SI
	ADDQ        $8, DI
	SUBQ        $8, CX
	JNZ         e4
	VZEROUPPER
	RET

// func fromE4M3AVX2(dst *float32, src *byte, n int, scale float32)
// dst[i] = float32(E4M3 src[i]) * scale; n a multiple of 8.
TEXT ·fromE4M3AVX2(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         n+16(FP), CX
	VBROADCASTSS scale+24(FP), Y15
	MOVL         $0x7f, AX
	VMOVD        AX, X14
	VPBROADCASTD X14, Y14            // 0x7f
	MOVL         $0x80, AX
	VMOVD        AX, X13
	VPBROADCASTD X13, Y13            // 0x80
	MOVL         $0x3c000000, AX     // 120<<23
	VMOVD        AX, X12
	VPBROADCASTD X12, Y12
	MOVL         $8, AX
	VMOVD        AX, X11
	VPBROADCASTD X11, Y11
	MOVL         $0x3b000000, AX     // 2^-9
	VMOVD        AX, X10
	VPBROADCASTD X10, Y10
	MOVL         $0x7fc00000, AX
	VMOVD        AX, X9
	VPBROADCASTD X9, Y9

f4:
	VPMOVZXBD   (SI), Y0
	VPAND       Y14, Y0, Y1          // x & 0x7f
	VPAND       Y13, Y0, Y0
	VPSLLD      $24, Y0, Y0          // sign
	VPSLLD      $20, Y1, Y2
	VPADDD      Y12, Y2, Y2          // normal bits
	VCVTDQ2PS   Y1, Y3
	VMULPS      Y10, Y3, Y3          // subnormal value
	VPCMPGTD    Y1, Y11, Y4          // x < 8
	VBLENDVPS   Y4, Y3, Y2, Y2
	VPCMPEQD    Y14, Y1, Y4          // x == 0x7f: NaN
	VBLENDVPS   Y4, Y9, Y2, Y2
	VPOR        Y0, Y2, Y2
	VMULPS      Y15, Y2, Y2
	VMOVUPS     Y2, (DI)
	ADDQ        $8, SI
	ADDQ        $32, DI
	SUBQ        $8, CX
	JNZ         f4
	VZEROUPPER
	RET

// func toI8AVX2(dst *byte, src *float32, n int, inv float32)
// dst[i] = int8 of src[i]*inv, clamped to ±127, rounded to nearest even; n a multiple
// of 8. The values are finite (the caller checked for NaN).
TEXT ·toI8AVX2(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         n+16(FP), CX
	VBROADCASTSS inv+24(FP), Y15
	MOVL         $0x42fe0000, AX     // 127.0
	VMOVD        AX, X14
	VPBROADCASTD X14, Y14
	MOVL         $0xc2fe0000, AX     // -127.0
	VMOVD        AX, X13
	VPBROADCASTD X13, Y13
	VMOVDQU      lowbytes<>(SB), Y3
	VMOVDQU      lanes<>(SB), Y2

i8:
	VMULPS      (SI), Y15, Y0
	VMINPS      Y14, Y0, Y0
	VMAXPS      Y13, Y0, Y0
	VCVTPS2DQ   Y0, Y0
	VPSHUFB     Y3, Y0, Y0
	VPERMD      Y0, Y2, Y0
	VMOVQ       X0, (DI)
	ADDQ        $32, SI
	ADDQ        $8, DI
	SUBQ        $8, CX
	JNZ         i8
	VZEROUPPER
	RET

// func fromI8AVX2(dst *float32, src *byte, n int, scale float32)
// dst[i] = float32(int8(src[i])) * scale; n a multiple of 8.
TEXT ·fromI8AVX2(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         n+16(FP), CX
	VBROADCASTSS scale+24(FP), Y15

fi8:
	VPMOVSXBD   (SI), Y0
	VCVTDQ2PS   Y0, Y0
	VMULPS      Y15, Y0, Y0
	VMOVUPS     Y0, (DI)
	ADDQ        $8, SI
	ADDQ        $32, DI
	SUBQ        $8, CX
	JNZ         fi8
	VZEROUPPER
	RET

// func scaleF32AVX2(dst *float32, a float32, x *float32, n int)
// dst[i] = a*x[i]; n a multiple of 16.
TEXT ·scaleF32AVX2(SB), NOSPLIT, $0-32
	MOVQ         dst+0(FP), DI
	VBROADCASTSS a+8(FP), Y15
	MOVQ         x+16(FP), SI
	MOVQ         n+24(FP), CX

scf:
	VMULPS  (SI), Y15, Y0
	VMULPS  32(SI), Y15, Y1
	VMOVUPS Y0, (DI)
	VMOVUPS Y1, 32(DI)
	ADDQ    $64, SI
	ADDQ    $64, DI
	SUBQ    $16, CX
	JNZ     scf
	VZEROUPPER
	RET

// func scaleBF16AVX2(dst *float32, a float32, x *uint16, n int)
// dst[i] = a*float32(x[i]); n a multiple of 16.
TEXT ·scaleBF16AVX2(SB), NOSPLIT, $0-32
	MOVQ         dst+0(FP), DI
	VBROADCASTSS a+8(FP), Y15
	MOVQ         x+16(FP), SI
	MOVQ         n+24(FP), CX

scb:
	VPMOVZXWD (SI), Y0
	VPMOVZXWD 16(SI), Y1
	VPSLLD    $16, Y0, Y0
	VPSLLD    $16, Y1, Y1
	VMULPS    Y15, Y0, Y0
	VMULPS    Y15, Y1, Y1
	VMOVUPS   Y0, (DI)
	VMOVUPS   Y1, 32(DI)
	ADDQ      $32, SI
	ADDQ      $64, DI
	SUBQ      $16, CX
	JNZ       scb
	VZEROUPPER
	RET

// func amaxBlocksBF16AVX2(src *uint16, nblocks int, out *uint32)
// out[b] = the float32 bits of the largest finite magnitude among the 128 bfloat16
// values of block b (0 for a block of zeros and non-finite values); nblocks > 0.
TEXT ·amaxBlocksBF16AVX2(SB), NOSPLIT, $0-24
	MOVQ         src+0(FP), SI
	MOVQ         nblocks+8(FP), CX
	MOVQ         out+16(FP), DI
	VPCMPEQW     Y15, Y15, Y15
	VPSRLW       $1, Y15, Y14        // 0x7fff
	MOVL         $0x7f80, AX
	VMOVD        AX, X13
	VPBROADCASTW X13, Y13            // 0x7f80: the bits of +Inf

abb:
	VPXOR        Y0, Y0, Y0
	VPXOR        Y1, Y1, Y1
	MOVQ         $4, DX

abi:
	VPAND        (SI), Y14, Y2       // |x|
	VPAND        32(SI), Y14, Y4
	VPCMPGTW     Y2, Y13, Y3         // Inf > |x|: finite (the words are non-negative)
	VPCMPGTW     Y4, Y13, Y5
	VPAND        Y3, Y2, Y2
	VPAND        Y5, Y4, Y4
	VPMAXUW      Y2, Y0, Y0
	VPMAXUW      Y4, Y1, Y1
	ADDQ         $64, SI
	DECQ         DX
	JNZ          abi
	VPMAXUW      Y1, Y0, Y0
	VEXTRACTI128 $1, Y0, X2
	VPMAXUW      X2, X0, X0
	VPSHUFD      $0x4e, X0, X2
	VPMAXUW      X2, X0, X0
	VPSHUFD      $0xb1, X0, X2
	VPMAXUW      X2, X0, X0
	VPSRLD       $16, X0, X2
	VPMAXUW      X2, X0, X0
	VMOVD        X0, AX
	SHLL         $16, AX             // the word, as the high half of a float32
	MOVL         AX, (DI)
	ADDQ         $4, DI
	DECQ         CX
	JNZ          abb
	VZEROUPPER
	RET

// func amaxBlocksF32AVX2(src *float32, nblocks int, out *uint32)
// out[b] = the bits of the largest finite magnitude among the 128 values of block b;
// nblocks > 0.
TEXT ·amaxBlocksF32AVX2(SB), NOSPLIT, $0-24
	MOVQ      src+0(FP), SI
	MOVQ      nblocks+8(FP), CX
	MOVQ      out+16(FP), DI
	VPCMPEQD  Y15, Y15, Y15
	VPSRLD    $1, Y15, Y14           // 0x7fffffff
	VPSLLD    $24, Y15, Y13
	VPSRLD    $1, Y13, Y13           // 0x7f800000

afb:
	VPXOR     Y0, Y0, Y0
	VPXOR     Y1, Y1, Y1
	MOVQ      $8, DX

afi:
	VPAND     (SI), Y14, Y2
	VPAND     32(SI), Y14, Y4
	VPCMPGTD  Y2, Y13, Y3
	VPCMPGTD  Y4, Y13, Y5
	VPAND     Y3, Y2, Y2
	VPAND     Y5, Y4, Y4
	VPMAXUD   Y2, Y0, Y0
	VPMAXUD   Y4, Y1, Y1
	ADDQ      $64, SI
	DECQ      DX
	JNZ       afi
	VPMAXUD   Y1, Y0, Y0
	VEXTRACTI128 $1, Y0, X2
	VPMAXUD   X2, X0, X0
	VPSHUFD   $0x4e, X0, X2
	VPMAXUD   X2, X0, X0
	VPSHUFD   $0xb1, X0, X2
	VPMAXUD   X2, X0, X0
	VMOVD     X0, AX
	MOVL      AX, (DI)
	ADDQ      $4, DI
	DECQ      CX
	JNZ       afb
	VZEROUPPER
	RET

// Dword order that undoes the lane interleaving of two rounds of packing.
DATA packorder<>+0(SB)/8, $0x0000000400000000
DATA packorder<>+8(SB)/8, $0x0000000500000001
DATA packorder<>+16(SB)/8, $0x0000000600000002
DATA packorder<>+24(SB)/8, $0x0000000700000003
GLOBL packorder<>(SB), RODATA|NOPTR, $32

// E4M3_SETUP loads the constants E4M3 uses: Y13 0x7fffffff, Y7 the bits of +Inf, Y8
// of 448, Y9 of 2^-6, Y5 of 2^20, Y6 (20<<23)+121*8, Y3 the exponent mask.
#define E4M3_SETUP \
	VPCMPEQD     Y13, Y13, Y13; \
	VPSRLD       $1, Y13, Y13; \
	MOVL         $0x3c800000, AX; \
	VMOVD        AX, X9; \
	VPBROADCASTD X9, Y9; \
	MOVL         $0x43e00000, AX; \
	VMOVD        AX, X8; \
	VPBROADCASTD X8, Y8; \
	MOVL         $0x7f800000, AX; \
	VMOVD        AX, X7; \
	VPBROADCASTD X7, Y7; \
	VMOVDQA      Y7, Y3; \
	MOVL         $0x49800000, AX; \
	VMOVD        AX, X5; \
	VPBROADCASTD X5, Y5; \
	MOVL         $0x0a0003c8, AX; \
	VMOVD        AX, X6; \
	VPBROADCASTD X6, Y6

// E4M3(out) writes into out the E4M3 codes, one per dword, of the 8 float32s in Y0
// multiplied by Y15, the bytes e4m3 gives, rounding as E4M3_512 does (quant512_amd64.s):
// the magnitude clamped to 448 (a NaN's too, whose code then gets a low bit of 1), one
// fused addition of c, 2^20 times the power of two at or below max(m, 2^-6), rounds it
// to E4M3's unit in the last place, normal or subnormal. Y0, Y1 and Y4 are scratch.
#define E4M3(out) \
	VMULPS      Y0, Y15, Y0; \
	VPSRLD      $31, Y0, Y1; \
	VPSLLD      $7, Y1, Y1; \
	VPAND       Y13, Y0, Y0; \
	VPCMPGTD    Y7, Y0, out; \
	VPSRLD      $31, out, out; \
	VPOR        out, Y1, Y1; \
	VPMINUD     Y8, Y0, Y0; \
	VMAXPS      Y9, Y0, Y4; \
	VPAND       Y3, Y4, Y4; \
	VFMADD231PS Y5, Y4, Y0; \
	VPSUBD      Y4, Y0, Y0; \
	VPSRLD      $20, Y4, Y4; \
	VPADDD      Y4, Y0, out; \
	VPSUBD      Y6, out, out; \
	VPOR        Y1, out, out

// PACK32 stores the 32 codes in Y10, Y11, Y12 and Y14 (8 each, in that order) at (DI).
#define PACK32 \
	VPACKUSDW   Y11, Y10, Y10; \
	VPACKUSDW   Y14, Y12, Y12; \
	VPACKUSWB   Y12, Y10, Y10; \
	VMOVDQU     packorder<>(SB), Y1; \
	VPERMD      Y10, Y1, Y10; \
	VMOVDQU     Y10, (DI)

// func toE4M3BlocksBF16AVX2(dst *byte, src *uint16, nblocks int, invs *float32)
// Block b of 128 bfloat16 values, multiplied by invs[b], as E4M3 bytes (toE4M3AVX2).
TEXT ·toE4M3BlocksBF16AVX2(SB), NOSPLIT, $0-32
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         nblocks+16(FP), CX
	MOVQ         invs+24(FP), R8
	E4M3_SETUP

ebb:
	VBROADCASTSS (R8), Y15
	ADDQ         $4, R8
	MOVQ         $4, DX

ebi:
	VPMOVZXWD    (SI), Y0
	VPSLLD       $16, Y0, Y0
	E4M3(Y10)
	VPMOVZXWD    16(SI), Y0
	VPSLLD       $16, Y0, Y0
	E4M3(Y11)
	VPMOVZXWD    32(SI), Y0
	VPSLLD       $16, Y0, Y0
	E4M3(Y12)
	VPMOVZXWD    48(SI), Y0
	VPSLLD       $16, Y0, Y0
	E4M3(Y14)
	PACK32
	ADDQ         $64, SI
	ADDQ         $32, DI
	DECQ         DX
	JNZ          ebi
	DECQ         CX
	JNZ          ebb
	VZEROUPPER
	RET

// func toE4M3BlocksF32AVX2(dst *byte, src *float32, nblocks int, invs *float32)
// Block b of 128 float32 values, multiplied by invs[b], as E4M3 bytes (toE4M3AVX2).
TEXT ·toE4M3BlocksF32AVX2(SB), NOSPLIT, $0-32
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         nblocks+16(FP), CX
	MOVQ         invs+24(FP), R8
	E4M3_SETUP

efb:
	VBROADCASTSS (R8), Y15
	ADDQ         $4, R8
	MOVQ         $4, DX

efi:
	VMOVUPS      (SI), Y0
	E4M3(Y10)
	VMOVUPS      32(SI), Y0
	E4M3(Y11)
	VMOVUPS      64(SI), Y0
	E4M3(Y12)
	VMOVUPS      96(SI), Y0
	E4M3(Y14)
	PACK32
	ADDQ         $128, SI
	ADDQ         $32, DI
	DECQ         DX
	JNZ          efi
	DECQ         CX
	JNZ          efb
	VZEROUPPER
	RET

// func sumBF16AVX2(dst *float32, rows **uint16, w *float32, k int, n int, add int)
// dst[i] = sum over j < k of w[j]*float32(rows[j][i]), added in order to dst[i] (add
// != 0) or starting from the first product; n a multiple of 32, k at least 1.
TEXT ·sumBF16AVX2(SB), NOSPLIT, $0-48
	MOVQ dst+0(FP), DI
	MOVQ rows+8(FP), R8
	MOVQ w+16(FP), R9
	MOVQ k+24(FP), R10
	MOVQ n+32(FP), CX
	MOVQ add+40(FP), R11
	XORQ SI, SI // byte offset in the rows

sbchunk:
	TESTQ R11, R11
	JNZ   sbadd
	MOVQ         (R8), AX
	VBROADCASTSS (R9), Y15
	VPMOVZXWD    (AX)(SI*1), Y0
	VPMOVZXWD    16(AX)(SI*1), Y1
	VPMOVZXWD    32(AX)(SI*1), Y2
	VPMOVZXWD    48(AX)(SI*1), Y3
	VPSLLD       $16, Y0, Y0
	VPSLLD       $16, Y1, Y1
	VPSLLD       $16, Y2, Y2
	VPSLLD       $16, Y3, Y3
	VMULPS       Y15, Y0, Y0
	VMULPS       Y15, Y1, Y1
	VMULPS       Y15, Y2, Y2
	VMULPS       Y15, Y3, Y3
	MOVQ         $1, DX
	JMP          sbrows

sbadd:
	VMOVUPS (DI), Y0
	VMOVUPS 32(DI), Y1
	VMOVUPS 64(DI), Y2
	VMOVUPS 96(DI), Y3
	XORQ    DX, DX

sbrows:
	CMPQ         DX, R10
	JGE          sbstore
	MOVQ         (R8)(DX*8), AX
	VBROADCASTSS (R9)(DX*4), Y15
	VPMOVZXWD    (AX)(SI*1), Y4
	VPMOVZXWD    16(AX)(SI*1), Y5
	VPMOVZXWD    32(AX)(SI*1), Y6
	VPMOVZXWD    48(AX)(SI*1), Y7
	VPSLLD       $16, Y4, Y4
	VPSLLD       $16, Y5, Y5
	VPSLLD       $16, Y6, Y6
	VPSLLD       $16, Y7, Y7
	VFMADD231PS  Y15, Y4, Y0 // Y0 += Y4*Y15
	VFMADD231PS  Y15, Y5, Y1
	VFMADD231PS  Y15, Y6, Y2
	VFMADD231PS  Y15, Y7, Y3
	INCQ         DX
	JMP          sbrows

sbstore:
	VMOVUPS Y0, (DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    $64, SI
	ADDQ    $128, DI
	SUBQ    $32, CX
	JNZ     sbchunk
	VZEROUPPER
	RET

// func sumF32AVX2(dst *float32, rows **float32, w *float32, k int, n int, add int)
// sumBF16AVX2 with float32 rows.
TEXT ·sumF32AVX2(SB), NOSPLIT, $0-48
	MOVQ dst+0(FP), DI
	MOVQ rows+8(FP), R8
	MOVQ w+16(FP), R9
	MOVQ k+24(FP), R10
	MOVQ n+32(FP), CX
	MOVQ add+40(FP), R11
	XORQ SI, SI // byte offset in the rows

sfchunk:
	TESTQ R11, R11
	JNZ   sfadd
	MOVQ         (R8), AX
	VBROADCASTSS (R9), Y15
	VMULPS       (AX)(SI*1), Y15, Y0
	VMULPS       32(AX)(SI*1), Y15, Y1
	VMULPS       64(AX)(SI*1), Y15, Y2
	VMULPS       96(AX)(SI*1), Y15, Y3
	MOVQ         $1, DX
	JMP          sfrows

sfadd:
	VMOVUPS (DI), Y0
	VMOVUPS 32(DI), Y1
	VMOVUPS 64(DI), Y2
	VMOVUPS 96(DI), Y3
	XORQ    DX, DX

sfrows:
	CMPQ         DX, R10
	JGE          sfstore
	MOVQ         (R8)(DX*8), AX
	VBROADCASTSS (R9)(DX*4), Y15
	VFMADD231PS  (AX)(SI*1), Y15, Y0 // Y0 += row*Y15
	VFMADD231PS  32(AX)(SI*1), Y15, Y1
	VFMADD231PS  64(AX)(SI*1), Y15, Y2
	VFMADD231PS  96(AX)(SI*1), Y15, Y3
	INCQ         DX
	JMP          sfrows

sfstore:
	VMOVUPS Y0, (DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    $128, SI
	ADDQ    $128, DI
	SUBQ    $32, CX
	JNZ     sfchunk
	VZEROUPPER
	RET
