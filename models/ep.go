package models

import (
	"context"
	"errors"

	"gorgonia.org/tensor"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// EP runs a Layer expert-parallel over a communicator, with activations of type T
// (float32 or bfloat16): each rank routes its own tokens, dispatches them, runs the
// experts it holds on what it receives (the reference experts compute in float32: bf16
// rows are widened for them and their outputs rounded back), combines, and adds the
// shared experts for its own tokens.
type EP[T combine.Act] struct {
	L   *Layer                  // the layer: its router and expert weights
	D   *dispatch.Dispatcher[T] // the dispatcher of its steps
	C   *combine.Combiner[T]    // and their combiner
	pl  *router.Placement
	y   []T // the last Experts' or Identity's outputs: the combine's Buffer, or own
	own []T
	sc  []float32
	xs  []T       // an expert's rows gathered (low-latency mode)
	xf  []float32 // an expert's rows in float32 (bf16 activations)
	yf  []float32
}

// NewEP prepares the expert-parallel form of l on c, with the dispatch configured by
// cfg (its Hidden and TopK come from the layer; Placement is required) and the combine
// by ccfg. To run the
// experts (Experts, Forward) l must materialise the experts that the placement puts on
// this rank. In the low-latency mode it is collective.
func NewEP[T combine.Act](ctx context.Context, c *coll.Comm, l *Layer, cfg dispatch.Config, ccfg combine.Config) (*EP[T], error) {
	cfg.Hidden, cfg.TopK = l.Cfg.Hidden, l.Cfg.TopK
	d, err := dispatch.New[T](ctx, c, cfg)
	if err != nil {
		return nil, err
	}
	cb, err := combine.New[T](ctx, d, ccfg)
	if err != nil {
		d.Close()
		return nil, err
	}
	return &EP[T]{L: l, D: d, C: cb, pl: cfg.Placement}, nil
}

// Close gives the dispatcher's and combiner's buffers back to their pool.
func (ep *EP[T]) Close() error {
	return errors.Join(ep.C.Close(), ep.D.Close())
}

// Forward runs the layer on this rank's tokens (a (tokens, hidden) float32 tensor,
// carried as T on the way). Every rank must call it.
func (ep *EP[T]) Forward(ctx context.Context, x *tensor.Dense) (*tensor.Dense, error) {
	in, rows, err := ep.L.input(x)
	if err != nil {
		return nil, err
	}
	r, err := ep.L.Route(in, rows)
	if err != nil {
		// The other ranks are about to dispatch: tell them, rather than leave them waiting.
		return nil, ep.D.Abandon(ctx, err)
	}
	hid := ep.L.Cfg.Hidden
	inT, outT := make([]T, rows*hid), make([]T, rows*hid)
	dtype.Convert(inT, in)
	if err := ep.ForwardRouted(ctx, inT, r, outT); err != nil {
		return nil, err
	}
	out := make([]float32, rows*hid)
	dtype.Convert(out, outT)
	ep.L.SharedForward(in, rows, out)
	return tensor.New(tensor.WithShape(rows, hid), tensor.WithBacking(out)), nil
}

// ForwardRouted dispatches in with routing r, runs the local experts, and combines into
// out (rows x hidden), without the shared experts.
func (ep *EP[T]) ForwardRouted(ctx context.Context, in []T, r *router.Routing, out []T) error {
	o, h, err := ep.D.Dispatch(ctx, in, r)
	if err != nil {
		return err
	}
	if err := ep.Experts(o); err != nil {
		return err
	}
	return ep.C.Combine(ctx, h, ep.y, out)
}

// outputs points ep.y at the memory for o's expert outputs: where the combine reads
// them in place (combine.Combiner.Buffer), if it does, else ep's own.
func (ep *EP[T]) outputs(o *dispatch.Output[T]) {
	n := o.Rows() * ep.L.Cfg.Hidden
	if b := ep.C.Buffer(o.Handle()); len(b) == n {
		ep.y = b
		return
	}
	ep.own = grow(ep.own, n)
	ep.y = ep.own
}

// Experts runs every local expert on its rows of o, into ep's output buffer (one row
// per entry of o): where the combine reads them in place, when it does.
func (ep *EP[T]) Experts(o *dispatch.Output[T]) error {
	hid, f := ep.L.Cfg.Hidden, ep.L.Cfg.ExpertFFN
	ep.outputs(o)
	me := ep.D.Comm().Rank()
	quantized := ep.D.Config().Quantized
	for li, e := range ep.pl.Local[me] {
		a, n := o.Offsets[li], o.Counts[li]
		if need := 2 * n * f; cap(ep.sc) < need {
			ep.sc = make([]float32, need)
		}
		x := o.Block(li) // in place where the rows are expert-major, else gathered
		if quantized {   // the rows as the wire carries them: dequantised here
			ep.xs = grow(ep.xs, n*hid)
			x = ep.xs
			for k := 0; k < n; k++ {
				o.Dequantize(a+k, x[k*hid:(k+1)*hid])
			}
		}
		y := ep.y[a*hid : (a+n)*hid]
		if xf, ok := any(x).([]float32); ok {
			if err := ep.L.Expert(e, xf, n, any(y).([]float32), ep.sc); err != nil {
				return err
			}
		} else {
			ep.xf, ep.yf = grow(ep.xf, n*hid), grow(ep.yf, n*hid)
			dtype.Convert(ep.xf, x)
			if err := ep.L.Expert(e, ep.xf, n, ep.yf, ep.sc); err != nil {
				return err
			}
			dtype.Convert(y, ep.yf)
		}
		clear(ep.y[(a+n)*hid : o.Offsets[li+1]*hid]) // padding rows
	}
	return nil
}

func grow[E any](s []E, n int) []E {
	if cap(s) < n {
		return make([]E, n)
	}
	return s[:n]
}

// Output returns the expert outputs of the last Experts call.
func (ep *EP[T]) Output() []T { return ep.y }

// Identity makes every expert the identity (outputs = inputs), for measuring the
// communication alone.
func (ep *EP[T]) Identity(o *dispatch.Output[T]) {
	hid := ep.L.Cfg.Hidden
	ep.outputs(o)
	quantized := ep.D.Config().Quantized
	for j := 0; j < o.Rows(); j++ {
		switch r := o.Entry(j); {
		case quantized: // the rows as the wire carries them: their values
			o.Dequantize(j, ep.y[j*hid:(j+1)*hid])
		case r != nil:
			copy(ep.y[j*hid:(j+1)*hid], r)
		default:
			clear(ep.y[j*hid : (j+1)*hid])
		}
	}
}
