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

// WeightedSum writes into dst the sum over j of w[j]*rows[j] (rows of at least len(dst)
// values), in float32, the terms in order: bit for bit what Scale (ScaleBF16) with the
// first row and Axpy (AxpyBF16) with each next would write, in one pass over dst. With
// add, every term is added to dst as it is. No rows: zeros (or dst as it is, with add).
func WeightedSum[T Activation](dst []float32, w []float32, rows [][]T, add bool) {
	w = w[:len(rows)]
	k := weightedSumFast(dst, w, rows, add)
	if k == len(dst) {
		return
	}
	rest := dst[k:]
	if len(rows) == 0 {
		if !add {
			clear(rest)
		}
		return
	}
	for j, r := range rows {
		r = r[k:len(dst)]
		switch x := any(r).(type) {
		case []float32:
			if j == 0 && !add {
				Scale(rest, w[j], x)
			} else {
				Axpy(rest, w[j], x)
			}
		case []BFloat16:
			if j == 0 && !add {
				ScaleBF16(rest, w[j], x)
			} else {
				AxpyBF16(rest, w[j], x)
			}
		}
	}
}

func isBF16[T Activation]() bool {
	var z T
	_, ok := any(z).(BFloat16)
	return ok
}
