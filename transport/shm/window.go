package shm

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/internal/core"
)

// A window is a file in DevShm that its rank and every peer on this host map read-write
// (transport.WindowTransport): the peers write blocks straight into the owner's memory.
// Layout: a page of header (a doorbell futex word at 0, a count of sleeping waiters at 64),
// then the window's bytes. The file is named like a segment, with the creator's pid, so
// that a job that dies before Seal leaves nothing that the next start does not remove.
const (
	winHdr      = 4096
	winDoorbell = 0
	winSleeping = 64
)

var _ transport.SpanTransport = (*Transport)(nil)

// NewSpanWindow implements transport.SpanTransport: every shm window can be spanned.
func (t *Transport) NewSpanWindow(size int) (transport.SpanWindow, []byte, error) {
	w, desc, err := t.NewWindow(size)
	if err != nil {
		return nil, nil, err
	}
	return w.(*window), desc, nil
}

// window is one rank's view of a set of shm windows.
type window struct {
	t      *Transport
	name   string // the file, until Seal
	own    []byte // the whole mapping, header included
	peers  [][]byte
	names  []string // the peers' files, for Span (until Seal)
	span   []byte
	procs  bool // the peers are other processes: waiters yield to the kernel only
	sealed atomic.Bool
	closed atomic.Bool
}

// NewWindow implements transport.WindowTransport.
func (t *Transport) NewWindow(size int) (transport.Window, []byte, error) {
	if err := transport.CheckNewWindow(size, t.closed.Load()); err != nil {
		return nil, nil, err
	}
	job := strings.TrimPrefix(t.own.name, segPrefix)
	if i := strings.Index(job, "-r"); i >= 0 {
		job = job[:i]
	}
	name := fmt.Sprintf("%s%s-w%d-r%d-p%d", segPrefix, job, t.windows.Add(1), t.rank, os.Getpid())
	path := filepath.Join(DevShm, name)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, nil, fmt.Errorf("shm: creating window %s: %w", path, err)
	}
	defer f.Close()
	total := winHdr + size
	if err := f.Truncate(int64(total)); err != nil {
		os.Remove(path)
		return nil, nil, fmt.Errorf("shm: sizing window %s to %d bytes: %w", path, total, err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, total, unix.PROT_READ|unix.PROT_WRITE, mapFlags(total))
	if err != nil {
		os.Remove(path)
		return nil, nil, fmt.Errorf("shm: mapping window %s: %w", path, err)
	}
	w := &window{t: t, name: name, own: mem, peers: make([][]byte, t.size), names: make([]string, t.size), procs: true}
	for _, p := range t.list() {
		if p != nil && p.pid == os.Getpid() {
			w.procs = false // ranks as goroutines of one process (tests)
		}
	}
	desc := make([]byte, 8+len(name))
	binary.LittleEndian.PutUint64(desc, uint64(total))
	copy(desc[8:], name)
	return w, desc, nil
}

// populateMax is the largest window whose pages are made when it is mapped (no page
// faults in its first exchanges). A larger one (a coll.Board sized for the worst case,
// say) fills as it is touched, so that it takes the memory its users write, not its size.
const populateMax = 64 << 20

func mapFlags(total int) int {
	if total <= populateMax {
		return unix.MAP_SHARED | unix.MAP_POPULATE
	}
	return unix.MAP_SHARED
}

func (w *window) Local() []byte { return w.own[winHdr:] }

