package inproc_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/inproc"
	"github.com/moex-ai/moex/transport/transporttest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func factory(t *testing.T, n int) *transporttest.World {
	eps := inproc.New(n, inproc.Config{})
	w := &transporttest.World{}
	for _, e := range eps {
		w.T = append(w.T, e)
	}
	w.Kill = func(r int) { eps[r].Kill() }
	t.Cleanup(func() {
		for _, e := range eps {
			_ = e.Close()
		}
	})
	return w
}

func TestConformance(t *testing.T) {
	transporttest.Run(t, factory, transporttest.Options{})
}

// The one-sided emulation over inproc's windows passes the windows' checks by puts and
// signals, as ucx's do (the exchange's one-sided path is tested over it without UCX).
func TestRMAEmulation(t *testing.T) {
	rma := func(t *testing.T, n int) *transporttest.World {
		w := factory(t, n)
		for r, tr := range w.T {
			w.T[r] = transporttest.NewRMA(tr, tr.(transport.WindowTransport))
		}
		return w
	}
	transporttest.RunWindows(t, rma)
}
