package shm

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/internal/wire"
	"github.com/moex-ai/moex/transport"
)

// A rank whose process died can be taken over by a new process on the same host while
// the job runs: the new process makes its segment (Join) and says where (Joiner.Addr,
// through the job's registry); the live ranks agree to admit it, and each maps that
// segment, forgets the dead process's ring into its own segment, and writes a greeting
// into its ring of the new segment (Readmit): its pid, its own segment's file descriptor
// and the live ranks. The new process takes each live rank's segment from its process
// (pidfd_getfd: the segments are unlinked once mapped) and becomes a Transport connected
// to each of them (Joiner.Accept). Only processes of the job's user can open a segment
// (mode 0600); the job's secret is checked where the address is published (the registry).

// ErrReplaced is what operations with a peer still thought alive complete with when
// Readmit gives its rank to a new process.
var ErrReplaced = fmt.Errorf("%w: its rank was given to a replacement", transport.ErrPeerClosed)

// joinMagic starts a live rank's greeting to a new process.
const joinMagic = "MXSJ"

// AddrPrefix starts the address of a Joiner (Joiner.Addr).
const AddrPrefix = "shm:"

// greeting is a live rank's greeting to a new process.
type greeting struct {
	rank, size, pid, segFD int
	probe                  uint64 // the address of its probeWord (cross-memory attach)
	members                []int  // the live ranks, as every one of them names them
}

func (g greeting) encode() []byte {
	le := binary.LittleEndian
	b := []byte(joinMagic)
	for _, v := range []int{g.rank, g.size, g.pid, g.segFD} {
		b = le.AppendUint32(b, uint32(v))
	}
	b = le.AppendUint64(b, g.probe)
	b = le.AppendUint32(b, uint32(len(g.members)))
	for _, m := range g.members {
		b = le.AppendUint32(b, uint32(m))
	}
	return b
}

func decodeGreeting(b []byte) (greeting, error) {
	le := binary.LittleEndian
	const head = 4 + 16 + 8 + 4
	if len(b) < head || string(b[:4]) != joinMagic {
		return greeting{}, fmt.Errorf("%w: bad greeting of a live rank", transport.ErrProtocol)
	}
	g := greeting{rank: int(le.Uint32(b[4:])), size: int(le.Uint32(b[8:])), pid: int(le.Uint32(b[12:])),
		segFD: int(le.Uint32(b[16:])), probe: le.Uint64(b[20:])}
	n := int(le.Uint32(b[28:]))
	if n < 1 || n >= g.size || len(b) != head+4*n {
		return greeting{}, fmt.Errorf("%w: a greeting of %d bytes naming %d live ranks of %d", transport.ErrProtocol, len(b), n, g.size)
	}
	g.members = make([]int, n)
	for i := range g.members {
		g.members[i] = int(le.Uint32(b[head+4*i:]))
	}
	return g, nil
}

// Joiner is a process taking over rank cfg.Rank of a running job whose ranks are all on
// this host: it has made its segment and waits for the live ranks to greet it.
type Joiner struct {
	t   *Transport
	cfg Config
}

// Join starts taking over rank cfg.Rank of cfg.Size ranks (cfg.Exchange and cfg.Local are
// not used; Slots, SlotSize and AreaBytes must be the live ranks'): it makes this rank's
// segment, where the live ranks find it at Addr, once they agree to admit it (Readmit).
func Join(cfg Config) (*Joiner, error) {
	if cfg.Size < 2 {
		return nil, &transport.ArgError{Arg: "Size", Reason: fmt.Sprintf("%d: a new process joins a job of at least two ranks", cfg.Size)}
	}
	t, err := newTransport(&cfg)
	if err != nil {
		return nil, err
	}
	peers := make([]*peer, cfg.Size)
	t.peerList.Store(&peers)
	return &Joiner{t: t, cfg: cfg}, nil
}

