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
	"errors"
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
	"github.com/moex-ai/moex/transport"
)

// CollOpts selects what to measure.
type CollOpts struct {
	Op       coll.OpKind
	MinBytes int
	MaxBytes int
	Factor   int // size step (default 2)
	DType    dtype.Type
	RedOp    dtype.Op
	Skew     float64 // alltoallv: every rank sends block j a share (j+1)^-Skew of its buffer
	Root     int
	Iters    int  // timed iterations per size (0: about 0.2 s worth, at least 5)
	Warmup   int  // untimed operations per size and form (0: 20; negative: none)
	Check    bool // verify the result of the last iteration (default on via the CLI)
	// Heap allocates the buffers with make (Go heap, 4 KiB pages) instead of taking them
	// from obuf (huge pages from 256 KiB on), to show what the buffers' origin costs.
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
	// Progress, when set, is called on rank 0 after each size with the sizes done and
	// the sizes in all.
	Progress func(done, total int)
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
	// OfFloor is the floor over the time: the fraction of the host's limit reached.
	OfFloor float64 `json:"of_floor,omitempty"`
	Iters   int     `json:"iters"`
	// P50US, P90US and P99US are percentiles over the iterations of the slowest rank's
	// time (the first 100000 iterations).
	P50US float64 `json:"p50_us"`
	P90US float64 `json:"p90_us"`
	P99US float64 `json:"p99_us"`
	// Tail says who the slow operations (over twice the p50) waited for: the rank that
	// entered them last, by the host's clock (one host), most often.
	Tail Tail `json:"tail"`
	// OutOfPlace says whether the main columns are the out-of-place form (send and
	// receive buffers apart); broadcast has only the in-place one, which fills them.
	OutOfPlace bool `json:"out_of_place"`
	// The in-place form (send == receive buffer; AllGather: this rank's block already in
	// place): its mean time, bus bandwidth and #wrong (-1: the operation has no such form).
	InPlaceUS    float64 `json:"in_place_time_us,omitempty"`
	InPlaceBusBW float64 `json:"in_place_busbw_gbs,omitempty"`
	InPlaceWrong int     `json:"in_place_wrong"`
	Skew         float64 `json:"skew,omitempty"` // alltoallv: block j weighs (j+1)^-skew
	// Run records the command line and the machine (in every row, so that each stands
	// alone).
	Run *RunInfo `json:"run,omitempty"`
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

// AllReduceFloor is the copy floor of an f32 AllReduce of n bytes on p ranks of this
// host: the best time, over a few tries, of p buffers reduced block by block (each of p
// workers sums its block of every buffer, n bytes read and n/p written) and the sums
// gathered back into every buffer (each worker copies the p-1 blocks it lacks), with as
// many threads as there are CPUs (at most p) and no synchronisation but a join between
// the halves: the bytes any reduce-scatter and all-gather must read and write, each
// once, with nothing else.
func AllReduceFloor(p, n int) time.Duration { return reduceFloor(p, n, true) }

// ReduceScatterFloor is the copy floor of an f32 ReduceScatter of send buffers of n bytes
// on p ranks: the first half of AllReduceFloor (every worker sums its block of every
// buffer: n bytes read, n/p written).
func ReduceScatterFloor(p, n int) time.Duration { return reduceFloor(p, n, false) }

// AllGatherFloor is the copy floor of an AllGather into buffers of n bytes on p ranks:
// every rank's block copied into every other rank's buffer once, as CopyFloor times it
// (the same bytes as an AlltoAll's).
func AllGatherFloor(p, n int) time.Duration { return CopyFloor(p, n) }

// reduceFloor times AllReduceFloor (gather) or ReduceScatterFloor.
func reduceFloor(p, n int, gather bool) time.Duration {
	if p < 2 || n < 4*p {
		return 0
	}
	b := n / p / 4 * 4
	bufs := make([]*obuf.Buf, p)
	for i := range bufs {
		bufs[i] = obuf.Default.Get(n)
		defer bufs[i].Release()
		clear(bufs[i].Bytes())
	}
	threads := min(p, runtime.NumCPU())
	on := func(work func(r int)) {
		var wg sync.WaitGroup
		for w := 0; w < threads; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for r := w; r < p; r += threads {
					work(r)
				}
			}()
		}
		wg.Wait()
	}
	best := time.Duration(1 << 62)
	for try := 0; try < max(5, min(100, (128<<20)/(p*n))); try++ {
		start := time.Now()
		on(func(r int) { // reduce block r into buffer r
			dst := bufs[r].Bytes()[r*b : (r+1)*b]
			for q := 0; q < p; q++ {
				if q != r {
					dtype.Reduce(dtype.F32, dtype.Sum, dst, bufs[q].Bytes()[r*b:(r+1)*b])
				}
			}
		})
		if gather {
			on(func(r int) { // gather every block into buffer r
				for q := 0; q < p; q++ {
					if q != r {
						copy(bufs[r].Bytes()[q*b:(q+1)*b], bufs[q].Bytes()[q*b:(q+1)*b])
					}
				}
			})
		}
		best = min(best, time.Since(start))
	}
	return best
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
	switch {
	case o.Warmup == 0:
		o.Warmup = 20 // pools, plans, page faults, the pollers' adaptive budgets settle
	case o.Warmup < 0:
		o.Warmup = 0
	}
	p := c.Size()
	var rows []CollResult
	all := sizes(o, p)
	for i, size := range all {
		r, err := collOne(ctx, c, o, size)
		if err != nil {
			return nil, fmt.Errorf("%v %d bytes: %w", o.Op, size, err)
		}
		if c.Rank() == 0 {
			rows = append(rows, r)
			if o.Progress != nil {
				o.Progress(i+1, len(all))
			}
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

// errNoForm: the operation has no such form (in place, or out of place).
var errNoForm = errors.New("bench: no such form")

// maxSamples bounds the per-iteration times kept for the percentiles.
const maxSamples = 100_000

// form is one timed form of an operation at one size.
type form struct {
	timeUS, p50, p90, p99 float64
	wrong                 int
	iters                 int
	tail                  Tail
}

func collOne(ctx context.Context, c *coll.Comm, o CollOpts, size int) (CollResult, error) {
	p := c.Size()
	es := o.DType.Size()
	count := size / es
	res := CollResult{Op: o.Op.String(), Ranks: p, Transport: c.Transport().Name(), Bytes: size, Count: count,
		DType: o.DType.String(), Root: o.Root, Buffers: "obuf", InPlaceWrong: -1}
	switch {
	case o.Heap && o.Shared:
		return res, &transport.ArgError{Arg: "Heap", Reason: "buffers from the heap or shared, not both"}
	case o.Heap:
		res.Buffers = "heap"
	case o.Shared:
		res.Buffers = "shared"
	}
	switch o.Op {
	case coll.OpAllReduce, coll.OpReduce, coll.OpReduceScatter:
		res.RedOp = o.RedOp.String()
	case coll.OpAlltoAllv:
		res.Skew = o.Skew
	}
	out, algoCount, err := collForm(ctx, c, o, size, false, true, &res)
	switch {
	case errors.Is(err, errNoForm):
		res.OutOfPlace = false
	case err != nil:
		return res, err
	default:
		res.OutOfPlace = true
		res.TimeUS, res.P50US, res.P90US, res.P99US, res.Wrong, res.Iters = out.timeUS, out.p50, out.p90, out.p99, out.wrong, out.iters
		res.Tail = out.tail
	}
	in, ac, err := collForm(ctx, c, o, size, true, !res.OutOfPlace, &res)
	switch {
	case errors.Is(err, errNoForm):
	case err != nil:
		return res, err
	default:
		res.InPlaceUS, res.InPlaceWrong = in.timeUS, in.wrong
		if !res.OutOfPlace { // the operation's only form fills the main columns too
			res.TimeUS, res.P50US, res.P90US, res.P99US, res.Wrong, res.Iters = in.timeUS, in.p50, in.p90, in.p99, in.wrong, in.iters
			res.Tail = in.tail
			algoCount = ac
		}
	}
	res.Algo = algoName(c, o.Op, o.DType, algoCount, o.Root)
	bus := BusFactor(o.Op, p)
	if res.TimeUS > 0 {
		res.AlgBW = float64(size) / res.TimeUS / 1e3
	}
	res.BusBW = res.AlgBW * bus
	if res.InPlaceUS > 0 {
		res.InPlaceBusBW = float64(size) / res.InPlaceUS / 1e3 * bus
	}
	if c.Rank() == 0 {
		res.MemcpyGBs = Memcpy(size)
		switch o.Op {
		case coll.OpAlltoAll:
			res.FloorUS = CopyFloor(p, size).Seconds() * 1e6
		case coll.OpAllGather:
			res.FloorUS = AllGatherFloor(p, size).Seconds() * 1e6
		case coll.OpAllReduce:
			if o.DType == dtype.F32 {
				res.FloorUS = AllReduceFloor(p, size).Seconds() * 1e6
			}
		case coll.OpReduceScatter:
			if o.DType == dtype.F32 {
				res.FloorUS = ReduceScatterFloor(p, size).Seconds() * 1e6
			}
		}
		if res.FloorUS > 0 && res.TimeUS > 0 {
			res.OfFloor = res.FloorUS / res.TimeUS
		}
	}
	return res, nil
}

// collForm times one form (in place or out of place) of the operation at one size: mean
// time, percentiles of the slowest rank per iteration, and the check's #wrong over
// every rank. The main form's profiling figures go into res.
func collForm(ctx context.Context, c *coll.Comm, o CollOpts, size int, inPlace, main bool, res *CollResult) (form, int, error) {
	var f form
	bo, algoCount, err := makeOpOf(ctx, c, o, size, inPlace)
	// Every rank reaches the same verdict: the forms depend on the operation only.
	if err != nil {
		return f, 0, err
	}
	defer bo.release()
	bo.prep()
	for i := 0; i < o.Warmup; i++ {
		if err := bo.run(); err != nil {
			return f, 0, err
		}
	}
	iters := o.Iters
	if iters <= 0 {
		// Agree on an iteration count from a timed probe (max over ranks).
		start := time.Now()
		if err := bo.run(); err != nil {
			return f, 0, err
		}
		per := []float64{time.Since(start).Seconds()}
		if err := coll.AllReduce(ctx, c, nil, per, dtype.Max); err != nil {
			return f, 0, err
		}
		iters = int(math.Min(1000, math.Max(5, 0.2/math.Max(per[0], 1e-7))))
	}
	if err := coll.Barrier(ctx, c); err != nil {
		return f, 0, err
	}
	// The first operations after the barrier are not timed, as in the OSU benchmarks. A
	// run takes a while to reach full speed: AlltoAll, P=4, 64 KiB on 2 CPUs took 30-53
	// us for its first 150-200 operations (warm-up included, barrier or not) and 18-22
	// after them, and the bare two-copy exchange (bench/peers/twocopy) 27-46 for its
	// first 200; sleeping 30 ms before timing did not shorten it.
	for i := 0; i < skipOf(iters); i++ {
		if err := bo.run(); err != nil {
			return f, 0, err
		}
	}
	straggle := o.StraggleDelay > 0 && c.Rank() == o.StraggleRank
	prof0 := c.ProfileOf(o.Op)
	samples := make([]float64, min(iters, maxSamples))
	entered := make([]float64, len(samples)) // when each operation began, by the host's clock
	base := []int64{time.Now().UnixNano()}
	if err := coll.AllReduce(ctx, c, nil, base, dtype.Min); err != nil {
		return f, 0, err
	}
	start := time.Now()
	last := start
	for i := 0; i < iters; i++ {
		if straggle {
			time.Sleep(o.StraggleDelay)
		}
		if i < len(samples) {
			entered[i] = float64(time.Now().UnixNano() - base[0])
		}
		if err := bo.run(); err != nil {
			return f, 0, err
		}
		if i < len(samples) {
			now := time.Now()
			samples[i] = now.Sub(last).Seconds()
			last = now
		}
	}
	el := []float64{time.Since(start).Seconds() / float64(iters)}
	if err := coll.AllReduce(ctx, c, nil, el, dtype.Max); err != nil {
		return f, 0, err
	}
	// Per iteration, the slowest rank's time, and who entered it last.
	all := make([]float64, c.Size()*len(entered))
	if err := coll.AllGather(ctx, c, entered, all); err != nil {
		return f, 0, err
	}
	if err := coll.AllReduce(ctx, c, nil, samples, dtype.Max); err != nil {
		return f, 0, err
	}
	n := len(entered)
	// The rank that entered last is the one whose entry time is the largest: tailOf
	// picks the smallest of what at returns.
	f.tail = tailOf(samples, c.Size(), func(r, i int) float64 { return -all[r*n+i] })
	if o.Profile && main {
		prof := c.ProfileOf(o.Op)
		n := float64(max(prof.Count-prof0.Count, 1))
		wm := []float64{(prof.Wait - prof0.Wait).Seconds() / n * 1e6, (prof.Move - prof0.Move).Seconds() / n * 1e6}
		if err := coll.AllReduce(ctx, c, nil, wm, dtype.Max); err != nil {
			return f, 0, err
		}
		res.WaitUS, res.MoveUS = wm[0], wm[1]
		lastRank, most := 0, -1
		for q := range prof.Last {
			k := prof.Last[q]
			if q < len(prof0.Last) {
				k -= prof0.Last[q]
			}
			if k > most {
				lastRank, most = q, k
			}
		}
		res.LastRank = &lastRank
	}
	if o.Check {
		bo.prep()
		if err := bo.run(); err != nil {
			return f, 0, err
		}
		wrong := []int64{int64(bo.check())}
		if err := coll.AllReduce(ctx, c, nil, wrong, dtype.Sum); err != nil {
			return f, 0, err
		}
		f.wrong = int(wrong[0])
	}
	f.iters, f.timeUS = iters, el[0]*1e6
	f.p50, f.p90, f.p99 = percentile(samples, 0.5)*1e6, percentile(samples, 0.9)*1e6, percentile(samples, 0.99)*1e6
	return f, algoCount, nil
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

// PrintColl writes rows as an nccl-tests-style table: the out-of-place form (the only
// one of broadcast, in place) with its percentiles, then the in-place form (N/A where the
// operation has none).
func PrintColl(w io.Writer, rows []CollResult) {
	if len(rows) == 0 {
		return
	}
	r0 := rows[0]
	fmt.Fprintf(w, "# moex bench coll: %s, %d ranks, transport %s, %s buffers", r0.Op, r0.Ranks, r0.Transport, r0.Buffers)
	if r0.Op == coll.OpAlltoAllv.String() {
		fmt.Fprintf(w, ", skew %g", r0.Skew)
	}
	fmt.Fprintln(w)
	if r0.Run != nil {
		fmt.Fprintf(w, "# %s; %s, %d CPUs, %s, commit %s; path %s; poll %s\n", r0.Run.Command, r0.Run.CPU, r0.Run.Cores, r0.Run.GoVersion, r0.Run.Commit, r0.Run.Path, r0.Run.Poll)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	profiled := r0.LastRank != nil
	main, other := "out-of-place", "in-place"
	if !r0.OutOfPlace {
		main, other = "in-place", "out-of-place"
	}
	fmt.Fprintf(tw, "\t\t\t\t\t\t%s\t\t\t\t\t\t\t\t\t%s\t\t\t\t\n", main, other)
	head := "size (B)\tcount\ttype\tredop\troot\talgo\ttime (us)\tp50\tp90\tp99\tslow\tlate\talgbw (GB/s)\tbusbw (GB/s)\t#wrong\ttime (us)\tbusbw (GB/s)\t#wrong\tmemcpy (GB/s)\t"
	if profiled {
		head += "wait (us)\tmove (us)\tlast rank\t"
	}
	fmt.Fprintln(tw, head)
	for _, r := range rows {
		red := r.RedOp
		if red == "" {
			red = "none"
		}
		late := "-"
		if r.Tail.Steps > 0 {
			late = fmt.Sprintf("%d (%d)", r.Tail.Late, r.Tail.LateIn)
		}
		fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%d\t%s\t%.1f\t%.1f\t%.1f\t%.1f\t%d\t%s\t%.2f\t%.2f\t%d\t",
			r.Bytes, r.Count, r.DType, red, r.Root, r.Algo, r.TimeUS, r.P50US, r.P90US, r.P99US, r.Tail.Steps, late, r.AlgBW, r.BusBW, r.Wrong)
		if r.OutOfPlace && r.InPlaceWrong >= 0 {
			fmt.Fprintf(tw, "%.1f\t%.2f\t%d\t", r.InPlaceUS, r.InPlaceBusBW, r.InPlaceWrong)
		} else {
			fmt.Fprint(tw, "N/A\tN/A\tN/A\t")
		}
		fmt.Fprintf(tw, "%.1f\t", r.MemcpyGBs)
		if profiled && r.LastRank != nil {
			fmt.Fprintf(tw, "%.1f\t%.1f\t%d\t", r.WaitUS, r.MoveUS, *r.LastRank)
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
	fmt.Fprintln(w, "# time: mean per operation of the slowest rank; p50/p90/p99: over iterations, each the slowest rank's; slow: operations over 2x the p50; late: the rank that entered them last most often (how often); #wrong: elements off the reference over every rank")
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
