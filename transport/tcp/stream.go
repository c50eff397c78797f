package tcp

import (
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/internal/wire"
	"github.com/moex-ai/moex/transport"
)

// A stream is one TCP connection to a peer, with a writer goroutine fed by two queues
// (control frames first, then bulk data in chunks) and a reader goroutine that parses
// frames and hands payloads to the protocol.

type frameKind uint8

const (
	fkEager frameKind = iota + 1 // completes its send when written
	fkRTS                        // part of a rendezvous send; nothing completes on write
	fkCTS                        // owned by a receive
	fkOwned                      // allocated for this frame alone (notices, bye)
)

type frame struct {
	hdr     [wire.HeaderSize]byte
	payload []byte
	kind    frameKind
	send    *sendReq
	next    *frame
	bye     bool
}

type dataJob struct {
	send     *sendReq
	off, end int
}

const rbufSize = 256 << 10

// directRead is the size from which the rest of a payload is read from the socket
// straight into its destination rather than through rbuf.
const directRead = 32 << 10

type stream struct {
	p    *peer
	idx  int
	conn *net.TCPConn
	raw  syscall.RawConn

	// Writing. wlock is held by whoever writes to the socket; the queues are taken only
	// under wlock, so frames leave in queue order even with direct writes.
	wlock      sync.Mutex
	qmu        sync.Mutex
	ctlHead    *frame
	ctlTail    *frame
	bulk       []dataJob
	wake       chan struct{}
	batch      []*sendReq // eager sends the write in progress carries (completed after it)
	nframes    int
	partial    *frame // a frame a direct write left half written (under wlock)
	partialOff int
	chunkJob   int // 1 when the write in progress carries a chunk of bulk[0]
	chunkLen   int
	chunkHdr   [wire.HeaderSize]byte
	iov        []unix.Iovec
	wdone      int // bytes of the current iovec list already written
	werr       error
	wtotal     int
	writeFn    func(uintptr) bool
	tryFn      func(uintptr) bool
	corks      atomic.Int32 // IsendBatch calls under way: send queues its frames for their flush

	// Reading (reader goroutine only).
	rbuf []byte
	r, w int
	// afterBulk: the last payload was read straight into its destination, so the next
	// fill reads no further than the header it needs.
	afterBulk bool
	spin      busypoll.Spinner
	rp        []byte
	rn        int
	rerr      error
	readFn    func(uintptr) bool
	woke      bool          // the last frame completed a receive whose waiter was parked
	src       payloadSource // the payload of the frame being handled
}

func newStream(p *peer, idx int, c *net.TCPConn) *stream {
	s := &stream{p: p, idx: idx, conn: c, wake: make(chan struct{}, 1), rbuf: make([]byte, rbufSize)}
	s.raw, _ = c.SyscallConn()
	s.src.s = s
	s.readFn = s.doRead
	s.writeFn = s.doWrite
	s.tryFn = s.doTryWrite
	return s
}

// setSockopts sets TCP_NODELAY, the dead-peer timeouts (dead: see Config.DeadAfter) and
// the busy-poll options; it returns what took of the latter.
func (s *stream) setSockopts(busyUS int, dead time.Duration) string {
	_ = s.conn.SetNoDelay(true)
	if dead > 0 {
		// Idle: a probe every dead/4 after dead/4 of silence, three unanswered end it;
		// data sent: unacknowledged for dead ends it.
		q := max(dead/4, time.Second)
		_ = s.conn.SetKeepAliveConfig(net.KeepAliveConfig{Enable: true, Idle: q, Interval: q, Count: 3})
		_ = s.raw.Control(func(fd uintptr) {
			_ = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(dead/time.Millisecond))
		})
	}
	if busyUS < 0 {
		return "off"
	}
	res := "not set"
	_ = s.raw.Control(func(fd uintptr) {
		if err := unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_BUSY_POLL, busyUS); err != nil {
			res = "not permitted (" + err.Error() + ")"
			return
		}
		got, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_BUSY_POLL)
		if err != nil || got != busyUS {
			res = fmt.Sprintf("asked %dus, kernel kept %d", busyUS, got)
			return
		}
		res = fmt.Sprintf("%dus", busyUS)
		if err := unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PREFER_BUSY_POLL, 1); err == nil {
			res += " (prefer)"
		}
	})
	return res
}

// ---- writing ----

// enqueueCtl appends a control frame and wakes the writer.
func (s *stream) enqueueCtl(f *frame) {
	s.enqueueQuiet(f)
	s.kick()
}

