package bootstrap

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"golang.org/x/time/rate"
	"io"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/moex-ai/moex/transport"
)

// The rendezvous store is a small key-value service that rank 0 runs while a job starts:
// ranks publish their transport addresses and host identities and read everyone else's.
// Every connection proves the job secret first (Handshake); a client with the wrong secret
// is refused, logged, and the store carries on serving the others.

const (
	opSet    = 'S'
	opGet    = 'G' // wait for keys, return their values
	opClaim  = 'C' // this connection is rank R of a job of N ranks (instance nonce)
	opStatus = 'Q' // every rank's stage, now, without waiting
	opScan   = 'P' // every key with a prefix and its value, now, without waiting
	opDel    = 'D' // remove a key
	stOK     = 0
	stErr    = 1
	stGone   = 2 // a rank left (or was refused) before the job was ready: rank, stage
	stDup    = 3 // two processes claim one rank: rank
	maxKey   = 1 << 10
	maxVal   = 16 << 20
	// MaxStoreRanks bounds the ranks a store serves.
	MaxStoreRanks = 1 << 16
)

// Stage names a rank's progress through start-up, as the store records it.
const (
	StageConnected = "connected" // claimed its rank at the store
	StageReady     = "ready"     // finished start-up; its connection may close
)

// claim is a rank's registration at the store.
type claim struct {
	conn  net.Conn
	nonce string
	stage string
	gone  bool // left (or refused as a duplicate) before it was ready
}

// StoreServer serves the rendezvous store.
type StoreServer struct {
	ln    net.Listener
	token []byte
	log   *slog.Logger

	mu     sync.Mutex
	cond   *sync.Cond
	data   map[string][]byte
	closed bool
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
	// Refused counts connections that failed the handshake.
	refused int
	// Start-up: every rank's claim, the job's size, and why the job failed (a rank that
	// left before it was ready, or a rank claimed twice), which every waiter is told.
	size   int
	claims map[int]*claim
	failed []byte // a reply to every later Get: status, rank, stage
	// The WARN about refused connections, at most once a second.
	refusedLog rate.Sometimes
}

// ServeStore listens on addr and serves until Close.
func ServeStore(addr string, token []byte, log *slog.Logger) (*StoreServer, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("transport: serving the rendezvous store: %w", err)
	}
	return serveStoreOn(ln, token, log), nil
}

// serveStoreOn serves the store on ln.
func serveStoreOn(ln net.Listener, token []byte, log *slog.Logger) *StoreServer {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &StoreServer{ln: ln, token: token, log: log, data: map[string][]byte{}, conns: map[net.Conn]struct{}{}, claims: map[int]*claim{}, refusedLog: rate.Sometimes{Interval: time.Second}}
	s.cond = sync.NewCond(&s.mu)
	s.wg.Add(1)
	go s.acceptLoop()
	return s
}

// closeWhenLeft closes the store once every rank that claimed its rank has closed its
// connection, or after wait: after a failed start-up the others ask it, on their way
// out, how far every rank got. (A rank that comes after it closed waits for its own
// deadline: nobody is left to tell it.)
func (s *StoreServer) closeWhenLeft(wait time.Duration) {
	deadline := time.Now().Add(wait)
	for time.Now().Before(deadline) {
		s.mu.Lock()
		open := 0
		for _, cl := range s.claims {
			if _, ok := s.conns[cl.conn]; ok {
				open++
			}
		}
		s.mu.Unlock()
		if open == 0 {
			break
		}
		time.Sleep(2 * time.Millisecond)
	}
	s.Close()
}

// Addr returns the address the store listens on.
func (s *StoreServer) Addr() string { return s.ln.Addr().String() }

// Refused returns how many connections failed the secret check.
func (s *StoreServer) Refused() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.refused
}

// Close stops the store and waits for its goroutines.
func (s *StoreServer) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	for c := range s.conns {
		_ = c.Close()
	}
	s.cond.Broadcast()
	s.mu.Unlock()
	err := s.ln.Close()
	s.wg.Wait()
	return err
}

