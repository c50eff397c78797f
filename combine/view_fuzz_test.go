package combine_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// The experts' view of a dispatch against a brute-force reference, on random routings:
// ranks, experts, top-k, tokens per rank (0 included), dropped choices, placements with
// replicas, padding, every wire type (f32, bf16, fp8, int8), rows expert-major or where
// they arrived, in every mode. For every local expert, its real entries are, in (origin
// rank, token) order, exactly the choices of every rank's tokens that the placement
// sends to this rank's copy of the expert, each with its origin, token, weight and
// global expert; each entry's row is its token's as the wire type rounds it (the
// dtype package's encoding and decoding), and Block holds the expert's rows; padding
// entries have no origin and no row. The buffers are reused as a server reuses them: a
// second dispatch in flight before the first is combined (both views stay right), and a
// Redispatch of the first with new activations.
func FuzzDispatchView(f *testing.F) {
	for _, s := range [][5]uint8{{2, 4, 2, 5, 0}, {3, 6, 3, 9, 1}, {5, 12, 4, 7, 2}, {8, 16, 2, 3, 3}, {1, 3, 1, 4, 4}, {4, 8, 8, 12, 5}} {
		f.Add(s[0], s[1], s[2], s[3], s[4], uint64(s[0])*7+uint64(s[4]))
	}
	f.Add(uint8(4), uint8(8), uint8(2), uint8(9), uint8(1), uint64(40)) // an f32 wire (seed%4 == 0)
	f.Fuzz(func(t *testing.T, pIn, expIn, kIn, tokIn, kind uint8, seed uint64) {
		p := 1 + int(pIn)%8
		experts := p * (1 + int(expIn)%4)
		k := 1 + int(kIn)%min(experts, 8)
		rng := rand.New(rand.NewPCG(seed, 1))
		tokens := make([]int, p)
		for r := range tokens {
			tokens[r] = rng.IntN(1 + int(tokIn)%20)
		}
		rs := routings(p, experts, k, tokens, seed)
		pl := fuzzPlacement(t, kind, experts, p, rs)
		align := 1 + int(kind)%3
		wire := []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3, dtype.I8}[int(seed%4)]
		for mi, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency, dispatch.Gathered, dispatch.Auto} {
			cfg := dispatch.Config{Hidden: 8, TopK: k, Placement: pl, Mode: mode, MaxTokens: 20, Align: align, WireDType: wire,
				ExpertMajor: (int(kind)+mi)%2 == 1}
			if mode == dispatch.Auto {
				cfg.MaxTokens = 1 + int(tokIn)%5 // steps that grow the buffers, or not
			}
			checkView(t, fmt.Sprintf("P=%d experts=%d k=%d tokens=%v %v align %d wire %v expert-major %v", p, experts, k, tokens, mode, align, wire, cfg.ExpertMajor), cfg, rs)
		}
	})
}

// fuzzPlacement is a placement of experts on p ranks: contiguous, round-robin, or with
// the hottest experts of rs replicated.
func fuzzPlacement(t *testing.T, kind uint8, experts, p int, rs []*router.Routing) *router.Placement {
	switch kind % 3 {
	case 0:
		pl, err := router.NewPlacement(router.Contiguous, experts, p)
		require.NoError(t, err)
		return pl
	case 1:
		pl, err := router.NewPlacement(router.RoundRobin, experts, p)
		require.NoError(t, err)
		return pl
	}
	load := make([]float64, experts)
	for _, r := range rs {
		for _, e := range r.Experts {
			if e >= 0 {
				load[e]++
			}
		}
	}
	// A redundant slot per rank, where a rank has room for one more than its share (no
	// rank holds two replicas of an expert).
	slots := experts + p
	if slots > experts*p {
		slots = experts
	}
	pl, err := router.Rebalance(load, p, router.Balance{Slots: slots})
	require.NoError(t, err)
	return pl
}

