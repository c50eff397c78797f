package combine_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
	"github.com/stretchr/testify/require"
)

// badHandles passes a bad handle to Combine on rank bad while the others pass the good
// one, for each kind of bad handle and each mode: a zero handle, one of another
// dispatcher, a stale one (its buffers reused by a later dispatch) and one combined
// already. Every rank must fail in that call (the bad rank with ErrStale, the others
// with a PeerInputError naming it, ErrStale within), without the communicator aborting,
// and the same dispatch must then combine right on every rank.
func badHandles(ctx context.Context, c *coll.Comm, bad int) error {
	p := c.Size()
	pl, err := router.NewPlacement(router.Contiguous, 2*p, p)
	if err != nil {
		return err
	}
	const hid, tokens = 8, 5
	r := &router.Routing{T: tokens, K: 2, E: 2 * p}
	for t := 0; t < tokens; t++ {
		r.Experts = append(r.Experts, int32((t+c.Rank())%(2*p)), int32((t+c.Rank()+p+1)%(2*p)))
		r.Weights = append(r.Weights, 0.25, 0.75)
	}
	x := make([]float32, tokens*hid)
	for i := range x {
		x[i] = float32(c.Rank()*100 + i)
	}
	for _, mode := range modes {
		cfg := dispatch.Config{Hidden: hid, TopK: 2, Placement: pl, Mode: mode, MaxTokens: 8}
		d, cb, err := newPair(ctx, c, cfg, combine.Config{})
		if err != nil {
			return err
		}
		other, _, err := newPair(ctx, c, cfg, combine.Config{})
		if err != nil {
			return err
		}
		step := func(kind string, handle func(good, prev dispatch.Handle) dispatch.Handle) error {
			var prev dispatch.Handle
			if kind == "stale" || kind == "combined" {
				// One dispatch combined, then another: the one before it is stale when
				// InFlight (2) dispatches have followed it, and combined anyway.
				for i := 0; i < 2; i++ {
					out, h, err := d.Dispatch(ctx, x, r)
					if err != nil {
						return err
					}
					if err := cb.Combine(ctx, h, identity(out, hid), make([]float32, len(x))); err != nil {
						return fmt.Errorf("%s: setting up: %w", kind, err)
					}
					if i == 0 || kind == "combined" {
						prev = h
					}
				}
			}
			out, h, err := d.Dispatch(ctx, x, r)
			if err != nil {
				return err
			}
			y, res := identity(out, hid), make([]float32, len(x))
			hh := h
			if c.Rank() == bad {
				hh = handle(h, prev)
			}
			err = cb.Combine(ctx, hh, y, res)
			var pie *dispatch.PeerInputError
			switch {
			case c.Rank() == bad && !errors.Is(err, dispatch.ErrStale):
				return fmt.Errorf("%v, %s handle: the bad rank got %v, want ErrStale", mode, kind, err)
			case c.Rank() != bad && (!errors.As(err, &pie) || pie.Rank != bad || !errors.Is(err, dispatch.ErrStale)):
				return fmt.Errorf("%v, %s handle: rank %d got %v, want a PeerInputError naming rank %d", mode, kind, c.Rank(), err, bad)
			case c.Err() != nil:
				return fmt.Errorf("%v, %s handle: the communicator aborted: %w", mode, kind, c.Err())
			}
			// The same dispatch combines right now, on every rank: each token comes back
			// as itself (identity experts, weights summing to 1).
			if err := cb.Combine(ctx, h, y, res); err != nil {
				return fmt.Errorf("%v, %s handle: the combine after it: %w", mode, kind, err)
			}
			for i := range x {
				if res[i] != x[i] {
					return fmt.Errorf("%v, %s handle: after it, value %d is %v, want %v", mode, kind, i, res[i], x[i])
				}
			}
			return nil
		}
		foreign := func() dispatch.Handle { // a dispatch of the other pair's dispatcher
			_, h, err := other.Dispatch(ctx, x, r)
			if err != nil {
				return dispatch.Handle{}
			}
			return h
		}
		// Every rank dispatches on the other pair (collective), before the step.
		fh := foreign()
		for _, c := range []struct {
			kind   string
			handle func(good, prev dispatch.Handle) dispatch.Handle
		}{
			{"zero", func(dispatch.Handle, dispatch.Handle) dispatch.Handle { return dispatch.Handle{} }},
			{"foreign", func(dispatch.Handle, dispatch.Handle) dispatch.Handle { return fh }},
			{"stale", func(_, prev dispatch.Handle) dispatch.Handle { return prev }},
			{"combined", func(_, prev dispatch.Handle) dispatch.Handle { return prev }},
		} {
			if err := step(c.kind, c.handle); err != nil {
				return err
			}
		}
		for _, x := range []interface{ Close() error }{cb, d, other} {
			if err := x.Close(); err != nil {
				return err
			}
		}
	}
	return nil
}

