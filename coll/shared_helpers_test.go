package coll

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport/shm"
)

// helperShared: AlltoAll through the shared areas (every rank on this host over shm):
// sizes through the area and read across, switching between them, blocking, in place,
// several in flight, against the point-to-point algorithm; every element checked, and no
// allocation per operation. Then the planned AlltoAllv (sharedV) and AllGather the same
// way.
func helperShared(ctx context.Context, c *Comm) error {
	p, r := c.Size(), c.Rank()
	if c.direct == nil || !c.SharedMemory() {
		return fmt.Errorf("no shared areas over %s", c.Transport().Name())
	}
	val := func(op, from, to, k int) int32 { return int32(op*1e7 + from*1e5 + to*1e3 + k%1000) }
	run := func(op, blk int, algo Algo, async bool) error {
		c.cfg.Algo = map[OpKind]Algo{OpAlltoAll: algo}
		defer func() { c.cfg.Algo = map[OpKind]Algo{} }()
		send, recv := make([]int32, blk*p), make([]int32, blk*p)
		if op%4 == 1 { // from shared buffers, read in place
			sb, rb := obuf.Shared.Get(4*blk*p), obuf.Shared.Get(4*blk*p)
			defer sb.Release()
			defer rb.Release()
			send, recv = dtype.FromBytes[int32](sb.Bytes()), dtype.FromBytes[int32](rb.Bytes())
		}
		for q := 0; q < p; q++ {
			for k := 0; k < blk; k++ {
				send[q*blk+k] = val(op, r, q, k)
			}
		}
		var err error
		switch {
		case async:
			var h *Handle
			if h, err = IAlltoAll(ctx, c, send, recv); err == nil {
				err = h.Wait(ctx)
			}
		case op%3 == 0: // in place
			copy(recv, send)
			err = AlltoAll(ctx, c, recv, recv)
		default:
			err = AlltoAll(ctx, c, send, recv)
		}
		if err != nil {
			return fmt.Errorf("op %d, %d per block, %v: %w", op, blk, algo, err)
		}
		for q := 0; q < p; q++ {
			for k := 0; k < blk; k++ {
				if got := recv[q*blk+k]; got != val(op, q, r, k) {
					return fmt.Errorf("op %d, %d per block, %v: element %d from rank %d is %d, want %d", op, blk, algo, k, q, got, val(op, q, r, k))
				}
			}
		}
		return nil
	}
	area := c.direct.Cap() / 4 / p // elements per block that fill the area
	blocks := []int{0, 1, 1000, area, area + 1, 1 << 18, 7, 1 << 18, area}
	for op, blk := range blocks {
		if a := c.choose(OpAlltoAll, blk*4); a != Shared && blk > 0 {
			return fmt.Errorf("%d-byte blocks: the model chose %v, want shared", blk*4, a)
		}
		if err := run(op, blk, AlgoAuto, false); err != nil {
			return err
		}
		if err := run(op+100, blk, Linear, false); err != nil {
			return err
		}
		if err := run(op+200, blk, Shared, op%2 == 1); err != nil {
			return err
		}
	}
	if tr, ok := c.Transport().(*shm.Transport); !ok || tr.Stats().SharedBytes == 0 {
		return fmt.Errorf("no bytes read in place from shared buffers (transport %s)", c.Transport().Name())
	}
	// Several in flight at once: they run in issue order.
	var hs []*Handle
	bufs := make([][]int32, 6)
	for i := range bufs {
		blk := 100 * (i + 1)
		if i == 3 {
			blk = area + 64 // read across
		}
		send := make([]int32, blk*p)
		for q := 0; q < p; q++ {
			for k := 0; k < blk; k++ {
				send[q*blk+k] = val(300+i, r, q, k)
			}
		}
		bufs[i] = make([]int32, blk*p)
		h, err := IAlltoAll(ctx, c, send, bufs[i])
		if err != nil {
			return err
		}
		hs = append(hs, h)
	}
	for i, h := range hs {
		if err := h.Wait(ctx); err != nil {
			return fmt.Errorf("in flight %d: %w", i, err)
		}
		blk := len(bufs[i]) / p
		for q := 0; q < p; q++ {
			for k := 0; k < blk; k++ {
				if got := bufs[i][q*blk+k]; got != val(300+i, q, r, k) {
					return fmt.Errorf("in flight %d: element %d from rank %d is %d", i, k, q, got)
				}
			}
		}
	}
	if err := sharedV(ctx, c, val); err != nil {
		return err
	}
	if err := sharedReduce(ctx, c); err != nil {
		return err
	}
	if err := sharedGather(ctx, c, val); err != nil {
		return err
	}
	return Barrier(ctx, c)
}

