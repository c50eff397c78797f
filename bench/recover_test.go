package bench

import (
	"bytes"
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/transport/inproc"
)

// One rank dies mid-serving: the survivors' result has every phase, in order, and the
// weights that moved; the summary and the table follow from the runs.
func TestRecoverBench(t *testing.T) {
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		cs, err := coll.Local(4, coll.Config{})
		require.NoError(t, err)
		o := RecoverOpts{Model: "tiny-qwen", Tokens: 16, Mode: mode, Victim: 2, WeightBytes: 100}
		var res *RecoverResult
		var wg sync.WaitGroup
		errs := make([]error, len(cs))
		for _, c := range cs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sub, r, err := Recover(context.Background(), c, o, func() { c.Transport().(*inproc.Transport).Kill() })
				if sub != c {
					sub.Close()
				}
				if c.Rank() != o.Victim {
					errs[c.Rank()] = err
				}
				if r != nil {
					res = r
				}
			}()
		}
		wg.Wait()
		for _, c := range cs {
			c.Close()
		}
		for r, err := range errs {
			require.NoError(t, err, "%v rank %d", mode, r)
		}
		require.NotNil(t, res, "%v", mode)
		assert.Equal(t, 4, res.Ranks)
		assert.Equal(t, mode.String(), res.Mode)
		assert.Positive(t, res.Moves, "the lost rank's experts get their second replica back")
		assert.True(t, res.DetectUS <= res.ShrinkUS && res.ShrinkUS <= res.RecoverUS && res.RecoverUS <= res.FirstStepUS, "%+v", res)
		s := SummarizeRecover([]*RecoverResult{res, {FirstStepUS: 2 * res.FirstStepUS}, {FirstStepUS: 0}})
		assert.Equal(t, res.FirstStepUS, s.P50["first_step"])
		assert.Equal(t, 2*res.FirstStepUS, s.Max["first_step"])
		var out bytes.Buffer
		PrintRecover(&out, s)
		assert.Contains(t, out.String(), "first step")
	}
}

// Options that cannot make a recovery are refused before anything runs.
func TestRecoverBenchRefuses(t *testing.T) {
	cs, err := coll.Local(2, coll.Config{})
	require.NoError(t, err)
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	_, _, err = Recover(context.Background(), cs[0], RecoverOpts{Model: "tiny-qwen", Tokens: 4, Victim: 1}, func() {})
	assert.Error(t, err, "two ranks leave one")
	cs3, err := coll.Local(3, coll.Config{})
	require.NoError(t, err)
	defer func() {
		for _, c := range cs3 {
			c.Close()
		}
	}()
	for _, o := range []RecoverOpts{{Model: "tiny-qwen", Tokens: 4, Victim: 3}, {Model: "tiny-qwen", Tokens: 4, Victim: 1, WeightBytes: -1}, {Model: "nope", Tokens: 4}} {
		_, _, err := Recover(context.Background(), cs3[0], o, func() {})
		assert.Error(t, err, "%+v", o)
	}
}
