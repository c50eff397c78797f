package combine_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/internal/race"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/transporttest"
)

var modes = []dispatch.Mode{dispatch.Normal, dispatch.LowLatency, dispatch.Gathered}

// Failures must never wait for the timeout: tests run with a short one, so that a hang
// shows as ErrTimeout, not as a stalled test.
var quick = coll.Config{Timeout: 10 * time.Second}

func goodRouting() (*router.Routing, []float32) {
	r := &router.Routing{T: 2, K: 2, E: 8, Experts: []int32{0, 5, 7, 2}, Weights: []float32{1, 1, 1, 1}}
	return r, make([]float32, 8)
}

// newPair makes a dispatcher of cfg on c and its combiner of ccfg (float32 activations
// unless newPairOf's T says otherwise).
func newPair(ctx context.Context, c *coll.Comm, cfg dispatch.Config, ccfg combine.Config) (*dispatch.Dispatcher[float32], *combine.Combiner[float32], error) {
	return newPairOf[float32](ctx, c, cfg, ccfg)
}

func newPairOf[T combine.Act](ctx context.Context, c *coll.Comm, cfg dispatch.Config, ccfg combine.Config) (*dispatch.Dispatcher[T], *combine.Combiner[T], error) {
	d, err := dispatch.New[T](ctx, c, cfg)
	if err != nil {
		return nil, nil, err
	}
	cb, err := combine.New[T](ctx, d, ccfg)
	if err != nil {
		d.Close()
		return nil, nil, err
	}
	return d, cb, nil
}

