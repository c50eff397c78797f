//go:build ucx

package ucx

/*
#cgo pkg-config: ucx
#include "ucx.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/internal/core"
)

// Requests: the sends and receives posted to UCX, their completion and cancellation.

type reqKind uint8

type req struct {
	core.Req
	t     *Transport
	kind  reqKind
	peer  int
	tag   transport.Tag
	utag  uint64
	buf   []byte
	dev   uintptr // device pointer (DeviceTransport)
	mt    int     // UCX memory type, -1: not given
	op    *C.moex_op
	pin   runtime.Pinner
	ucp   [2]unsafe.Pointer // pending UCX requests (header or whole message; payload)
	stage int               // recv: 1 header/small posted, 2 payload posted
	n     int
	err   error
	sink  unsafe.Pointer // C buffer of a sink receive
	// A request can part from its waiter before UCX is done with it: completed early
	// (its peer died), or given up by its waiter (a send UCX could not cancel). Whichever
	// of the waiter and UCX lets go last recycles it (under t.mu).
	early      bool // completed before UCX finished with it
	waiterGone bool // its waiter returned
}

func (t *Transport) getReq() *req {
	r, ok := t.freeReqs.Get()
	if !ok {
		r = &req{t: t, op: (*C.moex_op)(C.calloc(1, C.size_t(unsafe.Sizeof(C.moex_op{}))))}
		r.Init()
	}
	return r
}

func (t *Transport) putReq(r *req) {
	C.moex_set_iov(r.op, 1, nil, 0)
	r.pin.Unpin()
	if r.sink != nil {
		C.free(r.sink)
		r.sink = nil
	}
	r.Reset()
	r.buf, r.dev, r.ucp, r.stage, r.n, r.err, r.mt = nil, 0, [2]unsafe.Pointer{}, 0, 0, nil, -1
	r.early, r.waiterGone = false, false
	t.freeReqs.Put(r)
}

// utag is the 64-bit UCX tag: a hash of everything that is matched (the signature is
// checked, not matched), with the top bit kept for separate payloads.
func utag(src int, tg transport.Tag) uint64 {
	h := uint64(14695981039346656037)
	for _, v := range [4]uint32{uint32(src), tg.Comm, tg.Seq, tg.Tag} {
		for i := 0; i < 4; i++ {
			h ^= uint64(byte(v >> (8 * i)))
			h *= 1099511628211
		}
	}
	return h &^ payloadBit
}

func (t *Transport) peerCheck(peer int) error {
	if err := transport.CheckPeer(peer, t.size); err != nil {
		return err
	}
	if t.closed.Load() {
		return transport.ErrClosed
	}
	if peer != t.rank && !t.peers[peer] {
		return &transport.ArgError{Arg: "peer", Reason: fmt.Sprintf("rank %d is not served by ucx", peer)}
	}
	return nil
}

func (t *Transport) deadErr(peer int, op string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.dead[peer] == nil {
		return nil
	}
	return &transport.PeerError{Rank: peer, Op: op, Err: t.dead[peer]}
}

func (t *Transport) track(r *req) {
	t.mu.Lock()
	t.inflight = append(t.inflight, r)
	t.mu.Unlock()
}

func (r *req) fillHdr(flags uint32, n int) {
	h := &r.op.hdr
	h.comm, h.seq, h.tag, h.sig = C.uint32_t(r.tag.Comm), C.uint32_t(r.tag.Seq), C.uint32_t(r.tag.Tag), C.uint32_t(r.tag.Sig)
	h.src, h.flags, h.len = C.uint32_t(r.t.rank), C.uint32_t(flags), C.uint64_t(n)
}

// Isend implements transport.Transport.
func (t *Transport) Isend(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	return t.send(peer, tag, buf, 0, len(buf), -1)
}

// IsendDevice implements transport.DeviceTransport: ptr is device memory of type mt.
func (t *Transport) IsendDevice(peer int, tag transport.Tag, ptr uintptr, n int, mt transport.MemType) (transport.Request, error) {
	if err := t.checkDevice(ptr, n, mt); err != nil {
		return nil, err
	}
	return t.send(peer, tag, nil, ptr, n, ucsMemType(mt))
}

// MemTypes reports the memory types this UCX moves (host always; CUDA and ROCm only when
// UCX was built with them and finds the driver).
func (t *Transport) MemTypes() []transport.MemType {
	var out []transport.MemType
	for _, mt := range []transport.MemType{transport.MemHost, transport.MemCUDA, transport.MemCUDAManaged, transport.MemROCm} {
		if t.memTypes&(1<<uint(ucsMemType(mt))) != 0 {
			out = append(out, mt)
		}
	}
	return out
}

func (t *Transport) checkDevice(ptr uintptr, n int, mt transport.MemType) error {
	switch {
	case n < 0:
		return &transport.ArgError{Arg: "n", Reason: fmt.Sprintf("negative length %d", n)}
	case ptr == 0 && n > 0:
		return &transport.ArgError{Arg: "ptr", Reason: "nil device pointer"}
	case mt < transport.MemHost || mt > transport.MemROCm:
		return &transport.ArgError{Arg: "mt", Reason: fmt.Sprintf("unknown memory type %v", mt)}
	case t.memTypes&(1<<uint(ucsMemType(mt))) == 0:
		return &transport.ArgError{Arg: "mt", Reason: fmt.Sprintf("this UCX (%s) does not move %v memory (build UCX with --with-cuda or --with-rocm; see the README)", Version(), mt)}
	}
	return nil
}

func ucsMemType(mt transport.MemType) int {
	switch mt {
	case transport.MemCUDA:
		return int(C.UCS_MEMORY_TYPE_CUDA)
	case transport.MemCUDAManaged:
		return int(C.UCS_MEMORY_TYPE_CUDA_MANAGED)
	case transport.MemROCm:
		return int(C.UCS_MEMORY_TYPE_ROCM)
	}
	return int(C.UCS_MEMORY_TYPE_HOST)
}

func (t *Transport) send(peer int, tag transport.Tag, buf []byte, dev uintptr, n, mt int) (transport.Request, error) {
	if err := t.peerCheck(peer); err != nil {
		return nil, err
	}
	if peer == t.rank && dev == 0 {
		return t.self.Isend(0, tag, buf)
	}
	t.tagSends.Add(1)
	t.bytesOut.Add(uint64(n))
	r := t.getReq()
	r.kind, r.peer, r.tag, r.buf, r.dev, r.mt = kSend, peer, tag, buf, dev, mt
	if err := t.deadErr(peer, "send"); err != nil {
		r.Complete(0, err)
		return r, nil
	}
	r.utag = utag(t.rank, tag)
	r.n = n
	ep := t.eps[peer]
	var st C.ucs_status_t
	if dev == 0 && n <= smallMax {
		r.fillHdr(0, n)
		C.moex_set_iov(r.op, 0, unsafe.Pointer(&r.op.hdr), C.size_t(hdrSize))
		C.moex_set_iov(r.op, 1, nil, C.size_t(n))
		if n > 0 {
			r.pin.Pin(unsafe.SliceData(buf))
			C.moex_set_iov(r.op, 1, unsafe.Pointer(unsafe.SliceData(buf)), C.size_t(n))
		}
		k := C.moex_send(ep, unsafe.Pointer(&r.op.iov[0]), 2, 1, C.uint64_t(r.utag), -1, nil, &r.ucp[0], &st)
		return t.started(r, k, st, 0)
	}
	// Header, then the payload contiguous on its own tag.
	r.fillHdr(flagSeparate, n)
	k := C.moex_send(ep, unsafe.Pointer(&r.op.hdr), C.size_t(hdrSize), 0, C.uint64_t(r.utag), -1, nil, &r.ucp[0], &st)
	if k == 2 {
		r.ucp[0] = nil
		r.Complete(0, t.opErr(r, st))
		return r, nil
	}
	var p unsafe.Pointer
	var memh C.ucp_mem_h
	if dev != 0 {
		p = C.moex_devptr(C.uintptr_t(dev))
	} else {
		r.pin.Pin(unsafe.SliceData(buf))
		p = unsafe.Pointer(unsafe.SliceData(buf))
		memh = t.memh(buf)
	}
	k2 := C.moex_send(ep, p, C.size_t(n), 0, C.uint64_t(r.utag|payloadBit), C.int(mt), memh, &r.ucp[1], &st)
	if k == 0 {
		r.ucp[0] = nil
	}
	return t.started(r, k2, st, 1)
}

// started records what posting a UCX operation gave: done at once, pending, or an error.
func (t *Transport) started(r *req, kind C.int, st C.ucs_status_t, slot int) (transport.Request, error) {
	switch kind {
	case 0:
		r.ucp[slot] = nil
		if r.ucp[0] == nil && r.ucp[1] == nil {
			C.moex_set_iov(r.op, 1, nil, 0)
			r.pin.Unpin()
			r.Complete(r.n, nil)
			return r, nil
		}
	case 2:
		r.ucp[slot] = nil
		err := t.opErr(r, st)
		if r.ucp[0] == nil && r.ucp[1] == nil {
			C.moex_set_iov(r.op, 1, nil, 0)
			r.pin.Unpin()
			r.Complete(0, err)
			return r, nil
		}
		r.err = err
	}
	t.track(r)
	return r, nil
}

func (r *req) op2() string {
	switch r.kind {
	case kSend:
		return "send"
	case kPut:
		return "put"
	case kGet:
		return "get"
	case kAdd:
		return "signal"
	}
	return "recv"
}

// Irecv implements transport.Transport.
func (t *Transport) Irecv(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	return t.recv(peer, tag, buf, 0, len(buf), -1)
}

// IrecvDevice implements transport.DeviceTransport.
func (t *Transport) IrecvDevice(peer int, tag transport.Tag, ptr uintptr, n int, mt transport.MemType) (transport.Request, error) {
	if err := t.checkDevice(ptr, n, mt); err != nil {
		return nil, err
	}
	return t.recv(peer, tag, nil, ptr, n, ucsMemType(mt))
}

func (t *Transport) recv(peer int, tag transport.Tag, buf []byte, dev uintptr, n, mt int) (transport.Request, error) {
	if err := t.peerCheck(peer); err != nil {
		return nil, err
	}
	if peer == t.rank && dev == 0 {
		return t.self.Irecv(0, tag, buf)
	}
	t.tagRecvs.Add(1)
	r := t.getReq()
	r.kind, r.peer, r.tag, r.buf, r.dev, r.mt, r.n = kRecv, peer, tag, buf, dev, mt, n
	if err := t.deadErr(peer, "recv"); err != nil {
		r.Complete(0, err)
		return r, nil
	}
	r.utag = utag(peer, tag)
	r.stage = 1
	C.moex_set_iov(r.op, 0, unsafe.Pointer(&r.op.hdr), C.size_t(hdrSize))
	C.moex_set_iov(r.op, 1, nil, 0)
	if dev == 0 && len(buf) > 0 {
		r.pin.Pin(unsafe.SliceData(buf))
		C.moex_set_iov(r.op, 1, unsafe.Pointer(unsafe.SliceData(buf)), C.size_t(min(len(buf), smallMax)))
	}
	var st C.ucs_status_t
	k := C.moex_recv(t.worker, unsafe.Pointer(&r.op.iov[0]), 2, 1, C.uint64_t(r.utag), -1, nil, &r.ucp[0], &st)
	if k == 2 {
		r.ucp[0] = nil
		r.Complete(0, t.opErr(r, st))
		return r, nil
	}
	t.track(r)
	return r, nil
}

// check advances r if its UCX operations completed; it reports whether r is finished
// (then the caller takes it out of the in-flight list and calls finish).
func (t *Transport) check(r *req) bool {
	for i, p := range r.ucp {
		if p == nil {
			continue
		}
		var st C.ucs_status_t
		var length C.size_t
		if r.kind.tagRecv() {
			// t.lenBuf is C memory: a Go variable's address given to C would escape, one
			// allocation per look.
			st = C.moex_recv_test(p, t.lenBuf)
			length = *t.lenBuf
		} else {
			st = C.ucp_request_check_status(p)
		}
		if st == C.UCS_INPROGRESS {
			return false
		}
		C.ucp_request_free(p)
		r.ucp[i] = nil
		if r.kind.tagRecv() && i == 0 && st == C.UCS_OK {
			t.gotHeader(r, int(length))
			if r.ucp[1] != nil {
				return false
			}
			continue
		}
		if r.kind.tagRecv() && i == 1 && st == C.UCS_OK && r.sink == nil && int(length) != r.n && r.err == nil {
			r.err = &transport.PeerError{Rank: r.peer, Op: "recv", Err: fmt.Errorf("%w: payload of %d bytes, header said %d", transport.ErrProtocol, length, r.n)}
		}
		if st != C.UCS_OK && r.err == nil {
			r.err = t.opErr(r, st)
		}
	}
	return r.ucp[0] == nil && r.ucp[1] == nil
}

// finish completes a finished request (it is out of the in-flight list already, so that
// its waiter may recycle it at once).
func (t *Transport) finish(r *req) {
	C.moex_set_iov(r.op, 1, nil, 0) // UCX is done with the buffer: unpin now
	r.pin.Unpin()
	t.mu.Lock()
	early, gone := r.early, r.waiterGone
	t.mu.Unlock()
	switch {
	case r.kind == kBye:
		if r.err == nil && !t.closed.Load() {
			t.markDead(r.peer, transport.ErrPeerLeft)
		}
		t.putReq(r)
	case gone:
		t.putReq(r) // the waiter left first
	case early:
		// Answered already; its waiter recycles it when it returns.
		t.mu.Lock()
		r.ucp = [2]unsafe.Pointer{}
		gone = r.waiterGone
		r.early = false // UCX done: the waiter may recycle
		t.mu.Unlock()
		if gone {
			t.putReq(r)
		}
	case r.err != nil:
		r.Complete(0, r.err)
	default:
		r.Complete(r.n, nil)
	}
}

func (t *Transport) opErr(r *req, st C.ucs_status_t) error {
	if t.closed.Load() {
		return transport.ErrClosed
	}
	var kind error = statusErr(st)
	switch st {
	case C.UCS_ERR_MESSAGE_TRUNCATED:
		kind = fmt.Errorf("%w: %v", transport.ErrTruncated, statusErr(st))
	case C.UCS_ERR_CANCELED:
		if d := t.deadErr(r.peer, r.op2()); d != nil {
			return d
		}
		kind = transport.ErrCanceled
	}
	return &transport.PeerError{Rank: r.peer, Op: r.op2(), Err: kind}
}

// gotHeader handles the completion of a receive's first UCX message.
func (t *Transport) gotHeader(r *req, length int) {
	if length < hdrSize {
		r.err = &transport.PeerError{Rank: r.peer, Op: "recv", Err: fmt.Errorf("%w: %d-byte message without a header", transport.ErrProtocol, length)}
		return
	}
	h := r.op.hdr
	switch {
	case uint32(h.comm) != r.tag.Comm || uint32(h.seq) != r.tag.Seq || uint32(h.tag) != r.tag.Tag || int(h.src) != r.peer:
		r.err = &transport.PeerError{Rank: r.peer, Op: "recv", Err: fmt.Errorf("%w: header says comm=%d seq=%d tag=%d from %d (tag hash collision)",
			transport.ErrProtocol, h.comm, h.seq, h.tag, h.src)}
	case uint32(h.sig) != r.tag.Sig:
		got := r.tag
		got.Sig = uint32(h.sig)
		r.err = core.SignatureError(r.peer, got, r.tag.Sig)
	}
	if h.flags&flagSeparate == 0 {
		if r.err == nil {
			r.n = length - hdrSize
		}
		return
	}
	n := int(h.len)
	if r.err == nil && n > r.n {
		r.err = core.TruncatedError(r.peer, n, r.n)
	}
	var st C.ucs_status_t
	var k C.int
	if r.err != nil {
		// Take the payload anyway, into a sink, so that it does not linger in UCX.
		r.sink = C.malloc(C.size_t(max(n, 1)))
		k = C.moex_recv(t.worker, r.sink, C.size_t(n), 0, C.uint64_t(r.utag|payloadBit), -1, nil, &r.ucp[1], &st)
	} else {
		r.n = n
		var p unsafe.Pointer
		var memh C.ucp_mem_h
		if r.dev != 0 {
			p = C.moex_devptr(C.uintptr_t(r.dev))
		} else if n > 0 {
			p = unsafe.Pointer(unsafe.SliceData(r.buf))
			memh = t.memh(r.buf[:n])
		}
		k = C.moex_recv(t.worker, p, C.size_t(n), 0, C.uint64_t(r.utag|payloadBit), C.int(r.mt), memh, &r.ucp[1], &st)
	}
	r.stage = 2
	switch k {
	case 0:
		r.ucp[1] = nil
	case 2:
		r.ucp[1] = nil
		if r.err == nil {
			r.err = t.opErr(r, st)
		}
	}
}

// Wait implements transport.Request.
func (r *req) Wait(ctx context.Context) (int, error) {
	t := r.t
	if err := t.drv.Await(ctx, &r.Req); err != nil {
		if !r.cancel() {
			ctx2, cancel := context.WithTimeout(context.Background(), t.grace)
			werr := t.drv.Await(ctx2, &r.Req)
			cancel()
			if werr != nil {
				// The transfer is stuck: declare the peer dead, which completes it.
				t.failPeer(r.peer, fmt.Errorf("%w: a cancelled transfer did not finish within %v", transport.ErrTimeout, t.grace))
				ctx3, cancel3 := context.WithTimeout(context.Background(), t.grace)
				werr = t.drv.Await(ctx3, &r.Req)
				cancel3()
				if werr != nil {
					// UCX will not let go of it: abandon the request (leaked, pinned).
					t.abandon(r)
					return 0, transport.CtxError(err)
				}
			}
			n, e := r.Result()
			if e != nil && errors.Is(e, transport.ErrCanceled) {
				e = transport.CtxError(err)
			}
			t.release(r)
			return n, e
		}
		ctx2, cancel := context.WithTimeout(context.Background(), t.grace)
		werr := t.drv.Await(ctx2, &r.Req) // UCX confirms the cancellation
		cancel()
		if werr != nil {
			// UCX cannot cancel this one (a rendezvous send already announced): leave it
			// to UCX, which completes it if a receiver ever matches it.
			t.abandon(r)
			return 0, transport.CtxError(err)
		}
		n, e := r.Result()
		if e != nil {
			e = transport.CtxError(err)
		}
		t.release(r)
		return n, e
	}
	n, err := r.Result()
	t.release(r)
	return n, err
}

// release is the waiter letting go of r: recycled now, unless UCX still holds it (then
// finish recycles it).
func (t *Transport) release(r *req) {
	t.mu.Lock()
	ucxHolds := r.early
	if ucxHolds {
		r.waiterGone = true
	}
	t.mu.Unlock()
	if !ucxHolds {
		t.putReq(r)
	}
}

// cancel asks UCX to cancel a receive that has not started receiving its payload, or a
// send whose payload no receiver has matched; it reports whether it asked.
func (r *req) cancel() bool {
	t := r.t
	t.drv.Mu.Lock()
	defer t.drv.Mu.Unlock()
	if r.Test() {
		return false
	}
	switch {
	case r.kind == kRecv && r.stage == 1 && r.ucp[0] != nil:
		C.ucp_request_cancel(t.worker, r.ucp[0])
		return true
	case r.kind == kSend && r.ucp[1] != nil:
		C.ucp_request_cancel(t.worker, r.ucp[1])
		return true
	}
	return false
}

// abandon stops waiting for a request UCX will not complete now; it stays in flight (its
// buffer pinned) until UCX completes it or Close purges it, and is then recycled.
func (t *Transport) abandon(r *req) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r.waiterGone = true
}
