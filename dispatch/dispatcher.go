package dispatch

import (
	"context"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/internal/ep"
	"github.com/moex-ai/moex/router"
)

// Dispatcher moves tokens to experts over one communicator. Make one with New, before
// serving, and use it for every MoE layer of a model (UsePlacement switches layers);
// Dispatch (or Start and Wait) runs a step; Close frees its buffers. A Dispatcher is for
// one goroutine at a time.
type Dispatcher[T Act] struct {
	e     *ep.Dispatcher[T]
	views views[T]
}

// New returns a dispatcher for c. It is collective (every rank calls it with the same
// configuration) in the modes with buffers sized once (low-latency, Auto): it makes the
// exchange's buffers. A configuration that is not valid is ErrConfig.
func New[T Act](ctx context.Context, c *coll.Comm, cfg Config) (*Dispatcher[T], error) {
	e, err := ep.New[T](ctx, c, cfg.engine())
	if err != nil {
		return nil, err
	}
	return &Dispatcher[T]{e: e}, nil
}

// Dispatch sends this rank's tokens x (Tokens x Hidden values, row-major) to the
// experts r chose and returns what this rank's experts receive, with the handle of the
// step for the combine. Every rank must call it (a rank with no tokens passes empty x
// and routing). A rank whose input is bad gets ErrInput and every other rank a
// *PeerInputError naming it, in the same call; the communicator stays usable. It is
// Start followed by Wait.
func (d *Dispatcher[T]) Dispatch(ctx context.Context, x []T, r *router.Routing) (*Output[T], Handle, error) {
	p, err := d.Start(ctx, x, r)
	if err != nil {
		return nil, Handle{}, err
	}
	return p.Wait(ctx)
}

// Start is the send half of Dispatch: it checks the input, plans, packs and sends, and
// returns without waiting for the other ranks' rows. x and r must stay unchanged until
// Wait returns. It fails with ErrBusy where the buffers it would take are still in use.
func (d *Dispatcher[T]) Start(ctx context.Context, x []T, r *router.Routing) (*Pending[T], error) {
	p, err := d.e.Start(ctx, x, r)
	if err != nil {
		return nil, err
	}
	return d.views.pending(d, p), nil
}

// Abandon takes part in a dispatch that this rank cannot make (its router failed, for
// instance): the other ranks' Dispatch returns a *PeerInputError naming this rank, in
// the same call, instead of waiting; the communicator stays usable. It returns cause.
func (d *Dispatcher[T]) Abandon(ctx context.Context, cause error) error {
	return d.e.Abandon(ctx, cause)
}

// Redispatch moves new activations x with the routing of h (same tokens, same experts):
// the layout and plan of h are reused (in the normal mode, no counts exchange), and h
// and its Output stay valid. Every rank must call it. A handle that is not valid is
// ErrStale; one whose buffers are in use, ErrBusy.
func (d *Dispatcher[T]) Redispatch(ctx context.Context, h Handle, x []T) (*Output[T], error) {
	o, err := d.e.Redispatch(ctx, h.h, x)
	if err != nil {
		return nil, err
	}
	return d.views.output(o), nil
}

// UsePlacement makes the dispatches started after it use pl, another layer's placement
// for instance: one dispatcher and combiner, their buffers made once, serve every layer
// whose configuration differs only in its placement. Results already started keep the
// placement they were dispatched with (Handle.Placement), and so does Redispatch. Every
// rank must use the same placement for a dispatch, or it fails on every rank with
// ErrMismatch. pl must span the communicator's ranks, have at least TopK experts, and
// give no rank more than MaxLocalExperts of them (ErrConfig); it must not change while
// in use.
func (d *Dispatcher[T]) UsePlacement(pl *router.Placement) error { return d.e.UsePlacement(pl) }

// Config returns the dispatcher's configuration, defaults filled; its placement is the
// one the next dispatch uses.
func (d *Dispatcher[T]) Config() Config { return configOf(d.e.Config()) }

// Comm returns the communicator the dispatcher runs on.
func (d *Dispatcher[T]) Comm() *coll.Comm { return d.e.Comm() }

// Stats describes the last dispatch that completed.
func (d *Dispatcher[T]) Stats() Stats { return statsOf(d.e.Stats()) }

// Bytes is the memory this rank holds for the dispatcher's buffers (address space: a
// page takes memory when first written): in the low-latency mode most of it is fixed by
// New (LowLatencyBytes says it beforehand); elsewhere scratch buffers grow to the
// largest dispatch so far. The caller's memory does not count. It is 0 after Close.
func (d *Dispatcher[T]) Bytes() int { return d.e.Bytes() }

// RowsInPlace reports whether the low-latency dispatch writes each token once into its
// origin's staging, where the experts read it (PushRows unset, and every rank maps
// every rank's staging); in the Auto mode, for the last step.
func (d *Dispatcher[T]) RowsInPlace() bool { return d.e.RowsInPlace() }

// Buffer is where this rank may write the tokens of its next Start (Hidden values per
// token, at most MaxTokens tokens) so that the dispatch copies nothing of them: the
// staging the experts read in place. It is nil unless the rows are read in place
// (RowsInPlace) in the activation type (the wire type is the activation type) and the
// staging is free (the combine of the last dispatch into it has completed). A Start
// whose x is Buffer()[:T*Hidden] stages nothing; the memory is the other ranks' to read
// until the combine of that dispatch completes, and must not be written meanwhile.
func (d *Dispatcher[T]) Buffer() []T { return d.e.Buffer() }

// Close gives the dispatcher's buffers back to their pool. Outputs and Handles are not
// valid afterwards, and the Dispatcher must not be used again.
func (d *Dispatcher[T]) Close() error { return d.e.Close() }

// engine is what package combine reaches through ep.Hooks.Engine.
func (d *Dispatcher[T]) engine() any { return d.e }

// Pending is a dispatch whose rows are on their way: Wait completes it.
type Pending[T Act] struct {
	e *ep.Pending[T]
	d *Dispatcher[T]
}

// Wait is the receive half of Dispatch: it waits for the other ranks' rows and returns
// what this rank's experts receive, with the step's handle. Call it once.
func (p *Pending[T]) Wait(ctx context.Context) (*Output[T], Handle, error) {
	o, h, err := p.e.Wait(ctx)
	if err != nil {
		return nil, Handle{}, err
	}
	return p.d.views.output(o), Handle{h: h}, nil
}

// views holds the public Output and Pending of each of the engine's (a dispatcher has
// InFlight of each, twice in the Auto mode), made the first time it is seen, so that a
// step allocates nothing.
type views[T Act] struct {
	outs  []*Output[T]
	pends []*Pending[T]
}

// output is the public face of o, filled from it.
func (v *views[T]) output(o *ep.Output[T]) *Output[T] {
	for _, po := range v.outs {
		if po.e == o {
			po.fill()
			return po
		}
	}
	po := &Output[T]{e: o}
	v.outs = append(v.outs, po)
	po.fill()
	return po
}

// pending is the public face of p.
func (v *views[T]) pending(d *Dispatcher[T], p *ep.Pending[T]) *Pending[T] {
	for _, pp := range v.pends {
		if pp.e == p {
			return pp
		}
	}
	pp := &Pending[T]{e: p, d: d}
	v.pends = append(v.pends, pp)
	return pp
}