// sharedGather: AllGather and AllGatherv through the shared areas, against the ring, and
// AllGather and AlltoAll without allocating.
func sharedGather(ctx context.Context, c *Comm, val func(op, from, to, k int) int32) error {
	p, r := c.Size(), c.Rank()
	area := c.direct.Cap() / 4 / p // elements per block that fill the area
	// AllGather: blocks through the area and read across, in place and not (the others
	// then read a Go slice's, obuf's huge pages or obuf.Shared's arena), against ring.
	for op, blk := range []int{1, 1000, area * p, area*p + 1, 1 << 18, 0, 33, 1 << 16, 1 << 16} {
		if a := c.choose(OpAllGather, blk*4); a != Shared && blk > 0 {
			return fmt.Errorf("allgather of %d-byte blocks: the model chose %v, want shared", blk*4, a)
		}
		for _, algo := range []Algo{AlgoAuto, Ring} {
			c.cfg.Algo = map[OpKind]Algo{OpAllGather: algo}
			mine, all := make([]int32, blk), make([]int32, blk*p)
			if op >= 7 && blk > 0 { // op 7 from obuf's huge pages, op 8 from the shared arena
				pool := obuf.Default
				if op == 8 {
					pool = obuf.Shared
				}
				b := pool.Get(4 * blk)
				defer b.Release()
				mine = dtype.FromBytes[int32](b.Bytes())
			}
			for k := range mine {
				mine[k] = val(500+op, r, 0, k)
			}
			var err error
			if op%2 == 0 || op >= 7 {
				err = AllGather(ctx, c, mine, all)
			} else { // in place
				copy(all[r*blk:], mine)
				err = AllGather(ctx, c, nil, all)
			}
			c.cfg.Algo = map[OpKind]Algo{}
			if err != nil {
				return fmt.Errorf("allgather op %d, %d per block, %v: %w", op, blk, algo, err)
			}
			for q := 0; q < p; q++ {
				for k := 0; k < blk; k++ {
					if got := all[q*blk+k]; got != val(500+op, q, 0, k) {
						return fmt.Errorf("allgather op %d, %d per block, %v: element %d from rank %d is %d", op, blk, algo, k, q, got)
					}
				}
			}
		}
	}
	// AllGatherv: uneven blocks (one empty), packed and scattered, through the area and
	// read across, chosen by the model and forced, against ring.
	for op, base := range []int{1, 300, area, 1 << 16} {
		for _, scattered := range []bool{false, true} {
			counts := make([]int, p)
			for q := range counts {
				counts[q] = ((q*7 + 3) % 5) * base
			}
			counts[p-1] = 0
			var displs []int
			size := sum(counts)
			if scattered {
				displs = make([]int, p)
				o := 1
				for q := p - 1; q >= 0; q-- {
					displs[q] = o
					o += counts[q] + 3
				}
				size = o
			}
			if a := c.chooseFit(OpAllGatherv, size*4/p, c.direct.Fits(4*slices.Max(counts))); a != Shared {
				return fmt.Errorf("allgatherv of %d-element blocks: the model chose %v, want shared", base, a)
			}
			for _, algo := range []Algo{AlgoAuto, Ring} {
				c.cfg.Algo = map[OpKind]Algo{OpAllGatherv: algo}
				mine, all := make([]int32, counts[r]), make([]int32, size)
				for k := range mine {
					mine[k] = val(700+op, r, 0, k)
				}
				err := AllGatherv(ctx, c, mine, all, counts, displs)
				c.cfg.Algo = map[OpKind]Algo{}
				if err != nil {
					return fmt.Errorf("allgatherv %d per block, scattered %v, %v: %w", base, scattered, algo, err)
				}
				for q := 0; q < p; q++ {
					d := displOf(counts, displs, q)
					for k := 0; k < counts[q]; k++ {
						if got := all[d+k]; got != val(700+op, q, 0, k) {
							return fmt.Errorf("allgatherv %d per block, scattered %v, %v: element %d from rank %d is %d", base, scattered, algo, k, q, got)
						}
					}
				}
			}
		}
	}
	mine, all := make([]float32, 256), make([]float32, 256*p)
	if n := testing.AllocsPerRun(30, func() {
		if err := AllGather(ctx, c, mine, all); err != nil {
			panic(err)
		}
	}); n != 0 {
		return fmt.Errorf("allgather through the shared areas: %v allocations per operation", n)
	}
	for _, blk := range []int{1024, area + 16} {
		send, recv := make([]float32, blk*p), make([]float32, blk*p)
		if n := testing.AllocsPerRun(50, func() {
			if err := AlltoAll(ctx, c, send, recv); err != nil {
				panic(err)
			}
		}); n != 0 {
			return fmt.Errorf("%d-byte blocks through the shared areas: %v allocations per operation", blk*4, n)
		}
		sb := obuf.Shared.Get(4 * blk * p)
		defer sb.Release()
		send = dtype.FromBytes[float32](sb.Bytes())
		if n := testing.AllocsPerRun(50, func() {
			if err := AlltoAll(ctx, c, send, recv); err != nil {
				panic(err)
			}
		}); n != 0 {
			return fmt.Errorf("%d-byte blocks from a shared buffer: %v allocations per operation", blk*4, n)
		}
	}
	return nil
}

