package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/models"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport"
)

// MoEOpts selects an expert-parallel MoE measurement.
type MoEOpts struct {
	Model     string
	Tokens    int        // tokens per rank
	Wire      dtype.Type // F32 or BF16
	Compute   string     // "none" (identity experts) or "ffn" (the reference SwiGLU)
	Placement string     // "contiguous" (default), "roundrobin"
	Iters     int        // 0: about a second's worth, 3..50
	Warmup    int
	Seed      uint64
	Naive     bool // also time the naive dispatch (one message per token-expert pair)
	// Profile reports how much of the AlltoAllvs' time is waiting for the last rank (the
	// communicator must have been made with coll.Config.Profile).
	Profile bool
	// LocalRanks is how many ranks share this process (memory budget for --compute ffn).
	LocalRanks int
}

// MoEResult is the outcome, the fields of `moex bench moe --json`.
type MoEResult struct {
	Model          string  `json:"model"`
	Ranks          int     `json:"ranks"`
	Transport      string  `json:"transport"`
	TokensPerRank  int     `json:"tokens_per_rank"`
	Hidden         int     `json:"hidden"`
	TopK           int     `json:"top_k"`
	Experts        int     `json:"experts"`
	Wire           string  `json:"wire_dtype"`
	Compute        string  `json:"compute"`
	DispatchUS     float64 `json:"dispatch_us"`
	ComputeUS      float64 `json:"compute_us"`
	CombineUS      float64 `json:"combine_us"`
	TokensPerS     float64 `json:"tokens_per_s"`
	WireBytes      int64   `json:"wire_bytes"`         // bytes all ranks put on the wire per step (dispatch + combine)
	DispatchAlgBW  float64 `json:"dispatch_algbw_gbs"` // slowest rank's dispatch bytes / dispatch time
	ExpertImbal    float64 `json:"expert_imbalance"`   // max/mean tokens per expert
	RankImbal      float64 `json:"rank_imbalance"`     // max/mean rows received per rank
	AuxLoss        float64 `json:"aux_loss"`
	Algo           string  `json:"alltoallv_algo"`
	ConvertUS      float64 `json:"convert_us,omitempty"` // f32<->bf16 conversion of one dispatch's rows, measured apart
	NaiveUS        float64 `json:"naive_dispatch_us,omitempty"`
	NaiveMessages  int64   `json:"naive_messages,omitempty"`
	FusedOverNaive float64 `json:"naive_over_fused,omitempty"`
	Iters          int     `json:"iters"`
	// With profiling, per step (dispatch and combine together), the longest over the
	// ranks: waiting in the AlltoAllvs for the last rank to arrive, and moving after it;
	// and the rank that arrived last most often.
	WaitUS   float64 `json:"wait_us,omitempty"`
	MoveUS   float64 `json:"move_us,omitempty"`
	LastRank *int    `json:"last_rank,omitempty"`
}

func memTotal() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 8 << 30
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) >= 2 && fs[0] == "MemTotal:" {
			kb, _ := strconv.ParseInt(fs[1], 10, 64)
			return kb << 10
		}
	}
	return 8 << 30
}

// moeSetup is one rank's expert-parallel layer and tokens, routed.
type moeSetup struct {
	cfg models.Config
	pl  *router.Placement
	ep  *models.EP
	x   []float32
	r   *router.Routing
}

