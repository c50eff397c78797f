package shm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/cespare/xxhash/v2"
	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/internal/wire"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/internal/core"
)

const hdrSize = wire.HeaderSize

// Frames: TypeEager (payload inline), TypeRTS (payload: the sender's buffer address, u64),
// TypeCTS (ID: the sender's request; Aux 0: the receiver copied the message (FIN); Aux
// non-zero: stream it through the ring to receive request Aux), TypeData (ID: receive
// request, Aux: offset), TypeAbort (per-message notices, core.Notice*) and TypeBye.
//
// The protocol (matching, rendezvous, notices, cancellation, a dead peer's completion) is
// core.Engine's. This file holds shm's edges: a peer is the core.Link over its rings and
// cross-memory copies, and frame turns the frames it consumes into the Engine's events.

// sendX is shm's state in a send: the announcement's payload (the buffer's address) and,
// when the message goes through the ring, its progress.
type sendX struct {
	addr   [8]byte
	stream stream
}

type recvX struct{}

type (
	sendReq = core.Send[sendX, recvX]
	recvReq = core.Recv[sendX, recvX]
)

type peer struct {
	t     *Transport
	rank  int
	pid   int
	pidfd int
	seg   *segment // the peer's segment: we produce into seg.ring(our rank)
	in    ring     // the ring we consume (in our segment)
	out   ring     // the ring we produce into (in the peer's segment)
	cma   bool
	arena peerArena // its shared buffers, as Direct reads them

	outMu   sync.Mutex
	pending []outFrame // frames waiting for ring space, in order
	done    []*sendReq // scratch of flushOut: eager sends published
	pushed  []*sendReq // and sends streamed whole
	streams []*stream  // large messages going through the ring (no CMA)

	c       *core.Peer[sendX, recvX]
	src     payload // the payload of the frame being handled (progress loop only)
	retired bool    // under outMu: the rank went to a new process (Readmit), seg is unmapped
}

var _ core.Link[sendX, recvX] = (*peer)(nil)

type outFrame struct {
	h       wire.Header
	payload []byte
	send    *sendReq // the send the frame belongs to (eager or announcement)
	eager   bool     // send completes when the frame is published
}

type stream struct {
	send   *sendReq
	recvID uint64
	off    int
}

// ---- producing ----

// slotsFor is the number of slots a frame with n payload bytes occupies: the header in
// the first, the payload from there on, across as many slots as it needs.
func (r ring) slotsFor(n int) uint64 { return uint64((hdrSize + n + r.slotSize - 1) / r.slotSize) }

// data returns the ring's slot area.
func (r ring) data() []byte {
	off := r.base + ringHdr
	return r.seg.mem[off : off+int(r.slots)*r.slotSize]
}

// publishLocked writes one frame into the ring if there is room.
func (p *peer) publishLocked(h *wire.Header, payload []byte) bool {
	if p.retired {
		return false
	}
	r := p.out
	k := r.slotsFor(len(payload))
	head := atomic.LoadUint64(r.head())
	if head+k-atomic.LoadUint64(r.tail()) > r.slots {
		atomic.StoreUint32(r.wantSpace(), 1)
		// The consumer may have freed slots between our look and the flag: look again.
		if head+k-atomic.LoadUint64(r.tail()) > r.slots {
			p.t.full.Add(1)
			return false
		}
	}
	d := r.data()
	pos := head % r.slots
	if p.t.rewind && pos != 0 && k <= pos && head == atomic.LoadUint64(r.tail()) {
		// The consumer has taken everything: rather than go on into memory last touched a
		// lap ago, pad to the end and start over at the ring's first slot, which this
		// frame's predecessors left warm. With ranks taking turns on a CPU, the rings of
		// all peers together otherwise outgrow the caches (see Config.Rewind).
		pad := wire.Header{Type: wire.TypePad, Src: uint32(p.t.rank), Aux: r.slots - pos}
		pad.Encode(d[int(pos)*r.slotSize:])
		head += r.slots - pos
		p.t.slotsOut.Add(r.slots - pos)
		pos = 0
		p.t.rewinds.Add(1)
	}
	off := int(pos) * r.slotSize
	h.Length = uint64(len(payload))
	h.Encode(d[off : off+hdrSize])
	n := copy(d[off+hdrSize:], payload)
	copy(d, payload[n:]) // wrapped around the end of the ring
	atomic.StoreUint64(r.head(), head+k)
	p.t.slotsOut.Add(k)
	p.t.ringBytes.Add(uint64(len(payload)))
	return true
}

