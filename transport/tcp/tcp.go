// Package tcp is moex's transport across hosts without RDMA: framed TCP streams between
// every pair of ranks, authenticated with the job secret.
//
// Small messages go eager (header and payload in one frame); when the writer is idle the
// posting goroutine writes the frame itself, and frames that queue up behind a busy writer
// leave together in one writev. Large messages go rendezvous: an RTS frame announces them,
// the receiver answers CTS once a receive is posted, and the data frames are read by the
// receiver straight into the posted buffer. With several streams per peer the data of one
// message is striped over all of them.
//
// Receivers busy-poll: each stream's reader tries non-blocking reads under the adaptive
// policy of package busypoll (spin, yield, then park on the Go netpoller), and sets
// SO_BUSY_POLL / SO_PREFER_BUSY_POLL where the kernel allows so that the kernel polls the
// device queue too. Whether the socket options took is reported by Path and Stats.
//
// The package owns its listener (closed once every peer connected), its connections and
// their goroutines; Close stops and waits for all of them.
package tcp

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"golang.org/x/time/rate"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/inproc"
	"github.com/moex-ai/moex/transport/internal/core"
)

// Defaults, chosen by measurement on loopback (see README, "Transport figures").
const (
	DefaultStreams    = 1
	DefaultEagerLimit = 32 << 10
	DefaultChunk      = 1 << 20
	DefaultBusyPollUS = 50
	// DefaultDeadAfter is Config.DeadAfter where unset.
	DefaultDeadAfter = 10 * time.Second
	MaxStreams       = 8
	minStripe        = 256 << 10
)

// Config describes one rank's endpoint.
type Config struct {
	Rank, Size int
	// Exchange all-gathers one blob per rank (the rendezvous store's AllGather). It is
	// used once, to publish listening addresses.
	Exchange func(ctx context.Context, mine []byte) ([][]byte, error)
	Bind     string // host to listen on (default 127.0.0.1)
	Token    []byte // job secret

	Streams    int              // connections per peer (default DefaultStreams, max MaxStreams)
	EagerLimit int              // largest eager message (default DefaultEagerLimit, at most 16 MiB)
	Chunk      int              // data frame size (default DefaultChunk)
	Poll       busypoll.Config  // receiver policy
	Poller     *busypoll.Poller // overrides Poll when set (shared with other transports)
	BusyPollUS int              // SO_BUSY_POLL in µs; 0: default; negative: leave unset
	Checksum   bool             // xxhash64 over every payload, verified on receipt
	// CancelGrace bounds how long a cancelled transfer that is already on the wire may take
	// to finish before the peer is declared dead (default 5s).
	CancelGrace time.Duration
	// DeadAfter is how long a peer whose host stops answering (a link cut, a host down:
	// no ACK for data sent, no answer to keepalive probes while idle) takes to fail with
	// a PeerError (TCP_USER_TIMEOUT and TCP keepalive); default DefaultDeadAfter, negative:
	// the kernel's own timeouts (minutes). A process that is alive but stopped still has
	// its kernel answer: only its host's silence counts.
	DeadAfter time.Duration
	Pool      *obuf.Pool
	Logger    *slog.Logger
}

// ConfigFromEnv fills the tunables from MOEX_TCP_STREAMS, MOEX_BUSY_POLL_US,
// MOEX_CHECKSUM, MOEX_POLL and MOEX_SPIN_US.
func (c *Config) ConfigFromEnv(getenv func(string) string) error {
	if v := getenv("MOEX_TCP_STREAMS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > MaxStreams {
			return &transport.EnvError{Var: "MOEX_TCP_STREAMS", Value: v, Reason: fmt.Sprintf("want 1..%d", MaxStreams)}
		}
		c.Streams = n
	}
	if v := getenv("MOEX_BUSY_POLL_US"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return &transport.EnvError{Var: "MOEX_BUSY_POLL_US", Value: v, Reason: "want a non-negative integer"}
		}
		c.BusyPollUS = n
		if n == 0 {
			c.BusyPollUS = -1
		}
	}
	if v := getenv("MOEX_TCP_DEAD"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d != 0 && d < time.Second || d > time.Hour {
			return &transport.EnvError{Var: "MOEX_TCP_DEAD", Value: v, Reason: "want a Go duration from 1s to 1h, or 0 for the kernel's timeouts"}
		}
		c.DeadAfter = d
		if d == 0 {
			c.DeadAfter = -1
		}
	}
	c.Checksum = getenv("MOEX_CHECKSUM") == "1"
	p, err := busypoll.ConfigFromEnv(getenv)
	if err != nil {
		return err
	}
	c.Poll = p
	return nil
}

