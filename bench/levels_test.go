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

// The MoE step across (pretend) hosts runs flat and in two levels; the planner's bytes
// across hosts fall with two levels, and the model's choice is reported.
func TestLevelsBench(t *testing.T) {
	hosts := []int{0, 0, 1, 1}
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		var res []*LevelsResult
		for _, l := range []string{"flat", "two", "auto"} {
			o := MoEOpts{Model: "tiny-deepseek", Tokens: 24, Mode: mode, Iters: 2}
			r := onRanks(t, 4, coll.Config{Hosts: hosts}, func(c *coll.Comm) (*LevelsResult, error) { return Levels(context.Background(), c, o, l) })
			require.NotNil(t, r)
			res = append(res, r)
		}
		assert.Equal(t, "flat", res[0].Levels)
		assert.Equal(t, "two-level", res[1].Levels)
		assert.Equal(t, res[2].Chosen, res[2].Levels, "auto runs the model's choice")
		assert.Equal(t, 2, res[0].Hosts)
		assert.Less(t, res[1].AcrossBytes, res[0].AcrossBytes)
		assert.Positive(t, res[1].StepUS)
		var out bytes.Buffer
		PrintLevels(&out, res[:2])
		assert.Contains(t, out.String(), "two-level over flat")
	}
	cs, err := coll.Local(2, coll.Config{})
	require.NoError(t, err)
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	_, err = Levels(context.Background(), cs[0], MoEOpts{Model: "tiny-deepseek", Tokens: 4}, "three")
	assert.Error(t, err)
}
