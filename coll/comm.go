// Package coll is moex's general collective layer: communicators, every collective
// (Barrier, Broadcast, Scatter, Gather, Reduce, AllReduce, ReduceScatter, AllGather,
// AlltoAll, AlltoAllv, Send/Recv), the algorithms behind them (hierarchical ones for
// ranks on several hosts), the alpha-beta cost model that picks one (it knows host-local
// and network links apart), non-blocking handles, groups, a bucketing helper for small
// AllReduces, and profiling that tells waiting for a late rank from moving bytes.
//
// Schedules (plans) are pure functions of the operation's shape; one executor runs them on
// a transport.Transport. coll owns communicators, their watchdogs and plans; it must not
// import router, dispatch, combine or anything above it.
//
// Semantics follow MPI and NCCL: every rank of a communicator issues the same collectives
// in the same order. Each carries a sequence number and a signature (operation, type,
// count, root, algorithm), so that ranks that disagree get ErrMismatch instead of a hang or
// corrupt data. Every error inside a collective aborts the communicator on every rank: the
// rank that saw it tells the others, and their pending and later operations fail with an
// *AbortError naming it. A dead peer, a timeout (MOEX_TIMEOUT, or the context's deadline)
// and a cancelled context are such errors. Create a new communicator to carry on.
//
// Buffers: between processes of one host, large blocks are read across from the sender's
// buffer (process_vm_readv), which runs about twice as fast from huge pages as from the
// 4 KiB pages that make() usually gets. Take large buffers from obuf, as dispatch and
// combine do, and hold the *obuf.Buf while its memory is in use:
//
//	b := obuf.Default.Get(4 * n)
//	defer b.Release()
//	x := dtype.FromBytes[float32](b.Bytes())
//
// Send buffers that an AlltoAll, AlltoAllv or AllGather uses again and again do better
// still from obuf.Shared (when SharedMemory reports true): shared memory that the other
// ranks map once and read in place, one copy per byte, as NCCL's registered buffers. The
// MoE dispatcher takes its buffers from there by itself.
package coll

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/bootstrap"
)

// Config tunes communicators. The zero value takes everything from defaults.
type Config struct {
	// Timeout bounds every operation: no progress for this long aborts the communicator
	// (default bootstrap.DefaultTimeout, MOEX_TIMEOUT).
	Timeout time.Duration
	// InitTimeout bounds Init: every rank of the job must have started and connected
	// within it (default MOEX_INIT_TIMEOUT, else Timeout).
	InitTimeout time.Duration
	// Algo overrides the cost model per operation (MOEX_ALGO).
	Algo map[OpKind]Algo
	// Link overrides the cost-model parameters (default: by transport; with ranks on
	// several hosts, those of the network between them).
	Link *LinkCost
	// HostLink overrides the cost-model parameters between ranks of one host when the
	// ranks span hosts (default: shared memory's).
	HostLink *LinkCost
	// NetGbits is the speed of the network between hosts, in Gbit/s, for the cost model
	// when the ranks span hosts and Link is not set (MOEX_NET_GBITS; default: CostNet's
	// 24 Gbit/s). A link slower than the model believes makes it undervalue the
	// algorithms that cross it less (hierarchical, two-level).
	NetGbits float64
	// Logger receives INFO lines (transport per peer, algorithm per operation) when
	// enabled; default: slog to stderr at the MOEX_DEBUG level, else discarded.
	Logger *slog.Logger
	// Pool provides scratch buffers (default obuf.Default).
	Pool *obuf.Pool
	// Poll is the waiting policy (default MOEX_POLL / adaptive).
	Poll *busypoll.Config
	// Verify makes every operation first check, with one small all-gather, that all ranks
	// issued the same operation (catches what per-message signatures cannot, such as two
	// ranks that both think they are the root), and that every rank fails in the same
	// call when one has a bad argument. Costs one extra round trip per op. Broadcast,
	// Reduce, Gather and Scatter of VerifyRootedMin bytes and more verify unless
	// NoRootedVerify is set.
	Verify         bool
	NoRootedVerify bool
	// Profile measures, for every operation, how long this rank waited for the others to
	// arrive and how long the operation itself took, and which rank arrived last
	// (Comm.Profile; MOEX_PROFILE=1). Costs one small all-gather per operation.
	Profile bool
	// TraceDir makes Close write this rank's operations to a Chrome-trace JSON file in
	// that directory (MOEX_TRACE=dir; see TracePath): each op with its algorithm and
	// bytes, split into waiting for the last rank and moving. It turns Profile on.
	TraceDir string
	// Hosts assigns ranks of Local communicators to pretend hosts (tests of hierarchical
	// code); nil: one host.
	Hosts []int
	// NoWindows makes Exchanges (the MoE low-latency mode) send every block as a message,
	// even to ranks whose memory the transport could write directly (MOEX_WINDOWS=0).
	NoWindows bool
	// Wrap, when set, wraps each rank's transport before the communicator uses it: for
	// tests that inject faults (transporttest.Faulty) or trace messages. A wrapper that
	// hides the transport's optional capabilities (windows, shared areas) turns them off.
	Wrap func(rank int, tr transport.Transport) transport.Transport
}

