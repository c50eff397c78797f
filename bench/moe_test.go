package bench

import (
	"context"
	"sync"
	"testing"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
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
	for _, wire := range []dtype.Type{dtype.F32, dtype.BF16} {
		r := runMoE(t, 3, MoEOpts{Model: "tiny-deepseek", Tokens: 64, Wire: wire, Compute: "ffn", Iters: 2, Naive: true, LocalRanks: 3})
		if r == nil || r.DispatchUS <= 0 || r.TokensPerS <= 0 || r.WireBytes <= 0 || r.NaiveMessages != 3*64*4 {
			t.Fatalf("%+v", r)
		}
	}
}

func BenchmarkMoEStep(b *testing.B) {
	for i := 0; i < b.N; i++ {
		runMoE(b, 4, MoEOpts{Model: "mixtral-8x7b", Tokens: 512, Iters: 20, LocalRanks: 4})
	}
}