func (s *StoreServer) acceptLoop() {
	defer s.wg.Done()
	backoff := 5 * time.Millisecond
	for {
		c, err := s.ln.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if closed || errors.Is(err, net.ErrClosed) {
				return
			}
			// A passing shortage (EMFILE, ENFILE, ECONNABORTED): ranks that come
			// later must still get in. Back off, and go on.
			s.log.Warn("moex store: accept failed; retrying", "err", err, "in", backoff)
			time.Sleep(backoff)
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			_ = c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serve(c)
	}
}

// refusedWarn logs a refused connection at WARN, at most once a second (a flood of
// them must not flood the log).
func (s *StoreServer) refusedWarn(remote string, err error) {
	s.mu.Lock()
	s.refused++
	n := s.refused
	s.mu.Unlock()
	s.refusedLog.Do(func() {
		s.log.Warn("moex store: refused connection", "remote", remote, "err", err, "refused_so_far", n)
	})
}

func (s *StoreServer) serve(c net.Conn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		_ = c.Close()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	_, err := transport.Handshake(ctx, c, s.token, transport.RoleAcceptor, []byte("store"))
	cancel()
	if err != nil {
		s.refusedWarn(c.RemoteAddr().String(), err)
		return
	}
	rank := -1 // claimed by this connection
	defer func() {
		if rank >= 0 {
			s.left(rank, c)
		}
	}()
	r := bufio.NewReader(c)
	for {
		req, err := readRequest(r)
		if err != nil {
			if !errors.Is(err, io.EOF) {
				s.log.Warn("moex store: bad request", "remote", c.RemoteAddr().String(), "err", err)
			}
			return
		}
		switch req.op {
		case opSet:
			s.mu.Lock()
			s.data[req.key] = req.val
			s.cond.Broadcast()
			s.mu.Unlock()
			if err := writeReply(c, stOK, nil); err != nil {
				return
			}
		case opGet:
			vals, fail, ok := s.wait(req.keys)
			switch {
			case fail != nil:
				_, _ = c.Write(fail)
				return
			case !ok:
				_ = writeReply(c, stErr, [][]byte{[]byte("store closed")})
				return
			}
			if err := writeReply(c, stOK, vals); err != nil {
				return
			}
		case opClaim:
			if reply := s.claim(c, req.rank, req.size, req.nonce); reply != nil {
				_, _ = c.Write(reply)
				return
			}
			rank = req.rank
			if err := writeReply(c, stOK, nil); err != nil {
				return
			}
		case opStatus:
			if err := writeReply(c, stOK, s.stages()); err != nil {
				return
			}
		case opScan:
			if err := writeReply(c, stOK, s.scan(req.key)); err != nil {
				return
			}
		case opDel:
			s.mu.Lock()
			delete(s.data, req.key)
			s.mu.Unlock()
			if err := writeReply(c, stOK, nil); err != nil {
				return
			}
		}
	}
}

// request is one request to the store, as read from a client.
type request struct {
	op         byte
	key        string   // opSet
	val        []byte   // opSet
	keys       []string // opGet
	rank, size int      // opClaim
	nonce      string   // opClaim
}

// Bounds of what a request may carry.
const (
	maxGetKeys = 1 << 16
	maxNonce   = 64
)

