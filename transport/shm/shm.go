// Package shm is the transport between ranks that are processes on one host: one
// /dev/shm segment per rank holding a single-producer single-consumer ring of slots per
// source rank, synchronised with atomics, for small messages; large messages move in one
// copy, the receiver reading the sender's buffer with process_vm_readv (cross-memory
// attach), or, where the kernel refuses that, in pipelined ring copies.
//
// Each rank runs one progress goroutine that polls its incoming rings under the adaptive
// busy-poll policy and parks on a futex in its segment when idle; producers ring that
// doorbell after publishing. Segments are unlinked as soon as every rank has mapped them,
// so nothing is left in /dev/shm when processes exit, however they exit; segments of jobs
// that died during start-up are found by their pid and removed at the next start.
// A peer process that dies is detected through a pidfd, and every pending operation
// with it fails with an error naming it.
//
// The package owns its segments, mappings, pidfds and progress goroutine; Close releases
// all of them.
package shm

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/inproc"
	"github.com/moex-ai/moex/transport/internal/core"
)

// Defaults.
const (
	DefaultSlots    = 64
	DefaultSlotSize = 16 << 10
	// MaxEager is the largest message copied through the ring (spanning several slots);
	// larger ones move in one copy across (cma). Below it, two copies cost less than the
	// announcement's round trip.
	MaxEager = 64 << 10
)

// Config describes one rank's endpoint.
type Config struct {
	Rank, Size int
	// Local[q] says rank q is on this host; nil means every rank is. Operations with other
	// ranks are refused (a transport.Mux sends them elsewhere).
	Local []bool
	// Exchange all-gathers one blob per rank (the rendezvous store's AllGather); used
	// twice during New.
	Exchange func(ctx context.Context, mine []byte) ([][]byte, error)
	Slots    int // slots per ring (default 64)
	SlotSize int // bytes per slot, header included (default 16 KiB)
	// CMA: 0 detects whether process_vm_readv works between the ranks; -1 never uses it
	// (large messages go through the rings); 1 requires it.
	CMA int
	// Rewind: 0 lets a producer that finds its ring empty go back to the ring's first slot
	// when ranks outnumber CPUs (Poll.Oversubscribed), 1 always, -1 never. Measured with
	// moex bench coll (alltoall, 64 KiB per rank, 2 CPUs): P=8 about 1.6x faster, P=4 about
	// 1.15x, but P=2 (a CPU per rank, spinning) about 1.8x slower, hence the default.
	Rewind int
	// Stream: 0 copies the blocks that Direct reads in place from shared buffers with
	// streaming stores when the operation touches more than the last-level cache (see
	// Direct's footprint), and copies into the shared area so once plain copies prove
	// slow there (ranks on CPUs that share no cache); 1 always streams both, -1 never.
	Stream int
	// AreaBytes is the largest send buffer that Direct's collectives copy through this
	// rank's shared area, which holds three times as much (0: DefaultAreaBytes; negative:
	// no area, no Direct).
	AreaBytes   int
	Poll        busypoll.Config
	Poller      *busypoll.Poller
	Pool        *obuf.Pool
	Logger      *slog.Logger
	CancelGrace time.Duration
}

// ConfigFromEnv reads MOEX_SHM_CMA, MOEX_SHM_REWIND and MOEX_SHM_STREAM (auto, 0, 1), MOEX_SHM_AREA (KiB:
// AreaBytes; 0 turns the area off) and the polling variables.
func (c *Config) ConfigFromEnv(getenv func(string) string) error {
	for _, v := range []struct {
		name string
		dst  *int
	}{{"MOEX_SHM_CMA", &c.CMA}, {"MOEX_SHM_REWIND", &c.Rewind}, {"MOEX_SHM_STREAM", &c.Stream}} {
		switch s := getenv(v.name); s {
		case "", "auto":
		case "0", "off":
			*v.dst = -1
		case "1", "on":
			*v.dst = 1
		default:
			return &transport.EnvError{Var: v.name, Value: s, Reason: "want auto, 0 or 1"}
		}
	}
	if s := getenv("MOEX_SHM_AREA"); s != "" {
		n, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSuffix(s, "K"), "k"))
		if err != nil || n < 0 {
			return &transport.EnvError{Var: "MOEX_SHM_AREA", Value: s, Reason: "want KiB, the largest buffer through the shared area (0: no area)"}
		}
		c.AreaBytes = n << 10
		if n == 0 {
			c.AreaBytes = -1
		}
	}
	p, err := busypoll.ConfigFromEnv(getenv)
	if err != nil {
		return err
	}
	c.Poll = p
	return nil
}

