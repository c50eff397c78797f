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
// the low-latency mode. One in which any rank's do not makes every rank grow the
// low-latency buffers (here every rank maps every rank's memory) to the next power of
// two of the largest, within the same call, and run in the low-latency mode; where they
// may not grow (MaxBufferBytes negative, or another dispatch still in use), it runs in
// the normal mode on every rank. Either way each token comes back as itself (identity
// experts, weights summing to 1), and the pair serves step after step, mixed, one at a
// time and two in flight.
func TestAutoMode(t *testing.T) {
	const p, experts, k, hid, maxTokens = 3, 6, 2, 16, 4
	pl, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	// Tokens per rank per step: fits, rank 1 overflows (to 16, where it may grow), fits,
	// everyone overflows the first MaxTokens, fits.
	steps := [][]int{{2, 3, 1}, {2, 9, 1}, {0, 4, 4}, {8, 7, 5}, {1, 1, 1}}
	for _, grow := range []bool{false, true} {
		t.Run(fmt.Sprintf("grow=%v", grow), func(t *testing.T) {
			cfg := dispatch.Config{Hidden: hid, TopK: k, Placement: pl, MaxTokens: maxTokens}
			if !grow {
				cfg.MaxBufferBytes = -1
			}
			runRanks(t, p, coll.Config{Timeout: 20 * time.Second}, func(c *coll.Comm) error {
				return autoSteps(c, cfg, steps, grow)
			})
		})
	}
}

