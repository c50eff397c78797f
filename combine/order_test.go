package combine_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// globalTokens is one batch of tokens (activations, routing) split among p ranks in
// contiguous chunks, the same tokens whatever p.
type globalTokens struct {
	hid, k, experts, n int
	x                  []float32
	choices            []int32 // the expert of each (token, choice), -1 where dropped
	weights            []float32
}

func newGlobalTokens(hid, k, experts, n int, seed uint64) *globalTokens {
	rng := rand.New(rand.NewPCG(seed, 1))
	g := &globalTokens{hid: hid, k: k, experts: experts, n: n, x: make([]float32, n*hid), choices: make([]int32, n*k), weights: make([]float32, n*k)}
	for i := range g.x {
		g.x[i] = float32(rng.NormFloat64())
	}
	for t := 0; t < n; t++ {
		for j, e := range rng.Perm(experts)[:k] {
			g.choices[t*k+j], g.weights[t*k+j] = int32(e), float32(rng.Float64())
		}
		if t%7 == 3 {
			g.choices[t*k+1], g.weights[t*k+1] = -1, 0 // a dropped choice
		}
	}
	return g
}

// part is rank r's share of p: its tokens' activations and routing, and the first
// token's global index.
func (g *globalTokens) part(r, p int) ([]float32, *router.Routing, int) {
	lo, hi := r*g.n/p, (r+1)*g.n/p
	rt := &router.Routing{T: hi - lo, K: g.k, E: g.experts,
		Experts: append([]int32(nil), g.choices[lo*g.k:hi*g.k]...), Weights: append([]float32(nil), g.weights[lo*g.k:hi*g.k]...)}
	return append([]float32(nil), g.x[lo*g.hid:hi*g.hid]...), rt, lo
}

// expertOut is the test's expert: expert e scales its row by 1.1*(e+1) (not exact).
func expertOut(e int32, v float32) float32 { return v * 1.1 * float32(e+1) }

// reference is what one process computes for token t: the weighted sum of its experts'
// outputs in float32, in the order of its choices, rounded once to the activations.
func (g *globalTokens) reference(t int, act dtype.Type) []float32 {
	var ws []float32
	var rows [][]float32
	x := g.x[t*g.hid : (t+1)*g.hid]
	if act == dtype.BF16 { // the experts see the tokens in bfloat16
		x = toF32(toT[dtype.BFloat16](x))
	}
	for j := 0; j < g.k; j++ {
		e := g.choices[t*g.k+j]
		if e < 0 {
			continue
		}
		row := make([]float32, g.hid)
		for i := range row {
			row[i] = expertOut(e, x[i])
		}
		if act == dtype.BF16 {
			row = toF32(toT[dtype.BFloat16](row))
		}
		ws, rows = append(ws, g.weights[t*g.k+j]), append(rows, row)
	}
	out := make([]float32, g.hid)
	dtype.WeightedSum(out, ws, rows, false)
	if act == dtype.BF16 {
		out = toF32(toT[dtype.BFloat16](out))
	}
	return out
}

// combineGlobal runs one low-latency dispatch and combine of g over p local ranks with
// the placement kind, and returns every token's combined row, in global order.
func combineGlobal[T combine.Act](t *testing.T, g *globalTokens, p int, plKind string, cfg step) ([]float32, bool) {
	return combineGlobalOn[T](t, g, p, plKind, cfg, coll.Config{})
}

// combineGlobalOn is combineGlobal on ranks of ccfg.
func combineGlobalOn[T combine.Act](t *testing.T, g *globalTokens, p int, plKind string, cfg step, ccfg coll.Config) ([]float32, bool) {
	got := make([]float32, g.n*g.hid)
	inPlace := make([]bool, p)
	cfg.Hidden, cfg.TopK, cfg.MaxTokens = g.hid, g.k, g.n
	cfg.Placement = placement(t, plKind, g.experts, p)
	runRanks(t, p, ccfg, func(c *coll.Comm) error {
		ctx := context.Background()
		d, cb, err := newPairOf[T](ctx, c, cfg.Config, cfg.Back)
		if err != nil {
			return err
		}
		defer d.Close()
		defer cb.Close()
		inPlace[c.Rank()] = cb.InPlace()
		x, r, lo := g.part(c.Rank(), p)
		out, h, err := d.Dispatch(ctx, toT[T](x), r)
		if err != nil {
			return err
		}
		y := make([]float32, out.Rows()*g.hid)
		for j := 0; j < out.Rows(); j++ {
			if out.Origin[j] < 0 {
				continue
			}
			for i, v := range toF32(out.Entry(j)) {
				y[j*g.hid+i] = expertOut(out.Expert[j], v)
			}
		}
		res := make([]T, len(x))
		if err := cb.Combine(ctx, h, toT[T](y), res); err != nil {
			return err
		}
		copy(got[lo*g.hid:], toF32(res))
		return nil
	})
	return got, inPlace[0]
}

