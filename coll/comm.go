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
// 4 KiB pages that make() usually gets (a Go slice's blocks therefore go through the
// shared areas, two copies, up to the areas' size, MOEX_SHM_AREA). Take large buffers
// from obuf, as dispatch and combine do, and hold the *obuf.Buf while its memory is in
// use:
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
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/coll/health"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/bootstrap"
)

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
func (c *Comm) Hosts() int { return c.topo.Hosts }

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
	case "", "auto", "1", "on": // 1: the ucx transport also reads it (EmulatedWindows)
	case "0", "off":
		cfg.NoWindows = true
	default:
		return &ArgError{Arg: "MOEX_WINDOWS", Reason: fmt.Sprintf("%q: want auto, 1 or 0", v)}
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

// listen posts the receives for the peers' abort notices and starts their watchers: the
// last step of building a communicator, since a watcher may abort it at once.
func (c *Comm) listen() *Comm {
	c.ctlBufs = make([][]byte, c.size)
	c.lost = make([]chan struct{}, c.size)
	for q := range c.lost {
		c.lost[q] = make(chan struct{})
	}
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
		if errors.Is(err, transport.ErrPeerClosed) {
			close(c.lost[q]) // whether or not the communicator has aborted meanwhile
		}
		if c.actx.Err() != nil {
			return
		}
		if err != nil {
			if errors.Is(err, transport.ErrPeerLeft) {
				c.awaitNotice(err) // a goodbye: the notice that explains it may come from another rank
			}
			if c.actx.Err() != nil {
				return
			}
			c.abortLocal(err) // the transport says q (or the link to it) is gone
			return
		}
		b := c.ctlBufs[q][:n]
		m, err := health.Parse(b)
		if err != nil {
			c.abortLocal(&PeerError{Rank: c.ranks[q], Op: "control", Err: fmt.Errorf("%w: %w", transport.ErrProtocol, err)})
			return
		}
		if m.Kind == health.Probe || m.Kind == health.ProbeReply {
			c.onProbe(q, m.Kind, m.Body)
			if req, err = c.tr.Irecv(c.ranks[q], c.ctlTag(), c.ctlBufs[q]); err != nil {
				if c.actx.Err() == nil {
					c.abortLocal(err)
				}
				return
			}
			continue
		}
		if m.Kind == health.Timeout && m.Blame == c.ranks[c.rank] && c.dog.Idle() >= c.cfg.Timeout/2 {
			// A rank timed out waiting for this one, which is alive and has itself waited a
			// long time: the ranks this one waits for are the ones to name, to every rank.
			// (One that entered its operation only lately is the rank that came late.)
			if w := c.waitingFor(); len(w) > 0 {
				c.abortLocal(&TimeoutError{Idle: c.cfg.Timeout, Waiting: w, Stuck: c.findStuck(w)})
				return
			}
		}
		origin := m.Origin
		if origin < 0 || origin >= c.size {
			origin = q
		}
		// Forwarded as it came: a rank that cannot hear from the one that aborted (a cut
		// link) hears from the others.
		c.abortWith(&AbortError{Rank: origin, Err: decodeNotice(m.Kind, m.Blame, string(m.Body))}, append([]byte(nil), b...))
		return
	}
}

