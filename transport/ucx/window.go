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
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
)

// One-sided windows: memory registered once with UCX (ucp_mem_map), its remote key
// handed to every peer once (the descriptor), and then written with ucp_put_nbx, read
// with ucp_get_nbx and signalled with an atomic add that the owner polls in its own
// memory. No tag is matched on the way: where a NIC does RDMA, the owner's CPU takes no
// part; where a transport lacks RMA (tcp), UCX emulates it over active messages.

var _ transport.RMATransport = (*Transport)(nil)
var _ transport.RMAWindow = (*rmaWindow)(nil)

// descriptor: the window's address and size, then its packed remote key.
const winDescHdr = 16

// rmaWindow is one rank's window and its remote keys for the peers' windows.
type rmaWindow struct {
	t    *Transport
	mem  []byte // the whole mapping (page-rounded)
	size int
	memh C.ucp_mem_h
	// owned: UCX allocated mem (UCP_MEM_MAP_ALLOCATE), and ucp_mem_unmap frees it;
	// else it is buf's, registered.
	owned  bool
	buf    *obuf.Buf
	rkeys  []C.ucp_rkey_h // per peer, nil unless mapped
	raddr  []uint64
	rsize  []int
	closed atomic.Bool
}

// NewWindow implements transport.WindowTransport: a window whose peers are reached by
// Put, Get and Signal (transport.RMAWindow), not mapped (Remote is nil).
func (t *Transport) NewWindow(size int) (transport.Window, []byte, error) {
	if err := transport.CheckNewWindow(size, t.closed.Load()); err != nil {
		return nil, nil, err
	}
	w := &rmaWindow{t: t, size: size, rkeys: make([]C.ucp_rkey_h, t.size), raddr: make([]uint64, t.size), rsize: make([]int, t.size)}
	if err := w.allocate(); err != nil {
		return nil, nil, err
	}
	mem := w.mem
	var kbuf unsafe.Pointer
	var klen C.size_t
	if s := C.moex_rkey_pack(t.ctx, w.memh, &kbuf, &klen); s != C.UCS_OK {
		w.release()
		return nil, nil, fmt.Errorf("ucx: packing a window's remote key: %w", statusErr(s))
	}
	desc := make([]byte, winDescHdr+int(klen))
	binary.LittleEndian.PutUint64(desc, uint64(uintptr(unsafe.Pointer(unsafe.SliceData(mem)))))
	binary.LittleEndian.PutUint64(desc[8:], uint64(size))
	copy(desc[winDescHdr:], unsafe.Slice((*byte)(kbuf), int(klen)))
	C.ucp_rkey_buffer_release(kbuf)
	t.winMu.Lock()
	t.windows[w] = struct{}{}
	t.winMu.Unlock()
	return w, desc, nil
}

// allocate gets w's memory: from UCX where it can (UCP_MEM_MAP_ALLOCATE: shared memory
// that its shared-memory transports write with plain stores, where memory of the
// process's own is reached only by emulated puts), else mapped here (mapWindow) and
// registered. Either way it is registered once, for the window's life.
func (w *rmaWindow) allocate() error {
	t := w.t
	n := max(w.size, 1)
	var addr unsafe.Pointer
	var got C.size_t
	if s := C.moex_mem_alloc(t.ctx, C.size_t(n), &w.memh, &addr, &got); s == C.UCS_OK && int(got) >= n {
		w.mem, w.owned = unsafe.Slice((*byte)(addr), int(got)), true
		clear(w.mem[:w.size]) // windows start zeroed
		t.memHandles.Add(1)
		return nil
	} else if s == C.UCS_OK {
		C.ucp_mem_unmap(t.ctx, w.memh)
	}
	// obuf's buffers are page aligned, on huge pages from 256 KiB: a NIC registers them
	// a huge page at a time.
	b := obuf.Default.Get(n)
	mem := b.Bytes()[:n:n]
	clear(mem)
	if s := C.moex_mem_map(t.ctx, unsafe.Pointer(unsafe.SliceData(mem)), C.size_t(n), &w.memh); s != C.UCS_OK {
		b.Release()
		return fmt.Errorf("ucx: registering a window (ucp_mem_map): %w", statusErr(s))
	}
	w.mem, w.buf = mem, b
	t.memHandles.Add(1)
	return nil
}