// Where the combine reads the expert outputs in place (every rank on one host), each
// token's sum is the one a single process makes, bit for bit, whatever the number of
// ranks and the placement: its experts' outputs weighted and added in float32 in the
// order of its choices (dtype.WeightedSum), as a one-rank combine (of either mode) adds
// them. The engine's results do not change when it adds ranks.
func TestInPlaceSumsAsOneProcess(t *testing.T) {
	g := newGlobalTokens(40, 4, 16, 48, 21)
	check := func(t *testing.T, act dtype.Type, run func(p int, plKind string, mode dispatch.Mode) ([]float32, bool)) {
		for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
			got, _ := run(1, "contiguous", mode)
			for tok := 0; tok < g.n; tok++ {
				require.Equal(t, g.reference(tok, act), got[tok*g.hid:(tok+1)*g.hid], "one rank, %v, token %d", mode, tok)
			}
		}
		for _, p := range []int{2, 3, 4, 8} {
			for _, plKind := range []string{"contiguous", "roundrobin", "replicated"} {
				got, inPlace := run(p, plKind, dispatch.LowLatency)
				require.True(t, inPlace, "ranks of one process read each other's memory")
				for tok := 0; tok < g.n; tok++ {
					require.Equal(t, g.reference(tok, act), got[tok*g.hid:(tok+1)*g.hid], "P=%d %s token %d", p, plKind, tok)
				}
			}
		}
	}
	t.Run("f32", func(t *testing.T) {
		check(t, dtype.F32, func(p int, plKind string, mode dispatch.Mode) ([]float32, bool) {
			return combineGlobal[float32](t, g, p, plKind, step{Config: dispatch.Config{Mode: mode}})
		})
	})
	t.Run("bf16", func(t *testing.T) {
		check(t, dtype.BF16, func(p int, plKind string, mode dispatch.Mode) ([]float32, bool) {
			return combineGlobal[dtype.BFloat16](t, g, p, plKind, step{Config: dispatch.Config{Mode: mode}})
		})
	})
}

// With SumAtOrigin the expert outputs travel unsummed and each token's sum is the one a
// single process makes, bit for bit, wherever the ranks are: in both point-to-point
// modes, over messages (as between hosts) and over windows with the outputs sent
// (SendPartials), for any number of ranks and placement.
func TestSumAtOriginAsOneProcess(t *testing.T) {
	g := newGlobalTokens(40, 4, 16, 48, 23)
	for _, act := range []dtype.Type{dtype.F32, dtype.BF16} {
		for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
			for _, p := range []int{1, 2, 3, 4, 8} {
				for pi, plKind := range []string{"contiguous", "roundrobin", "replicated"} {
					ccfg := coll.Config{NoWindows: (p+pi)%2 == 0}
					cfg := step{dispatch.Config{Mode: mode}, combine.Config{SumAtOrigin: true, SendPartials: mode == dispatch.LowLatency && !ccfg.NoWindows}}
					name := fmt.Sprintf("%v/%v/P=%d/%s/windows=%v", act, mode, p, plKind, !ccfg.NoWindows)
					t.Run(name, func(t *testing.T) {
						var got []float32
						var inPlace bool
						if act == dtype.F32 {
							got, inPlace = combineGlobalOn[float32](t, g, p, plKind, cfg, ccfg)
						} else {
							got, inPlace = combineGlobalOn[dtype.BFloat16](t, g, p, plKind, cfg, ccfg)
						}
						require.False(t, inPlace, "the outputs travel")
						for tok := 0; tok < g.n; tok++ {
							require.Equal(t, g.reference(tok, act), got[tok*g.hid:(tok+1)*g.hid], "token %d", tok)
						}
					})
				}
			}
		}
	}
}
