// Package bench measures moex the way nccl-tests measures NCCL: per message size, time per
// operation, algorithm bandwidth and bus bandwidth, and a correctness check of the result,
// printed as a table or as one JSON object per line. It also runs the MoE scenarios
// behind `moex bench moe` and the point-to-point tests behind `moex bench p2p`.
//
// Every figure sits beside memcpy of the same bytes measured in the same run, since the
// machines moex is developed on are shared and noisy. bench runs collectives over a
// communicator it is given; launching ranks is the command's business (cmd/moex).
package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"runtime"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/internal/memx"
	"github.com/moex-ai/moex/obuf"
)

// CollOpts selects what to measure.
type CollOpts struct {
	Op       coll.OpKind
	MinBytes int
	MaxBytes int
	Factor   int // size step (default 2)
	DType    dtype.Type
	RedOp    dtype.Op
	Root     int
	Iters    int // timed iterations per size (0: about 0.2 s worth, at least 5)
	Warmup   int
	Check    bool // verify the result of the last iteration (default on via the CLI)
	// Heap allocates the buffers with make (Go heap, 4 KiB pages) instead of taking them
	// from obuf (huge pages from 2 MiB on), to show what the buffers' origin costs.
	Heap bool
	// Shared takes the buffers from obuf.Shared: shared memory that the other ranks of
	// the host read in place (one copy per byte over shm, where private buffers cost two
	// or the kernel's cross-memory copy), as NCCL's registered user buffers.
	Shared bool
	// Profile reports the wait for the last rank apart from the operation (the
	// communicator must have been made with coll.Config.Profile).
	Profile bool
	// StraggleRank sleeps StraggleDelay before each timed operation: a straggler, to see
	// what one does to everyone's time (and that profiling names it). Off when the delay
	// is zero.
	StraggleRank  int
	StraggleDelay time.Duration
}

// CollResult is one row: the fields of `moex bench coll --json`.
type CollResult struct {
	Op        string  `json:"op"`
	Ranks     int     `json:"ranks"`
	Transport string  `json:"transport"`
	Bytes     int     `json:"bytes"`
	Count     int     `json:"count"`
	DType     string  `json:"dtype"`
	RedOp     string  `json:"redop,omitempty"`
	Root      int     `json:"root"`
	Algo      string  `json:"algo"`
	TimeUS    float64 `json:"time_us"`
	AlgBW     float64 `json:"algbw_gbs"`
	BusBW     float64 `json:"busbw_gbs"`
	Wrong     int     `json:"wrong"`
	MemcpyGBs float64 `json:"memcpy_gbs"`
	// Buffers: where the buffers came from ("obuf", "shared": obuf.Shared, "heap").
	Buffers string `json:"buffers,omitempty"`
	// AlltoAll: the copy floor, the time this host takes to move every byte of the
	// operation once with all its CPUs and no synchronisation at all (CopyFloor).
	FloorUS float64 `json:"floor_us,omitempty"`
	Iters   int     `json:"iters"`
	// With profiling: the longest per-op wait for the last rank and the longest per-op
	// time after it, over the ranks, and the rank that arrived last most often.
	WaitUS   float64 `json:"wait_us,omitempty"`
	MoveUS   float64 `json:"move_us,omitempty"`
	LastRank *int    `json:"last_rank,omitempty"`
}

// BusFactor is nccl-tests' conversion from algorithm to bus bandwidth.
func BusFactor(op coll.OpKind, n int) float64 {
	if n <= 1 {
		return 0
	}
	f := float64(n)
	switch op {
	case coll.OpAllReduce:
		return 2 * (f - 1) / f
	case coll.OpAlltoAll, coll.OpAlltoAllv, coll.OpAllGather, coll.OpReduceScatter:
		return (f - 1) / f
	}
	return 1
}

// Memcpy measures copy() bandwidth for n bytes in GB/s.
func Memcpy(n int) float64 {
	if n == 0 {
		return 0
	}
	src, dst := make([]byte, n), make([]byte, n)
	for i := range src {
		src[i] = byte(i)
	}
	copy(dst, src) // fault the pages in before timing
	iters := max(3, (64<<20)/n)
	start := time.Now()
	for i := 0; i < iters; i++ {
		copy(dst, src)
	}
	return float64(n) * float64(iters) / time.Since(start).Seconds() / 1e9
}

