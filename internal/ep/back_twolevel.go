package ep

import (
	"context"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
)

// TwoLevelCombiner combines the dispatches of a TwoLevel: the down stage sums, on the
// rank that relayed each row, the weighted outputs of the host's experts for it (every
// rank of the host sends that rank one partial sum per row), and the up stage sends each
// such host sum back to the token's rank once, where the hosts' sums are added in
// ascending order of host. Bitwise reproducible for a fixed placement, as Combiner is;
// the sum is grouped by host, then by rank, so it agrees with the flat combine to
// rounding, not bit for bit.
type TwoLevelCombiner[T Out] struct {
	up, down *Combiner[T]
	hidden   int
	mid      obuf.Scratch // each relayed row's host sum
}

// NewTwoLevelCombiner returns the combiner of d's dispatches (collective in the low-latency
// mode, as New is).
func NewTwoLevelCombiner[T Out](ctx context.Context, d *TwoLevel[T]) (*TwoLevelCombiner[T], error) {
	down, err := NewCombiner[T](ctx, d.Down())
	if err != nil {
		return nil, err
	}
	up, err := NewCombiner[T](ctx, d.Up())
	if err != nil {
		down.Close()
		return nil, err
	}
	cb := &TwoLevelCombiner[T]{up: up, down: down, hidden: d.Up().Config().Hidden}
	cb.mid.Pool = d.Up().Config().Pool
	return cb, nil
}

// Combine takes the experts' outputs y (a row per entry of the dispatch's Output, as
// Combiner.Combine does) and writes this rank's tokens' weighted sums into out.
func (cb *TwoLevelCombiner[T]) Combine(ctx context.Context, h TwoLevelHandle, y, out []T) error {
	mid := dtype.FromBytes[T](cb.mid.Bytes(h.Up.IncomingRows() * cb.hidden * dtype.Of[T]().Size()))
	if err := cb.down.Combine(ctx, h.Down, y, mid); err != nil {
		return err
	}
	return cb.up.CombineRows(ctx, h.Up, mid, out)
}

// Close releases both stages' buffers.
// Bytes is the memory this rank holds for both stages' buffers (Combiner.Bytes of each,
// and the relayed rows' host sums). It is 0 after Close.
func (cb *TwoLevelCombiner[T]) Bytes() int {
	return cb.mid.Cap() + cb.up.Bytes() + cb.down.Bytes()
}

func (cb *TwoLevelCombiner[T]) Close() error {
	cb.mid.Release()
	cb.up.Close()
	return cb.down.Close()
}
