//go:build ucx

package ucx

/*
#cgo pkg-config: ucx
#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>

typedef struct {
	uint32_t comm, seq, tag, sig, src, flags;
	uint64_t len;
} moex_hdr;

typedef struct {
	moex_hdr hdr;
	ucp_dt_iov_t iov[2];
} moex_op;

typedef struct {
	int failed;
	int status;
} moex_ep_state;

static void moex_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
	moex_ep_state *st = (moex_ep_state *)arg;
	st->status = status;
	__atomic_store_n(&st->failed, 1, __ATOMIC_RELEASE);
}

static int moex_ep_failed(moex_ep_state *st) { return __atomic_load_n(&st->failed, __ATOMIC_ACQUIRE); }

static ucs_status_t moex_init(ucp_context_h *ctx, ucp_worker_h *w, int wakeup) {
	ucp_params_t p;
	memset(&p, 0, sizeof p);
	p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
	p.features = UCP_FEATURE_TAG | (wakeup ? UCP_FEATURE_WAKEUP : 0);
	p.mt_workers_shared = 1;
	ucp_config_t *cfg;
	ucs_status_t s = ucp_config_read(NULL, NULL, &cfg);
	if (s != UCS_OK) return s;
	// A dead peer must fail pending operations quickly: probe connections every second
	// (UCX's default is much longer), unless the user chose.
	if (getenv("UCX_KEEPALIVE_INTERVAL") == NULL) ucp_config_modify(cfg, "KEEPALIVE_INTERVAL", "1s");
	s = ucp_init(&p, cfg, ctx);
	ucp_config_release(cfg);
	if (s != UCS_OK) return s;
	ucp_worker_params_t wp;
	memset(&wp, 0, sizeof wp);
	wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
	wp.thread_mode = UCS_THREAD_MODE_MULTI;
	s = ucp_worker_create(*ctx, &wp, w);
	if (s != UCS_OK) ucp_cleanup(*ctx);
	return s;
}

static ucs_status_t moex_address(ucp_worker_h w, void **addr, size_t *len) {
	return ucp_worker_get_address(w, (ucp_address_t **)addr, len);
}

static ucs_status_t moex_ep_create(ucp_worker_h w, void *addr, moex_ep_state *st, int peer_errors, ucp_ep_h *ep) {
	ucp_ep_params_t p;
	memset(&p, 0, sizeof p);
	p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
	p.address = (const ucp_address_t *)addr;
	p.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
	p.err_handler.cb = moex_err_cb;
	p.err_handler.arg = st;
	if (!peer_errors) return ucp_ep_create(w, &p, ep);
	// Asking for peer-failure reports is a probe: shared-memory lanes cannot give
	// them and UCX logs that as an error before returning UNREACHABLE, which the
	// caller answers by connecting without. Keep the probe quiet.
	ucs_log_level_t saved = ucs_global_opts.log_component.log_level;
	if (saved < UCS_LOG_LEVEL_DEBUG) ucs_global_opts.log_component.log_level = UCS_LOG_LEVEL_FATAL;
	ucs_status_t s = ucp_ep_create(w, &p, ep);
	ucs_global_opts.log_component.log_level = saved;
	return s;
}

// kind: 0 completed at once, 1 request pending (in *req), 2 error (in *st).
static int moex_ptr(ucs_status_ptr_t p, void **req, ucs_status_t *st) {
	if (p == NULL) return 0;
	if (UCS_PTR_IS_ERR(p)) { *st = UCS_PTR_STATUS(p); return 2; }
	*req = p;
	return 1;
}

static int moex_send(ucp_ep_h ep, const void *buf, size_t count, int iov, uint64_t tag, int memtype, ucp_mem_h memh, void **req, ucs_status_t *st) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	if (iov) { p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE; p.datatype = ucp_dt_make_iov(); }
	if (memtype >= 0) { p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE; p.memory_type = (ucs_memory_type_t)memtype; }
	if (memh != NULL) { p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH; p.memh = memh; }
	return moex_ptr(ucp_tag_send_nbx(ep, buf, count, tag, &p), req, st);
}

static int moex_recv(ucp_worker_h w, void *buf, size_t count, int iov, uint64_t tag, int memtype, ucp_mem_h memh, void **req, ucs_status_t *st) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	p.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL; // always a request: its test gives the length
	if (iov) { p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE; p.datatype = ucp_dt_make_iov(); }
	if (memtype >= 0) { p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE; p.memory_type = (ucs_memory_type_t)memtype; }
	if (memh != NULL) { p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH; p.memh = memh; }
	return moex_ptr(ucp_tag_recv_nbx(w, buf, count, tag, (ucp_tag_t)-1, &p), req, st);
}

static ucs_status_t moex_recv_test(void *req, size_t *len) {
	ucp_tag_recv_info_t info;
	memset(&info, 0, sizeof info);
	ucs_status_t s = ucp_tag_recv_request_test(req, &info);
	*len = info.length;
	return s;
}

static char *moex_ep_info(ucp_ep_h ep) {
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	if (f == NULL) return NULL;
	ucp_ep_print_info(ep, f);
	fclose(f);
	return buf;
}

static void moex_ep_close(ucp_worker_h w, ucp_ep_h ep, int force, int spins) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
	p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
	ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
	if (r == NULL || UCS_PTR_IS_ERR(r)) return;
	for (int i = 0; i < spins && ucp_request_check_status(r) == UCS_INPROGRESS; i++) ucp_worker_progress(w);
	if (ucp_request_check_status(r) == UCS_INPROGRESS) {
		ucp_request_cancel(w, r);
		while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(w);
	}
	ucp_request_free(r);
}

static uint64_t moex_mem_types(ucp_context_h ctx) {
	ucp_context_attr_t a;
	memset(&a, 0, sizeof a);
	a.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
	if (ucp_context_query(ctx, &a) != UCS_OK) return 1u << UCS_MEMORY_TYPE_HOST;
	return a.memory_types;
}

// moex_ep_flush starts a flush of ep: *req is the request to poll (NULL: done).
static ucs_status_t moex_ep_flush(ucp_ep_h ep, void **req) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	ucs_status_ptr_t r = ucp_ep_flush_nbx(ep, &p);
	*req = NULL;
	if (r == NULL) return UCS_OK;
	if (UCS_PTR_IS_ERR(r)) return UCS_PTR_STATUS(r);
	*req = r;
	return UCS_INPROGRESS;
}

static ucs_status_t moex_mem_map(ucp_context_h ctx, void *addr, size_t len, ucp_mem_h *memh) {
	ucp_mem_map_params_t p;
	memset(&p, 0, sizeof p);
	p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
	p.address = addr;
	p.length = len;
	return ucp_mem_map(ctx, &p, memh);
}

static const char *moex_version(void) { return ucp_get_version_string(); }

// The iov slots are set from C: Go code storing a (pinned) Go pointer into C memory would
// run the write barrier over the stale pointer the slot held from an earlier request.
static void moex_set_iov(moex_op *op, int i, void *p, size_t len) { op->iov[i].buffer = p; op->iov[i].length = len; }

// A device address is not Go memory: it becomes a pointer on the C side.
static void *moex_devptr(uintptr_t p) { return (void *)p; }
*/
import "C"

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"os"
	"runtime"
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
	rank, size int
	ctx        C.ucp_context_h
	worker     C.ucp_worker_h
	eps        []C.ucp_ep_h
	states     *C.moex_ep_state // C array, one per rank
	peers      []bool
	efd        int
	efile      *os.File        // a duplicate of efd in Go's poller (nil: poll(2) efd)
	econn      syscall.RawConn // efile's
	eReady     func(uintptr) bool
	eFirst     bool
	lenBuf     *C.size_t // C scratch for received lengths (under drv.Mu)
	memTypes   uint64    // bit per ucs_memory_type_t UCX supports
	regCalls   atomic.Int64
	self       *inproc.Transport
	poller     *busypoll.Poller
	waitPoller *busypoll.Poller
	log        *slog.Logger
	grace      time.Duration
	reg        *obuf.RegCache
	lanes      [][]string
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
	t := &Transport{rank: cfg.Rank, size: cfg.Size, log: cfg.Logger, grace: cfg.CancelGrace, stop: make(chan struct{}), efd: -1}
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
	// Both exchanges below are collective: a rank that fails locally still takes part
	// (publishing an empty address, or a failed verdict), so that every rank returns
	// the same outcome instead of waiting for it.
	var mine []byte
	var initErr error
	if s := C.moex_init(&t.ctx, &t.worker, 1); s != C.UCS_OK {
		initErr = fmt.Errorf("ucx: initialising: %w", statusErr(s))
	} else {
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
		t.states = (*C.moex_ep_state)(C.calloc(C.size_t(cfg.Size), C.size_t(unsafe.Sizeof(C.moex_ep_state{}))))
		var addr unsafe.Pointer
		var alen C.size_t
		if s := C.moex_address(t.worker, &addr, &alen); s != C.UCS_OK {
			initErr = fmt.Errorf("ucx: worker address: %w", statusErr(s))
		} else {
			mine = append(identity(), C.GoBytes(addr, C.int(alen))...)
			C.ucp_worker_release_address(t.worker, (*C.ucp_address_t)(addr))
		}
	}
	t.eps = make([]C.ucp_ep_h, cfg.Size)
	t.dead = make([]error, cfg.Size)
	t.lanes = make([][]string, cfg.Size)
	t.rdmaAll = true
	t.noErr = make([]bool, cfg.Size)
	t.pidfds = make([]int, cfg.Size)
	t.watched = make([]bool, cfg.Size)
	for q := range t.pidfds {
		t.pidfds[q] = -1
	}
	var addrs [][]byte
	if cfg.Size == 1 {
		if initErr != nil {
			t.destroy()
			return nil, initErr
		}
	} else {
		var err error
		addrs, err = cfg.Exchange(ctx, mine)
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
		var connErr error
		for q := 0; q < cfg.Size && connErr == nil; q++ {
			if q == cfg.Rank || !t.peers[q] {
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
				connErr = fmt.Errorf("ucx: endpoint to rank %d: %w", q, statusErr(s))
				break
			}
			if info := C.moex_ep_info(t.eps[q]); info != nil {
				t.lanes[q] = parseLanes(C.GoString(info))
				C.free(unsafe.Pointer(info))
			}
		}
		// Flush every endpoint: that completes UCX's wire-up (lazy otherwise, which made
		// the first second of traffic over tcp lanes ten times slower).
		if connErr == nil {
			connErr = t.flushAll(ctx)
		}
		// The verdicts also fence the connection set-up: connecting attaches the peers'
		// shared-memory segments, and a rank that returned and closed before a slower
		// peer attached would leave it a dangling id.
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
		if connErr != nil || err != nil {
			if connErr == nil {
				connErr = fmt.Errorf("ucx: connect fence: %w", err)
			}
			for q, ep := range t.eps {
				if ep != nil {
					C.moex_ep_close(t.worker, ep, 1, 100000)
					t.eps[q] = nil
				}
			}
			t.destroy()
			return nil, connErr
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

func (t *Transport) state(q int) *C.moex_ep_state {
	return (*C.moex_ep_state)(unsafe.Add(unsafe.Pointer(t.states), uintptr(q)*unsafe.Sizeof(C.moex_ep_state{})))
}

func (t *Transport) register(b []byte) (any, error) {
	t.regCalls.Add(1)
	var memh C.ucp_mem_h
	if s := C.moex_mem_map(t.ctx, unsafe.Pointer(unsafe.SliceData(b)), C.size_t(len(b)), &memh); s != C.UCS_OK {
		return nil, fmt.Errorf("ucx: ucp_mem_map: %w", statusErr(s))
	}
	return memh, nil
}

func (t *Transport) deregister(h any) { C.ucp_mem_unmap(t.ctx, h.(C.ucp_mem_h)) }

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
	switch {
	case t.rdmaTo(peer):
		return fmt.Sprintf("ucx %s: %v (RDMA)%s", Version(), l, note)
	case len(l) == 1 && l[0] == "tcp":
		return fmt.Sprintf("ucx %s: [tcp] -- UCX fell back to TCP (no RDMA transport reaches this peer)%s", Version(), note)
	}
	return fmt.Sprintf("ucx %s: %v (no RDMA)%s", Version(), l, note)
}

// ---- requests ----

type reqKind uint8

const (
	kSend reqKind = iota + 1
	kRecv
	kBye // a posted receive of a peer's goodbye
)

// byeTag is the reserved tag of goodbyes: every transport keeps a receive posted for each
// peer's, so that a peer that closes is noticed even where UCX cannot report failures.
var byeTag = transport.Tag{Comm: 0xFFFFFFFF, Seq: 0xFFFFFFFF, Tag: 0xFFFFFFFF}

type req struct {
	core.Req
	t     *Transport
	kind  reqKind
	peer  int
	tag   transport.Tag
	utag  uint64
	buf   []byte
	dev   uintptr // device pointer (DeviceTransport)
	mt    int     // UCX memory type, -1: not given
	op    *C.moex_op
	pin   runtime.Pinner
	ucp   [2]unsafe.Pointer // pending UCX requests (header or whole message; payload)
	stage int               // recv: 1 header/small posted, 2 payload posted
	n     int
	err   error
	sink  unsafe.Pointer // C buffer of a sink receive
	// A request can part from its waiter before UCX is done with it: completed early
	// (its peer died), or given up by its waiter (a send UCX could not cancel). Whichever
	// of the waiter and UCX lets go last recycles it (under t.mu).
	early      bool // completed before UCX finished with it
	waiterGone bool // its waiter returned
}

func (t *Transport) getReq() *req {
	r, ok := t.freeReqs.Get()
	if !ok {
		r = &req{t: t, op: (*C.moex_op)(C.calloc(1, C.size_t(unsafe.Sizeof(C.moex_op{}))))}
		r.Init()
	}
	return r
}

func (t *Transport) putReq(r *req) {
	C.moex_set_iov(r.op, 1, nil, 0)
	r.pin.Unpin()
	if r.sink != nil {
		C.free(r.sink)
		r.sink = nil
	}
	r.Reset()
	r.buf, r.dev, r.ucp, r.stage, r.n, r.err, r.mt = nil, 0, [2]unsafe.Pointer{}, 0, 0, nil, -1
	r.early, r.waiterGone = false, false
	t.freeReqs.Put(r)
}

// utag is the 64-bit UCX tag: a hash of everything that is matched (the signature is
// checked, not matched), with the top bit kept for separate payloads.
func utag(src int, tg transport.Tag) uint64 {
	h := uint64(14695981039346656037)
	for _, v := range [4]uint32{uint32(src), tg.Comm, tg.Seq, tg.Tag} {
		for i := 0; i < 4; i++ {
			h ^= uint64(byte(v >> (8 * i)))
			h *= 1099511628211
		}
	}
	return h &^ payloadBit
}

func (t *Transport) peerCheck(peer int) error {
	if err := transport.CheckPeer(peer, t.size); err != nil {
		return err
	}
	if t.closed.Load() {
		return transport.ErrClosed
	}
	if peer != t.rank && !t.peers[peer] {
		return &transport.ArgError{Arg: "peer", Reason: fmt.Sprintf("rank %d is not served by ucx", peer)}
	}
	return nil
}

func (t *Transport) deadErr(peer int, op string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.dead[peer] == nil {
		return nil
	}
	return &transport.PeerError{Rank: peer, Op: op, Err: t.dead[peer]}
}

func (t *Transport) track(r *req) {
	t.mu.Lock()
	t.inflight = append(t.inflight, r)
	t.mu.Unlock()
}

func (r *req) fillHdr(flags uint32, n int) {
	h := &r.op.hdr
	h.comm, h.seq, h.tag, h.sig = C.uint32_t(r.tag.Comm), C.uint32_t(r.tag.Seq), C.uint32_t(r.tag.Tag), C.uint32_t(r.tag.Sig)
	h.src, h.flags, h.len = C.uint32_t(r.t.rank), C.uint32_t(flags), C.uint64_t(n)
}

// Isend implements transport.Transport.
func (t *Transport) Isend(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	return t.send(peer, tag, buf, 0, len(buf), -1)
}

// IsendDevice implements transport.DeviceTransport: ptr is device memory of type mt.
func (t *Transport) IsendDevice(peer int, tag transport.Tag, ptr uintptr, n int, mt transport.MemType) (transport.Request, error) {
	if err := t.checkDevice(ptr, n, mt); err != nil {
		return nil, err
	}
	return t.send(peer, tag, nil, ptr, n, ucsMemType(mt))
}

// MemTypes reports the memory types this UCX moves (host always; CUDA and ROCm only when
// UCX was built with them and finds the driver).
func (t *Transport) MemTypes() []transport.MemType {
	var out []transport.MemType
	for _, mt := range []transport.MemType{transport.MemHost, transport.MemCUDA, transport.MemCUDAManaged, transport.MemROCm} {
		if t.memTypes&(1<<uint(ucsMemType(mt))) != 0 {
			out = append(out, mt)
		}
	}
	return out
}

func (t *Transport) checkDevice(ptr uintptr, n int, mt transport.MemType) error {
	switch {
	case n < 0:
		return &transport.ArgError{Arg: "n", Reason: fmt.Sprintf("negative length %d", n)}
	case ptr == 0 && n > 0:
		return &transport.ArgError{Arg: "ptr", Reason: "nil device pointer"}
	case mt < transport.MemHost || mt > transport.MemROCm:
		return &transport.ArgError{Arg: "mt", Reason: fmt.Sprintf("unknown memory type %v", mt)}
	case t.memTypes&(1<<uint(ucsMemType(mt))) == 0:
		return &transport.ArgError{Arg: "mt", Reason: fmt.Sprintf("this UCX (%s) does not move %v memory (build UCX with --with-cuda or --with-rocm; see the README)", Version(), mt)}
	}
	return nil
}

func ucsMemType(mt transport.MemType) int {
	switch mt {
	case transport.MemCUDA:
		return int(C.UCS_MEMORY_TYPE_CUDA)
	case transport.MemCUDAManaged:
		return int(C.UCS_MEMORY_TYPE_CUDA_MANAGED)
	case transport.MemROCm:
		return int(C.UCS_MEMORY_TYPE_ROCM)
	}
	return int(C.UCS_MEMORY_TYPE_HOST)
}

func (t *Transport) send(peer int, tag transport.Tag, buf []byte, dev uintptr, n, mt int) (transport.Request, error) {
	if err := t.peerCheck(peer); err != nil {
		return nil, err
	}
	if peer == t.rank && dev == 0 {
		return t.self.Isend(0, tag, buf)
	}
	r := t.getReq()
	r.kind, r.peer, r.tag, r.buf, r.dev, r.mt = kSend, peer, tag, buf, dev, mt
	if err := t.deadErr(peer, "send"); err != nil {
		r.Complete(0, err)
		return r, nil
	}
	r.utag = utag(t.rank, tag)
	r.n = n
	ep := t.eps[peer]
	var st C.ucs_status_t
	if dev == 0 && n <= smallMax {
		r.fillHdr(0, n)
		C.moex_set_iov(r.op, 0, unsafe.Pointer(&r.op.hdr), C.size_t(hdrSize))
		C.moex_set_iov(r.op, 1, nil, C.size_t(n))
		if n > 0 {
			r.pin.Pin(unsafe.SliceData(buf))
			C.moex_set_iov(r.op, 1, unsafe.Pointer(unsafe.SliceData(buf)), C.size_t(n))
		}
		k := C.moex_send(ep, unsafe.Pointer(&r.op.iov[0]), 2, 1, C.uint64_t(r.utag), -1, nil, &r.ucp[0], &st)
		return t.started(r, k, st, 0)
	}
	// Header, then the payload contiguous on its own tag.
	r.fillHdr(flagSeparate, n)
	k := C.moex_send(ep, unsafe.Pointer(&r.op.hdr), C.size_t(hdrSize), 0, C.uint64_t(r.utag), -1, nil, &r.ucp[0], &st)
	if k == 2 {
		r.ucp[0] = nil
		r.Complete(0, t.opErr(r, st))
		return r, nil
	}
	var p unsafe.Pointer
	var memh C.ucp_mem_h
	if dev != 0 {
		p = C.moex_devptr(C.uintptr_t(dev))
	} else {
		r.pin.Pin(unsafe.SliceData(buf))
		p = unsafe.Pointer(unsafe.SliceData(buf))
		memh = t.memh(buf)
	}
	k2 := C.moex_send(ep, p, C.size_t(n), 0, C.uint64_t(r.utag|payloadBit), C.int(mt), memh, &r.ucp[1], &st)
	if k == 0 {
		r.ucp[0] = nil
	}
	return t.started(r, k2, st, 1)
}

// started records what posting a UCX operation gave: done at once, pending, or an error.
func (t *Transport) started(r *req, kind C.int, st C.ucs_status_t, slot int) (transport.Request, error) {
	switch kind {
	case 0:
		r.ucp[slot] = nil
		if r.ucp[0] == nil && r.ucp[1] == nil {
			C.moex_set_iov(r.op, 1, nil, 0)
			r.pin.Unpin()
			r.Complete(r.n, nil)
			return r, nil
		}
	case 2:
		r.ucp[slot] = nil
		err := t.opErr(r, st)
		if r.ucp[0] == nil && r.ucp[1] == nil {
			C.moex_set_iov(r.op, 1, nil, 0)
			r.pin.Unpin()
			r.Complete(0, err)
			return r, nil
		}
		r.err = err
	}
	t.track(r)
	return r, nil
}

func (r *req) op2() string {
	if r.kind == kSend {
		return "send"
	}
	return "recv"
}

// Irecv implements transport.Transport.
func (t *Transport) Irecv(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	return t.recv(peer, tag, buf, 0, len(buf), -1)
}

// IrecvDevice implements transport.DeviceTransport.
func (t *Transport) IrecvDevice(peer int, tag transport.Tag, ptr uintptr, n int, mt transport.MemType) (transport.Request, error) {
	if err := t.checkDevice(ptr, n, mt); err != nil {
		return nil, err
	}
	return t.recv(peer, tag, nil, ptr, n, ucsMemType(mt))
}

func (t *Transport) recv(peer int, tag transport.Tag, buf []byte, dev uintptr, n, mt int) (transport.Request, error) {
	if err := t.peerCheck(peer); err != nil {
		return nil, err
	}
	if peer == t.rank && dev == 0 {
		return t.self.Irecv(0, tag, buf)
	}
	r := t.getReq()
	r.kind, r.peer, r.tag, r.buf, r.dev, r.mt, r.n = kRecv, peer, tag, buf, dev, mt, n
	if err := t.deadErr(peer, "recv"); err != nil {
		r.Complete(0, err)
		return r, nil
	}
	r.utag = utag(peer, tag)
	r.stage = 1
	C.moex_set_iov(r.op, 0, unsafe.Pointer(&r.op.hdr), C.size_t(hdrSize))
	C.moex_set_iov(r.op, 1, nil, 0)
	if dev == 0 && len(buf) > 0 {
		r.pin.Pin(unsafe.SliceData(buf))
		C.moex_set_iov(r.op, 1, unsafe.Pointer(unsafe.SliceData(buf)), C.size_t(min(len(buf), smallMax)))
	}
	var st C.ucs_status_t
	k := C.moex_recv(t.worker, unsafe.Pointer(&r.op.iov[0]), 2, 1, C.uint64_t(r.utag), -1, nil, &r.ucp[0], &st)
	if k == 2 {
		r.ucp[0] = nil
		r.Complete(0, t.opErr(r, st))
		return r, nil
	}
	t.track(r)
	return r, nil
}

func (t *Transport) postBye(q int) {
	r := t.getReq()
	r.kind, r.peer, r.tag, r.n = kBye, q, byeTag, 0
	r.utag = utag(q, byeTag)
	r.stage = 1
	C.moex_set_iov(r.op, 0, unsafe.Pointer(&r.op.hdr), C.size_t(hdrSize))
	C.moex_set_iov(r.op, 1, nil, 0)
	var st C.ucs_status_t
	if C.moex_recv(t.worker, unsafe.Pointer(&r.op.iov[0]), 2, 1, C.uint64_t(r.utag), -1, nil, &r.ucp[0], &st) == 2 {
		r.ucp[0] = nil
		t.putReq(r)
		return
	}
	t.track(r)
}

// sayBye tells every peer this rank is leaving (small eager messages, flushed by the
// endpoint close that follows).
func (t *Transport) sayBye() {
	for q, ep := range t.eps {
		t.mu.Lock()
		gone := t.dead[q] != nil
		t.mu.Unlock()
		if ep == nil || gone {
			// A peer that said goodbye (or failed) may have unmapped the memory UCX would
			// touch to reach it.
			continue
		}
		r := t.getReq()
		r.kind, r.peer, r.tag = kSend, q, byeTag
		r.fillHdr(0, 0)
		C.moex_set_iov(r.op, 0, unsafe.Pointer(&r.op.hdr), C.size_t(hdrSize))
		C.moex_set_iov(r.op, 1, nil, 0)
		var st C.ucs_status_t
		k := C.moex_send(ep, unsafe.Pointer(&r.op.iov[0]), 2, 1, C.uint64_t(utag(t.rank, byeTag)), -1, nil, &r.ucp[0], &st)
		if k == 1 {
			r.waiterGone = true // nobody waits for a goodbye
			t.track(r)
		} else {
			r.ucp[0] = nil
			t.putReq(r)
		}
	}
}

// ---- progress ----

// check advances r if its UCX operations completed; it reports whether r is finished
// (then the caller takes it out of the in-flight list and calls finish).
func (t *Transport) check(r *req) bool {
	for i, p := range r.ucp {
		if p == nil {
			continue
		}
		var st C.ucs_status_t
		var length C.size_t
		if r.kind != kSend {
			// t.lenBuf is C memory: a Go variable's address given to C would escape, one
			// allocation per look.
			st = C.moex_recv_test(p, t.lenBuf)
			length = *t.lenBuf
		} else {
			st = C.ucp_request_check_status(p)
		}
		if st == C.UCS_INPROGRESS {
			return false
		}
		C.ucp_request_free(p)
		r.ucp[i] = nil
		if r.kind != kSend && i == 0 && st == C.UCS_OK {
			t.gotHeader(r, int(length))
			if r.ucp[1] != nil {
				return false
			}
			continue
		}
		if r.kind != kSend && i == 1 && st == C.UCS_OK && r.sink == nil && int(length) != r.n && r.err == nil {
			r.err = &transport.PeerError{Rank: r.peer, Op: "recv", Err: fmt.Errorf("%w: payload of %d bytes, header said %d", transport.ErrProtocol, length, r.n)}
		}
		if st != C.UCS_OK && r.err == nil {
			r.err = t.opErr(r, st)
		}
	}
	return r.ucp[0] == nil && r.ucp[1] == nil
}

// finish completes a finished request (it is out of the in-flight list already, so that
// its waiter may recycle it at once).
func (t *Transport) finish(r *req) {
	C.moex_set_iov(r.op, 1, nil, 0) // UCX is done with the buffer: unpin now
	r.pin.Unpin()
	t.mu.Lock()
	early, gone := r.early, r.waiterGone
	t.mu.Unlock()
	switch {
	case r.kind == kBye:
		if r.err == nil && !t.closed.Load() {
			t.markDead(r.peer, transport.ErrPeerLeft)
		}
		t.putReq(r)
	case gone:
		t.putReq(r) // the waiter left first
	case early:
		// Answered already; its waiter recycles it when it returns.
		t.mu.Lock()
		r.ucp = [2]unsafe.Pointer{}
		gone = r.waiterGone
		r.early = false // UCX done: the waiter may recycle
		t.mu.Unlock()
		if gone {
			t.putReq(r)
		}
	case r.err != nil:
		r.Complete(0, r.err)
	default:
		r.Complete(r.n, nil)
	}
}

func (t *Transport) opErr(r *req, st C.ucs_status_t) error {
	if t.closed.Load() {
		return transport.ErrClosed
	}
	var kind error = statusErr(st)
	switch st {
	case C.UCS_ERR_MESSAGE_TRUNCATED:
		kind = fmt.Errorf("%w: %v", transport.ErrTruncated, statusErr(st))
	case C.UCS_ERR_CANCELED:
		if d := t.deadErr(r.peer, r.op2()); d != nil {
			return d
		}
		kind = transport.ErrCanceled
	}
	return &transport.PeerError{Rank: r.peer, Op: r.op2(), Err: kind}
}

// gotHeader handles the completion of a receive's first UCX message.
func (t *Transport) gotHeader(r *req, length int) {
	if length < hdrSize {
		r.err = &transport.PeerError{Rank: r.peer, Op: "recv", Err: fmt.Errorf("%w: %d-byte message without a header", transport.ErrProtocol, length)}
		return
	}
	h := r.op.hdr
	switch {
	case uint32(h.comm) != r.tag.Comm || uint32(h.seq) != r.tag.Seq || uint32(h.tag) != r.tag.Tag || int(h.src) != r.peer:
		r.err = &transport.PeerError{Rank: r.peer, Op: "recv", Err: fmt.Errorf("%w: header says comm=%d seq=%d tag=%d from %d (tag hash collision)",
			transport.ErrProtocol, h.comm, h.seq, h.tag, h.src)}
	case uint32(h.sig) != r.tag.Sig:
		got := r.tag
		got.Sig = uint32(h.sig)
		r.err = core.SignatureError(r.peer, got, r.tag.Sig)
	}
	if h.flags&flagSeparate == 0 {
		if r.err == nil {
			r.n = length - hdrSize
		}
		return
	}
	n := int(h.len)
	if r.err == nil && n > r.n {
		r.err = core.TruncatedError(r.peer, n, r.n)
	}
	var st C.ucs_status_t
	var k C.int
	if r.err != nil {
		// Take the payload anyway, into a sink, so that it does not linger in UCX.
		r.sink = C.malloc(C.size_t(max(n, 1)))
		k = C.moex_recv(t.worker, r.sink, C.size_t(n), 0, C.uint64_t(r.utag|payloadBit), -1, nil, &r.ucp[1], &st)
	} else {
		r.n = n
		var p unsafe.Pointer
		var memh C.ucp_mem_h
		if r.dev != 0 {
			p = C.moex_devptr(C.uintptr_t(r.dev))
		} else if n > 0 {
			p = unsafe.Pointer(unsafe.SliceData(r.buf))
			memh = t.memh(r.buf[:n])
		}
		k = C.moex_recv(t.worker, p, C.size_t(n), 0, C.uint64_t(r.utag|payloadBit), C.int(r.mt), memh, &r.ucp[1], &st)
	}
	r.stage = 2
	switch k {
	case 0:
		r.ucp[1] = nil
	case 2:
		r.ucp[1] = nil
		if r.err == nil {
			r.err = t.opErr(r, st)
		}
	}
}

// step progresses the worker and finishes what completed; it reports whether anything
// happened.
func (t *Transport) step() bool {
	worked := false
	for i := 0; i < progressBudget; i++ {
		if C.ucp_worker_progress(t.worker) == 0 {
			break
		}
		worked = true
	}
	t.checkPeers()
	t.mu.Lock()
	list := append(t.scratch[:0], t.inflight...)
	t.mu.Unlock()
	for i, r := range list {
		list[i] = nil
		if !t.check(r) {
			continue
		}
		t.mu.Lock()
		for j, x := range t.inflight {
			if x == r {
				t.inflight = append(t.inflight[:j], t.inflight[j+1:]...)
				break
			}
		}
		t.mu.Unlock()
		t.finish(r)
		worked = true
	}
	t.scratch = list[:0]
	return worked
}

// checkPeers fails the peers UCX reported broken.
func (t *Transport) checkPeers() {
	for q := range t.eps {
		if t.eps[q] == nil || C.moex_ep_failed(t.state(q)) == 0 {
			continue
		}
		t.mu.Lock()
		known := t.dead[q] != nil
		t.mu.Unlock()
		if known {
			continue
		}
		t.markDead(q, fmt.Errorf("%w: %v", transport.ErrPeerClosed, statusErr(C.ucs_status_t(t.state(q).status))))
	}
}

// kick wakes the progress goroutine out of its event wait.
func (t *Transport) kick() {
	if t.closed.Load() {
		return
	}
	C.ucp_worker_signal(t.worker)
}

func (t *Transport) progress() {
	defer t.wg.Done()
	for {
		select {
		case <-t.stop:
			return
		default:
		}
		t.checkProcesses()
		// Progress while there is work, then sleep on the worker's event descriptor. The
		// spinning is the waiting goroutines' (under the adaptive policy): this goroutine
		// taking a spinner slot would make them park, and a wake-up through UCX's events
		// costs tens of microseconds.
		for {
			t.drv.Mu.Lock()
			worked := t.step()
			t.drv.Mu.Unlock()
			if !worked || t.closed.Load() {
				break
			}
		}
		if t.efd >= 0 {
			t.drv.Mu.Lock()
			st := C.ucp_worker_arm(t.worker)
			t.drv.Mu.Unlock()
			if st == C.UCS_ERR_BUSY {
				continue
			}
			if st == C.UCS_OK {
				t.sleepOnEvents(5 * time.Millisecond)
				continue
			}
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// sleepOnEvents waits until the worker's event descriptor is readable, or d. It waits
// in Go's network poller (through a duplicate of the descriptor) rather than in a
// blocking poll(2): the wake-up then is the scheduler's, as for a socket, without an OS
// thread parked in the kernel.
func (t *Transport) sleepOnEvents(d time.Duration) {
	if t.efile == nil {
		fds := []unix.PollFd{{Fd: int32(t.efd), Events: unix.POLLIN}}
		_, _ = unix.Poll(fds, int(d/time.Millisecond))
		return
	}
	_ = t.efile.SetReadDeadline(time.Now().Add(d))
	t.eFirst = true
	_ = t.econn.Read(t.eReady)
}

// efdReady is econn.Read's callback: the first call asks to wait for readability.
func (t *Transport) efdReady(uintptr) bool {
	if t.eFirst {
		t.eFirst = false
		return false
	}
	return true
}

// Wait implements transport.Request.
func (r *req) Wait(ctx context.Context) (int, error) {
	t := r.t
	if err := t.drv.Await(ctx, &r.Req); err != nil {
		if !r.cancel() {
			ctx2, cancel := context.WithTimeout(context.Background(), t.grace)
			werr := t.drv.Await(ctx2, &r.Req)
			cancel()
			if werr != nil {
				// The transfer is stuck: declare the peer dead, which completes it.
				t.failPeer(r.peer, fmt.Errorf("%w: a cancelled transfer did not finish within %v", transport.ErrTimeout, t.grace))
				ctx3, cancel3 := context.WithTimeout(context.Background(), t.grace)
				werr = t.drv.Await(ctx3, &r.Req)
				cancel3()
				if werr != nil {
					// UCX will not let go of it: abandon the request (leaked, pinned).
					t.abandon(r)
					return 0, transport.CtxError(err)
				}
			}
			n, e := r.Result()
			if e != nil && errors.Is(e, transport.ErrCanceled) {
				e = transport.CtxError(err)
			}
			t.release(r)
			return n, e
		}
		ctx2, cancel := context.WithTimeout(context.Background(), t.grace)
		werr := t.drv.Await(ctx2, &r.Req) // UCX confirms the cancellation
		cancel()
		if werr != nil {
			// UCX cannot cancel this one (a rendezvous send already announced): leave it
			// to UCX, which completes it if a receiver ever matches it.
			t.abandon(r)
			return 0, transport.CtxError(err)
		}
		n, e := r.Result()
		if e != nil {
			e = transport.CtxError(err)
		}
		t.release(r)
		return n, e
	}
	n, err := r.Result()
	t.release(r)
	return n, err
}

// release is the waiter letting go of r: recycled now, unless UCX still holds it (then
// finish recycles it).
func (t *Transport) release(r *req) {
	t.mu.Lock()
	ucxHolds := r.early
	if ucxHolds {
		r.waiterGone = true
	}
	t.mu.Unlock()
	if !ucxHolds {
		t.putReq(r)
	}
}

// cancel asks UCX to cancel a receive that has not started receiving its payload, or a
// send whose payload no receiver has matched; it reports whether it asked.
func (r *req) cancel() bool {
	t := r.t
	t.drv.Mu.Lock()
	defer t.drv.Mu.Unlock()
	if r.Test() {
		return false
	}
	switch {
	case r.kind == kRecv && r.stage == 1 && r.ucp[0] != nil:
		C.ucp_request_cancel(t.worker, r.ucp[0])
		return true
	case r.kind == kSend && r.ucp[1] != nil:
		C.ucp_request_cancel(t.worker, r.ucp[1])
		return true
	}
	return false
}

// abandon stops waiting for a request UCX will not complete now; it stays in flight (its
// buffer pinned) until UCX completes it or Close purges it, and is then recycled.
func (t *Transport) abandon(r *req) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r.waiterGone = true
}

// markDead fails peer q: its pending receives are cancelled (they complete with a
// PeerError), later operations with it fail at once.
func (t *Transport) markDead(q int, err error) {
	t.mu.Lock()
	if t.dead[q] != nil {
		t.mu.Unlock()
		return
	}
	t.dead[q] = err
	list := append([]*req(nil), t.inflight...)
	t.mu.Unlock()
	if errors.Is(err, transport.ErrPeerLeft) { // its Close: every rank logs this at a clean end
		t.log.Debug("moex ucx: peer left", "rank", t.rank, "peer", q)
	} else {
		t.log.Info("moex ucx: peer failed", "rank", t.rank, "peer", q, "err", err)
	}
	perr := &transport.PeerError{Rank: q, Op: "send", Err: err}
	for _, r := range list {
		if r.peer != q {
			continue
		}
		switch r.kind {
		case kRecv:
			for _, p := range r.ucp {
				if p != nil {
					C.ucp_request_cancel(t.worker, p)
				}
			}
		case kSend:
			// UCX may never complete a send to a peer that is gone (no error handling on
			// these transports): complete it ourselves; the request is recycled when UCX
			// lets go of it, or at Close.
			t.mu.Lock()
			take := !r.early && !r.waiterGone && !r.Test()
			if take {
				r.early = true
			}
			t.mu.Unlock()
			if take {
				r.Complete(0, perr)
			}
		}
	}
}

func (t *Transport) failPeer(q int, err error) {
	t.mu.Lock()
	if t.dead[q] == nil {
		t.dead[q] = err
	}
	list := append([]*req(nil), t.inflight...)
	t.mu.Unlock()
	t.drv.Mu.Lock()
	for _, r := range list {
		if r.peer == q {
			for _, p := range r.ucp {
				if p != nil {
					C.ucp_request_cancel(t.worker, p)
				}
			}
		}
	}
	t.drv.Mu.Unlock()
}

// flushAll flushes every endpoint, driving progress until they complete or ctx ends.
func (t *Transport) flushAll(ctx context.Context) error {
	var reqs []unsafe.Pointer
	for q, ep := range t.eps {
		if ep == nil {
			continue
		}
		var r unsafe.Pointer
		if s := C.moex_ep_flush(ep, &r); s != C.UCS_OK && s != C.UCS_INPROGRESS {
			return fmt.Errorf("ucx: connecting to rank %d: %w", q, statusErr(s))
		}
		if r != nil {
			reqs = append(reqs, r)
		}
	}
	var err error
	for i := 0; len(reqs) > 0; i++ {
		C.ucp_worker_progress(t.worker)
		for j := 0; j < len(reqs); j++ {
			if s := C.ucp_request_check_status(reqs[j]); s != C.UCS_INPROGRESS {
				if s != C.UCS_OK && err == nil {
					err = fmt.Errorf("ucx: connecting: %w", statusErr(s))
				}
				C.ucp_request_free(reqs[j])
				reqs[j] = reqs[len(reqs)-1]
				reqs = reqs[:len(reqs)-1]
				j--
			}
		}
		if i&1023 == 1023 {
			if ctx.Err() != nil {
				for _, r := range reqs {
					C.ucp_request_cancel(t.worker, r)
					for C.ucp_request_check_status(r) == C.UCS_INPROGRESS {
						C.ucp_worker_progress(t.worker)
					}
					C.ucp_request_free(r)
				}
				return fmt.Errorf("ucx: connecting: %w", ctx.Err())
			}
			runtime.Gosched()
		}
	}
	return err
}

// ---- liveness of peers UCX cannot watch ----

// identLen is the size of the identity that prefixes each worker address.
const identLen = 12

// identity is this process's pid and a hash of its host identity.
func identity() []byte {
	b := make([]byte, identLen)
	binary.LittleEndian.PutUint32(b, uint32(os.Getpid()))
	h := fnv.New64a()
	h.Write([]byte(transport.HostID()))
	binary.LittleEndian.PutUint64(b[4:], h.Sum64())
	return b
}

// watchProcesses opens a pidfd for every peer that UCX cannot report failed (shared-
// memory lanes) and that runs on this host, so that a peer process that dies fails the
// operations with it at once instead of at the communicator's deadline.
func (t *Transport) watchProcesses(addrs [][]byte) {
	me := identity()
	for q, a := range addrs {
		if q == t.rank || !t.noErr[q] || t.eps[q] == nil || len(a) < identLen {
			continue
		}
		if binary.LittleEndian.Uint64(a[4:identLen]) != binary.LittleEndian.Uint64(me[4:]) {
			continue // another host: the pid means nothing here
		}
		if fd, err := unix.PidfdOpen(int(binary.LittleEndian.Uint32(a)), 0); err == nil {
			t.pidfds[q] = fd
			t.watched[q] = true
		}
	}
}

// checkProcesses fails the peers whose process exited (at most every 20ms).
func (t *Transport) checkProcesses() {
	now := time.Now()
	if now.Before(t.nextWatch) {
		return
	}
	t.nextWatch = now.Add(20 * time.Millisecond)
	for q, fd := range t.pidfds {
		if fd < 0 {
			continue
		}
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if n, _ := unix.Poll(fds, 0); n > 0 {
			t.drv.Mu.Lock()
			t.markDead(q, fmt.Errorf("%w: process exited", transport.ErrPeerClosed))
			t.drv.Mu.Unlock()
			unix.Close(fd)
			t.pidfds[q] = -1
		}
	}
}

func (t *Transport) closePidfds() {
	for q, fd := range t.pidfds {
		if fd >= 0 {
			unix.Close(fd)
			t.pidfds[q] = -1
		}
	}
}

// ---- shutdown ----

// Close cancels what is pending, closes the endpoints (flushing them, briefly) and
// releases the worker and the context.
func (t *Transport) Close() error {
	if t.closed.Swap(true) {
		return nil
	}
	close(t.stop)
	C.ucp_worker_signal(t.worker)
	t.wg.Wait()
	t.shutdown(false)
	return t.self.Close()
}

// Kill closes everything without flushing, as a crash would (for tests).
func (t *Transport) Kill() {
	if t.closed.Swap(true) {
		return
	}
	close(t.stop)
	C.ucp_worker_signal(t.worker)
	t.wg.Wait()
	t.shutdown(true)
	_ = t.self.Close()
}

func (t *Transport) shutdown(force bool) {
	t.drv.Mu.Lock()
	defer t.drv.Mu.Unlock()
	if !force {
		t.sayBye()
		for i := 0; i < 1000 && C.ucp_worker_progress(t.worker) > 0; i++ {
		}
	}
	// Cancel the receives; sends (the goodbyes among them) are flushed by the endpoint
	// close below, or purged by it when forced.
	t.mu.Lock()
	list := append([]*req(nil), t.inflight...)
	t.mu.Unlock()
	for _, r := range list {
		if r.kind == kSend {
			continue
		}
		for _, p := range r.ucp {
			if p != nil {
				C.ucp_request_cancel(t.worker, p)
			}
		}
	}
	deadline := time.Now().Add(100 * time.Millisecond)
	for {
		t.step()
		t.mu.Lock()
		left := len(t.inflight)
		t.mu.Unlock()
		if left == 0 || time.Now().After(deadline) {
			break
		}
	}
	t.mu.Lock()
	stuck := len(t.inflight) > 0
	for _, r := range t.inflight {
		if !r.Test() {
			r.Complete(0, transport.ErrClosed)
		}
	}
	t.mu.Unlock()
	f := C.int(0)
	if force || stuck {
		f = 1 // purge what UCX still holds on the endpoints
	}
	for q, ep := range t.eps {
		if ep != nil {
			fq := f
			t.mu.Lock()
			if t.dead[q] != nil {
				fq = 1 // nothing to flush to a peer that is gone
			}
			t.mu.Unlock()
			C.moex_ep_close(t.worker, ep, fq, 100000)
			t.eps[q] = nil
		}
	}
	// The purge completed what was left: release those requests.
	t.mu.Lock()
	left := t.inflight
	t.inflight = nil
	t.mu.Unlock()
	for _, r := range left {
		C.moex_set_iov(r.op, 1, nil, 0)
		r.pin.Unpin()
		for i, p := range r.ucp {
			if p != nil {
				for j := 0; j < 100000 && C.ucp_request_check_status(p) == C.UCS_INPROGRESS; j++ {
					C.ucp_worker_progress(t.worker)
				}
				C.ucp_request_free(p)
				r.ucp[i] = nil
			}
		}
	}
	t.reg.Close()
	t.destroy()
}

func (t *Transport) destroy() {
	t.closePidfds()
	if t.efile != nil {
		t.efile.Close()
		t.efile = nil
	}
	t.freeReqs.Drain(func(r *req) { C.free(unsafe.Pointer(r.op)) })
	if t.worker != nil {
		C.ucp_worker_destroy(t.worker)
		t.worker = nil
	}
	if t.ctx != nil {
		C.ucp_cleanup(t.ctx)
		t.ctx = nil
	}
	if t.states != nil {
		C.free(unsafe.Pointer(t.states))
		t.states = nil
	}
	if t.lenBuf != nil {
		C.free(unsafe.Pointer(t.lenBuf))
		t.lenBuf = nil
	}
}