// CopyFloor is a lower bound for an AlltoAll of n bytes per rank among p ranks on this
// host that moves each byte once (cross-memory attach, or a shared mapping): the best time,
// over a few tries, of copying p buffers of n bytes block by block into p others with as
// many threads as there are CPUs (at most p), with no synchronisation but the final join.
// The buffers come from obuf, as the benchmark's do. Tries alternate between Go's copy
// (which streams moves of 1 MiB and more past the caches), memx.Copy (in pieces, through
// them) and memx.Stream (every store past them), whichever is faster here. With more
// ranks than CPUs it bounds what any implementation can reach, whatever its protocol.
func CopyFloor(p, n int) time.Duration {
	if p < 1 || n < p {
		return 0
	}
	b := n / p
	bufs := make([]*obuf.Buf, 2*p)
	for i := range bufs {
		bufs[i] = obuf.Default.Get(n)
		defer bufs[i].Release()
		clear(bufs[i].Bytes()) // fault the pages in
	}
	return fastestCopy(min(p, runtime.NumCPU()), max(5, min(200, (256<<20)/(p*n))), func(cp func(dst, src []byte), w, threads int) {
		for r := w; r < p; r += threads {
			recv := bufs[p+r].Bytes()
			for q := 0; q < p; q++ {
				cp(recv[q*b:(q+1)*b], bufs[q].Bytes()[r*b:(r+1)*b])
			}
		}
	})
}

// fastestCopy is the best time, over tries rounds of each copy function (Go's copy,
// which streams moves of 1 MiB and more past the caches; memx.Copy, in pieces through
// them; memx.Stream, every store past them), of threads goroutines each running
// job(copy, its index, threads), with no synchronisation but the final join.
func fastestCopy(threads, tries int, job func(cp func(dst, src []byte), w, threads int)) time.Duration {
	copies := []func(dst, src []byte){
		func(dst, src []byte) { copy(dst, src) },
		func(dst, src []byte) { memx.Copy(dst, src) },
		func(dst, src []byte) { memx.Stream(dst, src) },
	}
	best := time.Duration(1 << 62)
	for try := 0; try < len(copies)*tries; try++ {
		cp := copies[try%len(copies)]
		start := time.Now()
		var wg sync.WaitGroup
		for w := 0; w < threads; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				job(cp, w, threads)
			}()
		}
		wg.Wait()
		best = min(best, time.Since(start))
	}
	return best
}

// sizes returns the message sizes from min to max by factor, each a multiple of the
// granularity the op needs (element size, and the rank count for split buffers): rounded
// down, but a size asked for is never rounded to an empty operation.
func sizes(o CollOpts, ranks int) []int {
	gran := o.DType.Size()
	switch o.Op {
	case coll.OpAlltoAll, coll.OpAllGather, coll.OpReduceScatter:
		gran *= ranks
	}
	var out []int
	for s := max(o.MinBytes, 0); s <= o.MaxBytes; s *= o.Factor {
		n := s / gran * gran
		if n == 0 && s > 0 {
			n = gran
		}
		if len(out) == 0 || out[len(out)-1] != n {
			out = append(out, n)
		}
		if s == 0 {
			s = 1
		}
	}
	return out
}

// Coll runs the benchmark on every rank of c (collectively) and returns the rows on
// rank 0 (nil elsewhere).
func Coll(ctx context.Context, c *coll.Comm, o CollOpts) ([]CollResult, error) {
	if o.Factor < 2 {
		o.Factor = 2
	}
	if o.DType == 0 {
		o.DType = dtype.F32
	}
	if o.RedOp == 0 {
		o.RedOp = dtype.Sum
	}
	if o.Warmup == 0 {
		o.Warmup = 20 // pools, plans, page faults, the pollers' adaptive budgets settle
	}
	p := c.Size()
	var rows []CollResult
	for _, size := range sizes(o, p) {
		r, err := collOne(ctx, c, o, size)
		if err != nil {
			return nil, fmt.Errorf("%v %d bytes: %w", o.Op, size, err)
		}
		if c.Rank() == 0 {
			rows = append(rows, r)
		}
	}
	return rows, nil
}

