package shm_test

import (
	"context"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/transporttest"
)

// TestMain checks that the tests leave /dev/shm as they found it.
func TestMain(m *testing.M) {
	before := shm.Segments()
	code := m.Run()
	if after := shm.Segments(); code == 0 && !slices.Equal(before, after) {
		println("shm tests left segments behind:", len(after)-len(before))
		code = 1
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			println(err.Error())
			code = 1
		}
	}
	os.Exit(code)
}

type exchanger struct {
	mu    sync.Mutex
	cond  *sync.Cond
	round []int
	vals  [][][]byte
	n     int
}

func newExchanger(n int) *exchanger {
	e := &exchanger{n: n, round: make([]int, n)}
	e.cond = sync.NewCond(&e.mu)
	return e
}

func (e *exchanger) fn(rank int) func(context.Context, []byte) ([][]byte, error) {
	return func(ctx context.Context, mine []byte) ([][]byte, error) {
		e.mu.Lock()
		defer e.mu.Unlock()
		r := e.round[rank]
		e.round[rank]++
		for len(e.vals) <= r {
			e.vals = append(e.vals, make([][]byte, e.n))
		}
		e.vals[r][rank] = append([]byte{1}, mine...)
		e.cond.Broadcast()
		for {
			done := true
			for _, v := range e.vals[r] {
				if v == nil {
					done = false
				}
			}
			if done {
				out := make([][]byte, e.n)
				for i, v := range e.vals[r] {
					out[i] = v[1:]
				}
				return out, nil
			}
			e.cond.Wait()
		}
	}
}

func start(t testing.TB, n int, tweak func(*shm.Config)) []*shm.Transport {
	t.Helper()
	ex := newExchanger(n)
	ts := make([]*shm.Transport, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for r := 0; r < n; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			cfg := shm.Config{Rank: r, Size: n, Exchange: ex.fn(r)}
			if tweak != nil {
				tweak(&cfg)
			}
			ts[r], errs[r] = shm.New(ctx, cfg)
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

func factory(tweak func(*shm.Config)) transporttest.Factory {
	return func(t *testing.T, n int) *transporttest.World {
		ts := start(t, n, tweak)
		w := &transporttest.World{}
		for _, x := range ts {
			w.T = append(w.T, x)
		}
		w.Kill = func(r int) { ts[r].Kill() }
		w.Inject = func(from, to int, raw []byte) error { return ts[from].InjectRaw(to, raw) }
		w.WholeFrames = true
		return w
	}
}

func TestConformanceCMA(t *testing.T) {
	transporttest.Run(t, factory(func(c *shm.Config) { c.CMA = 1 }), transporttest.Options{})
}

// The fallback for kernels that refuse cross-memory attach: large messages through the
// rings.
func TestConformanceRingCopies(t *testing.T) {
	transporttest.Run(t, factory(func(c *shm.Config) { c.CMA = -1; c.Slots = 16; c.SlotSize = 4096 }), transporttest.Options{})
}

func TestPathSaysHow(t *testing.T) {
	ts := start(t, 2, nil)
	if p := ts[0].Path(1); !contains(p, "cma") || !contains(p, "same host") {
		t.Fatalf("path: %q", p)
	}
	ts2 := start(t, 2, func(c *shm.Config) { c.CMA = -1 })
	if p := ts2[0].Path(1); !contains(p, "ring copies") {
		t.Fatalf("path: %q", p)
	}
}

func contains(s, sub string) bool {
	return len(s) >= len(sub) && (s == sub || len(sub) == 0 || indexOf(s, sub) >= 0)
}

func indexOf(s, sub string) int {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return i
		}
	}
	return -1
}

// A rank that is not on this host is refused with an argument error.
func TestNonLocalPeer(t *testing.T) {
	ex := newExchanger(3)
	ts := make([]*shm.Transport, 3)
	var wg sync.WaitGroup
	local := []bool{true, true, false}
	for r := 0; r < 3; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			l := local
			if r == 2 {
				l = []bool{false, false, true}
			}
			var err error
			ts[r], err = shm.New(context.Background(), shm.Config{Rank: r, Size: 3, Local: l, Exchange: ex.fn(r)})
			if err != nil {
				t.Error(err)
			}
		}(r)
	}
	wg.Wait()
	defer func() {
		for _, x := range ts {
			if x != nil {
				x.Close()
			}
		}
	}()
	if _, err := ts[0].Isend(2, transport.Tag{}, nil); err == nil {
		t.Fatal("send to a rank on another host accepted")
	}
}

func TestCleanStale(t *testing.T) {
	// A segment named after a pid that does not exist is removed.
	name := shm.DevShm + "/moex-deadbeef-r0-p999999999"
	if err := os.WriteFile(name, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	removed, err := shm.CleanStale()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(removed, "moex-deadbeef-r0-p999999999") {
		t.Fatalf("removed %v", removed)
	}
	if _, err := os.Stat(name); !os.IsNotExist(err) {
		t.Fatal("stale segment still there")
	}
}