// enqueueQuiet appends a control frame without waking the writer.
func (s *stream) enqueueQuiet(f *frame) {
	f.next = nil
	s.qmu.Lock()
	if s.ctlTail == nil {
		s.ctlHead = f
	} else {
		s.ctlTail.next = f
	}
	s.ctlTail = f
	s.qmu.Unlock()
}

// uncork ends an IsendBatch call's hold on the queue; the last one writes what queued.
func (s *stream) uncork() {
	if s.corks.Add(-1) == 0 {
		s.flushQueued()
	}
}

// flushQueued writes the queued control frames from the calling goroutine, with one
// non-blocking writev, where the writer is idle and has nothing else to send first;
// otherwise, and for what the socket did not take, it wakes the writer. Eager sends
// written whole complete here, and a frame written in part becomes the writer's partial
// frame. The queue stays locked throughout, so that a peer's reaping (Drop) or a
// withdrawal finds every frame either queued or written.
func (s *stream) flushQueued() {
	if !s.wlock.TryLock() {
		s.kick()
		return
	}
	s.qmu.Lock()
	if writerFirst := s.partial != nil || len(s.bulk) > 0; s.ctlHead == nil || writerFirst {
		// Nothing queued (another flush took it), or the writer has a frame or data to
		// send first: it sends the queue after them.
		s.qmu.Unlock()
		s.wlock.Unlock()
		if writerFirst {
			s.kick()
		}
		return
	}
	s.iov, s.wtotal = s.iov[:0], 0
	for f := s.ctlHead; f != nil && len(s.iov) < 1024; f = f.next {
		s.iov = appendIov(s.iov, f.hdr[:])
		s.iov = appendIov(s.iov, f.payload)
		s.wtotal += wire.HeaderSize + len(f.payload)
	}
	s.wdone, s.werr = 0, nil
	_ = s.raw.Write(s.tryFn) // an error is the writer's to meet: the frames stay queued
	t := s.p.t
	if s.wdone > 0 {
		t.writevs.Add(1)
		t.direct.Add(1)
		t.bytesOut.Add(uint64(s.wdone))
	}
	for off := s.wdone; off > 0; {
		f := s.ctlHead
		s.ctlHead = f.next
		f.next = nil
		n := wire.HeaderSize + len(f.payload)
		if off < n {
			s.partial, s.partialOff = f, off
			break
		}
		off -= n
		t.framesOut.Add(1)
		if f.kind == fkEager {
			f.send.Complete(len(f.send.Buf), nil)
		}
	}
	if s.ctlHead == nil {
		s.ctlTail = nil
	}
	more := s.ctlHead != nil || s.partial != nil
	s.qmu.Unlock()
	s.wlock.Unlock()
	if more {
		s.kick()
	}
}

func (s *stream) enqueueBulk(j dataJob) {
	s.qmu.Lock()
	s.bulk = append(s.bulk, j)
	s.qmu.Unlock()
	s.kick()
}

func (s *stream) kick() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// removeCtl takes f out of the queue if it has not been picked up for writing.
func (s *stream) removeCtl(f *frame) bool {
	s.qmu.Lock()
	defer s.qmu.Unlock()
	var prev *frame
	for x := s.ctlHead; x != nil; prev, x = x, x.next {
		if x == f {
			if prev == nil {
				s.ctlHead = x.next
			} else {
				prev.next = x.next
			}
			if s.ctlTail == x {
				s.ctlTail = prev
			}
			x.next = nil
			return true
		}
	}
	return false
}