// Addr is where the live ranks find the new process: its segment's name, its pid and the
// address of its cross-memory probe.
func (j *Joiner) Addr() string {
	return fmt.Sprintf("%s%s:%d:%x", AddrPrefix, j.t.own.name, os.Getpid(), uintptr(unsafe.Pointer(&probeWord[0])))
}

// parseAddr reads a Joiner's Addr.
func parseAddr(addr string) (name string, pid int, probe uint64, err error) {
	rest, ok := strings.CutPrefix(addr, AddrPrefix)
	f := strings.Split(rest, ":")
	if ok && len(f) == 3 && strings.HasPrefix(f[0], segPrefix) && !strings.ContainsAny(f[0], "/\x00") {
		pid, err1 := strconv.Atoi(f[1])
		probe, err2 := strconv.ParseUint(f[2], 16, 64)
		if err1 == nil && err2 == nil && pid > 0 {
			return f[0], pid, probe, nil
		}
	}
	return "", 0, 0, &transport.ArgError{Arg: "addr", Reason: fmt.Sprintf("%q is not a shared-memory joiner's address (%s<segment>:<pid>:<probe>)", addr, AddrPrefix)}
}

// Accept waits, until ctx ends, for every live rank to greet the new process, and returns
// its transport and the live ranks, as their greetings name them (the greetings must
// agree). Operations with a rank that was not live fail. The segment is unlinked when
// Accept returns; on error everything is released.
func (j *Joiner) Accept(ctx context.Context) (*Transport, []int, error) {
	t := j.t
	defer os.Remove(DevShm + "/" + t.own.name)
	greets, err := j.greetings(ctx)
	if err == nil {
		err = j.connect(greets)
	}
	if err != nil {
		atomic.StoreUint32(t.own.u32(offState), stateClosed)
		t.unmapAll()
		return nil, nil, err
	}
	members := greets[slices.IndexFunc(greets, func(g *greeting) bool { return g != nil })].members
	t.lost = make([]bool, t.size)
	for q := range t.lost {
		t.lost[q] = q != t.rank && !slices.Contains(members, q)
	}
	t.start()
	t.log.Info("moex shm: took over a rank", "rank", t.rank, "live", members, "mode", t.mode)
	return t, slices.Clone(members), nil
}

// greetings reads the live ranks' greetings, the first frame of each ring into this
// rank's segment, until every rank the first names has greeted.
func (j *Joiner) greetings(ctx context.Context) ([]*greeting, error) {
	t := j.t
	greets := make([]*greeting, t.size)
	var members []int
	doorbell, sleeping := t.own.u32(offDoorbell), t.own.u32(offSleeping)
	atomic.StoreUint32(sleeping, 1) // the live ranks wake this process after greeting
	defer atomic.StoreUint32(sleeping, 0)
	for {
		seq := atomic.LoadUint32(doorbell)
		for q := range t.size {
			if q == t.rank || greets[q] != nil {
				continue
			}
			r := t.own.ring(q)
			if atomic.LoadUint64(r.head()) == 0 {
				continue
			}
			g, err := readGreeting(r, q, t.size)
			if err == nil && members != nil && !slices.Equal(members, g.members) {
				err = fmt.Errorf("%w: rank %d names live ranks %v, another %v", transport.ErrProtocol, q, g.members, members)
			}
			if err == nil && (!slices.Contains(g.members, q) || slices.Contains(g.members, t.rank)) {
				err = fmt.Errorf("%w: rank %d names live ranks %v", transport.ErrProtocol, q, g.members)
			}
			if err != nil {
				return nil, err
			}
			greets[q], members = g, g.members
		}
		if members != nil && !slices.ContainsFunc(members, func(m int) bool { return greets[m] == nil }) {
			return greets, nil
		}
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("shm: rank %d waited for the live ranks' greetings (%d came): %w", t.rank, countGreeted(greets), transport.CtxError(err))
		}
		futexWaitOn(doorbell, seq, int64(5*time.Millisecond))
	}
}

