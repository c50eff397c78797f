package dispatch_test

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// onRanks runs f on every rank of a p-rank local communicator and returns each rank's error.
func onRanks(t *testing.T, p int, f func(c *coll.Comm) error) []error {
	t.Helper()
	return onRanksCfg(t, p, coll.Config{}, f)
}

// onRanksCfg is onRanks on communicators made with cfg.
func onRanksCfg(t *testing.T, p int, cfg coll.Config, f func(c *coll.Comm) error) []error {
	t.Helper()
	cs, err := coll.Local(p, cfg)
	require.NoError(t, err)
	errs := make([]error, p)
	var wg sync.WaitGroup
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[c.Rank()] = f(c)
		}()
	}
	wg.Wait()
	for _, c := range cs {
		require.NoError(t, c.Close())
	}
	return errs
}

// choicesPerExpert counts the non-dropped (token, expert) choices of the routings per expert.
func choicesPerExpert(experts int, rs ...[]*router.Routing) []float64 {
	n := make([]float64, experts)
	for _, step := range rs {
		for _, r := range step {
			for _, e := range r.Experts {
				if e >= 0 {
					n[e]++
				}
			}
		}
	}
	return n
}

// The recorder's window holds the rows every physical expert took in the last steps,
// across a change of placement, and Gather sums them per logical expert on every rank:
// exactly the choices the routings made.
func TestLoadRecorder(t *testing.T) {
	const p, experts, k, hid = 4, 12, 3, 32
	tokens := []int{9, 14, 0, 6}
	steps := [][]*router.Routing{
		routings(p, experts, k, tokens, 1),
		routings(p, experts, k, tokens, 2),
		routings(p, experts, k, tokens, 3),
	}
	first, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	second, err := router.Rebalance(choicesPerExpert(experts, steps[0]), p, router.Balance{Slots: 16})
	require.NoError(t, err)
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		for _, window := range []int{2, 3} {
			got := make([][][]float64, p)
			local := make([][]int64, p)
			errs := onRanks(t, p, func(c *coll.Comm) error {
				rec, err := dispatch.NewLoadRecorder(2, experts, window)
				if err != nil {
					return err
				}
				for i, rs := range steps {
					pl := first
					if i > 0 {
						pl = second
					}
					d, err := dispatch.New[float32](context.Background(), c, dispatch.Config{Hidden: hid, TopK: k, WireDType: dtype.BF16, Placement: pl, Mode: mode, MaxTokens: 14})
					if err != nil {
						return err
					}
					out, h, err := d.Dispatch(context.Background(), make([]float32, tokens[c.Rank()]*hid), rs[c.Rank()])
					if err == nil {
						err = rec.Record(1, h, out.Counts)
					}
					d.Close()
					if err != nil {
						return err
					}
				}
				local[c.Rank()] = rec.Local(1, nil)
				got[c.Rank()], err = rec.Gather(context.Background(), c)
				return err
			})
			want := choicesPerExpert(experts, steps[3-window:]...)
			sum := make([]int64, experts)
			for r := 0; r < p; r++ {
				require.NoError(t, errs[r])
				assert.Equal(t, make([]float64, experts), got[r][0], "layer 0 recorded nothing")
				assert.Equal(t, want, got[r][1], "%v window %d rank %d", mode, window, r)
				for e, n := range local[r] {
					sum[e] += n
					if n > 0 {
						require.True(t, second.LocalIndex(r, e) >= 0 || window == 3 && first.LocalIndex(r, e) >= 0, "rank %d counted expert %d it never held", r, e)
					}
				}
			}
			for e := range sum {
				assert.Equal(t, want[e], float64(sum[e]))
			}
		}
	}
}

func TestLoadRecorderBadInput(t *testing.T) {
	for _, args := range [][3]int{{0, 8, 1}, {1, 0, 1}, {1, 8, 0}, {1, 8, dispatch.MaxLoadWindow + 1}} {
		_, err := dispatch.NewLoadRecorder(args[0], args[1], args[2])
		require.ErrorIs(t, err, dispatch.ErrConfig, "%v", args)
	}
	pl, err := router.NewPlacement(router.Contiguous, 8, 2)
	require.NoError(t, err)
	errs := onRanks(t, 2, func(c *coll.Comm) error {
		rec, err := dispatch.NewLoadRecorder(1, 8, 4)
		require.NoError(t, err)
		require.ErrorIs(t, rec.Record(0, dispatch.Handle{}, nil), dispatch.ErrStale)
		d, err := dispatch.New[float32](context.Background(), c, dispatch.Config{Hidden: 8, TopK: 2, Placement: pl, MaxTokens: 4})
		if err != nil {
			return err
		}
		defer d.Close()
		rs := routings(2, 8, 2, []int{4, 4}, 5)
		out, h, err := d.Dispatch(context.Background(), make([]float32, 4*8), rs[c.Rank()])
		if err != nil {
			return err
		}
		assert.ErrorIs(t, rec.Record(1, h, out.Counts), dispatch.ErrConfig, "layer out of range")
		assert.ErrorIs(t, rec.Record(0, h, out.Counts[1:]), dispatch.ErrConfig, "counts of another placement")
		other, err := dispatch.NewLoadRecorder(1, 16, 4)
		require.NoError(t, err)
		assert.ErrorIs(t, other.Record(0, h, out.Counts), dispatch.ErrConfig, "experts of another model")
		assert.Equal(t, 0, rec.Steps(0), "a refused record changes nothing")
		return nil
	})
	for _, err := range errs {
		require.NoError(t, err)
	}
}

// routings makes every rank's routing of tokens[o] tokens, each to k distinct experts
// (one choice in nine dropped), from seed.
func routings(p, experts, k int, tokens []int, seed uint64) []*router.Routing {
	rs := make([]*router.Routing, p)
	for o := range rs {
		rng := rand.New(rand.NewPCG(seed, uint64(o)))
		t := tokens[o]
		r := &router.Routing{T: t, K: k, E: experts, Experts: make([]int32, t*k), Weights: make([]float32, t*k)}
		for i := 0; i < t; i++ {
			for j, e := range rng.Perm(experts)[:k] {
				r.Experts[i*k+j], r.Weights[i*k+j] = int32(e), 0.5
				if rng.IntN(9) == 0 {
					r.Experts[i*k+j] = -1
				}
			}
		}
		rs[o] = r
	}
	return rs
}