// NativeRMA reports whether the lanes to peer do RMA and atomics; where they do not,
// UCX emulates them over active messages, and windows reach peer only with
// Config.EmulatedWindows.
func (t *Transport) NativeRMA(peer int) bool { return peer >= 0 && peer < t.size && t.rmaLanes[peer] }

// RMAWindows implements transport.RMATransport.
func (t *Transport) RMAWindows() bool { return true }

// MemHandles is how many memory registrations (ucp_mem_map) this transport holds now:
// windows and registered buffers. A window's is given back when the transport closes
// (a peer may still put into a window closed here), a buffer's when the buffer goes;
// after Close it is 0.
func (t *Transport) MemHandles() int { return int(t.memHandles.Load()) }

func (w *rmaWindow) Local() []byte { return w.mem[:w.size:w.size] }

// Map unpacks peer's remote key from the descriptor its NewWindow returned.
func (w *rmaWindow) Map(peer int, desc []byte) error {
	t := w.t
	switch {
	case peer < 0 || peer >= t.size:
		return &transport.ArgError{Arg: "peer", Reason: fmt.Sprintf("rank %d of %d", peer, t.size)}
	case peer == t.rank:
		return nil
	case !t.peers[peer] || t.eps[peer] == nil:
		return fmt.Errorf("%w: rank %d is not served by ucx", transport.ErrNoWindow, peer)
	case !t.rmaLanes[peer] && !t.emulatedWindows:
		return fmt.Errorf("%w: UCX emulates RMA to rank %d over active messages (no RMA lane), slower than its tag messages (MOEX_WINDOWS=1 uses it all the same)", transport.ErrNoWindow, peer)
	case len(desc) <= winDescHdr || len(desc) > winDescHdr+transport.MaxWindowDesc:
		return fmt.Errorf("%w: rank %d's window descriptor has %d bytes", transport.ErrProtocol, peer, len(desc))
	case w.closed.Load():
		return transport.ErrClosed
	}
	size := binary.LittleEndian.Uint64(desc[8:])
	if size > transport.MaxWindow {
		return fmt.Errorf("%w: rank %d's window descriptor says %d bytes", transport.ErrProtocol, peer, size)
	}
	kb := C.CBytes(desc[winDescHdr:])
	defer C.free(kb)
	var rkey C.ucp_rkey_h
	if s := C.ucp_ep_rkey_unpack(t.eps[peer], kb, &rkey); s != C.UCS_OK {
		return fmt.Errorf("ucx: rank %d's window remote key: %w", peer, statusErr(s))
	}
	if old := w.rkeys[peer]; old != nil {
		C.ucp_rkey_destroy(old)
	}
	w.rkeys[peer], w.raddr[peer], w.rsize[peer] = rkey, binary.LittleEndian.Uint64(desc), int(size)
	return nil
}

// Remote is nil: a UCX window is reached by Put, Get and Signal.
func (w *rmaWindow) Remote(peer int) []byte { return nil }

// Reaches implements transport.RMAWindow.
func (w *rmaWindow) Reaches(peer int) bool {
	return peer >= 0 && peer < len(w.rkeys) && w.rkeys[peer] != nil
}

// Seal implements transport.Window: there is nothing to unlink.
func (w *rmaWindow) Seal() {}

// Notify implements transport.Window: a waiter of a UCX window polls, nothing wakes it.
func (w *rmaWindow) Notify(peer int) {}

// check validates a one-sided operation of n bytes at off of peer's window.
func (w *rmaWindow) check(peer, off, n int) error {
	if err := w.t.peerCheck(peer); err != nil {
		return err
	}
	switch {
	case w.closed.Load():
		return transport.ErrClosed
	case peer == w.t.rank || w.rkeys[peer] == nil:
		return &transport.ArgError{Arg: "peer", Reason: fmt.Sprintf("rank %d's window is not mapped", peer)}
	case off < 0 || n < 0 || off > w.rsize[peer]-n:
		return &transport.ArgError{Arg: "off", Reason: fmt.Sprintf("%d bytes at %d of rank %d's %d-byte window", n, off, peer, w.rsize[peer])}
	}
	return nil
}