// EnvVars are the variables the shared-memory transport reads.
var EnvVars = []transport.EnvVar{
	{Name: "MOEX_SHM_CMA", Default: "auto", Meaning: "auto, 1 or 0: large shared-memory messages with process_vm_readv, or through the rings", Owner: "transport/shm"},
	{Name: "MOEX_SHM_REWIND", Default: "auto (on when ranks outnumber cores)", Meaning: "auto, 1 or 0: a producer that finds its shared-memory ring empty starts again at its first slot", Owner: "transport/shm"},
	{Name: "MOEX_SHM_STREAM", Default: "auto (when an operation touches more than the last-level cache)", Meaning: "auto, 1 or 0: non-temporal stores for blocks read in place, and for copies into the shared area (auto: those where plain copies prove slow, as between CPUs that share no cache)", Owner: "transport/shm"},
	{Name: "MOEX_SHM_AREA", Default: strconv.Itoa(DefaultAreaBytes >> 10), Meaning: "KiB: the largest send buffer a shared-area collective takes (0: no area)", Owner: "transport/shm"},
}

// Stats counts traffic.
type Stats struct {
	SlotsOut, SlotsIn uint64
	CMABytes          uint64 // bytes read with process_vm_readv
	SharedBytes       uint64 // bytes read in place from the peers' shared buffers (obuf.NewSharedPool)
	RingBytes         uint64 // payload bytes through the rings
	Parks             uint64 // times the progress loop slept on its doorbell
	FullRing          uint64 // times a producer found a ring full
	Rewinds           uint64 // times a producer found its ring empty and went back to its start
	DirectOps         uint64 // collectives run through the shared areas (package coll/shared)
	DirectParks       uint64 // times one of them slept waiting for the other ranks
	DirectTimeouts    uint64 // ... and woke by the timeout, not by a rank (ctx and liveness checks)
}

// Transport is one rank's shared-memory endpoint.
type Transport struct {
	rank, size int
	slotSize   int
	eager      int
	rewind     bool // producers rewind empty rings (see Config.Rewind)
	stream     int  // Config.Stream
	grace      time.Duration
	poller     *busypoll.Poller
	waitPoller *busypoll.Poller
	pool       *obuf.Pool
	log        *slog.Logger

	own      *segment
	lost     []bool                  // ranks that were not live when this process took over its rank (Join)
	peerList atomic.Pointer[[]*peer] // per rank, nil for this one and those on other hosts; replaced whole (Readmit)
	self     *inproc.Transport
	eng      core.Engine[sendX, recvX]

	jobMu sync.Mutex
	jobs  []*recvReq // matched announcements waiting for their copy
	spare []*recvReq

	liov [1]unix.Iovec // process_vm_readv vectors (progress loop only)
	riov [1]unix.RemoteIovec

	closed    atomic.Bool
	drv       core.Driver  // waiting goroutines drive progress themselves
	lastCheck atomic.Int64 // last liveness check (nanotime)
	quiet     atomic.Bool  // the progress loop is going to sleep or sleeps, maybe unannounced
	life      sync.RWMutex // held shared while touching peers' mappings; Close takes it to unmap
	stop      chan struct{}
	wg        sync.WaitGroup
	mode      string
	areasFree atomic.Bool // Areas not claimed yet

	slotsOut, slotsIn, cmaBytes, ringBytes, parks, full, rewinds atomic.Uint64
	areaOps, areaParks, areaTimeouts, sharedBytes                atomic.Uint64
	windows, winParks                                            atomic.Uint64
	oversubscribed                                               bool // ranks outnumber CPUs (Config.Poll): see rawParks
}