// setup builds, on this rank, the model's layer (with this rank's experts when o.Compute
// is ffn), its expert-parallel form and routed tokens. It fills o's defaults. The caller
// closes s.ep.
func setup(ctx context.Context, c *coll.Comm, o *MoEOpts) (*moeSetup, error) {
	cfg, err := models.Get(o.Model)
	if err != nil {
		return nil, err
	}
	if o.Wire == 0 {
		o.Wire = dtype.F32
	}
	if o.Warmup == 0 {
		o.Warmup = 2
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	kind := router.Contiguous
	if o.Placement == "roundrobin" {
		kind = router.RoundRobin
	}
	pl, err := router.NewPlacement(kind, cfg.Experts, c.Size())
	if err != nil {
		return nil, err
	}
	experts := []int{} // none: identity experts
	switch o.Compute {
	case "none", "":
		o.Compute = "none"
	case "ffn":
		experts = pl.Local[c.Rank()]
	default:
		return nil, fmt.Errorf("bench: --compute %q (want none or ffn)", o.Compute)
	}
	budget := memTotal() * 6 / 10 / int64(max(o.LocalRanks, 1))
	layer, err := models.NewLayer(cfg, o.Seed, experts, budget)
	if err != nil {
		return nil, fmt.Errorf("%w (use --compute none, a smaller model or fewer ranks per process)", err)
	}
	ep, err := models.NewEP(ctx, c, layer, dispatch.Config{WireDType: o.Wire, Placement: pl})
	if err != nil {
		return nil, err
	}
	x := models.Floats(cfg.Tokens(o.Seed, c.Rank(), o.Tokens))
	r, err := layer.Route(x, o.Tokens)
	if err != nil {
		ep.Close()
		return nil, err
	}
	return &moeSetup{cfg: cfg, pl: pl, ep: ep, x: x, r: r}, nil
}

// MoE runs the measurement on every rank of c (collectively); the result on rank 0.
func MoE(ctx context.Context, c *coll.Comm, o MoEOpts) (*MoEResult, error) {
	su, err := setup(ctx, c, &o)
	if err != nil {
		return nil, err
	}
	defer su.ep.Close()
	cfg, pl, ep, x, r := su.cfg, su.pl, su.ep, su.x, su.r
	p, me := c.Size(), c.Rank()
	out := make([]float32, len(x))
	var tDisp, tComp, tComb time.Duration
	step := func(timed bool) error {
		t0 := time.Now()
		dout, h, err := ep.D.Dispatch(ctx, x, r)
		if err != nil {
			return err
		}
		t1 := time.Now()
		if o.Compute == "ffn" {
			if err := ep.Experts(dout); err != nil {
				return err
			}
		} else {
			ep.Identity(dout)
		}
		t2 := time.Now()
		if err := ep.C.Combine(ctx, h, ep.Output(), out); err != nil {
			return err
		}
		if timed {
			tDisp += t1.Sub(t0)
			tComp += t2.Sub(t1)
			tComb += time.Since(t2)
		}
		return nil
	}
	for i := 0; i < o.Warmup; i++ {
		if err := step(false); err != nil {
			return nil, err
		}
	}
	iters := o.Iters
	if iters <= 0 {
		start := time.Now()
		if err := step(false); err != nil {
			return nil, err
		}
		per := []float64{time.Since(start).Seconds()}
		if err := coll.AllReduce(ctx, c, nil, per, dtype.Max); err != nil {
			return nil, err
		}
		iters = int(min(50, max(3, 1/max(per[0], 1e-6))))
	}
	if err := coll.Barrier(ctx, c); err != nil {
		return nil, err
	}
	prof0 := c.ProfileOf(coll.OpAlltoAllv)
	for i := 0; i < iters; i++ {
		if err := step(true); err != nil {
			return nil, err
		}
	}
	prof := c.ProfileOf(coll.OpAlltoAllv)
	st := ep.D.Stats()
	// Slowest rank per phase; totals of bytes and loads.
	times := []float64{tDisp.Seconds() / float64(iters), tComp.Seconds() / float64(iters), tComb.Seconds() / float64(iters),
		tDisp.Seconds() / float64(iters) / float64(max(st.BytesSent, 1))}
	if err := coll.AllReduce(ctx, c, nil, times, dtype.Max); err != nil {
		return nil, err
	}
	stats := r.Stats()
	loads := make([]int64, 2+p+cfg.Experts)
	loads[0] = int64(st.BytesSent)
	for q, n := range st.RowsPerRank {
		loads[2+q] = int64(n)
	}
	for e, n := range stats.TokensPerExpert {
		loads[2+p+e] = int64(n)
	}
	if err := coll.AllReduce(ctx, c, nil, loads, dtype.Sum); err != nil {
		return nil, err
	}
	res := &MoEResult{
		Model: cfg.Name, Ranks: p, Transport: c.Transport().Name(), TokensPerRank: o.Tokens, Hidden: cfg.Hidden,
		TopK: cfg.TopK, Experts: cfg.Experts, Wire: o.Wire.String(), Compute: o.Compute,
		DispatchUS: times[0] * 1e6, ComputeUS: times[1] * 1e6, CombineUS: times[2] * 1e6, Iters: iters,
		Algo: st.Algo.String(), AuxLoss: stats.AuxLoss,
	}
	// Combine moves one row per (token, serving rank) back: the same count as dispatch,
	// with payload only.
	combineRow := (cfg.Hidden*o.Wire.Size() + 7) &^ 7
	res.WireBytes = loads[0] + loads[0]/int64(ep.D.RowBytes())*int64(combineRow)
	if times[0] > 0 {
		res.DispatchAlgBW = float64(loads[0]) / float64(p) / times[0] / 1e9
	}
	total := times[0] + times[1] + times[2]
	if total > 0 {
		res.TokensPerS = float64(p*o.Tokens) / total
	}
	rowsPerRank := make([]int, p)
	for q := range rowsPerRank {
		rowsPerRank[q] = int(loads[2+q])
	}
	res.RankImbal = router.Imbalance(rowsPerRank)
	perExpert := make([]int, cfg.Experts)
	for e := range perExpert {
		perExpert[e] = int(loads[2+p+e])
	}
	res.ExpertImbal = router.Imbalance(perExpert)
	if o.Wire == dtype.BF16 {
		res.ConvertUS = convertCost(st.RowsSent+st.RowsReceived, cfg.Hidden)
	}
	if o.Profile {
		wm := []float64{(prof.Wait - prof0.Wait).Seconds() / float64(iters) * 1e6, (prof.Move - prof0.Move).Seconds() / float64(iters) * 1e6}
		if err := coll.AllReduce(ctx, c, nil, wm, dtype.Max); err != nil {
			return nil, err
		}
		res.WaitUS, res.MoveUS = wm[0], wm[1]
		last, most := 0, -1
		for q, k := range prof.Last {
			if q < len(prof0.Last) {
				k -= prof0.Last[q]
			}
			if k > most {
				last, most = q, k
			}
		}
		res.LastRank = &last
	}
	if o.Naive {
		us, msgs, err := naiveDispatch(ctx, c, x, r, pl, cfg.Hidden, o.Wire)
		if err != nil {
			return nil, err
		}
		res.NaiveUS, res.NaiveMessages = us, msgs
		if res.DispatchUS > 0 {
			res.FusedOverNaive = us / res.DispatchUS
		}
	}
	if me != 0 {
		return nil, nil
	}
	return res, nil
}

// convertCost times converting rows rows of hidden float32s to bf16 and back.
func convertCost(rows, hidden int) float64 {
	n := rows * hidden
	if n == 0 {
		return 0
	}
	src := make([]float32, n)
	mid := make([]dtype.BFloat16, n)
	dtype.F32ToBF16(mid, src) // touch the pages first
	dtype.BF16ToF32(src, mid)
	start := time.Now()
	const reps = 3
	for i := 0; i < reps; i++ {
		dtype.F32ToBF16(mid, src)
		dtype.BF16ToF32(src, mid)
	}
	return time.Since(start).Seconds() / reps * 1e6
}

// naiveDispatch sends one message per (token, expert) pair, each with its own row and
// metadata, all posted at once: the per-message cost the fused path avoids (and the
// bytes of tokens sent once per expert instead of once per rank). Buffers are allocated
// once, outside the timing, so that the comparison is of messages, not of allocation.
// It returns the slowest rank's time and the total number of messages.
func naiveDispatch(ctx context.Context, c *coll.Comm, x []float32, r *router.Routing, pl *router.Placement, hid int, wire dtype.Type) (float64, int64, error) {
	p, me := c.Size(), c.Rank()
	tr := c.Transport()
	rowBytes := 8 + hid*wire.Size()
	counts := make([]int64, p)
	for i, e := range r.Experts {
		if e >= 0 {
			counts[pl.RankOf(int(e), me, i/r.K)]++
		}
	}
	all := make([]int64, p*p)
	if err := coll.AllGather(ctx, c, counts, all); err != nil {
		return 0, 0, err
	}
	var nIn, nOut int64
	for q := 0; q < p; q++ {
		nIn += all[q*p+me]
		nOut += counts[q]
	}
	inBufs, outBufs := make([][]byte, nIn), make([][]byte, nOut)
	for i := range inBufs {
		inBufs[i] = make([]byte, rowBytes)
	}
	for i := range outBufs {
		outBufs[i] = make([]byte, rowBytes)
	}
	reqs := make([]transport.Request, 0, nIn+nOut)
	sent := make([]int, p)
	const iters = 3
	var el time.Duration
	for it := 0; it <= iters; it++ {
		if err := coll.Barrier(ctx, c); err != nil {
			return 0, 0, err
		}
		start := time.Now()
		// The counts exchange, as the fused path does.
		if err := coll.AllGather(ctx, c, counts, all); err != nil {
			return 0, 0, err
		}
		reqs = reqs[:0]
		tag := transport.Tag{Comm: 0x6e616976, Seq: uint32(it)} // a private tag space
		k := 0
		for q := 0; q < p; q++ {
			for i := 0; i < int(all[q*p+me]); i++ {
				tag.Tag = uint32(i)
				rq, err := tr.Irecv(c.WorldRank(q), tag, inBufs[k])
				if err != nil {
					return 0, 0, err
				}
				k++
				reqs = append(reqs, rq)
			}
		}
		clear(sent)
		k = 0
		for i, e := range r.Experts {
			if e < 0 {
				continue
			}
			t := i / r.K
			q := pl.RankOf(int(e), me, t)
			buf := outBufs[k]
			k++
			if wire == dtype.BF16 {
				dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](buf[8:]), x[t*hid:(t+1)*hid])
			} else {
				copy(buf[8:], dtype.Bytes(x[t*hid:(t+1)*hid]))
			}
			tag.Tag = uint32(sent[q])
			sent[q]++
			rq, err := tr.Isend(c.WorldRank(q), tag, buf)
			if err != nil {
				return 0, 0, err
			}
			reqs = append(reqs, rq)
		}
		if err := transport.WaitAll(ctx, reqs...); err != nil {
			return 0, 0, err
		}
		if it > 0 {
			el += time.Since(start)
		}
	}
	v := []float64{el.Seconds() / iters * 1e6}
	if err := coll.AllReduce(ctx, c, nil, v, dtype.Max); err != nil {
		return 0, 0, err
	}
	m := []int64{nOut}
	if err := coll.AllReduce(ctx, c, nil, m, dtype.Sum); err != nil {
		return 0, 0, err
	}
	return v[0], m[0], nil
}

