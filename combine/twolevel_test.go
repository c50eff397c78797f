package combine_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// hostTokens is origin o's tokens: small integers and dyadic weights, so that every sum
// below is exact in float32 and bf16, whatever its order.
func hostTokens(o, t, k, experts, hid int) (*router.Routing, []float32) {
	rng := rand.New(rand.NewPCG(uint64(o), 99))
	r := &router.Routing{T: t, K: k, E: experts, Experts: make([]int32, t*k), Weights: make([]float32, t*k)}
	for i := 0; i < t; i++ {
		for j, e := range rng.Perm(experts)[:k] {
			r.Experts[i*k+j], r.Weights[i*k+j] = int32(e), []float32{0.5, 0.25, 1, 0.125}[rng.IntN(4)]
			if rng.IntN(11) == 0 {
				r.Experts[i*k+j], r.Weights[i*k+j] = -1, 0 // dropped
			}
		}
	}
	x := make([]float32, t*hid)
	for i := range x {
		x[i] = float32(rng.IntN(9) - 4)
	}
	return r, x
}

// The two-level dispatch and combine give every token the reference sum (bit for bit:
// the sums are exact) for every host layout, mode, wire type and activation type, with
// replicated experts; each entry names a global expert this rank holds; and a token
// crosses to another host at most once per host, fewer times than the flat dispatch
// sends it to ranks there.
func TestTwoLevel(t *testing.T) {
	const experts, k, hid, tokens = 16, 4, 24, 11
	for _, hosts := range [][]int{{0, 0, 1, 1}, {0, 1, 0, 1}, {0, 0, 0, 0, 1, 1, 1, 1}, {0, 1, 2, 0, 1, 2}, {0, 0, 0}} {
		p := len(hosts)
		pl, err := router.NewPlacement(router.Contiguous, experts, p)
		require.NoError(t, err)
		require.NoError(t, pl.Replicate([]int{0, 5}, 2)) // expert 0 on ranks 0, 1; 5 on two ranks too
		for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
			for _, wire := range []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3} {
				name := fmt.Sprintf("%v/%v/%v", hosts, mode, wire)
				t.Run(name, func(t *testing.T) {
					cfg := step{Config: dispatch.Config{Hidden: hid, TopK: k, Placement: pl, Mode: mode, MaxTokens: tokens, WireDType: wire, PowerOfTwoScales: true}}
					crossed := make([][3]int, p) // rows to other hosts: two-level, flat; relayed within hosts
					errs := onRanks(t, p, coll.Config{Hosts: hosts}, true, func(c *coll.Comm) error {
						return twoLevelRank(c, cfg, hosts, &crossed[c.Rank()], tokens)
					})
					for r, err := range errs {
						require.NoError(t, err, "rank %d", r)
					}
					two, flat := 0, 0
					for _, x := range crossed {
						two, flat = two+x[0], flat+x[1]
					}
					// The planner's count of the rows across hosts is what ran.
					rs := make([]*router.Routing, p)
					for o := range rs {
						rs[o], _ = hostTokens(o, tokens-o%3, k, experts, hid)
					}
					plan, err := combine.NewPlan[float32](cfg.Config, cfg.Back, rs, false)
					require.NoError(t, err)
					ht, err := plan.Hosts(hosts)
					require.NoError(t, err)
					assert.Equal(t, flat, ht.Flat.RowsAcross)
					assert.Equal(t, two, ht.TwoLevel.RowsAcross)
					within := 0
					for _, x := range crossed {
						within += x[2]
					}
					assert.Equal(t, within, ht.TwoLevel.RowsWithin)
					assert.LessOrEqual(t, two, flat)
					if hosts[1] != hosts[0] || len(hosts) > 4 { // ranks of several hosts, several ranks a host
						assert.Less(t, two, flat, "the two-level dispatch sends fewer rows across hosts")
					}
				})
			}
		}
	}
}