// send publishes a frame now, or queues it behind earlier ones; it reports whether it
// went out now. Frames queued are flushed by the progress loop.
func (p *peer) send(f outFrame) bool {
	p.outMu.Lock()
	ok := len(p.pending) == 0 && p.publishLocked(&f.h, f.payload)
	if !ok {
		p.pending = append(p.pending, f)
	}
	p.outMu.Unlock()
	if ok {
		p.seg.ringDoorbell()
	} else {
		p.t.own.ringDoorbell() // our progress loop flushes the queue
	}
	return ok
}

// flushOut publishes queued frames and streams as room allows; it reports progress.
func (p *peer) flushOut() bool {
	p.outMu.Lock()
	n := 0
	done := p.done[:0] // flushOut runs in the progress loop only: the scratch is its own
	pushed := p.pushed[:0]
	for n < len(p.pending) {
		f := &p.pending[n]
		if !p.publishLocked(&f.h, f.payload) {
			break
		}
		if f.eager {
			done = append(done, f.send)
		}
		n++
	}
	if n > 0 {
		copy(p.pending, p.pending[n:])
		for i := len(p.pending) - n; i < len(p.pending); i++ {
			p.pending[i] = outFrame{}
		}
		p.pending = p.pending[:len(p.pending)-n]
	}
	moved := n > 0
	for len(p.pending) == 0 && len(p.streams) > 0 {
		st := p.streams[0]
		buf := st.send.Buf
		chunk := min(len(buf)-st.off, p.out.slotSize-hdrSize)
		h := wire.Header{Type: wire.TypeData, Src: uint32(p.t.rank), ID: st.recvID, Aux: uint64(st.off)}
		if !p.publishLocked(&h, buf[st.off:st.off+chunk]) {
			break
		}
		moved = true
		st.off += chunk
		if st.off >= len(buf) {
			copy(p.streams, p.streams[1:])
			p.streams[len(p.streams)-1] = nil
			p.streams = p.streams[:len(p.streams)-1]
			pushed = append(pushed, st.send)
		}
	}
	p.outMu.Unlock()
	if moved {
		p.seg.ringDoorbell()
	}
	for i, s := range done {
		done[i] = nil
		s.Complete(len(s.Buf), nil)
	}
	for i, s := range pushed {
		pushed[i] = nil
		p.t.eng.Pushed(s)
	}
	p.pushed = pushed[:0]
	p.done = done[:0]
	return moved
}

// hasWork reports slots to consume, or frames to produce into a ring with room (a full
// ring is not work: its consumer rings our doorbell when it frees a slot).
func (p *peer) hasWork() bool {
	return atomic.LoadUint64(p.in.head()) != atomic.LoadUint64(p.in.tail()) || p.hasOutWork()
}

// hasOutWork reports frames or streams to produce into a ring with room.
func (p *peer) hasOutWork() bool {
	p.outMu.Lock()
	w := len(p.pending) > 0 || len(p.streams) > 0
	p.outMu.Unlock()
	return w && atomic.LoadUint64(p.out.head())-atomic.LoadUint64(p.out.tail()) < p.out.slots
}

func (p *peer) bye() {
	p.outMu.Lock()
	h := wire.Header{Type: wire.TypeBye, Src: uint32(p.t.rank)}
	if p.retired {
		p.outMu.Unlock()
		return
	}
	if len(p.pending) == 0 {
		p.publishLocked(&h, nil)
	}
	p.outMu.Unlock()
	p.seg.ringDoorbell()
}

// ---- consuming ----