// op bundles one benchmark's buffers and its operation.
type benchOp struct {
	run   func() error
	prep  func() // reset inputs before a checked run
	check func() int
	bufs  []*obuf.Buf
}

// release gives the obuf buffers back. Until then they are held here: a buffer that is
// dropped while its memory is in use is unmapped by the collector.
func (bo *benchOp) release() {
	for _, b := range bo.bufs {
		b.Release()
	}
	bo.bufs = nil
}

func collOne(ctx context.Context, c *coll.Comm, o CollOpts, size int) (CollResult, error) {
	p, r := c.Size(), c.Rank()
	es := o.DType.Size()
	count := size / es
	res := CollResult{Op: o.Op.String(), Ranks: p, Transport: c.Transport().Name(), Bytes: size, Count: count,
		DType: o.DType.String(), Root: o.Root, Buffers: "obuf"}
	switch {
	case o.Heap && o.Shared:
		return res, fmt.Errorf("bench: buffers from the heap or shared, not both")
	case o.Heap:
		res.Buffers = "heap"
	case o.Shared:
		res.Buffers = "shared"
	}
	bo, algoCount, err := makeOp(ctx, c, o, size)
	if err != nil {
		return res, err
	}
	defer bo.release()
	switch o.Op {
	case coll.OpAllReduce, coll.OpReduce, coll.OpReduceScatter:
		res.RedOp = o.RedOp.String()
	}
	res.Algo = algoName(c, o.Op, o.DType, algoCount, o.Root)
	for i := 0; i < o.Warmup; i++ {
		if err := bo.run(); err != nil {
			return res, err
		}
	}
	iters := o.Iters
	if iters <= 0 {
		// Agree on an iteration count from a timed probe (max over ranks).
		start := time.Now()
		if err := bo.run(); err != nil {
			return res, err
		}
		per := []float64{time.Since(start).Seconds()}
		if err := coll.AllReduce(ctx, c, nil, per, dtype.Max); err != nil {
			return res, err
		}
		iters = int(math.Min(1000, math.Max(5, 0.2/math.Max(per[0], 1e-7))))
	}
	if err := coll.Barrier(ctx, c); err != nil {
		return res, err
	}
	// The first operations after the barrier are not timed, as in the OSU benchmarks. A
	// run takes a while to reach full speed: AlltoAll, P=4, 64 KiB on 2 CPUs took 30-53
	// us for its first 150-200 operations (warm-up included, barrier or not) and 18-22
	// after them, and the bare two-copy exchange (bench/peers/twocopy) 27-46 for its
	// first 200; sleeping 30 ms before timing did not shorten it.
	for i := 0; i < skipOf(iters); i++ {
		if err := bo.run(); err != nil {
			return res, err
		}
	}
	straggle := o.StraggleDelay > 0 && r == o.StraggleRank
	prof0 := c.ProfileOf(o.Op)
	start := time.Now()
	for i := 0; i < iters; i++ {
		if straggle {
			time.Sleep(o.StraggleDelay)
		}
		if err := bo.run(); err != nil {
			return res, err
		}
	}
	el := []float64{time.Since(start).Seconds() / float64(iters)}
	if err := coll.AllReduce(ctx, c, nil, el, dtype.Max); err != nil {
		return res, err
	}
	if o.Profile {
		prof := c.ProfileOf(o.Op)
		n := float64(max(prof.Count-prof0.Count, 1))
		wm := []float64{(prof.Wait - prof0.Wait).Seconds() / n * 1e6, (prof.Move - prof0.Move).Seconds() / n * 1e6}
		if err := coll.AllReduce(ctx, c, nil, wm, dtype.Max); err != nil {
			return res, err
		}
		res.WaitUS, res.MoveUS = wm[0], wm[1]
		last, most := 0, -1
		for q := range prof.Last {
			k := prof.Last[q]
			if q < len(prof0.Last) {
				k -= prof0.Last[q]
			}
			if k > most {
				last, most = q, k
			}
		}
		res.LastRank = &last
	}
	if o.Check {
		bo.prep()
		if err := bo.run(); err != nil {
			return res, err
		}
		wrong := []int64{int64(bo.check())}
		if err := coll.AllReduce(ctx, c, nil, wrong, dtype.Sum); err != nil {
			return res, err
		}
		res.Wrong = int(wrong[0])
	}
	res.Iters = iters
	res.TimeUS = el[0] * 1e6
	if el[0] > 0 {
		res.AlgBW = float64(size) / el[0] / 1e9
	}
	res.BusBW = res.AlgBW * BusFactor(o.Op, p)
	if r == 0 {
		res.MemcpyGBs = Memcpy(size)
		if o.Op == coll.OpAlltoAll {
			res.FloorUS = CopyFloor(p, size).Seconds() * 1e6
		}
	}
	return res, nil
}