// fp8 and int8 partial sums: every token's sum within the quantisation of the host sums
// sent across hosts (within a host they travel in the activation type, so the bound,
// which allows for two quantisations, is loose).
func TestTwoLevelQuantizedCombine(t *testing.T) {
	const experts, k, hid, tokens = 16, 4, 300, 11
	hosts := []int{0, 0, 1, 1}
	pl, err := router.NewPlacement(router.RoundRobin, experts, len(hosts))
	require.NoError(t, err)
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		for _, back := range []dtype.Type{dtype.FP8E4M3, dtype.I8} {
			t.Run(fmt.Sprintf("%v/%v", mode, back), func(t *testing.T) {
				cfg := step{dispatch.Config{Hidden: hid, TopK: k, Placement: pl, Mode: mode, MaxTokens: tokens}, combine.Config{PartialDType: back, SendPartials: mode == dispatch.LowLatency}}
				errs := onRanks(t, len(hosts), coll.Config{Hosts: hosts}, true, func(c *coll.Comm) error {
					d, cb, err := newTwoLevelPair(context.Background(), c, cfg)
					if err != nil {
						return err
					}
					up, down := cb.Up().Config().PartialDType, cb.Down().Config().PartialDType
					cb.Close()
					d.Close()
					if up != back || down != dtype.F32 {
						return fmt.Errorf("partial sums in %v across hosts and %v within, want %v and f32", up, down, back)
					}
					return twoLevelRank(c, cfg, hosts, new([3]int), tokens)
				})
				for r, err := range errs {
					require.NoError(t, err, "rank %d", r)
				}
			})
		}
	}
}

// newTwoLevelPair makes a two-level dispatcher of cfg on c and its combiner, as newPair
// does for the flat ones.
func newTwoLevelPair(ctx context.Context, c *coll.Comm, cfg step) (*dispatch.TwoLevel[float32], *combine.TwoLevel[float32], error) {
	d, err := dispatch.NewTwoLevel[float32](ctx, c, cfg.Config)
	if err != nil {
		return nil, nil, err
	}
	cb, err := combine.NewTwoLevel[float32](ctx, d, cfg.Back)
	if err != nil {
		d.Close()
		return nil, nil, err
	}
	return d, cb, nil
}

func twoLevelRank(c *coll.Comm, cfg step, hosts []int, crossed *[3]int, tokens int) error {
	ctx := context.Background()
	me := c.Rank()
	hid := cfg.Hidden
	r, x := hostTokens(me, tokens-me%3, cfg.TopK, cfg.Placement.Experts, hid)
	d, cb, err := newTwoLevelPair(ctx, c, cfg)
	if err != nil {
		return err
	}
	defer d.Close()
	defer cb.Close()
	for round := 0; round < 2; round++ {
		out, h, err := d.Dispatch(ctx, x, r)
		if err != nil {
			return err
		}
		y := make([]float32, out.Rows()*hid)
		for j := 0; j < out.Rows(); j++ {
			e := out.Expert[j]
			if out.Origin[j] < 0 {
				continue
			}
			if cfg.Placement.LocalIndex(me, int(e)) < 0 {
				return fmt.Errorf("rank %d got a row for expert %d, which it does not hold", me, e)
			}
			for i, v := range out.Entry(j) {
				y[j*hid+i] = v * float32(e+1)
			}
		}
		got := make([]float32, len(x))
		if err := cb.Combine(ctx, h, y, got); err != nil {
			return err
		}
		for t := 0; t < r.T; t++ {
			sum := float32(0)
			for j := 0; j < r.K; j++ {
				if e := r.Experts[t*r.K+j]; e >= 0 {
					sum += r.Weights[t*r.K+j] * float32(e+1)
				}
			}
			// Quantised partial sums, taken twice (a host's sum, then the sum sent across):
			// each within half a code step, an fp8 code's 2^-4 of the value or an int8
			// code's half of the row's largest over 127.
			tol := func(float32) float64 { return 0 }
			if q := cfg.Back.PartialDType; q == dtype.FP8E4M3 || q == dtype.I8 {
				mag, rowMax := float64(0), float64(0)
				for j := 0; j < r.K; j++ {
					if e := r.Experts[t*r.K+j]; e >= 0 {
						mag += math.Abs(float64(r.Weights[t*r.K+j] * float32(e+1)))
					}
				}
				for i := 0; i < hid; i++ {
					rowMax = max(rowMax, mag*math.Abs(float64(x[t*hid+i])))
				}
				tol = func(v float32) float64 {
					if q == dtype.FP8E4M3 {
						return 0x1p-3*mag*math.Abs(float64(v)) + 1e-6*rowMax
					}
					return 2 * rowMax / dtype.I8Max
				}
			}
			for i := 0; i < hid; i++ {
				if want := sum * x[t*hid+i]; math.Abs(float64(got[t*hid+i]-want)) > tol(x[t*hid+i]) {
					return fmt.Errorf("round %d, token %d element %d: %v, want %v", round, t, i, got[t*hid+i], want)
				}
			}
		}
	}
	// Rows to other hosts: the up stage's to other relays, the flat layout's to ranks
	// of other hosts.
	st := d.Up().Stats()
	for q, n := range st.RowsPerRank {
		if q != d.Up().Comm().Rank() {
			crossed[0] += n
		}
	}
	for q, n := range d.Down().Stats().RowsPerRank {
		if q != d.Down().Comm().Rank() {
			crossed[2] += n
		}
	}
	l, err := router.BuildLayout(r, cfg.Placement, me)
	if err != nil {
		return err
	}
	for q, rows := range l.Rows {
		if hosts[q] != hosts[me] {
			crossed[1] += len(rows)
		}
	}
	return nil
}