// drainIn handles every published frame; it reports whether there were any.
func (p *peer) drainIn() bool {
	r := p.in
	tail := atomic.LoadUint64(r.tail())
	head := atomic.LoadUint64(r.head())
	if tail == head {
		return false
	}
	d := r.data()
	for tail < head {
		off := int(tail%r.slots) * r.slotSize
		k := uint64(1)
		if p.c.Dead() == nil {
			var err error
			k, err = p.handle(d, off, head-tail)
			if err != nil {
				p.fail(err)
				k = head - tail // the rest of the ring cannot be trusted
			}
		}
		tail += k
		atomic.StoreUint64(r.tail(), tail)
		p.t.slotsIn.Add(k)
	}
	if atomic.LoadUint32(r.wantSpace()) != 0 {
		// The producer found the ring full: wake its progress loop to flush.
		atomic.StoreUint32(r.wantSpace(), 0)
		p.seg.ringDoorbell()
	}
	return true
}

// payload is a frame's payload, in one piece or, when it wraps around the end of the
// ring, two.
type payload struct{ a, b []byte }

func (pl payload) len() int { return len(pl.a) + len(pl.b) }

func (pl payload) copyTo(dst []byte) {
	n := copy(dst, pl.a)
	copy(dst[n:], pl.b)
}

// CopyTo implements core.Source.
func (pl *payload) CopyTo(dst []byte) error {
	pl.copyTo(dst)
	return nil
}

// Discard implements core.Source: the ring slots are consumed whatever happens.
func (pl *payload) Discard() error { return nil }

// handle processes the frame at offset off of the ring's slot area d, with avail slots
// published; it returns how many slots the frame occupies.
func (p *peer) handle(d []byte, off int, avail uint64) (uint64, error) {
	t := p.t
	r := p.in
	var h wire.Header
	if err := h.Decode(d[off : off+hdrSize]); err != nil {
		return 1, fmt.Errorf("%w: %v", transport.ErrProtocol, err)
	}
	if h.Src != uint32(p.rank) {
		return 1, fmt.Errorf("%w: frame claims source rank %d in the ring of rank %d", transport.ErrProtocol, h.Src, p.rank)
	}
	if h.Type == wire.TypePad {
		// Skip to the end of the ring (the producer rewound to its start).
		want := r.slots - uint64(off/r.slotSize)
		if h.Aux != want || h.Length != 0 || want > avail {
			return 1, fmt.Errorf("%w: pad of %d slots at slot %d of %d (%d published)", transport.ErrProtocol, h.Aux, off/r.slotSize, r.slots, avail)
		}
		return want, nil
	}
	maxLen := r.slotSize - hdrSize
	if h.Type == wire.TypeEager {
		maxLen = t.eager
	}
	if h.Length > uint64(maxLen) {
		return 1, fmt.Errorf("%w: %v frame of %d bytes (limit %d)", transport.ErrProtocol, h.Type, h.Length, maxLen)
	}
	k := r.slotsFor(int(h.Length))
	if k > avail {
		return 1, fmt.Errorf("%w: frame of %d slots with %d published", transport.ErrProtocol, k, avail)
	}
	var pl payload
	n := int(h.Length)
	start := off + hdrSize
	if start+n <= len(d) {
		pl.a = d[start : start+n]
	} else {
		pl.a, pl.b = d[start:], d[:n-(len(d)-start)]
	}
	if h.Flags&wire.FlagChecksum != 0 {
		if err := verify(&h, pl); err != nil {
			return k, fmt.Errorf("%w: %v", transport.ErrProtocol, err)
		}
	}
	return k, p.frame(&h, pl)
}