// Comm is a communicator: a group of ranks that run collectives together.
type Comm struct {
	tr    transport.Transport
	ranks []int // comm rank -> transport rank
	rank  int
	size  int
	id    uint32
	hosts []int // comm rank -> host index
	topo  topology
	cfg   Config
	link  LinkCost // the cost model's link: the slowest (between hosts when ranks span hosts)
	intra LinkCost // between ranks of one host
	why   string   // why the transport was chosen
	log   *slog.Logger
	pool  *obuf.Pool

	issueMu sync.Mutex
	seq     uint32
	splits  uint32
	shrinks uint32
	closed  atomic.Bool

	planMu   sync.Mutex
	plans    map[planKey]*plan
	vplans   map[vkey]*vcached // variable-size plans for the counts seen last
	vmu      sync.Mutex        // held while a variable-size op is planned
	vscratch blocks            // its blocks

	actx      context.Context // cancelled on abort or close; every wait uses it
	acancel   context.CancelCauseFunc
	abortOnce sync.Once
	watchers  sync.WaitGroup
	ctlBufs   [][]byte
	probeMu   sync.Mutex
	probeCh   chan probeReply // replies to this rank's stall probe, while one runs

	timer    *time.Timer
	armed    atomic.Bool // timer is set (it stays set across operations until it fires idle)
	inflight atomic.Int32
	progress atomic.Int64
	pend     []atomic.Int32 // per peer: transfers posted and not yet waited for (who a stuck op waits for)
	warned   atomic.Bool    // the no-progress warning was logged for the current stall

	ctxMu   sync.Mutex
	lastCtx context.Context
	stopCtx func() bool

	execPool sync.Pool

	verifyOnce    sync.Once
	verifyPlan    *plan     // the all-gather of Config.Verify
	verifyScratch sync.Pool // of *verifyScratch
	async         workers
	stats         Stats
	prof          profiler

	owned        *owner // the transport and rendezvous (Init, Local, and what Shrink made of them)
	splitFrom    *Comm  // the communicator Split made this one from
	kidsMu       sync.Mutex
	kids         map[*Comm]struct{}    // communicators split from this one, not closed yet
	parent       []int                 // rank in the communicator this one was made from (Split, Shrink)
	closeBarrier bool                  // Close waits for every rank first (communicators from Init)
	direct       transport.SharedAreas // the shared-memory areas (Shared), when every rank is on this host over shm
}

// Stats counts a communicator's work.
type Stats struct {
	Ops       atomic.Uint64
	BytesSent atomic.Uint64
}

const (
	ctlSeq = 0xFFFFFFFF // control messages (abort notices)
	p2pSeq = 0xFFFFFFFE // Send/Recv
	seqMax = 0xFFFFFFFD
)

// Rank returns this rank's index in the communicator.
func (c *Comm) Rank() int { return c.rank }

// Size returns the number of ranks.
func (c *Comm) Size() int { return c.size }

// ID returns the communicator's id (carried in every message).
func (c *Comm) ID() uint32 { return c.id }

// Transport returns the transport under the communicator.
func (c *Comm) Transport() transport.Transport { return c.tr }

// Link describes how this rank reaches one peer.
type Link struct {
	Peer      int    // rank in the communicator
	Host      int    // host index (ranks with equal Host share memory)
	Transport string // the transport's name ("shm", "tcp", "ucx", "shm+tcp" ...)
	Path      string // the path the transport reports for the peer (lanes, copies)
	Why       string // why this transport was chosen
}

// Links reports, for every peer, which transport and path carry the traffic and why:
// what `moex doctor` prints, and the first thing to read when a link is slower than
// expected.
func (c *Comm) Links() []Link {
	pr, _ := c.tr.(transport.PathReporter)
	out := make([]Link, c.size)
	for q := range out {
		l := Link{Peer: q, Host: c.hosts[q], Transport: c.tr.Name(), Why: c.why}
		if pr != nil {
			l.Path = pr.Path(c.ranks[q])
		}
		out[q] = l
	}
	return out
}

// WorldRank maps a rank of this communicator to its rank in the transport (the world).
func (c *Comm) WorldRank(r int) int { return c.ranks[r] }

// Host returns the host index of rank r (ranks with equal indices share memory).
func (c *Comm) Host(r int) int { return c.hosts[r] }

// Hosts returns the number of distinct hosts.
func (c *Comm) Hosts() int { return c.topo.hosts }

// Logger returns the communicator's logger.
func (c *Comm) Logger() *slog.Logger { return c.log }

// LinkCosts returns the cost model's links: the slowest one of the communicator
// (between hosts when its ranks span hosts) and the one between ranks of one host.
func (c *Comm) LinkCosts() (link, host LinkCost) { return c.link, c.intra }

// Pool returns the communicator's buffer pool.
func (c *Comm) Pool() *obuf.Pool { return c.pool }

// SharedMemory reports whether this communicator's AlltoAll, AlltoAllv and AllGather run
// through the shared-memory transport's shared areas (every rank on this host over shm):
// send buffers from obuf.Shared are then read in place by the other ranks, one copy per
// byte.
func (c *Comm) SharedMemory() bool { return c.direct != nil }

// Stats returns the communicator's counters.
func (c *Comm) Stats() *Stats { return &c.stats }

// Err returns why the communicator was aborted or closed, or nil.
func (c *Comm) Err() error {
	if c.actx.Err() == nil {
		return nil
	}
	return context.Cause(c.actx)
}

func defaultLogger() *slog.Logger {
	lvl := strings.ToUpper(os.Getenv("MOEX_DEBUG"))
	var l slog.Level
	switch lvl {
	case "":
		return slog.New(slog.DiscardHandler)
	case "DEBUG", "TRACE":
		l = slog.LevelDebug
	case "INFO", "1":
		l = slog.LevelInfo
	case "WARN":
		l = slog.LevelWarn
	default:
		l = slog.LevelError
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l}))
}