// A rank with bad input makes every rank fail in the same call, with a typed error
// naming it, and the communicator stays usable.
func TestBadInputs(t *testing.T) {
	pl := placement(t, "contiguous", 8, 3)
	ctx := context.Background()
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			runRanks(t, 3, quick, func(c *coll.Comm) error {
				d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: 4, TopK: 2, Placement: pl, Mode: mode, MaxTokens: 4}, combine.Config{})
				if err != nil {
					return err
				}
				defer d.Close()
				defer cb.Close()
				var pie *dispatch.PeerInputError
				expect := func(what string, bad int, err error) error {
					switch {
					case c.Rank() == bad && !errors.Is(err, dispatch.ErrInput):
						return fmt.Errorf("%s: the bad rank got %v", what, err)
					case c.Rank() != bad && (!errors.As(err, &pie) || pie.Rank != bad):
						return fmt.Errorf("%s: rank %d got %v, want a PeerInputError naming rank %d", what, c.Rank(), err, bad)
					}
					return nil
				}
				// An expert out of range on rank 1.
				r, x := goodRouting()
				if c.Rank() == 1 {
					r.Experts[3] = 8
				}
				_, _, err = d.Dispatch(ctx, x, r)
				if err := expect("bad expert", 1, err); err != nil {
					return err
				}
				// Rows and routing of different sizes on rank 2.
				r, x = goodRouting()
				if c.Rank() == 2 {
					x = x[:4]
				}
				_, _, err = d.Dispatch(ctx, x, r)
				if err := expect("shape", 2, err); err != nil {
					return err
				}
				// More tokens than MaxTokens on rank 0 (a limit of the low-latency mode).
				if mode == dispatch.LowLatency {
					big := &router.Routing{T: 5, K: 2, E: 8, Experts: make([]int32, 10), Weights: make([]float32, 10)}
					xb := make([]float32, 20)
					if c.Rank() != 0 {
						big, xb = goodRouting()
					}
					_, _, err = d.Dispatch(ctx, xb, big)
					if err := expect("too many tokens", 0, err); err != nil {
						return err
					}
				}
				// Abandon on rank 1: the others learn in the same call.
				r, x = goodRouting()
				cause := errors.New("router failed")
				if c.Rank() == 1 {
					err = d.Abandon(ctx, cause)
					if !errors.Is(err, cause) {
						return fmt.Errorf("abandon returned %v", err)
					}
				} else {
					_, _, err = d.Dispatch(ctx, x, r)
					if !errors.As(err, &pie) || pie.Rank != 1 {
						return fmt.Errorf("abandoned dispatch: %v", err)
					}
				}
				// The communicator is still usable: a good dispatch and combine work, with
				// a rank at zero tokens.
				r, x = goodRouting()
				if c.Rank() == 0 {
					r, x = &router.Routing{T: 0, K: 2, E: 8}, nil
				}
				out, h, err := d.Dispatch(ctx, x, r)
				if err != nil {
					return fmt.Errorf("good dispatch after errors: %v", err)
				}
				return cb.Combine(ctx, h, make([]float32, out.Rows()*4), make([]float32, len(x)))
			})
		})
	}
	// Configuration errors.
	cs, err := coll.Local(1, coll.Config{})
	require.NoError(t, err)
	defer cs[0].Close()
	pl1 := placement(t, "contiguous", 4, 1)
	for _, cfg := range []dispatch.Config{
		{Hidden: 0, TopK: 1, Placement: pl1},
		{Hidden: 4, TopK: 5, Placement: pl1},
		{Hidden: 4, TopK: 1, Placement: pl1, WireDType: dtype.F16},
		{Hidden: 4, TopK: 1, Placement: pl1, WireDType: dtype.U8},
		{Hidden: 4, TopK: 1, Placement: pl1, MaxLocalExperts: 3}, // its one rank holds 4
		{Hidden: 4, TopK: 1, Placement: pl1, MaxLocalExperts: 5}, // of 4 experts
		{Hidden: 4, TopK: 1, Placement: pl1, MaxLocalExperts: -1},
		{Hidden: 4, TopK: 1, Placement: pl1, PushRows: true, Mode: dispatch.Gathered},
		{Hidden: 4, TopK: 1, Placement: pl1, Quantized: true},
		{Hidden: 4, TopK: 1},
		{Hidden: 4, TopK: 1, Placement: pl},
		{Hidden: 4, TopK: 1, Placement: pl1, Mode: dispatch.LowLatency},
		{Hidden: 4, TopK: 1, Placement: pl1, Mode: dispatch.LowLatency, MaxTokens: dispatch.MaxLowLatencyTokens + 1},
		{Hidden: 4, TopK: 1, Placement: pl1, InFlight: 17},
		{Hidden: 4, TopK: 1, Placement: pl1, Mode: 7},
	} {
		_, err := dispatch.New[float32](context.Background(), cs[0], cfg)
		assert.ErrorIs(t, err, dispatch.ErrConfig, "%+v", cfg)
	}
	_, err = dispatch.New[byte](context.Background(), cs[0], dispatch.Config{Hidden: 4, TopK: 1, Placement: pl1, WireDType: dtype.BF16})
	assert.ErrorIs(t, err, dispatch.ErrConfig, "opaque rows on a bf16 wire")
	// The combine's configuration, checked by combine.New.
	for _, c := range []struct {
		mode dispatch.Mode
		cfg  combine.Config
	}{
		{dispatch.Normal, combine.Config{PartialDType: dtype.F16}},
		{dispatch.Normal, combine.Config{PartialDType: dtype.U8}},
		{dispatch.Gathered, combine.Config{PartialDType: dtype.FP8E4M3}}, // summed on the way
		{dispatch.Gathered, combine.Config{PartialDType: dtype.I8}},
		{dispatch.Gathered, combine.Config{SumAtOrigin: true}},
		{dispatch.Normal, combine.Config{SendPartials: true}},                          // the normal mode sends them anyway
		{dispatch.Normal, combine.Config{SumAtOrigin: true, PartialDType: dtype.BF16}}, // the outputs travel as they are
	} {
		d, err := dispatch.New[float32](context.Background(), cs[0], dispatch.Config{Hidden: 4, TopK: 1, Placement: pl1, Mode: c.mode})
		require.NoError(t, err)
		_, err = combine.New[float32](context.Background(), d, c.cfg)
		assert.ErrorIs(t, err, dispatch.ErrConfig, "%v: %+v", c.mode, c.cfg)
		require.NoError(t, d.Close())
	}
	// A dispatcher serves one combine configuration.
	d, err := dispatch.New[float32](context.Background(), cs[0], dispatch.Config{Hidden: 4, TopK: 1, Placement: pl1})
	require.NoError(t, err)
	defer d.Close()
	cb, err := combine.New[float32](context.Background(), d, combine.Config{})
	require.NoError(t, err)
	defer cb.Close()
	_, err = combine.New[float32](context.Background(), d, combine.Config{PartialDType: dtype.BF16})
	assert.ErrorIs(t, err, dispatch.ErrConfig, "a second combine configuration")
}

