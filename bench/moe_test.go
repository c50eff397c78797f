package bench

import (
	"context"
	"runtime"
	"strings"
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
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency, dispatch.Gathered} {
		for _, wire := range []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3, dtype.I8} {
			if mode != dispatch.Normal && wire != dtype.FP8E4M3 {
				continue // the wire types are the stages' business (combine's tests); one each
			}
			r := runMoE(t, 3, MoEOpts{Model: "tiny-deepseek", Tokens: 64, Wire: wire, Mode: mode, Compute: "ffn", Iters: 3, Naive: true, Overlap: true, Pairs: 4, LocalRanks: 3})
			if wire == dtype.FP8E4M3 || wire == dtype.I8 {
				// The experts take the quantised rows, as compute or as identity.
				for _, compute := range []string{"ffn", "none"} {
					q := runMoE(t, 3, MoEOpts{Model: "tiny-deepseek", Tokens: 64, Wire: wire, Mode: mode, Compute: compute, Quantized: true, Iters: 2, Pairs: 2, LocalRanks: 3})
					require.NotNil(t, q)
					assert.True(t, q.Quantized)
					assert.Positive(t, q.Dispatch.P50US)
				}
			}
			require.NotNil(t, r)
			assert.Equal(t, mode.String(), r.Mode)
			assert.Zero(t, r.ErrorRel, "no reference for computing experts")
			assert.Equal(t, runtime.GOMAXPROCS(0), r.GOMAXPROCS)
			assert.Equal(t, runtime.NumCPU(), r.HostCPUs)
			assert.Equal(t, 3, r.HostRanks, "the ranks of one process share a host")
			assert.Equal(t, dtype.Kernels(), r.Kernels, "the kernels named are the ones this CPU runs")
			// Ranks of one process read each other's memory: the low-latency combine reads
			// the expert outputs in place, unless told to send partial sums.
			assert.Equal(t, mode == dispatch.LowLatency, r.CombineInPlace)
			// and its experts read the tokens in their origins' memory, unless told to push.
			assert.Equal(t, mode == dispatch.LowLatency, r.DispatchInPlace)
			if mode == dispatch.LowLatency {
				sp := runMoE(t, 3, MoEOpts{Model: "tiny-deepseek", Tokens: 64, Wire: wire, Mode: mode, SendPartials: true, PushRows: true, Iters: 2, Pairs: 2, LocalRanks: 3})
				require.NotNil(t, sp)
				assert.False(t, sp.CombineInPlace)
				assert.False(t, sp.DispatchInPlace)
				assert.Positive(t, sp.Combine.Bytes)
				assert.Equal(t, r.Dispatch.Bytes, sp.Dispatch.Bytes, "the same rows, read in place or pushed")
				// The tokens written where the dispatcher says, with a wire of the
				// activations' type; with another wire the dispatch encodes them anyway.
				for _, w := range []dtype.Type{dtype.F32, wire} {
					ib := runMoE(t, 3, MoEOpts{Model: "tiny-deepseek", Tokens: 64, Wire: w, Mode: mode, TokensInBuffer: true, Iters: 2, Pairs: 2, LocalRanks: 3})
					require.NotNil(t, ib)
					assert.Equal(t, w == dtype.F32, ib.TokensInBuffer, "%v", w)
					assert.True(t, ib.DispatchInPlace)
				}
			}
			for _, s := range []Stage{r.Dispatch, r.Combine} {
				assert.Positive(t, s.P50US)
				assert.GreaterOrEqual(t, s.P99US, s.P50US)
				assert.Positive(t, s.Bytes)
				assert.Positive(t, s.FloorUS)
				assert.Positive(t, s.StepFloorUS)
				assert.InDelta(t, s.P50US/s.StepFloorUS, s.OverStepFloor, 1e-9)
				assert.Positive(t, s.BufferBytes, "every stage holds buffers once it has run")
			}
			// The activations are f32: the dispatch's step floor converts for any other wire.
			assert.Equal(t, wire != dtype.F32, r.Dispatch.StepFloorConverts, "%v", wire)
			assert.False(t, r.Combine.StepFloorConverts)
			assert.Positive(t, r.TokensPerS)
			assert.Positive(t, r.PairUS)
			assert.Positive(t, r.PairP50US)
			assert.GreaterOrEqual(t, r.PairP99US, r.PairP50US)
			assert.Positive(t, r.OverlapSpeedup)
			assert.Equal(t, int64(3*64*4), r.NaiveMessages)
			// Every valid choice is counted once (tiny-deepseek routes top-4 without drops),
			// with DeepEP's bytes per choice.
			assert.Equal(t, int64(3*64*4), r.Choices)
			switch wire {
			case dtype.FP8E4M3:
				assert.Equal(t, 32+4+16, r.BytesPerChoice) // hidden 32: the payload, one scale, 16 B of routing
			case dtype.BF16:
				assert.Equal(t, 64, r.BytesPerChoice)
			}
		}
	}
}