var _ transport.Transport = (*Transport)(nil)
var _ transport.PathReporter = (*Transport)(nil)

// setup blob: name, pid, address of a probe word for the CMA check.
type hello struct {
	name  string
	pid   int
	probe uint64
}

func (h hello) encode() []byte {
	b := binary.LittleEndian.AppendUint32(nil, uint32(h.pid))
	b = binary.LittleEndian.AppendUint64(b, h.probe)
	return append(b, h.name...)
}

func decodeHello(b []byte) (hello, bool) {
	if len(b) < 12 {
		return hello{}, false
	}
	return hello{pid: int(binary.LittleEndian.Uint32(b)), probe: binary.LittleEndian.Uint64(b[4:]), name: string(b[12:])}, true
}

// probeWord is read by peers to test cross-memory attach.
var probeWord = [8]byte{'m', 'o', 'e', 'x', 'c', 'm', 'a', '!'}

// New creates this rank's segment, exchanges names with the other ranks on this host,
// maps their segments, tests cross-memory attach, unlinks its segment once everyone has
// mapped it, and starts the progress loop.
func New(ctx context.Context, cfg Config) (*Transport, error) {
	if cfg.Size > 1 && cfg.Exchange == nil {
		return nil, &transport.ArgError{Arg: "Exchange", Reason: "nil with more than one rank"}
	}
	t, err := newTransport(&cfg)
	if err != nil {
		return nil, err
	}
	local := cfg.Local
	if local == nil {
		local = make([]bool, cfg.Size)
		for i := range local {
			local[i] = true
		}
	}
	own := t.own
	fail := func(err error) (*Transport, error) {
		os.Remove(DevShm + "/" + own.name)
		t.unmapAll()
		return nil, err
	}
	peers := make([]*peer, cfg.Size)
	t.peerList.Store(&peers)
	if cfg.Size == 1 {
		os.Remove(DevShm + "/" + own.name)
		t.mode = "single rank"
		t.start()
		return t, nil
	}
	me := hello{name: own.name, pid: os.Getpid(), probe: uint64(uintptr(unsafe.Pointer(&probeWord[0])))}
	if !local[cfg.Rank] {
		me = hello{}
	}
	blobs, err := cfg.Exchange(ctx, me.encode())
	if err != nil {
		return fail(fmt.Errorf("shm: exchanging segment names: %w", err))
	}
	cmaOK := true
	var cmaErr error
	for q := 0; q < cfg.Size; q++ {
		if q == cfg.Rank || !local[q] {
			continue
		}
		h, ok := decodeHello(blobs[q])
		if !ok || h.name == "" {
			return fail(fmt.Errorf("shm: rank %d is said to be on this host but published no segment", q))
		}
		seg, err := openSegment(h.name, q, cfg.Size)
		if err != nil {
			return fail(err)
		}
		p := t.newPeer(q, seg, h.pid)
		peers[q] = p
		if cfg.CMA >= 0 && cmaErr == nil {
			if err := probeCMA(q, h.pid, h.probe); err != nil {
				cmaOK = false
				cmaErr = err
			}
		}
	}
	if err := t.setMode(cfg.CMA, cmaOK, cmaErr); err != nil {
		return fail(err)
	}
	// Every rank has mapped every segment: unlink ours, so that it disappears with the
	// last process that maps it, whatever happens to them.
	if _, err := cfg.Exchange(ctx, nil); err != nil {
		return fail(fmt.Errorf("shm: start-up barrier: %w", err))
	}
	os.Remove(DevShm + "/" + own.name)
	t.start()
	t.log.Info("moex shm: ready", "rank", cfg.Rank, "mode", t.mode, "slots", cfg.Slots, "slot_size", cfg.SlotSize)
	return t, nil
}

