package bench

import (
	"unsafe"

	"context"
	"math"
	"runtime"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/models"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
)

// What the MoE bench measures beside its timed steps: the step's error, the pair period,
// the chunked pipeline, the floors the stages are held to.

// identityError is the relative error of out, this rank's combined tokens from identity
// experts, against each token's input times the sum of its valid choices' weights (in
// float64), over every rank's tokens: sqrt(sum (out-ref)^2 / sum ref^2).
func identityError[T combine.Act](ctx context.Context, c *coll.Comm, x []T, r *router.Routing, out []T, hid int) (float64, error) {
	sums := make([]float64, 2) // squared error, squared reference
	xf, of := make([]float32, hid), make([]float32, hid)
	for t := 0; t < r.T; t++ {
		w := 0.0
		for j := 0; j < r.K; j++ {
			if r.Experts[t*r.K+j] >= 0 {
				w += float64(r.Weights[t*r.K+j])
			}
		}
		dtype.Convert(xf, x[t*hid:(t+1)*hid])
		dtype.Convert(of, out[t*hid:(t+1)*hid])
		for i := range xf {
			ref := w * float64(xf[i])
			d := float64(of[i]) - ref
			sums[0] += d * d
			sums[1] += ref * ref
		}
	}
	if err := coll.AllReduce(ctx, c, nil, sums, dtype.Sum); err != nil {
		return 0, err
	}
	if sums[1] == 0 {
		return 0, nil
	}
	return math.Sqrt(sums[0] / sums[1]), nil
}

// pairPeriod times n dispatch-then-combine pairs back to back (the expert outputs are a
// fixed buffer, or the combine's where it reads them in place: the pair moves the bytes,
// nothing computes) and returns, in microseconds, the slowest rank's mean time per pair
// and the slowest rank's p50 and p99 of the pairs' times.
func pairPeriod[T combine.Act](ctx context.Context, c *coll.Comm, ep *models.EP[T], x []T, r *router.Routing, out []T, n int) (mean, p50, p99 float64, err error) {
	hid := ep.L.Cfg.Hidden
	var y []T
	pair := func() error {
		o, h, err := ep.D.Dispatch(ctx, x, r)
		if err != nil {
			return err
		}
		ys := ep.C.Buffer(h)
		if ys == nil {
			if cap(y) < o.Rows()*hid {
				y = make([]T, o.Rows()*hid)
			}
			ys = y[:o.Rows()*hid]
		}
		return ep.C.Combine(ctx, h, ys, out)
	}
	// One pair untimed: the first allocates the expert outputs, and faulting in their
	// pages (tens of MiB at 128 tokens) would be timed as one pair's.
	if err := pair(); err != nil {
		return 0, 0, 0, err
	}
	ts := make([]float64, 0, n)
	if err := coll.Barrier(ctx, c); err != nil {
		return 0, 0, 0, err
	}
	start := time.Now()
	last := start
	for i := 0; i < n; i++ {
		if err := pair(); err != nil {
			return 0, 0, 0, err
		}
		now := time.Now()
		ts = append(ts, float64(now.Sub(last).Nanoseconds())/1e3)
		last = now
	}
	v := []float64{time.Since(start).Seconds() / float64(max(n, 1)) * 1e6, percentile(ts, 0.5), percentile(ts, 0.99)}
	if err := coll.AllReduce(ctx, c, nil, v, dtype.Max); err != nil {
		return 0, 0, 0, err
	}
	return v[0], v[1], v[2], nil
}