// readRequest reads one request, checking every length against its bound before it
// allocates: io.EOF at a clean end, ErrProtocol for what no client sends.
func readRequest(r *bufio.Reader) (request, error) {
	op, err := r.ReadByte()
	if err != nil {
		return request{}, err
	}
	req := request{op: op}
	short := func(err error) error {
		if errors.Is(err, io.EOF) {
			return io.ErrUnexpectedEOF
		}
		return err
	}
	switch op {
	case opSet:
		k, err := readBlob(r, maxKey)
		if err != nil {
			return req, short(err)
		}
		if req.val, err = readBlob(r, maxVal); err != nil {
			return req, short(err)
		}
		req.key = string(k)
	case opGet:
		var nb [4]byte
		if _, err := io.ReadFull(r, nb[:]); err != nil {
			return req, short(err)
		}
		n := binary.LittleEndian.Uint32(nb[:])
		if n > maxGetKeys {
			return req, fmt.Errorf("%w: a get of %d keys (limit %d)", transport.ErrProtocol, n, maxGetKeys)
		}
		req.keys = make([]string, 0, min(n, 64))
		for range n {
			k, err := readBlob(r, maxKey)
			if err != nil {
				return req, short(err)
			}
			req.keys = append(req.keys, string(k))
		}
	case opClaim:
		var hdr [8]byte
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return req, short(err)
		}
		nonce, err := readBlob(r, maxNonce)
		if err != nil {
			return req, short(err)
		}
		req.rank, req.size, req.nonce = int(int32(binary.LittleEndian.Uint32(hdr[:4]))), int(int32(binary.LittleEndian.Uint32(hdr[4:]))), string(nonce)
	case opStatus:
	case opScan, opDel:
		k, err := readBlob(r, maxKey)
		if err != nil {
			return req, short(err)
		}
		req.key = string(k)
	default:
		return req, fmt.Errorf("%w: unknown store request %q", transport.ErrProtocol, op)
	}
	return req, nil
}

// claim registers c as rank want of a job of size ranks, or returns the reply that
// refuses it.
func (s *StoreServer) claim(c net.Conn, want, size int, nonce string) []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case size < 1 || size > MaxStoreRanks || want < 0 || want >= size:
		return replyMsg(stErr, fmt.Sprintf("rank %d of a job of %d ranks (at most %d)", want, size, MaxStoreRanks))
	case s.size != 0 && size != s.size:
		return replyMsg(stErr, fmt.Sprintf("rank %d says the job has %d ranks; the ranks before it said %d (MOEX_WORLD_SIZE differs)", want, size, s.size))
	}
	s.size = size
	if old, ok := s.claims[want]; ok && old.nonce != nonce {
		// Both claimants fail, and every rank waiting with them: the job cannot start.
		s.failed = failReply(stDup, want, "")
		s.log.Warn("moex store: two processes claim one rank", "rank", want, "first", old.conn.RemoteAddr().String(), "second", c.RemoteAddr().String())
		s.cond.Broadcast()
		return s.failed
	}
	if s.failed != nil {
		return s.failed
	}
	s.claims[want] = &claim{conn: c, nonce: nonce, stage: StageConnected}
	s.data[stageKey(want)] = []byte(StageConnected)
	return nil
}

// left records that rank's connection closed: the end of a ready rank, or a rank lost
// during start-up, which fails every rank still waiting.
func (s *StoreServer) left(rank int, c net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	cl, ok := s.claims[rank]
	if !ok || cl.conn != c || s.closed {
		return
	}
	if string(s.data[stageKey(rank)]) != StageReady && s.failed == nil {
		cl.gone = true
		s.failed = failReply(stGone, rank, string(s.data[stageKey(rank)]))
		s.log.Warn("moex store: a rank left during start-up", "rank", rank, "stage", string(s.data[stageKey(rank)]))
		s.cond.Broadcast()
	}
}

// stages returns every rank's stage ("" for a rank not heard from).
func (s *StoreServer) stages() [][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([][]byte, s.size)
	for r := range out {
		out[r] = s.data[stageKey(r)]
		if cl, ok := s.claims[r]; ok && cl.gone {
			out[r] = []byte("left at " + string(out[r]))
		}
	}
	return out
}

func stageKey(rank int) string { return "stage/" + strconv.Itoa(rank) }