// Ranks whose placements differ (another kind, other replicas) or whose configurations
// differ fail every one of them with ErrMismatch in the same call: nothing is delivered
// to the wrong experts, nothing panics.
func TestConfigurationMismatch(t *testing.T) {
	ctx := context.Background()
	for _, mode := range modes {
		for _, what := range []string{"kind", "replicas", "hidden", "wire", "sum-at-origin"} {
			if what == "sum-at-origin" && mode == dispatch.Gathered {
				continue // refused by New on that rank alone: ErrConfig
			}
			t.Run(fmt.Sprintf("%v/%s", mode, what), func(t *testing.T) {
				errs := onRanks(t, 4, quick, false, func(c *coll.Comm) error {
					cfg := dispatch.Config{Hidden: 8, TopK: 2, Mode: mode, MaxTokens: 8, Placement: placement(t, "contiguous", 8, 4)}
					var ccfg combine.Config
					if c.Rank() == 2 {
						switch what {
						case "kind":
							cfg.Placement = placement(t, "roundrobin", 8, 4)
						case "replicas":
							cfg.Placement = placement(t, "replicated", 8, 4)
						case "hidden":
							cfg.Hidden = 16
						case "wire":
							cfg.WireDType = dtype.BF16
						case "sum-at-origin":
							ccfg.SumAtOrigin = true
						}
					}
					d, cb, err := newPair(ctx, c, cfg, ccfg)
					if err != nil {
						return err
					}
					defer d.Close()
					defer cb.Close()
					r := &router.Routing{T: 3, K: 2, E: 8, Experts: []int32{0, 1, 2, 3, 6, 7}, Weights: []float32{1, 1, 1, 1, 1, 1}}
					out, h, err := d.Dispatch(ctx, make([]float32, 3*cfg.Hidden), r)
					if err != nil {
						return err
					}
					// The combine's configuration is checked by the combine.
					return cb.Combine(ctx, h, make([]float32, out.Rows()*cfg.Hidden), make([]float32, 3*cfg.Hidden))
				})
				for r, err := range errs {
					assert.ErrorIs(t, err, coll.ErrMismatch, "rank %d", r)
				}
			})
		}
	}
}