// The two-level stages say the memory they hold: both levels' buffers and the relay's,
// none after Close.
func TestTwoLevelBytes(t *testing.T) {
	const experts, k, hid, tokens = 16, 4, 24, 11
	hosts := []int{0, 0, 1, 1}
	pl, err := router.NewPlacement(router.Contiguous, experts, len(hosts))
	require.NoError(t, err)
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		t.Run(mode.String(), func(t *testing.T) {
			cfg := dispatch.Config{Hidden: hid, TopK: k, Placement: pl, Mode: mode, MaxTokens: tokens}
			errs := onRanks(t, len(hosts), coll.Config{Hosts: hosts}, true, func(c *coll.Comm) error {
				ctx := context.Background()
				d, err := dispatch.NewTwoLevel[float32](ctx, c, cfg)
				if err != nil {
					return err
				}
				cb, err := combine.NewTwoLevel[float32](ctx, d, combine.Config{})
				if err != nil {
					d.Close()
					return err
				}
				r, x := hostTokens(c.Rank(), tokens, k, experts, hid)
				out, h, err := d.Dispatch(ctx, x, r)
				if err != nil {
					return err
				}
				if err := cb.Combine(ctx, h, make([]float32, out.Rows()*hid), make([]float32, len(x))); err != nil {
					return err
				}
				stages := d.Up().Bytes() + d.Down().Bytes()
				assert.Positive(t, d.Down().Bytes(), "rank %d: the host level", c.Rank())
				assert.Positive(t, d.Up().Bytes(), "rank %d: the level across hosts", c.Rank())
				assert.GreaterOrEqual(t, d.Bytes(), stages, "rank %d: both levels count", c.Rank())
				assert.Positive(t, cb.Bytes(), "rank %d", c.Rank())
				require.NoError(t, cb.Close())
				require.NoError(t, d.Close())
				assert.Zero(t, d.Bytes(), "rank %d: after Close", c.Rank())
				assert.Zero(t, cb.Bytes(), "rank %d: after Close", c.Rank())
				return nil
			})
			for r, err := range errs {
				require.NoError(t, err, "rank %d", r)
			}
		})
	}
}

// SumAtOrigin is refused on the two-level path, which sums each host's terms there
// (ErrConfig from combine.NewTwoLevel, before anything collective), where the cost model
// would pick two levels for DeepSeek-V3's top-8.
func TestTwoLevelSumAtOriginRefused(t *testing.T) {
	hosts := []int{0, 0, 0, 0, 1, 1, 1, 1}
	pl, err := router.NewPlacement(router.Contiguous, 256, len(hosts))
	require.NoError(t, err)
	chose := make([]bool, len(hosts))
	errs := onRanks(t, len(hosts), coll.Config{Hosts: hosts}, false, func(c *coll.Comm) error {
		cfg := dispatch.Config{Hidden: 7168, TopK: 8, Placement: pl, MaxTokens: 128}
		chose[c.Rank()], _ = dispatch.ChooseTwoLevel(c, cfg)
		d, err := dispatch.NewTwoLevel[float32](context.Background(), c, cfg)
		if err != nil {
			return err
		}
		defer d.Close()
		_, err = combine.NewTwoLevel[float32](context.Background(), d, combine.Config{SumAtOrigin: true})
		return err
	})
	for r, err := range errs {
		assert.ErrorIs(t, err, dispatch.ErrConfig, "rank %d", r)
		assert.True(t, chose[r], "rank %d: two levels chosen", r)
	}
}

