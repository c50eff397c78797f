package combine_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
)

// stageBytes is what one rank's low-latency dispatcher and combiner hold: after New,
// after two steps (one in each of the InFlight slots) and after four.
type stageBytes struct{ dNew, d2, d4, cNew, c2, c4, dClosed, cClosed int }

// lowLatencyBytes runs four steps of the low-latency mode with P ranks of the scenario,
// every rank at MaxTokens tokens, the given experts and configuration (its Hidden,
// TopK, Mode, MaxTokens and Placement set here), and returns what each rank's stages
// held.
func lowLatencyBytes[T combine.Act](t *testing.T, p, experts, maxTokens int, cfg dispatch.Config, back combine.Config, ccfg coll.Config) []stageBytes {
	t.Helper()
	s := scenario{p: p, hid: 256, k: 4, experts: experts, tokens: make([]int, p), seed: 3, maxTokens: maxTokens}
	for i := range s.tokens {
		s.tokens[i] = maxTokens
	}
	cfg.Hidden, cfg.TopK, cfg.Mode, cfg.MaxTokens = s.hid, s.k, dispatch.LowLatency, maxTokens
	cfg.Placement = placement(t, "contiguous", experts, p)
	got := make([]stageBytes, p)
	runRanks(t, p, ccfg, func(c *coll.Comm) error {
		ctx := context.Background()
		d, cb, err := newPairOf[T](ctx, c, cfg, back)
		if err != nil {
			return err
		}
		b := &got[c.Rank()]
		b.dNew, b.cNew = d.Bytes(), cb.Bytes()
		r, x32 := s.routing(c.Rank())
		x := toT[T](x32)
		out := make([]T, len(x))
		for step := 1; step <= 4; step++ {
			o, h, err := d.Dispatch(ctx, x, r)
			if err != nil {
				return err
			}
			if err := cb.Combine(ctx, h, make([]T, o.Rows()*s.hid), out); err != nil {
				return err
			}
			switch step {
			case 2:
				b.d2, b.c2 = d.Bytes(), cb.Bytes()
			case 4:
				b.d4, b.c4 = d.Bytes(), cb.Bytes()
			}
		}
		if err := cb.Close(); err != nil {
			return err
		}
		if err := d.Close(); err != nil {
			return err
		}
		b.dClosed, b.cClosed = d.Bytes(), cb.Bytes()
		return nil
	})
	return got
}

// The low-latency stages' memory is sized once, for MaxTokens tokens from every rank:
// it does not grow from step to step, does not depend on how many experts a rank holds
// (the receive buffers are indexed by source rank), holds every block it may receive
// (and, where blocks travel as messages, every block it may send), and is given back by
// Close.
func TestLowLatencyBytes(t *testing.T) {
	const p, maxTokens, inFlight = 4, 24, 2 // InFlight's default
	for _, windows := range []bool{true, false} {
		for _, wire := range []dtype.Type{dtype.BF16, dtype.FP8E4M3} {
			t.Run(fmt.Sprintf("windows=%v/%v", windows, wire), func(t *testing.T) {
				ccfg := coll.Config{NoWindows: !windows}
				few := lowLatencyBytes[dtype.BFloat16](t, p, 16, maxTokens, dispatch.Config{WireDType: wire}, combine.Config{}, ccfg)
				many := lowLatencyBytes[dtype.BFloat16](t, p, 64, maxTokens, dispatch.Config{WireDType: wire}, combine.Config{}, ccfg)
				f := dispatch.NewFormat(dispatch.Config{Hidden: 256, TopK: 4, WireDType: wire, Mode: dispatch.LowLatency, MaxTokens: maxTokens})
				rows := (inFlight + 1) * p * maxTokens // blocks of every source, per buffered exchange
				for r := 0; r < p; r++ {
					b := few[r]
					assert.Equal(t, b.dNew, many[r].dNew, "rank %d: the dispatch's buffers depend on the experts per rank", r)
					assert.Equal(t, b.d2, b.d4, "rank %d: the dispatch's buffers grew once every slot was used", r)
					assert.Equal(t, b.c2, b.c4, "rank %d: the combine's buffers grew once every slot was used", r)
					if wire == dtype.BF16 && windows { // rows read in place: nothing grows at all
						assert.Equal(t, b.dNew, b.d4, "rank %d: the dispatch's buffers grew", r)
					}
					min := rows * f.Payload
					if !windows {
						min *= 2 // a receive buffer and a send buffer
					}
					assert.GreaterOrEqual(t, b.dNew, min, "rank %d: dispatch", r)
					if windows { // in place: InFlight regions for the outputs of every row that may come
						assert.GreaterOrEqual(t, b.cNew, inFlight*p*maxTokens*2*256, "rank %d: combine", r)
					} else {
						assert.GreaterOrEqual(t, b.cNew, 2*rows*256*2, "rank %d: combine (bf16 partial sums)", r)
					}
					require.Zero(t, b.dClosed, "rank %d: dispatch after Close", r)
					require.Zero(t, b.cClosed, "rank %d: combine after Close", r)
				}
			})
		}
	}
}

