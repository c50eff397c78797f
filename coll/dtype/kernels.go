package dtype

import (
	"fmt"

	"gonum.org/v1/gonum/blas/blas32"
	"gonum.org/v1/gonum/blas/blas64"
)

// Op is a reduction.
type Op uint8

const (
	Sum Op = iota + 1
	Prod
	Min
	Max
	Avg // sum, then divided by the number of contributions (Finish)
	opEnd
)

var opNames = [...]string{Sum: "sum", Prod: "prod", Min: "min", Max: "max", Avg: "avg"}

// Ops lists every reduction.
var Ops = []Op{Sum, Prod, Min, Max, Avg}

// Valid reports whether op is known.
func (op Op) Valid() bool { return op > 0 && op < opEnd }

func (op Op) String() string {
	if !op.Valid() {
		return fmt.Sprintf("op(%d)", uint8(op))
	}
	return opNames[op]
}

// ParseOp returns the reduction named s.
func ParseOp(s string) (Op, error) {
	for _, op := range Ops {
		if op.String() == s {
			return op, nil
		}
	}
	return 0, fmt.Errorf("dtype: unknown reduction %q (want sum, prod, min, max or avg)", s)
}

// Reduce sets dst[i] = dst[i] op src[i] for every element of t in the byte buffers (equal
// lengths, a multiple of t.Size()). Avg reduces as Sum; call Finish once on the result.
//
// Every op is commutative bit for bit (a op b == b op a) for non-NaN inputs, which
// collectives rely on for identical results on every rank. bf16, f16 and fp8 accumulate each pair in
// float32 and round the result back once. Integer sums and products wrap around.
func Reduce(t Type, op Op, dst, src []byte) {
	if len(dst) != len(src) {
		panic(fmt.Sprintf("dtype: Reduce on %d and %d bytes", len(dst), len(src)))
	}
	if op == Avg {
		op = Sum
	}
	switch t {
	case F32:
		d, s := FromBytes[float32](dst), FromBytes[float32](src)
		if op == Sum && len(d) > 0 {
			// gonum's assembly axpy: y += 1*x is exactly y+x (one rounding).
			blas32.Axpy(1, blas32.Vector{N: len(s), Inc: 1, Data: s}, blas32.Vector{N: len(d), Inc: 1, Data: d})
			return
		}
		native(op, d, s)
	case F64:
		d, s := FromBytes[float64](dst), FromBytes[float64](src)
		if op == Sum && len(d) > 0 {
			blas64.Axpy(1, blas64.Vector{N: len(s), Inc: 1, Data: s}, blas64.Vector{N: len(d), Inc: 1, Data: d})
			return
		}
		native(op, d, s)
	case I32:
		native(op, FromBytes[int32](dst), FromBytes[int32](src))
	case I64:
		native(op, FromBytes[int64](dst), FromBytes[int64](src))
	case U8:
		native(op, dst, src)
	case I8:
		native(op, FromBytes[int8](dst), FromBytes[int8](src))
	case BF16:
		reduceBF16(op, FromBytes[BFloat16](dst), FromBytes[BFloat16](src))
	case F16:
		reduceF16(op, FromBytes[Float16](dst), FromBytes[Float16](src))
	case FP8E4M3:
		reduceFP8(op, FromBytes[FP8E4M3Val](dst), FromBytes[FP8E4M3Val](src))
	default:
		panic(fmt.Sprintf("dtype: Reduce on %v", t))
	}
}

type number interface {
	~float32 | ~float64 | ~int32 | ~int64 | ~uint8 | ~int8
}

func native[T number](op Op, d, s []T) {
	s = s[:len(d)]
	switch op {
	case Sum:
		for i := range d {
			d[i] += s[i]
		}
	case Prod:
		for i := range d {
			d[i] *= s[i]
		}
	case Min:
		for i := range d {
			d[i] = min(d[i], s[i])
		}
	case Max:
		for i := range d {
			d[i] = max(d[i], s[i])
		}
	default:
		panic(fmt.Sprintf("dtype: reduction %v", op))
	}
}

