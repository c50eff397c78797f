package bootstrap

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/transporttest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// startStore serves a store on loopback and returns it and a dialer of claimed clients.
func startStore(t *testing.T) (*StoreServer, func(rank, size int, nonce string) (*Store, error)) {
	t.Helper()
	srv, err := ServeStore("127.0.0.1:0", []byte("k"), nil)
	require.NoError(t, err)
	t.Cleanup(func() { srv.Close() })
	return srv, func(rank, size int, nonce string) (*Store, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		st, err := DialStore(ctx, srv.Addr(), []byte("k"))
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { st.Close() })
		return st, st.Claim(ctx, rank, size, nonce)
	}
}

// A second process claiming a rank fails, the first on its next call, and every rank
// waiting with them: the job cannot start, and says why.
func TestStoreDuplicateRank(t *testing.T) {
	_, dial := startStore(t)
	a, err := dial(1, 3, "first")
	require.NoError(t, err)
	other, err := dial(0, 3, "zero")
	require.NoError(t, err)
	waiting := make(chan error, 1)
	go func() {
		_, err := other.AllGather(context.Background(), "ag/1", 0, 3, []byte("x"))
		waiting <- err
	}()
	time.Sleep(20 * time.Millisecond) // rank 0 waits in the all-gather
	_, err = dial(1, 3, "second")
	var se *StartupError
	require.ErrorAs(t, err, &se)
	assert.ErrorIs(t, err, ErrDuplicateRank)
	assert.Equal(t, 1, se.Rank)
	_, err = a.AllGather(context.Background(), "ag/1", 1, 3, []byte("y"))
	assert.ErrorIs(t, err, ErrDuplicateRank, "the first claimant fails too")
	assert.ErrorIs(t, <-waiting, ErrDuplicateRank, "and the ranks waiting with them")
}

// A rank whose connection closes before it was ready fails every rank waiting, at once,
// naming it; a rank that was ready may leave.
func TestStoreRankLeftDuringStartup(t *testing.T) {
	_, dial := startStore(t)
	zero, err := dial(0, 3, "z")
	require.NoError(t, err)
	one, err := dial(1, 3, "o")
	require.NoError(t, err)
	two, err := dial(2, 3, "t")
	require.NoError(t, err)
	require.NoError(t, two.Set(context.Background(), stageKey(2), []byte(StageReady)))
	two.Close() // ready: a clean exit
	waiting := make(chan error, 1)
	go func() {
		_, err := zero.AllGather(context.Background(), "ag/1", 0, 3, nil)
		waiting <- err
	}()
	require.NoError(t, one.Set(context.Background(), stageKey(1), []byte("transport")))
	start := time.Now()
	one.Close() // rank 1 dies during start-up
	err = <-waiting
	var pe *transport.PeerError
	require.ErrorAs(t, err, &pe)
	assert.Equal(t, 1, pe.Rank)
	assert.ErrorIs(t, err, transport.ErrPeerClosed)
	assert.Less(t, time.Since(start), 5*time.Second)
}

// Status reports each rank's stage; a job size that disagrees is refused.
func TestStoreStatusAndSize(t *testing.T) {
	srv, dial := startStore(t)
	zero, err := dial(0, 4, "z")
	require.NoError(t, err)
	_, err = dial(2, 4, "t")
	require.NoError(t, err)
	require.NoError(t, zero.Set(context.Background(), stageKey(0), []byte("transport")))
	st, err := zero.Status(context.Background())
	require.NoError(t, err)
	assert.Equal(t, []string{"transport", "", StageConnected, ""}, st)
	se := &StartupError{Expected: 4, Stages: st, Rank: -1, Err: transport.ErrTimeout}
	assert.Equal(t, []int{1, 3}, se.Missing())
	assert.Equal(t, 2, se.Arrived())
	assert.Contains(t, se.Error(), "not heard from: ranks [1 3]")
	_, err = dial(3, 5, "bad")
	assert.Error(t, err, "a job of 5 ranks where the others said 4")
	_ = srv
}

// flakyListener fails its first Accepts as a process out of file descriptors does.
type flakyListener struct {
	net.Listener
	mu    sync.Mutex
	fails int
}

type tempErr struct{}

func (tempErr) Error() string   { return "accept: too many open files" }
func (tempErr) Timeout() bool   { return false }
func (tempErr) Temporary() bool { return true }

func (l *flakyListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	if l.fails > 0 {
		l.fails--
		l.mu.Unlock()
		return nil, tempErr{}
	}
	l.mu.Unlock()
	return l.Listener.Accept()
}

// An Accept that fails for a moment does not end the store: ranks that come later get in.
func TestStoreAcceptSurvives(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := serveStoreOn(&flakyListener{Listener: ln, fails: 3}, []byte("k"), nil)
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := DialStore(ctx, srv.Addr(), []byte("k"))
	require.NoError(t, err)
	defer st.Close()
	require.NoError(t, st.Claim(ctx, 0, 1, "n"))
	vals, err := st.AllGather(ctx, "ag/1", 0, 1, []byte("v"))
	require.NoError(t, err)
	assert.Equal(t, "v", string(vals[0]))
	assert.False(t, errors.Is(err, transport.ErrClosed))
}

// The store drops connections that are not a rank's: garbage at once, silence after
// transport.AcceptIdle.
func TestStoreDropsStrangers(t *testing.T) {
	srv, err := ServeStore("127.0.0.1:0", []byte("job"), nil)
	require.NoError(t, err)
	defer srv.Close()
	for _, s := range transporttest.Strangers {
		assert.NoError(t, transporttest.Dropped(srv.Addr(), s.Send), s.Name)
	}
}
