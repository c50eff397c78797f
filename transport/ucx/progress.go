//go:build ucx

package ucx

/*
#cgo pkg-config: ucx
#include "ucx.h"
*/
import "C"

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"runtime"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/transport"
)

// Progress: the worker driven by whoever waits, and the watch on the peers.

// step progresses the worker and finishes what completed; it reports whether anything
// happened.
func (t *Transport) step() bool {
	worked := false
	for i := 0; i < progressBudget; i++ {
		if C.ucp_worker_progress(t.worker) == 0 {
			break
		}
		worked = true
	}
	t.checkPeers()
	t.mu.Lock()
	list := append(t.scratch[:0], t.inflight...)
	t.mu.Unlock()
	for i, r := range list {
		list[i] = nil
		if !t.check(r) {
			continue
		}
		t.mu.Lock()
		for j, x := range t.inflight {
			if x == r {
				t.inflight = append(t.inflight[:j], t.inflight[j+1:]...)
				break
			}
		}
		t.mu.Unlock()
		t.finish(r)
		worked = true
	}
	t.scratch = list[:0]
	return worked
}

// checkPeers fails the peers UCX reported broken.
func (t *Transport) checkPeers() {
	for q := range t.eps {
		if t.eps[q] == nil || C.moex_ep_failed(t.state(q)) == 0 {
			continue
		}
		t.mu.Lock()
		known := t.dead[q] != nil
		t.mu.Unlock()
		if known {
			continue
		}
		t.markDead(q, fmt.Errorf("%w: %v", transport.ErrPeerClosed, statusErr(C.ucs_status_t(t.state(q).status))))
	}
}

// kick wakes the progress goroutine out of its event wait.
func (t *Transport) kick() {
	if t.closed.Load() {
		return
	}
	C.ucp_worker_signal(t.worker)
}

