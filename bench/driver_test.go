package bench

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
)

// countingScenario records the steps Time asks for and reports, for stage k of step i,
// rank-dependent seconds, so that the slowest rank's are known.
type countingScenario struct {
	rank    int
	calls   []int // the i of every step, in order
	untimed int   // steps given no record
}

func (s *countingScenario) Stages() []string { return []string{"a", "b"} }

func (s *countingScenario) Step(_ context.Context, i int, rec []float64) error {
	s.calls = append(s.calls, i)
	if rec == nil {
		s.untimed++
		return nil
	}
	rec[0] = float64(i+1) + float64(s.rank) // rank 2 is the slowest: i+3
	rec[1] = float64(10 * (i + 1))
	return nil
}

// Time runs the warm-up untimed, then the timed steps in order, and keeps, per step and
// stage, the slowest rank's time, the same on every rank; the stages' figures follow.
func TestTime(t *testing.T) {
	const p, warmup, iters = 3, 2, 5
	cs, err := coll.Local(p, coll.Config{})
	require.NoError(t, err)
	scs := make([]*countingScenario, p)
	tms := make([]*Timing, p)
	errs := make([]error, p)
	var wg sync.WaitGroup
	for r, c := range cs {
		scs[r] = &countingScenario{rank: r}
		wg.Add(1)
		go func() {
			defer wg.Done()
			tms[r], errs[r] = Time(context.Background(), c, scs[r], TimeOpts{Warmup: warmup, Iters: iters, Barrier: true})
		}()
	}
	wg.Wait()
	for _, c := range cs {
		require.NoError(t, c.Close())
	}
	for r := 0; r < p; r++ {
		require.NoError(t, errs[r], "rank %d", r)
		assert.Equal(t, []int{-2, -1, 0, 1, 2, 3, 4}, scs[r].calls, "rank %d's steps", r)
		assert.Equal(t, warmup, scs[r].untimed, "rank %d's untimed steps", r)
		tm := tms[r]
		assert.Equal(t, iters, tm.Iters)
		assert.Equal(t, []float64{3, 4, 5, 6, 7}, tm.Column(0), "rank %d: stage a, the slowest rank's", r)
		assert.Equal(t, []float64{13, 24, 35, 46, 57}, tm.Steps(), "rank %d: the steps, stages summed", r)
		st := tm.Stage(1)
		assert.InDelta(t, 30e6, st.MeanUS, 1e-3)
		assert.InDelta(t, 30e6, st.P50US, 1e-3, "the median of 10..50")
		assert.InDelta(t, 50e6, st.P99US, 1e-3, "the largest")
	}
}

// The quantiles are the empirical ones (nearest rank), and none of nothing is 0.
func TestPercentile(t *testing.T) {
	v := []float64{5, 1, 4, 2, 3}
	assert.Equal(t, 3.0, percentile(v, 0.5))
	assert.Equal(t, 5.0, percentile(v, 0.99))
	assert.Equal(t, 1.0, percentile(v, 0.2))
	assert.Equal(t, []float64{5, 1, 4, 2, 3}, v, "the input is not sorted in place")
	assert.Zero(t, percentile(nil, 0.5))
	assert.Zero(t, mean(nil))
}

// The slow steps' late rank is the one with the shortest own time in them (it waited
// for nobody), counted only over the steps above twice the p50.
func TestTailOf(t *testing.T) {
	// 3 ranks, 6 steps; steps 2 and 5 are slow, rank 1 came last in both, rank 2 in a
	// fast one.
	own := [][]float64{
		{1, 1, 9, 1, 1, 8},
		{1, 1, 2, 1, 1, 1},
		{1, 0.5, 9, 1, 1, 8},
	}
	slowest := []float64{1, 1, 9, 1, 1, 8}
	tl := tailOf(slowest, 3, func(r, i int) float64 { return own[r][i] })
	assert.Equal(t, Tail{Steps: 2, Late: 1, LateIn: 2}, tl)
	assert.Equal(t, Tail{Late: -1}, tailOf([]float64{1, 1, 1}, 3, func(r, i int) float64 { return 1 }))
}