// overlap times the step as chunks micro-batches one after the other and pipelined
// (combine.Pipeline), and returns the slowest rank's mean time of each.
func overlap[T combine.Act](ctx context.Context, c *coll.Comm, ep *models.EP[T], x []T, r *router.Routing, out []T, chunks, iters int, experts func(*dispatch.Output[T]) error) (serial, pipelined float64, err error) {
	run := func(o *dispatch.Output[T]) ([]T, error) {
		if err := experts(o); err != nil {
			return nil, err
		}
		return ep.Output(), nil
	}
	hid := ep.L.Cfg.Hidden
	serialStep := func() error {
		for i := 0; i < chunks; i++ {
			a, b := r.T*i/chunks, r.T*(i+1)/chunks
			ri := &router.Routing{T: b - a, K: r.K, E: r.E, Experts: r.Experts[a*r.K : b*r.K], Weights: r.Weights[a*r.K : b*r.K]}
			if err := ep.C.Pipeline(ctx, ep.D, x[a*hid:b*hid], ri, 1, run, out[a*hid:b*hid]); err != nil {
				return err
			}
		}
		return nil
	}
	pipeStep := func() error { return ep.C.Pipeline(ctx, ep.D, x, r, chunks, run, out) }
	var ts, tp time.Duration
	for i := 0; i < iters+1; i++ {
		for k, f := range []func() error{serialStep, pipeStep} {
			if err := coll.Barrier(ctx, c); err != nil {
				return 0, 0, err
			}
			start := time.Now()
			if err := f(); err != nil {
				return 0, 0, err
			}
			if i > 0 { // the first round warms up
				if k == 0 {
					ts += time.Since(start)
				} else {
					tp += time.Since(start)
				}
			}
		}
	}
	v := []float64{ts.Seconds() / float64(iters) * 1e6, tp.Seconds() / float64(iters) * 1e6}
	if err := coll.AllReduce(ctx, c, nil, v, dtype.Max); err != nil {
		return 0, 0, err
	}
	return v[0], v[1], nil
}

// stepFloors times every rank copying once, in the cache state of a step, what its
// stages move, each iteration as a stage is timed (every rank starting together, the
// slowest rank's time) and returns the p50s over iters: after the experts have run (on
// out, the last dispatch's output, as in a step), the sent bytes of the dispatch, taken
// from the tokens x a payload (bytes of a row on the wire) at a time, into one buffer;
// then the combine's reads, the expert outputs y(), row by row into another; where ranks
// outnumber the host's CPUs, no less than all the ranks' copying shared among them. What the
// stages add to these copies is their protocol, their waiting for one another and their
// writes into other ranks' memory. StageFloor is the same bytes copied with warm caches.
func stepFloors[T combine.Act](ctx context.Context, c *coll.Comm, out *dispatch.Output[T], x []T, tokens, hid int,
	y func() []T, experts func(*dispatch.Output[T]) error, iters, payload, sent int, conv func() int) (disp, comb float64, err error) {
	if out == nil || iters <= 0 || tokens == 0 {
		return 0, 0, nil
	}
	xb := dtype.Bytes(x)
	rowB := len(xb) / tokens
	pay := max(min(payload, rowB), 1)
	dbuf := make([]byte, sent)
	var cbuf []T
	times := make([]float64, 2*iters)
	for i := 0; i < iters; i++ {
		if err := coll.Barrier(ctx, c); err != nil {
			return 0, 0, err
		}
		t0 := time.Now()
		for off, t := 0, 0; off < sent; t = (t + 1) % tokens {
			off += copy(dbuf[off:min(off+pay, sent)], xb[t*rowB:])
		}
		if conv != nil {
			conv()
		}
		times[2*i] = time.Since(t0).Seconds()
		if err := experts(out); err != nil {
			return 0, 0, err
		}
		if err := coll.Barrier(ctx, c); err != nil {
			return 0, 0, err
		}
		ys := y()[:out.Rows()*hid]
		if cbuf == nil {
			cbuf = make([]T, len(ys))
		}
		t1 := time.Now()
		for r := 0; r < len(ys); r += hid {
			copy(cbuf[r:r+hid], ys[r:r+hid])
		}
		times[2*i+1] = time.Since(t1).Seconds()
	}
	// The slowest rank's copy, or, where ranks outnumber CPUs and so copy in turns, every
	// rank's copying shared among the CPUs, whichever is longer.
	sum := append([]float64(nil), times...)
	if err := coll.AllReduce(ctx, c, nil, times, dtype.Max); err != nil {
		return 0, 0, err
	}
	if err := coll.AllReduce(ctx, c, nil, sum, dtype.Sum); err != nil {
		return 0, 0, err
	}
	cpus := float64(min(c.Size(), runtime.NumCPU()))
	d, cm := make([]float64, iters), make([]float64, iters)
	for i := range d {
		d[i], cm[i] = max(times[2*i], sum[2*i]/cpus), max(times[2*i+1], sum[2*i+1]/cpus)
	}
	return percentile(d, 0.5), percentile(cm, 0.5), nil
}

