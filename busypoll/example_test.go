package busypoll_test

import (
	"context"
	"fmt"
	"log"
	"sync/atomic"
	"time"

	"github.com/moex-ai/moex/busypoll"
)

// A receiver waits for a flag that another goroutine sets. The Poller spins on the
// condition for its budget, yields, then parks on the Event until the producer sets
// it: the producer sets the Event after it makes the condition true, so a parked
// waiter always wakes. The policy comes from MOEX_POLL (adaptive unless set).
func ExamplePoller_Wait() {
	cfg, err := busypoll.ConfigFromEnv(func(string) string { return "" }) // os.Getenv in a program
	if err != nil {
		log.Fatal(err)
	}
	cfg.Oversubscribed = busypoll.Oversubscribed(busypoll.LocalRanks())
	p := busypoll.New(cfg)
	var ev busypoll.Event
	ev.Init()
	var arrived atomic.Bool
	go func() {
		time.Sleep(5 * time.Millisecond) // longer than the spin budget: the waiter parks
		arrived.Store(true)
		ev.Set()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Wait(ctx, &ev, arrived.Load); err != nil {
		log.Fatal(err)
	}
	// p.Stats() counts the waits, spins, yields and parks, for a report.
	fmt.Println("mode:", p.Mode())
	fmt.Println("arrived:", arrived.Load())
	// Output:
	// mode: adaptive
	// arrived: true
}
