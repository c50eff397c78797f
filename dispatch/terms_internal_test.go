package dispatch

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/router"
)

// Whatever a block of unsummed outputs says of its rows' terms (memory written wrongly,
// a peer gone wrong), summing at the origin returns ErrMismatch or a sum, and never
// reads past the block: the fuzzer writes over the counts of the block this rank keeps
// for its own tokens, in both point-to-point modes.
func FuzzSumTerms(f *testing.F) {
	f.Add([]byte{1, 0, 0, 0}, uint8(0), false)
	f.Add([]byte{0xff, 0xff, 0xff, 0x7f}, uint8(4), true)
	f.Add([]byte{0, 0, 0, 0, 3, 0, 0, 0}, uint8(0), true)
	f.Add([]byte{0xff, 0xff, 0xff, 0xff}, uint8(8), false)
	run := termsFixture(f)
	f.Fuzz(func(t *testing.T, patch []byte, at uint8, ll bool) {
		if err := run(patch, at, ll); err != nil {
			require.ErrorIs(t, err, ErrMismatch)
		}
	})
}

// A count that moves a term from one token to the next, or that claims more terms than
// the block holds, is ErrMismatch; the counts as sent sum.
func TestSumTermsMismatch(t *testing.T) {
	run := termsFixture(t)
	for _, ll := range []bool{false, true} {
		require.NoError(t, run(nil, 0, ll))
		require.ErrorIs(t, run([]byte{1, 0, 0, 0, 2, 0, 0, 0}, 0, ll), ErrMismatch, "low-latency %v: a term moved to token 1", ll)
		require.ErrorIs(t, run([]byte{0xff, 0xff, 0xff, 0x7f}, 8, ll), ErrMismatch, "low-latency %v: past the block", ll)
		require.ErrorIs(t, run([]byte{0xff, 0xff, 0xff, 0xff}, 0, ll), ErrMismatch, "low-latency %v: a negative count", ll)
		require.NoError(t, run(nil, 0, ll), "low-latency %v: after the failures", ll)
	}
}

// termsFixture makes a one-rank dispatcher and combiner of each point-to-point mode
// with SumAtOrigin, and returns a step that writes patch over the own block's counts
// at byte at (modulo their length) between the combine's Start and its Wait.
func termsFixture(tb testing.TB) func(patch []byte, at uint8, ll bool) error {
	const hid, tokens = 4, 3
	cs, err := coll.Local(1, coll.Config{Timeout: 10 * time.Second})
	require.NoError(tb, err)
	tb.Cleanup(func() { cs[0].Close() })
	pl, err := router.NewPlacement(router.Contiguous, 4, 1)
	require.NoError(tb, err)
	ctx := context.Background()
	type pair struct {
		d  *Dispatcher[float32]
		cb *Combiner[float32]
	}
	pairs := map[bool]pair{}
	for _, ll := range []bool{false, true} {
		mode := Normal
		if ll {
			mode = LowLatency
		}
		d, err := New[float32](ctx, cs[0], Config{Hidden: hid, TopK: 2, Placement: pl, Mode: mode, MaxTokens: tokens})
		require.NoError(tb, err)
		cb, err := NewCombiner[float32](ctx, d, CombineConfig{SumAtOrigin: true})
		require.NoError(tb, err)
		tb.Cleanup(func() { cb.Close(); d.Close() })
		pairs[ll] = pair{d, cb}
	}
	// Token 0 chooses experts 0 and 3, token 1 expert 2 alone, token 2 experts 1 and 2.
	r := &router.Routing{T: tokens, K: 2, E: 4, Experts: []int32{0, 3, 2, -1, 1, 2}, Weights: []float32{0.5, 0.25, 1, 0, 0.75, 0.125}}
	x := make([]float32, tokens*hid)
	for i := range x {
		x[i] = float32(i + 1)
	}
	return func(patch []byte, at uint8, ll bool) error {
		pr := pairs[ll]
		out, h, err := pr.d.Dispatch(ctx, x, r)
		if err != nil {
			return err
		}
		p, err := pr.cb.Start(ctx, h, make([]float32, out.Rows()*hid), make([]float32, tokens*hid))
		if err != nil {
			return err
		}
		counts := p.cs.parts[0][:4*tokens]
		copy(counts[int(at)%len(counts):], patch)
		return p.Wait(ctx)
	}
}
