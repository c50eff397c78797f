package bench

import (
	"context"
	"fmt"

	"github.com/moex-ai/moex/coll"
)

// FlowRank is what one rank does in one MoE step: what `moex flow` draws.
type FlowRank struct {
	Rank, Host     int
	Tokens         int
	LocalExperts   []int // experts this rank holds
	RowsPerExpert  []int // rows each of them receives
	RowsTo         []int // rows this rank's dispatch sends to each rank (its own stay local)
	RowBytes       int   // a dispatch row on the wire: activations + expert ids + weights
	CombineBytes   int   // a partial sum on the wire
	CountsInts     int   // int64s per rank in the counts all-gather
	CountsAlgo     coll.Algo
	DispatchAlgo   coll.Algo
	CombineAlgo    coll.Algo
	DispatchPlan   string // the dispatch AlltoAllv's schedule on this rank
	CombinePlan    string
	Gating         string
	ExpertsOfRanks [][]int // which experts every rank holds
}

// Flow runs one MoE step (identity experts) on every rank of c and returns what this
// rank did.
func Flow(ctx context.Context, c *coll.Comm, o MoEOpts) (*FlowRank, error) {
	o.Compute = "none"
	su, err := setup[float32](ctx, c, &o)
	if err != nil {
		return nil, err
	}
	defer su.ep.Close()
	cfg, pl, ep, x, r := su.cfg, su.pl, su.ep, su.x, su.r
	out, h, err := ep.D.Dispatch(ctx, x, r)
	if err != nil {
		return nil, err
	}
	counts := append([]int(nil), out.Counts...)
	ep.Identity(out)
	res := make([]float32, len(x))
	if err := ep.C.Combine(ctx, h, ep.Output(), res); err != nil {
		return nil, err
	}
	st := ep.D.Stats()
	fr := &FlowRank{
		Rank: c.Rank(), Host: c.Host(c.Rank()), Tokens: o.Tokens,
		LocalExperts: append([]int(nil), pl.Local[c.Rank()]...), RowsPerExpert: counts,
		RowsTo: append([]int(nil), st.RowsPerRank...), RowBytes: ep.D.RowBytes(), CombineBytes: ep.C.RowBytes(),
		CountsInts: ep.D.CountsExchange(), DispatchAlgo: ep.D.Plan().Algo, CombineAlgo: ep.C.Plan().Algo,
		DispatchPlan: ep.D.Plan().Describe(c), CombinePlan: ep.C.Plan().Describe(c),
		Gating: fmt.Sprint(cfg.Gating), ExpertsOfRanks: pl.Local,
	}
	fr.CountsAlgo = c.Algorithm(coll.OpAllGather, fr.CountsInts*8)
	return fr, nil
}
