package health

import (
	"sync/atomic"
	"time"
)

// Watchdog turns a stall into an error: while operations run, one that makes no
// progress for the timeout fires (the communicator aborts), and one stalled for
// WarnAfter, when the timeout is longer, warns once. Operations in a steady stream keep
// one timer set rather than setting it each: Begin and End are a few atomic operations.
type Watchdog struct {
	timeout   time.Duration
	warnAfter time.Duration
	dead      func() bool              // the communicator has ended: do nothing more
	fire      func(idle time.Duration) // no progress for the timeout
	warn      func(idle time.Duration) // no progress for warnAfter

	timer    *time.Timer
	armed    atomic.Bool // timer is set (it stays set across operations until it fires idle)
	inflight atomic.Int32
	progress atomic.Int64 // when progress was last made, in nanoseconds since epoch
	warned   atomic.Bool  // the warning was given for the current stall
	epoch    time.Time
}

// NewWatchdog makes a watchdog; it checks nothing until an operation begins.
func NewWatchdog(timeout, warnAfter time.Duration, dead func() bool, fire, warn func(idle time.Duration)) *Watchdog {
	w := &Watchdog{timeout: timeout, warnAfter: warnAfter, dead: dead, fire: fire, warn: warn, epoch: time.Now()}
	w.timer = time.AfterFunc(time.Hour, w.check)
	w.timer.Stop()
	return w
}

func (w *Watchdog) now() int64 { return int64(time.Since(w.epoch)) }

// Begin counts an operation in, as progress, and sets the timer unless it is set.
func (w *Watchdog) Begin() {
	w.progress.Store(w.now())
	w.inflight.Add(1)
	if !w.armed.Load() && w.armed.CompareAndSwap(false, true) {
		w.warned.Store(false)
		w.timer.Reset(w.next(0))
	}
}

// End counts an operation out, as progress.
func (w *Watchdog) End() {
	w.progress.Store(w.now())
	w.inflight.Add(-1)
}

// Progressed records progress within an operation.
func (w *Watchdog) Progressed() { w.progress.Store(w.now()) }

// Busy says whether an operation runs.
func (w *Watchdog) Busy() bool { return w.inflight.Load() > 0 }

// Idle is how long since the last progress.
func (w *Watchdog) Idle() time.Duration { return time.Duration(w.now() - w.progress.Load()) }

// Stop stops the timer for good.
func (w *Watchdog) Stop() { w.timer.Stop() }

func (w *Watchdog) check() {
	if w.dead() {
		return
	}
	if w.inflight.Load() == 0 {
		// Nothing runs: stay unset. An operation that began since and found the timer
		// still set is seen by the second look (it counts itself in before it looks at
		// armed; this clears armed before it looks again).
		w.armed.Store(false)
		if w.inflight.Load() == 0 || !w.armed.CompareAndSwap(false, true) {
			return
		}
	}
	idle := w.Idle()
	if idle >= w.timeout {
		w.fire(idle)
		return
	}
	if idle >= w.warnAfter && !w.warned.Swap(true) {
		w.warn(idle)
	}
	w.timer.Reset(w.next(idle))
}

// next is when to look again, idle into a stall: at the warning, then at the timeout.
func (w *Watchdog) next(idle time.Duration) time.Duration {
	if idle < w.warnAfter && w.warnAfter < w.timeout && !w.warned.Load() {
		return w.warnAfter - idle
	}
	return w.timeout - idle
}
