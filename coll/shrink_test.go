package coll

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/inproc"
)

// kill makes c's rank vanish as a crashed process would.
func kill(c *Comm) { c.tr.(*inproc.Transport).Kill() }

// checkWorks runs an AllReduce and an AlltoAll on c and checks their results.
func checkWorks(ctx context.Context, c *Comm) error {
	p := c.Size()
	x := []int64{int64(c.Rank() + 1), 7}
	if err := AllReduce(ctx, c, nil, x, dtype.Sum); err != nil {
		return err
	}
	if x[0] != int64(p*(p+1)/2) || x[1] != int64(7*p) {
		return fmt.Errorf("rank %d: AllReduce gave %v", c.Rank(), x)
	}
	send := make([]int32, 3*p)
	for i := range send {
		send[i] = int32(c.Rank()*1000 + i)
	}
	recv := make([]int32, len(send))
	if err := AlltoAll(ctx, c, send, recv); err != nil {
		return err
	}
	for q := 0; q < p; q++ {
		for j := 0; j < 3; j++ {
			if want := int32(q*1000 + 3*c.Rank() + j); recv[3*q+j] != want {
				return fmt.Errorf("rank %d: block from %d element %d = %d, want %d", c.Rank(), q, j, recv[3*q+j], want)
			}
		}
	}
	return nil
}

// After a rank dies, the survivors' next operation fails naming it; Shrink gives every
// survivor the same communicator of the others, which works, and whose Close (then the
// old one's) releases the transport once.
func TestShrinkAfterDeath(t *testing.T) {
	const p, victim = 5, 2
	cs := newLocal(t, p, Config{Timeout: 10 * time.Second})
	parents := make([][]int, p)
	errs := runOn(cs, func(c *Comm) error {
		ctx := context.Background()
		err := checkWorks(ctx, c)
		if c.Rank() == victim {
			kill(c)
			return err
		}
		// The victim dies once its part is done: the others see it there or next.
		if err == nil {
			err = checkWorks(ctx, c)
		}
		var pe *PeerError
		if !errors.As(err, &pe) || pe.Rank != victim {
			return fmt.Errorf("rank %d: after the death got %v, want a PeerError naming rank %d", c.Rank(), err, victim)
		}
		sub, err := c.Shrink(ctx)
		if err != nil {
			return err
		}
		defer sub.Close()
		parents[c.Rank()] = sub.ParentRanks()
		if sub.Size() != p-1 {
			return fmt.Errorf("rank %d: shrunk to %d ranks", c.Rank(), sub.Size())
		}
		return checkWorks(ctx, sub)
	})
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
	for r := 0; r < p; r++ {
		if r != victim {
			assert.Equal(t, []int{0, 1, 3, 4}, parents[r], "rank %d", r)
		}
	}
}

// Shrinking a healthy communicator keeps every rank; both communicators work side by
// side, and closing the new one first leaves the old one's transport open.
func TestShrinkHealthy(t *testing.T) {
	cs := newLocal(t, 3, Config{})
	errs := runOn(cs, func(c *Comm) error {
		ctx := context.Background()
		sub, err := c.Shrink(ctx)
		if err != nil {
			return err
		}
		if sub.Size() != 3 || sub.Rank() != c.Rank() {
			return fmt.Errorf("rank %d: rank %d of %d", c.Rank(), sub.Rank(), sub.Size())
		}
		if err := checkWorks(ctx, sub); err != nil {
			return err
		}
		if err := checkWorks(ctx, c); err != nil {
			return err
		}
		if err := sub.Close(); err != nil {
			return err
		}
		return checkWorks(ctx, c)
	})
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
}