// Put implements transport.RMAWindow.
func (w *rmaWindow) Put(peer, off int, src []byte) (transport.Request, error) {
	return w.rma(kPut, peer, off, src)
}

// Get implements transport.RMAWindow.
func (w *rmaWindow) Get(peer, off int, dst []byte) (transport.Request, error) {
	return w.rma(kGet, peer, off, dst)
}

func (w *rmaWindow) rma(kind reqKind, peer, off int, buf []byte) (transport.Request, error) {
	t := w.t
	if err := w.check(peer, off, len(buf)); err != nil {
		return nil, err
	}
	r := t.getReq()
	r.kind, r.peer, r.buf, r.n = kind, peer, buf, len(buf)
	if err := t.deadErr(peer, r.op2()); err != nil {
		r.Complete(0, err)
		return r, nil
	}
	t.rmaOps.Add(1)
	if kind == kPut {
		t.bytesOut.Add(uint64(len(buf)))
	}
	var p unsafe.Pointer
	if len(buf) > 0 {
		r.pin.Pin(unsafe.SliceData(buf))
		p = unsafe.Pointer(unsafe.SliceData(buf))
	}
	raddr := C.uint64_t(w.raddr[peer] + uint64(off))
	var st C.ucs_status_t
	var k C.int
	if kind == kPut {
		k = C.moex_put(t.eps[peer], p, C.size_t(len(buf)), raddr, w.rkeys[peer], t.memh(buf), &r.ucp[0], &st)
	} else {
		k = C.moex_get(t.eps[peer], p, C.size_t(len(buf)), raddr, w.rkeys[peer], t.memh(buf), &r.ucp[0], &st)
	}
	return t.started(r, k, st, 0)
}

// Signal implements transport.RMAWindow: an atomic add, with no reply.
func (w *rmaWindow) Signal(peer, off int, delta uint64) (transport.Request, error) {
	t := w.t
	if err := w.check(peer, off, 8); err != nil {
		return nil, err
	}
	if off%8 != 0 {
		return nil, &transport.ArgError{Arg: "off", Reason: fmt.Sprintf("%d is not 8-byte aligned", off)}
	}
	r := t.getReq()
	r.kind, r.peer = kAdd, peer
	if err := t.deadErr(peer, r.op2()); err != nil {
		r.Complete(0, err)
		return r, nil
	}
	t.rmaOps.Add(1)
	r.op.hdr.len = C.uint64_t(delta) // C memory, which UCX may read until the request ends
	var st C.ucs_status_t
	k := C.moex_add64(t.eps[peer], &r.op.hdr.len, C.uint64_t(w.raddr[peer]+uint64(off)), w.rkeys[peer], &r.ucp[0], &st)
	return t.started(r, k, st, 0)
}

// Fence implements transport.RMAWindow (ucp_worker_fence).
func (w *rmaWindow) Fence() error {
	if w.closed.Load() || w.t.closed.Load() {
		return transport.ErrClosed
	}
	if s := C.ucp_worker_fence(w.t.worker); s != C.UCS_OK {
		return fmt.Errorf("ucx: fence: %w", statusErr(s))
	}
	return nil
}

// Register implements transport.RMAWindow: b is mapped with UCX once, and Puts from it
// or Gets into it name the registration.
func (w *rmaWindow) Register(b *obuf.Buf) error { return w.t.Register(b) }

// Wait polls ready, driving the worker (emulated RMA arrives through it) under the
// transport's busy-poll policy, then parks until the progress goroutine has done some
// work (an emulated put or signal landed) or a short nap ends: a put over native RMA
// wakes nobody. A peer of this window found dead ends the wait with its
// *transport.PeerError.
func (w *rmaWindow) Wait(ctx context.Context, ready func() bool) error {
	if ready() {
		return nil
	}
	t := w.t
	t.winWaiters.Add(1)
	defer t.winWaiters.Add(-1)
	spin := t.poller.BeginProcess()
	defer spin.End()
	var nap *time.Timer
	d := 20 * time.Microsecond
	for i := 0; !ready(); i++ {
		if i&63 == 63 {
			if err := w.failed(ctx); err != nil {
				return err
			}
		}
		if t.drv.TryStep() || !spin.Idle() {
			continue
		}
		if err := w.failed(ctx); err != nil {
			return err
		}
		bell := t.windowBell()
		if ready() {
			break
		}
		if nap == nil {
			nap = time.NewTimer(d)
			defer nap.Stop()
		} else {
			nap.Reset(d)
		}
		select {
		case <-bell:
		case <-nap.C:
			d = min(2*d, maxNap)
		case <-ctx.Done():
		}
	}
	return nil
}

