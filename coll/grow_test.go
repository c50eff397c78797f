package coll

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/bootstrap"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/tcp"
	"github.com/moex-ai/moex/transport/transporttest"
)

const growSecret = "grow-secret"

// tcpComms returns n communicators over tcp transports of this process (loopback); the
// transports close when the test ends, after the communicators.
func tcpComms(t *testing.T, n int, cfg Config) ([]*Comm, []*tcp.Transport) {
	t.Helper()
	return commsOver(t, n, cfg, func(ctx context.Context, r int, ex func(context.Context, []byte) ([][]byte, error)) (*tcp.Transport, error) {
		return tcp.New(ctx, tcp.Config{Rank: r, Size: n, Exchange: ex, Token: []byte(growSecret)})
	})
}

// shmComms is tcpComms over shared-memory transports.
func shmComms(t *testing.T, n int, cfg Config) ([]*Comm, []*shm.Transport) {
	t.Helper()
	return commsOver(t, n, cfg, func(ctx context.Context, r int, ex func(context.Context, []byte) ([][]byte, error)) (*shm.Transport, error) {
		return shm.New(ctx, shm.Config{Rank: r, Size: n, Exchange: ex})
	})
}

// commsOver starts n transports with open (transporttest.Start) and a communicator on
// each; the communicators close when the test ends, before the transports.
func commsOver[T transport.Transport](t *testing.T, n int, cfg Config, open func(context.Context, int, func(context.Context, []byte) ([][]byte, error)) (T, error)) ([]*Comm, []T) {
	t.Helper()
	ts := transporttest.Start(t, n, open)
	cs := make([]*Comm, n)
	for r, tr := range ts {
		c, err := New(tr, cfg)
		require.NoError(t, err)
		cs[r] = c
		t.Cleanup(func() { c.Close() })
	}
	return cs, ts
}

// killable is a transport a test can kill as a crash would.
type killable interface {
	transport.Transport
	Kill()
}

// comms returns n communicators over tcp or shm (kind) transports of this process.
func comms(t *testing.T, kind string, n int, cfg Config) ([]*Comm, []killable) {
	t.Helper()
	var ks []killable
	var cs []*Comm
	if kind == "tcp" {
		var ts []*tcp.Transport
		cs, ts = tcpComms(t, n, cfg)
		for _, x := range ts {
			ks = append(ks, x)
		}
	} else {
		var ts []*shm.Transport
		cs, ts = shmComms(t, n, cfg)
		for _, x := range ts {
			ks = append(ks, x)
		}
	}
	return cs, ks
}

// listenJoiner starts a new process's side for rank r of n over tcp or shm (kind), with
// the job secret token (tcp): where the live ranks find it, and how it waits for them.
func listenJoiner(t *testing.T, kind string, r, n int, token string) (string, func(context.Context) (killable, []int, error)) {
	t.Helper()
	if kind == "tcp" {
		rep, err := tcp.Listen(tcp.Config{Rank: r, Size: n, Token: []byte(token)})
		require.NoError(t, err)
		return rep.Addr(), func(ctx context.Context) (killable, []int, error) {
			tr, members, err := rep.Accept(ctx)
			if err != nil {
				return nil, nil, err
			}
			return tr, members, nil
		}
	}
	sj, err := shm.Join(shm.Config{Rank: r, Size: n})
	require.NoError(t, err)
	return sj.Addr(), func(ctx context.Context) (killable, []int, error) {
		tr, members, err := sj.Accept(ctx)
		if err != nil {
			return nil, nil, err
		}
		return tr, members, nil
	}
}

// joiner is a process taking over rank r of n: it waits for the live ranks, and once
// admitted returns its communicator (closed, with its transport, when the test ends).
type joiner struct {
	addr string
	rank int
	done chan struct{}
	c    *Comm
	err  error
}

// startJoiner starts one over tcp that, once admitted, runs serve on its communicator.
func startJoiner(t *testing.T, r, n int, token string, cfg Config, serve func(c *Comm) error) *joiner {
	t.Helper()
	return startKindJoiner(t, "tcp", r, n, token, cfg, serve)
}