// onProbe answers peer q's stall probe with the ranks this rank waits for, or hands q's
// reply to this rank's running probe.
func (c *Comm) onProbe(q int, kind health.Kind, body []byte) {
	if kind == health.ProbeReply {
		r := health.ParseReply(body, c.size)
		r.From = c.ranks[q]
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
	c.sendCtl(q, health.ReplyMessage(c.dog.Busy(), c.waitingFor()))
}

// sendCtl sends a control message to peer q without waiting for it: a watcher waits for
// its completion, or for the communicator's end.
func (c *Comm) sendCtl(q int, msg []byte) {
	// The watchdog's timer goroutine sends probes too, and Close does not wait for it:
	// once Close has begun waiting for the watchers, nothing is sent and none is added.
	c.watchMu.Lock()
	defer c.watchMu.Unlock()
	if c.ctlStopped {
		return
	}
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
// for, over the control channel, to the ranks at its end (health.FindStuck).
func (c *Comm) findStuck(waiting []int) []int {
	if len(waiting) == 0 || c.actx.Err() != nil {
		return nil
	}
	index := make(map[int]int, c.size) // world rank -> rank in this communicator
	for q, w := range c.ranks {
		index[w] = q
	}
	ch := make(chan health.Reply, c.size)
	c.probeMu.Lock()
	c.probeCh = ch
	c.probeMu.Unlock()
	defer func() {
		c.probeMu.Lock()
		c.probeCh = nil
		c.probeMu.Unlock()
	}()
	ask := func(w int) bool {
		q, ok := index[w]
		if !ok || q == c.rank {
			return false
		}
		c.sendCtl(q, health.ProbeMessage())
		return true
	}
	return health.FindStuck(waiting, min(ProbeWindow, c.cfg.Timeout/10), ask, ch, c.actx.Done())
}

// abortLocal aborts the communicator because of err, seen by this rank, and tells every
// other rank.
func (c *Comm) abortLocal(err error) { c.abortWith(&AbortError{Rank: c.rank, Err: err}, nil) }

// abortWith aborts the communicator with ae and tells every other rank: with a notice of
// its own (fwd nil), or by forwarding the notice it learnt ae from, so that every rank
// hears of an abort even where a link to the rank that aborted is down.
func (c *Comm) abortWith(ae *AbortError, fwd []byte) {
	c.abortOnce.Do(func() {
		if !c.closed.Load() {
			c.reportBlame(ae) // before anything wakes: a rank may exit on the error at once
		}
		// The notices go out before this rank's operations wake, for the same reason: a
		// rank that exits on the error the moment it gets it would otherwise leave its
		// peers an ended connection where it meant to leave them its reason.
		var reqs []transport.Request
		if !c.closed.Load() {
			c.log.Warn("moex: communicator aborted", "comm", c.id, "rank", c.rank, "by", ae.Rank, "err", ae.Err)
			msg := fwd
			if msg == nil {
				msg = noticeOf(ae)
			}
			for q := 0; q < c.size; q++ {
				if q == c.rank {
					continue
				}
				if r, err := c.tr.Isend(c.ranks[q], c.ctlTag(), msg); err == nil {
					reqs = append(reqs, r)
				}
			}
		}
		c.acancel(ae)
		if c.direct != nil {
			c.direct.Wake() // a rank waiting in the shared area looks at actx again
		}
		if h := abortTestHook.Load(); h != nil {
			(*h)(c)
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
		if len(reqs) > 0 {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			_ = transport.WaitAll(ctx, reqs...)
		}
	})
}

// abortTestHook, when set (by tests), runs in abortWith once the rank's operations are
// woken, before anything else: as if the rank exited there. Tests running in parallel
// see it too, so it must ignore their communicators.
var abortTestHook atomic.Pointer[func(c *Comm)]

// blamed is the rank (of the world) ae blames: a dead peer, the rank a timeout waited
// for; -1: none.
func blamed(ae *AbortError) int {
	var pe *PeerError
	var te *TimeoutError
	var pa *PanicError
	switch {
	case errors.As(ae.Err, &pa):
		return pa.Rank
	case errors.As(ae.Err, &pe):
		return pe.Rank
	case errors.As(ae.Err, &te):
		return te.blame()
	}
	return -1
}

// noticeOf is the abort notice that tells the other ranks of ae.
func noticeOf(ae *AbortError) []byte {
	return health.Notice(kindOf(ae.Err), blamed(ae), ae.Rank, ae.Err.Error())
}

// reportBlame tells the launcher which rank of the world this rank holds to blame for
// ae: the one ae blames, else the rank that aborted.
func (c *Comm) reportBlame(ae *AbortError) {
	blame := blamed(ae)
	if blame < 0 {
		blame = c.ranks[ae.Rank]
	}
	health.ReportBlame(c.ranks[c.rank], blame, kindOf(ae.Err))
}

// Abort aborts the communicator: every pending and later operation on every rank fails
// with an *AbortError. It does not wait for anything and is safe to call at any time.
func (c *Comm) Abort(reason string) {
	c.abortLocal(fmt.Errorf("%w: %s", ErrAborted, reason))
}

// stalled is the watchdog's verdict: no progress for the timeout aborts the
// communicator, naming the ranks it waited for and those at the end of the chain.
func (c *Comm) stalled(idle time.Duration) {
	w := c.waitingFor()
	c.abortLocal(&TimeoutError{Idle: idle.Round(time.Millisecond), Waiting: w, Stuck: c.findStuck(w)})
}

// stalling is the watchdog's warning, long into a stall.
func (c *Comm) stalling(idle time.Duration) {
	c.log.Warn("moex: no progress; waiting for ranks", "comm", c.id, "rank", c.rank, "idle", idle.Round(time.Millisecond),
		"waiting_for", c.waitingFor(), "timeout", c.cfg.Timeout)
}

// WarnAfter is how long an operation may make no progress before a warning names the
// ranks it waits for (when the timeout is longer).
const WarnAfter = 30 * time.Second

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
		c.abortLocal(ctxError(err))
		return c.Err()
	}
	c.watchCtx(ctx)
	c.dog.Begin()
	return nil
}

func (c *Comm) end() { c.dog.End() }

// watchCtx arranges for ctx's end to abort the communicator while operations run. The
// registration is kept while callers keep passing the same context, so that steady-state
// operations allocate nothing.
//
// Only the context of the latest operation is watched: a context that ends after its
// operations returned, while an operation with another context (or one that never ends)
// runs, must not abort the communicator (a caller's `defer cancel()` after an operation
// is the common case).
func (c *Comm) watchCtx(ctx context.Context) {
	c.ctxMu.Lock()
	defer c.ctxMu.Unlock()
	if c.lastCtx == ctx {
		return
	}
	if c.stopCtx != nil {
		c.stopCtx()
		c.stopCtx = nil
	}
	c.lastCtx = nil
	if ctx.Done() == nil {
		return
	}
	c.lastCtx = ctx
	c.stopCtx = context.AfterFunc(ctx, func() {
		c.ctxMu.Lock()
		current := c.lastCtx == ctx
		c.ctxMu.Unlock()
		if current && c.dog.Busy() {
			c.abortLocal(ctxError(ctx.Err()))
		}
	})
}

// ctxError is the error of an operation whose context ended (transport.CtxError): where
// the launcher (moex run) is stopping the job, which is why a rank's program cancels its
// context on SIGTERM, a *StoppedError that names the rank the launcher blames, rather
// than only "context canceled".
func ctxError(err error) error {
	err = transport.CtxError(err)
	if rank, why := health.StopReason(); rank >= 0 && errors.Is(err, ErrCanceled) {
		return &StoppedError{Rank: rank, Reason: why, err: err}
	}
	return err
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

// Undefined is the Split color of ranks that join no new communicator.
const Undefined = -1

var _ = slices.Index[[]int]
var _ = dtype.F32

// MaxModelRanks bounds a Model.
const MaxModelRanks = 1 << 14

// noticeGrace is how long an error from a peer that said goodbye waits for an abort
// notice that explains it.
const noticeGrace = 500 * time.Millisecond

// mismatchGrace is how long a mismatched message waits for a notice that explains it.
const mismatchGrace = 100 * time.Millisecond

// awaitNotice: a peer that closed its end in the middle of an operation has usually seen
// the communicator abort (another rank died, or failed); that abort's notice is on its
// way on another connection. Wait for it a moment, so that every rank's error names the
// cause rather than the rank that left because of it.
//
// A peer whose connection ended without a goodbye (it crashed, or exited on an error)
// sent any notice before the end of the connection, on the same connection: the notice
// completed that peer's watcher's receive before the transport failed this operation,
// though the watcher may not have acted on it yet. Wait, as long as a mismatch's grace at
// most, for the watcher to act (the communicator aborts with the notice's cause) or to
// see the peer gone without one (lost): then nothing more is coming, and a crash is an
// error at once.
//
// A message of another operation than the one posted (transport.ErrMismatch) is often a
// peer's step of an operation this rank never entered, sent before that peer aborted:
// its notice is on the way too, and is waited for a shorter moment.
func (c *Comm) awaitNotice(err error) {
	grace := noticeGrace
	var lost <-chan struct{}
	switch {
	case c.actx.Err() != nil:
		return
	case errors.Is(err, transport.ErrPeerLeft):
	case errors.Is(err, transport.ErrPeerClosed):
		grace = mismatchGrace
		var pe *transport.PeerError
		if errors.As(err, &pe) {
			if q := slices.Index(c.ranks, pe.Rank); q >= 0 && q != c.rank && c.lost != nil {
				lost = c.lost[q]
			}
		}
	case errors.Is(err, transport.ErrMismatch):
		grace = mismatchGrace
	default:
		return
	}
	t := time.NewTimer(grace)
	select {
	case <-c.actx.Done():
	case <-lost:
	case <-t.C:
	}
	t.Stop()
}

func (w *workers) init() {
	w.jobs = make(chan *job, 1024)
	w.stop = make(chan struct{})
}

// nextOf is the sequence number after seq.
func nextOf(seq uint32) uint32 {
	if seq++; seq > seqMax {
		seq = 1
	}
	return seq
}