// scan returns every key with prefix and its value, in key order (at most maxGetKeys/2
// of them).
func (s *StoreServer) scan(prefix string) [][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	var keys []string
	for k := range s.data {
		if strings.HasPrefix(k, prefix) {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	keys = keys[:min(len(keys), maxGetKeys/2)]
	out := make([][]byte, 0, 2*len(keys))
	for _, k := range keys {
		out = append(out, []byte(k), s.data[k])
	}
	return out
}

func replyMsg(st byte, msg string) []byte {
	var b bytes.Buffer
	_ = writeReply(&b, st, [][]byte{[]byte(msg)})
	return b.Bytes()
}

// failReply is the reply of a failed start-up: the rank to blame and its stage.
func failReply(st byte, rank int, stage string) []byte {
	var b bytes.Buffer
	_ = writeReply(&b, st, [][]byte{[]byte(strconv.Itoa(rank)), []byte(stage)})
	return b.Bytes()
}

// wait blocks until every key is present, the start-up failed (fail: the reply to
// send), or the store closes.
func (s *StoreServer) wait(keys []string) (vals [][]byte, fail []byte, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		if s.failed != nil {
			return nil, s.failed, false
		}
		if s.closed {
			return nil, nil, false
		}
		vals := make([][]byte, len(keys))
		all := true
		for i, k := range keys {
			v, ok := s.data[k]
			if !ok {
				all = false
				break
			}
			vals[i] = v
		}
		if all {
			return vals, nil, true
		}
		s.cond.Wait()
	}
}

func readBlob(r io.Reader, max int) ([]byte, error) {
	var nb [4]byte
	if _, err := io.ReadFull(r, nb[:]); err != nil {
		return nil, err
	}
	n := int(binary.LittleEndian.Uint32(nb[:]))
	if n > max {
		return nil, fmt.Errorf("%w: store blob of %d bytes (limit %d)", transport.ErrProtocol, n, max)
	}
	b := make([]byte, n)
	_, err := io.ReadFull(r, b)
	return b, err
}

func appendBlob(b, v []byte) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(v)))
	return append(b, v...)
}

func writeReply(w io.Writer, st byte, vals [][]byte) error {
	b := []byte{st}
	b = binary.LittleEndian.AppendUint32(b, uint32(len(vals)))
	for _, v := range vals {
		b = appendBlob(b, v)
	}
	_, err := w.Write(b)
	return err
}

// Store is a client of the rendezvous store. Its methods are safe for concurrent use
// (calls are serialised).
type Store struct {
	mu        sync.Mutex
	c         net.Conn
	r         *bufio.Reader
	broken    error
	closeOnce sync.Once
	closeErr  error
}

// DialStore connects to the store at addr, retrying until ctx ends (rank 0 may still be
// starting), and proves the job secret. A wrong secret is not retried.
func DialStore(ctx context.Context, addr string, token []byte) (*Store, error) {
	return dialStore(ctx, addr, token, "rank 0, which serves the rendezvous store at "+addr+", has not come")
}

