//go:build !amd64

package dtype

func f32ToBF16Fast(dst []BFloat16, src []float32) int { return 0 }
func bf16ToF32Fast(dst []float32, src []BFloat16) int { return 0 }
func bf16SumFast(d, s []BFloat16) int                 { return 0 }
