package busypoll

import (
	"context"
	"errors"
	"runtime"
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

// MOEX_HOLD_P asks for HoldP; anything but 0 and 1 is an error.
func TestHoldPFromEnv(t *testing.T) {
	for v, want := range map[string]bool{"": false, "0": false, "1": true} {
		c, err := ConfigFromEnv(func(k string) string { return map[string]string{"MOEX_HOLD_P": v}[k] })
		require.NoError(t, err, "%q", v)
		require.Equal(t, want, c.HoldP, "%q", v)
	}
	_, err := ConfigFromEnv(func(k string) string { return map[string]string{"MOEX_HOLD_P": "yes"}[k] })
	require.Error(t, err)
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

// A HoldP waiter sleeps with a spinner slot (its P kept) and is woken by Set, by Kick
// (its condition re-checked) and by the end of its context; with one P it parks as others
// do, and two such waiters never take every P.
func TestHoldP(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(2))
	require.Zero(t, spinning.Load())
	p := New(Config{Mode: Block, HoldP: true})
	var ev Event
	ev.Init()

	// Set wakes it; the slot is held while it sleeps and given back after.
	ev.Reset()
	done := make(chan error, 1)
	go func() { done <- p.Wait(context.Background(), &ev, ev.IsSet) }()
	require.Eventually(t, func() bool { return ev.parked.Load() == parkedHolding }, 5*time.Second, 100*time.Microsecond)
	require.EqualValues(t, 1, spinning.Load(), "a sleeper holding its P takes a spinner slot")
	require.False(t, ev.Set(), "a sleeper on its own P is not handed the setter's")
	require.NoError(t, <-done)
	require.Zero(t, spinning.Load())

	// Kick makes it look at its condition again.
	ev.Reset()
	var flag atomic.Bool
	go func() { done <- p.Wait(context.Background(), &ev, flag.Load) }()
	require.Eventually(t, func() bool { return ev.parked.Load() == parkedHolding }, 5*time.Second, 100*time.Microsecond)
	flag.Store(true)
	ev.Kick()
	require.NoError(t, <-done)

	// The end of its context ends the wait.
	ev.Reset()
	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- p.Wait(ctx, &ev, ev.IsSet) }()
	require.Eventually(t, func() bool { return ev.parked.Load() == parkedHolding }, 5*time.Second, 100*time.Microsecond)
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
	require.Zero(t, spinning.Load())
}

func TestHoldPLeavesAP(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(2))
	p := New(Config{Mode: Block, HoldP: true})
	evs := make([]Event, 2)
	done := make(chan error, len(evs))
	for i := range evs {
		evs[i].Init()
		go func() { done <- p.Wait(context.Background(), &evs[i], evs[i].IsSet) }()
	}
	require.Eventually(t, func() bool { return evs[0].parked.Load() != 0 && evs[1].parked.Load() != 0 }, 5*time.Second, 100*time.Microsecond)
	held := 0
	for i := range evs {
		if evs[i].parked.Load() == parkedHolding {
			held++
		}
	}
	require.Equal(t, 1, held, "with 2 Ps one waiter may hold its P, the other parks through the runtime")
	for i := range evs {
		evs[i].Set()
	}
	require.NoError(t, <-done)
	require.NoError(t, <-done)

	runtime.GOMAXPROCS(1)
	var ev Event
	ev.Init()
	go func() { done <- p.Wait(context.Background(), &ev, ev.IsSet) }()
	require.Eventually(t, func() bool { return ev.parked.Load() != 0 }, 5*time.Second, 100*time.Microsecond)
	require.EqualValues(t, parkedChan, ev.parked.Load(), "with one P nothing may hold it")
	ev.Set()
	require.NoError(t, <-done)
	require.Zero(t, spinning.Load())
}