// EnvVars are the variables the TCP transport reads.
var EnvVars = []transport.EnvVar{
	{Name: "MOEX_TCP_STREAMS", Default: strconv.Itoa(DefaultStreams), Meaning: fmt.Sprintf("TCP connections per peer (1 to %d)", MaxStreams), Owner: "transport/tcp"},
	{Name: "MOEX_BUSY_POLL_US", Default: strconv.Itoa(DefaultBusyPollUS), Meaning: "SO_BUSY_POLL of TCP sockets in microseconds (0: off)", Owner: "transport/tcp"},
	{Name: "MOEX_TCP_DEAD", Default: DefaultDeadAfter.String(), Meaning: "how long a peer whose host stops answering (a link cut, a host down) takes to fail with a PeerError (TCP_USER_TIMEOUT, keepalive probes); 0: the kernel's timeouts (minutes)", Owner: "transport/tcp"},
	{Name: "MOEX_CHECKSUM", Default: "0", Meaning: "1: carry an xxhash64 of every TCP payload and verify it", Owner: "transport/tcp"},
	{Name: "MOEX_TCP_WAIT_SPIN", Default: "0", Meaning: "1: with MOEX_POLL=spin, tcp senders spin on their completions too (an experiment)", Owner: "transport/tcp", Internal: true},
}

// Stats counts traffic.
type Stats struct {
	FramesOut, Writevs, DirectWrites uint64 // Writevs < FramesOut means frames were coalesced
	BytesOut, BytesIn                uint64
	Reads                            uint64
	BusyPoll                         string // what SO_BUSY_POLL did, e.g. "50us" or "not permitted"
}

// Transport is one rank's TCP endpoint.
type Transport struct {
	rank, size int
	streams    int
	eager      int
	chunk      int
	checksum   bool
	grace      time.Duration
	poller     *busypoll.Poller // stream readers: spin on the socket, then park in the netpoller
	waitPoller *busypoll.Poller // request waiters: park at once (see New)
	pool       *obuf.Pool
	log        *slog.Logger

	// peers[p] is the state of peer p: nil for this rank and for a rank never connected
	// (a replacement's dead peers); a dead peer's is replaced when a new process takes
	// its rank over (Readmit).
	peers  []atomic.Pointer[peer]
	self   *inproc.Transport
	token  []byte
	bind   string
	busyUS int
	dead   time.Duration // Config.DeadAfter
	// peersMu orders Readmit against Close; readmitMu orders Readmits.
	peersMu, readmitMu sync.Mutex
	eng                core.Engine[sendX, recvX]

	closed   atomic.Bool
	wg       sync.WaitGroup
	busyPoll string

	framesOut, writevs, direct, bytesOut, bytesIn, reads atomic.Uint64

	// Connections refused at connect time, and the WARN about them, at most once a
	// second: a flood of them (a stranger's job, a port scanner) must not flood the log.
	refused    atomic.Uint64
	refusedLog rate.Sometimes
}

var _ transport.Transport = (*Transport)(nil)
var _ transport.PathReporter = (*Transport)(nil)

// refusedWarn counts a refused connection and logs it at WARN, at most once a second,
// with the count so far.
func (t *Transport) refusedWarn(msg string, args ...any) {
	n := t.refused.Add(1)
	t.refusedLog.Do(func() { t.log.Warn(msg, append(args, "refused_so_far", int64(n))...) })
}

type hello struct {
	rank, size, stream, streams uint32
}

const helloMagic = "MXTC"

func (h hello) encode() []byte {
	b := []byte(helloMagic)
	for _, v := range []uint32{h.rank, h.size, h.stream, h.streams} {
		b = binary.LittleEndian.AppendUint32(b, v)
	}
	return b
}

