package bench

import (
	"context"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/models"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport"
)

// CoalesceOpts selects the coalescing study: one MoE dispatch, sent five ways.
type CoalesceOpts struct {
	Model string // a model of package models; or, when Hidden > 0, a layer given by the fields below
	// Hidden, TopK and Experts describe a layer of no model: tokens go to TopK distinct
	// experts drawn uniformly.
	Hidden, TopK, Experts int
	Tokens                int        // tokens per rank
	Wire                  dtype.Type // the payload's element type (default BF16)
	// MinChunk and MaxChunk bound the chunk sizes of the chunked way, which doubles from
	// one to the other (default 4 KiB to 4 MiB).
	MinChunk, MaxChunk int
	Iters, Warmup      int // per way (default 20 and 3; a negative Warmup: none)
	Seed               uint64
	// Progress, when set, is called on rank 0 after each way with the ways done and the
	// ways in all.
	Progress func(done, total int)
}

// Coalescing ways.
const (
	WayPair      = "pair"       // (a) one message per (token, expert) pair
	WayTokenRank = "token-rank" // (b) one per (token, destination rank)
	WayExpert    = "expert"     // (c) one per (source rank, expert): that expert's rows
	WayFused     = "fused"      // (d) one per destination rank: the moex dispatch
	WayChunked   = "chunked"    // (e) fused, then split into chunks of ChunkBytes
)

// CoalesceRow is one way's figures; counts and bytes are per dispatch, all ranks together.
type CoalesceRow struct {
	Way        string  `json:"way"`
	ChunkBytes int     `json:"chunk_bytes,omitempty"`
	Messages   int64   `json:"messages"`
	Bytes      int64   `json:"bytes"`
	Syscalls   float64 `json:"syscalls,omitempty"` // tcp: writes and reads
	Frames     float64 `json:"frames,omitempty"`   // shm: ring slots written (it makes no system call to send)
	CPUSecGB   float64 `json:"cpu_s_per_gb"`       // user+system CPU of every rank per GB moved
	P50US      float64 `json:"p50_us"`
	P99US      float64 `json:"p99_us"`
	TokensPerS float64 `json:"tokens_per_s"` // every rank's tokens per p50 time
	// Wrong counts the rows received, over every rank, whose payload is not the sender's
	// row of the token their header names, or rows missing (checked after the last
	// iteration).
	Wrong int `json:"wrong"`
}

// CoalesceResult is the outcome, the fields of `moex bench coalesce --json`.
type CoalesceResult struct {
	Model         string        `json:"model"`
	Hidden        int           `json:"hidden"`
	TopK          int           `json:"top_k"`
	Experts       int           `json:"experts"`
	Ranks         int           `json:"ranks"`
	Transport     string        `json:"transport"`
	Path          string        `json:"path"`
	TokensPerRank int           `json:"tokens_per_rank"`
	Wire          string        `json:"wire_dtype"`
	RowBytes      int           `json:"row_bytes"`
	Iters         int           `json:"iters"`
	Rows          []CoalesceRow `json:"rows"`
	// RecommendedChunk is the chunk size to use (0: do not split the fused message), and
	// Reason says why in one line.
	RecommendedChunk int    `json:"recommended_chunk_bytes"`
	Reason           string `json:"reason"`
}

// MaxCoalesceMessages bounds the messages a rank posts in one dispatch (the pair way has
// the most), so that a flag cannot ask for millions of requests.
const MaxCoalesceMessages = 1 << 20

// coalescePlan is one rank's dispatch: which rows go where, in each way's order.
type coalescePlan struct {
	p, me, rowBytes int
	pairs           [][]int32   // dest rank -> token of each (token, expert) pair, choice order
	fused           [][]int32   // dest rank -> distinct tokens, ascending
	byExpert        [][][]int32 // dest rank -> its experts (ascending) -> tokens routed there
	expertIDs       [][]int     // dest rank -> expert of each byExpert entry
	// What this rank receives, from the gathered counts: per source, pairs, fused rows
	// and rows per local expert (those with a count only).
	inPairs, inFused []int
	inExpert         [][]int
}