// A rank that passes Combine a stale handle, or buffers of the wrong length, fails with
// its own error, and every other rank with a PeerInputError naming it, in the same call;
// the communicator and the dispatch stay usable.
//
// With SumAtOrigin (the outputs sent unsummed) too, where a rank that calls CombineRows,
// whose rows are summed already, gets ErrConfig and the others a PeerInputError.
func TestCombineBadCall(t *testing.T) {
	s := scenario{p: 4, hid: 8, k: 2, experts: 8, tokens: []int{6, 5, 7, 4}, seed: 3, maxTokens: 8}
	ctx := context.Background()
	type variant struct {
		mode dispatch.Mode
		sum  bool
	}
	variants := []variant{{dispatch.Normal, true}, {dispatch.LowLatency, true}}
	for _, mode := range modes {
		variants = append(variants, variant{mode, false})
	}
	for _, v := range variants {
		mode := v.mode
		t.Run(fmt.Sprintf("%v/sum-at-origin=%v", mode, v.sum), func(t *testing.T) {
			pl := placement(t, "contiguous", s.experts, s.p)
			runRanks(t, s.p, quick, func(c *coll.Comm) error {
				d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, Mode: mode, MaxTokens: s.maxTokens},
					combine.Config{SumAtOrigin: v.sum, SendPartials: v.sum && mode == dispatch.LowLatency})
				if err != nil {
					return err
				}
				defer d.Close()
				defer cb.Close()
				r, x := s.routing(c.Rank())
				var hs []dispatch.Handle
				var outs []*dispatch.Output[float32]
				for i := 0; i < 3; i++ { // InFlight 2: the first handle is stale after the third
					out, h, err := d.Dispatch(ctx, x, r)
					if err != nil {
						return err
					}
					hs, outs = append(hs, h), append(outs, out)
				}
				if hs[0].Valid() {
					return errors.New("handle of the first of three dispatches still valid")
				}
				h, out := hs[2], outs[2]
				y, res := make([]float32, out.Rows()*s.hid), make([]float32, len(x))
				var pie *dispatch.PeerInputError
				for _, bad := range []struct {
					rank int
					want error
					peer error // what the others learn the bad rank found wrong
				}{{1, dispatch.ErrStale, dispatch.ErrStale}, {2, combine.ErrInput, combine.ErrInput}, {0, combine.ErrInput, combine.ErrInput}, {3, dispatch.ErrConfig, combine.ErrInput}} {
					if bad.rank == 3 && !v.sum {
						continue
					}
					hh, yy, rr := h, y, res
					if c.Rank() == bad.rank {
						switch bad.rank {
						case 1:
							hh = hs[0]
						case 2:
							yy = y[:len(y)-1]
						case 0:
							rr = append(res, 0)
						}
					}
					var err error
					if c.Rank() == 3 && bad.rank == 3 {
						err = cb.CombineRows(ctx, hh, make([]float32, hh.IncomingRows()*s.hid), rr)
					} else {
						err = cb.Combine(ctx, hh, yy, rr)
					}
					switch {
					case c.Rank() == bad.rank && !errors.Is(err, bad.want):
						return fmt.Errorf("bad rank %d got %v, want %v", bad.rank, err, bad.want)
					case c.Rank() != bad.rank && (!errors.As(err, &pie) || pie.Rank != bad.rank || !errors.Is(pie, bad.peer) || !errors.Is(pie, dispatch.ErrInput)):
						return fmt.Errorf("rank %d got %v, want a PeerInputError naming rank %d (%v)", c.Rank(), err, bad.rank, bad.peer)
					}
				}
				if err := cb.Combine(ctx, h, y, res); err != nil {
					return fmt.Errorf("combine after the failures: %v", err)
				}
				// Every rank passes the stale handle: every rank says so, nobody waits.
				if err := cb.Combine(ctx, hs[0], y, res); !errors.Is(err, dispatch.ErrStale) {
					return fmt.Errorf("stale everywhere: %v", err)
				}
				return nil
			})
		})
	}
}