// The combine type sets the partial sums' bytes: fp8 and int8 about half of bf16's (a
// scale per 128 values, or per row, besides), in the normal mode and in the low-latency
// mode sending partial sums; the report names the type.
func TestMoECombineTypes(t *testing.T) {
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		bytes, errs := map[dtype.Type]int64{}, map[dtype.Type]float64{}
		for _, back := range []dtype.Type{dtype.BF16, dtype.FP8E4M3, dtype.I8} {
			r := runMoE(t, 3, MoEOpts{Model: "tiny-deepseek", Tokens: 64, Wire: dtype.BF16, Combine: back, Mode: mode, SendPartials: mode == dispatch.LowLatency, Iters: 2, Pairs: 2, LocalRanks: 3})
			require.NotNil(t, r)
			assert.Equal(t, back.String(), r.CombineWire)
			assert.False(t, r.CombineInPlace)
			bytes[back], errs[back] = r.Combine.Bytes, r.ErrorRel
		}
		// The error against the exact sums: bf16's rounding, then more for fp8 (3 bits of
		// mantissa) than for int8 (a row's 127 steps); none to speak of in f32.
		assert.Positive(t, errs[dtype.BF16], "%v", mode)
		assert.Less(t, errs[dtype.BF16], errs[dtype.I8], "%v", mode)
		assert.Less(t, errs[dtype.I8], errs[dtype.FP8E4M3], "%v", mode)
		assert.Less(t, errs[dtype.FP8E4M3], 0.1, "%v", mode)
		f32 := runMoE(t, 3, MoEOpts{Model: "tiny-deepseek", Tokens: 64, Mode: mode, SendPartials: mode == dispatch.LowLatency, Iters: 2, Pairs: 2, LocalRanks: 3})
		require.NotNil(t, f32)
		assert.Less(t, f32.ErrorRel, 1e-6, "%v: f32 throughout", mode)
		// tiny-deepseek's rows are 32 values: 64 B in bf16, 32 + 4 B in fp8 or int8 (the
		// partial sums; the headers are the same).
		assert.InDelta(t, 36.0/64, float64(bytes[dtype.FP8E4M3])/float64(bytes[dtype.BF16]), 0.02, "%v", mode)
		assert.Equal(t, bytes[dtype.FP8E4M3], bytes[dtype.I8], "%v: one scale a row either way at 32 values", mode)
		// Unsummed, the outputs come back a row per choice, in the activations' type:
		// more bytes than a partial sum per (token, rank) in that type.
		sum := runMoE(t, 3, MoEOpts{Model: "tiny-deepseek", Tokens: 64, Wire: dtype.FP8E4M3, SumAtOrigin: true, Mode: mode, SendPartials: mode == dispatch.LowLatency, Iters: 2, Pairs: 2, LocalRanks: 3})
		part := runMoE(t, 3, MoEOpts{Model: "tiny-deepseek", Tokens: 64, Wire: dtype.FP8E4M3, Combine: dtype.F32, Mode: mode, SendPartials: mode == dispatch.LowLatency, Iters: 2, Pairs: 2, LocalRanks: 3})
		require.NotNil(t, sum)
		require.NotNil(t, part)
		assert.True(t, sum.SumAtOrigin)
		assert.Equal(t, "f32", sum.CombineWire)
		assert.Greater(t, sum.Combine.Bytes, part.Combine.Bytes, "%v", mode)
	}
}

// The step floor's conversions: none where the wire is the activations' type; else each
// token encoded once and each received row decoded, unless the experts take the
// quantised rows; a row decoded once however many entries share it.
func TestStepFloorConversions(t *testing.T) {
	x := make([]float32, 4*256)
	assert.Nil(t, conversions(x, 4, 256, dtype.F32, false, 3))
	for _, w := range []dtype.Type{dtype.BF16, dtype.FP8E4M3, dtype.I8} {
		for _, q := range []bool{false, true} {
			f := conversions(x, 4, 256, w, q, 3)
			require.NotNil(t, f, "%v", w)
			want := 4 + 3
			if q {
				want = 4
			}
			assert.Equal(t, want, f(), "%v quantized=%v: rows converted", w, q)
		}
	}
}