// routeSynthetic routes tokens to k distinct experts drawn uniformly.
func routeSynthetic(tokens, k, experts int, seed uint64, rank int) *router.Routing {
	rng := rand.New(rand.NewPCG(seed, uint64(rank)+1))
	r := &router.Routing{K: k, Experts: make([]int32, tokens*k), Weights: make([]float32, tokens*k)}
	for t := 0; t < tokens; t++ {
		perm := rng.Perm(experts)[:k]
		for j, e := range perm {
			r.Experts[t*k+j] = int32(e)
			r.Weights[t*k+j] = 1 / float32(k)
		}
	}
	return r
}

func newCoalescePlan(r *router.Routing, pl *router.Placement, p, me, rowBytes int) *coalescePlan {
	cp := &coalescePlan{p: p, me: me, rowBytes: rowBytes,
		pairs: make([][]int32, p), fused: make([][]int32, p), byExpert: make([][][]int32, p), expertIDs: make([][]int, p)}
	slot := make(map[int]int) // expert -> index in byExpert[its rank]
	for q := 0; q < p; q++ {
		for _, e := range pl.Local[q] {
			slot[e] = len(cp.expertIDs[q])
			cp.expertIDs[q] = append(cp.expertIDs[q], e)
			cp.byExpert[q] = append(cp.byExpert[q], nil)
		}
	}
	tokens := len(r.Experts) / r.K
	stamp := make([]int, p) // stamp[q] == t+1: token t already goes to rank q
	for t := 0; t < tokens; t++ {
		for j := 0; j < r.K; j++ {
			e := int(r.Experts[t*r.K+j])
			if e < 0 {
				continue
			}
			q := pl.RankOf(e, me, t)
			if q == me {
				continue // local rows are a copy in every way
			}
			cp.pairs[q] = append(cp.pairs[q], int32(t))
			cp.byExpert[q][slot[e]] = append(cp.byExpert[q][slot[e]], int32(t))
			if stamp[q] != t+1 {
				stamp[q] = t + 1
				cp.fused[q] = append(cp.fused[q], int32(t))
			}
		}
	}
	return cp
}

// counts is this rank's side of the gathered counts: pairs and fused rows per dest rank,
// then rows per expert (in each rank's local order, ranks in order).
func (cp *coalescePlan) counts(experts int) []int64 {
	v := make([]int64, 0, 2*cp.p+experts)
	for q := 0; q < cp.p; q++ {
		v = append(v, int64(len(cp.pairs[q])))
	}
	for q := 0; q < cp.p; q++ {
		v = append(v, int64(len(cp.fused[q])))
	}
	for q := 0; q < cp.p; q++ {
		for _, rows := range cp.byExpert[q] {
			v = append(v, int64(len(rows)))
		}
	}
	return v
}

// receive fills what this rank receives from every rank's counts.
func (cp *coalescePlan) receive(all []int64, experts int, pl *router.Placement) {
	n := 2*cp.p + experts
	cp.inPairs, cp.inFused, cp.inExpert = make([]int, cp.p), make([]int, cp.p), make([][]int, cp.p)
	off := 2 * cp.p // index of my first local expert in a counts vector
	for q := 0; q < cp.me; q++ {
		off += len(pl.Local[q])
	}
	for s := 0; s < cp.p; s++ {
		v := all[s*n : (s+1)*n]
		cp.inPairs[s] = int(v[cp.me])
		cp.inFused[s] = int(v[cp.p+cp.me])
		for i := range pl.Local[cp.me] {
			if c := int(v[off+i]); c > 0 {
				cp.inExpert[s] = append(cp.inExpert[s], c)
			}
		}
	}
}