// Two dispatches and two combines in flight on one dispatcher (two micro-batches); the
// limit is checked with ErrBusy, the same way on every rank.
func TestInFlight(t *testing.T) {
	s := scenario{p: 3, hid: 16, k: 2, experts: 6, tokens: []int{9, 12, 7}, seed: 21, maxTokens: 12}
	ctx := context.Background()
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			pl := placement(t, "replicated", s.experts, s.p)
			runRanks(t, s.p, quick, func(c *coll.Comm) error {
				d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, Mode: mode, MaxTokens: s.maxTokens}, combine.Config{})
				if err != nil {
					return err
				}
				defer d.Close()
				defer cb.Close()
				r, x := s.routing(c.Rank())
				xb := make([]float32, len(x))
				for i := range xb {
					xb[i] = 2 * x[i]
				}
				pa, err := d.Start(ctx, x, r)
				if err != nil {
					return err
				}
				pb, err := d.Start(ctx, xb, r)
				if err != nil {
					return err
				}
				if _, err := d.Start(ctx, x, r); !errors.Is(err, dispatch.ErrBusy) {
					return fmt.Errorf("third dispatch in flight: %v, want ErrBusy", err)
				}
				oa, ha, err := pa.Wait(ctx)
				if err != nil {
					return err
				}
				ya := identity(oa, s.hid)
				ob, hb, err := pb.Wait(ctx)
				if err != nil {
					return err
				}
				yb := identity(ob, s.hid)
				ra, rb := make([]float32, len(x)), make([]float32, len(x))
				ca, err := cb.Start(ctx, ha, ya, ra)
				if err != nil {
					return err
				}
				// A's combine pins A's buffers: the dispatch that would reuse them waits.
				if _, err := d.Start(ctx, x, r); !errors.Is(err, dispatch.ErrBusy) {
					return fmt.Errorf("dispatch over a running combine: %v, want ErrBusy", err)
				}
				cbb, err := cb.Start(ctx, hb, yb, rb)
				if err != nil {
					return err
				}
				if err := ca.Wait(ctx); err != nil {
					return err
				}
				if err := cbb.Wait(ctx); err != nil {
					return err
				}
				// Identity experts: the sum of the weights times the token.
				for tok := 0; tok < r.T; tok++ {
					w := float32(0)
					for j := 0; j < s.k; j++ {
						if r.Experts[tok*s.k+j] >= 0 {
							w += r.Weights[tok*s.k+j]
						}
					}
					for k := 0; k < s.hid; k++ {
						if ra[tok*s.hid+k] != w*x[tok*s.hid+k] || rb[tok*s.hid+k] != w*xb[tok*s.hid+k] {
							return fmt.Errorf("token %d element %d: %v and %v, want %v and %v", tok, k, ra[tok*s.hid+k], rb[tok*s.hid+k], w*x[tok*s.hid+k], w*xb[tok*s.hid+k])
						}
					}
				}
				return nil
			})
		})
	}
}

func identity(o *dispatch.Output[float32], hid int) []float32 {
	y := make([]float32, o.Rows()*hid)
	for j := 0; j < o.Rows(); j++ {
		copy(y[j*hid:], o.Entry(j))
	}
	return y
}

// Non-finite activations come through each wire type as documented (coll/dtype): bf16
// keeps NaN and infinities; fp8 keeps NaN and saturates infinities to the block's
// largest finite magnitude; int8 turns a row with a NaN into NaNs and saturates
// infinities.
func TestNonFinite(t *testing.T) {
	const hid = 256
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	row := make([]float32, hid)
	for i := range row {
		row[i] = float32(i%7) - 3
	}
	row[5], row[200] = inf, -inf
	withNaN := append([]float32(nil), row...)
	withNaN[9] = nan
	ctx := context.Background()
	pl := placement(t, "contiguous", 2, 2)
	for _, mode := range modes {
		for _, wire := range []dtype.Type{dtype.BF16, dtype.FP8E4M3, dtype.I8} {
			t.Run(fmt.Sprintf("%v/%v", mode, wire), func(t *testing.T) {
				runRanks(t, 2, quick, func(c *coll.Comm) error {
					d, err := dispatch.New[float32](ctx, c, dispatch.Config{Hidden: hid, TopK: 1, Placement: pl, Mode: mode, MaxTokens: 2, WireDType: wire})
					if err != nil {
						return err
					}
					defer d.Close()
					// Both tokens of rank 0 go to expert 1 (rank 1).
					r := &router.Routing{T: 2, K: 1, E: 2, Experts: []int32{1, 1}, Weights: []float32{1, 1}}
					x := append(append([]float32(nil), row...), withNaN...)
					if c.Rank() == 1 {
						r, x = &router.Routing{T: 0, K: 1, E: 2}, nil
					}
					out, _, err := d.Dispatch(ctx, x, r)
					if err != nil || c.Rank() == 0 {
						return err
					}
					if out.Counts[0] != 2 {
						return fmt.Errorf("%d rows", out.Counts[0])
					}
					a, b := out.Entry(out.Offsets[0]), out.Entry(out.Offsets[0]+1)
					switch wire {
					case dtype.BF16:
						if a[5] != inf || b[200] != -inf || !math.IsNaN(float64(b[9])) || a[0] != -3 {
							return fmt.Errorf("bf16: %v %v %v %v", a[5], b[200], b[9], a[0])
						}
					case dtype.FP8E4M3:
						if a[5] != 3 || a[200] != -3 || !math.IsNaN(float64(b[9])) || b[10] != row[10] {
							return fmt.Errorf("fp8: %v %v %v %v", a[5], a[200], b[9], b[10])
						}
					case dtype.I8:
						if a[5] != 3 || a[200] != -3 || math.Abs(float64(a[1]+2)) > 1.5/127 {
							return fmt.Errorf("int8: %v %v %v", a[5], a[200], a[1])
						}
						for _, v := range b {
							if !math.IsNaN(float64(v)) {
								return fmt.Errorf("int8 row with a NaN: %v", v)
							}
						}
					}
					return nil
				})
			})
		}
	}
}

