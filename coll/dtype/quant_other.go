//go:build !amd64

package dtype

func axpyF32Fast(dst []float32, a float32, x []float32) int     { return 0 }
func axpyBF16Fast(dst []float32, a float32, x []BFloat16) int   { return 0 }
func scaleF32Fast(dst []float32, a float32, x []float32) int    { return 0 }
func scaleBF16Fast(dst []float32, a float32, x []BFloat16) int  { return 0 }
func amaxFast(src []float32) (n int, fin, all uint32)           { return 0, 0, 0 }
func toE4M3Fast(dst []byte, x []float32, inv float32) int       { return 0 }
func fromE4M3Fast(dst []float32, src []byte, scale float32) int { return 0 }
func toI8Fast(dst []byte, x []float32, inv float32) int         { return 0 }
func fromI8Fast(dst []float32, src []byte, scale float32) int   { return 0 }

func weightedSumFast[T Activation](dst []float32, w []float32, rows [][]T, add bool) int { return 0 }

func quantizeFP8Fast[T Activation](dst []byte, scales []float32, src []T, pow2 bool) int { return 0 }

// haveFMA and haveAVX512 are false off amd64: the portable loops are the only ones.
var haveFMA, haveAVX512 = false, false

func dequantizeFP8Fast[T Activation](dst []T, src []byte, scales []float32) int { return 0 }

func quantizeI8Fast[T Activation](dst []byte, src []T) (float32, bool)      { return 0, false }
func dequantizeI8Fast[T Activation](dst []T, src []byte, scale float32) int { return 0 }

// Kernels names the kernels in use: "portable" (Go loops) off amd64.
func Kernels() string { return "portable" }