// dispatch.LowLatencyBytes and combine.LowLatencyBytes say, before anything runs, what the
// stages hold once every slot has taken MaxTokens tokens: exactly, for windows (shared)
// and messages, wire and activation types, experts given quantised rows, and the
// variants that push rows or send partial sums where ranks share memory.
func TestLowLatencyBytesBeforehand(t *testing.T) {
	const p, experts, maxTokens = 4, 16, 24
	type variant struct {
		name string
		cfg  dispatch.Config
		back combine.Config
	}
	variants := []variant{
		{"bf16", dispatch.Config{WireDType: dtype.BF16}, combine.Config{}},
		{"f32", dispatch.Config{WireDType: dtype.F32}, combine.Config{}},
		{"fp8", dispatch.Config{WireDType: dtype.FP8E4M3}, combine.Config{}},
		{"fp8/quantized", dispatch.Config{WireDType: dtype.FP8E4M3, Quantized: true}, combine.Config{}},
		{"int8/bf16-back", dispatch.Config{WireDType: dtype.I8}, combine.Config{PartialDType: dtype.BF16}},
		{"bf16/pushed/partials", dispatch.Config{WireDType: dtype.BF16, PushRows: true}, combine.Config{SendPartials: true}},
		{"fp8/fp8-back/partials", dispatch.Config{WireDType: dtype.FP8E4M3}, combine.Config{PartialDType: dtype.FP8E4M3, SendPartials: true}},
		{"bf16/int8-back", dispatch.Config{WireDType: dtype.BF16}, combine.Config{PartialDType: dtype.I8}},
		{"fp8/sum-at-origin/partials", dispatch.Config{WireDType: dtype.FP8E4M3}, combine.Config{SumAtOrigin: true, SendPartials: true}},
		{"bf16/inflight3", dispatch.Config{WireDType: dtype.BF16, InFlight: 3}, combine.Config{}},
	}
	for _, windows := range []bool{true, false} {
		for _, v := range variants {
			t.Run(fmt.Sprintf("windows=%v/%s", windows, v.name), func(t *testing.T) {
				ccfg := coll.Config{NoWindows: !windows}
				full := v.cfg
				full.Hidden, full.TopK, full.Mode, full.MaxTokens = 256, 4, dispatch.LowLatency, maxTokens
				full.Placement = placement(t, "contiguous", experts, p)
				t.Run("f32", func(t *testing.T) {
					back := v.back
					if v.back.SumAtOrigin {
						back.PartialDType = 0 // the outputs' type
					}
					checkBeforehand[float32](t, p, experts, maxTokens, v.cfg, full, back, windows, ccfg)
				})
				t.Run("bf16", func(t *testing.T) {
					checkBeforehand[dtype.BFloat16](t, p, experts, maxTokens, v.cfg, full, v.back, windows, ccfg)
				})
			})
		}
	}
	_, err := dispatch.LowLatencyBytes[float32](dispatch.Config{Hidden: 8, TopK: 1, Mode: dispatch.Normal, Placement: placement(t, "contiguous", 4, 2)}, true)
	require.ErrorIs(t, err, dispatch.ErrConfig, "the normal mode has no fixed buffers")
	// The Auto mode's are its low-latency mode's, for AutoMaxTokens unless told.
	auto, err := dispatch.LowLatencyBytes[float32](dispatch.Config{Hidden: 8, TopK: 1, Placement: placement(t, "contiguous", 4, 2)}, true)
	require.NoError(t, err)
	ll, err := dispatch.LowLatencyBytes[float32](dispatch.Config{Hidden: 8, TopK: 1, Mode: dispatch.LowLatency, MaxTokens: dispatch.AutoMaxTokens, Placement: placement(t, "contiguous", 4, 2)}, true)
	require.NoError(t, err)
	assert.Equal(t, ll, auto)
	_, err = combine.LowLatencyBytes[float32](dispatch.Config{Hidden: 8, TopK: 1, Mode: dispatch.LowLatency, Placement: placement(t, "contiguous", 4, 2)}, combine.Config{}, true)
	require.ErrorIs(t, err, dispatch.ErrConfig, "no MaxTokens")
}

func checkBeforehand[T combine.Act](t *testing.T, p, experts, maxTokens int, cfg, full dispatch.Config, back combine.Config, shared bool, ccfg coll.Config) {
	wantD, err := dispatch.LowLatencyBytes[T](full, shared)
	require.NoError(t, err)
	wantC, err := combine.LowLatencyBytes[T](full, back, shared)
	require.NoError(t, err)
	for r, b := range lowLatencyBytes[T](t, p, experts, maxTokens, cfg, back, ccfg) {
		assert.Equal(t, wantD, b.d4, "rank %d: dispatch", r)
		assert.Equal(t, wantC, b.c4, "rank %d: combine", r)
	}
}
