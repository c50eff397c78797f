package bench

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/dispatch"
)

// A skewed routing served on a contiguous placement is balanced after the rebalance:
// the measured rank imbalance drops to near the plan's, the hottest experts get
// replicas, and the table says so.
func TestEPLBBench(t *testing.T) {
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		o := EPLBOpts{Model: "tiny-qwen", Tokens: 256, Mode: mode, Skew: 1.2, Every: 4, Steps: 8, Redundant: 4}
		res := onRanks(t, 4, coll.Config{}, func(c *coll.Comm) (*EPLBResult, error) { return EPLB(context.Background(), c, o) })
		require.NotNil(t, res)
		assert.Equal(t, 1, res.Rebalances, "%v", mode)
		assert.Equal(t, 16, res.Slots)
		assert.Equal(t, "contiguous", res.Before.Placement)
		assert.Equal(t, 3, res.Before.Steps, "the first step of a placement is left out")
		assert.Equal(t, 3, res.After.Steps)
		assert.Greater(t, res.Before.Imbalance, 1.3, "%v: zipf 1.2 on a contiguous placement", mode)
		assert.Less(t, res.After.Imbalance, 1.25, "%v", mode)
		assert.GreaterOrEqual(t, res.After.Imbalance, 1.0)
		assert.InDelta(t, res.Before.Imbalance/res.After.Imbalance, res.ImbalanceGain, 1e-9)
		assert.NotEmpty(t, res.Replicated, "the hot experts get replicas")
		total := 0
		for _, n := range res.Replicated {
			total += n - 1
		}
		assert.Equal(t, o.Redundant, total, "every redundant slot holds a replica")
		var out bytes.Buffer
		PrintEPLB(&out, res)
		assert.Contains(t, out.String(), "balanced")
	}
}

// Bad periods are refused on every rank.
func TestEPLBBenchRefuses(t *testing.T) {
	cs, err := coll.Local(2, coll.Config{})
	require.NoError(t, err)
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	for _, o := range []EPLBOpts{{Model: "tiny-qwen", Tokens: 8, Every: 1}, {Model: "tiny-qwen", Tokens: 8, Every: 4, Steps: 5}, {Model: "nope", Every: 4}} {
		_, err := EPLB(context.Background(), cs[0], o)
		assert.Error(t, err, "%+v", o)
	}
}