func (cfg *Config) fill() error {
	if cfg.Timeout <= 0 {
		cfg.Timeout = bootstrap.DefaultTimeout
		if v := os.Getenv("MOEX_TIMEOUT"); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil || d <= 0 {
				return &ArgError{Arg: "MOEX_TIMEOUT", Reason: fmt.Sprintf("%q: want a positive duration", v)}
			}
			cfg.Timeout = d
		}
	}
	if cfg.InitTimeout <= 0 {
		cfg.InitTimeout = cfg.Timeout
		if v := os.Getenv("MOEX_INIT_TIMEOUT"); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil || d <= 0 {
				return &ArgError{Arg: "MOEX_INIT_TIMEOUT", Reason: fmt.Sprintf("%q: want a positive duration", v)}
			}
			cfg.InitTimeout = d
		}
	}
	if cfg.Algo == nil {
		m, err := ParseAlgoOverrides(os.Getenv("MOEX_ALGO"))
		if err != nil {
			return err
		}
		cfg.Algo = m
	}
	if cfg.TraceDir == "" {
		cfg.TraceDir = os.Getenv("MOEX_TRACE")
	}
	if v := os.Getenv("MOEX_NET_GBITS"); v != "" && cfg.NetGbits == 0 {
		g, err := strconv.ParseFloat(v, 64)
		if err != nil || !(g > 0) || g > 1e6 {
			return &ArgError{Arg: "MOEX_NET_GBITS", Reason: fmt.Sprintf("%q: want a speed in Gbit/s, above 0", v)}
		}
		cfg.NetGbits = g
	}
	if cfg.NetGbits < 0 || cfg.NetGbits > 1e6 {
		return &ArgError{Arg: "NetGbits", Reason: fmt.Sprintf("%v Gbit/s", cfg.NetGbits)}
	}
	if cfg.TraceDir != "" {
		cfg.Profile = true
	}
	if v := os.Getenv("MOEX_PROFILE"); v != "" && !cfg.Profile {
		switch v {
		case "1", "on", "true":
			cfg.Profile = true
		case "0", "off", "false":
		default:
			return &ArgError{Arg: "MOEX_PROFILE", Reason: fmt.Sprintf("%q: want 1 or 0", v)}
		}
	}
	switch v := os.Getenv("MOEX_WINDOWS"); v {
	case "", "auto", "1":
	case "0", "off":
		cfg.NoWindows = true
	default:
		return &ArgError{Arg: "MOEX_WINDOWS", Reason: fmt.Sprintf("%q: want auto or 0", v)}
	}
	if cfg.Logger == nil {
		cfg.Logger = defaultLogger()
	}
	if cfg.Pool == nil {
		cfg.Pool = obuf.Default
	}
	if cfg.Poll == nil {
		p, err := busypoll.ConfigFromEnv(os.Getenv)
		if err != nil {
			return err
		}
		cfg.Poll = &p
	}
	return nil
}

// newComm builds a communicator over tr. The caller finishes setting it up and then calls
// listen; nothing else runs before that, so the fields set in between need no lock.
func newComm(tr transport.Transport, id uint32, ranks, hosts []int, rank int, cfg Config, link LinkCost) *Comm {
	c := &Comm{
		tr: tr, ranks: ranks, rank: rank, size: len(ranks), id: id, hosts: hosts, cfg: cfg,
		link: link, log: cfg.Logger, pool: cfg.Pool, plans: map[planKey]*plan{}, vplans: map[vkey]*vcached{},
	}
	c.async.init()
	if cfg.Link != nil {
		c.link = *cfg.Link
	}
	c.intra = c.link
	if cfg.Link == nil && cfg.NetGbits > 0 && slices.Max(hosts) > 0 {
		c.link.Beta = 8 / (cfg.NetGbits * 1e9)
	}
	if cfg.HostLink != nil {
		c.intra = *cfg.HostLink
	}
	c.topo = newTopology(hosts)
	if cfg.Profile {
		c.prof.plan = planAllGatherBruck(shape{p: c.size, rank: rank, es: 8, count: 1})
		c.prof.plan.sig = signature(OpAllGather, Bruck, 8, 1, -2)
	}
	c.pend = make([]atomic.Int32, c.size)
	c.actx, c.acancel = context.WithCancelCause(context.Background())
	c.timer = time.AfterFunc(time.Hour, c.checkProgress)
	c.timer.Stop()
	c.execPool.New = func() any { return &execState{} }
	return c
}

// listen posts the receives for the peers' abort notices and starts their watchers: the
// last step of building a communicator, since a watcher may abort it at once.
func (c *Comm) listen() *Comm {
	c.ctlBufs = make([][]byte, c.size)
	for q := 0; q < c.size; q++ {
		if q == c.rank {
			continue
		}
		c.ctlBufs[q] = make([]byte, 1024)
		req, err := c.tr.Irecv(c.ranks[q], c.ctlTag(), c.ctlBufs[q])
		if err != nil {
			c.abortLocal(err)
			continue
		}
		c.watchers.Add(1)
		go c.watch(q, req)
	}
	return c
}

func (c *Comm) ctlTag() transport.Tag { return transport.Tag{Comm: c.id, Seq: ctlSeq} }

// watch waits for an abort notice from peer q, or for the transport to report q dead.
// It answers q's stall probes (and hands on q's replies to this rank's) and waits again.
func (c *Comm) watch(q int, req transport.Request) {
	defer c.watchers.Done()
	for {
		n, err := req.Wait(c.actx)
		if c.actx.Err() != nil {
			return
		}
		if err != nil {
			c.awaitNotice(err)
			if c.actx.Err() != nil {
				return
			}
			c.abortLocal(err) // the transport says q (or the link to it) is gone
			return
		}
		b := c.ctlBufs[q][:n]
		if len(b) < noticeHeader {
			c.abortLocal(&PeerError{Rank: c.ranks[q], Op: "control", Err: fmt.Errorf("%w: short abort notice", transport.ErrProtocol)})
			return
		}
		kind, peer := b[0], int(int32(binary.LittleEndian.Uint32(b[1:])))
		if kind == kindProbe || kind == kindProbeReply {
			c.onProbe(q, kind, b[noticeHeader:])
			if req, err = c.tr.Irecv(c.ranks[q], c.ctlTag(), c.ctlBufs[q]); err != nil {
				if c.actx.Err() == nil {
					c.abortLocal(err)
				}
				return
			}
			continue
		}
		if kind == kindTimeout && peer == c.ranks[c.rank] && time.Duration(nanotime()-c.progress.Load()) >= c.cfg.Timeout/2 {
			// A rank timed out waiting for this one, which is alive and has itself waited a
			// long time: the ranks this one waits for are the ones to name, to every rank.
			// (One that entered its operation only lately is the rank that came late.)
			if w := c.waitingFor(); len(w) > 0 {
				c.abortLocal(&TimeoutError{Idle: c.cfg.Timeout, Waiting: w, Stuck: c.findStuck(w)})
				return
			}
		}
		origin := int(int32(binary.LittleEndian.Uint32(b[5:])))
		if origin < 0 || origin >= c.size {
			origin = q
		}
		// Forwarded as it came: a rank that cannot hear from the one that aborted (a cut
		// link) hears from the others.
		c.abortWith(&AbortError{Rank: origin, Err: decodeNotice(kind, peer, string(b[noticeHeader:]))}, append([]byte(nil), b...))
		return
	}
}