// send writes a control frame (eager message, RTS, CTS, notice) from the calling goroutine
// when the writer is idle and nothing is queued, with one non-blocking writev, and reports
// whether it went out whole. Otherwise the frame, or the rest of it, is left to the writer
// goroutine, which also deals with any write error. Callers hold p.mu, so that a peer that
// fails meanwhile reaps a frame that ended up queued.
//
// Writing from the caller saves waking the writer goroutine: on a busy machine that wake-up
// waits for a CPU, and every message would pay for it.
func (s *stream) send(f *frame) (done bool) {
	if s.corks.Load() > 0 {
		s.enqueueQuiet(f)
		if s.corks.Load() == 0 {
			s.kick() // the batch ended meanwhile, and its flush may have missed f
		}
		return false
	}
	if !s.wlock.TryLock() {
		s.enqueueCtl(f)
		return false
	}
	s.qmu.Lock()
	idle := s.partial == nil && s.ctlHead == nil && len(s.bulk) == 0
	s.qmu.Unlock()
	if !idle {
		s.wlock.Unlock()
		s.enqueueCtl(f)
		return false
	}
	s.iov = s.iov[:0]
	s.iov = appendIov(s.iov, f.hdr[:])
	s.iov = appendIov(s.iov, f.payload)
	s.wtotal = wire.HeaderSize + len(f.payload)
	s.wdone, s.werr = 0, nil
	if cerr := s.raw.Write(s.tryFn); cerr != nil && s.werr == nil {
		s.werr = cerr
	}
	t := s.p.t
	if s.werr == nil && s.wdone == s.wtotal {
		t.framesOut.Add(1)
		t.writevs.Add(1)
		t.direct.Add(1)
		t.bytesOut.Add(uint64(s.wtotal))
		s.wlock.Unlock()
		return true
	}
	if s.wdone > 0 {
		// Partial: the writer must send the rest of this frame before anything else.
		s.partial = f
		s.partialOff = s.wdone
		s.wlock.Unlock()
		s.kick()
		return false
	}
	s.wlock.Unlock()
	s.enqueueCtl(f) // EAGAIN, or an error the writer will meet and report
	return false
}

func appendIov(iov []unix.Iovec, b []byte) []unix.Iovec {
	if len(b) == 0 {
		return iov
	}
	v := unix.Iovec{Base: unsafe.SliceData(b)}
	v.SetLen(len(b))
	return append(iov, v)
}

// The socket's reads and writes are raw system calls: the sockets are non-blocking, so
// the calls never sleep, and a raw call skips the runtime's entry and exit, whose entry
// wakes the runtime's monitor thread (sysmon) when the process has been idle. Woken so,
// it polls every 20 µs for a while, and where ranks share CPUs that thread takes them
// from the ranks: one such wake per message.

// writev writes the iovecs from s.wdone on; it returns false on EAGAIN.
func (s *stream) writev(fd uintptr) bool {
	for s.wdone < s.wtotal {
		iov := s.iov
		skip := s.wdone
		for len(iov) > 0 && int(iov[0].Len) <= skip {
			skip -= int(iov[0].Len)
			iov = iov[1:]
		}
		first := iov[0]
		iov[0].Base = (*byte)(unsafe.Add(unsafe.Pointer(first.Base), skip))
		iov[0].SetLen(int(first.Len) - skip)
		n, _, e := unix.RawSyscall(unix.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&iov[0])), uintptr(min(len(iov), 1024)))
		iov[0] = first
		if e != 0 {
			if e == unix.EINTR {
				continue
			}
			if e == unix.EAGAIN {
				return false
			}
			s.werr = e
			return true
		}
		s.wdone += int(n)
	}
	return true
}

func (s *stream) doWrite(fd uintptr) bool { return s.writev(fd) }

func (s *stream) doTryWrite(fd uintptr) bool {
	if !s.writev(fd) {
		s.werr = unix.EAGAIN
	}
	return true
}

// writeLoop is the stream's writer goroutine.
func (s *stream) writeLoop() {
	p := s.p
	defer p.exited()
	for {
		select {
		case <-s.wake:
		case <-p.quit:
			s.flushOnQuit()
			return
		}
		for {
			if p.isQuitting() {
				s.flushOnQuit()
				return
			}
			s.wlock.Lock()
			if !s.gather() {
				s.wlock.Unlock()
				break
			}
			s.wdone, s.werr = 0, nil
			if err := s.raw.Write(s.writeFn); err != nil && s.werr == nil {
				s.werr = err
			}
			err := s.werr
			if err != nil {
				s.wlock.Unlock()
				p.fail(fmt.Errorf("write: %w", err))
				s.failBatch(err)
				return
			}
			s.finishBatch() // under wlock: direct writes share the scratch fields
			s.wlock.Unlock()
		}
	}
}

// flushOnQuit writes queued control frames up to a bye (graceful leave), bounded by a
// short deadline, then closes the connection.
func (s *stream) flushOnQuit() {
	defer s.conn.Close()
	if !s.p.graceful {
		return
	}
	_ = s.conn.SetWriteDeadline(time.Now().Add(time.Second))
	s.wlock.Lock()
	defer s.wlock.Unlock()
	s.qmu.Lock()
	s.iov, s.wtotal = s.iov[:0], 0
	for f := s.ctlHead; f != nil; f = f.next {
		if f.kind == fkOwned || f.kind == fkCTS {
			s.iov = appendIov(s.iov, f.hdr[:])
			s.iov = appendIov(s.iov, f.payload)
			s.wtotal += wire.HeaderSize + len(f.payload)
		}
		if f.bye {
			break
		}
	}
	s.qmu.Unlock()
	if s.wtotal > 0 && s.partial == nil {
		s.wdone = 0
		_ = s.raw.Write(s.writeFn)
	}
	_ = s.conn.CloseWrite()
}