// sizes returns the message sizes this rank sends to (out) and receives from (in) each
// rank in one way, in posting order.
func (cp *coalescePlan) sizes(way string, chunk int) (out, in [][]int) {
	out, in = make([][]int, cp.p), make([][]int, cp.p)
	rb := cp.rowBytes
	split := func(n int) []int {
		if n == 0 {
			return nil
		}
		if way != WayChunked || chunk <= 0 {
			return []int{n}
		}
		var s []int
		for o := 0; o < n; o += chunk {
			s = append(s, min(chunk, n-o))
		}
		return s
	}
	for q := 0; q < cp.p; q++ {
		switch way {
		case WayPair:
			out[q] = slices.Repeat([]int{rb}, len(cp.pairs[q]))
			in[q] = slices.Repeat([]int{rb}, cp.inPairs[q])
		case WayTokenRank:
			out[q] = slices.Repeat([]int{rb}, len(cp.fused[q]))
			in[q] = slices.Repeat([]int{rb}, cp.inFused[q])
		case WayExpert:
			for _, rows := range cp.byExpert[q] {
				if len(rows) > 0 {
					out[q] = append(out[q], len(rows)*rb)
				}
			}
			for _, c := range cp.inExpert[q] {
				in[q] = append(in[q], c*rb)
			}
		default: // fused, chunked
			out[q] = split(len(cp.fused[q]) * rb)
			in[q] = split(cp.inFused[q] * rb)
		}
	}
	return out, in
}

// pack writes this rank's rows for one way into send, in posting order: a row is an
// 8-byte header (token, expert or destination) and the token's payload.
func (cp *coalescePlan) pack(way string, send []byte, x []byte) {
	rb, pay := cp.rowBytes, cp.rowBytes-8
	o := 0
	put := func(t int32, tag int) {
		row := send[o : o+rb]
		row[0], row[1], row[2], row[3] = byte(t), byte(t>>8), byte(t>>16), byte(t>>24)
		row[4], row[5], row[6], row[7] = byte(tag), byte(tag>>8), byte(tag>>16), byte(tag>>24)
		copy(row[8:], x[int(t)*pay:int(t+1)*pay])
		o += rb
	}
	for q := 0; q < cp.p; q++ {
		switch way {
		case WayPair:
			for _, t := range cp.pairs[q] {
				put(t, q)
			}
		case WayExpert:
			for i, rows := range cp.byExpert[q] {
				for _, t := range rows {
					put(t, cp.expertIDs[q][i])
				}
			}
		default: // token-rank, fused, chunked: each token once per destination
			for _, t := range cp.fused[q] {
				put(t, q)
			}
		}
	}
}

// payloadByte is byte i of rank src's tokens (token t's row at t*payload).
func payloadByte(src, i int) byte { return byte(i*7 + src*13 + i>>8) }

// checkRows counts the rows of b (whole rows from rank src) whose payload is not src's
// row of the token in their header, and a partial row.
func checkRows(b []byte, rowBytes, src int) int {
	pay, wrong := rowBytes-8, 0
	if len(b)%rowBytes != 0 {
		wrong++
	}
	for o := 0; o+rowBytes <= len(b); o += rowBytes {
		t := int(b[o]) | int(b[o+1])<<8 | int(b[o+2])<<16 | int(b[o+3])<<24
		for j, v := range b[o+8 : o+rowBytes] {
			if v != payloadByte(src, t*pay+j) {
				wrong++
				break
			}
		}
	}
	return wrong
}

// transportCounters sums the system calls (tcp) and ring slots (shm) of the transports
// under tr so far.
func transportCounters(tr transport.Transport) (syscalls, frames uint64) {
	c, _ := transport.CountersOf(tr)
	return c.Syscalls, c.Slots
}