// newPeer is the peer of rank q, whose process pid has the segment seg, which this rank
// writes into (the peer reads from this rank through this rank's own segment).
func (t *Transport) newPeer(q int, seg *segment, pid int) *peer {
	p := &peer{t: t, rank: q, seg: seg, pid: pid, in: t.own.ring(q), out: seg.ring(t.rank), pidfd: -1, arena: peerArena{fd: -1}}
	p.c = core.NewPeer[sendX, recvX](q, p)
	if fd, err := unix.PidfdOpen(pid, 0); err == nil {
		p.pidfd = fd
	}
	return p
}

// probeCMA reads probeWord at addr in rank's process pid with process_vm_readv.
func probeCMA(rank, pid int, addr uint64) error {
	var got [8]byte
	local := []unix.Iovec{{Base: &got[0], Len: 8}}
	remote := []unix.RemoteIovec{{Base: uintptr(addr), Len: 8}}
	n, err := processVMReadv(pid, local, remote, 0)
	switch {
	case err != nil:
		return ptraceErr("process_vm_readv", rank, pid, fmt.Errorf("rank %d (pid %d): %w", rank, pid, err))
	case n != 8 || got != probeWord:
		return fmt.Errorf("process_vm_readv from rank %d (pid %d): read %d bytes, %x", rank, pid, n, got)
	}
	return nil
}

// setMode says how large messages move, from the configuration (cma) and whether
// cross-memory attach works with every peer (ok; else why not), and sets the peers'.
func (t *Transport) setMode(cma int, ok bool, why error) error {
	switch {
	case cma < 0:
		ok = false
		t.mode = "ring copies (cross-memory attach disabled by configuration)"
	case ok:
		t.mode = "cma single copy for messages over " + strconv.Itoa(t.eager) + " B"
	case cma > 0:
		return fmt.Errorf("shm: cross-memory attach required but refused: %w", why)
	default:
		t.mode = "ring copies (cross-memory attach refused: " + why.Error() + ")"
		t.log.Warn("moex shm: process_vm_readv refused; large messages go through the rings", "rank", t.rank, "err", why)
	}
	for _, p := range t.list() {
		if p != nil {
			p.cma = ok
		}
	}
	return nil
}