func countGreeted(greets []*greeting) int {
	n := 0
	for _, g := range greets {
		if g != nil {
			n++
		}
	}
	return n
}

// readGreeting consumes the greeting at the start of ring r, from rank q.
func readGreeting(r ring, q, size int) (*greeting, error) {
	head := atomic.LoadUint64(r.head())
	var h wire.Header
	if err := h.Decode(r.slot(0)[:hdrSize]); err != nil {
		return nil, fmt.Errorf("%w: rank %d's greeting: %v", transport.ErrProtocol, q, err)
	}
	k := r.slotsFor(int(h.Length))
	if h.Type != wire.TypeHello || h.Src != uint32(q) || k > head || k > r.slots {
		return nil, fmt.Errorf("%w: rank %d's first frame is %v from %d, %d slots with %d published", transport.ErrProtocol, q, h.Type, h.Src, k, head)
	}
	d := r.data()
	g, err := decodeGreeting(d[hdrSize : hdrSize+int(h.Length)])
	if err != nil {
		return nil, err
	}
	if g.rank != q || g.size != size {
		return nil, fmt.Errorf("%w: rank %d's greeting says rank %d of %d", transport.ErrProtocol, q, g.rank, g.size)
	}
	atomic.StoreUint64(r.tail(), k)
	return &g, nil
}

// connect maps each live rank's segment, taken from its process, and makes its peer.
func (j *Joiner) connect(greets []*greeting) error {
	t := j.t
	peers := t.list()
	cmaOK := true
	var cmaErr error
	for q, g := range greets {
		if g == nil {
			continue
		}
		pidfd, err := unix.PidfdOpen(g.pid, 0)
		if err != nil {
			return &transport.PeerError{Rank: q, Op: "join", Err: fmt.Errorf("%w: process %d: %w", transport.ErrPeerClosed, g.pid, err)}
		}
		fd, err := pidfdGetfd(pidfd, g.segFD, 0)
		unix.Close(pidfd)
		if err != nil {
			return &transport.PeerError{Rank: q, Op: "join", Err: fmt.Errorf("taking rank %d's segment (fd %d): %w", q, g.segFD, ptraceErr("pidfd_getfd", q, g.pid, err))}
		}
		f := os.NewFile(uintptr(fd), "rank "+strconv.Itoa(q)+"'s segment")
		seg, err := mapSegment(f, f.Name(), q, t.size)
		f.Close()
		if err != nil {
			return err
		}
		p := t.newPeer(q, seg, g.pid)
		peers[q] = p // unmapAll releases it on error
		if p.pidfd < 0 {
			return &transport.PeerError{Rank: q, Op: "join", Err: fmt.Errorf("%w: process %d is gone", transport.ErrPeerClosed, g.pid)}
		}
		if j.cfg.CMA >= 0 && cmaErr == nil {
			if err := probeCMA(q, g.pid, g.probe); err != nil {
				cmaOK, cmaErr = false, err
			}
		}
	}
	return t.setMode(j.cfg.CMA, cmaOK, cmaErr)
}

// Close releases a Joiner whose Accept was not called.
func (j *Joiner) Close() error {
	os.Remove(DevShm + "/" + j.t.own.name)
	j.t.unmapAll()
	return j.t.self.Close()
}