func algoName(c *coll.Comm, op coll.OpKind, dt dtype.Type, count, root int) string {
	d := c.Describe(op, dt, count, root)
	// "rank 0: allreduce/ring, ..." -> "ring"
	if i := strings.Index(d, "/"); i >= 0 {
		rest := d[i+1:]
		if j := strings.IndexAny(rest, ", "); j >= 0 {
			return rest[:j]
		}
	}
	return "?"
}

// makeOp allocates buffers for one size; the inputs are small integers so that every
// reduction is exact and the result can be checked against a closed form.
func makeOp(ctx context.Context, c *coll.Comm, o CollOpts, size int) (benchOp, int, error) {
	p, r := c.Size(), c.Rank()
	n := size / 4
	var bo benchOp
	mk := func(k int) []float32 {
		if o.Heap {
			return make([]float32, k)
		}
		// obuf buffers, as a user following moex's advice would have them, held by bo
		// until the size is done.
		pool := obuf.Default
		if o.Shared {
			pool = obuf.Shared
		}
		b := pool.Get(4 * k)
		bo.bufs = append(bo.bufs, b)
		return dtype.FromBytes[float32](b.Bytes())
	}
	if o.DType != dtype.F32 {
		return benchOp{}, 0, fmt.Errorf("bench: only f32 is wired into the command so far (got %v)", o.DType)
	}
	val := func(rank, i int) float32 { return float32((rank+i)%7 - 3) }
	switch o.Op {
	case coll.OpAllReduce:
		buf := mk(n)
		bo.prep = func() {
			for i := range buf {
				buf[i] = val(r, i)
			}
		}
		bo.run = func() error { return coll.AllReduce(ctx, c, nil, buf, o.RedOp) }
		bo.check = func() int {
			wrong := 0
			for i, v := range buf {
				want := float32(0)
				for q := 0; q < p; q++ {
					want += val(q, i)
				}
				if o.RedOp == dtype.Avg {
					want /= float32(p)
				}
				if o.RedOp == dtype.Sum || o.RedOp == dtype.Avg {
					if v != want {
						wrong++
					}
				}
			}
			return wrong
		}
		return bo, n, nil
	case coll.OpAlltoAll:
		send, recv := mk(n), mk(n)
		blk := n / p
		bo.prep = func() {
			for i := range send {
				send[i] = float32(r*1000003 + i)
			}
		}
		bo.prep()
		bo.run = func() error { return coll.AlltoAll(ctx, c, send, recv) }
		bo.check = func() int {
			wrong := 0
			for q := 0; q < p; q++ {
				for k := 0; k < blk; k++ {
					if recv[q*blk+k] != float32(q*1000003+r*blk+k) {
						wrong++
					}
				}
			}
			return wrong
		}
		return bo, blk, nil
	case coll.OpAllGather:
		blk := n / p
		send, recv := mk(blk), mk(n)
		bo.prep = func() {
			for i := range send {
				send[i] = float32(r*7 + i)
			}
		}
		bo.prep()
		bo.run = func() error { return coll.AllGather(ctx, c, send, recv) }
		bo.check = func() int {
			wrong := 0
			for q := 0; q < p; q++ {
				for k := 0; k < blk; k++ {
					if recv[q*blk+k] != float32(q*7+k) {
						wrong++
					}
				}
			}
			return wrong
		}
		return bo, blk, nil
	case coll.OpReduceScatter:
		blk := n / p
		send, recv := mk(n), mk(blk)
		bo.prep = func() {
			for i := range send {
				send[i] = val(r, i)
			}
		}
		bo.prep()
		bo.run = func() error { return coll.ReduceScatter(ctx, c, send, recv, dtype.Sum) }
		bo.check = func() int {
			wrong := 0
			for k, v := range recv {
				want := float32(0)
				for q := 0; q < p; q++ {
					want += val(q, r*blk+k)
				}
				if v != want {
					wrong++
				}
			}
			return wrong
		}
		return bo, blk, nil
	case coll.OpBroadcast:
		buf := mk(n)
		bo.prep = func() {
			for i := range buf {
				buf[i] = 0
				if r == o.Root {
					buf[i] = float32(i)
				}
			}
		}
		bo.prep()
		bo.run = func() error { return coll.Broadcast(ctx, c, buf, o.Root) }
		bo.check = func() int {
			wrong := 0
			for i, v := range buf {
				if v != float32(i) {
					wrong++
				}
			}
			return wrong
		}
		return bo, n, nil
	case coll.OpReduce:
		send, recv := mk(n), mk(n)
		bo.prep = func() {
			for i := range send {
				send[i] = val(r, i)
			}
		}
		bo.prep()
		bo.run = func() error { return coll.Reduce(ctx, c, send, recv, dtype.Sum, o.Root) }
		bo.check = func() int {
			if r != o.Root {
				return 0
			}
			wrong := 0
			for i, v := range recv {
				want := float32(0)
				for q := 0; q < p; q++ {
					want += val(q, i)
				}
				if v != want {
					wrong++
				}
			}
			return wrong
		}
		return bo, n, nil
	}
	return bo, 0, fmt.Errorf("bench: operation %v is not benchmarked (allreduce, alltoall, allgather, reducescatter, broadcast, reduce)", o.Op)
}

