package combine

import (
	"context"
	"fmt"

	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/internal/ep"
)

// TwoLevel combines the dispatches of a dispatch.TwoLevel: the stage within the host
// sums, on the rank that relayed each row, the weighted outputs of the host's experts
// for it, and the stage across hosts sends each host's sum back to the token's rank
// once, where the hosts' sums are added in ascending order of host. Bitwise
// reproducible for a fixed placement, as Combiner is; grouped by host, then by rank, so
// it agrees with the flat combine to rounding, not bit for bit.
type TwoLevel[T Act] struct {
	e        *ep.TwoLevelCombiner[T]
	up, down *Combiner[T]
}

// NewTwoLevel returns the combiner of d's dispatches (collective in the low-latency
// mode, as New is). An fp8 or int8 PartialDType applies to the host sums that cross
// hosts; within a host the partial sums travel in the outputs' type. SumAtOrigin is
// refused (dispatch.ErrConfig).
func NewTwoLevel[T Act](ctx context.Context, d *dispatch.TwoLevel[T], cfg Config) (*TwoLevel[T], error) {
	de, ok := hooks.engine(d).(*ep.TwoLevel[T])
	if !ok {
		return nil, fmt.Errorf("%w: no two-level dispatcher", dispatch.ErrConfig)
	}
	e, err := ep.NewTwoLevelCombiner[T](ctx, de, ep.CombineConfig(cfg))
	if err != nil {
		return nil, err
	}
	return &TwoLevel[T]{e: e, up: &Combiner[T]{e: e.Up(), src: d.Up()}, down: &Combiner[T]{e: e.Down(), src: d.Down()}}, nil
}

// Combine takes the experts' outputs y (a row per entry of the dispatch's Output, as
// Combiner.Combine does) and writes this rank's tokens' weighted sums into out. Every
// rank must call it.
func (cb *TwoLevel[T]) Combine(ctx context.Context, h dispatch.TwoLevelHandle, y, out []T) error {
	return cb.e.Combine(ctx, hooks.twoLevelHandle(h), y, out)
}

// Up is the combiner of the stage across hosts; Down that of the stage within this
// host. They are the TwoLevel's: for their Stats, Bytes and Config, not to combine.
func (cb *TwoLevel[T]) Up() *Combiner[T] { return cb.up }

// Down is the combiner of the stage within this host (see Up).
func (cb *TwoLevel[T]) Down() *Combiner[T] { return cb.down }

// Bytes is the memory this rank holds for both stages' buffers (Combiner.Bytes of each,
// and the relayed rows' host sums). It is 0 after Close.
func (cb *TwoLevel[T]) Bytes() int { return cb.e.Bytes() }

// Close releases both stages' buffers.
func (cb *TwoLevel[T]) Close() error { return cb.e.Close() }
