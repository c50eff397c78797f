package inproc

import (
	"context"
	"encoding/binary"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/moex-ai/moex/transport"
)

// Windows between goroutines are plain memory: a peer's window is its slice.

var _ transport.WindowTransport = (*Transport)(nil)

// winMem is one rank's window memory and its wake-up.
type winMem struct {
	mem      []byte
	sleeping atomic.Int32
	bell     chan struct{}
	// A window that can be spanned lives in a memory file (fd >= 0), mapped once here
	// and released when the last window that mapped it closes.
	fd   int
	file []byte // the file's whole mapping
	refs atomic.Int32
}

// unref drops one window's hold on m.
func (m *winMem) unref() {
	if m.fd >= 0 && m.refs.Add(-1) == 0 {
		releaseFile(m)
	}
}

type windows struct {
	mu   sync.Mutex
	next uint64
	all  map[uint64]*winMem
}

type window struct {
	t      *Transport
	id     uint64
	own    *winMem
	peers  []*winMem
	span   []byte
	closed atomic.Bool
}

// NewWindow implements transport.WindowTransport.
func (t *Transport) NewWindow(size int) (transport.Window, []byte, error) {
	if err := transport.CheckNewWindow(size, t.closed.Load()); err != nil {
		return nil, nil, err
	}
	return t.newWindow(&winMem{mem: make([]byte, size), bell: make(chan struct{}, 1), fd: -1})
}

func (t *Transport) newWindow(m *winMem) (*window, []byte, error) {
	m.refs.Store(1)
	ws := &t.w.windows
	ws.mu.Lock()
	if ws.all == nil {
		ws.all = map[uint64]*winMem{}
	}
	ws.next++
	id := ws.next
	ws.all[id] = m
	ws.mu.Unlock()
	w := &window{t: t, id: id, own: m, peers: make([]*winMem, len(t.w.eps))}
	w.peers[t.rank] = m
	desc := binary.LittleEndian.AppendUint64(nil, id)
	return w, desc, nil
}

func (w *window) Local() []byte { return w.own.mem }

func (w *window) Map(peer int, desc []byte) error {
	if err := transport.CheckPeer(peer, len(w.peers)); err != nil {
		return err
	}
	if len(desc) != 8 {
		return fmt.Errorf("%w: rank %d's window descriptor has %d bytes", transport.ErrProtocol, peer, len(desc))
	}
	ws := &w.t.w.windows
	ws.mu.Lock()
	m := ws.all[binary.LittleEndian.Uint64(desc)]
	ws.mu.Unlock()
	if m == nil {
		return fmt.Errorf("%w: rank %d's window is not (or no longer) in this process", transport.ErrProtocol, peer)
	}
	if old := w.peers[peer]; old != nil && old != w.own {
		old.unref()
	}
	if m != w.own {
		m.refs.Add(1)
	}
	w.peers[peer] = m
	return nil
}

func (w *window) Remote(peer int) []byte {
	if peer < 0 || peer >= len(w.peers) || w.peers[peer] == nil {
		return nil
	}
	return w.peers[peer].mem
}

func (w *window) Seal() {
	ws := &w.t.w.windows
	ws.mu.Lock()
	delete(ws.all, w.id)
	ws.mu.Unlock()
}

func (w *window) Notify(peer int) {
	m := w.peers[peer]
	if m == nil || m.sleeping.Load() == 0 {
		return
	}
	select {
	case m.bell <- struct{}{}:
	default:
	}
}

func (w *window) Wait(ctx context.Context, ready func() bool) error {
	if ready() {
		return nil
	}
	m := w.own
	s := w.t.w.poller.Begin()
	defer s.End()
	for !ready() {
		if !s.Idle() {
			continue
		}
		for {
			m.sleeping.Add(1)
			if ready() {
				m.sleeping.Add(-1)
				return nil
			}
			select {
			case <-m.bell:
			case <-ctx.Done():
				m.sleeping.Add(-1)
				if ready() {
					return nil
				}
				return ctx.Err()
			}
			n := m.sleeping.Add(-1)
			if ready() {
				return nil
			}
			if n > 0 { // the wake-up may have been another waiter's: pass it on
				select {
				case m.bell <- struct{}{}:
				default:
				}
			}
			if w.closed.Load() {
				return transport.ErrClosed
			}
		}
	}
	return nil
}

func (w *window) Close() error {
	if w.closed.Swap(true) {
		return nil
	}
	w.Seal()
	if w.span != nil {
		unmapSpan(w.span)
		w.span = nil
	}
	for q, m := range w.peers {
		if m != nil && m != w.own {
			m.unref()
		}
		w.peers[q] = nil
	}
	w.own.unref()
	return nil
}