// checkView runs dispatches of rs and compares every rank's Outputs with the reference:
// two in flight, then a Redispatch of the first.
func checkView(t *testing.T, name string, cfg dispatch.Config, rs []*router.Routing) {
	t.Helper()
	p, hid := len(rs), cfg.Hidden
	// Token t of rank o, in the dispatch numbered v, is the row of values
	// v*100000 + o*1000 + t*10 + i: every row is its own.
	row := func(v, o, tok int) []float32 {
		x := make([]float32, hid)
		for i := range x {
			x[i] = float32(v*100000 + o*1000 + tok*10 + i)
		}
		return x
	}
	errs := onRanks(t, p, coll.Config{}, true, func(c *coll.Comm) error {
		ctx := context.Background()
		me := c.Rank()
		d, cb, err := newPairOf[float32](ctx, c, cfg, combine.Config{})
		if err != nil {
			return err
		}
		defer d.Close()
		defer cb.Close()
		xs := make([][]float32, 3)
		for v := range xs {
			for tok := 0; tok < rs[me].T; tok++ {
				xs[v] = append(xs[v], row(v, me, tok)...)
			}
		}
		out1, h1, err := d.Dispatch(ctx, xs[0], rs[me])
		if err != nil {
			return err
		}
		if err := checkOutput(out1, cfg, rs, me, func(o, tok int) []float32 { return row(0, o, tok) }); err != nil {
			return fmt.Errorf("the first dispatch: %w", err)
		}
		out2, h2, err := d.Dispatch(ctx, xs[1], rs[me]) // a second one in flight
		if err != nil {
			return err
		}
		if err := checkOutput(out2, cfg, rs, me, func(o, tok int) []float32 { return row(1, o, tok) }); err != nil {
			return fmt.Errorf("the second dispatch, the first in flight: %w", err)
		}
		if h1.Valid() {
			if err := checkOutput(out1, cfg, rs, me, func(o, tok int) []float32 { return row(0, o, tok) }); err != nil {
				return fmt.Errorf("the first dispatch, after the second: %w", err)
			}
			out1, err = d.Redispatch(ctx, h1, xs[2])
			if err != nil {
				return err
			}
			if err := checkOutput(out1, cfg, rs, me, func(o, tok int) []float32 { return row(2, o, tok) }); err != nil {
				return fmt.Errorf("the first dispatch redispatched: %w", err)
			}
			// The combine of the views takes part, so that every rank ends the step alike.
			if err := cb.Combine(ctx, h1, make([]float32, out1.Rows()*hid), make([]float32, len(xs[0]))); err != nil {
				return err
			}
		}
		return cb.Combine(ctx, h2, make([]float32, out2.Rows()*hid), make([]float32, len(xs[0])))
	})
	for r, err := range errs {
		require.NoError(t, err, "%s: rank %d", name, r)
	}
}

// checkOutput compares rank me's Output with the reference: every local expert's
// entries, rows (as the wire type rounds row(o, tok)) and Block, and its padding.
func checkOutput(out *dispatch.Output[float32], cfg dispatch.Config, rs []*router.Routing, me int, row func(o, tok int) []float32) error {
	pl := cfg.Placement
	for li, e := range pl.Local[me] {
		type entry struct {
			o, tok int
			w      float32
		}
		var want []entry
		for o, r := range rs {
			for tok := 0; tok < r.T; tok++ {
				for j := 0; j < r.K; j++ {
					if int(r.Experts[tok*r.K+j]) == e && pl.RankOf(e, o, tok) == me {
						want = append(want, entry{o, tok, r.Weights[tok*r.K+j]})
					}
				}
			}
		}
		if out.Counts[li] != len(want) {
			return fmt.Errorf("rank %d expert %d: %d entries, want %d", me, e, out.Counts[li], len(want))
		}
		if n := out.Offsets[li+1] - out.Offsets[li]; n%cfg.Align != 0 || n < len(want) || n >= len(want)+cfg.Align {
			return fmt.Errorf("rank %d expert %d: a block of %d entries for %d, Align %d", me, e, n, len(want), cfg.Align)
		}
		block := out.Block(li)
		for i, w := range want {
			j := out.Offsets[li] + i
			if int(out.Origin[j]) != w.o || int(out.Source[j]) != w.tok || out.Weight[j] != w.w || int(out.Expert[j]) != e {
				return fmt.Errorf("rank %d expert %d entry %d: origin %d token %d weight %v expert %d, want %+v", me, e, i, out.Origin[j], out.Source[j], out.Weight[j], out.Expert[j], w)
			}
			got, wantRow := out.Entry(j), wireRound(row(w.o, w.tok), cfg.WireDType, dtype.F32, false)
			if !slices.Equal(got, wantRow) {
				return fmt.Errorf("rank %d expert %d entry %d: %v, want %v", me, e, i, got, wantRow)
			}
			if !slices.Equal(block[i*cfg.Hidden:(i+1)*cfg.Hidden], wantRow) {
				return fmt.Errorf("rank %d expert %d: Block row %d is %v, want %v", me, e, i, block[i*cfg.Hidden:(i+1)*cfg.Hidden], wantRow)
			}
		}
		for j := out.Offsets[li] + len(want); j < out.Offsets[li+1]; j++ {
			if out.Origin[j] != -1 || out.Entry(j) != nil {
				return fmt.Errorf("rank %d expert %d: padding entry %d has origin %d", me, e, j, out.Origin[j])
			}
		}
	}
	return nil
}
