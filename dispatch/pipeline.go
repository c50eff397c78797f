package dispatch

import (
	"context"
	"fmt"

	"github.com/moex-ai/moex/router"
)

// Experts computes one chunk's expert outputs for Pipeline: one row of Hidden values per
// entry of o, in entry order. The returned slice is read by the combine's Start, before
// Pipeline calls Experts again, so one buffer can serve every chunk; or it is
// Combiner.Buffer(o.Handle()), where the combine then reads the outputs in place.
type Experts[T Out] func(o *Output[T]) ([]T, error)

// MaxChunks bounds Pipeline's chunks.
const MaxChunks = 1 << 16

// Pipeline runs one MoE layer over this rank's tokens x (routed by r) in chunks of
// consecutive tokens, so that chunk i+1's rows move while chunk i's experts compute, and
// chunk i's partial sums move back while chunk i+1's experts compute; out receives every
// token's combined row. d is the combiner's dispatcher. Every rank must call it with the
// same number of chunks (their sizes may differ); the dispatcher needs InFlight of at
// least 2. With one chunk it is Dispatch, Experts, Combine. An error of Experts on one
// rank fails every rank's Pipeline, after the chunks in flight have completed.
func (cb *Combiner[T]) Pipeline(ctx context.Context, d *Dispatcher[T], x []T, r *router.Routing, chunks int, experts Experts[T], out []T) error {
	cfg := d.Config()
	hid := cfg.Hidden
	switch {
	case d.core != cb.d:
		return fmt.Errorf("%w: the dispatcher is not this combiner's", ErrStale)
	case chunks < 1 || chunks > MaxChunks:
		return fmt.Errorf("%w: %d chunks (want 1 to %d)", ErrCombineInput, chunks, MaxChunks)
	case chunks > 1 && cfg.InFlight < 2:
		return fmt.Errorf("%w: a pipeline needs InFlight 2 or more, not %d", ErrCombineInput, cfg.InFlight)
	case r == nil || len(x) != r.T*hid || len(out) != len(x):
		return fmt.Errorf("%w: %d values, %d output values for a routing of the wrong shape or %d tokens of %d", ErrCombineInput, len(x), len(out), tokensOf(r), hid)
	}
	if cap(cb.chunkR) < chunks {
		cb.chunkR = make([]router.Routing, chunks)
	}
	rs := cb.chunkR[:chunks]
	bound := func(i int) int { return r.T * i / chunks }
	for i := range rs {
		a, b := bound(i), bound(i+1)
		rs[i] = router.Routing{T: b - a, K: r.K, E: r.E, Experts: r.Experts[a*r.K : b*r.K], Weights: r.Weights[a*r.K : b*r.K]}
	}
	chunk := func(s []T, i int) []T { return s[bound(i)*hid : bound(i+1)*hid] }
	// Every rank runs the whole schedule, so that every rank issues the same collectives
	// whatever fails where: after the first error (this rank's experts, or a combine that
	// reports another rank's) the remaining combines take part saying so, and the first
	// error is returned at the end. A dispatch that fails fails on every rank at once.
	var first error
	note := func(err error) {
		if err != nil && first == nil {
			first = err
		}
	}
	var inflight [2]*CombinePending[T] // combines of chunks i-1 and i
	wait := func(k int) {
		if k >= 0 && inflight[k%2] != nil {
			note(inflight[k%2].Wait(ctx))
			inflight[k%2] = nil
		}
	}
	finish := func() error {
		wait(0)
		wait(1)
		return first
	}
	pd, err := d.Start(ctx, chunk(x, 0), &rs[0])
	if err != nil {
		return err
	}
	for i := 0; i < chunks; i++ {
		o, h, err := pd.Wait(ctx)
		if err != nil {
			note(err)
			return finish()
		}
		if i+1 < chunks {
			wait(i - 1) // chunk i-1's combine releases the buffers chunk i+1 takes
			if pd, err = d.Start(ctx, chunk(x, i+1), &rs[i+1]); err != nil {
				note(err)
				return finish()
			}
		}
		var y []T
		if first == nil {
			y, err = experts(o)
			note(err)
		}
		if first != nil {
			y = nil // take part, saying this rank failed
		}
		p, err := cb.Start(ctx, h, y, chunk(out, i))
		if err != nil {
			note(err)
			return finish()
		}
		inflight[i%2] = p
	}
	wait(chunks - 2)
	wait(chunks - 1)
	return first
}