// conversions returns what a dispatch computes besides moving bytes, for its step floor:
// each of the rank's tokens in x converted into the wire type once, and, unless the
// experts take the quantised rows, each of the rows it received converted back. The
// conversions run on one row of scratch, whose bytes the floor's copy already counts; the
// function returns how many rows it converted. It is nil where the wire type is the
// activations'.
func conversions[T combine.Act](x []T, tokens, hid int, wire dtype.Type, quantized bool, rows int) func() int {
	if wire == dtype.Of[T]() {
		return nil
	}
	q := make([]byte, hid*wire.Size())
	sc := make([]float32, max(dtype.FP8Scales(hid), 1))
	back := make([]T, hid)
	var enc func(row []T)
	var dec func()
	switch wire {
	case dtype.FP8E4M3:
		enc = func(row []T) { dtype.QuantizeFP8(q, sc, row, false) }
		dec = func() { dtype.DequantizeFP8(back, q, sc) }
	case dtype.I8:
		enc = func(row []T) { sc[0] = dtype.QuantizeI8(q, row) }
		dec = func() { dtype.DequantizeI8(back, q, sc[0]) }
	case dtype.BF16:
		w := dtype.FromBytes[dtype.BFloat16](q)
		enc = func(row []T) { dtype.Convert(w, row) }
		dec = func() { dtype.Convert(back, w) }
	case dtype.F32:
		w := dtype.FromBytes[float32](q)
		enc = func(row []T) { dtype.Convert(w, row) }
		dec = func() { dtype.Convert(back, w) }
	default:
		return nil
	}
	if quantized {
		rows = 0
	}
	return func() int {
		for t := 0; t < tokens; t++ {
			enc(x[t*hid : (t+1)*hid])
		}
		for r := 0; r < rows; r++ {
			dec()
		}
		return tokens + rows
	}
}

// decodedRows is how many rows the dispatch that gave out converted for its experts: one
// per row its entries name (in the low-latency mode entries of one token share its row).
func decodedRows[T combine.Act](out *dispatch.Output[T]) int {
	seen := make(map[uintptr]struct{}, out.Rows())
	for j := 0; j < out.Rows(); j++ {
		if e := out.Entry(j); len(e) > 0 {
			seen[uintptr(unsafe.Pointer(&e[0]))] = struct{}{}
		} else if q, _ := out.QEntry(j); len(q) > 0 {
			seen[uintptr(unsafe.Pointer(&q[0]))] = struct{}{}
		}
	}
	return len(seen)
}

// StageFloor is a lower bound for a stage in which rank q puts bytes[q] on the wire and
// each byte moves once: the best time, over a few tries, of copying every rank's bytes
// once into another buffer with as many threads as there are CPUs (at most one per
// rank), alternating Go's copy, memx.Copy and memx.Stream.
func StageFloor(bytes []int) time.Duration {
	p := len(bytes)
	total := 0
	for _, n := range bytes {
		total += n
	}
	if p == 0 || total == 0 {
		return 0
	}
	// Where ranks outnumber CPUs the shm transport's progress loop sleeps holding a P (see
	// its rawParks): one P more, so that the copies still have a P per CPU.
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(runtime.GOMAXPROCS(0) + 1))
	src, dst := make([]*obuf.Buf, p), make([]*obuf.Buf, p)
	for q, n := range bytes {
		src[q], dst[q] = obuf.Default.Get(max(n, 1)), obuf.Default.Get(max(n, 1))
		defer src[q].Release()
		defer dst[q].Release()
		clear(src[q].Bytes()) // fault the pages in
		clear(dst[q].Bytes())
	}
	return fastestCopy(min(p, runtime.NumCPU()), max(5, min(100, (256<<20)/total)), func(cp func(dst, src []byte), w, threads int) {
		for q := w; q < p; q += threads {
			cp(dst[q].Bytes()[:bytes[q]], src[q].Bytes()[:bytes[q]])
		}
	})
}