// startKindJoiner is startJoiner over tcp or shm (kind).
func startKindJoiner(t *testing.T, kind string, r, n int, token string, cfg Config, serve func(c *Comm) error) *joiner {
	t.Helper()
	addr, accept := listenJoiner(t, kind, r, n, token)
	return runJoiner(t, r, addr, cfg, serve, accept)
}

func runJoiner(t *testing.T, r int, addr string, cfg Config, serve func(c *Comm) error, accept func(context.Context) (killable, []int, error)) *joiner {
	j := &joiner{addr: addr, rank: r, done: make(chan struct{})}
	go func() {
		defer close(j.done)
		ctx, cancel := context.WithTimeout(context.Background(), cfg.Timeout)
		defer cancel()
		tr, members, err := accept(ctx)
		if err != nil {
			j.err = err
			return
		}
		j.c, j.err = Rejoin(ctx, tr, j.addr, members, cfg)
		t.Cleanup(func() {
			if j.c != nil {
				j.c.Close()
			}
			tr.Close()
		})
		if j.err == nil && serve != nil {
			j.err = serve(j.c)
		}
	}()
	return j
}

func (j *joiner) spec() Joiner {
	return Joiner{Rank: j.rank, Addr: j.addr, Host: transport.HostID()}
}

// survivors runs f on every rank of cs but the dead ones (and nil ones), and returns their
// errors by rank.
func survivors(cs []*Comm, dead []int, f func(c *Comm) error) map[int]error {
	var mu sync.Mutex
	errs := map[int]error{}
	var wg sync.WaitGroup
	for r, c := range cs {
		if c == nil || slices.Contains(dead, r) {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := f(c)
			mu.Lock()
			errs[r] = err
			mu.Unlock()
		}()
	}
	wg.Wait()
	return errs
}

// A rank of a 4-rank job (tcp, shm) is killed mid-serving: the survivors Shrink and serve
// on three ranks, a replacement joins, and the grown communicator (the replacement in
// the dead rank's place) gives the right results for 100 steps of collectives, on every
// rank.
func TestGrowAfterDeath(t *testing.T) {
	for _, kind := range []string{"tcp", "shm"} {
		t.Run(kind, func(t *testing.T) { growAfterDeath(t, kind) })
	}
}

func growAfterDeath(t *testing.T, kind string) {
	const n, victim = 4, 2
	fds, segs := openFDs(t), shm.SegmentsOf(os.Getpid())
	t.Cleanup(func() { // the last cleanup: every transport and communicator is closed
		require.Equal(t, fds, openFDs(t), "file descriptors open before the test and after it")
		require.Equal(t, segs, shm.SegmentsOf(os.Getpid()), "segments in /dev/shm before the test and after it")
	})
	cfg := Config{Timeout: 10 * time.Second}
	cs, ts := comms(t, kind, n, cfg)
	require.NoError(t, errors.Join(slices.Collect(mapValues(survivors(cs, nil, func(c *Comm) error { return checkWorks(context.Background(), c) })))...))
	ts[victim].Kill()
	var j *joiner
	var once sync.Once
	errs := survivors(cs, []int{victim}, func(c *Comm) error {
		ctx := context.Background()
		err := checkWorks(ctx, c)
		var pe *PeerError
		if !errors.As(err, &pe) || pe.Rank != victim {
			return fmt.Errorf("rank %d: after the death got %v, want a PeerError naming rank %d", c.Rank(), err, victim)
		}
		sub, err := c.Shrink(ctx)
		if err != nil {
			return err
		}
		defer sub.Close()
		if err := checkWorks(ctx, sub); err != nil { // serving on three
			return err
		}
		once.Do(func() {
			serve := func(c *Comm) error {
				if c.Rank() != victim || c.Size() != n || !slices.Equal(c.ParentRanks(), []int{0, 1, -1, 2}) {
					return fmt.Errorf("the joiner is rank %d of %d, parents %v", c.Rank(), c.Size(), c.ParentRanks())
				}
				return steps(context.Background(), c)
			}
			j = startKindJoiner(t, kind, victim, n, growSecret, cfg, serve)
		})
		g, err := sub.Grow(ctx, []Joiner{j.spec()})
		if err != nil {
			return err
		}
		defer g.Close()
		if g.Size() != n || g.Rank() != c.Rank() {
			return fmt.Errorf("rank %d: grown to rank %d of %d", c.Rank(), g.Rank(), g.Size())
		}
		if got := g.ParentRanks(); !slices.Equal(got, []int{0, 1, -1, 2}) {
			return fmt.Errorf("rank %d: parents %v", c.Rank(), got)
		}
		return steps(ctx, g)
	})
	<-j.done
	require.NoError(t, j.err)
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
}

