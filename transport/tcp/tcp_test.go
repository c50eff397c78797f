package tcp_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/tcp"
	"github.com/moex-ai/moex/transport/transporttest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func start(t testing.TB, n int, tweak func(*tcp.Config)) []*tcp.Transport {
	t.Helper()
	ex := transporttest.NewExchange(n)
	ts := make([]*tcp.Transport, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for r := 0; r < n; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			cfg := tcp.Config{Rank: r, Size: n, Exchange: ex.For(r), Token: []byte("test-secret")}
			if tweak != nil {
				tweak(&cfg)
			}
			ts[r], errs[r] = tcp.New(ctx, cfg)
		}(r)
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	t.Cleanup(func() {
		for _, x := range ts {
			_ = x.Close()
		}
	})
	return ts
}

func factory(tweak func(*tcp.Config)) transporttest.Factory {
	return func(t *testing.T, n int) *transporttest.World {
		ts := start(t, n, tweak)
		w := &transporttest.World{}
		for _, x := range ts {
			w.T = append(w.T, x)
		}
		w.Kill = func(r int) { ts[r].Kill() }
		w.Inject = func(from, to int, raw []byte) error { return ts[from].InjectRaw(to, raw) }
		return w
	}
}

func TestConformance(t *testing.T) {
	transporttest.Run(t, factory(nil), transporttest.Options{})
}

func TestConformanceMultiStream(t *testing.T) {
	transporttest.Run(t, factory(func(c *tcp.Config) { c.Streams = 3; c.Checksum = true }), transporttest.Options{})
}

var _ transport.Transport = (*tcp.Transport)(nil)
