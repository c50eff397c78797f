//go:build ucx

package ucx

/*
#cgo pkg-config: ucx
#include "ucx.h"
*/
import "C"

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/inproc"
	"github.com/moex-ai/moex/transport/internal/core"
)

// Built reports whether this binary has the UCX transport.
func Built() bool { return true }

// Version returns the UCX library version.
func Version() string { return C.GoString(C.moex_version()) }

const (
	hdrSize = int(unsafe.Sizeof(C.moex_hdr{}))
	// smallMax: messages up to this size go as one UCX message [header|payload]; larger
	// ones as the header, then the payload contiguous on a tag of its own.
	smallMax       = 8 << 10
	flagSeparate   = 1       // the payload follows on tag|payloadBit
	payloadBit     = 1 << 63 // tag space of separate payloads
	progressBudget = 16
)

// Transport is one rank's UCX endpoint.
type Transport struct {
	rank, size      int
	ctx             C.ucp_context_h
	worker          C.ucp_worker_h
	eps             []C.ucp_ep_h
	states          *C.moex_ep_state // C array, one per rank
	peers           []bool
	efd             int
	efile           *os.File        // a duplicate of efd in Go's poller (nil: poll(2) efd)
	econn           syscall.RawConn // efile's
	eReady          func(uintptr) bool
	eFirst          bool
	lenBuf          *C.size_t // C scratch for received lengths (under drv.Mu)
	memTypes        uint64    // bit per ucs_memory_type_t UCX supports
	regCalls        atomic.Int64
	memHandles      atomic.Int64 // registrations held now (window.go)
	tagSends        atomic.Uint64
	tagRecvs        atomic.Uint64
	rmaOps          atomic.Uint64
	bytesOut        atomic.Uint64
	winMu           sync.Mutex
	windows         map[*rmaWindow]struct{}
	graves          []grave // closed windows' memory and registrations, given back at Close (window.go)
	winWaiters      atomic.Int32
	bellMu          sync.Mutex
	bell            chan struct{}
	self            *inproc.Transport
	poller          *busypoll.Poller
	waitPoller      *busypoll.Poller
	log             *slog.Logger
	grace           time.Duration
	reg             *obuf.RegCache
	lanes           [][]string
	rmaLanes        []bool // per peer: the lanes do RMA and atomics (else UCX emulates them)
	emulatedWindows bool
	// noPeerErrors: UCX cannot report a failed peer on these transports.
	noPeerErrors bool
	// rdmaAll: every rank that UCX serves reaches its peers over RDMA.
	rdmaAll bool
	// noErr[q]: the endpoint to q has no peer-failure reports; pidfds[q] (or -1) then
	// watches q's process when it is on this host.
	noErr     []bool
	pidfds    []int  // the progress goroutine's
	watched   []bool // a pidfd was opened (set in New, read-only after)
	nextWatch time.Time

	mu       sync.Mutex
	inflight []*req
	scratch  []*req // step's copy of inflight (under drv.Mu)
	dead     []error
	freeReqs core.FreeList[*req]

	drv    core.Driver // waiting goroutines drive progress themselves
	closed atomic.Bool
	stop   chan struct{}
	wg     sync.WaitGroup
}

var _ transport.Transport = (*Transport)(nil)
var _ transport.PathReporter = (*Transport)(nil)
var _ transport.DeviceTransport = (*Transport)(nil)
var _ transport.Counting = (*Transport)(nil)

// Counters implements transport.Counting: tag messages posted (MessagesOut: sends,
// MessagesIn: receives), one-sided operations (RMAOps: puts, gets, signals) and the
// bytes sent and put (BytesOut).
func (t *Transport) Counters() transport.Counters {
	return transport.Counters{MessagesOut: t.tagSends.Load(), MessagesIn: t.tagRecvs.Load(), RMAOps: t.rmaOps.Load(), BytesOut: t.bytesOut.Load()}
}

// probeMu serialises the endpoint probe, which lowers UCX's process-wide log level
// while it runs.
var probeMu sync.Mutex

func statusErr(s C.ucs_status_t) error {
	return fmt.Errorf("ucx: %s", C.GoString(C.ucs_status_string(s)))
}

