package models

import (
	"context"
	"errors"

	"gorgonia.org/tensor"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// EP runs a Layer expert-parallel over a communicator: each rank routes its own tokens,
// dispatches them, runs the experts it holds on what it receives, combines, and adds the
// shared experts for its own tokens.
type EP struct {
	L  *Layer
	D  *dispatch.Dispatcher[float32]
	C  *combine.Combiner[float32]
	pl *router.Placement
	y  []float32
	sc []float32
	xs []float32 // an expert's rows gathered (low-latency mode)
}

// NewEP prepares the expert-parallel form of l on c, with the dispatch configured by
// cfg (its Hidden and TopK come from the layer; Placement is required). To run the
// experts (Experts, Forward) l must materialise the experts that the placement puts on
// this rank. In the low-latency mode it is collective.
func NewEP(ctx context.Context, c *coll.Comm, l *Layer, cfg dispatch.Config) (*EP, error) {
	cfg.Hidden, cfg.TopK = l.Cfg.Hidden, l.Cfg.TopK
	d, err := dispatch.New[float32](ctx, c, cfg)
	if err != nil {
		return nil, err
	}
	cb, err := combine.New[float32](ctx, d)
	if err != nil {
		d.Close()
		return nil, err
	}
	return &EP{L: l, D: d, C: cb, pl: cfg.Placement}, nil
}

// Close gives the dispatcher's and combiner's buffers back to their pool.
func (ep *EP) Close() error {
	return errors.Join(ep.C.Close(), ep.D.Close())
}

// Forward runs the layer on this rank's tokens (a (tokens, hidden) float32 tensor).
// Every rank must call it.
func (ep *EP) Forward(ctx context.Context, x *tensor.Dense) (*tensor.Dense, error) {
	in, rows, err := ep.L.input(x)
	if err != nil {
		return nil, err
	}
	r, err := ep.L.Route(in, rows)
	if err != nil {
		// The other ranks are about to dispatch: tell them, rather than leave them waiting.
		return nil, ep.D.Abandon(ctx, err)
	}
	out := make([]float32, rows*ep.L.Cfg.Hidden)
	if err := ep.ForwardRouted(ctx, in, r, out); err != nil {
		return nil, err
	}
	ep.L.SharedForward(in, rows, out)
	return tensor.New(tensor.WithShape(rows, ep.L.Cfg.Hidden), tensor.WithBacking(out)), nil
}

// ForwardRouted dispatches in with routing r, runs the local experts, and combines into
// out (rows x hidden), without the shared experts.
func (ep *EP) ForwardRouted(ctx context.Context, in []float32, r *router.Routing, out []float32) error {
	o, h, err := ep.D.Dispatch(ctx, in, r)
	if err != nil {
		return err
	}
	if err := ep.Experts(o); err != nil {
		return err
	}
	return ep.C.Combine(ctx, h, ep.y, out)
}

// Experts runs every local expert on its rows of o, into ep's output buffer (one row
// per entry of o).
func (ep *EP) Experts(o *dispatch.Output[float32]) error {
	hid, f := ep.L.Cfg.Hidden, ep.L.Cfg.ExpertFFN
	ep.y = grow(ep.y, o.Rows()*hid)
	me := ep.D.Comm().Rank()
	for li, e := range ep.pl.Local[me] {
		a, n := o.Offsets[li], o.Counts[li]
		if need := 2 * n * f; cap(ep.sc) < need {
			ep.sc = make([]float32, need)
		}
		x := o.X[a*hid : (a+n)*hid] // expert-major rows (normal mode)
		if n > 0 && o.Row[a] != int32(a) {
			ep.xs = grow(ep.xs, n*hid)
			x = o.Gather(li, ep.xs)
		}
		if err := ep.L.Expert(e, x, n, ep.y[a*hid:(a+n)*hid], ep.sc); err != nil {
			return err
		}
		clear(ep.y[(a+n)*hid : o.Offsets[li+1]*hid]) // padding rows
	}
	return nil
}

func grow(s []float32, n int) []float32 {
	if cap(s) < n {
		return make([]float32, n)
	}
	return s[:n]
}

// Output returns the expert outputs of the last Experts call.
func (ep *EP) Output() []float32 { return ep.y }

// Identity makes every expert the identity (outputs = inputs), for measuring the
// communication alone.
func (ep *EP) Identity(o *dispatch.Output[float32]) {
	hid := ep.L.Cfg.Hidden
	ep.y = grow(ep.y, o.Rows()*hid)
	for j := 0; j < o.Rows(); j++ {
		if r := o.Entry(j); r != nil {
			copy(ep.y[j*hid:(j+1)*hid], r)
		} else {
			clear(ep.y[j*hid : (j+1)*hid])
		}
	}
}