// A second rank dies during the agreement, after one survivor heard from it: every
// survivor still gets the same membership. Where it kept the second victim, the new
// communicator's first operation fails naming it on every rank, and a second Shrink
// leaves it out.
func TestShrinkSecondDeathDuringAgreement(t *testing.T) {
	const p = 5
	errDied := errors.New("died")
	for _, tc := range []struct {
		name string
		keep bool // the survivors decide before rank 4 dies: they keep it
		hook func(decided chan struct{}) func(c *Comm, round uint32, to int) error
	}{
		// Rank 4 dies having sent its proposal of round 1 or 2 to rank 0 alone.
		{"in round 1", false, func(chan struct{}) func(*Comm, uint32, int) error {
			return func(c *Comm, r uint32, to int) error {
				if c.Rank() == 4 && r == 1 && to == 1 {
					kill(c)
					return errDied
				}
				return nil
			}
		}},
		{"in round 2", false, func(chan struct{}) func(*Comm, uint32, int) error {
			return func(c *Comm, r uint32, to int) error {
				if c.Rank() == 4 && r == 2 && to == 1 {
					kill(c)
					return errDied
				}
				return nil
			}
		}},
		// Rank 4 sends all of round 2 and dies once rank 0 decided.
		{"after the decision", true, func(decided chan struct{}) func(*Comm, uint32, int) error {
			return func(c *Comm, r uint32, to int) error {
				switch {
				case c.Rank() == 0 && r == 0 && c.parent == nil: // the first Shrink
					close(decided)
				case c.Rank() == 4 && r == 2 && to == -1:
					<-decided
					kill(c)
					return errDied
				}
				return nil
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs := newLocal(t, p, Config{Timeout: 10 * time.Second})
			shrinkTestHook = tc.hook(make(chan struct{}))
			defer func() { shrinkTestHook = nil }()
			members := make([][]int, p)
			finals := make([][]int, p)
			errs := runOn(cs, func(c *Comm) error {
				ctx := context.Background()
				if c.Rank() == 2 {
					kill(c)
					return nil
				}
				sub, err := c.Shrink(ctx)
				if c.Rank() == 4 {
					if !errors.Is(err, errDied) {
						return fmt.Errorf("victim: %v", err)
					}
					return nil
				}
				if err != nil {
					return err
				}
				defer sub.Close()
				members[c.Rank()] = sub.ParentRanks()
				if err := checkWorks(ctx, sub); err != nil {
					var pe *PeerError
					if !errors.As(err, &pe) || pe.Rank != 4 {
						return fmt.Errorf("rank %d: the shrunk communicator failed with %v, want a PeerError naming rank 4", c.Rank(), err)
					}
					again, err := sub.Shrink(ctx)
					if err != nil {
						return err
					}
					defer again.Close()
					sub = again
				}
				finals[c.Rank()] = members[c.Rank()]
				if again := sub.ParentRanks(); len(again) < len(members[c.Rank()]) {
					finals[c.Rank()] = nil
					for _, q := range again { // ranks of the first shrunk communicator
						finals[c.Rank()] = append(finals[c.Rank()], members[c.Rank()][q])
					}
				}
				return checkWorks(ctx, sub)
			})
			for r, err := range errs {
				require.NoError(t, err, "rank %d", r)
			}
			t.Logf("first membership %v, final %v", members[0], finals[0])
			if tc.keep {
				assert.Equal(t, []int{0, 1, 3, 4}, members[0])
			}
			assert.Equal(t, []int{0, 1, 3}, finals[0])
			for _, r := range []int{1, 3} {
				assert.Equal(t, members[0], members[r], "rank %d's membership", r)
				assert.Equal(t, finals[0], finals[r], "rank %d's final membership", r)
			}
		})
	}
}

// A live rank that does not take part makes Shrink fail with ErrTimeout at the
// communicator's timeout on the others, without leaving anything running.
func TestShrinkTimeout(t *testing.T) {
	cs := newLocal(t, 3, Config{Timeout: 300 * time.Millisecond})
	var others sync.WaitGroup
	others.Add(2)
	errs := runOn(cs, func(c *Comm) error {
		if c.Rank() == 2 {
			others.Wait() // alive, but not in the Shrink
			return nil
		}
		defer others.Done()
		_, err := c.Shrink(context.Background())
		return err
	})
	for r := 0; r < 2; r++ {
		assert.ErrorIs(t, errs[r], ErrTimeout, "rank %d", r)
	}
}

// A cancelled context and a closed communicator are refused at once.
func TestShrinkRefused(t *testing.T) {
	cs := newLocal(t, 2, Config{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := cs[0].Shrink(ctx)
	assert.ErrorIs(t, err, transport.ErrCanceled)
	require.NoError(t, cs[1].Close())
	_, err = cs[1].Shrink(context.Background())
	assert.ErrorIs(t, err, ErrClosed)
}

// Aborting a communicator aborts what was split from it, on every rank of the child:
// a rank that gave up on the parent leaves nobody waiting in the child.
func TestAbortReachesSplit(t *testing.T) {
	cs := newLocal(t, 4, Config{Timeout: 20 * time.Second})
	// Rank 0 aborts only once every rank's Split has returned: an abort while a
	// rank is still in the parent's Split fails that Split, which is right but
	// not what this test is about.
	var split sync.WaitGroup
	split.Add(len(cs))
	errs := runOn(cs, func(c *Comm) error {
		ctx := context.Background()
		sub, err := c.Split(ctx, c.Rank()%2, c.Rank())
		split.Done()
		if err != nil {
			return err
		}
		defer sub.Close()
		if c.Rank() == 0 {
			split.Wait()
			c.Abort("giving up")
			return nil
		}
		// Rank 2 waits in the child for rank 0, which will never come.
		err = Barrier(ctx, sub)
		if c.Rank() == 2 && !errors.Is(err, ErrAborted) {
			return fmt.Errorf("rank 2 in the child: got %v, want ErrAborted", err)
		}
		return nil
	})
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
}

// A crashed peer's watcher marks it lost (what an operation that saw the crash waits
// for instead of the grace period), and only it; the survivors' next operation fails
// naming the dead rank.
func TestWatcherMarksCrashedPeerLost(t *testing.T) {
	const p, victim = 3, 2
	cs := newLocal(t, p, Config{Timeout: 10 * time.Second})
	kill(cs[victim])
	for r := 0; r < victim; r++ {
		select {
		case <-cs[r].lost[victim]:
		case <-time.After(10 * time.Second):
			require.FailNow(t, "the dead rank is not marked lost", "rank %d", r)
		}
		select {
		case <-cs[r].lost[1-r]:
			assert.Fail(t, "a live rank is marked lost", "rank %d marks rank %d", r, 1-r)
		default:
		}
	}
	errs := runOn(cs[:victim], func(c *Comm) error {
		return AllReduce(context.Background(), c, nil, []int64{1}, dtype.Sum)
	})
	for r, err := range errs {
		var pe *PeerError
		require.ErrorAs(t, err, &pe, "rank %d", r)
		assert.Equal(t, victim, pe.Rank, "rank %d", r)
	}
}

// A rank that exits the moment its operation fails (here its transport killed then)
// has told the others why first: a survivor still waiting gets that rank's timeout,
// naming the rank it waited for, not a dead peer in its place.
func TestTimeoutNoticeBeforeExit(t *testing.T) {
	const stuck = 2
	cs := newLocal(t, 3, Config{Timeout: 300 * time.Millisecond})
	// Rank 0's transport dies the moment its operation is woken with the error, before
	// its abort goes on: as a process that exits on the error at once.
	hook := func(c *Comm) {
		if c == cs[0] {
			kill(c)
		}
	}
	abortTestHook.Store(&hook)
	defer abortTestHook.Store(nil)
	errs := runOn(cs[:stuck], func(c *Comm) error {
		if c.Rank() == 1 {
			time.Sleep(100 * time.Millisecond) // rank 0 times out first
		}
		return AllReduce(context.Background(), c, nil, make([]float32, 64), dtype.Sum)
	})
	var te *TimeoutError
	require.ErrorAs(t, errs[0], &te, "rank 0")
	assert.Equal(t, stuck, te.blame(), "rank 0: %v", errs[0])
	var ae *AbortError
	require.ErrorAs(t, errs[1], &ae, "rank 1")
	require.ErrorAs(t, errs[1], &te, "rank 1 gets rank 0's timeout: %v", errs[1])
	assert.Equal(t, stuck, te.blame(), "rank 1: %v", errs[1])
	var pe *PeerError
	assert.False(t, errors.As(errs[1], &pe), "rank 1 blames the rank that exited: %v", errs[1])
}