func decodeHello(b []byte) (hello, error) {
	if len(b) != 20 || string(b[:4]) != helloMagic {
		return hello{}, fmt.Errorf("%w: bad hello", transport.ErrProtocol)
	}
	le := binary.LittleEndian
	return hello{le.Uint32(b[4:]), le.Uint32(b[8:]), le.Uint32(b[12:]), le.Uint32(b[16:])}, nil
}

// New listens, publishes its address through cfg.Exchange, connects to every peer (ranks
// dial lower ranks and accept higher ones) and starts the streams. Connections that fail
// the secret check are refused and logged; setup continues until ctx ends.
func New(ctx context.Context, cfg Config) (*Transport, error) {
	if cfg.Size > 1 && cfg.Exchange == nil {
		return nil, &transport.ArgError{Arg: "Exchange", Reason: "nil with more than one rank"}
	}
	t, err := newTransport(cfg)
	if err != nil {
		return nil, err
	}
	if t.size == 1 {
		t.busyPoll = "n/a (single rank)"
		return t, nil
	}
	conns, err := t.connectAll(ctx, cfg)
	if err != nil {
		return nil, err
	}
	t.install(conns)
	return t, nil
}

// newTransport is the transport of cfg, with no peer connected yet.
func newTransport(cfg Config) (*Transport, error) {
	if cfg.Size < 1 || cfg.Rank < 0 || cfg.Rank >= cfg.Size {
		return nil, &transport.ArgError{Arg: "rank", Reason: fmt.Sprintf("rank %d of %d", cfg.Rank, cfg.Size)}
	}
	t := &Transport{
		refusedLog: rate.Sometimes{Interval: time.Second},
		rank:       cfg.Rank, size: cfg.Size, streams: cfg.Streams, eager: cfg.EagerLimit,
		chunk: cfg.Chunk, checksum: cfg.Checksum, grace: cfg.CancelGrace,
		poller: cfg.Poller, pool: cfg.Pool, log: cfg.Logger,
	}
	if t.streams <= 0 {
		t.streams = DefaultStreams
	}
	if t.streams > MaxStreams {
		return nil, &transport.ArgError{Arg: "Streams", Reason: fmt.Sprintf("%d > %d", t.streams, MaxStreams)}
	}
	if t.eager <= 0 {
		t.eager = DefaultEagerLimit
	}
	if t.eager > maxEager {
		return nil, &transport.ArgError{Arg: "EagerLimit", Reason: fmt.Sprintf("%d > %d", t.eager, maxEager)}
	}
	if t.chunk <= 0 {
		t.chunk = DefaultChunk
	}
	if t.grace <= 0 {
		t.grace = 5 * time.Second
	}
	if t.poller == nil {
		pc := cfg.Poll
		if pc.Oversubscribed && pc.YieldSpin == 0 {
			// The readers' poller. With more ranks than cores, a reader that yields and
			// polls its socket takes the CPU from the ranks it waits for; parking in the
			// netpoller at once is faster (BenchmarkAllToAll8Procs, 8 processes on 2
			// cores: 2.8 against 1.9 ms per all-to-all; moex bench coll alltoall over tcp,
			// P=4: 1.3 against 0.9 ms at 1 MiB). MOEX_YIELD_US still overrides.
			pc.YieldSpin = -1
		}
		t.poller = busypoll.New(pc)
	}
	// One spinner per message is enough, and it must be the reader: it polls the socket
	// itself, while a waiter spinning on the request would keep a P busy and starve the Go
	// netpoller (polled only when a P has nothing else to run) and the readers.
	t.waitPoller = busypoll.New(busypoll.Config{Mode: busypoll.Block})
	if t.poller.Mode() == busypoll.Spin && os.Getenv("MOEX_TCP_WAIT_SPIN") == "1" {
		t.waitPoller = t.poller
	}
	if t.pool == nil {
		t.pool = obuf.Default
	}
	if t.log == nil {
		t.log = slog.New(slog.DiscardHandler)
	}
	t.self = inproc.New(1, inproc.Config{Poller: t.waitPoller, Pool: t.pool})[0]
	t.eng = core.Engine[sendX, recvX]{Rank: t.rank, Name: "tcp", EagerMax: t.eager, Pool: t.pool, Closed: t.closed.Load,
		Await: t.await, GracePoller: t.waitPoller, Grace: t.grace, Log: t.log}
	t.peers = make([]atomic.Pointer[peer], t.size)
	t.dead = cfg.DeadAfter
	if t.dead == 0 {
		t.dead = DefaultDeadAfter
	}
	t.busyUS = cfg.BusyPollUS
	if t.busyUS == 0 {
		t.busyUS = DefaultBusyPollUS
	}
	t.busyPoll = "unset"
	t.token = cfg.Token
	t.bind = cfg.Bind
	return t, nil
}

