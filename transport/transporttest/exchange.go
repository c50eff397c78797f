package transporttest

import (
	"context"
	"sync"
	"testing"
	"time"
)

// Exchange is an in-memory all-gather among n ranks of one process: the rendezvous
// store's role when a test starts a transport's ranks as goroutines. Each call of a rank's
// function is one round; round r returns once every rank has made its r-th call, or with
// the context's error if that ends first.
type Exchange struct {
	mu     sync.Mutex
	n      int
	rounds []*exchangeRound
	next   []int // next round of each rank
}

type exchangeRound struct {
	vals [][]byte
	left int
	done chan struct{}
}

// NewExchange returns an Exchange for n ranks.
func NewExchange(n int) *Exchange { return &Exchange{n: n, next: make([]int, n)} }

// For returns rank's all-gather function (the Exchange field of a transport's Config).
func (e *Exchange) For(rank int) func(ctx context.Context, mine []byte) ([][]byte, error) {
	return func(ctx context.Context, mine []byte) ([][]byte, error) {
		e.mu.Lock()
		r := e.next[rank]
		e.next[rank]++
		for len(e.rounds) <= r {
			e.rounds = append(e.rounds, &exchangeRound{vals: make([][]byte, e.n), left: e.n, done: make(chan struct{})})
		}
		rd := e.rounds[r]
		rd.vals[rank] = append([]byte(nil), mine...)
		if rd.left--; rd.left == 0 {
			close(rd.done)
		}
		e.mu.Unlock()
		select {
		case <-rd.done:
			return rd.vals, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Start opens n ranks of a transport at once, as goroutines of this process: open(ctx,
// rank, exchange) builds rank's endpoint with exchange as its rendezvous all-gather. It
// fails the test if any rank fails to open (within 30 s), and closes every rank when
// the test ends.
func Start[T interface{ Close() error }](t testing.TB, n int,
	open func(ctx context.Context, rank int, exchange func(context.Context, []byte) ([][]byte, error)) (T, error)) []T {
	t.Helper()
	ex := NewExchange(n)
	ts := make([]T, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for r := 0; r < n; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ts[r], errs[r] = open(ctx, r, ex.For(r))
		}()
	}
	wg.Wait()
	t.Cleanup(func() {
		for r, x := range ts {
			if errs[r] == nil {
				_ = x.Close()
			}
		}
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return ts
}