// gather builds the next write under wlock: a partial frame's rest, every queued control
// frame (coalesced into one writev), and one chunk of the first bulk job.
func (s *stream) gather() bool {
	// Only eager sends are remembered: other frames (CTS) may be recycled by their owner as
	// soon as the bytes are out, before this goroutine looks again.
	s.iov, s.batch, s.wtotal, s.chunkJob, s.nframes = s.iov[:0], s.batch[:0], 0, 0, 0
	p := s.p
	if f := s.partial; f != nil && s.idx == 0 {
		s.partial = nil
		off := s.partialOff
		if off < wire.HeaderSize {
			s.iov = appendIov(s.iov, f.hdr[off:])
			s.iov = appendIov(s.iov, f.payload)
		} else {
			s.iov = appendIov(s.iov, f.payload[off-wire.HeaderSize:])
		}
		s.wtotal += wire.HeaderSize + len(f.payload) - off
		if f.kind == fkEager {
			s.batch = append(s.batch, f.send)
		}
		s.nframes++
	}
	s.qmu.Lock()
	for f := s.ctlHead; f != nil && len(s.iov) < 512; {
		next := f.next
		s.iov = appendIov(s.iov, f.hdr[:])
		s.iov = appendIov(s.iov, f.payload)
		s.wtotal += wire.HeaderSize + len(f.payload)
		if f.kind == fkEager {
			s.batch = append(s.batch, f.send)
		}
		s.nframes++
		f.next = nil
		f = next
		s.ctlHead = f
	}
	if s.ctlHead == nil {
		s.ctlTail = nil
	}
	if len(s.bulk) > 0 {
		j := &s.bulk[0]
		n := min(j.end-j.off, p.t.chunk)
		sr := j.send
		h := wire.Header{Type: wire.TypeData, Comm: sr.Tag.Comm, Src: uint32(p.t.rank), Seq: sr.Tag.Seq,
			Tag: sr.Tag.Tag, Sig: sr.Tag.Sig, Length: uint64(n), ID: sr.X.recvID, Aux: uint64(j.off)}
		if p.t.checksum {
			h.SetChecksum(sr.Buf[j.off : j.off+n])
		}
		h.Encode(s.chunkHdr[:])
		s.iov = appendIov(s.iov, s.chunkHdr[:])
		s.iov = appendIov(s.iov, sr.Buf[j.off:j.off+n])
		s.wtotal += wire.HeaderSize + n
		s.chunkJob, s.chunkLen = 1, n
	}
	s.qmu.Unlock()
	return s.wtotal > 0
}

// failBatch completes the eager sends of a write that failed. (Rendezvous sends are in
// the transport's table, which reap walks.)
func (s *stream) failBatch(err error) {
	for i, sr := range s.batch {
		s.batch[i] = nil
		sr.Complete(0, &transport.PeerError{Rank: s.p.rank, Op: "send", Err: err})
	}
}

// finishBatch completes what the last write carried.
func (s *stream) finishBatch() {
	t := s.p.t
	t.writevs.Add(1)
	t.bytesOut.Add(uint64(s.wtotal))
	t.framesOut.Add(uint64(s.nframes))
	for i, sr := range s.batch {
		s.batch[i] = nil
		sr.Complete(len(sr.Buf), nil)
	}
	if s.chunkJob != 0 {
		t.framesOut.Add(1)
		s.qmu.Lock()
		j := &s.bulk[0]
		j.off += s.chunkLen
		var finished *sendReq
		if j.off >= j.end {
			finished = j.send
			copy(s.bulk, s.bulk[1:])
			s.bulk[len(s.bulk)-1] = dataJob{}
			s.bulk = s.bulk[:len(s.bulk)-1]
		}
		s.qmu.Unlock()
		if finished != nil && finished.X.stripes.Add(-1) == 0 {
			t.eng.Pushed(finished)
		}
	}
}

// ---- reading ----