// install makes the peers of the connections conns[p] (every stream to peer p; nil for
// a peer not connected) and starts them.
func (t *Transport) install(conns [][]*net.TCPConn) {
	var prs []*peer
	for p := range t.peers {
		if p == t.rank || conns[p] == nil {
			continue
		}
		prs = append(prs, t.newPeer(p, conns[p]))
	}
	for _, pr := range prs {
		t.peers[pr.rank].Store(pr)
		pr.start()
	}
	t.log.Info("moex tcp: connected", "rank", t.rank, "size", t.size,
		"streams", t.streams, "busy_poll", t.busyPoll, "poll", t.poller.Mode().String())
}

// newPeer is the state of peer p over its streams' connections.
func (t *Transport) newPeer(p int, conns []*net.TCPConn) *peer {
	pr := &peer{t: t, rank: p}
	pr.c = core.NewPeer[sendX, recvX](p, pr)
	for s, c := range conns {
		st := newStream(pr, s, c)
		t.busyPoll = st.setSockopts(t.busyUS, t.dead)
		pr.streams = append(pr.streams, st)
	}
	return pr
}

// connectAll listens, publishes the address through cfg.Exchange, and connects every
// stream to every peer: it dials lower ranks and accepts higher ones.
func (t *Transport) connectAll(ctx context.Context, cfg Config) ([][]*net.TCPConn, error) {
	bind := cfg.Bind
	if bind == "" {
		bind = "127.0.0.1"
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(bind, "0"))
	if err != nil {
		return nil, fmt.Errorf("tcp: listen on %s: %w", bind, err)
	}
	defer ln.Close() // every peer is connected (or setup failed) when New returns
	conns := make([][]*net.TCPConn, t.size)
	for i := range conns {
		conns[i] = make([]*net.TCPConn, t.streams)
	}
	var mu sync.Mutex
	closeAll := func() {
		for _, cs := range conns {
			for _, c := range cs {
				if c != nil {
					_ = c.Close()
				}
			}
		}
	}
	sctx, cancelSetup := context.WithCancel(ctx)
	defer cancelSetup()
	g, gctx := errgroup.WithContext(sctx)
	// Accept higher ranks, from now: a connection that is not a peer's (garbage, or one
	// that says nothing) is dropped at once, not left until the addresses are known.
	if want := (t.size - 1 - t.rank) * t.streams; want > 0 {
		g.Go(func() error { return t.acceptAll(gctx, ln, higherRanks{t}, conns, &mu, []byte(cfg.Token)) })
	}
	addrs, err := cfg.Exchange(ctx, []byte(ln.Addr().String()))
	if err == nil && len(addrs) != t.size {
		err = fmt.Errorf("tcp: address exchange returned %d entries for %d ranks", len(addrs), t.size)
	} else if err != nil {
		err = fmt.Errorf("tcp: exchanging addresses: %w", err)
	}
	if err != nil {
		cancelSetup()
		_ = g.Wait()
		closeAll()
		return nil, err
	}
	// Dial lower ranks.
	for p := 0; p < t.rank; p++ {
		for s := 0; s < t.streams; s++ {
			g.Go(func() error {
				h := hello{uint32(t.rank), uint32(t.size), uint32(s), uint32(t.streams)}
				c, err := t.dial(gctx, string(addrs[p]), p, h.encode(), []byte(cfg.Token))
				if err != nil {
					return &transport.PeerError{Rank: p, Op: "connect", Err: err}
				}
				mu.Lock()
				conns[p][s] = c
				mu.Unlock()
				return nil
			})
		}
	}
	if err := g.Wait(); err != nil {
		closeAll()
		return nil, err
	}
	t.log.Info("moex tcp: listened", "rank", t.rank, "listen", ln.Addr().String())
	return conns, nil
}

