package combine_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// autoRouting is rank me's routing of t tokens, weights 1/k, and its tokens.
func autoRouting(me, t, k, experts, hid int) (*router.Routing, []float32) {
	r := &router.Routing{T: t, K: k, E: experts}
	for i := 0; i < t; i++ {
		for j := 0; j < k; j++ {
			r.Experts = append(r.Experts, int32((i*5+j*3+me)%experts))
			r.Weights = append(r.Weights, 1/float32(k))
		}
	}
	x := make([]float32, t*hid)
	for i := range x {
		x[i] = float32((i*7+me)%11) - 5
	}
	return r, x
}

// The zero Mode is Auto: a step in which every rank's tokens fit in MaxTokens runs in
// the low-latency mode, one in which any rank's do not runs in the normal mode on every
// rank, within the same call; either way each token comes back as itself (identity
// experts, weights summing to 1), and the pair serves step after step, mixed, one at a
// time and two in flight.
func TestAutoMode(t *testing.T) {
	const p, experts, k, hid, maxTokens = 3, 6, 2, 16, 4
	pl, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	// Tokens per rank per step: fits, rank 1 overflows, fits, everyone overflows, fits.
	steps := [][]int{{2, 3, 1}, {2, 9, 1}, {0, 4, 4}, {8, 7, 5}, {1, 1, 1}}
	runRanks(t, p, coll.Config{Timeout: 20 * time.Second}, func(c *coll.Comm) error {
		ctx := context.Background()
		d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: hid, TopK: k, Placement: pl, MaxTokens: maxTokens}, combine.Config{})
		if err != nil {
			return err
		}
		defer d.Close()
		defer cb.Close()
		if d.Config().Mode != dispatch.Auto {
			return fmt.Errorf("Config().Mode is %v, want auto", d.Config().Mode)
		}
		check := func(i int, out *dispatch.Output[float32], h dispatch.Handle, x []float32) error {
			fits := true
			for _, n := range steps[i] {
				fits = fits && n <= maxTokens
			}
			want := dispatch.LowLatency
			if !fits {
				want = dispatch.Normal
			}
			if got := h.Schedule().Mode; got != want {
				return fmt.Errorf("step %d %v: ran in the %v mode, want %v", i, steps[i], got, want)
			}
			res := make([]float32, len(x))
			if err := cb.Combine(ctx, h, identity(out, hid), res); err != nil {
				return fmt.Errorf("step %d: %w", i, err)
			}
			for j := range x {
				if res[j] != x[j] {
					return fmt.Errorf("step %d: value %d came back %v, want %v", i, j, res[j], x[j])
				}
			}
			return nil
		}
		for i, ts := range steps {
			r, x := autoRouting(c.Rank(), ts[c.Rank()], k, experts, hid)
			out, h, err := d.Dispatch(ctx, x, r)
			if err != nil {
				return fmt.Errorf("step %d: %w", i, err)
			}
			if err := check(i, out, h, x); err != nil {
				return err
			}
		}
		// Two in flight: one that fits and one that does not.
		ra, xa := autoRouting(c.Rank(), steps[0][c.Rank()], k, experts, hid)
		rb, xb := autoRouting(c.Rank(), steps[1][c.Rank()], k, experts, hid)
		pa, err := d.Start(ctx, xa, ra)
		if err != nil {
			return err
		}
		pb, err := d.Start(ctx, xb, rb)
		if err != nil {
			return err
		}
		oa, ha, err := pa.Wait(ctx)
		if err != nil {
			return err
		}
		ob, hb, err := pb.Wait(ctx)
		if err != nil {
			return err
		}
		if err := check(0, oa, ha, xa); err != nil {
			return err
		}
		return check(1, ob, hb, xb)
	})
}

// A rank with bad input in an Auto step that does not fit fails every rank in that
// call (not as an overflow), and the next step works.
func TestAutoModeBadInput(t *testing.T) {
	const p, experts, k, hid = 3, 6, 2, 8
	pl, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	runRanks(t, p, coll.Config{Timeout: 20 * time.Second}, func(c *coll.Comm) error {
		ctx := context.Background()
		d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: hid, TopK: k, Placement: pl, MaxTokens: 2}, combine.Config{})
		if err != nil {
			return err
		}
		defer d.Close()
		defer cb.Close()
		r, x := autoRouting(c.Rank(), 5, k, experts, hid) // too many for MaxTokens everywhere
		if c.Rank() == 2 {
			x = x[:len(x)-1] // and rank 2's tokens are short
		}
		_, _, err = d.Dispatch(ctx, x, r)
		var pie *dispatch.PeerInputError
		switch {
		case c.Rank() == 2 && !errors.Is(err, dispatch.ErrInput):
			return fmt.Errorf("rank 2: %v, want ErrInput", err)
		case c.Rank() != 2 && (!errors.As(err, &pie) || pie.Rank != 2):
			return fmt.Errorf("rank %d: %v, want a PeerInputError naming rank 2", c.Rank(), err)
		}
		r, x = autoRouting(c.Rank(), 1, k, experts, hid)
		out, h, err := d.Dispatch(ctx, x, r)
		if err != nil {
			return err
		}
		return cb.Combine(ctx, h, identity(out, hid), make([]float32, len(x)))
	})
}

// Ranks that disagree on the mode (one Auto, the others low-latency) fail together.
func TestAutoModeMismatch(t *testing.T) {
	const p, experts, k, hid = 2, 4, 2, 8
	pl, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	errs := onRanks(t, p, coll.Config{Timeout: 20 * time.Second}, false, func(c *coll.Comm) error {
		ctx := context.Background()
		cfg := dispatch.Config{Hidden: hid, TopK: k, Placement: pl, MaxTokens: 4}
		if c.Rank() == 1 {
			cfg.Mode = dispatch.LowLatency
		}
		d, err := dispatch.New[float32](ctx, c, cfg)
		if err != nil {
			return err
		}
		defer d.Close()
		r, x := autoRouting(c.Rank(), 2, k, experts, hid)
		_, _, err = d.Dispatch(ctx, x, r)
		return err
	})
	for r, err := range errs {
		assert.ErrorIs(t, err, dispatch.ErrMismatch, "rank %d", r)
	}
}