// Each kind of bad handle on one rank: every rank fails that combine, and the pair and
// the communicator serve on (in process; TestMoEProcesses runs it between processes).
func TestBadHandles(t *testing.T) {
	for _, bad := range []int{0, 2} {
		runRanks(t, 3, coll.Config{Timeout: 20 * time.Second}, func(c *coll.Comm) error {
			ctx := context.Background()
			return badHandles(ctx, c, bad)
		})
	}
}

// On the two-level path a rank whose dispatch or combine is bad fails every rank's call,
// not only those of its stage (which are of its host, or of its local index): the
// others take part in the next stage with a status that fails it. Then a good step
// works.
func TestTwoLevelBadInput(t *testing.T) {
	const experts, k, hid, tokens = 8, 2, 8, 5
	hosts := []int{0, 0, 1, 1}
	pl, err := router.NewPlacement(router.Contiguous, experts, len(hosts))
	require.NoError(t, err)
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		t.Run(mode.String(), func(t *testing.T) {
			cfg := step{Config: dispatch.Config{Hidden: hid, TopK: k, Placement: pl, Mode: mode, MaxTokens: tokens}}
			runRanks(t, len(hosts), coll.Config{Hosts: hosts, Timeout: 20 * time.Second}, func(c *coll.Comm) error {
				ctx := context.Background()
				d, cb, err := newTwoLevelPair(ctx, c, cfg)
				if err != nil {
					return err
				}
				defer d.Close()
				defer cb.Close()
				r, x := hostTokens(c.Rank(), tokens, k, experts, hid)
				const bad = 1
				// A routing that names no expert there is, on rank 1 only.
				rr := r
				if c.Rank() == bad {
					rr = &router.Routing{T: r.T, K: r.K, E: r.E, Experts: append([]int32(nil), r.Experts...), Weights: r.Weights}
					rr.Experts[0] = int32(experts + 3)
				}
				_, _, err = d.Dispatch(ctx, x, rr)
				if !errors.Is(err, dispatch.ErrInput) {
					return fmt.Errorf("rank %d: the dispatch with rank %d's bad routing returned %v, want ErrInput", c.Rank(), bad, err)
				}
				// A zero handle on rank 1 in the combine.
				out, h, err := d.Dispatch(ctx, x, r)
				if err != nil {
					return fmt.Errorf("rank %d: the dispatch after the bad one: %w", c.Rank(), err)
				}
				y, res := identity(out, hid), make([]float32, len(x))
				hh := h
				if c.Rank() == bad {
					hh = dispatch.TwoLevelHandle{}
				}
				if err := cb.Combine(ctx, hh, y, res); !errors.Is(err, dispatch.ErrStale) {
					return fmt.Errorf("rank %d: the combine with rank %d's zero handle returned %v, want ErrStale", c.Rank(), bad, err)
				}
				if c.Err() != nil {
					return fmt.Errorf("rank %d: the communicator aborted: %w", c.Rank(), c.Err())
				}
				// And a good step: every token's sum is the reference.
				out, h, err = d.Dispatch(ctx, x, r)
				if err != nil {
					return err
				}
				return cb.Combine(ctx, h, identity(out, hid), res)
			})
		})
	}
}