// The narrow-float kernels are written out per type so that the conversions inline (a
// generic kernel calling them through function values ran at 0.4 GB/s).

func reduceBF16(op Op, d, s []BFloat16) {
	s = s[:len(d)]
	switch op {
	case Sum:
		k := bf16SumFast(d, s)
		d, s = d[k:], s[k:]
		for i := range d {
			d[i] = ToBF16(d[i].Float32() + s[i].Float32())
		}
	case Prod:
		for i := range d {
			d[i] = ToBF16(d[i].Float32() * s[i].Float32())
		}
	case Min:
		for i := range d {
			d[i] = ToBF16(min(d[i].Float32(), s[i].Float32()))
		}
	case Max:
		for i := range d {
			d[i] = ToBF16(max(d[i].Float32(), s[i].Float32()))
		}
	default:
		panic(fmt.Sprintf("dtype: reduction %v", op))
	}
}

// f16Table maps every binary16 encoding to its float32 value.
var f16Table = func() *[1 << 16]float32 {
	var t [1 << 16]float32
	for i := range t {
		t[i] = Float16(i).Float32()
	}
	return &t
}()

func reduceF16(op Op, d, s []Float16) {
	s = s[:len(d)]
	t := f16Table
	switch op {
	case Sum:
		for i := range d {
			d[i] = ToF16(t[d[i]] + t[s[i]])
		}
	case Prod:
		for i := range d {
			d[i] = ToF16(t[d[i]] * t[s[i]])
		}
	case Min:
		for i := range d {
			d[i] = ToF16(min(t[d[i]], t[s[i]]))
		}
	case Max:
		for i := range d {
			d[i] = ToF16(max(t[d[i]], t[s[i]]))
		}
	default:
		panic(fmt.Sprintf("dtype: reduction %v", op))
	}
}

var fp8Table = func() *[256]float32 {
	var t [256]float32
	for i := range t {
		t[i] = FP8E4M3Val(i).Float32()
	}
	return &t
}()

func reduceFP8(op Op, d, s []FP8E4M3Val) {
	s = s[:len(d)]
	t := fp8Table
	switch op {
	case Sum:
		for i := range d {
			d[i] = ToFP8(t[d[i]] + t[s[i]])
		}
	case Prod:
		for i := range d {
			d[i] = ToFP8(t[d[i]] * t[s[i]])
		}
	case Min:
		for i := range d {
			d[i] = ToFP8(min(t[d[i]], t[s[i]]))
		}
	case Max:
		for i := range d {
			d[i] = ToFP8(max(t[d[i]], t[s[i]]))
		}
	default:
		panic(fmt.Sprintf("dtype: reduction %v", op))
	}
}

// Finish applies what op needs once all n contributions are reduced: Avg divides by n
// (integers truncate toward zero; the sum itself wrapped if it overflowed). Other ops need
// nothing.
func Finish(t Type, op Op, buf []byte, n int) {
	if op != Avg || n == 1 {
		return
	}
	switch t {
	case F32:
		d := FromBytes[float32](buf)
		for i := range d {
			d[i] /= float32(n)
		}
	case F64:
		d := FromBytes[float64](buf)
		for i := range d {
			d[i] /= float64(n)
		}
	case I32:
		divInt(FromBytes[int32](buf), n)
	case I64:
		divInt(FromBytes[int64](buf), n)
	case U8:
		divInt(buf, n)
	case I8:
		divInt(FromBytes[int8](buf), n)
	case BF16:
		d := FromBytes[BFloat16](buf)
		for i := range d {
			d[i] = ToBF16(d[i].Float32() / float32(n))
		}
	case F16:
		d := FromBytes[Float16](buf)
		for i := range d {
			d[i] = ToF16(d[i].Float32() / float32(n))
		}
	case FP8E4M3:
		d := FromBytes[FP8E4M3Val](buf)
		for i := range d {
			d[i] = ToFP8(d[i].Float32() / float32(n))
		}
	}
}

func divInt[T ~int32 | ~int64 | ~uint8 | ~int8](d []T, n int) {
	for i := range d {
		d[i] = T(int64(d[i]) / int64(n))
	}
}
