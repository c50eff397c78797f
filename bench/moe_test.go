package bench

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/dispatch"
)

// onRanks runs f on p local ranks (made with cfg) and returns rank 0's result.
func onRanks[T any](t testing.TB, p int, cfg coll.Config, f func(c *coll.Comm) (T, error)) T {
	t.Helper()
	cs, err := coll.Local(p, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	var res T
	var wg sync.WaitGroup
	errs := make([]error, p)
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := f(c)
			errs[c.Rank()] = err
			if c.Rank() == 0 {
				res = r
			}
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return res
}

func runMoE(t testing.TB, p int, o MoEOpts) *MoEResult {
	return onRanks(t, p, coll.Config{}, func(c *coll.Comm) (*MoEResult, error) { return MoE(context.Background(), c, o) })
}

func TestMoEBenchRuns(t *testing.T) {
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		for _, wire := range []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3, dtype.I8} {
			r := runMoE(t, 3, MoEOpts{Model: "tiny-deepseek", Tokens: 64, Wire: wire, Mode: mode, Compute: "ffn", Iters: 3, Naive: true, Overlap: true, Pairs: 4, LocalRanks: 3})
			require.NotNil(t, r)
			assert.Equal(t, mode.String(), r.Mode)
			for _, s := range []Stage{r.Dispatch, r.Combine} {
				assert.Positive(t, s.P50US)
				assert.GreaterOrEqual(t, s.P99US, s.P50US)
				assert.Positive(t, s.Bytes)
				assert.Positive(t, s.FloorUS)
			}
			assert.Positive(t, r.TokensPerS)
			assert.Positive(t, r.PairUS)
			assert.Positive(t, r.OverlapSpeedup)
			assert.Equal(t, int64(3*64*4), r.NaiveMessages)
			// Every valid choice is counted once (tiny-deepseek routes top-4 without drops).
			assert.Equal(t, int64(3*64*4), r.Choices)
		}
	}
}

// The bytes on the wire shrink with the wire type as the formats say: fp8 at most 0.52x
// bf16 at DeepSeek-V3's hidden size.
func TestMoEBenchWireBytes(t *testing.T) {
	bytes := map[dtype.Type]int64{}
	for _, wire := range []dtype.Type{dtype.BF16, dtype.FP8E4M3} {
		r := runMoE(t, 4, MoEOpts{Model: "deepseek-v3", Tokens: 16, Wire: wire, Mode: dispatch.LowLatency, Iters: 2, Pairs: 2, LocalRanks: 4})
		bytes[wire] = r.Dispatch.Bytes
		if wire == dtype.FP8E4M3 {
			assert.Equal(t, 7168+56*4+16, r.BytesPerChoice, "DeepEP's count for fp8")
		} else {
			assert.Equal(t, 2*7168, r.BytesPerChoice)
		}
	}
	ratio := float64(bytes[dtype.FP8E4M3]) / float64(bytes[dtype.BF16])
	assert.LessOrEqual(t, ratio, 0.52, "fp8 dispatch bytes over bf16's")
}

func BenchmarkMoEStep(b *testing.B) {
	for i := 0; i < b.N; i++ {
		runMoE(b, 4, MoEOpts{Model: "mixtral-8x7b", Tokens: 512, Iters: 20, LocalRanks: 4})
	}
}
