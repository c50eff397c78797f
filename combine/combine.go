// Package combine is the second stage of MoE expert parallelism.
package combine

import (
	"context"

	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/internal/ep"
)

type (
	Act             = ep.Out
	Source          = ep.Source
	Combiner[T Act] = ep.Combiner[T]
	Pending[T Act]  = ep.CombinePending[T]
	Experts[T Act]  = ep.Experts[T]
	TwoLevel[T Act] = ep.TwoLevelCombiner[T]
)

var ErrInput = ep.ErrCombineInput

func New[T Act](ctx context.Context, d Source) (*Combiner[T], error) {
	return ep.NewCombiner[T](ctx, d)
}

func LowLatencyBytes[T Act](cfg dispatch.Config, shared bool) (int, error) {
	return ep.CombineLowLatencyBytes[T](cfg, shared)
}

func NewTwoLevel[T Act](ctx context.Context, d *dispatch.TwoLevel[T]) (*TwoLevel[T], error) {
	return ep.NewTwoLevelCombiner[T](ctx, d)
}