// openFDs counts this process's open file descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// steps runs 100 steps of collectives on c, checking each result.
func steps(ctx context.Context, c *Comm) error {
	for step := 0; step < 100; step++ {
		if err := checkWorks(ctx, c); err != nil {
			return fmt.Errorf("rank %d, step %d: %w", c.Rank(), step, err)
		}
	}
	return nil
}

func mapValues[K comparable, V any](m map[K]V) func(func(V) bool) {
	return func(yield func(V) bool) {
		for _, v := range m {
			if !yield(v) {
				return
			}
		}
	}
}

// growAll runs Grow with joiners(rank) on every live rank of cs (dead left out) and returns
// each one's error.
func growAll(cs []*Comm, dead []int, joiners func(rank int) []Joiner) map[int]error {
	return survivors(cs, dead, func(c *Comm) error {
		g, err := c.Grow(context.Background(), joiners(c.Rank()))
		if err == nil {
			g.Close()
		}
		return err
	})
}

// shrunk returns the communicators of the survivors of n local ranks after victim died.
func shrunk(t *testing.T, n, victim int, cfg Config) []*Comm {
	t.Helper()
	cs := newLocal(t, n, cfg)
	kill(cs[victim])
	return slices.DeleteFunc(shrinkAll(t, cs, []int{victim}), func(c *Comm) bool { return c == nil })
}

// shrinkAll shrinks every communicator of cs but the dead ones, requiring no error, and
// returns the results by rank (nil for the dead), closed when the test ends.
func shrinkAll(t *testing.T, cs []*Comm, dead []int) []*Comm {
	t.Helper()
	subs := make([]*Comm, len(cs))
	errs := survivors(cs, dead, func(c *Comm) error {
		sub, err := c.Shrink(context.Background())
		if err == nil {
			subs[c.Rank()] = sub
			t.Cleanup(func() { sub.Close() })
		}
		return err
	})
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
	return subs
}

// Joiners that cannot be admitted are refused on every live rank alike, in the same
// call, and the communicator serves on: one claiming a live rank, two claiming one rank,
// a list that differs between the ranks, and a joiner over a transport that cannot take
// one (inproc).
func TestGrowRefused(t *testing.T) {
	cfg := Config{Timeout: 5 * time.Second}
	subs := shrunk(t, 4, 3, cfg)
	for _, c := range []struct {
		name    string
		joiners func(rank int) []Joiner
		want    error
	}{
		{"live rank", func(int) []Joiner { return []Joiner{{Rank: 1, Addr: "127.0.0.1:1"}} }, ErrRankLive},
		{"two claimants", func(int) []Joiner { return []Joiner{{Rank: 3, Addr: "127.0.0.1:1"}, {Rank: 3, Addr: "127.0.0.1:2"}} }, ErrRankClaimed},
		{"different lists", func(r int) []Joiner { return []Joiner{{Rank: 3, Addr: fmt.Sprintf("127.0.0.1:%d", 1+r%2)}} }, ErrMismatch},
		{"inproc", func(int) []Joiner { return []Joiner{{Rank: 3, Addr: "127.0.0.1:1"}} }, ErrJoinFailed},
	} {
		errs := growAll(subs, nil, c.joiners)
		require.Len(t, errs, 3)
		for r, err := range errs {
			require.ErrorIs(t, err, c.want, "%s: rank %d", c.name, r)
			if !errors.Is(c.want, ErrMismatch) {
				var je *JoinError
				require.ErrorAs(t, err, &je, "%s: rank %d", c.name, r)
			}
		}
		for r, err := range survivors(subs, nil, func(c *Comm) error { return checkWorks(context.Background(), c) }) {
			require.NoError(t, err, "%s: rank %d serves on", c.name, r)
		}
	}
}

