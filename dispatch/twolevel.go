package dispatch

import (
	"context"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/internal/ep"
	"github.com/moex-ai/moex/router"
)

// TwoLevel is the dispatch for ranks on several hosts, in two stages, as DeepEP's
// internode kernels do it: a token crosses the network at most once per remote host,
// whatever the number of its experts there, and the host's ranks pass it on among
// themselves (over shared memory).
//
//   - Up: among the ranks with the same local index on every host, a dispatch whose
//     "ranks" are the hosts: each token goes once to the relay of every host holding one
//     of its experts (its own host's relay is the rank itself).
//   - Down: among the ranks of the host, a dispatch of the rows each rank relays (its
//     own tokens included) to the ranks that hold their experts.
//
// The experts see the down stage's Output: Expert holds global expert ids; Origin is
// the rank (of the communicator given to NewTwoLevel) that relayed the row and Source
// the row's index among that rank's relayed rows. combine.TwoLevel sums a token's
// expert outputs within each host first, and each host's sum crosses back once. Both
// stages run in the normal or the low-latency mode (Auto runs them in the normal mode);
// hosts must hold equal numbers of ranks. A rank's bad input fails every rank in the
// same call, as a dispatch does.
type TwoLevel[T Act] struct {
	e        *ep.TwoLevel[T]
	up, down *Dispatcher[T]
}

// NewTwoLevel splits c by host (collectively: every rank calls it with the same cfg)
// and makes the two stages' dispatchers.
func NewTwoLevel[T Act](ctx context.Context, c *coll.Comm, cfg Config) (*TwoLevel[T], error) {
	e, err := ep.NewTwoLevel[T](ctx, c, cfg.engine())
	if err != nil {
		return nil, err
	}
	return &TwoLevel[T]{e: e, up: &Dispatcher[T]{e: e.Up()}, down: &Dispatcher[T]{e: e.Down()}}, nil
}

// Dispatch sends this rank's tokens x (Tokens x Hidden) to the experts r chose (global
// expert ids) and returns what this rank's experts receive. Every rank must call it.
func (d *TwoLevel[T]) Dispatch(ctx context.Context, x []T, r *router.Routing) (*Output[T], TwoLevelHandle, error) {
	o, h, err := d.e.Dispatch(ctx, x, r)
	if err != nil {
		return nil, TwoLevelHandle{}, err
	}
	return d.down.views.output(o), TwoLevelHandle{h: h}, nil
}

// UsePlacement makes the dispatches that follow use pl, another layer's placement, as
// Dispatcher.UsePlacement does: the hosts' placement and this host's follow from it, and
// both stages keep their buffers. Every rank must call it alike. pl must leave experts on
// this host's ranks, at least the down stage's top-k of them, and give no rank more than
// MaxLocalExperts (ErrConfig; the stages then keep the placement they had).
func (d *TwoLevel[T]) UsePlacement(pl *router.Placement) error { return d.e.UsePlacement(pl) }

// Up is the dispatcher of the stage across hosts; Down that of the stage within this
// host. They are the TwoLevel's: for their Stats, Bytes and Config, not to dispatch.
func (d *TwoLevel[T]) Up() *Dispatcher[T] { return d.up }

// Down is the dispatcher of the stage within this host (see Up).
func (d *TwoLevel[T]) Down() *Dispatcher[T] { return d.down }

// Bytes is the memory this rank holds for both stages' buffers (Dispatcher.Bytes of
// each, and the relayed rows). It is 0 after Close.
func (d *TwoLevel[T]) Bytes() int { return d.e.Bytes() }

// Close releases both stages and the host communicators.
func (d *TwoLevel[T]) Close() error { return d.e.Close() }

// engine is what package combine reaches through ep.Hooks.Engine.
func (d *TwoLevel[T]) engine() any { return d.e }

// TwoLevelHandle is an opaque token for one two-level dispatch, for combine.TwoLevel:
// the handles of its two stages.
type TwoLevelHandle struct {
	h ep.TwoLevelHandle
}

// Valid reports whether both stages' handles still describe their buffers.
func (h TwoLevelHandle) Valid() bool { return h.h.Up.Valid() && h.h.Down.Valid() }

// Tokens is the number of this rank's tokens: the combined output has this many rows.
func (h TwoLevelHandle) Tokens() int { return Handle{h: h.h.Up}.Tokens() }

// Rows is the number of entries the down stage delivered to this rank: the expert
// outputs passed to the combine have this many rows.
func (h TwoLevelHandle) Rows() int { return Handle{h: h.h.Down}.Rows() }

// hooks: what package combine needs of the engine behind these types, which it cannot
// see (ep.Hooks).
func init() {
	ep.Hooks.Handle = func(h Handle) ep.Handle { return h.h }
	ep.Hooks.TwoLevelHandle = func(h TwoLevelHandle) ep.TwoLevelHandle { return h.h }
	ep.Hooks.Engine = func(x any) any {
		if e, ok := x.(interface{ engine() any }); ok {
			return e.engine()
		}
		return nil
	}
	ep.Hooks.Schedule = func(s *ep.Schedule) Schedule { return scheduleOf(s) }
	ep.Hooks.Config = func(c ep.Config) Config { return configOf(c) }
	ep.Hooks.EngineConfig = func(c Config) ep.Config { return c.engine() }
}
