package transporttest

import (
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
)

// RMA is a transport whose windows are one-sided (transport.RMATransport), made from a
// transport whose windows are plain memory (inproc, shm): its peers' windows are
// reached only by Put, Get and Signal, which copy and add in Go, and every one of them is
// recorded. It lets a test run, without UCX, the one-sided paths that ucx takes, and
// count what they wrote into and read from each peer's window.
//
// Messages go through Transport, which may differ from the transport whose windows are
// used (a counting wrapper, say).
type RMA struct {
	transport.Transport
	w transport.WindowTransport

	mu  sync.Mutex
	ops []RMAOp
}

// RMAOpKind is what a recorded one-sided operation did.
type RMAOpKind int

// The one-sided operations, and the fence between them.
const (
	OpPut RMAOpKind = iota + 1
	OpGet
	OpSignal
	OpFence
)

// RMAOp is one recorded operation: its kind, the peer (a transport rank) whose window it
// reached, the offset there and its bytes (8 for a Signal; 0 for a Fence).
type RMAOp struct {
	Kind      RMAOpKind
	Peer, Off int
	Bytes     int
}

// NewRMA returns msgs, for messages, with w's windows made one-sided.
func NewRMA(msgs transport.Transport, w transport.WindowTransport) *RMA {
	return &RMA{Transport: msgs, w: w}
}

var _ transport.RMATransport = (*RMA)(nil)

// RMAWindows implements transport.RMATransport.
func (t *RMA) RMAWindows() bool { return true }

// NewWindow implements transport.WindowTransport: a window of the underlying transport,
// whose peers are reached by one-sided operations only.
func (t *RMA) NewWindow(size int) (transport.Window, []byte, error) {
	w, desc, err := t.w.NewWindow(size)
	if err != nil {
		return nil, nil, err
	}
	return &rmaWindow{Window: w, t: t}, desc, nil
}

// Take returns, and forgets, the operations recorded since the last Take, in the order
// they were posted.
func (t *RMA) Take() []RMAOp {
	t.mu.Lock()
	defer t.mu.Unlock()
	ops := t.ops
	t.ops = nil
	return ops
}

func (t *RMA) record(op RMAOp) {
	t.mu.Lock()
	t.ops = append(t.ops, op)
	t.mu.Unlock()
}

type rmaWindow struct {
	transport.Window
	t *RMA
}

var _ transport.RMAWindow = (*rmaWindow)(nil)

// Remote is nil: peers are reached by Put, Get and Signal.
func (w *rmaWindow) Remote(int) []byte { return nil }

func (w *rmaWindow) Reaches(peer int) bool { return w.Window.Remote(peer) != nil }

// at is n bytes of peer's window at off, or an error naming what is out of range.
func (w *rmaWindow) at(peer, off, n int) ([]byte, error) {
	mem := w.Window.Remote(peer)
	switch {
	case mem == nil:
		return nil, fmt.Errorf("%w: rank %d's window is not mapped", transport.ErrNoWindow, peer)
	case off < 0 || n < 0 || off+n > len(mem):
		return nil, &transport.ArgError{Arg: "off", Reason: fmt.Sprintf("%d bytes at %d of a %d-byte window", n, off, len(mem))}
	}
	return mem[off : off+n], nil
}

func (w *rmaWindow) Put(peer, off int, src []byte) (transport.Request, error) {
	dst, err := w.at(peer, off, len(src))
	if err != nil {
		return nil, err
	}
	copy(dst, src)
	w.t.record(RMAOp{Kind: OpPut, Peer: peer, Off: off, Bytes: len(src)})
	return done{n: len(src)}, nil
}

func (w *rmaWindow) Get(peer, off int, dst []byte) (transport.Request, error) {
	src, err := w.at(peer, off, len(dst))
	if err != nil {
		return nil, err
	}
	copy(dst, src)
	w.t.record(RMAOp{Kind: OpGet, Peer: peer, Off: off, Bytes: len(dst)})
	return done{n: len(dst)}, nil
}

func (w *rmaWindow) Signal(peer, off int, delta uint64) (transport.Request, error) {
	word, err := w.at(peer, off, 8)
	if err != nil {
		return nil, err
	}
	if off%8 != 0 {
		return nil, &transport.ArgError{Arg: "off", Reason: fmt.Sprintf("%d is not 8-byte aligned", off)}
	}
	atomic.AddUint64((*uint64)(unsafe.Pointer(&word[0])), delta)
	w.t.record(RMAOp{Kind: OpSignal, Peer: peer, Off: off, Bytes: 8})
	w.Window.Notify(peer)
	return done{n: 8}, nil
}

// Fence orders nothing more than program order already does (every operation completes
// when posted); it is recorded.
func (w *rmaWindow) Fence() error {
	w.t.record(RMAOp{Kind: OpFence})
	return nil
}

func (w *rmaWindow) Register(*obuf.Buf) error { return nil }