// probeReply is a peer's answer to a stall probe: the ranks (of the world) it waits
// for, and whether it is in an operation of this communicator at all.
type probeReply struct {
	from    int // world rank
	inOp    bool
	waiting []int
}

// onProbe answers peer q's stall probe with the ranks this rank waits for, or hands q's
// reply to this rank's running probe.
func (c *Comm) onProbe(q int, kind uint8, body []byte) {
	if kind == kindProbeReply {
		r := parseProbeReply(body, c.size)
		r.from = c.ranks[q]
		c.probeMu.Lock()
		if c.probeCh != nil {
			select {
			case c.probeCh <- r:
			default:
			}
		}
		c.probeMu.Unlock()
		return
	}
	w := c.waitingFor()
	msg := make([]byte, noticeHeader+1, noticeHeader+1+4*len(w))
	msg[0] = kindProbeReply
	if c.inflight.Load() > 0 {
		msg[noticeHeader] = 1
	}
	for _, x := range w {
		msg = binary.LittleEndian.AppendUint32(msg, uint32(x))
	}
	c.sendCtl(q, msg)
}

// parseProbeReply reads a stall probe's reply from the wire: whether the peer is in an
// operation, and at most max ranks it waits for, each below 2^31.
func parseProbeReply(body []byte, max int) probeReply {
	var r probeReply
	if len(body) >= 1 {
		r.inOp = body[0] == 1
		for i := 1; i+4 <= len(body) && len(r.waiting) < max; i += 4 {
			if w := binary.LittleEndian.Uint32(body[i:]); w < 1<<31 {
				r.waiting = append(r.waiting, int(w))
			}
		}
	}
	return r
}

// sendCtl sends a control message to peer q without waiting for it: a watcher waits for
// its completion, or for the communicator's end.
func (c *Comm) sendCtl(q int, msg []byte) {
	r, err := c.tr.Isend(c.ranks[q], c.ctlTag(), msg)
	if err != nil {
		return
	}
	c.watchers.Add(1)
	go func() {
		defer c.watchers.Done()
		ctx, cancel := context.WithTimeout(c.actx, time.Second)
		defer cancel()
		_, _ = r.Wait(ctx)
	}()
}

// ProbeWindow bounds how long a rank that timed out spends asking along the chain of
// waits which rank is stuck at its end, before it fails.
const ProbeWindow = 200 * time.Millisecond

// findStuck follows the chain of waits from the ranks (of the world) this rank waits
// for: it asks each, on the control channel, whom it waits for in turn, and returns the
// ranks at the end of the chain: those that did not answer within the window (stopped,
// or cut off), else those that answered but are in no operation of this communicator
// (busy elsewhere). Nil when every rank asked is alive and waiting (a cycle, or the
// window too short).
func (c *Comm) findStuck(waiting []int) []int {
	if len(waiting) == 0 || c.actx.Err() != nil {
		return nil
	}
	index := make(map[int]int, c.size) // world rank -> rank in this communicator
	for q, w := range c.ranks {
		index[w] = q
	}
	ch := make(chan probeReply, c.size)
	c.probeMu.Lock()
	c.probeCh = ch
	c.probeMu.Unlock()
	defer func() {
		c.probeMu.Lock()
		c.probeCh = nil
		c.probeMu.Unlock()
	}()
	asked, replies := map[int]bool{}, map[int]probeReply{}
	ask := func(w int) {
		q, ok := index[w]
		if !ok || q == c.rank || asked[w] {
			return
		}
		asked[w] = true
		msg := make([]byte, noticeHeader)
		msg[0] = kindProbe
		c.sendCtl(q, msg)
	}
	for _, w := range waiting {
		ask(w)
	}
	timer := time.NewTimer(min(ProbeWindow, c.cfg.Timeout/10))
	defer timer.Stop()
wait:
	for len(replies) < len(asked) {
		select {
		case r := <-ch:
			if !asked[r.from] {
				continue
			}
			replies[r.from] = r
			for _, w := range r.waiting {
				ask(w)
			}
		case <-timer.C:
			break wait
		case <-c.actx.Done():
			return nil
		}
	}
	var silent, idle []int
	for w := range asked {
		r, ok := replies[w]
		switch {
		case !ok:
			silent = append(silent, w)
		case !r.inOp:
			idle = append(idle, w)
		}
	}
	if len(silent) == 0 {
		silent = idle
	}
	slices.Sort(silent)
	return silent
}

// abortLocal aborts the communicator because of err, seen by this rank, and tells every
// other rank.
func (c *Comm) abortLocal(err error) { c.abortWith(&AbortError{Rank: c.rank, Err: err}, nil) }

// noticeHeader is the length of a control message's header: its kind, the peer it names
// (-1: none) and the rank that aborted (probes: unused), then the text.
const noticeHeader = 9