// sharedV: AlltoAllv planned from the whole count matrix (the MoE dispatch and combine)
// through the shared areas: rows of every length (zeros, through the area, read across,
// both in one operation), against the point-to-point plan; every element checked, and a
// stream of new matrices replanned and run without allocating.
func sharedV(ctx context.Context, c *Comm, val func(op, from, to, k int) int32) error {
	p, r := c.Size(), c.Rank()
	area := c.direct.Cap() / 4 // elements in a row that fills the area
	counts := func(op int) [][]int {
		m := make([][]int, p)
		for q := range m {
			m[q] = make([]int, p)
			for j := range m[q] {
				switch (op + 2*q + j) % 4 {
				case 0:
					m[q][j] = 0
				case 1:
					m[q][j] = 1 + j
				case 2:
					m[q][j] = area/p + op // rows beyond the area, some ops
				default:
					m[q][j] = 97 * (q + 1)
				}
			}
		}
		return m
	}
	var vp VPlan
	for op := 0; op < 12; op++ {
		m := counts(op)
		for _, algo := range []Algo{AlgoAuto, Linear} {
			c.cfg.Algo = map[OpKind]Algo{OpAlltoAllv: algo}
			err := c.ReplanAlltoAllv(&vp, m, 4)
			c.cfg.Algo = map[OpKind]Algo{}
			if err != nil {
				return err
			}
			if want := cmp.Or(algo, Shared); vp.Algo != want {
				return fmt.Errorf("alltoallv op %d: planned %v, want %v", op, vp.Algo, want)
			}
			send, recv := make([]int32, vp.SendBytes()/4+3), make([]int32, vp.RecvBytes()/4)
			at := 0
			for j := 0; j < p; j++ {
				for k := 0; k < m[r][j]; k++ {
					send[at] = val(400+op, r, j, k)
					at++
				}
			}
			if err := c.RunAlltoAllv(ctx, &vp, dtype.Bytes(send), dtype.Bytes(recv)); err != nil {
				return fmt.Errorf("alltoallv op %d, %v: %w", op, vp.Algo, err)
			}
			at = 0
			for q := 0; q < p; q++ {
				for k := 0; k < m[q][r]; k++ {
					if got := recv[at]; got != val(400+op, q, r, k) {
						return fmt.Errorf("alltoallv op %d, %v: element %d from rank %d is %d, want %d", op, vp.Algo, k, q, got, val(400+op, q, r, k))
					}
					at++
				}
			}
		}
	}
	// The blocks where the caller lays them out: in reverse rank order with a gap of
	// three elements before each, on both sides; the receive buffer's gaps keep their
	// bytes.
	for op := 0; op < 4; op++ {
		m, sendOff, recvOff := counts(op), make([][]int, p), make([]int, p)
		for q := range m {
			sendOff[q] = make([]int, p)
			o := 0
			for j := p - 1; j >= 0; j-- {
				m[q][j] %= 200
				sendOff[q][j], o = o+3, o+3+m[q][j]
			}
		}
		o := 0
		for q := p - 1; q >= 0; q-- {
			recvOff[q], o = o+3, o+3+m[q][r]
		}
		if err := c.ReplanAlltoAllvAt(&vp, m, 4, sendOff, recvOff); err != nil {
			return err
		}
		if vp.Algo != Shared {
			return fmt.Errorf("alltoallv at offsets, op %d: planned %v, want shared", op, vp.Algo)
		}
		send, recv := make([]int32, vp.SendBytes()/4), make([]int32, vp.RecvBytes()/4)
		for j := 0; j < p; j++ {
			for k := 0; k < m[r][j]; k++ {
				send[sendOff[r][j]+k] = val(500+op, r, j, k)
			}
		}
		for i := range recv {
			recv[i] = -7
		}
		if err := c.RunAlltoAllv(ctx, &vp, dtype.Bytes(send), dtype.Bytes(recv)); err != nil {
			return fmt.Errorf("alltoallv at offsets, op %d: %w", op, err)
		}
		want := make([]int32, len(recv))
		for i := range want {
			want[i] = -7
		}
		for q := 0; q < p; q++ {
			for k := 0; k < m[q][r]; k++ {
				want[recvOff[q]+k] = val(500+op, q, r, k)
			}
		}
		if !slices.Equal(want, recv) {
			return fmt.Errorf("alltoallv at offsets, op %d: rank %d received %v, want %v", op, r, recv, want)
		}
	}
	ms := [][][]int{counts(1), counts(2), counts(3)}
	send, recv := make([]byte, 4*p*(area+100)), make([]byte, 4*p*(area+100))
	i := 0
	if n := testing.AllocsPerRun(30, func() {
		i++
		if err := c.ReplanAlltoAllv(&vp, ms[i%3], 4); err != nil {
			panic(err)
		}
		if err := c.RunAlltoAllv(ctx, &vp, send, recv); err != nil {
			panic(err)
		}
	}); n != 0 {
		return fmt.Errorf("alltoallv through the shared areas: %v allocations per replan and run", n)
	}
	return nil
}