// One two-level pair serves layers of different placements (UsePlacement): each layer's
// rows and sums are those of a pair made for it alone, and the stages keep their buffers.
func TestTwoLevelManyLayers(t *testing.T) {
	const experts, k, hid, tokens = 16, 4, 24, 11
	hosts := []int{0, 0, 1, 1}
	p := len(hosts)
	var layers []*router.Placement
	for _, kind := range []router.PlacementKind{router.Contiguous, router.RoundRobin} {
		pl, err := router.NewPlacement(kind, experts, p)
		require.NoError(t, err)
		layers = append(layers, pl)
	}
	rep, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	require.NoError(t, rep.Replicate([]int{0, 5}, 2))
	layers = append(layers, rep)
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		t.Run(mode.String(), func(t *testing.T) {
			type result struct {
				experts []int32
				out     []float32
			}
			shared, alone := make([][]result, p), make([][]result, p)
			run := func(ctx context.Context, me int, d *dispatch.TwoLevel[float32], cb *combine.TwoLevel[float32]) (result, error) {
				r, x := hostTokens(me, tokens-me%3, k, experts, hid)
				out, h, err := d.Dispatch(ctx, x, r)
				if err != nil {
					return result{}, err
				}
				y := make([]float32, out.Rows()*hid)
				for j := 0; j < out.Rows(); j++ {
					if out.Origin[j] >= 0 {
						for i, v := range out.Entry(j) {
							y[j*hid+i] = v * float32(out.Expert[j]+1)
						}
					}
				}
				res := result{experts: append([]int32(nil), out.Expert...), out: make([]float32, len(x))}
				return res, cb.Combine(ctx, h, y, res.out)
			}
			errs := onRanks(t, p, coll.Config{Hosts: hosts}, true, func(c *coll.Comm) error {
				ctx := context.Background()
				cfg := step{Config: dispatch.Config{Hidden: hid, TopK: k, Placement: layers[0], Mode: mode, MaxTokens: tokens, MaxLocalExperts: 6}}
				d, cb, err := newTwoLevelPair(ctx, c, cfg)
				if err != nil {
					return err
				}
				defer d.Close()
				defer cb.Close()
				held := 0
				for step := 0; step < 2; step++ {
					for _, pl := range layers {
						if err := d.UsePlacement(pl); err != nil {
							return err
						}
						res, err := run(ctx, c.Rank(), d, cb)
						if err != nil {
							return err
						}
						if step == 1 {
							shared[c.Rank()] = append(shared[c.Rank()], res)
						}
					}
					if step == 0 {
						held = d.Bytes() + cb.Bytes()
					}
				}
				if mode == dispatch.LowLatency && d.Bytes()+cb.Bytes() != held {
					return fmt.Errorf("buffers grew from %d to %d bytes", held, d.Bytes()+cb.Bytes())
				}
				for _, pl := range layers {
					cfg.Placement = pl
					d, cb, err := newTwoLevelPair(ctx, c, cfg)
					if err != nil {
						return err
					}
					res, err := run(ctx, c.Rank(), d, cb)
					cb.Close()
					d.Close()
					if err != nil {
						return err
					}
					alone[c.Rank()] = append(alone[c.Rank()], res)
				}
				return nil
			})
			for r, err := range errs {
				require.NoError(t, err, "rank %d", r)
			}
			for r := range shared {
				for l := range layers {
					assert.Equal(t, alone[r][l].experts, shared[r][l].experts, "rank %d layer %d: the rows' experts", r, l)
					assert.Equal(t, alone[r][l].out, shared[r][l].out, "rank %d layer %d: the sums", r, l)
				}
			}
		})
	}
}
