package dispatch

import (
	"context"
	"fmt"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/router"
)

// MaxLoadWindow bounds a LoadRecorder's window, in steps.
const MaxLoadWindow = 1 << 20

// LoadRecorder keeps, per MoE layer, a sliding window of the load on this rank's
// physical experts (every replica apart): the rows each of its experts took in the
// last Window dispatches of that layer. A dispatch already knows these counts
// (Output.Counts), so recording costs no communication; Gather sums every rank's
// window per logical expert when the engine wants to rebalance. The engine picks the
// window and how often it gathers.
//
// A recorder is used by one goroutine, like the dispatcher it records.
type LoadRecorder struct {
	experts, window int
	layers          []layerLoad
}

type layerLoad struct {
	steps  [][]int32 // ring of Window steps: rows per local expert
	locals [][]int   // the global ids of the local experts of each step
	next   int
	n      int     // steps recorded, at most Window
	sum    []int64 // per logical expert, over the window
}

// NewLoadRecorder makes a recorder for layers MoE layers of experts logical experts,
// keeping the last window steps of each.
func NewLoadRecorder(layers, experts, window int) (*LoadRecorder, error) {
	switch {
	case layers < 1 || layers > 1<<16:
		return nil, fmt.Errorf("%w: load recorder for %d layers (want 1..%d)", ErrConfig, layers, 1<<16)
	case experts < 1 || experts > router.MaxExperts:
		return nil, fmt.Errorf("%w: load recorder for %d experts (want 1..%d)", ErrConfig, experts, router.MaxExperts)
	case window < 1 || window > MaxLoadWindow:
		return nil, fmt.Errorf("%w: load window of %d steps (want 1..%d)", ErrConfig, window, MaxLoadWindow)
	}
	r := &LoadRecorder{experts: experts, window: window, layers: make([]layerLoad, layers)}
	for i := range r.layers {
		r.layers[i] = layerLoad{steps: make([][]int32, window), locals: make([][]int, window), sum: make([]int64, experts)}
	}
	return r, nil
}

// Record adds one dispatch of layer: h is its handle and counts its Output.Counts
// (rows per local expert). The step that falls out of the window is dropped.
func (r *LoadRecorder) Record(layer int, h Handle, counts []int) error {
	if layer < 0 || layer >= len(r.layers) {
		return fmt.Errorf("%w: layer %d of %d", ErrConfig, layer, len(r.layers))
	}
	pl := h.Placement()
	if pl == nil {
		return fmt.Errorf("%w: a zero Handle", ErrStale)
	}
	local := pl.Local[h.s.sched.Rank]
	switch {
	case pl.Experts != r.experts:
		return fmt.Errorf("%w: a placement of %d experts into a recorder of %d", ErrConfig, pl.Experts, r.experts)
	case len(counts) != len(local):
		return fmt.Errorf("%w: %d counts for %d local experts", ErrConfig, len(counts), len(local))
	}
	l := &r.layers[layer]
	if l.n == r.window {
		old, olocal := l.steps[l.next], l.locals[l.next]
		for i, e := range olocal {
			l.sum[e] -= int64(old[i])
		}
	} else {
		l.n++
	}
	step := l.steps[l.next][:0]
	for i, n := range counts {
		step = append(step, int32(n))
		l.sum[local[i]] += int64(n)
	}
	l.steps[l.next], l.locals[l.next] = step, local
	l.next = (l.next + 1) % r.window
	return nil
}

// Steps is how many steps of layer the window holds now.
func (r *LoadRecorder) Steps(layer int) int { return r.layers[layer].n }

// Local returns this rank's load per logical expert of layer over the window (the
// rows its replicas took), into dst (len: experts).
func (r *LoadRecorder) Local(layer int, dst []int64) []int64 {
	dst = append(dst[:0], r.layers[layer].sum...)
	return dst
}

// Reset empties every layer's window (after a new placement, say, to measure it alone).
func (r *LoadRecorder) Reset() {
	for i := range r.layers {
		l := &r.layers[i]
		l.next, l.n = 0, 0
		clear(l.sum)
		clear(l.locals)
	}
}

// Gather sums every rank's window (collectively: every rank of c calls it) and returns
// the load per logical expert of every layer, the same on every rank: the input of
// router.Rebalance. It is one AllReduce of layers x experts int64.
func (r *LoadRecorder) Gather(ctx context.Context, c *coll.Comm) ([][]float64, error) {
	all := make([]int64, 0, len(r.layers)*r.experts)
	for i := range r.layers {
		all = append(all, r.layers[i].sum...)
	}
	if err := coll.AllReduce(ctx, c, nil, all, dtype.Sum); err != nil {
		return nil, err
	}
	out := make([][]float64, len(r.layers))
	for i := range out {
		out[i] = make([]float64, r.experts)
		for e := range out[i] {
			out[i][e] = float64(all[i*r.experts+e])
		}
	}
	return out, nil
}
