package combine_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/internal/race"
	"github.com/moex-ai/moex/router"
)

// layerResult is what one layer's dispatch and combine gave a rank.
type layerResult struct {
	experts []int32   // Output.Expert
	counts  []int     // Output.Counts
	out     []float32 // the combined rows
}

// runLayer dispatches this rank's share of g with d, runs the test's experts and
// combines with cb.
func runLayer(ctx context.Context, c *coll.Comm, g *globalTokens, d *dispatch.Dispatcher[float32], cb *combine.Combiner[float32]) (layerResult, error) {
	return runLayerThen(ctx, c, g, d, cb, noop, nil, 0)
}

func noop() error { return nil }

// runLayerThen is runLayer calling between after the dispatch's Start and again after
// its Wait, and then recording the layer's load into rec (if any) as layer.
func runLayerThen(ctx context.Context, c *coll.Comm, g *globalTokens, d *dispatch.Dispatcher[float32], cb *combine.Combiner[float32], between func() error, rec *dispatch.LoadRecorder, layer int) (layerResult, error) {
	x, r, _ := g.part(c.Rank(), c.Size())
	pend, err := d.Start(ctx, x, r)
	if err != nil {
		return layerResult{}, err
	}
	if err := between(); err != nil {
		return layerResult{}, err
	}
	out, h, err := pend.Wait(ctx)
	if err != nil {
		return layerResult{}, err
	}
	if err := between(); err != nil {
		return layerResult{}, err
	}
	if rec != nil {
		if err := rec.Record(layer, h, out.Counts); err != nil {
			return layerResult{}, err
		}
	}
	y := make([]float32, out.Rows()*g.hid)
	for j := 0; j < out.Rows(); j++ {
		if out.Origin[j] >= 0 {
			for i, v := range out.Entry(j) {
				y[j*g.hid+i] = expertOut(out.Expert[j], v)
			}
		}
	}
	res := layerResult{experts: slices.Clone(out.Expert), counts: slices.Clone(out.Counts), out: make([]float32, len(x))}
	return res, cb.Combine(ctx, h, y, res.out)
}