// abortWith aborts the communicator with ae and tells every other rank: with a notice of
// its own (fwd nil), or by forwarding the notice it learnt ae from, so that every rank
// hears of an abort even where a link to the rank that aborted is down.
func (c *Comm) abortWith(ae *AbortError, fwd []byte) {
	c.abortOnce.Do(func() {
		if !c.closed.Load() {
			c.reportBlame(ae) // before anything wakes: a rank may exit on the error at once
		}
		c.acancel(ae)
		if c.direct != nil {
			c.direct.Wake() // a rank waiting in the shared area looks at actx again
		}
		// What was split from an aborted communicator is aborted too: a rank that gave up
		// on the parent must not leave its peers waiting in a child.
		c.kidsMu.Lock()
		kids := make([]*Comm, 0, len(c.kids))
		for k := range c.kids {
			kids = append(kids, k)
		}
		c.kidsMu.Unlock()
		for _, k := range kids {
			k.abortLocal(fmt.Errorf("%w: the communicator it was split from (comm %d) aborted: %v", ErrAborted, c.id, ae))
		}
		if c.closed.Load() {
			return
		}
		c.log.Warn("moex: communicator aborted", "comm", c.id, "rank", c.rank, "by", ae.Rank, "err", ae.Err)
		msg := fwd
		if msg == nil {
			peer := -1
			var pe *PeerError
			var te *TimeoutError
			switch {
			case errors.As(ae.Err, &pe):
				peer = pe.Rank
			case errors.As(ae.Err, &te):
				peer = te.blame()
			}
			reason := ae.Err.Error()
			if len(reason) > 900 {
				reason = reason[:900]
			}
			msg = make([]byte, noticeHeader+len(reason))
			msg[0] = kindOf(ae.Err)
			binary.LittleEndian.PutUint32(msg[1:], uint32(int32(peer)))
			binary.LittleEndian.PutUint32(msg[5:], uint32(int32(ae.Rank)))
			copy(msg[noticeHeader:], reason)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		var reqs []transport.Request
		for q := 0; q < c.size; q++ {
			if q == c.rank {
				continue
			}
			if r, err := c.tr.Isend(c.ranks[q], c.ctlTag(), msg); err == nil {
				reqs = append(reqs, r)
			}
		}
		_ = transport.WaitAll(ctx, reqs...)
	})
}

// blameOnce makes a process report one root cause to its launcher: the first abort's.
var blameOnce sync.Once

// reportBlame tells the launcher (moex run: MOEX_LAUNCH_REPORT names a directory) which
// rank of the world this rank holds to blame for ae: a dead peer, the rank a timeout
// waited for, or the rank that aborted. The launcher blames that rank rather than the
// first survivor that exited because of it.
func (c *Comm) reportBlame(ae *AbortError) {
	dir := os.Getenv("MOEX_LAUNCH_REPORT")
	if dir == "" {
		return
	}
	blame := c.ranks[ae.Rank]
	var pe *PeerError
	var te *TimeoutError
	switch {
	case errors.As(ae.Err, &pe):
		blame = pe.Rank
	case errors.As(ae.Err, &te) && te.blame() >= 0:
		blame = te.blame()
	}
	blameOnce.Do(func() {
		name := filepath.Join(dir, fmt.Sprintf("rank%d", c.ranks[c.rank]))
		_ = os.WriteFile(name, []byte(fmt.Sprintf("blame %d %s\n", blame, kindName(ae.Err))), 0o600)
	})
}

// Abort aborts the communicator: every pending and later operation on every rank fails
// with an *AbortError. It does not wait for anything and is safe to call at any time.
func (c *Comm) Abort(reason string) {
	c.abortLocal(fmt.Errorf("%w: %s", ErrAborted, reason))
}

// checkProgress is the watchdog: an operation that made no progress for the timeout
// aborts the communicator.
func (c *Comm) checkProgress() {
	if c.actx.Err() != nil {
		return
	}
	if c.inflight.Load() == 0 {
		// Nothing runs: stay unset. An operation that began since and found the timer
		// still set is seen by the second look (it counts itself in before it looks at
		// armed; this clears armed before it looks again).
		c.armed.Store(false)
		if c.inflight.Load() == 0 || !c.armed.CompareAndSwap(false, true) {
			return
		}
	}
	idle := time.Duration(nanotime() - c.progress.Load())
	if idle >= c.cfg.Timeout {
		w := c.waitingFor()
		c.abortLocal(&TimeoutError{Idle: idle.Round(time.Millisecond), Waiting: w, Stuck: c.findStuck(w)})
		return
	}
	if idle >= WarnAfter && !c.warned.Swap(true) {
		c.log.Warn("moex: no progress; waiting for ranks", "comm", c.id, "rank", c.rank, "idle", idle.Round(time.Millisecond),
			"waiting_for", c.waitingFor(), "timeout", c.cfg.Timeout)
	}
	c.timer.Reset(c.nextCheck(idle))
}

// WarnAfter is how long an operation may make no progress before a warning names the
// ranks it waits for (when the timeout is longer).
const WarnAfter = 30 * time.Second

// nextCheck is when the watchdog looks again, idle into a stall: at the warning, then
// at the timeout.
func (c *Comm) nextCheck(idle time.Duration) time.Duration {
	if idle < WarnAfter && WarnAfter < c.cfg.Timeout && !c.warned.Load() {
		return WarnAfter - idle
	}
	return c.cfg.Timeout - idle
}

// waitingFor lists the ranks (of the world) this rank's operations wait for now:
// those with a transfer posted and not completed.
func (c *Comm) waitingFor() []int {
	var out []int
	for q := range c.pend {
		if q != c.rank && c.pend[q].Load() > 0 {
			out = append(out, c.ranks[q])
		}
	}
	if c.direct != nil { // the shared areas: the ranks that have not published
		for _, q := range c.direct.Waiting() {
			if !slices.Contains(out, q) {
				out = append(out, q)
			}
		}
		slices.Sort(out)
	}
	return out
}

var epoch = time.Now()

func nanotime() int64 { return int64(time.Since(epoch)) }

// begin starts an operation: it checks the communicator and the context, and arms the
// watchdog.
func (c *Comm) begin(ctx context.Context) error {
	if c.closed.Load() {
		return ErrClosed
	}
	if err := c.Err(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		c.abortLocal(transport.CtxError(err))
		return c.Err()
	}
	c.watchCtx(ctx)
	c.progress.Store(nanotime())
	c.inflight.Add(1)
	// Set the watchdog unless it is set already: it stays set while operations follow
	// each other, instead of being reset by each (without the reset per operation, a
	// 256-byte AlltoAll at P=4 over shm took 12% less user CPU).
	if !c.armed.Load() && c.armed.CompareAndSwap(false, true) {
		c.warned.Store(false)
		c.timer.Reset(c.nextCheck(0))
	}
	return nil
}

func (c *Comm) end() {
	c.progress.Store(nanotime())
	c.inflight.Add(-1)
}

// watchCtx arranges for ctx's end to abort the communicator while operations run. The
// registration is kept while callers keep passing the same context, so that steady-state
// operations allocate nothing.
func (c *Comm) watchCtx(ctx context.Context) {
	if ctx.Done() == nil {
		return
	}
	c.ctxMu.Lock()
	defer c.ctxMu.Unlock()
	if c.lastCtx == ctx {
		return
	}
	if c.stopCtx != nil {
		c.stopCtx()
	}
	c.lastCtx = ctx
	c.stopCtx = context.AfterFunc(ctx, func() {
		if c.inflight.Load() > 0 {
			c.abortLocal(transport.CtxError(ctx.Err()))
		}
	})
}

// nextSeq returns the sequence number of the next collective.
func (c *Comm) nextSeq() uint32 {
	c.issueMu.Lock()
	c.seq++
	if c.seq > seqMax {
		c.seq = 1
	}
	s := c.seq
	c.issueMu.Unlock()
	return s
}

// Close releases the communicator: its watchers stop, and the transport and rendezvous
// (for the communicator Init or Local created) are closed. Pending operations fail with
// ErrClosed. Close does not talk to other ranks; they see this rank leave.
//
// For the communicator Init returned, Close is collective: it first waits (for at most the
// timeout, or 30 s) until every rank has reached Close, so that a rank that finishes early
// does not fail the last operation of a slower one by leaving.
func (c *Comm) Close() error {
	if c.closeBarrier && !c.closed.Load() && c.Err() == nil && c.size > 1 {
		ctx, cancel := context.WithTimeout(context.Background(), min(c.cfg.Timeout, 30*time.Second))
		if err := Barrier(ctx, c); err != nil {
			c.log.Warn("moex: not every rank reached Close", "rank", c.rank, "err", err)
		}
		cancel()
	}
	if c.closed.Swap(true) {
		return nil
	}
	if pa := c.splitFrom; pa != nil {
		pa.kidsMu.Lock()
		delete(pa.kids, c)
		pa.kidsMu.Unlock()
	}
	var errs []error
	if c.cfg.Profile {
		for _, p := range c.Profile() {
			c.log.Info("moex: profile", "comm", c.id, "rank", c.rank, "profile", p.String())
		}
		if err := c.writeTrace(); err != nil {
			c.log.Warn("moex: trace not written", "rank", c.rank, "err", err)
			errs = append(errs, err)
		}
	}
	c.abortOnce.Do(func() { c.acancel(ErrClosed) })
	c.acancel(ErrClosed)
	c.timer.Stop()
	c.ctxMu.Lock()
	if c.stopCtx != nil {
		c.stopCtx()
	}
	c.ctxMu.Unlock()
	c.watchers.Wait()
	close(c.async.stop)
	c.async.wg.Wait()
	errs = append(errs, c.owned.release())
	return errors.Join(errs...)
}

// owner holds what the communicators made by Init or Local own, and what Shrink makes
// of them share: the transport and the rendezvous, closed by the last one's Close.
type owner struct {
	refs    atomic.Int32
	closers []func() error
}

func newOwner(closers ...func() error) *owner {
	o := &owner{closers: closers}
	o.refs.Store(1)
	return o
}

func (o *owner) release() error {
	if o == nil || o.refs.Add(-1) != 0 {
		return nil
	}
	var errs []error
	for i := len(o.closers) - 1; i >= 0; i-- {
		errs = append(errs, o.closers[i]())
	}
	return errors.Join(errs...)
}

// Local returns n communicators whose ranks are goroutines of this process, connected by
// the inproc transport.
func Local(n int, cfg Config) ([]*Comm, error) {
	if n < 1 {
		return nil, &ArgError{Arg: "n", Reason: fmt.Sprintf("%d ranks", n)}
	}
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	if cfg.Hosts != nil && len(cfg.Hosts) != n {
		return nil, &ArgError{Arg: "Hosts", Reason: fmt.Sprintf("%d entries for %d ranks", len(cfg.Hosts), n)}
	}
	// The ranks are goroutines: with no P to spare, a spinning rank takes the P another
	// rank needs (measured: P=2 on GOMAXPROCS=2, 64 KiB AllReduce, adaptive spinning 10.9us
	// against 8.3us parking).
	poller := busypoll.New(busypoll.Config{Mode: cfg.Poll.Mode, MaxSpin: cfg.Poll.MaxSpin,
		Oversubscribed: cfg.Poll.Oversubscribed || n >= runtime.GOMAXPROCS(0)})
	eps := bootstrap.Local(n, poller, cfg.Pool)
	ranks := make([]int, n)
	for i := range ranks {
		ranks[i] = i
	}
	hosts := cfg.Hosts
	if hosts != nil {
		hosts = hostsDense(hosts)
	} else {
		hosts = make([]int, n)
	}
	cs := make([]*Comm, n)
	for i, e := range eps {
		tr := e
		if cfg.Wrap != nil {
			tr = cfg.Wrap(i, e)
		}
		cs[i] = newComm(tr, 1, ranks, hosts, i, cfg, CostInproc)
		cs[i].why = "inproc: every rank in this process (Local)"
		cs[i].owned = newOwner(tr.Close)
		cs[i].listen()
	}
	return cs, nil
}

// Init joins the job described by the environment (MOEX_*, torchrun, Open MPI or Slurm
// variables; see moex env): rendezvous at rank 0's store, exchange host
// identities, connect a transport to every rank, and return the world communicator.
func Init(ctx context.Context, cfg Config) (*Comm, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	env, err := bootstrap.FromEnv()
	if err != nil {
		return nil, err
	}
	if env.Timeout > 0 && os.Getenv("MOEX_TIMEOUT") != "" {
		cfg.Timeout = env.Timeout
	}
	return InitEnv(ctx, env, cfg)
}

// InitEnv is Init with the job description given.
func InitEnv(ctx context.Context, env bootstrap.Env, cfg Config) (*Comm, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	// Start-up is an operation like any other: one deadline (MOEX_INIT_TIMEOUT, else the
	// communicator's timeout), and on failure every rank says which ranks it never heard
	// from and how far each got (*bootstrap.StartupError).
	ictx, cancelInit := context.WithTimeout(ctx, cfg.InitTimeout)
	defer cancelInit()
	rv, err := bootstrap.Join(ictx, env, log)
	if err != nil {
		return nil, err
	}
	if env.AddrNote != "" {
		log.Info("moex: rendezvous", "rank", env.Rank, "store", rv.Env.Addr, "chosen", env.AddrNote)
	}
	sctx, stopWatch := rv.Watch(ictx) // ends as soon as the store learns the start-up failed
	fail := func(err error) (*Comm, error) {
		stopWatch()
		var se *bootstrap.StartupError
		switch cause := context.Cause(sctx); {
		case errors.As(cause, &se):
			err = se // a rank left or was claimed twice: the root, not its symptom here
		case !errors.As(err, &se) && ictx.Err() != nil:
			err = rv.Explain(err) // the deadline: the store says who is missing
		}
		rv.Close()
		return nil, err
	}
	ctx = sctx
	// Hosts, CPU binding, the network's speed and the transport to every peer.
	bs, err := bootstrap.Open(ctx, env, rv, *cfg.Poll, log)
	if err != nil {
		var tae *transport.ArgError
		if errors.As(err, &tae) {
			err = &ArgError{Arg: tae.Arg, Reason: tae.Reason}
		}
		return fail(err)
	}
	tr, why, hosts, poll := bs.Transport, bs.Why, bs.Hosts, bs.Poll
	link := map[bootstrap.Class]LinkCost{bootstrap.Inproc: CostInproc, bootstrap.Shm: CostShm, bootstrap.Net: CostNet}[bs.Class]
	if bs.NetGbits > 0 && cfg.Link == nil && cfg.NetGbits == 0 {
		// The network's speed for the cost model: the NIC's (MOEX_NET_GBITS overrides).
		cfg.NetGbits = bs.NetGbits
		log.Info("moex: network speed for the cost model", "rank", env.Rank, "gbits", cfg.NetGbits)
	}
	ranks := make([]int, env.Size)
	for i := range ranks {
		ranks[i] = i
	}
	if cfg.Wrap != nil {
		tr = cfg.Wrap(env.Rank, tr)
	}
	c := newComm(tr, 1, ranks, hosts, env.Rank, cfg, link)
	c.why = why
	if sp, ok := tr.(transport.SharedAreasProvider); ok {
		c.direct = sp.SharedAreas() // the shared-area collectives (shm, every rank on this host)
	}
	if c.topo.hosts > 1 && cfg.HostLink == nil && env.Transport != "tcp" {
		c.intra = CostShm // the ranks of a host talk through shared memory
	}
	if c.direct != nil && poll.Oversubscribed && cfg.Link == nil {
		// One host, more ranks than CPUs: every step that waits for a peer costs
		// context switches (see CrowdedAlpha).
		c.link.Alpha *= CrowdedAlpha
		c.intra.Alpha *= CrowdedAlpha
	}
	if err := rv.Ready(ctx); err != nil { // every rank is set up; the store closes
		tr.Close()
		return fail(err)
	}
	stopWatch()
	c.owned = newOwner(rv.Close, tr.Close)
	c.closeBarrier = true
	c.listen()
	if log.Enabled(ctx, slog.LevelInfo) {
		pr, _ := tr.(transport.PathReporter)
		for q := 0; q < env.Size; q++ {
			path := why
			if pr != nil {
				path = pr.Path(q)
			}
			log.Info("moex: transport to peer", "rank", env.Rank, "peer", q, "host", hosts[q], "transport", tr.Name(), "why", why, "path", path)
		}
		log.Info("moex: initialised", "rank", env.Rank, "size", env.Size, "hosts", c.topo.hosts, "launcher", env.Launcher,
			"transport", tr.Name(), "poll", poll.Mode.String(), "oversubscribed", poll.Oversubscribed, "timeout", cfg.Timeout)
	}
	return c, nil
}

// Split partitions the communicator: ranks that pass the same color form a new
// communicator, ordered by key (then by rank). A negative color (Undefined) returns nil.
// Split is collective: every rank must call it. Aborting c aborts what was split from
// it (and, for their ranks, tells their peers), so that no rank waits in a child for a
// rank that gave up on the parent.
func (c *Comm) Split(ctx context.Context, color, key int) (*Comm, error) {
	mine := []int64{int64(color), int64(key)}
	all := make([]int64, 2*c.size)
	if err := AllGather(ctx, c, mine, all); err != nil {
		return nil, err
	}
	c.issueMu.Lock()
	c.splits++
	n := c.splits
	c.issueMu.Unlock()
	if color < 0 {
		return nil, nil
	}
	type member struct{ key, rank int }
	var ms []member
	for r := 0; r < c.size; r++ {
		if int(all[2*r]) == color {
			ms = append(ms, member{int(all[2*r+1]), r})
		}
	}
	sort.SliceStable(ms, func(i, j int) bool {
		if ms[i].key != ms[j].key {
			return ms[i].key < ms[j].key
		}
		return ms[i].rank < ms[j].rank
	})
	ranks := make([]int, len(ms))
	hosts := make([]int, len(ms))
	me := -1
	for i, m := range ms {
		ranks[i] = c.ranks[m.rank]
		hosts[i] = c.hosts[m.rank]
		if m.rank == c.rank {
			me = i
		}
	}
	id := signature(OpKind(0xff), 0, int(c.id), int(n), color)
	if id >= 0xFFFFFFF0 || id <= 1 {
		id ^= 0x5a5a5a5a
	}
	sub := newComm(c.tr, id, ranks, hostsDense(hosts), me, c.cfg, c.link)
	sub.why = c.why
	if sub.topo.hosts == 1 {
		sub.link = c.intra // every link of this one is within a host
	}
	sub.intra = c.intra
	sub.parent = make([]int, len(ms))
	for i, m := range ms {
		sub.parent[i] = m.rank
	}
	sub.splitFrom = c
	c.kidsMu.Lock()
	if c.kids == nil {
		c.kids = map[*Comm]struct{}{}
	}
	c.kids[sub] = struct{}{}
	c.kidsMu.Unlock()
	if err := c.Err(); err != nil { // aborted while splitting: so is the child
		sub.listen()
		sub.abortLocal(fmt.Errorf("%w: the communicator it was split from aborted: %v", ErrAborted, err))
		return sub, nil
	}
	return sub.listen(), nil
}

// Undefined is the Split color of ranks that join no new communicator.
const Undefined = -1

func hostsDense(h []int) []int {
	idx := map[int]int{}
	out := make([]int, len(h))
	for i, x := range h {
		if _, ok := idx[x]; !ok {
			idx[x] = len(idx)
		}
		out[i] = idx[x]
	}
	return out
}

// SplitHosts returns the intra-host communicator (ranks on this rank's host) and the
// inter-host communicator of the ranks with the same local index on every host (nil when
// hosts have different numbers of ranks and this rank has no counterpart on some host).
func (c *Comm) SplitHosts(ctx context.Context) (intra, inter *Comm, err error) {
	local := 0
	for r := 0; r < c.rank; r++ {
		if c.hosts[r] == c.hosts[c.rank] {
			local++
		}
	}
	intra, err = c.Split(ctx, c.hosts[c.rank], c.rank)
	if err != nil {
		return nil, nil, err
	}
	inter, err = c.Split(ctx, local, c.hosts[c.rank])
	if err != nil {
		intra.Close()
		return nil, nil, err
	}
	return intra, inter, nil
}

var _ = slices.Index[[]int]
var _ = dtype.F32

// Model is the cost model and the planners of a communicator of p ranks on the given
// hosts, without a transport: the algorithm an operation would run with and the schedule
// every rank would follow (moex flow, capacity planning). Its links are those a job on
// that placement sees (cfg.Link and cfg.HostLink, or shared memory within hosts and the
// network between them). It does not model the shared-memory areas, which need the
// ranks' segments: a job over shm may choose them where the model does not.
type Model struct {
	cs []*Comm
}

// MaxModelRanks bounds a Model.
const MaxModelRanks = 1 << 14

// NewModel returns the model of p ranks on hosts (nil: one host).
func NewModel(p int, hosts []int, cfg Config) (*Model, error) {
	if p < 1 || p > MaxModelRanks {
		return nil, &ArgError{Arg: "p", Reason: fmt.Sprintf("%d ranks (want 1..%d)", p, MaxModelRanks)}
	}
	if hosts != nil && len(hosts) != p {
		return nil, &ArgError{Arg: "hosts", Reason: fmt.Sprintf("%d entries for %d ranks", len(hosts), p)}
	}
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	if hosts == nil {
		hosts = make([]int, p)
	}
	hosts = hostsDense(hosts)
	link := CostShm
	if slices.Max(hosts) > 0 {
		link = CostNet
		if cfg.HostLink == nil {
			cfg.HostLink = &CostShm
		}
	}
	ranks := make([]int, p)
	for i := range ranks {
		ranks[i] = i
	}
	m := &Model{cs: make([]*Comm, p)}
	for r := range m.cs {
		m.cs[r] = newComm(nil, 0, ranks, hosts, r, cfg, link)
	}
	return m, nil
}

// Comm is rank's communicator of the model: no transport, for planning questions
// (Size, Host, LinkCosts, Algorithm), not for operations.
func (m *Model) Comm(rank int) *Comm { return m.cs[rank] }

// Algorithm is the algorithm op runs with for bytes (see Comm.Algorithm).
func (m *Model) Algorithm(op OpKind, bytes int) Algo { return m.cs[0].Algorithm(op, bytes) }

// Hosts is the number of hosts.
func (m *Model) Hosts() int { return m.cs[0].Hosts() }

// Host is rank r's host index.
func (m *Model) Host(r int) int { return m.cs[0].Host(r) }

// AlltoAllv plans an AlltoAllv of counts[i][j] units of unit bytes from rank i to rank j
// (as Comm.PlanAlltoAllv) and returns its algorithm and rank's schedule.
func (m *Model) AlltoAllv(rank int, counts [][]int, unit int) (Algo, string, error) {
	if rank < 0 || rank >= len(m.cs) {
		return 0, "", &ArgError{Arg: "rank", Reason: fmt.Sprintf("%d of %d", rank, len(m.cs))}
	}
	c := m.cs[rank]
	var vp VPlan
	if err := c.ReplanAlltoAllv(&vp, counts, unit); err != nil {
		return 0, "", err
	}
	return vp.Algo, vp.Describe(c), nil
}

// Describe writes rank's schedule of op on count elements of dt (see Comm.Describe).
func (m *Model) Describe(rank int, op OpKind, dt dtype.Type, count, root int) string {
	return m.cs[rank].Describe(op, dt, count, root)
}