// A joiner with another job's secret is refused: every live rank's Grow fails with a
// JoinError that matches ErrAuth, the joiner's start-up ends with its deadline, and the
// live ranks serve on.
func TestGrowWrongSecret(t *testing.T) {
	const n, victim = 3, 1
	cfg := Config{Timeout: 2 * time.Second}
	cs, ts := tcpComms(t, n, cfg)
	ts[victim].Kill()
	subs := shrinkAll(t, cs, []int{victim})
	j := startJoiner(t, victim, n, "another-secret", cfg, nil)
	for r, err := range growAll(subs, nil, func(int) []Joiner { return []Joiner{j.spec()} }) {
		var je *JoinError
		require.ErrorAs(t, err, &je, "rank %d", r)
		require.ErrorIs(t, err, ErrJoinFailed)
		require.ErrorIs(t, err, transport.ErrAuth)
		require.Equal(t, victim, je.Rank)
	}
	<-j.done
	require.ErrorIs(t, j.err, ErrTimeout)
	for r, err := range survivors(subs, nil, func(c *Comm) error { return checkWorks(context.Background(), c) }) {
		require.NoError(t, err, "rank %d serves on", r)
	}
}

// A live rank that dies while the others admit a joiner makes every other live rank's
// Grow fail with a PeerError naming it, and the joiner's with its deadline: nobody waits
// for it past the timeout.
func TestGrowMemberDies(t *testing.T) {
	for _, kind := range []string{"tcp", "shm"} {
		t.Run(kind, func(t *testing.T) { growMemberDies(t, kind) })
	}
}

func growMemberDies(t *testing.T, kind string) {
	const n, victim, second = 4, 2, 3
	cfg := Config{Timeout: 2 * time.Second}
	cs, ts := comms(t, kind, n, cfg)
	ts[victim].Kill()
	subs := shrinkAll(t, cs, []int{victim})
	j := startKindJoiner(t, kind, victim, n, growSecret, cfg, nil)
	ts[second].Kill()
	for r, err := range growAll(subs, []int{victim, second}, func(int) []Joiner { return []Joiner{j.spec()} }) {
		var pe *PeerError
		require.ErrorAs(t, err, &pe, "rank %d", r)
		require.Equal(t, second, pe.Rank)
	}
	<-j.done
	require.ErrorIs(t, j.err, ErrTimeout)
}

// A joiner that dies once connected, before it is admitted, makes every live rank's
// Grow fail (a PeerError naming it, or a JoinError) rather than wait for it.
func TestGrowJoinerDies(t *testing.T) {
	for _, kind := range []string{"tcp", "shm"} {
		t.Run(kind, func(t *testing.T) { growJoinerDies(t, kind) })
	}
}

func growJoinerDies(t *testing.T, kind string) {
	const n, victim = 3, 2
	cfg := Config{Timeout: 2 * time.Second}
	cs, ts := comms(t, kind, n, cfg)
	ts[victim].Kill()
	subs := shrinkAll(t, cs, []int{victim})
	addr, accept := listenJoiner(t, kind, victim, n, growSecret)
	died := make(chan error, 1)
	go func() { // connected, then gone before the communicator's description
		tr, _, err := accept(context.Background())
		if err == nil {
			tr.Kill()
		}
		died <- err
	}()
	for r, err := range growAll(subs, nil, func(int) []Joiner { return []Joiner{{Rank: victim, Addr: addr}} }) {
		var pe *PeerError
		var je *JoinError
		require.True(t, errors.As(err, &pe) || errors.As(err, &je), "rank %d: %v", r, err)
		if pe != nil {
			require.Equal(t, victim, pe.Rank)
		}
	}
	require.NoError(t, <-died)
}