// New creates the context and worker, exchanges worker addresses through cfg.Exchange,
// creates an endpoint to every peer served and starts progress.
func New(ctx context.Context, cfg Config) (*Transport, error) {
	if cfg.Size < 1 || cfg.Rank < 0 || cfg.Rank >= cfg.Size {
		return nil, &transport.ArgError{Arg: "rank", Reason: fmt.Sprintf("rank %d of %d", cfg.Rank, cfg.Size)}
	}
	if cfg.Size > 1 && cfg.Exchange == nil {
		return nil, &transport.ArgError{Arg: "Exchange", Reason: "nil with more than one rank"}
	}
	t := newTransport(cfg)
	// Both exchanges below are collective: a rank that fails locally still takes part
	// (publishing an empty address, or a failed verdict), so that every rank returns
	// the same outcome instead of waiting for it.
	mine, initErr := t.initWorker()
	var addrs [][]byte
	if cfg.Size == 1 {
		if initErr != nil {
			t.destroy()
			return nil, initErr
		}
	} else {
		var err error
		if addrs, err = t.connect(ctx, cfg, mine, initErr); err != nil {
			return nil, err
		}
	}
	for q := range t.eps {
		if t.eps[q] != nil {
			t.postBye(q)
		}
	}
	if cfg.Size > 1 {
		t.watchProcesses(addrs)
	}
	t.wg.Add(1)
	go t.progress()
	for q, l := range t.lanes {
		if q != t.rank && t.peers[q] {
			t.log.Info("moex ucx: endpoint", "rank", t.rank, "peer", q, "transports", l, "rdma", t.rdmaTo(q), "peer_failure_detection", !t.noPeerErrors)
		}
	}
	return t, nil
}

// newTransport is t with its Go side made, before UCX.
func newTransport(cfg Config) *Transport {
	t := &Transport{rank: cfg.Rank, size: cfg.Size, log: cfg.Logger, grace: cfg.CancelGrace, stop: make(chan struct{}), efd: -1,
		windows: map[*rmaWindow]struct{}{}, emulatedWindows: cfg.EmulatedWindows}
	if t.log == nil {
		t.log = slog.New(slog.DiscardHandler)
	}
	if t.grace <= 0 {
		t.grace = 5 * time.Second
	}
	t.poller = busypoll.New(cfg.Poll)
	t.waitPoller = busypoll.New(busypoll.Config{Mode: busypoll.Block})
	t.drv = core.Driver{Step: t.step, Closed: t.closed.Load, Handoff: t.kick, Poller: t.poller, Park: t.waitPoller}
	t.self = inproc.New(1, inproc.Config{Poller: t.waitPoller})[0]
	t.peers = cfg.Peers
	if t.peers == nil {
		t.peers = make([]bool, cfg.Size)
		for i := range t.peers {
			t.peers[i] = true
		}
	}
	t.eps = make([]C.ucp_ep_h, cfg.Size)
	t.dead = make([]error, cfg.Size)
	t.lanes = make([][]string, cfg.Size)
	t.rmaLanes = make([]bool, cfg.Size)
	t.rdmaAll = true
	t.noErr = make([]bool, cfg.Size)
	t.pidfds = make([]int, cfg.Size)
	t.watched = make([]bool, cfg.Size)
	for q := range t.pidfds {
		t.pidfds[q] = -1
	}
	return t
}

// initWorker creates the UCX context and worker, the worker's event descriptor and the C
// scratch, and returns this rank's address for the peers (its identity, then the
// worker's address), or why it could not.
func (t *Transport) initWorker() ([]byte, error) {
	if s := C.moex_init(&t.ctx, &t.worker, 1); s != C.UCS_OK {
		return nil, fmt.Errorf("ucx: initialising: %w", statusErr(s))
	}
	var fd C.int
	if C.ucp_worker_get_efd(t.worker, &fd) == C.UCS_OK {
		t.efd = int(fd)
		if dup, err := unix.Dup(t.efd); err == nil {
			_ = unix.SetNonblock(dup, true)
			t.efile = os.NewFile(uintptr(dup), "ucx-worker-events")
			if rc, err := t.efile.SyscallConn(); err == nil {
				t.econn = rc
				t.eReady = t.efdReady
			} else {
				t.efile.Close()
				t.efile = nil
			}
		}
	}
	t.reg = obuf.NewRegCache(t.register, t.deregister)
	t.memTypes = uint64(C.moex_mem_types(t.ctx))
	t.lenBuf = (*C.size_t)(C.malloc(C.size_t(unsafe.Sizeof(C.size_t(0)))))
	t.states = (*C.moex_ep_state)(C.calloc(C.size_t(t.size), C.size_t(unsafe.Sizeof(C.moex_ep_state{}))))
	var addr unsafe.Pointer
	var alen C.size_t
	if s := C.moex_address(t.worker, &addr, &alen); s != C.UCS_OK {
		return nil, fmt.Errorf("ucx: worker address: %w", statusErr(s))
	}
	mine := append(identity(), C.GoBytes(addr, C.int(alen))...)
	C.ucp_worker_release_address(t.worker, (*C.ucp_address_t)(addr))
	return mine, nil
}

