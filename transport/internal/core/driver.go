package core

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/moex-ai/moex/busypoll"
)

// Driver lets the goroutines that wait on a transport's requests drive its progress
// themselves, the way an MPI library's wait does: no wake-up stands between the data
// arriving and its waiter. A transport with a progress goroutine of its own (shm, ucx)
// embeds one; its progress goroutine takes Mu for each step and, while Waiters is not
// zero, may leave the work to them.
type Driver struct {
	// Mu is held by whoever runs a progress step: one goroutine at a time.
	Mu sync.Mutex
	// Step does one round of progress under Mu and reports whether it did anything.
	Step func() bool
	// Closed reports that the transport is closed: steps stop.
	Closed func() bool
	// Handoff wakes the progress goroutine when a waiter stops driving and parks: the
	// progress goroutine may be asleep without having asked to be woken (it was not
	// needed while waiters polled).
	Handoff func()
	// Release, if set, is called when the last driving waiter stops without parking
	// (its request completed, or its context ended): the progress goroutine may be
	// asleep without having asked to be woken, and work may be left that no waiter
	// will drive (frames queued behind a full ring, a stream still to send).
	Release func()
	// Poller is the policy of waiting goroutines while they drive; Park the one they park
	// with once they stop.
	Poller, Park *busypoll.Poller

	waiters atomic.Int32
}

// Waiters reports how many goroutines are driving progress now.
func (d *Driver) Waiters() int32 { return d.waiters.Load() }

// TryStep runs a step unless another goroutine is running one or the transport is closed.
func (d *Driver) TryStep() bool {
	if !d.Mu.TryLock() {
		return false
	}
	defer d.Mu.Unlock()
	if d.Closed() {
		return false
	}
	return d.Step()
}

// Await waits for r, stepping the transport while the policy says poll, then parking
// (and handing progress back) when it says park. It returns ctx's error if ctx ends first.
func (d *Driver) Await(ctx context.Context, r *Req) error {
	if r.Test() {
		return nil
	}
	d.waiters.Add(1)
	s := d.Poller.Begin()
	for i := 0; !r.Test(); i++ {
		if i&255 == 255 && ctx.Err() != nil {
			// Looked at every 256 rounds, worked or not: steps that keep finding work
			// for other requests must not hide the end of this one's context.
			s.End()
			d.leave()
			return ctx.Err()
		}
		if d.TryStep() {
			continue
		}
		if s.Idle() {
			s.End()
			d.waiters.Add(-1)
			d.Handoff()
			return r.Await(ctx, d.Park)
		}
	}
	s.End()
	d.leave()
	return nil
}

// leave counts a driving waiter out without parking.
func (d *Driver) leave() {
	if d.waiters.Add(-1) == 0 && d.Release != nil {
		d.Release()
	}
}