// newTransport checks cfg and fills in its defaults, and makes the transport with its
// own segment (not yet published, no peers, not started).
func newTransport(cfgp *Config) (*Transport, error) {
	cfg := *cfgp
	defer func() { *cfgp = cfg }()
	if cfg.Size < 1 || cfg.Rank < 0 || cfg.Rank >= cfg.Size {
		return nil, &transport.ArgError{Arg: "rank", Reason: fmt.Sprintf("rank %d of %d", cfg.Rank, cfg.Size)}
	}
	if cfg.Local != nil && len(cfg.Local) != cfg.Size {
		return nil, &transport.ArgError{Arg: "Local", Reason: fmt.Sprintf("%d entries for %d ranks", len(cfg.Local), cfg.Size)}
	}
	if cfg.Slots <= 0 {
		cfg.Slots = DefaultSlots
	}
	if cfg.SlotSize <= 0 {
		cfg.SlotSize = DefaultSlotSize
	}
	if cfg.SlotSize < 1024 || cfg.SlotSize%64 != 0 {
		return nil, &transport.ArgError{Arg: "SlotSize", Reason: fmt.Sprintf("%d: want a multiple of 64, at least 1024", cfg.SlotSize)}
	}
	t := &Transport{
		rank: cfg.Rank, size: cfg.Size, slotSize: cfg.SlotSize,
		eager:  min(MaxEager, cfg.Slots/2*cfg.SlotSize-hdrSize),
		rewind: cfg.Rewind > 0 || (cfg.Rewind == 0 && cfg.Poll.Oversubscribed), stream: cfg.Stream, oversubscribed: cfg.Poll.Oversubscribed,
		grace: cfg.CancelGrace, poller: cfg.Poller, pool: cfg.Pool, log: cfg.Logger, stop: make(chan struct{}),
	}
	if t.grace <= 0 {
		t.grace = 5 * time.Second
	}
	if t.poller == nil {
		t.poller = busypoll.New(cfg.Poll)
	}
	t.waitPoller = busypoll.New(busypoll.Config{Mode: busypoll.Block})
	t.drv = core.Driver{Step: t.step, Closed: t.closed.Load, Poller: t.poller, Park: t.waitPoller,
		Handoff: t.wakeLoop, Release: t.release}
	if t.pool == nil {
		t.pool = obuf.Default
	}
	if t.log == nil {
		t.log = slog.New(slog.DiscardHandler)
	}
	t.self = inproc.New(1, inproc.Config{Poller: t.waitPoller, Pool: t.pool})[0]
	t.eng = core.Engine[sendX, recvX]{Rank: t.rank, Name: "shm", EagerMax: t.eager, Pool: t.pool, Closed: t.closed.Load,
		Await: t.drv.Await, GracePoller: t.waitPoller, Grace: t.grace, Log: t.log}
	if removed, _ := CleanStale(); len(removed) > 0 {
		t.log.Info("moex shm: removed segments of dead processes", "segments", removed)
	}
	if g, err := GrantPeers(); err != nil || g == PtraceRefused {
		t.log.Warn("moex shm: the peers cannot read this process (ptrace); large messages go through the rings", "rank", t.rank, "ptrace", g, "err", err)
	} else {
		t.log.Debug("moex shm: ptrace for the peers", "rank", t.rank, "ptrace", g)
	}
	var jb [6]byte
	_, _ = rand.Read(jb[:])
	switch {
	case cfg.AreaBytes == 0:
		cfg.AreaBytes = DefaultAreaBytes
	case cfg.AreaBytes < 0:
		cfg.AreaBytes = 0
	case cfg.AreaBytes%64 != 0 || cfg.AreaBytes > 1<<30:
		return nil, &transport.ArgError{Arg: "AreaBytes", Reason: fmt.Sprintf("%d: want a multiple of 64, at most 1 GiB", cfg.AreaBytes)}
	}
	t.areasFree.Store(true)
	own, err := createSegment(segmentName(hex.EncodeToString(jb[:]), cfg.Rank), cfg.Rank, cfg.Size, cfg.Slots, cfg.SlotSize, cfg.AreaBytes)
	if err != nil {
		return nil, err
	}
	t.own = own
	return t, nil
}

// list is the peers, by rank (nil: this rank, and those on other hosts).
func (t *Transport) list() []*peer {
	if l := t.peerList.Load(); l != nil {
		return *l
	}
	return nil
}

func (t *Transport) start() {
	openTransports.Add(1)
	t.wg.Add(2)
	go t.progress()
	go t.watchPeers()
}

func (t *Transport) unmapAll() {
	for _, p := range t.list() {
		if p != nil {
			p.seg.unmap()
			p.closeArena()
			if p.pidfd >= 0 {
				unix.Close(p.pidfd)
				p.pidfd = -1
			}
		}
	}
	if t.own != nil {
		t.own.unmap()
	}
}

// Rank implements transport.Transport.
func (t *Transport) Rank() int { return t.rank }

// Size implements transport.Transport.
func (t *Transport) Size() int { return t.size }

// Name implements transport.Transport.
func (t *Transport) Name() string { return "shm" }

// Poller returns the progress loop's poller (for its counters).
func (t *Transport) Poller() *busypoll.Poller { return t.poller }

// Mode says how large messages move ("cma single copy ..." or "ring copies (...)").
func (t *Transport) Mode() string { return t.mode }

