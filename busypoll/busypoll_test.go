package busypoll

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestEventWakesParkedWaiter(t *testing.T) {
	for _, m := range []Mode{Adaptive, Spin, Block} {
		t.Run(m.String(), func(t *testing.T) {
			p := New(Config{Mode: m})
			var ev Event
			ev.Init()
			for round := 0; round < 200; round++ {
				ev.Reset()
				go func() {
					if round%2 == 0 {
						time.Sleep(50 * time.Microsecond)
					}
					ev.Set()
				}()
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				err := p.Wait(ctx, &ev, ev.IsSet)
				cancel()
				if err != nil {
					t.Fatalf("round %d: %v", round, err)
				}
			}
			if m == Block && p.Stats().Spins != 0 {
				t.Fatalf("block mode spun: %v", p.Stats())
			}
		})
	}
}

func TestWaitHonoursContext(t *testing.T) {
	for _, m := range []Mode{Adaptive, Spin, Block} {
		t.Run(m.String(), func(t *testing.T) {
			p := New(Config{Mode: m})
			var ev Event
			ev.Init()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
			defer cancel()
			err := p.Wait(ctx, &ev, ev.IsSet)
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("got %v, want deadline exceeded", err)
			}
		})
	}
}

// A wait whose condition becomes true only after a long time must shrink the adaptive
// budget (spinning did not pay); waits satisfied quickly must restore it.
func TestAdaptiveBudget(t *testing.T) {
	p := New(Config{MaxSpin: 40 * time.Microsecond})
	// Waits whose condition never comes true while the poller spins: each ends parked
	// (deterministic, unlike a timer, which a loaded machine may fire mid-spin).
	for i := 0; i < 10; i++ {
		s := p.Begin()
		for !s.Idle() {
		}
		s.End()
	}
	st := p.Stats()
	if st.Parks == 0 || st.BudgetNow >= 40*time.Microsecond/8 {
		t.Fatalf("budget did not shrink after parked waits: %v", st)
	}
	// Conditions that are true after a few polls make spinning pay again.
	for i := 0; i < 2*probeEvery; i++ {
		n := 0
		s := p.Begin()
		for n < 3 {
			n++
			if s.Idle() {
				break
			}
		}
		s.End()
	}
	if st2 := p.Stats(); st2.SpinHits == 0 || st2.BudgetNow == 0 {
		t.Fatalf("budget did not recover after spin hits: %v", st2)
	}
}

func TestOversubscribedCapsSpin(t *testing.T) {
	p := New(Config{Oversubscribed: true})
	if b := p.Stats().BudgetNow; b > OversubscribedSpin {
		t.Fatalf("oversubscribed budget = %v, want at most %v", b, OversubscribedSpin)
	}
	// Without its yield-polling, an oversubscribed waiter parks at its first look.
	s := New(Config{Oversubscribed: true, YieldSpin: -1}).Begin()
	if !s.Idle() {
		t.Fatal("oversubscribed waiter with no yield-polling did not park at once")
	}
	s.End()
	// With it, it parks after a bounded number of looks (each a yield of the CPU), never
	// spinning: counted in looks, not in time, which a loaded machine stretches.
	s = p.Begin()
	looks := 1
	for ; !s.Idle(); looks++ {
		if looks > 10_000_000 {
			t.Fatal("oversubscribed waiter never parked")
		}
	}
	s.End()
	if st := p.Stats(); st.Spins != 0 {
		t.Fatalf("oversubscribed waiter spun %d times before parking (after %d looks)", st.Spins, looks)
	}
	if p := New(Config{MaxSpin: -1}); p.Stats().BudgetNow != 0 {
		t.Fatalf("MaxSpin<0 budget = %v", p.Stats().BudgetNow)
	}
}

