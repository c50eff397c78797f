package dispatch_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// weightOf is expert e's reference weights.
func weightOf(e, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(e*31 + i*7 + 1)
	}
	return b
}

// rankWeights is one rank's expert storage under two placements.
type rankWeights struct {
	old, next map[int][]byte
}

func newRankWeights(old, next *router.Placement, me, n int) *rankWeights {
	w := &rankWeights{old: map[int][]byte{}, next: map[int][]byte{}}
	for _, e := range old.Local[me] {
		w.old[e] = weightOf(e, n)
	}
	for i, e := range next.Local[me] {
		if old.LocalIndex(me, e) >= 0 && i%2 == 0 {
			w.next[e] = w.old[e] // kept in place
		} else {
			w.next[e] = make([]byte, n)
		}
	}
	return w
}

func (w *rankWeights) weights(n int) dispatch.Weights {
	return dispatch.Weights{Bytes: n, Old: func(e int) []byte { return w.old[e] }, New: func(e int) []byte { return w.next[e] }}
}

func skewedPlacement(t *testing.T, experts, p, slots int) *router.Placement {
	load := make([]float64, experts)
	for e := range load {
		load[e] = float64(1 + e%3)
	}
	load[1], load[experts-2] = 60, 40
	pl, err := router.Rebalance(load, p, router.Balance{Slots: slots})
	require.NoError(t, err)
	return pl
}

// Every rank ends with the weights of every expert the new placement gives it, moved
// only where the rank did not hold the expert before.
func TestMigrate(t *testing.T) {
	const p, experts, n = 4, 12, 96
	old, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	next := skewedPlacement(t, experts, p, 16)
	ws := make([]*rankWeights, p)
	for r := range ws {
		ws[r] = newRankWeights(old, next, r, n)
	}
	moves := make([][]router.Move, p)
	errs := onRanks(t, p, func(c *coll.Comm) error {
		var err error
		moves[c.Rank()], err = dispatch.Migrate(context.Background(), c, old, next, ws[c.Rank()].weights(n))
		return err
	})
	for r := 0; r < p; r++ {
		require.NoError(t, errs[r])
		assert.Equal(t, moves[0], moves[r], "every rank plans the same moves")
		for _, e := range next.Local[r] {
			assert.Equal(t, weightOf(e, n), ws[r].next[e], "rank %d expert %d", r, e)
		}
	}
	require.NotEmpty(t, moves[0])
	for _, m := range moves[0] {
		assert.Less(t, old.LocalIndex(m.To, m.Expert), 0, "expert %d moved to rank %d, which held it", m.Expert, m.To)
		assert.GreaterOrEqual(t, old.LocalIndex(m.From, m.Expert), 0, "expert %d moved from rank %d, which did not hold it", m.Expert, m.From)
		assert.GreaterOrEqual(t, next.LocalIndex(m.To, m.Expert), 0)
	}
}

// A rank that swaps to another placement, or hands over a buffer of the wrong size,
// makes every rank fail in the same call, before anything moves; the communicator
// stays usable.
func TestMigrateRefusedOnEveryRank(t *testing.T) {
	const p, experts, n = 4, 12, 64
	old, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	next := skewedPlacement(t, experts, p, 16)
	other := skewedPlacement(t, experts, p, 20)
	for _, tc := range []struct {
		name  string
		check func(t *testing.T, err error)
		bad   func(r int, w *dispatch.Weights, next **router.Placement)
	}{
		{"another placement on rank 2", func(t *testing.T, err error) { assert.ErrorIs(t, err, dispatch.ErrMismatch) },
			func(r int, w *dispatch.Weights, nx **router.Placement) {
				if r == 2 {
					*nx = other
				}
			}},
		{"another weight size on rank 3", func(t *testing.T, err error) { assert.ErrorIs(t, err, dispatch.ErrMismatch) },
			func(r int, w *dispatch.Weights, _ **router.Placement) {
				if r == 3 { // consistent on the rank, not with the others
					o, nw := w.Old, w.New
					w.Bytes = n / 2
					w.Old = func(e int) []byte { return o(e)[:n/2] }
					w.New = func(e int) []byte { return nw(e)[:n/2] }
				}
			}},
		{"a short buffer on rank 1", func(t *testing.T, err error) {
			var pe *dispatch.PeerInputError
			require.ErrorAs(t, err, &pe)
			assert.Equal(t, 1, pe.Rank)
			assert.ErrorIs(t, pe, dispatch.ErrWeights)
		}, func(r int, w *dispatch.Weights, _ **router.Placement) {
			if r == 1 {
				full := w.New
				w.New = func(e int) []byte { return full(e)[:n-1] }
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ws := make([]*rankWeights, p)
			errs := onRanks(t, p, func(c *coll.Comm) error {
				me := c.Rank()
				nx, unused := next, next
				tc.bad(me, &dispatch.Weights{}, &nx) // the placement first, to make the weights for
				w0 := newRankWeights(old, nx, me, n)
				ws[me] = w0
				w := w0.weights(n)
				tc.bad(me, &w, &unused)
				_, err := dispatch.Migrate(context.Background(), c, old, nx, w)
				if err == nil {
					return errors.New("migrate succeeded")
				}
				// Still usable: a barrier after the refused call.
				require.NoError(t, coll.Barrier(context.Background(), c))
				return err
			})
			for r := 0; r < p; r++ {
				tc.check(t, errs[r])
				for e := range ws[r].next {
					if old.LocalIndex(r, e) < 0 {
						assert.Equal(t, make([]byte, n), ws[r].next[e], "rank %d expert %d written after a refusal", r, e)
					}
				}
			}
		})
	}
}

// After the swap, a rank still dispatching with the old placement makes the step fail
// on every rank with ErrMismatch: no rows reach experts whose weights are elsewhere.
func TestDispatchDuringSwapRefused(t *testing.T) {
	const p, experts, k, hid = 4, 12, 2, 16
	old, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	next := skewedPlacement(t, experts, p, 16)
	rs := routings(p, experts, k, []int{5, 5, 5, 5}, 4)
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		errs := onRanks(t, p, func(c *coll.Comm) error {
			pl := next
			if c.Rank() == 3 {
				pl = old
			}
			d, err := dispatch.New[float32](context.Background(), c, dispatch.Config{Hidden: hid, TopK: k, Placement: pl, Mode: mode, MaxTokens: 5})
			if err != nil {
				return err
			}
			defer d.Close()
			_, _, err = d.Dispatch(context.Background(), make([]float32, 5*hid), rs[c.Rank()])
			return err
		})
		for r := 0; r < p; r++ {
			assert.ErrorIs(t, errs[r], dispatch.ErrMismatch, "%v rank %d", mode, r)
		}
	}
}