// PrintColl writes rows as an nccl-tests-style table.
func PrintColl(w io.Writer, rows []CollResult) {
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(w, "# moex bench coll: %s, %d ranks, transport %s\n", rows[0].Op, rows[0].Ranks, rows[0].Transport)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	profiled := rows[0].LastRank != nil
	head := "size (B)\tcount\ttype\tredop\troot\talgo\ttime (us)\talgbw (GB/s)\tbusbw (GB/s)\t#wrong\tmemcpy (GB/s)\t"
	if profiled {
		head += "wait (us)\tmove (us)\tlast rank\t"
	}
	fmt.Fprintln(tw, head)
	for _, r := range rows {
		red := r.RedOp
		if red == "" {
			red = "none"
		}
		fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%d\t%s\t%.1f\t%.2f\t%.2f\t%d\t%.1f\t",
			r.Bytes, r.Count, r.DType, red, r.Root, r.Algo, r.TimeUS, r.AlgBW, r.BusBW, r.Wrong, r.MemcpyGBs)
		if profiled && r.LastRank != nil {
			fmt.Fprintf(tw, "%.1f\t%.1f\t%d\t", r.WaitUS, r.MoveUS, *r.LastRank)
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
	if profiled {
		fmt.Fprintln(w, "# wait: longest time a rank spent waiting for the last one to arrive; move: longest time of the operation after that (per op, over the ranks)")
	}
}

// PrintJSON writes one JSON object per row.
func PrintJSON[T any](w io.Writer, rows []T) error {
	enc := json.NewEncoder(w)
	for _, r := range rows {
		if err := enc.Encode(r); err != nil {
			return err
		}
	}
	return nil
}

// skipOf is how many operations run untimed after the barrier before iters timed ones:
// a tenth as many, at least 5, the OSU benchmarks' ratio (they skip 100 before 1000
// small operations and 10 before 100 large ones). bench/peers/mpi_coll.c and twocopy
// skip as many.
func skipOf(iters int) int { return max(5, iters/10) }
