package combine_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// The experts' view of a dispatch against a brute-force reference, on random routings:
// ranks, experts, top-k, tokens per rank (0 included), dropped choices, placements with
// replicas, padding, in every mode. For every local expert, its real entries are, in
// (origin rank, token) order, exactly the choices of every rank's tokens that the
// placement sends to this rank's copy of the expert, each with its origin, token, weight
// and global expert; each entry's row is its token's (f32 rows travel exactly); padding
// entries have no origin and no row.
func FuzzDispatchView(f *testing.F) {
	for _, s := range [][5]uint8{{2, 4, 2, 5, 0}, {3, 6, 3, 9, 1}, {5, 12, 4, 7, 2}, {8, 16, 2, 3, 3}, {1, 3, 1, 4, 4}, {4, 8, 8, 12, 5}} {
		f.Add(s[0], s[1], s[2], s[3], s[4], uint64(s[0])*7+uint64(s[4]))
	}
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
		for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency, dispatch.Gathered, dispatch.Auto} {
			cfg := dispatch.Config{Hidden: 8, TopK: k, Placement: pl, Mode: mode, MaxTokens: 20, Align: align}
			if mode == dispatch.Auto {
				cfg.MaxTokens = 1 + int(tokIn)%5 // steps that grow the buffers, or not
			}
			checkView(t, fmt.Sprintf("P=%d experts=%d k=%d tokens=%v %v align %d", p, experts, k, tokens, mode, align), cfg, rs)
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

// checkView runs one dispatch of rs and compares every rank's Output with the reference.
func checkView(t *testing.T, name string, cfg dispatch.Config, rs []*router.Routing) {
	t.Helper()
	p, hid, pl := len(rs), cfg.Hidden, cfg.Placement
	// Token t of rank o is the row of values o*1000 + t*10 + i: every row is its own.
	row := func(o, tok int) []float32 {
		x := make([]float32, hid)
		for i := range x {
			x[i] = float32(o*1000 + tok*10 + i)
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
		x := make([]float32, 0, rs[me].T*hid)
		for tok := 0; tok < rs[me].T; tok++ {
			x = append(x, row(me, tok)...)
		}
		out, h, err := d.Dispatch(ctx, x, rs[me])
		if err != nil {
			return err
		}
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
			for i, w := range want {
				j := out.Offsets[li] + i
				if int(out.Origin[j]) != w.o || int(out.Source[j]) != w.tok || out.Weight[j] != w.w || int(out.Expert[j]) != e {
					return fmt.Errorf("rank %d expert %d entry %d: origin %d token %d weight %v expert %d, want %+v", me, e, i, out.Origin[j], out.Source[j], out.Weight[j], out.Expert[j], w)
				}
				got, wantRow := out.Entry(j), row(w.o, w.tok)
				for v := range wantRow {
					if got[v] != wantRow[v] {
						return fmt.Errorf("rank %d expert %d entry %d: value %d is %v, want %v", me, e, i, v, got[v], wantRow[v])
					}
				}
			}
			for j := out.Offsets[li] + len(want); j < out.Offsets[li+1]; j++ {
				if out.Origin[j] != -1 || out.Entry(j) != nil {
					return fmt.Errorf("rank %d expert %d: padding entry %d has origin %d", me, e, j, out.Origin[j])
				}
			}
		}
		// The combine of the view takes part, so that every rank ends the step alike.
		return cb.Combine(ctx, h, make([]float32, out.Rows()*hid), make([]float32, len(x)))
	})
	for r, err := range errs {
		require.NoError(t, err, "%s: rank %d", name, r)
	}
}
