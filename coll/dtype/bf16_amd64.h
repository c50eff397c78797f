// Macros of the AVX-512 kernels that write bfloat16s (quant512_amd64.s, conv512_amd64.s).

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

// BF16_STORE512(R, addr) stores at addr the 16 float32s of R as bfloat16s, rounded to
// nearest even as F32ToBF16 rounds (a NaN keeps its high half, made quiet), subnormals
// included. Z3, Z4, Z5 and K3 are scratch.
#define BF16_STORE512(R, addr) \
	VPSRLD  $16, R, Z3; \
	VPANDD  Z8, Z3, Z4; \
	VPADDD  Z7, R, Z5; \
	VPADDD  Z4, Z5, Z5; \
	VPSRLD  $16, Z5, Z5; \
	VPANDD  Z6, R, Z4; \
	VPCMPUD $6, Z16, Z4, K3; \
	VPORD   Z17, Z3, K3, Z5; \
	VPMOVDW Z5, addr

// CVT2BF16 is VCVTNE2PS2BF16 Z0, Z1, Z2 (Intel order: zmm2, zmm1, zmm0), which Go's
// assembler does not know: Z2's low 16 words are Z0's float32s as bfloat16s, its high
// 16 Z1's. The bytes are those binutils gives.
#define CVT2BF16 \
	BYTE $0x62; BYTE $0xf2; BYTE $0x77; BYTE $0x48; BYTE $0x72; BYTE $0xd0

// BF16_STORE32(round) stores at (DI) the 32 float32s of Z0 and Z1 as bfloat16s: with
// CVT2BF16, unless one of them is subnormal (which it would take as zero); then it jumps
// to round, where the caller stores them with BF16_STORE512 (BF16_ROUND32). K1, K2 and Z2
// are scratch.
#define BF16_STORE32(round) \
	VFPCLASSPSZ $0x20, Z0, K1; \
	VFPCLASSPSZ $0x20, Z1, K2; \
	KORTESTW    K2, K1; \
	JNE         round; \
	CVT2BF16; \
	VMOVDQU16   Z2, (DI)

// BF16_ROUND32 stores at (DI) the 32 float32s of Z0 and Z1 as bfloat16s, subnormals
// included, by BF16_STORE512.
#define BF16_ROUND32 \
	BF16_STORE512(Z0, (DI)); \
	BF16_STORE512(Z1, 32(DI))