// read does one read of at least one byte into p, under the busy-poll policy.
func (s *stream) read(p []byte) (int, error) {
	s.rp, s.rn, s.rerr = p, 0, nil
	s.spin = s.p.t.poller.Begin()
	err := s.raw.Read(s.readFn)
	s.spin.End()
	s.p.t.reads.Add(1)
	if err != nil {
		return 0, err
	}
	return s.rn, s.rerr
}

func (s *stream) doRead(fd uintptr) bool {
	for {
		n, _, e := unix.RawSyscall(unix.SYS_READ, fd, uintptr(unsafe.Pointer(unsafe.SliceData(s.rp))), uintptr(len(s.rp)))
		switch {
		case e == 0 && n > 0:
			s.rn = int(n)
			return true
		case e == 0:
			s.rerr = io.EOF
			return true
		case e == unix.EINTR:
		case e == unix.EAGAIN:
			if s.spin.Idle() {
				return false
			}
		default:
			s.rerr = e
			return true
		}
	}
}

// fill makes at least n bytes available in rbuf[r:w].
func (s *stream) fill(n int) error {
	if s.w-s.r >= n {
		return nil
	}
	if len(s.rbuf)-s.r < n {
		s.w = copy(s.rbuf, s.rbuf[s.r:s.w])
		s.r = 0
	}
	end := len(s.rbuf)
	if s.afterBulk {
		// The last frame's payload went straight to its destination: read this frame's
		// header alone, so that a bulk payload after it does too instead of filling
		// rbuf only to be copied out of it.
		end = s.r + n
		s.afterBulk = false
	}
	for s.w-s.r < n {
		k, err := s.read(s.rbuf[s.w:end])
		if err != nil {
			return err
		}
		s.w += k
		s.p.t.bytesIn.Add(uint64(k))
	}
	return nil
}

// readInto fills dst with the next len(dst) bytes of the stream: what is buffered first,
// then a large remainder (directRead or more) straight from the socket into dst, to its
// end (no intermediate copy).
func (s *stream) readInto(dst []byte) error {
	k := copy(dst, s.rbuf[s.r:s.w])
	s.r += k
	dst = dst[k:]
	if len(dst) >= directRead {
		s.afterBulk = true
		for len(dst) > 0 {
			n, err := s.read(dst)
			if err != nil {
				return err
			}
			s.p.t.bytesIn.Add(uint64(n))
			dst = dst[n:]
		}
		return nil
	}
	for len(dst) > 0 {
		if err := s.fill(1); err != nil {
			return err
		}
		k := copy(dst, s.rbuf[s.r:s.w])
		s.r += k
		dst = dst[k:]
	}
	return nil
}

// discard skips n bytes of the stream.
func (s *stream) discard(n int) error {
	for n > 0 {
		if s.r == s.w {
			if err := s.fill(1); err != nil {
				return err
			}
		}
		k := min(n, s.w-s.r)
		s.r += k
		n -= k
	}
	return nil
}

// readLoop is the stream's reader goroutine.
func (s *stream) readLoop() {
	p := s.p
	defer p.exited()
	var h wire.Header
	for {
		if err := s.fill(wire.HeaderSize); err != nil {
			p.fail(readErr(err))
			return
		}
		if err := h.Decode(s.rbuf[s.r : s.r+wire.HeaderSize]); err != nil {
			p.fail(fmt.Errorf("%w: %v", transport.ErrProtocol, err))
			return
		}
		s.r += wire.HeaderSize
		if h.Src != uint32(p.rank) && h.Type != wire.TypeHello {
			p.fail(fmt.Errorf("%w: frame claims source rank %d on the connection of rank %d", transport.ErrProtocol, h.Src, p.rank))
			return
		}
		bye, err := p.handle(s, &h)
		if err != nil {
			p.fail(err)
			return
		}
		if bye {
			p.fail(transport.ErrPeerLeft)
			return
		}
		if s.woke {
			// Hand the CPU to the waiter we just woke: it was queued on this P, and this
			// goroutine is about to spin on the socket again.
			s.woke = false
			runtime.Gosched()
		}
	}
}

func readErr(err error) error {
	if errors.Is(err, io.EOF) {
		return fmt.Errorf("%w: connection ended (%v)", transport.ErrPeerClosed, io.ErrUnexpectedEOF)
	}
	if errors.Is(err, net.ErrClosed) {
		return transport.ErrClosed
	}
	return fmt.Errorf("%w: %v", transport.ErrPeerClosed, err)
}