// frame acts on one decoded frame.
func (p *peer) frame(h *wire.Header, pl payload) error {
	t := p.t
	e := &t.eng
	tag := transport.Tag{Comm: h.Comm, Seq: h.Seq, Tag: h.Tag, Sig: h.Sig}
	p.src = pl
	switch h.Type {
	case wire.TypeEager:
		woke, err := e.Eager(p.c, tag, pl.len(), &p.src)
		t.handoff(woke)
		return err

	case wire.TypeRTS:
		if len(pl.a) != 8 {
			return fmt.Errorf("%w: RTS without an address", transport.ErrProtocol)
		}
		return e.Announced(p.c, tag, h.ID, h.Aux, binary.LittleEndian.Uint64(pl.a))

	case wire.TypeCTS:
		if h.Aux == 0 { // FIN: the receiver copied our buffer
			t.handoff(e.Copied(p.c, h.ID))
			return nil
		}
		e.ClearToSend(p.c, h.ID, h.Aux)
		return nil

	case wire.TypeData:
		woke, err := e.Data(p.c, h.ID, h.Aux, pl.len(), &p.src)
		t.handoff(woke)
		return err

	case wire.TypeAbort:
		e.Notice(p.c, h.ID, h.Aux, string(pl.a))
		return nil

	case wire.TypeBye:
		p.fail(transport.ErrPeerLeft)
		return nil
	}
	return fmt.Errorf("%w: unexpected %v frame", transport.ErrProtocol, h.Type)
}

// handoff yields the CPU to a waiter the progress loop just woke: it was queued on this
// goroutine's P, which would otherwise keep polling.
func (t *Transport) handoff(woke bool) {
	if woke {
		runtime.Gosched()
	}
}

// ---- core.Link ----

// Eager implements core.Link.
func (p *peer) Eager(h wire.Header, s *sendReq) bool {
	return p.send(outFrame{h: h, payload: s.Buf, send: s, eager: true})
}

// Announce implements core.Link: the payload is the buffer's address, for a receiver
// that copies across.
func (p *peer) Announce(h wire.Header, s *sendReq) {
	binary.LittleEndian.PutUint64(s.X.addr[:], uint64(uintptr(unsafe.Pointer(unsafe.SliceData(s.Buf)))))
	p.send(outFrame{h: h, payload: s.X.addr[:], send: s})
}

// Withdraw implements core.Link.
func (p *peer) Withdraw(s *sendReq) bool {
	p.outMu.Lock()
	defer p.outMu.Unlock()
	for i := range p.pending {
		if p.pending[i].send == s {
			p.pending = append(p.pending[:i], p.pending[i+1:]...)
			return true
		}
	}
	return false
}

// Pull implements core.Link: copy the message across (cma), or ask for it through the
// ring.
func (p *peer) Pull(r *recvReq) {
	t := p.t
	if !p.cma {
		id := t.eng.Register(r)
		p.send(outFrame{h: wire.Header{Type: wire.TypeCTS, Src: uint32(t.rank), ID: r.SenderID, Aux: id}})
		return
	}
	// The copy itself runs in the progress loop (or right here when we are it).
	t.jobMu.Lock()
	t.jobs = append(t.jobs, r)
	t.jobMu.Unlock()
	t.own.ringDoorbell()
}

// Push implements core.Link: stream the message through the ring.
func (p *peer) Push(s *sendReq, recvID uint64) {
	p.outMu.Lock()
	s.X.stream = stream{send: s, recvID: recvID}
	p.streams = append(p.streams, &s.X.stream)
	p.outMu.Unlock()
	p.t.own.ringDoorbell()
}

// Notify implements core.Link. A waiter that cancels its send calls it outside Isend and
// Irecv, so it takes the lock that keeps the peer's segment mapped; it never waits for
// it: while Close waits to unmap, the notice is dropped (the peer sees this rank close).
func (p *peer) Notify(id, code uint64, reason string) {
	if !p.t.life.TryRLock() {
		return
	}
	defer p.t.life.RUnlock()
	if !p.t.closed.Load() {
		p.notify(id, code, reason)
	}
}

// Drop implements core.Link.
func (p *peer) Drop(fn func(*sendReq)) {
	p.outMu.Lock()
	pend := p.pending
	p.pending = nil
	p.streams = nil // their sends are in the Engine's table
	p.outMu.Unlock()
	for _, f := range pend {
		if f.eager {
			fn(f.send)
		}
	}
}

// Fail implements core.Link: a cancelled transfer outlived its grace period. The
// progress lock keeps the ring's consumer out while the peer's receives complete.
func (p *peer) Fail(err error) {
	p.t.drv.Mu.Lock()
	p.fail(err)
	p.t.drv.Mu.Unlock()
}