// Path implements transport.PathReporter.
func (t *Transport) Path(peer int) string {
	switch {
	case peer == t.rank:
		return "shm: self, in-process copy"
	case peer < 0 || peer >= t.size || t.list()[peer] == nil:
		return "shm: not on this host"
	}
	rings := "rings"
	if t.rewind {
		rings = "rings (rewound when empty)"
	}
	area := "no shared area"
	if t.own.areaCap > 0 {
		area = fmt.Sprintf("shared area for AlltoAll up to %d KiB", t.own.areaCap>>10)
		if t.list()[peer].cma {
			area += fmt.Sprintf(" (send buffers from obuf.Shared read in place from %d KiB)", SharedMin>>10)
		}
	}
	return fmt.Sprintf("shm: same host (pid %d), %d-slot %s of %d B, %s, %s, progress poll %s",
		t.list()[peer].pid, t.own.slots, rings, t.slotSize, t.mode, area, t.poller.Mode())
}

// Stats returns the counters.
func (t *Transport) Stats() Stats {
	return Stats{SlotsOut: t.slotsOut.Load(), SlotsIn: t.slotsIn.Load(), CMABytes: t.cmaBytes.Load(),
		RingBytes: t.ringBytes.Load(), Parks: t.parks.Load(), FullRing: t.full.Load(),
		Rewinds: t.rewinds.Load(), DirectOps: t.areaOps.Load(), DirectParks: t.areaParks.Load(),
		DirectTimeouts: t.areaTimeouts.Load(), SharedBytes: t.sharedBytes.Load()}
}

// Counters implements transport.Counting.
func (t *Transport) Counters() transport.Counters {
	return transport.Counters{MessagesOut: t.slotsOut.Load(), MessagesIn: t.slotsIn.Load(),
		BytesIn: t.ringBytes.Load() + t.cmaBytes.Load() + t.sharedBytes.Load(), Slots: t.slotsOut.Load()}
}

var (
	_ transport.Counting = (*Transport)(nil)
	_ transport.Killer   = (*Transport)(nil)
)

// Close tells the peers, stops the progress loop and unmaps everything. Pending requests
// complete with ErrClosed.
func (t *Transport) Close() error {
	if t.closed.Swap(true) {
		return nil
	}
	for _, p := range t.list() {
		if p != nil {
			p.bye()
		}
	}
	return t.shutdown()
}

// Kill stops without telling anyone, as a crash would (for tests; the peers see this
// process as dead only if it really exits, so tests mark the segment closed too).
func (t *Transport) Kill() {
	if t.closed.Swap(true) {
		return
	}
	_ = t.shutdown()
}

// shutdown marks the segment closed, stops the progress loop, fails what is pending and
// unmaps everything (Close after its goodbyes, Kill without them).
func (t *Transport) shutdown() error {
	openTransports.Add(-1)
	atomic.StoreUint32(t.own.u32(offState), stateClosed)
	close(t.stop)
	t.drv.Handoff() // the loop may sleep unannounced: wake it whatever its flag says
	t.wg.Wait()
	for _, p := range t.list() {
		if p != nil {
			p.fail(transport.ErrClosed)
		}
	}
	t.failJobs()
	// Requests take life; a goroutine that waits may drive the rings itself
	// (core.Driver.TryStep) under drv.Mu, after the loop stopped: hold both, in rejoin's
	// order, so that nothing reads a segment while it is unmapped. The driver sees the
	// transport closed afterwards and steps no more.
	t.life.Lock()
	t.drv.Mu.Lock()
	t.unmapAll()
	t.drv.Mu.Unlock()
	t.life.Unlock()
	return t.self.Close()
}

// InjectRaw writes b into the ring to peer as one slot, bypassing framing (for tests).
func (t *Transport) InjectRaw(peer int, b []byte) error {
	if peer == t.rank || peer < 0 || peer >= t.size || t.list()[peer] == nil {
		return &transport.ArgError{Arg: "peer", Reason: "no ring"}
	}
	p := t.list()[peer]
	p.outMu.Lock()
	defer p.outMu.Unlock()
	h := atomic.LoadUint64(p.out.head())
	if h-atomic.LoadUint64(p.out.tail()) >= p.out.slots {
		return errors.New("shm: ring full")
	}
	s := p.out.slot(h)
	clear(s)
	copy(s, b)
	atomic.StoreUint64(p.out.head(), h+1)
	p.seg.ringDoorbell()
	return nil
}
