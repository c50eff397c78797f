//go:build ucx

package ucx

/*
#cgo pkg-config: ucx
#include "ucx.h"
*/
import "C"

import (
	"time"
	"unsafe"

	"github.com/moex-ai/moex/transport"
)

// Leaving: the goodbyes, Close, Kill and the teardown.

func (t *Transport) postBye(q int) {
	r := t.getReq()
	r.kind, r.peer, r.tag, r.n = kBye, q, byeTag, 0
	r.utag = utag(q, byeTag)
	r.stage = 1
	C.moex_set_iov(r.op, 0, unsafe.Pointer(&r.op.hdr), C.size_t(hdrSize))
	C.moex_set_iov(r.op, 1, nil, 0)
	var st C.ucs_status_t
	if C.moex_recv(t.worker, unsafe.Pointer(&r.op.iov[0]), 2, 1, C.uint64_t(r.utag), -1, nil, &r.ucp[0], &st) == 2 {
		r.ucp[0] = nil
		t.putReq(r)
		return
	}
	t.track(r)
}

// sayBye tells every peer this rank is leaving (small eager messages, flushed by the
// endpoint close that follows).
func (t *Transport) sayBye() {
	for q, ep := range t.eps {
		t.mu.Lock()
		gone := t.dead[q] != nil
		t.mu.Unlock()
		if ep == nil || gone {
			// A peer that said goodbye (or failed) may have unmapped the memory UCX would
			// touch to reach it.
			continue
		}
		r := t.getReq()
		r.kind, r.peer, r.tag = kSend, q, byeTag
		r.fillHdr(0, 0)
		C.moex_set_iov(r.op, 0, unsafe.Pointer(&r.op.hdr), C.size_t(hdrSize))
		C.moex_set_iov(r.op, 1, nil, 0)
		var st C.ucs_status_t
		k := C.moex_send(ep, unsafe.Pointer(&r.op.iov[0]), 2, 1, C.uint64_t(utag(t.rank, byeTag)), -1, nil, &r.ucp[0], &st)
		if k == 1 {
			r.waiterGone = true // nobody waits for a goodbye
			t.track(r)
		} else {
			r.ucp[0] = nil
			t.putReq(r)
		}
	}
}

// ---- progress ----

// Close cancels what is pending, closes the endpoints (flushing them, briefly) and
// releases the worker and the context.
func (t *Transport) Close() error {
	if t.closed.Swap(true) {
		return nil
	}
	close(t.stop)
	C.ucp_worker_signal(t.worker)
	t.wg.Wait()
	t.shutdown(false)
	return t.self.Close()
}

// Kill closes everything without flushing, as a crash would (for tests).
func (t *Transport) Kill() {
	if t.closed.Swap(true) {
		return
	}
	close(t.stop)
	C.ucp_worker_signal(t.worker)
	t.wg.Wait()
	t.shutdown(true)
	_ = t.self.Close()
}

func (t *Transport) shutdown(force bool) {
	t.drv.Mu.Lock()
	defer t.drv.Mu.Unlock()
	if !force {
		t.sayBye()
		for i := 0; i < 1000 && C.ucp_worker_progress(t.worker) > 0; i++ {
		}
	}
	// Cancel the receives; sends (the goodbyes among them) are flushed by the endpoint
	// close below, or purged by it when forced.
	t.mu.Lock()
	list := append([]*req(nil), t.inflight...)
	t.mu.Unlock()
	for _, r := range list {
		if !r.kind.tagRecv() {
			continue // sends and one-sided operations: flushed or purged below
		}
		for _, p := range r.ucp {
			if p != nil {
				C.ucp_request_cancel(t.worker, p)
			}
		}
	}
	deadline := time.Now().Add(100 * time.Millisecond)
	for {
		t.step()
		t.mu.Lock()
		left := len(t.inflight)
		t.mu.Unlock()
		if left == 0 || time.Now().After(deadline) {
			break
		}
	}
	t.mu.Lock()
	stuck := len(t.inflight) > 0
	for _, r := range t.inflight {
		if !r.Test() {
			r.Complete(0, transport.ErrClosed)
		}
	}
	t.mu.Unlock()
	t.closeWindows() // their keys belong to the endpoints closed below
	f := C.int(0)
	if force || stuck {
		f = 1 // purge what UCX still holds on the endpoints
	}
	for q, ep := range t.eps {
		if ep != nil {
			fq := f
			t.mu.Lock()
			if t.dead[q] != nil {
				fq = 1 // nothing to flush to a peer that is gone
			}
			t.mu.Unlock()
			C.moex_ep_close(t.worker, ep, fq, 100000)
			t.eps[q] = nil
		}
	}
	// The purge completed what was left: release those requests.
	t.mu.Lock()
	left := t.inflight
	t.inflight = nil
	t.mu.Unlock()
	for _, r := range left {
		C.moex_set_iov(r.op, 1, nil, 0)
		r.pin.Unpin()
		for i, p := range r.ucp {
			if p != nil {
				for j := 0; j < 100000 && C.ucp_request_check_status(p) == C.UCS_INPROGRESS; j++ {
					C.ucp_worker_progress(t.worker)
				}
				C.ucp_request_free(p)
				r.ucp[i] = nil
			}
		}
	}
	t.reg.Close()
	t.destroy()
}

func (t *Transport) destroy() {
	t.closePidfds()
	if t.efile != nil {
		t.efile.Close()
		t.efile = nil
	}
	t.freeReqs.Drain(func(r *req) { C.free(unsafe.Pointer(r.op)) })
	if t.worker != nil {
		C.ucp_worker_destroy(t.worker)
		t.worker = nil
	}
	t.buryWindows()
	if t.ctx != nil {
		C.ucp_cleanup(t.ctx)
		t.ctx = nil
	}
	if t.states != nil {
		C.free(unsafe.Pointer(t.states))
		t.states = nil
	}
	if t.lenBuf != nil {
		C.free(unsafe.Pointer(t.lenBuf))
		t.lenBuf = nil
	}
}