// joinEnv starts a process's part that takes over rank r of n through the registry at
// reg (coll.Init with MOEX_JOINING=1), in a goroutine; its communicator (or error) comes
// on the channel, and serve runs on the communicator first.
func joinEnv(t *testing.T, r, n int, reg string, cfg Config, serve func(c *Comm) error) chan error {
	t.Helper()
	env := bootstrap.Env{Rank: r, Size: n, LocalRank: -1, LocalSize: -1, Token: growSecret, Registry: reg, Joining: true,
		Transport: "tcp", Timeout: cfg.Timeout}
	done := make(chan error, 1)
	go func() {
		c, err := InitEnv(context.Background(), env, cfg)
		if err == nil {
			err = serve(c)
			c.Close()
		}
		done <- err
	}()
	return done
}

// waitEntries waits until the registry holds n entries of processes waiting to join.
func waitEntries(t *testing.T, reg bootstrap.KV, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		keys, _, err := reg.Scan(context.Background(), bootstrap.JoinPrefix)
		return err == nil && len(keys) == n
	}, 10*time.Second, 5*time.Millisecond)
}

// The live ranks refuse, through the registry, a process that claims a live rank and two
// that claim one dead rank: the claimants' coll.Init fails at once with a JoinError
// saying why (ErrRankLive, ErrRankClaimed), the live ranks' Admit admits nobody (or
// fails with the same JoinError on every one of them) and they serve on; a third
// process for the dead rank is then admitted, and every rank works.
func TestAdmitRefuses(t *testing.T) {
	const n, victim = 3, 2
	cfg := Config{Timeout: 10 * time.Second}
	srv, err := bootstrap.ServeStore("127.0.0.1:0", []byte(growSecret), nil)
	require.NoError(t, err)
	defer srv.Close()
	cs, ts := tcpComms(t, n, cfg)
	ctx := context.Background()
	for _, c := range cs {
		reg, err := bootstrap.DialRegistry(ctx, srv.Addr(), []byte(growSecret))
		require.NoError(t, err)
		c.registry = reg
		t.Cleanup(func() { reg.Close() })
	}
	watch, err := bootstrap.DialRegistry(ctx, srv.Addr(), []byte(growSecret))
	require.NoError(t, err)
	defer watch.Close()

	// A second claimant of live rank 1.
	claimant := joinEnv(t, 1, n, srv.Addr(), cfg, func(*Comm) error { return errors.New("admitted") })
	waitEntries(t, watch, 1)
	for r, err := range survivors(cs, nil, func(c *Comm) error {
		g, err := c.Admit(ctx)
		if g != nil {
			return fmt.Errorf("admitted %d ranks", g.Size())
		}
		return err
	}) {
		require.NoError(t, err, "rank %d", r)
	}
	err = <-claimant
	var je *JoinError
	require.ErrorAs(t, err, &je)
	require.ErrorIs(t, err, ErrRankLive)
	require.Equal(t, 1, je.Rank)

	// Two claimants of dead rank 2.
	ts[victim].Kill()
	subs := shrinkAll(t, cs, []int{victim})
	first := joinEnv(t, victim, n, srv.Addr(), cfg, func(*Comm) error { return errors.New("admitted") })
	second := joinEnv(t, victim, n, srv.Addr(), cfg, func(*Comm) error { return errors.New("admitted") })
	waitEntries(t, watch, 2)
	for r, err := range survivors(subs, nil, func(c *Comm) error {
		_, err := c.Admit(ctx)
		return err
	}) {
		require.ErrorAs(t, err, &je, "rank %d", r)
		require.ErrorIs(t, err, ErrRankClaimed, "rank %d", r)
	}
	for _, ch := range []chan error{first, second} {
		err := <-ch
		require.ErrorAs(t, err, &je)
		require.ErrorIs(t, err, ErrRankClaimed)
	}

	// One claimant: admitted, and every rank works.
	third := joinEnv(t, victim, n, srv.Addr(), cfg, func(c *Comm) error { return steps(ctx, c) })
	waitEntries(t, watch, 1)
	for r, err := range survivors(subs, nil, func(c *Comm) error {
		g, err := c.Admit(ctx)
		if err != nil {
			return err
		}
		if g == nil {
			return errors.New("nobody admitted")
		}
		defer g.Close()
		return steps(ctx, g)
	}) {
		require.NoError(t, err, "rank %d", r)
	}
	require.NoError(t, <-third)
}
