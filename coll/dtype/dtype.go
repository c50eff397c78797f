// Package dtype defines the element types moex moves and reduces (f32, f64, i32, i64, u8,
// i8, bf16, f16, fp8-e4m3), exact conversions between the narrow floats and float32, and
// the reduction kernels (sum, prod, min, max, avg) that collectives apply to byte buffers.
//
// It owns the numerics and nothing else: no I/O, no knowledge of ranks. The hot kernels
// use gonum's assembly (blas32/blas64 axpy) for f32 and f64 sums; see kernels.go and the
// benchmarks beside copy() in dtype_test.go.
package dtype

import (
	"fmt"
	"unsafe"
)

// Type is an element type.
type Type uint8

const (
	F32 Type = iota + 1
	F64
	I32
	I64
	U8
	I8
	BF16
	F16
	FP8E4M3
	typeEnd
)

var typeInfo = [...]struct {
	name string
	size int
}{
	F32: {"f32", 4}, F64: {"f64", 8}, I32: {"i32", 4}, I64: {"i64", 8}, U8: {"u8", 1},
	I8: {"i8", 1}, BF16: {"bf16", 2}, F16: {"f16", 2}, FP8E4M3: {"fp8e4m3", 1},
}

// Types lists every type.
var Types = []Type{F32, F64, I32, I64, U8, I8, BF16, F16, FP8E4M3}

// Valid reports whether t is a known type.
func (t Type) Valid() bool { return t > 0 && t < typeEnd }

// Size is the size of one element in bytes.
func (t Type) Size() int {
	if !t.Valid() {
		return 0
	}
	return typeInfo[t].size
}

func (t Type) String() string {
	if !t.Valid() {
		return fmt.Sprintf("dtype(%d)", uint8(t))
	}
	return typeInfo[t].name
}

// Parse returns the type named s ("f32", "bf16", ...; "float32" and "float" also work).
func Parse(s string) (Type, error) {
	switch s {
	case "float", "float32", "fp32":
		return F32, nil
	case "double", "float64", "fp64":
		return F64, nil
	case "int32", "int":
		return I32, nil
	case "int64":
		return I64, nil
	case "uint8", "byte":
		return U8, nil
	case "int8":
		return I8, nil
	case "bfloat16":
		return BF16, nil
	case "float16", "half", "fp16":
		return F16, nil
	case "fp8", "e4m3", "float8_e4m3fn":
		return FP8E4M3, nil
	}
	for _, t := range Types {
		if t.String() == s {
			return t, nil
		}
	}
	return 0, fmt.Errorf("dtype: unknown type %q", s)
}

// Floating reports whether t is a floating-point type.
func (t Type) Floating() bool {
	switch t {
	case F32, F64, BF16, F16, FP8E4M3:
		return true
	}
	return false
}

// BFloat16 is a bfloat16 value (the top half of a float32).
type BFloat16 uint16

// Float16 is an IEEE 754 binary16 value.
type Float16 uint16

// FP8E4M3Val is an OCP 8-bit float, E4M3 "fn" variant: 4 exponent bits (bias 7), 3
// mantissa bits, no infinities, NaN = S.1111.111, largest finite 448.
type FP8E4M3Val uint8

// Elem is the set of Go element types with a dtype (FP8E4M3Val is in through ~uint8).
type Elem interface {
	~float32 | ~float64 | ~int32 | ~int64 | ~uint8 | ~int8 | BFloat16 | Float16
}

// Of returns the dtype of T.
func Of[T Elem]() Type {
	var z T
	switch any(z).(type) {
	case float32:
		return F32
	case float64:
		return F64
	case int32:
		return I32
	case int64:
		return I64
	case uint8:
		return U8
	case int8:
		return I8
	case BFloat16:
		return BF16
	case Float16:
		return F16
	case FP8E4M3Val:
		return FP8E4M3
	}
	// Named types with these underlying types: decide by size and kind.
	switch unsafe.Sizeof(z) {
	case 1:
		if isSigned(z) {
			return I8
		}
		return U8
	case 4:
		if isFloat(z) {
			return F32
		}
		return I32
	case 8:
		if isFloat(z) {
			return F64
		}
		return I64
	}
	panic("dtype: unsupported element type")
}

func isSigned[T Elem](z T) bool {
	z--
	return z < 0 || isFloat(z)
}

func isFloat[T Elem](T) bool {
	var z T = 1
	z /= 2
	return z != 0
}

// Bytes views s as bytes without copying.
func Bytes[T Elem](s []T) []byte {
	if len(s) == 0 {
		return nil
	}
	var z T
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), len(s)*int(unsafe.Sizeof(z)))
}

// FromBytes views b as elements of T without copying. len(b) must be a multiple of the
// element size and b suitably aligned.
func FromBytes[T Elem](b []byte) []T {
	var z T
	n := len(b) / int(unsafe.Sizeof(z))
	if n == 0 {
		return nil
	}
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b))), n)
}
