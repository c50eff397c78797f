package combine_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/tcp"
	"github.com/moex-ai/moex/transport/transporttest"
)

const growSecret = "grow-secret"

// serveSteps serves steps [from, to) on c with placement pl and weights ws, every token
// checked; id is the rank's identity (its rank in the world).
func serveSteps(ctx context.Context, c *coll.Comm, pl *router.Placement, ws store, id, from, to int) error {
	srv, err := newServer(ctx, c, pl, ws, dispatch.Auto)
	if err != nil {
		return err
	}
	defer srv.Close()
	for n := from; n < to; n++ {
		if err := srv.step(ctx, id, n); err != nil {
			return fmt.Errorf("rank %d, step %d: %w", id, n, err)
		}
	}
	return nil
}

// A rank of a 4-rank job (tcp, shm) is killed mid-serving: the survivors shrink, recover
// the experts onto themselves and serve; a new process takes the dead rank over, every
// rank grows the communicator back, dispatch.Grow moves experts onto the newcomer (its
// weights from the others), and 100 further steps give the reference result for every
// token, on every rank.
func TestServingRegrowsLostRank(t *testing.T) {
	for _, kind := range []string{"tcp", "shm"} {
		t.Run(kind, func(t *testing.T) { servingRegrows(t, kind) })
	}
}

// killable is a transport a test can kill as a crash would.
type killable interface {
	transport.Transport
	Kill()
}

func servingRegrows(t *testing.T, kind string) {
	const p, victim, steps = 4, 2, 100
	cfg := coll.Config{Timeout: 20 * time.Second}
	var ts []killable
	var addr string
	var accept func(context.Context) (transport.Transport, []int, error)
	if kind == "tcp" {
		for _, tr := range transporttest.Start(t, p, func(ctx context.Context, r int, ex func(context.Context, []byte) ([][]byte, error)) (*tcp.Transport, error) {
			return tcp.New(ctx, tcp.Config{Rank: r, Size: p, Exchange: ex, Token: []byte(growSecret)})
		}) {
			ts = append(ts, tr)
		}
		rep, err := tcp.Listen(tcp.Config{Rank: victim, Size: p, Token: []byte(growSecret)})
		require.NoError(t, err)
		addr = rep.Addr()
		accept = func(ctx context.Context) (transport.Transport, []int, error) {
			tr, members, err := rep.Accept(ctx)
			if err != nil {
				return nil, nil, err
			}
			return tr, members, nil
		}
	} else {
		for _, tr := range transporttest.Start(t, p, func(ctx context.Context, r int, ex func(context.Context, []byte) ([][]byte, error)) (*shm.Transport, error) {
			return shm.New(ctx, shm.Config{Rank: r, Size: p, Exchange: ex})
		}) {
			ts = append(ts, tr)
		}
		j, err := shm.Join(shm.Config{Rank: victim, Size: p})
		require.NoError(t, err)
		addr = j.Addr()
		accept = func(ctx context.Context) (transport.Transport, []int, error) {
			tr, members, err := j.Accept(ctx)
			if err != nil {
				return nil, nil, err
			}
			return tr, members, nil
		}
	}
	pl := replicated(t, p)
	var wg sync.WaitGroup
	errs := make([]error, p+1)
	joinerMoved := make(chan int, 1)
	wg.Add(1)
	go func() { // the new process for rank 2
		defer wg.Done()
		errs[p] = func() error {
			ctx := context.Background()
			actx, cancel := context.WithTimeout(ctx, cfg.Timeout)
			defer cancel()
			tr, members, err := accept(actx)
			if err != nil {
				return err
			}
			defer tr.Close()
			c, err := coll.Rejoin(ctx, tr, addr, members, cfg)
			if err != nil {
				return err
			}
			defer c.Close()
			next := store{}
			gpl, moves, err := dispatch.Grow(ctx, c, nil, nil, router.Balance{}, store{}.weights(next))
			if err != nil {
				return err
			}
			got := 0
			for _, m := range moves {
				if m.To == c.Rank() {
					got++
				}
			}
			joinerMoved <- got
			return serveSteps(ctx, c, gpl, next, victim, 4, 4+steps)
		}()
	}()
	for r := 0; r < p; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = func() error {
				ctx := context.Background()
				c, err := coll.New(ts[r], cfg)
				if err != nil {
					return err
				}
				defer c.Close()
				sub, err := func() (*coll.Comm, error) {
					s, _, err := serveThroughDeath(ctx, c, pl, dispatch.Auto, victim, 2, 4, func() { ts[r].Kill() })
					return s, err
				}()
				if r == victim || err != nil {
					return err
				}
				defer sub.Close()
				// serveThroughDeath recovered onto the survivors; recover again to learn
				// the placement (the same call, the same result) and the weights.
				ws, next := newStore(pl, r), store{}
				npl, _, err := dispatch.Recover(ctx, sub, pl, nil, router.Balance{}, ws.weights(next))
				if err != nil {
					return err
				}
				g, err := sub.Grow(ctx, []coll.Joiner{{Rank: victim, Addr: addr, Host: transport.HostID()}})
				if err != nil {
					return err
				}
				defer g.Close()
				grown := store{}
				gpl, _, err := dispatch.Grow(ctx, g, npl, nil, router.Balance{}, next.weights(grown))
				if err != nil {
					return err
				}
				if gpl.Ranks != p || !slices.Equal(g.ParentRanks(), []int{0, 1, -1, 2}) {
					return fmt.Errorf("grown onto %d ranks, parents %v", gpl.Ranks, g.ParentRanks())
				}
				return serveSteps(ctx, g, gpl, grown, r, 4, 4+steps)
			}()
		}()
	}
	wg.Wait()
	for r, err := range errs {
		require.NoError(t, err, "rank %d (%d: the new process)", r, p)
	}
	require.Positive(t, <-joinerMoved, "experts moved onto the new process")
}
