package models

import (
	"context"

	"gorgonia.org/tensor"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// EP runs a Layer expert-parallel over a communicator: each rank routes its own tokens,
// dispatches them, runs the experts it holds on what it receives, combines, and adds the
// shared experts for its own tokens.
type EP struct {
	L  *Layer
	D  *dispatch.Dispatcher
	C  *combine.Combiner
	pl *router.Placement
	y  []float32
	sc []float32
}

// NewEP prepares the expert-parallel form of l on c. To run the experts (Experts,
// Forward) l must materialise the experts that pl places on this rank.
func NewEP(c *coll.Comm, l *Layer, pl *router.Placement, wire dtype.Type) (*EP, error) {
	d, err := dispatch.New(c, dispatch.Config{Hidden: l.Cfg.Hidden, TopK: l.Cfg.TopK, WireDType: wire, Placement: pl})
	if err != nil {
		return nil, err
	}
	return &EP{L: l, D: d, C: combine.New(d), pl: pl}, nil
}

// Close gives the dispatcher's and combiner's buffers back to their pool.
func (ep *EP) Close() {
	ep.C.Close()
	ep.D.Close()
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

// Experts runs every local expert on its block of o, into ep's output buffer.
func (ep *EP) Experts(o *dispatch.Output) error {
	hid, f := ep.L.Cfg.Hidden, ep.L.Cfg.ExpertFFN
	if cap(ep.y) < len(o.X) {
		ep.y = make([]float32, len(o.X))
	}
	ep.y = ep.y[:len(o.X)]
	me := ep.D.Comm().Rank()
	for li, e := range ep.pl.Local[me] {
		a, n := o.Offsets[li], o.Counts[li]
		if need := 2 * n * f; cap(ep.sc) < need {
			ep.sc = make([]float32, need)
		}
		if err := ep.L.Expert(e, o.X[a*hid:(a+n)*hid], n, ep.y[a*hid:(a+n)*hid], ep.sc); err != nil {
			return err
		}
		clear(ep.y[(a+n)*hid : o.Offsets[li+1]*hid]) // padding rows
	}
	return nil
}

// Output returns the expert outputs of the last Experts call.
func (ep *EP) Output() []float32 { return ep.y }

// Identity makes every expert the identity (outputs = inputs), for measuring the
// communication alone.
func (ep *EP) Identity(o *dispatch.Output) {
	if cap(ep.y) < len(o.X) {
		ep.y = make([]float32, len(o.X))
	}
	ep.y = ep.y[:len(o.X)]
	copy(ep.y, o.X)
}