// maxNap is the longest a window's waiter sleeps between looks at its memory.
const maxNap = 200 * time.Microsecond

// windowBell is closed when the progress goroutine next does some work.
func (t *Transport) windowBell() <-chan struct{} {
	t.bellMu.Lock()
	defer t.bellMu.Unlock()
	if t.bell == nil {
		t.bell = make(chan struct{})
	}
	return t.bell
}

// ringWindows wakes the windows' waiters (after progress did some work).
func (t *Transport) ringWindows() {
	t.bellMu.Lock()
	if t.bell != nil {
		close(t.bell)
		t.bell = nil
	}
	t.bellMu.Unlock()
}

// failed is why a wait on w cannot go on: its context ended, the window or transport
// closed, or a peer whose key it holds died.
func (w *rmaWindow) failed(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if w.closed.Load() || w.t.closed.Load() {
		return transport.ErrClosed
	}
	for q, k := range w.rkeys {
		if k != nil {
			if err := w.t.deadErr(q, "window"); err != nil {
				return err
			}
		}
	}
	return nil
}

// Close releases the remote keys, the registration and the memory.
func (w *rmaWindow) Close() error {
	if w.closed.Swap(true) {
		return nil
	}
	t := w.t
	t.winMu.Lock()
	defer t.winMu.Unlock()
	_, live := t.windows[w]
	delete(t.windows, w)
	switch {
	case !live && w.owned:
		return nil // the transport's Close freed it with its registration
	case !live:
		w.buf.Release() // the worker is gone: nothing writes here any more
		return nil
	}
	// A peer that has not yet seen this rank leave the exchange (one aborting after a
	// rank died, say) may still put into the window, and this process's worker (or the
	// peer, through shared memory) writes what arrives: the memory stays, registered,
	// until the transport closes (its pages given back where they are this process's).
	w.releaseKeys()
	t.graves = append(t.graves, grave{memh: w.memh, buf: w.buf})
	w.memh = nil
	return nil
}

// grave is a closed window's registration and, where it is not UCX's, its buffer, kept
// until the transport closes.
type grave struct {
	memh C.ucp_mem_h
	buf  *obuf.Buf
}

// release gives UCX back the keys and the registration (under t.winMu, or before w is
// listed); the transport's shutdown calls it for windows still open, whose memory, if
// UCX allocated it, goes with the registration.
func (w *rmaWindow) release() {
	w.releaseKeys()
	if w.memh != nil {
		C.ucp_mem_unmap(w.t.ctx, w.memh)
		w.memh = nil
		w.t.memHandles.Add(-1)
	}
}

// releaseKeys destroys the peers' remote keys.
func (w *rmaWindow) releaseKeys() {
	for q, k := range w.rkeys {
		if k != nil {
			C.ucp_rkey_destroy(k)
			w.rkeys[q] = nil
		}
	}
}

// closeWindows releases what every open window holds of UCX (at shutdown, before the
// endpoints and the context go); their memory stays until their Close.
func (t *Transport) closeWindows() {
	t.winMu.Lock()
	defer t.winMu.Unlock()
	for w := range t.windows {
		w.release()
		delete(t.windows, w)
	}
}

// buryWindows gives back the memory and registrations of closed windows, once the
// worker that could write into them is gone (before the context).
func (t *Transport) buryWindows() {
	t.winMu.Lock()
	defer t.winMu.Unlock()
	for _, g := range t.graves {
		C.ucp_mem_unmap(t.ctx, g.memh)
		t.memHandles.Add(-1)
		if g.buf != nil {
			g.buf.Release()
		}
	}
	t.graves = nil
}