// dial connects to peerRank at addr, greeting it with greeting, and checks its answer.
func (t *Transport) dial(ctx context.Context, addr string, peerRank int, greeting, token []byte) (*net.TCPConn, error) {
	backoff := 5 * time.Millisecond
	for {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			var ph []byte
			ph, err = transport.Handshake(ctx, c, token, transport.RoleDialer, greeting)
			if err == nil {
				var got hello
				if got, err = decodeHello(ph); err == nil {
					if got.rank != uint32(peerRank) || got.size != uint32(t.size) || got.streams != uint32(t.streams) {
						err = fmt.Errorf("%w: %s is rank %d of %d with %d streams, expected rank %d of %d with %d",
							transport.ErrMismatch, addr, got.rank, got.size, got.streams, peerRank, t.size, t.streams)
					}
				}
			}
			if err == nil {
				return c.(*net.TCPConn), nil
			}
			_ = c.Close()
			if errors.Is(err, transport.ErrAuth) || errors.Is(err, transport.ErrMismatch) {
				return nil, err
			}
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("dial %s: %w (last error: %v)", addr, transport.CtxError(ctx.Err()), err)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 200*time.Millisecond)
	}
}

// An acceptor decides which connections a listener takes: from a greeting, the peer
// rank and stream it names, or why it is refused; and how many more it waits for.
type acceptor interface {
	admit(greeting []byte) (rank, stream int, why string)
	missing(got int) int
}

// higherRanks accepts the greetings of the ranks above this one (start-up).
type higherRanks struct{ t *Transport }

func (a higherRanks) admit(greeting []byte) (int, int, string) {
	t := a.t
	h, err := decodeHello(greeting)
	switch {
	case err != nil:
		return 0, 0, err.Error()
	case int(h.rank) <= t.rank || int(h.rank) >= t.size || int(h.stream) >= t.streams ||
		h.size != uint32(t.size) || h.streams != uint32(t.streams):
		return 0, 0, fmt.Sprintf("unexpected hello: rank %d of %d, stream %d of %d", h.rank, h.size, h.stream, h.streams)
	}
	return int(h.rank), int(h.stream), ""
}

func (a higherRanks) missing(got int) int { return (a.t.size-1-a.t.rank)*a.t.streams - got }

func (t *Transport) acceptAll(ctx context.Context, ln net.Listener, acc acceptor, conns [][]*net.TCPConn, mu *sync.Mutex, token []byte) error {
	var hs sync.WaitGroup
	defer hs.Wait()
	ctx, cancel := context.WithCancel(ctx) // ends handshakes still running when we return
	defer cancel()
	got := 0
	type result struct {
		c   *net.TCPConn
		ph  []byte
		err error
	}
	results := make(chan result)
	acceptErr := make(chan error, 1)
	go func() {
		backoff := 5 * time.Millisecond
		for {
			c, err := ln.Accept()
			if err != nil {
				if errors.Is(err, net.ErrClosed) || ctx.Err() != nil {
					acceptErr <- err
					return
				}
				// A passing shortage (EMFILE, ENFILE, ECONNABORTED): the peers that
				// come later must still get in. Back off, and go on.
				t.log.Warn("moex tcp: accept failed; retrying", "rank", t.rank, "err", err, "in", backoff)
				select {
				case <-time.After(backoff):
				case <-ctx.Done():
				}
				backoff = min(2*backoff, time.Second)
				continue
			}
			backoff = 5 * time.Millisecond
			hs.Add(1)
			go func() {
				defer hs.Done()
				hctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				defer cancel()
				me := hello{uint32(t.rank), uint32(t.size), 0, uint32(t.streams)}
				ph, err := transport.Handshake(hctx, c, token, transport.RoleAcceptor, me.encode())
				select {
				case results <- result{c.(*net.TCPConn), ph, err}:
				case <-ctx.Done():
					_ = c.Close()
				}
			}()
		}
	}()
	for acc.missing(got) > 0 {
		select {
		case r := <-results:
			if r.err != nil {
				t.refusedWarn("moex tcp: refused connection", "rank", t.rank, "remote", r.c.RemoteAddr().String(), "err", r.err)
				_ = r.c.Close()
				continue
			}
			rank, stream, why := acc.admit(r.ph)
			if why != "" {
				t.refusedWarn("moex tcp: refused connection", "rank", t.rank, "remote", r.c.RemoteAddr().String(), "why", why)
				_ = r.c.Close()
				continue
			}
			mu.Lock()
			if conns[rank] == nil {
				conns[rank] = make([]*net.TCPConn, t.streams)
			}
			dup := conns[rank][stream] != nil
			if !dup {
				conns[rank][stream] = r.c
			}
			mu.Unlock()
			if dup {
				t.refusedWarn("moex tcp: refused duplicate connection", "rank", t.rank, "peer_rank", rank, "stream", stream)
				_ = r.c.Close()
				continue
			}
			got++
		case <-ctx.Done():
			_ = ln.Close()
			<-acceptErr
			return fmt.Errorf("tcp: waiting for %d more connections: %w", acc.missing(got), transport.CtxError(ctx.Err()))
		}
	}
	_ = ln.Close()
	<-acceptErr
	return nil
}