// Only GOMAXPROCS-1 goroutines of the process spin at once; the others park at once.
func TestSpinnerSlots(t *testing.T) {
	p := New(Config{MaxSpin: time.Second})
	var held []Spinner
	for i := int32(0); i < maxSpinners(); i++ {
		s := p.Begin()
		if s.Idle() {
			t.Fatalf("spinner %d parked with slots free", i)
		}
		held = append(held, s)
	}
	extra := p.Begin()
	if !extra.Idle() {
		t.Fatal("a spinner beyond the process limit did not park")
	}
	extra.End()
	for i := range held {
		held[i].End()
	}
	again := p.Begin()
	if again.Idle() {
		t.Fatal("slot not released")
	}
	again.End()
}

func TestParseModeAndEnv(t *testing.T) {
	for in, want := range map[string]Mode{"": Adaptive, "spin": Spin, "BLOCK": Block, "adaptive": Adaptive} {
		got, err := ParseMode(in)
		if err != nil || got != want {
			t.Fatalf("ParseMode(%q) = %v, %v", in, got, err)
		}
	}
	if _, err := ParseMode("turbo"); err == nil {
		t.Fatal("ParseMode accepted turbo")
	}
	env := map[string]string{"MOEX_POLL": "spin", "MOEX_SPIN_US": "7"}
	c, err := ConfigFromEnv(func(k string) string { return env[k] })
	if err != nil || c.Mode != Spin || c.MaxSpin != 7*time.Microsecond {
		t.Fatalf("ConfigFromEnv = %+v, %v", c, err)
	}
	env["MOEX_SPIN_US"] = "-1"
	if _, err := ConfigFromEnv(func(k string) string { return env[k] }); err == nil {
		t.Fatal("negative MOEX_SPIN_US accepted")
	}
}

// MOEX_HOLD_P=1, read by an earlier release, is an error naming it; 0 and unset are fine.
func TestHoldPRemoved(t *testing.T) {
	for _, v := range []string{"", "0"} {
		_, err := ConfigFromEnv(func(k string) string { return map[string]string{"MOEX_HOLD_P": v}[k] })
		require.NoError(t, err, "%q", v)
	}
	for _, v := range []string{"1", "yes"} {
		_, err := ConfigFromEnv(func(k string) string { return map[string]string{"MOEX_HOLD_P": v}[k] })
		require.ErrorIs(t, err, ErrHoldPRemoved, "%q", v)
	}
}

// Many waiters on few CPUs: every one completes (no starvation) under each mode.
func TestManyWaiters(t *testing.T) {
	for _, m := range []Mode{Adaptive, Block, Spin} {
		t.Run(m.String(), func(t *testing.T) {
			p := New(Config{Mode: m})
			const n = 16
			evs := make([]Event, n)
			for i := range evs {
				evs[i].Init()
			}
			var wg sync.WaitGroup
			for i := 0; i < n; i++ {
				wg.Add(1)
				go func(i int) {
					defer wg.Done()
					// A chain: waiter i sets i+1 after its own event fires.
					if err := p.Wait(context.Background(), &evs[i], evs[i].IsSet); err != nil {
						t.Error(err)
					}
					if i+1 < n {
						evs[i+1].Set()
					}
				}(i)
			}
			evs[0].Set()
			wg.Wait()
		})
	}
}

func BenchmarkEventPingPong(b *testing.B) {
	for _, m := range []Mode{Adaptive, Spin, Block} {
		b.Run(m.String(), func(b *testing.B) {
			p := New(Config{Mode: m})
			var ping, pong Event
			ping.Init()
			pong.Init()
			var stop atomic.Bool
			done := make(chan struct{})
			go func() {
				defer close(done)
				for {
					_ = p.Wait(context.Background(), &ping, ping.IsSet)
					ping.Reset()
					if stop.Load() {
						return
					}
					pong.Set()
				}
			}()
			b.ReportAllocs()
			for b.Loop() {
				ping.Set()
				_ = p.Wait(context.Background(), &pong, pong.IsSet)
				pong.Reset()
			}
			b.StopTimer()
			stop.Store(true)
			ping.Set()
			<-done
			b.ReportMetric(float64(p.Stats().Parks)/float64(b.N), "parks/op")
		})
	}
}
