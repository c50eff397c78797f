//go:build ucx

package coll

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/transporttest"
	"github.com/moex-ai/moex/transport/ucx"
)

// ucxComms starts n UCX transports in this process (lanes as UCX_TLS says; windows even
// where UCX emulates RMA) and a communicator on each.
func ucxComms(t *testing.T, n int, cfg Config) ([]*Comm, []*ucx.Transport) {
	return ucxCommsB(t, n, cfg)
}

func ucxCommsB(t testing.TB, n int, cfg Config) ([]*Comm, []*ucx.Transport) {
	t.Helper()
	ts := transporttest.Start(t, n, func(ctx context.Context, r int, ex func(context.Context, []byte) ([][]byte, error)) (*ucx.Transport, error) {
		return ucx.New(ctx, ucx.Config{Rank: r, Size: n, Exchange: ex, CancelGrace: 2 * time.Second, EmulatedWindows: true})
	})
	cs := make([]*Comm, n)
	for r, x := range ts {
		c, err := New(x, cfg)
		require.NoError(t, err)
		cs[r] = c
	}
	t.Cleanup(func() {
		for _, c := range cs {
			c.Close()
		}
	})
	return cs, ts
}

// Over UCX the exchange puts every block into its receiver's registered memory and
// signals it: every byte and length arrives, and no tag receive is posted for a block
// (the transport's count of receives does not move while the exchanges run). With
// NoWindows the same exchanges go as tag messages, the fallback.
func TestExchangeOneSidedUCX(t *testing.T) {
	fields := []int{100, 0, 7 << 10}
	for _, windows := range []bool{true, false} {
		for _, p := range []int{2, 4, 8} {
			t.Run(fmt.Sprintf("windows=%v/P=%d", windows, p), func(t *testing.T) {
				cs, ts := ucxComms(t, p, Config{NoWindows: !windows})
				xs := make([]*Exchange, p)
				noErr(t, runOn(cs, func(c *Comm) error {
					x, err := c.NewExchange(context.Background(), ExchangeConfig{Fields: fields, Slots: 2})
					xs[c.Rank()] = x
					return err
				}))
				defer func() {
					for _, x := range xs {
						x.Close()
					}
				}()
				before := make([]transport.Counters, p)
				for r, x := range ts {
					before[r] = x.Counters()
					for q := 0; q < p; q++ {
						assert.Equal(t, windows && q != r, xs[r].OneSided(q), "rank %d to %d", r, q)
						assert.False(t, xs[r].Pushes(q), "nothing is stored into a UCX peer's memory")
					}
				}
				noErr(t, runOn(cs, func(c *Comm) error { return exchangeRounds(c, xs[c.Rank()], fields, 6) }))
				for r, x := range ts {
					c := x.Counters()
					if windows {
						assert.Zero(t, c.MessagesIn-before[r].MessagesIn, "rank %d posted tag receives", r)
						assert.NotZero(t, c.RMAOps-before[r].RMAOps, "rank %d put nothing", r)
					} else {
						assert.NotZero(t, c.MessagesIn-before[r].MessagesIn, "rank %d posted no tag receive", r)
						assert.Zero(t, c.RMAOps-before[r].RMAOps, "rank %d put", r)
					}
				}
			})
		}
	}
}

// A board needs memory it can store into: over UCX there is none (ErrNoBoard on every
// rank), and nothing is registered for it.
func TestBoardRefusedOverUCX(t *testing.T) {
	cs, ts := ucxComms(t, 2, Config{})
	base := ts[0].MemHandles()
	errs := runOn(cs, func(c *Comm) error {
		_, err := c.NewBoard(context.Background(), 1<<20)
		return err
	})
	for _, err := range errs {
		require.ErrorIs(t, err, ErrNoBoard)
	}
	assert.Equal(t, base, ts[0].MemHandles())
}
