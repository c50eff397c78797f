package core

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/transport"
)

// A request that does not complete within the grace period gets its peer failed with a
// timeout naming what was waited for; the failure completes it and the wait returns.
func TestAwaitGrace(t *testing.T) {
	var r Req
	r.Init()
	var failed error
	r.AwaitGrace(busypoll.New(busypoll.Config{Mode: busypoll.Block}), 10*time.Millisecond, "receive", func(err error) {
		failed = err
		r.Complete(0, err)
	})
	if !errors.Is(failed, transport.ErrTimeout) || !r.Test() {
		t.Fatalf("failed with %v, completed %v", failed, r.Test())
	}
	// One that completes in time is left alone.
	var q Req
	q.Init()
	q.Complete(5, nil)
	q.AwaitGrace(busypoll.New(busypoll.Config{}), time.Second, "transfer", func(err error) { t.Fatalf("failed a completed request: %v", err) })
	if n, err := q.Result(); n != 5 || err != nil {
		t.Fatalf("result %d %v", n, err)
	}
}

// The last waiter that stops driving tells the transport: Release when its request
// completed (or its context ended), Handoff when it parks; a waiter that leaves another
// one driving calls neither.
func TestDriverRelease(t *testing.T) {
	var steps, releases, handoffs int
	var a, b Req
	a.Init()
	b.Init()
	d := &Driver{Closed: func() bool { return false }, Poller: busypoll.New(busypoll.Config{Mode: busypoll.Spin}),
		Park:    busypoll.New(busypoll.Config{Mode: busypoll.Block}),
		Release: func() { releases++ }, Handoff: func() { handoffs++ }}
	d.Step = func() bool {
		steps++
		if steps == 3 {
			a.Complete(1, nil)
		}
		return true
	}
	if err := d.Await(context.Background(), &a); err != nil || releases != 1 || handoffs != 0 || d.Waiters() != 0 {
		t.Fatalf("completed wait: err %v, %d releases, %d handoffs, %d waiters", err, releases, handoffs, d.Waiters())
	}
	// Another waiter still driving: leaving calls neither.
	d.waiters.Add(1)
	a.Reset()
	a.Init()
	steps = 0
	if err := d.Await(context.Background(), &a); err != nil || releases != 1 || handoffs != 0 {
		t.Fatalf("wait beside another: err %v, %d releases, %d handoffs", err, releases, handoffs)
	}
	d.waiters.Add(-1)
	// A context that ends releases too, even while every step finds work.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	d.Step = func() bool { return true }
	if err := d.Await(ctx, &b); !errors.Is(err, context.Canceled) || releases != 2 || handoffs != 0 {
		t.Fatalf("cancelled wait: err %v, %d releases, %d handoffs", err, releases, handoffs)
	}
	// A waiter that parks hands off instead.
	park := &Driver{Closed: func() bool { return false }, Step: func() bool { return false },
		Poller: busypoll.New(busypoll.Config{Mode: busypoll.Block}), Park: busypoll.New(busypoll.Config{Mode: busypoll.Block}),
		Release: func() { releases++ }, Handoff: func() { handoffs++; b.Complete(2, nil) }}
	b.Reset()
	b.Init()
	if err := park.Await(context.Background(), &b); err != nil || releases != 2 || handoffs != 1 {
		t.Fatalf("parked wait: err %v, %d releases, %d handoffs", err, releases, handoffs)
	}
}