func dialStore(ctx context.Context, addr string, token []byte, absent string) (*Store, error) {
	backoff := 10 * time.Millisecond
	for {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			if _, err = transport.Handshake(ctx, c, token, transport.RoleDialer, []byte("store")); err == nil {
				return &Store{c: c, r: bufio.NewReader(c)}, nil
			}
			_ = c.Close()
			if errors.Is(err, transport.ErrAuth) {
				return nil, transport.Because(err, "the rendezvous store at %s refused this rank (another job's, or a job secret that differs: MOEX_JOB_TOKEN): %v", addr, err)
			}
		}
		select {
		case <-ctx.Done():
			return nil, transport.Because(transport.CtxError(ctx.Err()),
				"%s: no answer %s (last error: %v)", absent, gaveUp(ctx), err)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}

// gaveUp says why a wait of the start-up ended, for its error: the deadline passed, or
// the start-up was cancelled (the launcher stopping the job, for instance).
func gaveUp(ctx context.Context) string {
	if errors.Is(ctx.Err(), context.Canceled) {
		return "before the start-up was cancelled"
	}
	return "before the start-up deadline"
}

func (s *Store) call(ctx context.Context, req []byte) ([][]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.broken != nil {
		return nil, s.broken
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = s.c.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = s.c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	fail := func(err error) ([][]byte, error) {
		var ne net.Error
		switch {
		case ctx.Err() != nil:
			s.broken = transport.Because(transport.CtxError(ctx.Err()), "no answer from the rendezvous store %s", gaveUp(ctx))
		case errors.As(err, &ne) && ne.Timeout():
			// the socket deadline fired first
			s.broken = transport.Because(transport.CtxError(context.DeadlineExceeded), "no answer from the rendezvous store before the start-up deadline")
		case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE):
			// The store lives in rank 0's process, which has closed it: it exited,
			// crashed, or failed its own start-up.
			s.broken = &StartupError{Rank: 0, Err: transport.Because(
				&transport.PeerError{Rank: 0, Op: "start-up", Err: fmt.Errorf("%w: %v", transport.ErrPeerClosed, err)},
				"rank 0, which serves the rendezvous store, is gone: it closed the store's connection (%v)", err)}
		default:
			s.broken = fmt.Errorf("rendezvous store: %w", err)
		}
		return nil, s.broken
	}
	if _, err := s.c.Write(req); err != nil {
		return fail(err)
	}
	st, vals, err := readReply(s.r)
	if err != nil {
		return fail(err)
	}
	switch st {
	case stOK:
		return vals, nil
	case stGone, stDup:
		rank, stage := -1, ""
		if len(vals) == 2 {
			rank, _ = strconv.Atoi(string(vals[0]))
			stage = string(vals[1])
		}
		if st == stDup {
			s.broken = &StartupError{Rank: rank, Err: transport.Because(ErrDuplicateRank, "two processes claim rank %d", rank)}
		} else {
			s.broken = &StartupError{Rank: rank, Err: &transport.PeerError{Rank: rank, Op: "start-up",
				Err: fmt.Errorf("%w during start-up (it had reached %q)", transport.ErrPeerClosed, stage)}}
		}
		return nil, s.broken
	}
	msg := "error"
	if len(vals) > 0 {
		msg = string(vals[0])
	}
	return fail(errors.New(msg))
}

// readReply reads one reply: its status and values, every length checked against its
// bound before it allocates.
func readReply(r *bufio.Reader) (byte, [][]byte, error) {
	st, err := r.ReadByte()
	if err != nil {
		return 0, nil, err
	}
	var nb [4]byte
	if _, err := io.ReadFull(r, nb[:]); err != nil {
		return 0, nil, err
	}
	n := binary.LittleEndian.Uint32(nb[:])
	if n > maxGetKeys {
		return 0, nil, fmt.Errorf("%w: reply with %d values", transport.ErrProtocol, n)
	}
	vals := make([][]byte, 0, min(n, 64))
	for range n {
		v, err := readBlob(r, maxVal)
		if err != nil {
			return 0, nil, err
		}
		vals = append(vals, v)
	}
	return st, vals, nil
}

// Claim registers this connection as rank of a job of size ranks; nonce tells this
// process from another that claims the same rank (both then fail with
// ErrDuplicateRank, and so does every rank waiting with them).
func (s *Store) Claim(ctx context.Context, rank, size int, nonce string) error {
	req := []byte{opClaim}
	req = binary.LittleEndian.AppendUint32(req, uint32(rank))
	req = binary.LittleEndian.AppendUint32(req, uint32(size))
	req = appendBlob(req, []byte(nonce))
	_, err := s.call(ctx, req)
	return err
}

// Status returns every rank's start-up stage ("" for a rank not heard from), now.
func (s *Store) Status(ctx context.Context) ([]string, error) {
	vals, err := s.call(ctx, []byte{opStatus})
	if err != nil {
		return nil, err
	}
	out := make([]string, len(vals))
	for i, v := range vals {
		out[i] = string(v)
	}
	return out, nil
}

// ErrDuplicateRank: two processes claim one rank of a starting job.
var ErrDuplicateRank = errors.New("transport: two processes claim one rank")

// StartupError says why a job did not start, as every rank sees it: a rank left during
// start-up (Err wraps a *PeerError naming it), two processes claimed one rank (Err wraps
// ErrDuplicateRank), or the start-up deadline passed (Err wraps ErrTimeout) with some
// ranks not heard from. Stages lists, per rank, the last stage the store saw it reach
// ("" for none: never connected), when the store could still say.
type StartupError struct {
	Expected int
	Stages   []string
	Rank     int // the rank to blame, or -1 (those not heard from)
	Err      error
}

// Missing lists the ranks that never reached the store.
func (e *StartupError) Missing() []int {
	var m []int
	for r, st := range e.Stages {
		if st == "" {
			m = append(m, r)
		}
	}
	return m
}

// Arrived counts the ranks that reached the store.
func (e *StartupError) Arrived() int { return len(e.Stages) - len(e.Missing()) }

func (e *StartupError) Error() string {
	var b strings.Builder
	b.WriteString("transport: start-up failed")
	if e.Stages != nil {
		fmt.Fprintf(&b, ": %d of %d ranks arrived", e.Arrived(), e.Expected)
		if m := e.Missing(); len(m) > 0 {
			fmt.Fprintf(&b, "; not heard from: ranks %v", m)
		}
		var at []string
		for r, st := range e.Stages {
			if st != "" {
				at = append(at, fmt.Sprintf("%d:%s", r, st))
			}
		}
		fmt.Fprintf(&b, "; stages reached: %s", strings.Join(at, " "))
	}
	fmt.Fprintf(&b, ": %s", transport.Unprefixed(e.Err))
	return b.String()
}

func (e *StartupError) Unwrap() error { return e.Err }

// Set stores val under key.
func (s *Store) Set(ctx context.Context, key string, val []byte) error {
	req := appendBlob([]byte{opSet}, []byte(key))
	req = appendBlob(req, val)
	_, err := s.call(ctx, req)
	return err
}

// Get waits until every key is set and returns their values.
func (s *Store) Get(ctx context.Context, keys ...string) ([][]byte, error) {
	req := []byte{opGet}
	req = binary.LittleEndian.AppendUint32(req, uint32(len(keys)))
	for _, k := range keys {
		req = appendBlob(req, []byte(k))
	}
	return s.call(ctx, req)
}

// Scan returns every key that starts with prefix and its value, now, in key order.
func (s *Store) Scan(ctx context.Context, prefix string) (keys []string, vals [][]byte, err error) {
	out, err := s.call(ctx, appendBlob([]byte{opScan}, []byte(prefix)))
	if err != nil {
		return nil, nil, err
	}
	if len(out)%2 != 0 {
		return nil, nil, fmt.Errorf("%w: a scan reply of %d values", transport.ErrProtocol, len(out))
	}
	for i := 0; i < len(out); i += 2 {
		keys, vals = append(keys, string(out[i])), append(vals, out[i+1])
	}
	return keys, vals, nil
}

// Delete removes key (a key that is not there is no error).
func (s *Store) Delete(ctx context.Context, key string) error {
	_, err := s.call(ctx, appendBlob([]byte{opDel}, []byte(key)))
	return err
}

// AllGather publishes val as rank's entry under prefix and returns every rank's entry.
func (s *Store) AllGather(ctx context.Context, prefix string, rank, size int, val []byte) ([][]byte, error) {
	if err := s.Set(ctx, prefix+"/"+strconv.Itoa(rank), val); err != nil {
		return nil, err
	}
	keys := make([]string, size)
	for i := range keys {
		keys[i] = prefix + "/" + strconv.Itoa(i)
	}
	return s.Get(ctx, keys...)
}

// Close closes the connection (once; again is a no-op). It may be called while a call
// waits: the call then fails.
func (s *Store) Close() error {
	s.closeOnce.Do(func() { s.closeErr = s.c.Close() })
	return s.closeErr
}