func (w *window) Map(peer int, desc []byte) error {
	t := w.t
	switch {
	case peer < 0 || peer >= t.size:
		return &transport.ArgError{Arg: "peer", Reason: fmt.Sprintf("rank %d of %d", peer, t.size)}
	case peer == t.rank:
		w.peers[peer] = w.own
		return nil
	case t.list()[peer] == nil:
		return fmt.Errorf("%w: rank %d is not on this host", transport.ErrNoWindow, peer)
	case len(desc) < 8 || len(desc) > 8+255:
		return fmt.Errorf("%w: rank %d's window descriptor has %d bytes", transport.ErrProtocol, peer, len(desc))
	}
	total := int(binary.LittleEndian.Uint64(desc))
	name := string(desc[8:])
	if total < winHdr || total > winHdr+transport.MaxWindow || !strings.HasPrefix(name, segPrefix) || strings.ContainsAny(name, "/\x00") {
		return fmt.Errorf("%w: rank %d's window descriptor (%q, %d bytes)", transport.ErrProtocol, peer, name, total)
	}
	path := filepath.Join(DevShm, name)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("shm: opening rank %d's window %s: %w", peer, path, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	if st.Size() != int64(total) {
		return fmt.Errorf("%w: rank %d's window %s has %d bytes, its descriptor says %d", transport.ErrProtocol, peer, path, st.Size(), total)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, total, unix.PROT_READ|unix.PROT_WRITE, mapFlags(total))
	if err != nil {
		return fmt.Errorf("shm: mapping rank %d's window %s: %w", peer, path, err)
	}
	if old := w.peers[peer]; old != nil {
		_ = unix.Munmap(old)
	}
	w.peers[peer] = mem
	w.names[peer] = name
	return nil
}

// Span implements transport.SpanWindow: each window's file is mapped again, past its
// header page, at its place in the span.
func (w *window) Span(peers []int) ([]byte, error) {
	if w.span != nil {
		return w.span, nil
	}
	if w.sealed.Load() || w.closed.Load() {
		return nil, fmt.Errorf("%w: span of a sealed window", transport.ErrClosed)
	}
	size := len(w.own) - winHdr
	stride := transport.SpanStride(size)
	fds := make([]int, len(peers))
	offs := make([]int64, len(peers))
	for i := range fds {
		fds[i] = -1
	}
	defer func() {
		for _, fd := range fds {
			if fd >= 0 {
				unix.Close(fd)
			}
		}
	}()
	for i, q := range peers {
		name := w.name
		if q != w.t.rank {
			if q < 0 || q >= len(w.peers) || w.peers[q] == nil {
				return nil, &transport.ArgError{Arg: "peers", Reason: fmt.Sprintf("rank %d's window is not mapped", q)}
			}
			if len(w.peers[q]) != len(w.own) {
				return nil, fmt.Errorf("%w: rank %d's window has %d bytes, this rank's %d", transport.ErrProtocol, q, len(w.peers[q])-winHdr, size)
			}
			name = w.names[q]
		}
		fd, err := unix.Open(filepath.Join(DevShm, name), unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("shm: opening rank %d's window for a span: %w", q, err)
		}
		fds[i], offs[i] = fd, winHdr
	}
	span, err := core.MapSpan(fds, offs, stride)
	if err != nil {
		return nil, err
	}
	w.span = span
	return span, nil
}

func (w *window) Remote(peer int) []byte {
	if peer < 0 || peer >= len(w.peers) || w.peers[peer] == nil {
		return nil
	}
	return w.peers[peer][winHdr:]
}

func (w *window) Seal() {
	if !w.sealed.Swap(true) {
		os.Remove(filepath.Join(DevShm, w.name))
	}
}

func u32At(mem []byte, off int) *uint32 { return (*uint32)(unsafe.Pointer(&mem[off])) }

func (w *window) Notify(peer int) {
	m := w.peers[peer]
	if m == nil || peer == w.t.rank {
		return
	}
	if atomic.LoadUint32(u32At(m, winSleeping)) != 0 {
		bell := u32At(m, winDoorbell)
		atomic.AddUint32(bell, 1)
		futexWakeAll(bell)
	}
}

func (w *window) Wait(ctx context.Context, ready func() bool) error {
	if ready() {
		return nil
	}
	t := w.t
	bell, sleeping := u32At(w.own, winDoorbell), u32At(w.own, winSleeping)
	for {
		spin := t.poller.Begin()
		if w.procs {
			spin = t.poller.BeginProcess()
		}
		for !ready() {
			if !spin.Idle() {
				continue
			}
			// Announce, then sleep unless ready meanwhile: a notifier that stored before
			// it saw the announcement is seen by the look below; one that saw it rings.
			v := atomic.LoadUint32(bell)
			atomic.AddUint32(sleeping, 1)
			if !ready() && ctx.Err() == nil {
				t.winParks.Add(1)
				t.park(bell, v, int64(2*time.Millisecond))
			}
			atomic.AddUint32(sleeping, ^uint32(0))
			break
		}
		spin.End()
		if ready() {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if t.closed.Load() || w.closed.Load() {
			return transport.ErrClosed
		}
	}
}

func (w *window) Close() error {
	if w.closed.Swap(true) {
		return nil
	}
	w.Seal()
	if w.span != nil {
		_ = core.UnmapSpan(w.span)
		w.span = nil
	}
	for q, m := range w.peers {
		if m != nil && q != w.t.rank {
			_ = unix.Munmap(m)
		}
		w.peers[q] = nil
	}
	err := unix.Munmap(w.own)
	w.own = nil
	return err
}
