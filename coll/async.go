package coll

import (
	"context"

	"github.com/moex-ai/moex/transport"
)

func newHandle() *Handle {
	h := &Handle{}
	h.ev.Init()
	return h
}

// take readies h for another operation; it must not be in flight.
func (h *Handle) take() error {
	if h.ev.IsSet() || !h.busy.Load() {
		if h.ev.IsSet() {
			h.ev.Reset()
		} else {
			h.ev.Init()
		}
		h.err = nil
		h.busy.Store(true)
		return nil
	}
	return &ArgError{Arg: "handle", Reason: "its operation is still in flight"}
}

func (h *Handle) finish(err error) {
	h.err = err
	h.busy.Store(false)
	h.ev.Set()
}

// Wait blocks until the operation completes and returns its error. If ctx ends first,
// Wait returns a timeout/cancellation error; the operation itself goes on, bounded by the
// communicator's timeout.
func (h *Handle) Wait(ctx context.Context) error {
	if h.ev.IsSet() {
		return h.err
	}
	if err := h.ev.WaitSet(ctx); err != nil {
		return transport.CtxError(err)
	}
	return h.err
}

// Test reports whether the operation has completed.
func (h *Handle) Test() bool { return h.ev.IsSet() }

// run queues j, starting a worker unless an idle one can take it.
func (c *Comm) runAsync(j *job) {
	w := &c.async
	if w.idle.Add(-1) < 0 {
		w.idle.Add(1)
		w.wg.Add(1)
		go c.worker()
	}
	w.jobs <- j
}

func (c *Comm) worker() {
	w := &c.async
	defer w.wg.Done()
	for {
		select {
		case j := <-w.jobs:
			c.runJob(j)
			w.idle.Add(1)
		case <-w.stop:
			// Whatever was queued still completes (with the communicator's error).
			for {
				select {
				case j := <-w.jobs:
					c.runJob(j)
				default:
					return
				}
			}
		}
	}
}

func (c *Comm) runJob(j *job) {
	err := c.exec(j.pl, j.seq, &j.cl)
	if j.after != nil {
		j.after()
	}
	h := j.h
	w := &c.async
	*j = job{}
	w.mu.Lock()
	w.free = append(w.free, j)
	w.mu.Unlock()
	h.finish(err)
}

func (c *Comm) getJob() *job {
	w := &c.async
	w.mu.Lock()
	defer w.mu.Unlock()
	if n := len(w.free); n > 0 {
		j := w.free[n-1]
		w.free = w.free[:n-1]
		return j
	}
	return &job{}
}