// cpuTime is this process's user and system CPU time so far.
func cpuTime() time.Duration {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// Coalesce runs the study on every rank of c (collectively); the result on rank 0.
// procRank says whether this rank counts its process's CPU time (one rank per process
// must; ranks that share a process with one that does must not).
func Coalesce(ctx context.Context, c *coll.Comm, o CoalesceOpts, procRank bool) (*CoalesceResult, error) {
	if o.Wire == 0 {
		o.Wire = dtype.BF16
	}
	if o.Iters == 0 {
		o.Iters = 20
	}
	switch {
	case o.Warmup == 0:
		o.Warmup = 3
	case o.Warmup < 0:
		o.Warmup = 0
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.MinChunk == 0 {
		o.MinChunk = 4 << 10
	}
	if o.MaxChunk == 0 {
		o.MaxChunk = 4 << 20
	}
	p, me := c.Size(), c.Rank()
	res := &CoalesceResult{Ranks: p, Transport: c.Transport().Name(), TokensPerRank: o.Tokens, Wire: o.Wire.String(), Iters: o.Iters}
	if p > 1 {
		l := c.Links()[(me+1)%p]
		res.Path = l.Path
	}
	var r *router.Routing
	if o.Hidden > 0 {
		if o.TopK < 1 || o.Experts < o.TopK {
			return nil, fmt.Errorf("bench: coalesce: top-k %d of %d experts", o.TopK, o.Experts)
		}
		res.Model, res.Hidden, res.TopK, res.Experts = "custom", o.Hidden, o.TopK, o.Experts
		r = routeSynthetic(o.Tokens, o.TopK, o.Experts, o.Seed, me)
	} else {
		cfg, err := models.Get(o.Model)
		if err != nil {
			return nil, err
		}
		res.Model, res.Hidden, res.TopK, res.Experts = cfg.Name, cfg.Hidden, cfg.TopK, cfg.Experts
		layer, err := models.NewRoutedLayer(cfg, o.Seed, []int{}, 0) // the router only: identity experts
		if err != nil {
			return nil, err
		}
		if r, err = layer.Route(models.Floats(cfg.Tokens(o.Seed, me, o.Tokens)), o.Tokens); err != nil {
			return nil, err
		}
	}
	if res.Experts%p != 0 {
		return nil, fmt.Errorf("bench: coalesce: %d experts on %d ranks: want a multiple", res.Experts, p)
	}
	pl, err := router.NewPlacement(router.Contiguous, res.Experts, p)
	if err != nil {
		return nil, err
	}
	res.RowBytes = 8 + res.Hidden*o.Wire.Size()
	cp := newCoalescePlan(r, pl, p, me, res.RowBytes)
	all := make([]int64, p*(2*p+res.Experts))
	if err := coll.AllGather(ctx, c, cp.counts(res.Experts), all); err != nil {
		return nil, err
	}
	cp.receive(all, res.Experts, pl)

	ways := []CoalesceRow{{Way: WayPair}, {Way: WayTokenRank}, {Way: WayExpert}, {Way: WayFused}}
	for k := o.MinChunk; k <= o.MaxChunk; k *= 2 {
		ways = append(ways, CoalesceRow{Way: WayChunked, ChunkBytes: k})
	}
	pool := obuf.Default
	if c.SharedMemory() {
		pool = obuf.Shared // what the dispatcher sends from over shm
	}
	maxOut, maxIn := 0, 0
	for q := 0; q < p; q++ {
		maxOut += len(cp.pairs[q])
		maxIn += cp.inPairs[q]
	}
	if maxOut > MaxCoalesceMessages || maxIn > MaxCoalesceMessages {
		return nil, fmt.Errorf("bench: coalesce: %d messages per rank in the pair way: at most %d", max(maxOut, maxIn), MaxCoalesceMessages)
	}
	sendB, recvB := pool.Get(max(maxOut*res.RowBytes, 1)), pool.Get(max(maxIn*res.RowBytes, 1))
	defer sendB.Release()
	defer recvB.Release()
	x := make([]byte, o.Tokens*(res.RowBytes-8))
	for i := range x {
		x[i] = payloadByte(me, i)
	}
	sc := &coalesceScenario{c: c, cp: cp, x: x, send: sendB.Bytes(), recv: recvB.Bytes(), reqs: make([]transport.Request, 0, 2*maxOut+2*maxIn)}
	for wi := range ways {
		if err := sc.run(ctx, wi, &ways[wi], o, res.RowBytes, procRank); err != nil {
			return nil, err
		}
		if me == 0 && o.Progress != nil {
			o.Progress(wi+1, len(ways))
		}
	}
	res.Rows = ways
	res.RecommendedChunk, _, res.Reason = recommendChunk(ways)
	return res, nil
}

// coalesceScenario is one way of sending the dispatch's rows, as a Scenario: a step
// packs this rank's rows and moves them in that way's messages.
type coalesceScenario struct {
	c          *coll.Comm
	cp         *coalescePlan
	x          []byte
	send, recv []byte
	reqs       []transport.Request
	// The way being run: its index, name and chunk, its messages' sizes, and the
	// counters at its first timed step.
	wi        int
	way       *CoalesceRow
	outs, ins [][]int
	cpu0      time.Duration
	sys0, fr0 uint64
}

func (sc *coalesceScenario) Stages() []string { return []string{"exchange"} }

func (sc *coalesceScenario) Step(ctx context.Context, it int, rec []float64) error {
	c, tr := sc.c, sc.c.Transport()
	p := c.Size()
	if it == 0 && rec != nil {
		sc.cpu0 = cpuTime()
		sc.sys0, sc.fr0 = transportCounters(tr)
	}
	tag := transport.Tag{Comm: 0x636f616c, Seq: uint32(sc.wi<<16 | (it+1<<15)&0xffff)} // a private tag space
	start := time.Now()
	sc.cp.pack(sc.way.Way, sc.send, sc.x)
	sc.reqs = sc.reqs[:0]
	off := 0
	for q := 0; q < p; q++ {
		for i, n := range sc.ins[q] {
			tag.Tag = uint32(i)
			rq, err := tr.Irecv(c.WorldRank(q), tag, sc.recv[off:off+n])
			if err != nil {
				return err
			}
			sc.reqs = append(sc.reqs, rq)
			off += n
		}
	}
	off = 0
	for q := 0; q < p; q++ {
		for i, n := range sc.outs[q] {
			tag.Tag = uint32(i)
			rq, err := tr.Isend(c.WorldRank(q), tag, sc.send[off:off+n])
			if err != nil {
				return err
			}
			sc.reqs = append(sc.reqs, rq)
			off += n
		}
	}
	if err := transport.WaitAll(ctx, sc.reqs...); err != nil {
		return err
	}
	if rec != nil {
		rec[0] = time.Since(start).Seconds()
	}
	return nil
}

// run times way w (index wi) and fills its row: messages, bytes, system calls, frames,
// CPU per GB (where procRank: one rank a process counts it), p50, p99 and rows that
// arrived wrong.
func (sc *coalesceScenario) run(ctx context.Context, wi int, w *CoalesceRow, o CoalesceOpts, rowBytes int, procRank bool) error {
	c := sc.c
	p := c.Size()
	sc.wi, sc.way = wi, w
	sc.outs, sc.ins = sc.cp.sizes(w.Way, w.ChunkBytes)
	var msgs, bytes int64
	for q := 0; q < p; q++ {
		msgs += int64(len(sc.outs[q]))
		for _, n := range sc.outs[q] {
			bytes += int64(n)
		}
	}
	tm, err := Time(ctx, c, sc, TimeOpts{Warmup: o.Warmup, Iters: o.Iters, Barrier: true})
	if err != nil {
		return err
	}
	sys1, fr1 := transportCounters(c.Transport())
	wrong := 0
	off := 0
	for q := 0; q < p; q++ {
		n := 0
		for _, k := range sc.ins[q] {
			n += k
		}
		wrong += checkRows(sc.recv[off:off+n], rowBytes, q)
		off += n
	}
	cpu := (cpuTime() - sc.cpu0).Seconds()
	if !procRank {
		cpu = 0
	}
	sums := []float64{float64(msgs), float64(bytes), float64(sys1 - sc.sys0), float64(fr1 - sc.fr0), cpu, float64(wrong)}
	if err := coll.AllReduce(ctx, c, nil, sums, dtype.Sum); err != nil {
		return err
	}
	it := float64(o.Iters)
	w.Messages, w.Bytes = int64(sums[0]), int64(sums[1])
	w.Syscalls, w.Frames, w.Wrong = sums[2]/it, sums[3]/it, int(sums[5])
	if w.Bytes > 0 {
		w.CPUSecGB = sums[4] / (float64(w.Bytes) * it / 1e9)
	}
	st := tm.Stage(0)
	w.P50US, w.P99US = st.P50US, st.P99US
	if w.P50US > 0 {
		w.TokensPerS = float64(o.Tokens*p) / (w.P50US / 1e6)
	}
	return nil
}

// recommendChunk picks, among the fused way and the chunk sizes that do split it, the
// one with the least CPU per GB whose p50 is within 5% of the fastest of them: splitting
// costs messages, so a chunk must buy time to be worth it. Chunks as large as every
// fused message split nothing: their runs are the fused way's too, and the fastest of
// those runs stands for it. It returns the chunk (0: do not split), the row whose figures
// the reason quotes (each figure of the reason is that row's), and the reason.
func recommendChunk(rows []CoalesceRow) (int, *CoalesceRow, string) {
	var fused *CoalesceRow
	for i := range rows {
		if rows[i].Way == WayFused {
			fused = &rows[i]
		}
	}
	if fused == nil {
		return 0, nil, "no fused way was measured"
	}
	unsplit := fused // the fastest run of one message per rank
	best := math.Inf(1)
	var split []*CoalesceRow
	for i := range rows {
		r := &rows[i]
		switch {
		case r.Way == WayFused:
		case r.Way != WayChunked:
			continue
		case r.Messages == fused.Messages:
			if r.P50US < unsplit.P50US {
				unsplit = r
			}
		default:
			split = append(split, r)
		}
		best = min(best, r.P50US)
	}
	which := "the fused run"
	if unsplit != fused {
		which = fmt.Sprintf("the run of %s chunks, which split nothing", SizeOf(int64(unsplit.ChunkBytes)))
	}
	var pick *CoalesceRow
	for _, r := range split {
		if r.P50US <= 1.05*best && (pick == nil || r.CPUSecGB < pick.CPUSecGB) {
			pick = r
		}
	}
	if unsplit.P50US <= 1.05*best && (pick == nil || unsplit.CPUSecGB <= pick.CPUSecGB) {
		return 0, unsplit, fmt.Sprintf("do not split: one fused message per rank is within 5%% of the fastest (p50 %.0f us against %.0f) at the least CPU, %.2f s/GB (%s)",
			unsplit.P50US, best, unsplit.CPUSecGB, which)
	}
	if pick == nil { // no way within 5% of the best: take the fastest
		for _, r := range split {
			if pick == nil || r.P50US < pick.P50US {
				pick = r
			}
		}
	}
	return pick.ChunkBytes, pick, fmt.Sprintf("chunks of %s: p50 %.0f us (the fastest: %.0f) at %.2f CPU s/GB, against %.0f us and %.2f s/GB unsplit (%s)",
		SizeOf(int64(pick.ChunkBytes)), pick.P50US, best, pick.CPUSecGB, unsplit.P50US, unsplit.CPUSecGB, which)
}

// PrintCoalesce writes the study as a table and its recommendation.
func PrintCoalesce(w io.Writer, r *CoalesceResult) {
	path, _, _ := strings.Cut(r.Path, " (")
	fmt.Fprintf(w, "# moex bench coalesce: %s (hidden %d, %d experts, top-%d), %d ranks over %s (%s), %d tokens per rank, %s rows of %d bytes, %d iterations per way\n",
		r.Model, r.Hidden, r.Experts, r.TopK, r.Ranks, r.Transport, path, r.TokensPerRank, r.Wire, r.RowBytes, r.Iters)
	fmt.Fprintln(w, "# per dispatch, every rank together: messages, bytes, system calls (tcp: writes and reads) or ring frames (shm); CPU: user+system of every rank per GB; p50/p99: the slowest rank, over iterations")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	var sys, frames bool // whether the transport counts them
	for _, x := range r.Rows {
		sys, frames = sys || x.Syscalls > 0, frames || x.Frames > 0
	}
	count := func(on bool, v float64) string {
		if !on {
			return "-"
		}
		return fmt.Sprintf("%.0f", v)
	}
	fmt.Fprintln(tw, "way\tchunk\tmessages\tbytes\tsyscalls\tframes\tCPU s/GB\tp50 us\tp99 us\ttokens/s\t#wrong\t")
	for _, x := range r.Rows {
		chunk := "-"
		if x.ChunkBytes > 0 {
			chunk = SizeOf(int64(x.ChunkBytes))
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%.2f\t%.1f\t%.1f\t%.0f\t%d\t\n",
			x.Way, chunk, x.Messages, SizeOf(x.Bytes), count(sys, x.Syscalls), count(frames, x.Frames), x.CPUSecGB, x.P50US, x.P99US, x.TokensPerS, x.Wrong)
	}
	tw.Flush()
	fmt.Fprintf(w, "# recommended: %s\n", r.Reason)
}
