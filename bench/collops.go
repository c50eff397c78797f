package bench

import (
	"context"
	"fmt"
	"math"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
)

// fromF64 rounds v to E (integers wrap as Go's conversions do).
func fromF64[E dtype.Elem](v float64) E {
	var z E
	switch any(z).(type) {
	case dtype.BFloat16:
		return any(dtype.ToBF16(float32(v))).(E)
	case dtype.Float16:
		return any(dtype.ToF16(float32(v))).(E)
	case dtype.FP8E4M3Val:
		return any(dtype.ToFP8(float32(v))).(E)
	case float32, float64:
		return E(v)
	}
	return E(int64(v))
}

// toF64 widens e.
func toF64[E dtype.Elem](e E) float64 {
	switch v := any(e).(type) {
	case dtype.BFloat16:
		return float64(v.Float32())
	case dtype.Float16:
		return float64(v.Float32())
	case dtype.FP8E4M3Val:
		return float64(v.Float32())
	case float32:
		return float64(v)
	case float64:
		return v
	case int32:
		return float64(v)
	case int64:
		return float64(v)
	case uint8:
		return float64(v)
	case int8:
		return float64(v)
	}
	return math.NaN()
}

// tolerance is the relative error a reduction of p contributions in t may carry
// against the exact result: 0 where every partial result is exact.
func tolerance(t dtype.Type, op dtype.Op, p int) float64 {
	switch t {
	case dtype.BF16:
		return float64(p) / 256
	case dtype.F16:
		return float64(p) / 2048
	case dtype.FP8E4M3:
		return float64(p) / 16
	case dtype.F32:
		if op == dtype.Avg {
			return 1e-6
		}
	case dtype.F64:
		if op == dtype.Avg {
			return 1e-14
		}
	}
	return 0
}

// redVal is rank r's input at index i of a reduction with op: small values, so that
// sums and products stay exact where the type allows; prod multiplies one 2 and ones.
func redVal(op dtype.Op, r, i, p int) float64 {
	switch op {
	case dtype.Prod:
		if i%p == r {
			return 2
		}
		return 1
	case dtype.Min, dtype.Max:
		return float64((r*7 + i) % 5)
	}
	return float64((r + i) % 3)
}

// redWant is the exact reduction of every rank's input at index i, as E rounds it.
func redWant[E dtype.Elem](op dtype.Op, i, p int) float64 {
	acc := redVal(op, 0, i, p)
	for q := 1; q < p; q++ {
		v := redVal(op, q, i, p)
		switch op {
		case dtype.Prod:
			acc *= v
		case dtype.Min:
			acc = math.Min(acc, v)
		case dtype.Max:
			acc = math.Max(acc, v)
		default:
			acc += v
		}
	}
	if op == dtype.Avg {
		acc /= float64(p)
		if !dtype.Of[E]().Floating() {
			acc = math.Trunc(acc)
		}
	}
	return toF64(fromF64[E](acc))
}

// moveVal is rank r's element i of a data movement (compared bit for bit).
func moveVal(r, i int) float64 { return float64((r*31 + i) % 97) }

// wrongRed counts the elements of got that miss the reduction of every rank's input by
// more than the type's tolerance; index(k) is the input index of got[k].
func wrongRed[E dtype.Elem](got []E, op dtype.Op, p int, index func(k int) int) int {
	tol := tolerance(dtype.Of[E](), op, p)
	wrong := 0
	for k, v := range got {
		want := redWant[E](op, index(k), p)
		if d := math.Abs(toF64(v) - want); d > tol*math.Max(1, math.Abs(want)) || math.IsNaN(d) {
			wrong++
		}
	}
	return wrong
}

// skewCounts splits n elements over p destinations with weight (j+1)^-skew: block j of
// an AlltoAllv whose ranks all send more to the low ranks, as skewed routing sends more
// to the hot experts' ranks (skew 0: equal blocks).
func skewCounts(n, p int, skew float64) []int {
	w, sum := make([]float64, p), 0.0
	for j := range w {
		w[j] = math.Pow(float64(j+1), -skew)
		sum += w[j]
	}
	counts, total := make([]int, p), 0
	for j := range counts {
		counts[j] = int(float64(n) * w[j] / sum)
		total += counts[j]
	}
	counts[0] += n - total
	return counts
}