// sharedReduce: AllReduce and ReduceScatter through the shared areas, against the ring
// and against sums computed here: buffers of fewer elements than ranks, uneven blocks,
// exactly the area and one element more (which must not go through it), sum, avg and
// max, in place and not; then without allocating.
func sharedReduce(ctx context.Context, c *Comm) error {
	p, r := c.Size(), c.Rank()
	area := c.direct.Cap() / 4 // f32 elements that fill the area
	if crowded := p > runtime.NumCPU(); crowded && c.choose(OpAllReduce, 4096) != Shared {
		return fmt.Errorf("allreduce of 4 KiB, %d ranks on %d CPUs: the model chose %v, want shared", p, runtime.NumCPU(), c.choose(OpAllReduce, 4096))
	}
	// Larger buffers than the area are combined in place in the ranks' buffers, where
	// they can be read across, and that beats the ring; else they must not go through it.
	if a := c.choose(OpAllReduce, 64*area); c.direct.CanReduceAcross() != (a == Shared) {
		return fmt.Errorf("allreduce of %d bytes, %d-byte area, read across %v: the model chose %v", 64*area, 4*area, c.direct.CanReduceAcross(), a)
	}
	defer func() { c.cfg.Algo = map[OpKind]Algo{} }()
	x := func(op, q, k int) float32 { return float32((op*131+q*17+k*7)%1000 - 300) }
	// area+1 and more: combined across, a chunk at a time (several per block for the
	// largest), from private buffers and from obuf.Shared's (op 6: read in place).
	for op, n := range []int{1, p - 1, 1000, area, area + 1, 3*p + 1, 2*area + 40000*p + 3} {
		sb, rb := obuf.Shared.Get(4*n), obuf.Shared.Get(4*n)
		for _, redop := range []dtype.Op{dtype.Sum, dtype.Avg, dtype.Max} {
			want := make([]float32, n)
			for k := range want {
				var acc float32
				for q := 0; q < p; q++ {
					v := x(op, q, k)
					switch {
					case q == 0:
						acc = v
					case redop == dtype.Max:
						acc = max(acc, v)
					default:
						acc += v
					}
				}
				if redop == dtype.Avg {
					acc /= float32(p)
				}
				want[k] = acc
			}
			for _, algo := range []Algo{Shared, Ring} {
				c.cfg.Algo = map[OpKind]Algo{OpAllReduce: algo, OpReduceScatter: algo}
				send, recv := make([]float32, n), make([]float32, n)
				if op == 6 {
					send, recv = dtype.FromBytes[float32](sb.Bytes()), dtype.FromBytes[float32](rb.Bytes())
				}
				for k := range send {
					send[k] = x(op, r, k)
				}
				var err error
				if op%2 == 0 {
					err = AllReduce(ctx, c, send, recv, redop)
				} else {
					err = AllReduce(ctx, c, nil, send, redop)
					recv = send
				}
				if err != nil {
					return fmt.Errorf("allreduce op %d, %d elements, %v, %v: %w", op, n, redop, algo, err)
				}
				for k := range want {
					if recv[k] != want[k] {
						return fmt.Errorf("allreduce op %d, %d elements, %v, %v: element %d is %v, want %v", op, n, redop, algo, k, recv[k], want[k])
					}
				}
				// ReduceScatter of the same buffers cut into p blocks.
				b := n / p
				send = make([]float32, b*p)
				for k := range send {
					send[k] = x(op, r, k)
				}
				recv = make([]float32, b)
				if err = ReduceScatter(ctx, c, send, recv, redop); err != nil {
					return fmt.Errorf("reducescatter op %d, %d per block, %v, %v: %w", op, b, redop, algo, err)
				}
				for k := range recv {
					if recv[k] != want[r*b+k] {
						return fmt.Errorf("reducescatter op %d, %d per block, %v, %v: element %d is %v, want %v", op, b, redop, algo, k, recv[k], want[r*b+k])
					}
				}
			}
		}
		sb.Release()
		rb.Release()
	}
	c.cfg.Algo = map[OpKind]Algo{OpAllReduce: Shared, OpReduceScatter: Shared}
	buf, blk := make([]float32, 1000), make([]float32, 1000/p)
	if n := testing.AllocsPerRun(30, func() {
		if err := AllReduce(ctx, c, nil, buf, dtype.Sum); err != nil {
			panic(err)
		}
		if err := ReduceScatter(ctx, c, buf[:len(blk)*p], blk, dtype.Sum); err != nil {
			panic(err)
		}
	}); n != 0 {
		return fmt.Errorf("allreduce and reducescatter through the shared areas: %v allocations per operation", n)
	}
	return nil
}