// copyAcross reads a matched message from the sender's memory and tells it.
func (t *Transport) copyAcross(p *peer, r *recvReq) {
	if err := cmaRead(p.pid, r.Buf[:r.Total], r.Cookie, &t.liov, &t.riov); err != nil {
		t.eng.Pulled(r, &transport.PeerError{Rank: p.rank, Op: "recv", Err: fmt.Errorf("%w: reading rank %d's buffer: %v", transport.ErrPeerClosed, p.rank, err)})
		return
	}
	t.cmaBytes.Add(uint64(r.Total))
	p.send(outFrame{h: wire.Header{Type: wire.TypeCTS, Src: uint32(t.rank), ID: r.SenderID, Aux: 0}})
	t.handoff(t.eng.Pulled(r, nil))
}

// cmaRead fills dst from address addr of process pid with process_vm_readv, using the
// caller's vectors (so that it allocates nothing).
func cmaRead(pid int, dst []byte, addr uint64, liov *[1]unix.Iovec, riov *[1]unix.RemoteIovec) error {
	for done := 0; done < len(dst); {
		liov[0] = unix.Iovec{Base: &dst[done]}
		liov[0].SetLen(len(dst) - done)
		riov[0] = unix.RemoteIovec{Base: uintptr(addr) + uintptr(done), Len: len(dst) - done}
		n, err := processVMReadv(pid, liov[:], riov[:], 0)
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			return err
		case n == 0:
			return errors.New("process_vm_readv made no progress")
		}
		done += n
	}
	return nil
}

func (t *Transport) runJobs() bool {
	t.jobMu.Lock()
	jobs := t.jobs
	t.jobs, t.spare = t.spare[:0], nil
	t.jobMu.Unlock()
	for i, r := range jobs {
		jobs[i] = nil
		if r.P.Dead() != nil {
			r.Complete(0, t.eng.PeerErr(r.P, "recv"))
			continue
		}
		t.copyAcross(t.list()[r.P.Rank], r)
	}
	t.jobMu.Lock()
	t.spare = jobs[:0] // double buffering: no allocation per job in steady state
	t.jobMu.Unlock()
	return len(jobs) > 0
}

func (t *Transport) failJobs() {
	t.jobMu.Lock()
	jobs := t.jobs
	t.jobs = nil
	t.jobMu.Unlock()
	for _, r := range jobs {
		r.Complete(0, transport.ErrClosed)
	}
}

func (p *peer) notify(id, code uint64, reason string) {
	if max := p.out.slotSize - hdrSize; len(reason) > max {
		reason = reason[:max]
	}
	p.send(outFrame{h: wire.Header{Type: wire.TypeAbort, Src: uint32(p.t.rank), ID: id, Aux: code}, payload: []byte(reason)})
}

// ---- failure ----

func (p *peer) isDead() bool { return p.c.Dead() != nil }

func (p *peer) peerErr(op string) error { return p.t.eng.PeerErr(p.c, op) }

// fail marks the peer gone and completes every operation pending with it. Messages it
// sent before going stay deliverable.
func (p *peer) fail(err error) {
	if p.t.eng.MarkDead(p.c, err) {
		p.t.eng.Reap(p.c)
	}
}

// checkLiveness fails peers whose process exited or whose segment says closed.
func (t *Transport) checkLiveness() {
	for _, p := range t.list() {
		if p == nil || p.isDead() {
			continue
		}
		gone := p.seg.state() == stateClosed
		why := "closed without a goodbye"
		if !gone && p.pidfd >= 0 {
			fds := []unix.PollFd{{Fd: int32(p.pidfd), Events: unix.POLLIN}}
			if n, _ := unix.Poll(fds, 0); n > 0 {
				gone, why = true, fmt.Sprintf("process %d exited", p.pid)
			}
		}
		if gone {
			p.drainIn() // what it sent before going is still in the ring
			p.fail(fmt.Errorf("%w: %s", transport.ErrPeerClosed, why))
		}
	}
}

// ---- the progress loop ----