// One dispatcher and combiner serve every layer, each with its own placement
// (UsePlacement before its dispatch): each layer's rows reach its experts and its sums
// come back exactly as with a dispatcher made for that layer alone, in every mode,
// where the outputs are read in place and where they travel, with buffers made once.
// A layer's dispatch started before the next layer's placement is set keeps its own.
func TestOneDispatcherManyLayers(t *testing.T) {
	const p, experts = 4, 16
	g := newGlobalTokens(24, 4, experts, 40, 31)
	layers := []*router.Placement{placement(t, "contiguous", experts, p), placement(t, "roundrobin", experts, p), placement(t, "replicated", experts, p)}
	most := 0
	for _, pl := range layers {
		for _, l := range pl.Local {
			most = max(most, len(l))
		}
	}
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency, dispatch.Gathered} {
		for _, ccfg := range []coll.Config{{}, {NoWindows: true}} {
			t.Run(fmt.Sprintf("%v/windows=%v", mode, !ccfg.NoWindows), func(t *testing.T) {
				shared := make([][]layerResult, p)
				alone := make([][]layerResult, p)
				runRanks(t, p, ccfg, func(c *coll.Comm) error {
					ctx := context.Background()
					cfg := dispatch.Config{Hidden: g.hid, TopK: g.k, Mode: mode, MaxTokens: g.n, Placement: layers[0], MaxLocalExperts: most}
					d, cb, err := newPair(ctx, c, cfg, combine.Config{})
					if err != nil {
						return err
					}
					defer d.Close()
					defer cb.Close()
					held := 0
					// The layers' loads, by logical expert: recorded from the shared pair's
					// handles, and from each layer's own pair below.
					recShared, err := dispatch.NewLoadRecorder(len(layers), experts, 1)
					if err != nil {
						return err
					}
					recAlone, err := dispatch.NewLoadRecorder(len(layers), experts, 1)
					if err != nil {
						return err
					}
					for step := 0; step < 2; step++ {
						for l, pl := range layers {
							if err := d.UsePlacement(pl); err != nil {
								return err
							}
							// The next layer's placement is set before this one's load is
							// recorded: the handle keeps its own.
							next := func() error { return d.UsePlacement(layers[(l+1)%len(layers)]) }
							res, err := runLayerThen(ctx, c, g, d, cb, next, recShared, l)
							if err != nil {
								return fmt.Errorf("step %d layer %d: %w", step, l, err)
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
						return fmt.Errorf("buffers grew from %d to %d bytes on the second step", held, d.Bytes()+cb.Bytes())
					}
					// A dispatch started under layer 2's placement, then layer 0's set
					// before its Wait: it keeps layer 2's, and the next one takes layer 0's.
					if err := d.UsePlacement(layers[2]); err != nil {
						return err
					}
					res, err := runLayerThen(ctx, c, g, d, cb, func() error { return d.UsePlacement(layers[0]) }, nil, 0)
					if err != nil {
						return err
					}
					shared[c.Rank()] = append(shared[c.Rank()], res)
					if res, err = runLayer(ctx, c, g, d, cb); err != nil {
						return err
					}
					shared[c.Rank()] = append(shared[c.Rank()], res)
					for _, pl := range layers {
						cfg.Placement = pl
						d, cb, err := newPair(ctx, c, cfg, combine.Config{})
						if err != nil {
							return err
						}
						res, err := runLayerThen(ctx, c, g, d, cb, noop, recAlone, len(alone[c.Rank()]))
						cb.Close()
						d.Close()
						if err != nil {
							return err
						}
						alone[c.Rank()] = append(alone[c.Rank()], res)
					}
					for l := range layers {
						if a, b := recShared.Local(l, nil), recAlone.Local(l, nil); !slices.Equal(a, b) {
							return fmt.Errorf("layer %d: load %v recorded through the shared pair, %v through the layer's own", l, a, b)
						}
					}
					return nil
				})
				for r := range shared {
					require.Len(t, shared[r], len(layers)+2)
					for i, l := range []int{0, 1, 2, 2, 0} { // the layers in the order they ran
						assert.Equal(t, alone[r][l].experts, shared[r][i].experts, "rank %d layer %d (#%d): the rows' experts", r, l, i)
						assert.Equal(t, alone[r][l].counts, shared[r][i].counts, "rank %d layer %d (#%d): rows per expert", r, l, i)
						assert.Equal(t, alone[r][l].out, shared[r][i].out, "rank %d layer %d (#%d): the combined rows", r, l, i)
					}
				}
			})
		}
	}
}

// Ranks that dispatch a layer under different placements (one forgot UsePlacement)
// fail together with ErrMismatch; placements the buffers cannot take are ErrConfig.
func TestUsePlacementChecked(t *testing.T) {
	const p, experts = 4, 16
	g := newGlobalTokens(8, 2, experts, 12, 5)
	a, b := placement(t, "contiguous", experts, p), placement(t, "roundrobin", experts, p)
	errs := onRanks(t, p, quick, false, func(c *coll.Comm) error {
		ctx := context.Background()
		d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: g.hid, TopK: g.k, Mode: dispatch.LowLatency, MaxTokens: g.n, Placement: a}, combine.Config{})
		if err != nil {
			return err
		}
		defer d.Close()
		defer cb.Close()
		if err := d.UsePlacement(placement(t, "replicated", experts, p)); !errors.Is(err, dispatch.ErrConfig) {
			return fmt.Errorf("more experts on a rank than MaxLocalExperts: %v", err)
		}
		if err := d.UsePlacement(placement(t, "contiguous", experts, p+1)); !errors.Is(err, dispatch.ErrConfig) {
			return fmt.Errorf("a placement over other ranks: %v", err)
		}
		if err := d.UsePlacement(nil); !errors.Is(err, dispatch.ErrConfig) {
			return fmt.Errorf("no placement: %v", err)
		}
		if c.Rank() != 2 {
			if err := d.UsePlacement(b); err != nil {
				return err
			}
		}
		_, err = runLayer(ctx, c, g, d, cb)
		return err
	})
	for r, err := range errs {
		assert.ErrorIs(t, err, dispatch.ErrMismatch, "rank %d", r)
	}
}

// Switching placements costs no allocation (once the encoding's buffer has grown).
func TestUsePlacementAllocs(t *testing.T) {
	if race.Enabled {
		t.Skip("allocation counts are meaningless under -race")
	}
	const p, experts = 2, 256
	a, b := placement(t, "contiguous", experts, p), placement(t, "roundrobin", experts, p)
	runRanks(t, p, quick, func(c *coll.Comm) error {
		d, err := dispatch.New[float32](context.Background(), c, dispatch.Config{Hidden: 64, TopK: 8, Placement: a, Mode: dispatch.Normal})
		if err != nil {
			return err
		}
		defer d.Close()
		var failed error
		n := testing.AllocsPerRun(50, func() {
			if err := errors.Join(d.UsePlacement(b), d.UsePlacement(a)); err != nil {
				failed = err
			}
		})
		if failed != nil {
			return failed
		}
		if n != 0 {
			return fmt.Errorf("%v allocations per two switches", n)
		}
		return nil
	})
}