// In steady state a dispatch and a combine allocate nothing, in every mode, with fp8
// partial sums and with the outputs sent unsummed too.
func TestAllocs(t *testing.T) {
	if race.Enabled {
		t.Skip("allocation counts are meaningless under -race (sync.Pool drops items on purpose)")
	}
	s := scenario{p: 2, hid: 64, k: 2, experts: 4, tokens: []int{100, 100}, seed: 1, maxTokens: 100}
	pl := placement(t, "contiguous", s.experts, s.p)
	ctx := context.Background()
	type variant struct {
		wire, back dtype.Type
		sum        bool
	}
	for _, mode := range modes {
		variants := []variant{{wire: dtype.BF16}, {wire: dtype.FP8E4M3}}
		if mode != dispatch.Gathered {
			variants = append(variants, variant{wire: dtype.FP8E4M3, back: dtype.FP8E4M3}, variant{wire: dtype.BF16, sum: true})
		}
		for _, v := range variants {
			wire := v.wire
			cs, err := coll.Local(2, coll.Config{})
			require.NoError(t, err)
			type st struct {
				d   *dispatch.Dispatcher[float32]
				cb  *combine.Combiner[float32]
				r   *router.Routing
				x   []float32
				y   []float32
				res []float32
			}
			sts := make([]*st, 2)
			pools := []*obuf.Pool{obuf.NewPool(0), obuf.NewPool(0)}
			errs := runOnComms(cs, func(c *coll.Comm) error {
				i := c.Rank()
				d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, WireDType: wire, Pool: pools[i], Mode: mode, MaxTokens: s.maxTokens},
					combine.Config{PartialDType: v.back, SumAtOrigin: v.sum, SendPartials: mode == dispatch.LowLatency && (v.back != 0 || v.sum)})
				if err != nil {
					return err
				}
				r, x := s.routing(i)
				sts[i] = &st{d: d, cb: cb, r: r, x: x, y: make([]float32, 4096*s.hid), res: make([]float32, len(x))}
				return nil
			})
			for _, err := range errs {
				require.NoError(t, err)
			}
			step := func(s *st) error {
				out, h, err := s.d.Dispatch(ctx, s.x, s.r)
				if err != nil {
					return err
				}
				return s.cb.Combine(ctx, h, s.y[:out.Rows()*64], s.res)
			}
			other := make(chan struct{})
			done := make(chan error, 1)
			go func() {
				var err error
				for range other {
					if e := step(sts[1]); e != nil && err == nil {
						err = e
					}
				}
				done <- err
			}()
			var first error
			run := func() {
				other <- struct{}{}
				if err := step(sts[0]); err != nil && first == nil {
					first = err
				}
			}
			for i := 0; i < 10; i++ {
				run()
			}
			n := testing.AllocsPerRun(100, run)
			close(other)
			require.NoError(t, <-done)
			require.NoError(t, first)
			assert.Zero(t, n, "%v %+v: allocations per dispatch+combine", mode, v)
			// The buffers came from the pool, and go back to it on Close.
			for i, x := range sts {
				ps := pools[i].Stats()
				assert.True(t, ps.Gets >= 2 && ps.Allocs <= ps.Gets, "rank %d: pool stats %+v", i, ps)
				require.NoError(t, x.cb.Close())
				require.NoError(t, x.d.Close())
				ps = pools[i].Stats()
				assert.Equal(t, ps.Gets, ps.Releases, "rank %d: buffers taken and given back after Close", i)
			}
			for _, c := range cs {
				c.Close()
			}
		}
	}
}