// step does one round of progress: copies due, slots to consume, frames to produce. It
// runs under drv.Mu, in the progress goroutine or in a waiting goroutine (core.Driver).
func (t *Transport) step() bool {
	worked := t.runJobs()
	for _, p := range t.list() {
		if p == nil {
			continue
		}
		if p.drainIn() {
			worked = true
		}
		if p.flushOut() {
			worked = true
		}
	}
	t.checkLivenessDue()
	return worked
}

// checkLivenessDue runs checkLiveness if the last look is more than 5 ms old. Under
// drv.Mu.
func (t *Transport) checkLivenessDue() {
	if now := nanotime(); now-t.lastCheck.Load() > int64(5*time.Millisecond) {
		t.lastCheck.Store(now)
		t.checkLiveness()
	}
}

// livenessEvery is how often watchPeers looks at the peers while nothing else does.
const livenessEvery = 20 * time.Millisecond

// watchPeers looks at the peers' liveness every livenessEvery, so that a peer that dies
// while every goroutine here sleeps fails what is pending with it. It sleeps on a Go
// timer, not in a system call: the Go runtime takes the P of a goroutine that stays in a
// system call (the progress loop's futex wait) and then, as a bet that work resumes,
// polls every 20 µs for a millisecond, on a CPU that ranks may be short of. Waking the
// progress loop every 20 ms for this kept it at that pace: with 4 ranks on 2 CPUs, an
// AlltoAll of 256 bytes took 8.2-11.1 us, and 6.3-8.2 with the loop left asleep (runs of
// 10^5 operations, alternating; 20% fewer context switches).
func (t *Transport) watchPeers() {
	defer t.wg.Done()
	tick := time.NewTicker(livenessEvery)
	defer tick.Stop()
	for {
		select {
		case <-t.stop:
			return
		case <-tick.C:
		}
		t.drv.Mu.Lock()
		t.checkLivenessDue()
		t.drv.Mu.Unlock()
		if t.quiet.Load() && t.drv.Waiters() == 0 {
			// The loop sleeps unannounced and nobody drives: announce it, and wake it
			// for what the last waiter left behind (see release).
			atomic.StoreUint32(t.own.u32(offSleeping), 1)
			if t.anyWork() {
				t.drv.Handoff()
			}
		}
	}
}

func (t *Transport) progress() {
	defer t.wg.Done()
	sleeping := t.own.u32(offSleeping)
	doorbell := t.own.u32(offDoorbell)
	for {
		select {
		case <-t.stop:
			return
		default:
		}
		t.drv.Mu.Lock()
		worked := t.step()
		t.drv.Mu.Unlock()
		if worked {
			continue
		}
		// Park on the doorbell at once: waiting goroutines do the spinning (they poll the
		// rings themselves); a progress goroutine that spun too would take the process's
		// spinner slot from them and double the wake-ups. Announce (unless waiters poll:
		// then producers need not wake us; the last waiter wakes us when it parks or
		// leaves work that a peer waits for, and watchPeers announces us when no
		// waiter is left: see release), look once more, sleep. quiet is raised before
		// Waiters is read, and a leaving waiter counts itself out before it reads
		// quiet: one of the two sees the other.
		seq := atomic.LoadUint32(doorbell)
		t.quiet.Store(true)
		if t.drv.Waiters() == 0 {
			atomic.StoreUint32(sleeping, 1)
		}
		if !t.anyWork() {
			t.parks.Add(1)
			if t.rawParks() {
				futexPark(doorbell, seq, int64(min(rawNap, progressNap)))
			} else {
				futexWaitOn(doorbell, seq, int64(progressNap))
			}
		}
		t.quiet.Store(false)
		atomic.StoreUint32(sleeping, 0)
	}
}