// connect exchanges the addresses, creates an endpoint to every peer served and agrees
// with every rank that all connected; on failure t is destroyed.
func (t *Transport) connect(ctx context.Context, cfg Config, mine []byte, initErr error) ([][]byte, error) {
	addrs, err := cfg.Exchange(ctx, mine)
	if err != nil {
		t.destroy()
		return nil, fmt.Errorf("ucx: exchanging worker addresses: %w", err)
	}
	if initErr != nil {
		t.destroy()
		return nil, initErr
	}
	for q, a := range addrs {
		if len(a) <= identLen {
			t.destroy()
			return nil, fmt.Errorf("ucx: rank %d could not initialise UCX", q)
		}
	}
	connErr := t.endpoints(addrs)
	// Flush every endpoint: that completes UCX's wire-up (lazy otherwise, which made the
	// first second of traffic over tcp lanes ten times slower).
	if connErr == nil {
		connErr = t.flushAll(ctx)
	}
	if err := t.fence(ctx, cfg, connErr); err != nil {
		for q, ep := range t.eps {
			if ep != nil {
				C.moex_ep_close(t.worker, ep, 1, 100000)
				t.eps[q] = nil
			}
		}
		t.destroy()
		return nil, err
	}
	return addrs, nil
}

// endpoints creates an endpoint to every peer served, with peer-failure reports where
// its lanes give them.
func (t *Transport) endpoints(addrs [][]byte) error {
	for q := 0; q < t.size; q++ {
		if q == t.rank || !t.peers[q] {
			continue
		}
		ca := C.CBytes(addrs[q][identLen:])
		probeMu.Lock() // the probe flips UCX's process-wide log level
		s := C.moex_ep_create(t.worker, ca, t.state(q), 1, &t.eps[q])
		probeMu.Unlock()
		if s == C.UCS_ERR_UNREACHABLE {
			// Some transports (shared memory) cannot report a failed peer: connect
			// without, and leave dead peers to the communicator's timeout.
			s = C.moex_ep_create(t.worker, ca, t.state(q), 0, &t.eps[q])
			t.noPeerErrors = true
			t.noErr[q] = true
		}
		C.free(ca)
		if s != C.UCS_OK {
			t.eps[q] = nil
			return fmt.Errorf("ucx: endpoint to rank %d: %w", q, statusErr(s))
		}
		if info := C.moex_ep_info(t.eps[q]); info != nil {
			t.lanes[q] = parseLanes(C.GoString(info))
			t.rmaLanes[q] = nativeRMA(C.GoString(info))
			C.free(unsafe.Pointer(info))
		}
	}
	return nil
}

// fence exchanges every rank's verdict (connected, over RDMA), which also fences the
// connection set-up: connecting attaches the peers' shared-memory segments, and a rank
// that returned and closed before a slower peer attached would leave it a dangling id.
func (t *Transport) fence(ctx context.Context, cfg Config, connErr error) error {
	verdict := []byte{1, 0}
	if connErr != nil {
		verdict[0] = 0
	}
	served := false
	for q := range t.eps {
		served = served || (q != cfg.Rank && t.peers[q])
	}
	if t.RDMA() || !served {
		verdict[1] = 1
	}
	all, err := cfg.Exchange(ctx, verdict)
	if err == nil && connErr == nil {
		for q, v := range all {
			if len(v) != 2 || v[0] != 1 {
				err = fmt.Errorf("ucx: rank %d could not connect to its peers", q)
				break
			}
			if v[1] != 1 {
				t.rdmaAll = false
			}
		}
	}
	switch {
	case connErr != nil:
		return connErr
	case err != nil:
		return fmt.Errorf("ucx: connect fence: %w", err)
	}
	return nil
}

func (t *Transport) state(q int) *C.moex_ep_state {
	return (*C.moex_ep_state)(unsafe.Add(unsafe.Pointer(t.states), uintptr(q)*unsafe.Sizeof(C.moex_ep_state{})))
}

func (t *Transport) register(b []byte) (any, error) {
	t.regCalls.Add(1)
	var memh C.ucp_mem_h
	if s := C.moex_mem_map(t.ctx, unsafe.Pointer(unsafe.SliceData(b)), C.size_t(len(b)), &memh); s != C.UCS_OK {
		return nil, fmt.Errorf("ucx: ucp_mem_map: %w", statusErr(s))
	}
	t.memHandles.Add(1)
	return memh, nil
}

