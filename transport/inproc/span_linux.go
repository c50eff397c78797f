package inproc

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/internal/core"
)

var _ transport.SpanTransport = (*Transport)(nil)

// NewSpanWindow implements transport.SpanTransport: the window lives in a memory file
// (memfd), which Span maps again beside its peers'.
func (t *Transport) NewSpanWindow(size int) (transport.SpanWindow, []byte, error) {
	if size < 0 || size > transport.MaxWindow {
		return nil, nil, &transport.ArgError{Arg: "size", Reason: fmt.Sprintf("%d bytes (want 0..%d)", size, transport.MaxWindow)}
	}
	if t.closed.Load() {
		return nil, nil, transport.ErrClosed
	}
	stride := transport.SpanStride(max(size, 1))
	fd, err := unix.MemfdCreate("moex-window", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, nil, fmt.Errorf("inproc: creating a window file: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(stride)); err != nil {
		unix.Close(fd)
		return nil, nil, fmt.Errorf("inproc: sizing a window file to %d bytes: %w", stride, err)
	}
	mem, err := unix.Mmap(fd, 0, stride, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, nil, fmt.Errorf("inproc: mapping a window file: %w", err)
	}
	return t.newWindow(&winMem{mem: mem[:size:size], file: mem, bell: make(chan struct{}, 1), fd: fd})
}

// Span implements transport.SpanWindow.
func (w *window) Span(peers []int) ([]byte, error) {
	if w.span != nil {
		return w.span, nil
	}
	if w.closed.Load() {
		return nil, transport.ErrClosed
	}
	size := len(w.own.mem)
	fds := make([]int, len(peers))
	offs := make([]int64, len(peers))
	for i, q := range peers {
		if q < 0 || q >= len(w.peers) || w.peers[q] == nil {
			return nil, &transport.ArgError{Arg: "peers", Reason: fmt.Sprintf("rank %d's window is not mapped", q)}
		}
		m := w.peers[q]
		if m.fd < 0 {
			return nil, &transport.ArgError{Arg: "peers", Reason: fmt.Sprintf("rank %d's window was not made by NewSpanWindow", q)}
		}
		if len(m.mem) != size {
			return nil, fmt.Errorf("%w: rank %d's window has %d bytes, this rank's %d", transport.ErrProtocol, q, len(m.mem), size)
		}
		fds[i] = m.fd
	}
	span, err := core.MapSpan(fds, offs, transport.SpanStride(max(size, 1)))
	if err != nil {
		return nil, err
	}
	w.span = span
	return span, nil
}

func unmapSpan(b []byte) { _ = core.UnmapSpan(b) }

// releaseFile unmaps a window file's memory and closes it, once no window holds it.
func releaseFile(m *winMem) {
	_ = unix.Munmap(m.file)
	m.mem, m.file = nil, nil
	unix.Close(m.fd)
}