func (t *Transport) progress() {
	defer t.wg.Done()
	for {
		select {
		case <-t.stop:
			return
		default:
		}
		t.checkProcesses()
		// Progress while there is work, then sleep on the worker's event descriptor. The
		// spinning is the waiting goroutines' (under the adaptive policy): this goroutine
		// taking a spinner slot would make them park, and a wake-up through UCX's events
		// costs tens of microseconds.
		any := false
		for {
			t.drv.Mu.Lock()
			worked := t.step()
			t.drv.Mu.Unlock()
			if worked && t.winWaiters.Load() > 0 {
				t.ringWindows()
			}
			if !worked || t.closed.Load() {
				break
			}
			any = true
		}
		if t.efd >= 0 {
			t.drv.Mu.Lock()
			st := C.ucp_worker_arm(t.worker)
			t.drv.Mu.Unlock()
			// Busy is events to progress first. UCX also says busy with nothing to
			// progress (seen with the one-sided windows over UCX_TLS=sm, where looping
			// at once took the CPUs from the ranks: 36 ms an exchange of 4 ranks, 1.9
			// ms with this back-off): then sleep as below.
			if st == C.UCS_ERR_BUSY && any {
				continue
			}
			if st == C.UCS_OK {
				t.sleepOnEvents(5 * time.Millisecond)
				continue
			}
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// sleepOnEvents waits until the worker's event descriptor is readable, or d. It waits
// in Go's network poller (through a duplicate of the descriptor) rather than in a
// blocking poll(2): the wake-up then is the scheduler's, as for a socket, without an OS
// thread parked in the kernel.
func (t *Transport) sleepOnEvents(d time.Duration) {
	if t.efile == nil {
		fds := []unix.PollFd{{Fd: int32(t.efd), Events: unix.POLLIN}}
		_, _ = unix.Poll(fds, int(d/time.Millisecond))
		return
	}
	_ = t.efile.SetReadDeadline(time.Now().Add(d))
	t.eFirst = true
	_ = t.econn.Read(t.eReady)
}

// efdReady is econn.Read's callback: the first call asks to wait for readability.
func (t *Transport) efdReady(uintptr) bool {
	if t.eFirst {
		t.eFirst = false
		return false
	}
	return true
}

// markDead fails peer q: its pending receives are cancelled (they complete with a
// PeerError), later operations with it fail at once.
func (t *Transport) markDead(q int, err error) {
	t.mu.Lock()
	if t.dead[q] != nil {
		t.mu.Unlock()
		return
	}
	t.dead[q] = err
	list := append([]*req(nil), t.inflight...)
	t.mu.Unlock()
	if errors.Is(err, transport.ErrPeerLeft) { // its Close: every rank logs this at a clean end
		t.log.Debug("moex ucx: peer left", "rank", t.rank, "peer", q)
	} else {
		t.log.Info("moex ucx: peer failed", "rank", t.rank, "peer", q, "err", err)
	}
	perr := &transport.PeerError{Rank: q, Op: "send", Err: err}
	for _, r := range list {
		if r.peer != q {
			continue
		}
		switch r.kind {
		case kRecv:
			for _, p := range r.ucp {
				if p != nil {
					C.ucp_request_cancel(t.worker, p)
				}
			}
		case kSend, kPut, kGet, kAdd:
			// UCX may never complete a send to a peer that is gone (no error handling on
			// these transports): complete it ourselves; the request is recycled when UCX
			// lets go of it, or at Close.
			t.mu.Lock()
			take := !r.early && !r.waiterGone && !r.Test()
			if take {
				r.early = true
			}
			t.mu.Unlock()
			if take {
				r.Complete(0, perr)
			}
		}
	}
}

func (t *Transport) failPeer(q int, err error) {
	t.mu.Lock()
	if t.dead[q] == nil {
		t.dead[q] = err
	}
	list := append([]*req(nil), t.inflight...)
	t.mu.Unlock()
	t.drv.Mu.Lock()
	for _, r := range list {
		if r.peer == q {
			for _, p := range r.ucp {
				if p != nil {
					C.ucp_request_cancel(t.worker, p)
				}
			}
		}
	}
	t.drv.Mu.Unlock()
}

// flushAll flushes every endpoint, driving progress until they complete or ctx ends.
func (t *Transport) flushAll(ctx context.Context) error {
	var reqs []unsafe.Pointer
	for q, ep := range t.eps {
		if ep == nil {
			continue
		}
		var r unsafe.Pointer
		if s := C.moex_ep_flush(ep, &r); s != C.UCS_OK && s != C.UCS_INPROGRESS {
			return fmt.Errorf("ucx: connecting to rank %d: %w", q, statusErr(s))
		}
		if r != nil {
			reqs = append(reqs, r)
		}
	}
	var err error
	for i := 0; len(reqs) > 0; i++ {
		C.ucp_worker_progress(t.worker)
		for j := 0; j < len(reqs); j++ {
			if s := C.ucp_request_check_status(reqs[j]); s != C.UCS_INPROGRESS {
				if s != C.UCS_OK && err == nil {
					err = fmt.Errorf("ucx: connecting: %w", statusErr(s))
				}
				C.ucp_request_free(reqs[j])
				reqs[j] = reqs[len(reqs)-1]
				reqs = reqs[:len(reqs)-1]
				j--
			}
		}
		if i&1023 == 1023 {
			if ctx.Err() != nil {
				for _, r := range reqs {
					C.ucp_request_cancel(t.worker, r)
					for C.ucp_request_check_status(r) == C.UCS_INPROGRESS {
						C.ucp_worker_progress(t.worker)
					}
					C.ucp_request_free(r)
				}
				return fmt.Errorf("ucx: connecting: %w", ctx.Err())
			}
			runtime.Gosched()
		}
	}
	return err
}

// ---- liveness of peers UCX cannot watch ----

// identLen is the size of the identity that prefixes each worker address.
const identLen = 12

// identity is this process's pid and a hash of its host identity.
func identity() []byte {
	b := make([]byte, identLen)
	binary.LittleEndian.PutUint32(b, uint32(os.Getpid()))
	h := fnv.New64a()
	h.Write([]byte(transport.HostID()))
	binary.LittleEndian.PutUint64(b[4:], h.Sum64())
	return b
}

// watchProcesses opens a pidfd for every peer that UCX cannot report failed (shared-
// memory lanes) and that runs on this host, so that a peer process that dies fails the
// operations with it at once instead of at the communicator's deadline.
func (t *Transport) watchProcesses(addrs [][]byte) {
	me := identity()
	for q, a := range addrs {
		if q == t.rank || !t.noErr[q] || t.eps[q] == nil || len(a) < identLen {
			continue
		}
		if binary.LittleEndian.Uint64(a[4:identLen]) != binary.LittleEndian.Uint64(me[4:]) {
			continue // another host: the pid means nothing here
		}
		if fd, err := unix.PidfdOpen(int(binary.LittleEndian.Uint32(a)), 0); err == nil {
			t.pidfds[q] = fd
			t.watched[q] = true
		}
	}
}

// checkProcesses fails the peers whose process exited (at most every 20ms).
func (t *Transport) checkProcesses() {
	now := time.Now()
	if now.Before(t.nextWatch) {
		return
	}
	t.nextWatch = now.Add(20 * time.Millisecond)
	for q, fd := range t.pidfds {
		if fd < 0 {
			continue
		}
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if n, _ := unix.Poll(fds, 0); n > 0 {
			t.drv.Mu.Lock()
			t.markDead(q, fmt.Errorf("%w: process exited", transport.ErrPeerClosed))
			t.drv.Mu.Unlock()
			unix.Close(fd)
			t.pidfds[q] = -1
		}
	}
}

func (t *Transport) closePidfds() {
	for q, fd := range t.pidfds {
		if fd >= 0 {
			unix.Close(fd)
			t.pidfds[q] = -1
		}
	}
}

// ---- shutdown ----