func (t *Transport) deregister(h any) {
	C.ucp_mem_unmap(t.ctx, h.(C.ucp_mem_h))
	t.memHandles.Add(-1)
}

// Registrations returns how many times memory was mapped with UCX (ucp_mem_map).
func (t *Transport) Registrations() int { return int(t.regCalls.Load()) }

// Register maps b with UCX once (ucp_mem_map); sends and receives from any part of it then
// use the memory handle instead of registering on the fly.
func (t *Transport) Register(b *obuf.Buf) error {
	_, err := t.reg.Register(b)
	return err
}

func (t *Transport) memh(b []byte) C.ucp_mem_h {
	if h := t.reg.Lookup(b); h != nil {
		return h.(C.ucp_mem_h)
	}
	return nil
}

// Rank implements transport.Transport.
func (t *Transport) Rank() int { return t.rank }

// Size implements transport.Transport.
func (t *Transport) Size() int { return t.size }

// Name implements transport.Transport.
func (t *Transport) Name() string { return "ucx" }

// Poller returns the waiting policy's poller (for its counters).
func (t *Transport) Poller() *busypoll.Poller { return t.poller }

// PeerErrors reports whether UCX detects failed peers on the transports in use.
func (t *Transport) PeerErrors() bool { return !t.noPeerErrors }

// Lanes returns the UCX transports that carry traffic to peer (read back from UCX).
func (t *Transport) Lanes(peer int) []string { return t.lanes[peer] }

func (t *Transport) rdmaTo(q int) bool {
	for _, l := range t.lanes[q] {
		if isRDMA(l) {
			return true
		}
	}
	return false
}

// RDMA reports whether UCX reaches every peer it serves over an RDMA transport.
func (t *Transport) RDMA() bool {
	any := false
	for q := range t.lanes {
		if q == t.rank || !t.peers[q] {
			continue
		}
		if !t.rdmaTo(q) {
			return false
		}
		any = true
	}
	return any
}

// AllRDMA reports whether every rank found an RDMA transport to each of the peers it
// serves (agreed at New, so the same on every rank): the condition for preferring UCX
// over moex's own tcp.
func (t *Transport) AllRDMA() bool { return t.rdmaAll }

// Path implements transport.PathReporter.
func (t *Transport) Path(peer int) string {
	switch {
	case peer == t.rank:
		return "ucx: self, in-process copy"
	case peer < 0 || peer >= t.size || !t.peers[peer]:
		return "ucx: not served"
	}
	l := t.lanes[peer]
	note := ""
	switch {
	case t.noErr[peer] && t.watched[peer]:
		note = "; UCX cannot report a dead peer on these lanes: moex watches its process"
	case t.noErr[peer]:
		note = "; UCX cannot report a dead peer on these lanes (the communicator's timeout does)"
	}
	win := "; windows one-sided (put, fence, signal)"
	switch {
	case !t.rmaLanes[peer] && t.emulatedWindows:
		win = "; windows one-sided, RMA emulated over active messages (no RMA lane; MOEX_WINDOWS=1)"
	case !t.rmaLanes[peer]:
		win = "; no RMA lane: exchanges as tag messages (UCX would emulate RMA, slower; MOEX_WINDOWS=1 forces it)"
	}
	switch {
	case t.rdmaTo(peer):
		return fmt.Sprintf("ucx %s: %v (RDMA)%s%s", Version(), l, win, note)
	case len(l) == 1 && l[0] == "tcp":
		return fmt.Sprintf("ucx %s: [tcp] -- UCX fell back to TCP (no RDMA transport reaches this peer)%s%s", Version(), win, note)
	}
	return fmt.Sprintf("ucx %s: %v (no RDMA)%s%s", Version(), l, win, note)
}

// ---- requests ----

const (
	kSend reqKind = iota + 1
	kRecv
	kBye // a posted receive of a peer's goodbye
	kPut // one-sided, into a peer's window (window.go)
	kGet
	kAdd // the signal: an atomic add into a peer's window
)

// tagRecv: a tag receive (its completion carries a length to test for).
func (k reqKind) tagRecv() bool { return k == kRecv || k == kBye }

// byeTag is the reserved tag of goodbyes: every transport keeps a receive posted for each
// peer's, so that a peer that closes is noticed even where UCX cannot report failures.
var byeTag = transport.Tag{Comm: 0xFFFFFFFF, Seq: 0xFFFFFFFF, Tag: 0xFFFFFFFF}