// autoSteps runs the steps of TestAutoMode on one rank.
func autoSteps(c *coll.Comm, cfg dispatch.Config, steps [][]int, grow bool) error {
	ctx := context.Background()
	hid, k, experts := cfg.Hidden, cfg.TopK, cfg.Placement.Experts
	d, cb, err := newPair(ctx, c, cfg, combine.Config{})
	if err != nil {
		return err
	}
	defer d.Close()
	defer cb.Close()
	if d.Config().Mode != dispatch.Auto {
		return fmt.Errorf("Config().Mode is %v, want auto", d.Config().Mode)
	}
	mt := cfg.MaxTokens // what the low-latency buffers hold now
	// want is the mode a step of these tokens runs in; busy: another dispatch is in use.
	want := func(ts []int, busy bool) dispatch.Mode {
		most := 0
		for _, n := range ts {
			most = max(most, n)
		}
		switch {
		case most <= mt:
			return dispatch.LowLatency
		case grow && !busy:
			for mt < most {
				mt *= 2
			}
			return dispatch.LowLatency
		}
		return dispatch.Normal
	}
	check := func(i int, ts []int, mode dispatch.Mode, out *dispatch.Output[float32], h dispatch.Handle, x []float32) error {
		if got := h.Schedule().Mode; got != mode {
			return fmt.Errorf("step %d %v: ran in the %v mode, want %v", i, ts, got, mode)
		}
		if got := d.Config().MaxTokens; got != mt {
			return fmt.Errorf("step %d %v: the buffers hold %d tokens, want %d", i, ts, got, mt)
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
		mode := want(ts, false)
		out, h, err := d.Dispatch(ctx, x, r)
		if err != nil {
			return fmt.Errorf("step %d: %w", i, err)
		}
		if err := check(i, ts, mode, out, h, x); err != nil {
			return err
		}
	}
	// Two in flight: one that fits, and one that does not, which may not grow the
	// buffers while the first is in use: the normal mode.
	big := []int{mt + 1, 1, mt + 2}
	ra, xa := autoRouting(c.Rank(), steps[0][c.Rank()], k, experts, hid)
	rb, xb := autoRouting(c.Rank(), big[c.Rank()], k, experts, hid)
	modeA := want(steps[0], false)
	pa, err := d.Start(ctx, xa, ra)
	if err != nil {
		return err
	}
	pb, err := d.Start(ctx, xb, rb)
	if err != nil {
		return err
	}
	modeB := want(big, true)
	oa, ha, err := pa.Wait(ctx)
	if err != nil {
		return err
	}
	ob, hb, err := pb.Wait(ctx)
	if err != nil {
		return err
	}
	if err := check(0, steps[0], modeA, oa, ha, xa); err != nil {
		return err
	}
	if err := check(1, big, modeB, ob, hb, xb); err != nil {
		return err
	}
	// The other order: the one that does not fit first, then one that fits, started
	// before the first is waited for. The first's header said no other dispatch was in
	// use, but by its Wait one is: it must not grow (the second's buffers are in use),
	// and runs in the normal mode; the second in the low-latency one.
	big = []int{mt + 3, 2, 1}
	rb, xb = autoRouting(c.Rank(), big[c.Rank()], k, experts, hid)
	pb, err = d.Start(ctx, xb, rb)
	if err != nil {
		return err
	}
	pa, err = d.Start(ctx, xa, ra)
	if err != nil {
		return err
	}
	modeB = want(big, true)
	if ob, hb, err = pb.Wait(ctx); err != nil {
		return err
	}
	if oa, ha, err = pa.Wait(ctx); err != nil {
		return err
	}
	if err := check(2, big, modeB, ob, hb, xb); err != nil {
		return err
	}
	return check(3, steps[0], modeA, oa, ha, xa)
}

// A step that would grow the buffers past MaxBufferBytes runs in the normal mode, and
// the buffers keep their size; one whose normal-mode buffers would pass it too fails on
// every rank with a BufferLimitError, in the same call, and the next step runs.
func TestAutoModeGrowLimit(t *testing.T) {
	const p, experts, k, hid = 2, 4, 2, 64
	pl, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	cfg := dispatch.Config{Hidden: hid, TopK: k, Placement: pl, MaxTokens: 4}
	grown := cfg
	grown.MaxTokens = 64
	dn, err := dispatch.LowLatencyBytes[float32](grown, true)
	require.NoError(t, err)
	cn, err := combine.LowLatencyBytes[float32](grown, combine.Config{}, true)
	require.NoError(t, err)
	for _, c := range []struct {
		limit  int
		failed bool
	}{{dn + cn - 1, false}, {16 << 10, true}} {
		cfg.MaxBufferBytes = c.limit
		runRanks(t, p, coll.Config{Timeout: 20 * time.Second}, func(cm *coll.Comm) error {
			ctx := context.Background()
			d, cb, err := newPair(ctx, cm, cfg, combine.Config{})
			if err != nil {
				return err
			}
			defer d.Close()
			defer cb.Close()
			r, x := autoRouting(cm.Rank(), 64, k, experts, hid)
			out, h, err := d.Dispatch(ctx, x, r)
			var le *dispatch.BufferLimitError
			switch {
			case c.failed && !errors.As(err, &le):
				return fmt.Errorf("limit %d: %v, want a BufferLimitError", c.limit, err)
			case c.failed && (le.Limit != c.limit || le.Need <= le.Limit || !errors.Is(err, dispatch.ErrBufferLimit)):
				return fmt.Errorf("limit %d: %+v", c.limit, le)
			case c.failed: // the next step, small, runs
				r, x = autoRouting(cm.Rank(), 2, k, experts, hid)
				if out, h, err = d.Dispatch(ctx, x, r); err != nil {
					return err
				}
			case err != nil:
				return err
			case h.Schedule().Mode != dispatch.Normal || d.Stats().Mode != dispatch.Normal:
				return fmt.Errorf("limit %d: ran in the %v mode, want normal", c.limit, h.Schedule().Mode)
			}
			if got := d.Config().MaxTokens; got != 4 {
				return fmt.Errorf("limit %d: the buffers hold %d tokens, want 4", c.limit, got)
			}
			return cb.Combine(ctx, h, identity(out, hid), make([]float32, len(x)))
		})
	}
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

// A rank whose tokens are in its staging already (Dispatcher.Buffer) takes part in a step
// that grows the buffers (another rank's tokens do not fit): the step runs again from
// those tokens, and every token comes back as itself.
func TestAutoModeGrowFromBuffer(t *testing.T) {
	const p, experts, k, hid = 2, 4, 2, 64
	pl, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	cfg := dispatch.Config{Hidden: hid, TopK: k, Placement: pl, MaxTokens: 4}
	runRanks(t, p, coll.Config{Timeout: 20 * time.Second}, func(c *coll.Comm) error {
		ctx := context.Background()
		d, cb, err := newPair(ctx, c, cfg, combine.Config{})
		if err != nil {
			return err
		}
		defer d.Close()
		defer cb.Close()
		n := []int{3, 40}[c.Rank()]
		r, x := autoRouting(c.Rank(), n, k, experts, hid)
		in := x
		if c.Rank() == 0 {
			b := d.Buffer()
			if b == nil {
				return fmt.Errorf("no staging to write the tokens into")
			}
			in = b[:copy(b, x)]
		}
		out, h, err := d.Dispatch(ctx, in, r)
		if err != nil {
			return err
		}
		if got := h.Schedule().Mode; got != dispatch.LowLatency || d.Config().MaxTokens != 64 {
			return fmt.Errorf("ran in the %v mode with buffers for %d tokens, want low-latency, 64", got, d.Config().MaxTokens)
		}
		res := make([]float32, len(x))
		if err := cb.Combine(ctx, h, identity(out, hid), res); err != nil {
			return err
		}
		for j := range x {
			if res[j] != x[j] {
				return fmt.Errorf("value %d came back %v, want %v", j, res[j], x[j])
			}
		}
		return nil
	})
}