// makeOp allocates buffers of E for one size, out of place or in place, and returns the
// operation, a reset of its inputs, a check of its output and the element count that
// names its algorithm. It reports errNoForm for a form the operation lacks.
func makeOp[E dtype.Elem](ctx context.Context, c *coll.Comm, o CollOpts, size int, inPlace bool) (benchOp, int, error) {
	p, r := c.Size(), c.Rank()
	es := o.DType.Size()
	n := size / es
	var bo benchOp
	mk := func(k int) []E {
		if o.Heap {
			return make([]E, k)
		}
		// obuf buffers, as a user following moex's advice would have them, held by bo
		// until the size is done.
		pool := obuf.Default
		if o.Shared {
			pool = obuf.Shared
		}
		b := pool.Get(max(es*k, 1))
		bo.bufs = append(bo.bufs, b)
		return dtype.FromBytes[E](b.Bytes())[:k]
	}
	fill := func(dst []E, f func(i int) float64) {
		for i := range dst {
			dst[i] = fromF64[E](f(i))
		}
	}
	moved := func(got []E, f func(k int) float64) int {
		wrong := 0
		for k, v := range got {
			if v != fromF64[E](f(k)) {
				wrong++
			}
		}
		return wrong
	}
	red := func(i int) float64 { return redVal(o.RedOp, r, i, p) }
	switch o.Op {
	case coll.OpAllReduce:
		recv := mk(n)
		send := recv
		if !inPlace {
			send = mk(n)
		}
		bo.prep = func() { fill(send, red) }
		bo.run = func() error { return coll.AllReduce(ctx, c, send, recv, o.RedOp) }
		bo.check = func() int { return wrongRed(recv, o.RedOp, p, func(k int) int { return k }) }
		return bo, n, nil
	case coll.OpReduce:
		recv := mk(n)
		send := recv
		if !inPlace {
			send = mk(n)
		}
		bo.prep = func() { fill(send, red) }
		bo.run = func() error {
			if inPlace && r == o.Root {
				return coll.Reduce(ctx, c, nil, recv, o.RedOp, o.Root)
			}
			return coll.Reduce(ctx, c, send, recv, o.RedOp, o.Root)
		}
		bo.check = func() int {
			if r != o.Root {
				return 0
			}
			return wrongRed(recv, o.RedOp, p, func(k int) int { return k })
		}
		return bo, n, nil
	case coll.OpReduceScatter:
		if inPlace {
			return bo, 0, errNoForm
		}
		blk := n / p
		send, recv := mk(n), mk(blk)
		bo.prep = func() { fill(send, red) }
		bo.run = func() error { return coll.ReduceScatter(ctx, c, send, recv, o.RedOp) }
		bo.check = func() int { return wrongRed(recv, o.RedOp, p, func(k int) int { return r*blk + k }) }
		return bo, blk, nil
	case coll.OpAllGather:
		blk := n / p
		recv := mk(n)
		send := recv[r*blk : (r+1)*blk]
		if !inPlace {
			send = mk(blk)
		}
		bo.prep = func() { fill(send, func(i int) float64 { return moveVal(r, i) }) }
		bo.run = func() error {
			if inPlace {
				return coll.AllGather(ctx, c, nil, recv)
			}
			return coll.AllGather(ctx, c, send, recv)
		}
		bo.check = func() int { return moved(recv, func(k int) float64 { return moveVal(k/blk, k%blk) }) }
		return bo, blk, nil
	case coll.OpAlltoAll:
		blk := n / p
		recv := mk(n)
		send := recv
		if !inPlace {
			send = mk(n)
		}
		bo.prep = func() { fill(send, func(i int) float64 { return moveVal(r, i) }) }
		bo.run = func() error { return coll.AlltoAll(ctx, c, send, recv) }
		bo.check = func() int { return moved(recv, func(k int) float64 { return moveVal(k/blk, r*blk+k%blk) }) }
		return bo, blk, nil
	case coll.OpAlltoAllv:
		if inPlace {
			return bo, 0, errNoForm
		}
		counts := skewCounts(n, p, o.Skew)
		displs := make([]int, p)
		for j := 1; j < p; j++ {
			displs[j] = displs[j-1] + counts[j-1]
		}
		rc, rd := make([]int, p), make([]int, p)
		for q := range rc {
			rc[q], rd[q] = counts[r], q*counts[r]
		}
		send, recv := mk(n), mk(p*counts[r])
		bo.prep = func() { fill(send, func(i int) float64 { return moveVal(r, i) }) }
		bo.run = func() error { return coll.AlltoAllv(ctx, c, send, counts, displs, recv, rc, rd) }
		bo.check = func() int {
			return moved(recv, func(k int) float64 { return moveVal(k/max(counts[r], 1), displs[r]+k%max(counts[r], 1)) })
		}
		return bo, counts[0], nil
	case coll.OpBroadcast:
		if !inPlace {
			return bo, 0, errNoForm
		}
		buf := mk(n)
		bo.prep = func() {
			fill(buf, func(i int) float64 {
				if r == o.Root {
					return moveVal(o.Root, i)
				}
				return 0
			})
		}
		bo.run = func() error { return coll.Broadcast(ctx, c, buf, o.Root) }
		bo.check = func() int { return moved(buf, func(k int) float64 { return moveVal(o.Root, k) }) }
		return bo, n, nil
	}
	return bo, 0, fmt.Errorf("bench: operation %v is not benchmarked (allreduce, alltoall, alltoallv, allgather, reducescatter, broadcast, reduce)", o.Op)
}

// makeOpOf picks makeOp's element type from o.DType.
func makeOpOf(ctx context.Context, c *coll.Comm, o CollOpts, size int, inPlace bool) (benchOp, int, error) {
	switch o.DType {
	case dtype.F32:
		return makeOp[float32](ctx, c, o, size, inPlace)
	case dtype.F64:
		return makeOp[float64](ctx, c, o, size, inPlace)
	case dtype.I32:
		return makeOp[int32](ctx, c, o, size, inPlace)
	case dtype.I64:
		return makeOp[int64](ctx, c, o, size, inPlace)
	case dtype.U8:
		return makeOp[uint8](ctx, c, o, size, inPlace)
	case dtype.I8:
		return makeOp[int8](ctx, c, o, size, inPlace)
	case dtype.BF16:
		return makeOp[dtype.BFloat16](ctx, c, o, size, inPlace)
	case dtype.F16:
		return makeOp[dtype.Float16](ctx, c, o, size, inPlace)
	case dtype.FP8E4M3:
		return makeOp[dtype.FP8E4M3Val](ctx, c, o, size, inPlace)
	}
	return benchOp{}, 0, fmt.Errorf("bench: element type %v", o.DType)
}