// PrintMoE writes the result as a table.
func PrintMoE(w io.Writer, r *MoEResult) {
	fmt.Fprintf(w, "# moex bench moe: %s (hidden %d, %d experts, top-%d), %d ranks over %s, %d tokens per rank, %s on the wire, experts: %s\n",
		r.Model, r.Hidden, r.Experts, r.TopK, r.Ranks, r.Transport, r.TokensPerRank, r.Wire, r.Compute)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, v) }
	row("dispatch", fmt.Sprintf("%.1f us (alltoallv: %s, %.2f GB/s per rank)", r.DispatchUS, r.Algo, r.DispatchAlgBW))
	row("expert compute", fmt.Sprintf("%.1f us", r.ComputeUS))
	row("combine", fmt.Sprintf("%.1f us", r.CombineUS))
	row("tokens/s", fmt.Sprintf("%.0f", r.TokensPerS))
	row("bytes on the wire per step", fmt.Sprintf("%d (dispatch + combine, all ranks)", r.WireBytes))
	row("load imbalance", fmt.Sprintf("experts %.2f, ranks %.2f (max/mean); aux loss %.3f", r.ExpertImbal, r.RankImbal, r.AuxLoss))
	if r.ConvertUS > 0 {
		row("bf16 conversion", fmt.Sprintf("%.1f us for this rank's rows (measured apart)", r.ConvertUS))
	}
	if r.LastRank != nil {
		row("alltoallv wait / move", fmt.Sprintf("%.1f / %.1f us per step (longest over the ranks); last to arrive most often: rank %d", r.WaitUS, r.MoveUS, *r.LastRank))
	}
	if r.NaiveUS > 0 {
		row("naive dispatch", fmt.Sprintf("%.1f us, %d messages: fused is %.1fx faster", r.NaiveUS, r.NaiveMessages, r.FusedOverNaive))
	}
	row("iterations", strconv.Itoa(r.Iters))
	tw.Flush()
}