// The bench advises GOMAXPROCS at each rank's share where tcp or ucx ranks share CPUs with
// more Ps than that, and stays quiet otherwise.
func TestSharedCPUsNote(t *testing.T) {
	for _, tc := range []struct {
		transport          string
		procs, cpus, ranks int
		want               string // in the note; "" for none
	}{
		{"tcp", 2, 2, 4, "GOMAXPROCS=1"},
		{"tcp", 2, 2, 2, "GOMAXPROCS=1"},
		{"ucx", 8, 8, 2, "GOMAXPROCS=4"},
		{"shm+tcp", 16, 16, 8, ""}, // shm within the host
		{"tcp", 1, 2, 4, ""},       // already at the share
		{"tcp", 4, 8, 2, ""},       // at the share
		{"tcp", 8, 8, 1, ""},       // one rank: the CPUs are its own
		{"shm", 2, 2, 8, ""},       // shm's waiters keep their Ps on purpose
		{"inproc", 2, 2, 4, ""},
	} {
		note := SharedCPUsNote(&MoEResult{Transport: tc.transport, GOMAXPROCS: tc.procs, HostCPUs: tc.cpus, HostRanks: tc.ranks})
		if tc.want == "" {
			assert.Empty(t, note, "%+v", tc)
		} else {
			assert.Contains(t, note, tc.want, "%+v", tc)
		}
	}
}

// The text report says how many Ps each rank ran with, and how many ranks shared how
// many CPUs: what the stage times depend on where ranks share CPUs.
func TestPrintMoERuntime(t *testing.T) {
	var b strings.Builder
	PrintMoE(&b, &MoEResult{Model: "m", Transport: "tcp", Mode: "low-latency", GOMAXPROCS: 1, HostCPUs: 2, HostRanks: 4})
	assert.Contains(t, b.String(), "GOMAXPROCS 1 per rank (rank 0's); 4 ranks share the host's 2 CPUs")
	assert.NotContains(t, b.String(), "set GOMAXPROCS", "at the share: no advice")

	b.Reset()
	PrintMoE(&b, &MoEResult{Model: "m", Transport: "tcp", Mode: "low-latency", GOMAXPROCS: 2, HostCPUs: 2, HostRanks: 4})
	assert.Contains(t, b.String(), "GOMAXPROCS 2 per rank")
	assert.Contains(t, b.String(), "set GOMAXPROCS=1, each rank's share")
}

// The text report says what memory each stage's buffers hold.
func TestPrintMoEBuffers(t *testing.T) {
	var b strings.Builder
	PrintMoE(&b, &MoEResult{Model: "m", Transport: "shm", Mode: "low-latency", Dispatch: Stage{BufferBytes: 3 << 20}, Combine: Stage{BufferBytes: 500 << 20}})
	assert.Contains(t, b.String(), "dispatch 3.0 MiB, combine 500.0 MiB per rank")
}

// With profiling the report says how long the stages waited and for which ranks: the
// AlltoAllvs in the normal mode, the exchanges in the low-latency mode.
func TestMoEProfile(t *testing.T) {
	const p = 3
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		t.Run(mode.String(), func(t *testing.T) {
			o := MoEOpts{Model: "tiny-deepseek", Tokens: 32, Mode: mode, Iters: 4, Pairs: 2, LocalRanks: p, Profile: true}
			r := onRanks(t, p, coll.Config{Profile: true}, func(c *coll.Comm) (*MoEResult, error) {
				r, err := MoE(context.Background(), c, o)
				// The operation reported is the one the stages ran.
				assert.Positive(t, c.ProfileOf(profiled(mode)).Count, "rank %d: no %v profiled", c.Rank(), profiled(mode))
				return r, err
			})
			require.NotNil(t, r.LastRank)
			assert.Less(t, *r.LastRank, p)
			assert.Len(t, r.WaitForUS, p, "a wait per rank")
			var b strings.Builder
			PrintMoE(&b, r)
			label := map[dispatch.Mode]string{dispatch.Normal: "alltoallv wait / move", dispatch.LowLatency: "exchange wait"}[mode]
			assert.Contains(t, b.String(), label)
			assert.Contains(t, b.String(), "waited longest for rank")
		})
	}
}