func runOnComms(cs []*coll.Comm, f func(c *coll.Comm) error) []error {
	errs := make([]error, len(cs))
	done := make(chan struct{})
	for i, c := range cs {
		go func() {
			errs[i] = f(c)
			done <- struct{}{}
		}()
	}
	for range cs {
		<-done
	}
	return errs
}

// The chunked pipeline gives the same bits as one dispatch and combine, in both modes,
// for any number of chunks; an expert failure on one rank fails every rank's pipeline
// with a typed error, and the next pipeline works.
func TestPipeline(t *testing.T) {
	s := scenario{p: 4, hid: 16, k: 3, experts: 8, tokens: []int{23, 0, 17, 30}, dropEvery: 6, seed: 31, maxTokens: 30}
	ctx := context.Background()
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			pl := placement(t, "replicated", s.experts, s.p)
			runRanks(t, s.p, quick, func(c *coll.Comm) error {
				d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, Mode: mode, MaxTokens: s.maxTokens, WireDType: dtype.BF16}, combine.Config{})
				if err != nil {
					return err
				}
				defer d.Close()
				defer cb.Close()
				r, x := s.routing(c.Rank())
				var y []float32
				n := 0
				experts := func(o *dispatch.Output[float32]) ([]float32, error) {
					n++
					y = identity(o, s.hid)
					for j := range y {
						y[j] *= float32(o.Expert[j/s.hid] + 1)
					}
					// Every other call, where the combine reads in place, the outputs go
					// there (the chunks' dispatches alternate between the buffers).
					if b := cb.Buffer(o.Handle()); b != nil && n%2 == 0 {
						copy(b, y)
						return b, nil
					}
					return y, nil
				}
				want := make([]float32, len(x))
				if err := cb.Pipeline(ctx, d, x, r, 1, experts, want); err != nil {
					return err
				}
				for _, chunks := range []int{2, 3, 5} {
					got := make([]float32, len(x))
					if err := cb.Pipeline(ctx, d, x, r, chunks, experts, got); err != nil {
						return fmt.Errorf("%d chunks: %w", chunks, err)
					}
					if err := sameRow(got, want); err != nil {
						return fmt.Errorf("%d chunks: %w", chunks, err)
					}
				}
				// Rank 3's experts fail in the second of three chunks.
				boom := errors.New("expert kernel failed")
				calls := 0
				failing := func(o *dispatch.Output[float32]) ([]float32, error) {
					calls++
					if c.Rank() == 3 && calls == 2 {
						return nil, boom
					}
					return experts(o)
				}
				err = cb.Pipeline(ctx, d, x, r, 3, failing, make([]float32, len(x)))
				var pie *dispatch.PeerInputError
				switch {
				case c.Rank() == 3 && !errors.Is(err, boom):
					return fmt.Errorf("failing rank: %v", err)
				case c.Rank() != 3 && (!errors.As(err, &pie) || pie.Rank != 3):
					return fmt.Errorf("rank %d: %v, want a PeerInputError naming rank 3", c.Rank(), err)
				}
				got := make([]float32, len(x))
				if err := cb.Pipeline(ctx, d, x, r, 2, experts, got); err != nil {
					return fmt.Errorf("pipeline after the failure: %w", err)
				}
				return sameRow(got, want)
			})
		})
	}
}