// helperSharedMismatch: the last rank's AlltoAll has twice the others' blocks; every
// rank must fail with ErrMismatch, and quickly.
func helperSharedMismatch(ctx context.Context, c *Comm) error {
	blk := 256
	if c.Rank() == c.Size()-1 {
		blk = 512
	}
	start := time.Now()
	err := AlltoAll(ctx, c, make([]int32, blk*c.Size()), make([]int32, blk*c.Size()))
	return failedAsExpected(c, start, err, errors.Is(err, ErrMismatch), "ErrMismatch")
}

// failedAsExpected ends a rank of a failure scenario: err must be what ok says it is
// (want), seen within 10 s of start; the rank prints it, closes and exits.
func failedAsExpected(c *Comm, start time.Time, err error, ok bool, want string) error {
	if !ok {
		return fmt.Errorf("got %v, want %s", err, want)
	}
	if d := time.Since(start); d > 10*time.Second {
		return fmt.Errorf("took %v to notice", d)
	}
	fmt.Printf("rank %d saw: %v\n", c.Rank(), err)
	c.Close()
	fmt.Printf("rank %d ok\n", c.Rank())
	os.Exit(0)
	return nil
}

// helperSharedDeath: rank 1 vanishes before an AlltoAll through the shared areas; every
// other rank must fail it with an error naming rank 1, quickly. (A rank still in the
// Barrier when rank 1 has left it may learn there: the error must name rank 1 too.)
func helperSharedDeath(ctx context.Context, c *Comm) error {
	start := time.Now()
	err := Barrier(ctx, c)
	if c.Rank() == 1 {
		if err != nil {
			return err
		}
		fmt.Println("rank 1 ok (vanishing)")
		os.Exit(0)
	}
	if err == nil {
		start = time.Now()
		x := make([]float32, 64*c.Size())
		err = AlltoAll(ctx, c, x, make([]float32, len(x)))
	}
	var pe *PeerError
	return failedAsExpected(c, start, err, errors.As(err, &pe) && pe.Rank == 1, "a PeerError naming rank 1")
}
