package inproc_test

import (
	"testing"

	"go.uber.org/goleak"

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
