package dtype

// Axpy adds a*x to dst (same length), with AVX2 and FMA where available: the kernel of
// weighted sums (the MoE combine).
func Axpy(dst []float32, a float32, x []float32) {
	dst = dst[:len(x)]
	k := axpyF32Fast(dst, a, x)
	for i, v := range x[k:] {
		dst[k+i] += a * v
	}
}

// AxpyBF16 adds a*x to dst, x in bfloat16 (widened exactly), with AVX2 and FMA where
// available.
func AxpyBF16(dst []float32, a float32, x []BFloat16) {
	dst = dst[:len(x)]
	k := axpyBF16Fast(dst, a, x)
	for i, v := range x[k:] {
		dst[k+i] += a * v.Float32()
	}
}

// Scale writes a*x into dst (same length).
func Scale(dst []float32, a float32, x []float32) {
	dst = dst[:len(x)]
	k := scaleF32Fast(dst, a, x)
	for i, v := range x[k:] {
		dst[k+i] = a * v
	}
}

// ScaleBF16 writes a*x into dst, x in bfloat16.
func ScaleBF16(dst []float32, a float32, x []BFloat16) {
	dst = dst[:len(x)]
	k := scaleBF16Fast(dst, a, x)
	for i, v := range x[k:] {
		dst[k+i] = a * v.Float32()
	}
}
