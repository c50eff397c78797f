package tcp_test

import (
	"context"
	"log/slog"
	"testing"

	"go.uber.org/goleak"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/tcp"
	"github.com/moex-ai/moex/transport/transporttest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func start(t testing.TB, n int, tweak func(*tcp.Config)) []*tcp.Transport {
	t.Helper()
	return transporttest.Start(t, n, func(ctx context.Context, r int, ex func(context.Context, []byte) ([][]byte, error)) (*tcp.Transport, error) {
		cfg := tcp.Config{Rank: r, Size: n, Exchange: ex, Token: []byte("test-secret")}
		if tweak != nil {
			tweak(&cfg)
		}
		return tcp.New(ctx, cfg)
	})
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

// A clean end is not a failure: see transporttest.LeaveLogs.
func TestLogsGoodbyeAsLeaving(t *testing.T) {
	transporttest.LeaveLogs(t, "moex tcp", func(n int, log *slog.Logger) []*tcp.Transport {
		return start(t, n, func(c *tcp.Config) { c.Logger = log })
	})
}

// Where ranks outnumber CPUs (the readers park at once), the whole contract holds so too,
// cancellation and peer failure included.
func TestConformanceOversubscribed(t *testing.T) {
	transporttest.Run(t, factory(func(c *tcp.Config) { c.Poll.Oversubscribed = true }), transporttest.Options{})
}