// Readmit gives rank peer, whose process died, to the new process whose segment is at
// addr (Joiner.Addr): it maps that segment, forgets what the dead process left in its
// ring, and greets the new process with members (the live ranks, this one among them,
// as every one of them names them); from then on operations with peer reach the new
// process. A peer still thought alive is failed first (its operations complete with
// ErrReplaced): the caller has agreed with the other live ranks that it died. On error
// peer stays as it was (or failed).
func (t *Transport) Readmit(ctx context.Context, peer int, addr string, members []int) error {
	if err := transport.CheckReadmit(t.rank, t.size, peer, members); err != nil {
		return err
	}
	switch {
	case t.closed.Load():
		return transport.ErrClosed
	case t.list()[peer] == nil:
		return &transport.ArgError{Arg: "peer", Reason: fmt.Sprintf("rank %d is not on this host", peer)}
	}
	name, pid, probe, err := parseAddr(addr)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	seg, err := openSegment(name, peer, t.size)
	if err != nil {
		return &transport.PeerError{Rank: peer, Op: "connect", Err: err}
	}
	if seg.slots != t.own.slots || seg.slotSize != t.own.slotSize {
		seg.unmap()
		return &transport.PeerError{Rank: peer, Op: "connect", Err: fmt.Errorf("%w: its rings have %d slots of %d B, this rank's %d of %d", transport.ErrProtocol, seg.slots, seg.slotSize, t.own.slots, t.own.slotSize)}
	}
	np := t.newPeer(peer, seg, pid)
	if np.pidfd < 0 {
		seg.unmap()
		return &transport.PeerError{Rank: peer, Op: "connect", Err: fmt.Errorf("%w: process %d is gone", transport.ErrPeerClosed, pid)}
	}
	old := t.list()[peer]
	np.cma = old.cma && probeCMA(peer, pid, probe) == nil
	// Swap the peers while nothing reads them: requests take life, the progress loop
	// and the waiters that drive it drv.Mu.
	t.life.Lock()
	t.drv.Mu.Lock()
	if t.closed.Load() {
		t.drv.Mu.Unlock()
		t.life.Unlock()
		np.seg.unmap()
		unix.Close(np.pidfd)
		return transport.ErrClosed
	}
	if !old.isDead() {
		old.fail(ErrReplaced)
	}
	in := t.own.ring(peer) // the dead process's frames are dropped: nobody writes it now
	atomic.StoreUint64(in.head(), 0)
	atomic.StoreUint64(in.tail(), 0)
	atomic.StoreUint32(in.wantSpace(), 0)
	// The greeting goes first into the new process's ring, before anything else can be
	// sent to it (nothing runs here until the locks are released).
	g := greeting{rank: t.rank, size: t.size, pid: os.Getpid(), segFD: int(t.own.file.Fd()),
		probe: uint64(uintptr(unsafe.Pointer(&probeWord[0]))), members: members}
	b := g.encode()
	h := wire.Header{Type: wire.TypeHello, Src: uint32(t.rank), Length: uint64(len(b))}
	np.outMu.Lock()
	ok := np.publishLocked(&h, b)
	np.outMu.Unlock()
	if ok {
		peers := slices.Clone(t.list())
		peers[peer] = np
		t.peerList.Store(&peers)
	}
	t.drv.Mu.Unlock()
	t.life.Unlock()
	if !ok {
		np.seg.unmap()
		unix.Close(np.pidfd)
		return &transport.PeerError{Rank: peer, Op: "connect", Err: fmt.Errorf("%w: no room for a greeting of %d bytes", transport.ErrProtocol, len(b))}
	}
	old.outMu.Lock() // a late notice to the old process goes nowhere
	old.retired, old.pending, old.streams = true, nil, nil
	old.outMu.Unlock()
	old.seg.unmap()
	old.closeArena()
	if old.pidfd >= 0 {
		unix.Close(old.pidfd)
		old.pidfd = -1
	}
	np.seg.ringDoorbell()
	t.log.Info("moex shm: readmitted", "rank", t.rank, "peer", peer, "pid", pid)
	return nil
}

// Evict fails peer, admitted by Readmit, with transport.ErrEvicted: its operations
// complete with it and nothing more is sent to the process (its segment stays mapped
// until Close, as a dead peer's does).
func (t *Transport) Evict(peer int) {
	if peer < 0 || peer >= t.size || peer == t.rank || t.closed.Load() {
		return
	}
	if p := t.list()[peer]; p != nil && !p.isDead() {
		p.Fail(transport.ErrEvicted)
		t.log.Info("moex shm: evicted", "rank", t.rank, "peer", peer)
	}
}

var _ transport.Readmitter = (*Transport)(nil)