// A bit flipped in a low-latency block's header or metadata on its way from rank 0 to
// rank 1 (its status, its row count, its fingerprint, a row's count of choices, a local
// expert): rank 1 refuses the block (ErrMismatch, or a PeerInputError for a status that
// says rank 0's input was bad), never panics and never reads past it, and no rank hangs:
// every rank's step (dispatch, then combine) ends with an error.
func TestCorruptLowLatencyBlock(t *testing.T) {
	pl := placement(t, "contiguous", 8, 3)
	for _, bit := range []int{3, 8*4 + 1, 8*8 + 1, 8 * (32 + 4), 8*(32+8) + 2} { // status, rows, fingerprint, choices, local expert
		t.Run(fmt.Sprintf("bit %d", bit), func(t *testing.T) {
			var armed atomic.Bool
			ccfg := quick
			ccfg.Wrap = func(rank int, tr transport.Transport) transport.Transport {
				f := transporttest.NewFaulty(tr, func(m transporttest.Msg) transporttest.Fault {
					// The block's first message: its header (status, rows, fingerprint,
					// generation) and the rows' metadata.
					if rank == 0 && m.Peer == 1 && m.Tag.Tag == 0 && armed.CompareAndSwap(true, false) {
						return transporttest.Flip
					}
					return transporttest.Pass
				})
				f.FlipBit = bit
				return f
			}
			errs := onRanks(t, 3, ccfg, true, func(c *coll.Comm) error {
				ctx := context.Background()
				d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: 64, TopK: 2, Placement: pl, Mode: dispatch.LowLatency, MaxTokens: 4}, combine.Config{})
				if err != nil {
					return err
				}
				defer d.Close()
				defer cb.Close()
				if err := coll.Barrier(ctx, c); err != nil {
					return err
				}
				if c.Rank() == 0 {
					armed.Store(true)
				}
				r, _ := goodRouting()
				out, h, err := d.Dispatch(ctx, make([]float32, 2*64), r)
				if err != nil {
					return err
				}
				y := make([]float32, out.Rows()*64)
				return cb.Combine(ctx, h, y, make([]float32, 2*64))
			})
			var pie *dispatch.PeerInputError
			require.True(t, errors.Is(errs[1], dispatch.ErrMismatch) || errors.As(errs[1], &pie), "rank 1: %v", errs[1])
			for r, err := range errs {
				assert.Error(t, err, "rank %d finished a step whose block was corrupt", r)
			}
		})
	}
}

// A rank that hangs, before its dispatch or in its experts: the others' dispatch or
// combine times out naming it (in the low-latency mode, the rank whose blocks never
// came), in both modes, over windows and messages alike, as a serving engine needs to
// find a hung step's culprit.
func TestDispatchTimeoutNamesTheRank(t *testing.T) {
	for _, windows := range []bool{true, false} {
		for _, mode := range []dispatch.Mode{dispatch.LowLatency, dispatch.Normal} {
			for _, inExperts := range []bool{false, true} {
				t.Run(fmt.Sprintf("%v/windows=%v/in-experts=%v", mode, windows, inExperts), func(t *testing.T) {
					checkTimeoutNames(t, mode, windows, inExperts)
				})
			}
		}
	}
}

func checkTimeoutNames(t *testing.T, mode dispatch.Mode, windows, inExperts bool) {
	const p, silent = 3, 1
	s := defaultScenario(p)
	pl := placement(t, "contiguous", s.experts, p)
	errs := onRanks(t, p, coll.Config{Timeout: 300 * time.Millisecond, NoWindows: !windows}, false, func(c *coll.Comm) error {
		ctx := context.Background()
		d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, Mode: mode, MaxTokens: s.maxTokens}, combine.Config{})
		if err != nil {
			return err
		}
		defer d.Close()
		defer cb.Close()
		r, x := s.routing(c.Rank())
		if c.Rank() == silent && !inExperts {
			time.Sleep(600 * time.Millisecond) // hung before the step, past the timeout
			return nil
		}
		o, h, err := d.Dispatch(ctx, x, r)
		if err != nil || c.Rank() == silent {
			time.Sleep(600 * time.Millisecond) // hung in its experts
			return err
		}
		return cb.Combine(ctx, h, make([]float32, o.Rows()*s.hid), make([]float32, len(x)))
	})
	for r, err := range errs {
		if r == silent {
			continue
		}
		require.ErrorIs(t, err, coll.ErrTimeout, "rank %d", r)
		var te *coll.TimeoutError
		require.ErrorAs(t, err, &te, "rank %d", r)
		assert.Contains(t, te.Waiting, silent, "rank %d: %v", r, err)
		if len(te.Stuck) > 0 { // where this rank's own watchdog asked who is stuck
			assert.Equal(t, []int{silent}, te.Stuck, "rank %d: %v", r, err)
		}
	}
}