// release is the driver's Release: the last waiter stopped driving, and the progress
// loop may sleep unannounced (it left the work to the waiters). Wake it if a peer waits
// for work that only this process can do (urgentWork). Frames that arrived for requests
// nobody waits on yet stay in the ring for the next waiter, or for watchPeers within
// livenessEvery, which also announces the loop again: announcing it here, so that every
// frame from then on woke it, and waking it for any work, made an AlltoAll over the
// rings of 8 ranks on 2 CPUs (MOEX_ALGO=alltoall:linear, 64 KiB) take 381-565 us against
// 97-406 (4 runs, alternating): each operation's next wait follows at once, and the
// loop's wake-ups only take CPU from the ranks.
func (t *Transport) release() {
	t.life.RLock() // a waiter may leave after Close (or Kill) unmapped the segments
	defer t.life.RUnlock()
	if !t.closed.Load() && t.quiet.Load() && t.urgentWork() {
		t.ringOwn()
	}
}

// wakeLoop is the driver's Handoff: it wakes the progress loop, whatever its flag says,
// unless Close has unmapped this rank's segment.
func (t *Transport) wakeLoop() {
	t.life.RLock()
	if t.own.mem != nil {
		t.ringOwn()
	}
	t.life.RUnlock()
}

// ringOwn rings this rank's own doorbell and wakes the progress loop.
func (t *Transport) ringOwn() {
	atomic.AddUint32(t.own.u32(offDoorbell), 1)
	futexWake(t.own.u32(offDoorbell))
}

// urgentWork reports work that a peer waits for and only this process can do: copies
// queued, frames or streams to send into a ring with room, a ring to this rank that its
// producer found full.
func (t *Transport) urgentWork() bool {
	return t.work(func(p *peer) bool { return atomic.LoadUint32(p.in.wantSpace()) != 0 || p.hasOutWork() })
}

// progressNap bounds the progress loop's sleep: every wake-up that matters comes
// through the doorbell (frames, goodbyes, Close), the last waiter (release) or
// watchPeers. The package's tests make it an hour, so that a lost wake-up hangs a test
// instead of costing a nap.
var progressNap = time.Second

var epoch = time.Now()

func nanotime() int64 { return int64(time.Since(epoch)) }

// anyWork reports work for the progress loop: the transport stopping, copies queued,
// or a peer's (peer.hasWork).
func (t *Transport) anyWork() bool {
	select {
	case <-t.stop:
		return true
	default:
	}
	return t.work((*peer).hasWork)
}

// work reports copies queued, or a peer for which has reports work.
func (t *Transport) work(has func(*peer) bool) bool {
	t.jobMu.Lock()
	j := len(t.jobs) > 0
	t.jobMu.Unlock()
	if j {
		return true
	}
	for _, p := range t.list() {
		if p != nil && has(p) {
			return true
		}
	}
	return false
}

// ---- requests ----

func (t *Transport) peerFor(peer int) (*peer, error) {
	if err := transport.CheckPeer(peer, t.size); err != nil {
		return nil, err
	}
	if t.closed.Load() {
		return nil, transport.ErrClosed
	}
	p := t.list()[peer]
	switch {
	case p != nil || peer == t.rank:
	case t.lost != nil && t.lost[peer]:
		return nil, &transport.PeerError{Rank: peer, Op: "connect", Err: fmt.Errorf("%w: not live when this process took over its rank", transport.ErrPeerClosed)}
	default:
		return nil, &transport.ArgError{Arg: "peer", Reason: fmt.Sprintf("rank %d is not on this host", peer)}
	}
	return p, nil
}

// Isend implements transport.Transport.
func (t *Transport) Isend(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	t.life.RLock()
	defer t.life.RUnlock()
	p, err := t.peerFor(peer)
	if err != nil {
		return nil, err
	}
	if p == nil {
		return t.self.Isend(0, tag, buf)
	}
	return t.eng.Isend(p.c, tag, buf), nil
}

// Irecv implements transport.Transport.
func (t *Transport) Irecv(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	t.life.RLock()
	defer t.life.RUnlock()
	p, err := t.peerFor(peer)
	if err != nil {
		return nil, err
	}
	if p == nil {
		return t.self.Irecv(0, tag, buf)
	}
	return t.eng.Irecv(p.c, tag, buf), nil
}

func verify(h *wire.Header, pl payload) error {
	d := xxhash.New()
	d.Write(pl.a)
	d.Write(pl.b)
	if d.Sum64() != h.Sum {
		return wire.ErrChecksum
	}
	return nil
}