// Rank implements transport.Transport.
func (t *Transport) Rank() int { return t.rank }

// Size implements transport.Transport.
func (t *Transport) Size() int { return t.size }

// Name implements transport.Transport.
func (t *Transport) Name() string { return "tcp" }

// Poller returns the receive poller (for its counters).
func (t *Transport) Poller() *busypoll.Poller { return t.poller }

// Path implements transport.PathReporter.
func (t *Transport) Path(peer int) string {
	if peer == t.rank {
		return "tcp: self, in-process copy"
	}
	if peer < 0 || peer >= t.size || t.peers[peer].Load() == nil {
		return "tcp: no such peer"
	}
	c := t.peers[peer].Load().streams[0].conn
	return fmt.Sprintf("tcp: %s -> %s, %d stream(s), SO_BUSY_POLL %s, receive poll %s",
		c.LocalAddr(), c.RemoteAddr(), t.streams, t.busyPoll, t.poller.Mode())
}

// Stats returns the transport's counters.
func (t *Transport) Stats() Stats {
	return Stats{
		FramesOut: t.framesOut.Load(), Writevs: t.writevs.Load(), DirectWrites: t.direct.Load(),
		BytesOut: t.bytesOut.Load(), BytesIn: t.bytesIn.Load(), Reads: t.reads.Load(), BusyPoll: t.busyPoll,
	}
}

// Counters implements transport.Counting.
func (t *Transport) Counters() transport.Counters {
	return transport.Counters{MessagesOut: t.framesOut.Load(), BytesOut: t.bytesOut.Load(), BytesIn: t.bytesIn.Load(),
		Syscalls: t.writevs.Load() + t.direct.Load() + t.reads.Load()}
}

var (
	_ transport.Counting = (*Transport)(nil)
	_ transport.Killer   = (*Transport)(nil)
)

// Close says goodbye to every peer, stops every goroutine and closes every connection.
// Pending requests complete with ErrClosed.
func (t *Transport) Close() error {
	t.peersMu.Lock()
	if t.closed.Swap(true) {
		t.peersMu.Unlock()
		return nil
	}
	t.peersMu.Unlock()
	for i := range t.peers {
		if p := t.peers[i].Load(); p != nil {
			p.leave(true)
		}
	}
	t.wg.Wait()
	return t.self.Close()
}

// Kill closes every connection without a goodbye, as a crash would (for tests).
func (t *Transport) Kill() {
	t.peersMu.Lock()
	if t.closed.Swap(true) {
		t.peersMu.Unlock()
		return
	}
	t.peersMu.Unlock()
	for i := range t.peers {
		if p := t.peers[i].Load(); p != nil {
			p.leave(false)
		}
	}
	t.wg.Wait()
	_ = t.self.Close()
}

// InjectRaw writes b on the first stream to peer, bypassing framing (for tests of
// garbage on the wire).
func (t *Transport) InjectRaw(peer int, b []byte) error {
	if peer == t.rank || t.peers[peer].Load() == nil {
		return &transport.ArgError{Arg: "peer", Reason: "no connection"}
	}
	st := t.peers[peer].Load().streams[0]
	st.wlock.Lock()
	defer st.wlock.Unlock()
	_, err := st.conn.Write(b)
	return err
}
