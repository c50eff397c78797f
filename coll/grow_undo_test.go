package coll

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/tcp"
)

// readmitting is a transport that takes joiners (tcp, shm).
type readmitting interface {
	killable
	transport.Readmitter
}

// refusing is a transport whose Readmit fails while refuse is set, as a live rank that
// cannot reach a joiner (a firewall, a route down) would.
type refusing struct {
	readmitting
	refuse *atomic.Bool
	after  func(peer int) // once connected, if set
}

var errUnreachable = errors.New("the joiner is unreachable from this rank")

func (r *refusing) Readmit(ctx context.Context, peer int, addr string, members []int) error {
	if r.refuse.Load() {
		return &transport.PeerError{Rank: peer, Op: "connect", Err: errUnreachable}
	}
	err := r.readmitting.Readmit(ctx, peer, addr, members)
	if err == nil && r.after != nil {
		r.after(peer)
	}
	return err
}

// A Grow that one live rank cannot complete (it cannot connect to the joiner) fails on
// every live rank with a JoinError naming that rank, and undoes itself: the live ranks
// that did connect to the joiner are no longer connected (their operations with it fail
// with ErrEvicted), the communicator serves on, and a later Grow with a new process for
// the rank admits it. Over tcp and shm.
func TestGrowUndoneOnFailure(t *testing.T) {
	for _, kind := range []string{"tcp", "shm"} {
		t.Run(kind, func(t *testing.T) { growUndone(t, kind) })
	}
}

func growUndone(t *testing.T, kind string) {
	const n, victim, unreachable = 4, 3, 1
	fds, segs := openFDs(t), shm.SegmentsOf(os.Getpid())
	t.Cleanup(func() { // the last cleanup: every transport and communicator is closed
		require.Equal(t, fds, openFDs(t), "file descriptors open before the test and after it")
		require.Equal(t, segs, shm.SegmentsOf(os.Getpid()), "segments in /dev/shm before the test and after it")
	})
	cfg := Config{Timeout: 3 * time.Second}
	var refuse atomic.Bool
	refuse.Store(true)
	cs, ts := commsOver(t, n, cfg, func(ctx context.Context, r int, ex func(context.Context, []byte) ([][]byte, error)) (*refusing, error) {
		var tr readmitting
		var err error
		if kind == "tcp" {
			tr, err = tcp.New(ctx, tcp.Config{Rank: r, Size: n, Exchange: ex, Token: []byte(growSecret)})
		} else {
			tr, err = shm.New(ctx, shm.Config{Rank: r, Size: n, Exchange: ex})
		}
		if err != nil {
			return nil, err
		}
		rf := &refusing{readmitting: tr, refuse: &atomic.Bool{}}
		if r == unreachable {
			rf.refuse = &refuse
		}
		return rf, nil
	})
	ts[victim].Kill()
	subs := shrinkAll(t, cs, []int{victim})

	first := startKindJoiner(t, kind, victim, n, growSecret, cfg, nil)
	for r, err := range growAll(subs, []int{victim}, func(int) []Joiner { return []Joiner{first.spec()} }) {
		var je *JoinError
		require.ErrorAs(t, err, &je, "rank %d", r)
		require.ErrorIs(t, err, ErrJoinFailed, "rank %d", r)
		require.Equal(t, victim, je.Rank, "rank %d", r)
		require.Equal(t, unreachable, je.Member, "rank %d", r)
	}
	for _, r := range []int{0, 2} { // they had connected to the joiner
		req, err := ts[r].Isend(victim, transport.Tag{Comm: 77}, []byte("after the failed Grow"))
		if err == nil {
			_, err = req.Wait(context.Background())
		}
		require.ErrorIs(t, err, transport.ErrEvicted, "rank %d still reaches the joiner it was not to admit", r)
		var pe *transport.PeerError
		require.ErrorAs(t, err, &pe, "rank %d", r)
		require.Equal(t, victim, pe.Rank)
	}
	<-first.done
	require.Error(t, first.err, "the first joiner was not admitted")
	for r, err := range survivors(subs, []int{victim}, func(c *Comm) error { return checkWorks(context.Background(), c) }) {
		require.NoError(t, err, "rank %d serves on", r)
	}

	refuse.Store(false)
	second := startKindJoiner(t, kind, victim, n, growSecret, cfg, func(c *Comm) error { return checkWorks(context.Background(), c) })
	for r, err := range survivors(subs, []int{victim}, func(c *Comm) error {
		g, err := c.Grow(context.Background(), []Joiner{second.spec()})
		if err != nil {
			return err
		}
		defer g.Close()
		if g.Size() != n {
			return fmt.Errorf("grown to %d ranks", g.Size())
		}
		return checkWorks(context.Background(), g)
	}) {
		require.NoError(t, err, "rank %d", r)
	}
	<-second.done
	require.NoError(t, second.err)
}

// A description of a grown communicator meant for another process (an earlier Grow's,
// abandoned, for a process that took the rank over before) that reaches a joiner before
// its own is not taken for its own: the joiner is admitted into the communicator the
// live ranks grew, and serves.
func TestGrowIgnoresOthersDescription(t *testing.T) {
	const n, victim = 3, 2
	cfg := Config{Timeout: 5 * time.Second}
	var sent atomic.Int32
	cs, ts := commsOver(t, n, cfg, func(ctx context.Context, r int, ex func(context.Context, []byte) ([][]byte, error)) (*refusing, error) {
		tr, err := tcp.New(ctx, tcp.Config{Rank: r, Size: n, Exchange: ex, Token: []byte(growSecret)})
		if err != nil {
			return nil, err
		}
		rf := &refusing{readmitting: tr, refuse: &atomic.Bool{}}
		if r == 0 { // the rank that describes the communicator: a stale description first
			rf.after = func(peer int) {
				stale := joinDesc{id: 4242, ranks: []int{0, 1}, hosts: []int{0, 0}, parents: []int{0, 1}}.encode()
				if req, err := tr.Isend(peer, joinTagFor("127.0.0.1:1"), stale); err == nil {
					if _, err := req.Wait(ctx); err == nil {
						sent.Add(1)
					}
				}
			}
		}
		return rf, nil
	})
	ts[victim].Kill()
	subs := shrinkAll(t, cs, []int{victim})
	j := startJoiner(t, victim, n, growSecret, cfg, func(c *Comm) error { return checkWorks(context.Background(), c) })
	for r, err := range survivors(subs, []int{victim}, func(c *Comm) error {
		g, err := c.Grow(context.Background(), []Joiner{j.spec()})
		if err != nil {
			return err
		}
		defer g.Close()
		return checkWorks(context.Background(), g)
	}) {
		require.NoError(t, err, "rank %d", r)
	}
	<-j.done
	require.NoError(t, j.err)
	require.Equal(t, int32(1), sent.Load(), "the stale description went out before the real one")
}
