package transport

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"
)

// The rendezvous store is a small key-value service that rank 0 runs while a job starts:
// ranks publish their transport addresses and host identities and read everyone else's.
// Every connection proves the job secret first (Handshake); a client with the wrong secret
// is refused, logged, and the store carries on serving the others.

const (
	opSet  = 'S'
	opGet  = 'G' // wait for keys, return their values
	stOK   = 0
	stErr  = 1
	maxKey = 1 << 10
	maxVal = 16 << 20
)

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
}

// ServeStore listens on addr and serves until Close.
func ServeStore(addr string, token []byte, log *slog.Logger) (*StoreServer, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("transport: store: %w", err)
	}
	s := &StoreServer{ln: ln, token: token, log: log, data: map[string][]byte{}, conns: map[net.Conn]struct{}{}}
	s.cond = sync.NewCond(&s.mu)
	s.wg.Add(1)
	go s.acceptLoop()
	return s, nil
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
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
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

func (s *StoreServer) serve(c net.Conn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		_ = c.Close()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	_, err := Handshake(ctx, c, s.token, RoleAcceptor, []byte("store"))
	cancel()
	if err != nil {
		s.mu.Lock()
		s.refused++
		s.mu.Unlock()
		s.log.Warn("moex store: refused connection", "remote", c.RemoteAddr().String(), "err", err)
		return
	}
	r := bufio.NewReader(c)
	for {
		op, err := r.ReadByte()
		if err != nil {
			return
		}
		switch op {
		case opSet:
			k, err1 := readBlob(r, maxKey)
			v, err2 := readBlob(r, maxVal)
			if err := errors.Join(err1, err2); err != nil {
				s.log.Warn("moex store: bad request", "remote", c.RemoteAddr().String(), "err", err)
				return
			}
			s.mu.Lock()
			s.data[string(k)] = v
			s.cond.Broadcast()
			s.mu.Unlock()
			if err := writeReply(c, stOK, nil); err != nil {
				return
			}
		case opGet:
			var nb [4]byte
			if _, err := io.ReadFull(r, nb[:]); err != nil {
				return
			}
			n := int(binary.LittleEndian.Uint32(nb[:]))
			if n > 1<<16 {
				return
			}
			keys := make([]string, n)
			for i := range keys {
				k, err := readBlob(r, maxKey)
				if err != nil {
					return
				}
				keys[i] = string(k)
			}
			vals, ok := s.wait(keys)
			if !ok {
				_ = writeReply(c, stErr, [][]byte{[]byte("store closed")})
				return
			}
			if err := writeReply(c, stOK, vals); err != nil {
				return
			}
		default:
			s.log.Warn("moex store: unknown request", "remote", c.RemoteAddr().String(), "op", op)
			return
		}
	}
}

// wait blocks until every key is present or the store closes.
func (s *StoreServer) wait(keys []string) ([][]byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		if s.closed {
			return nil, false
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
			return vals, true
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
		return nil, fmt.Errorf("%w: store blob of %d bytes (limit %d)", ErrProtocol, n, max)
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
	mu     sync.Mutex
	c      net.Conn
	r      *bufio.Reader
	broken error
}

// DialStore connects to the store at addr, retrying until ctx ends (rank 0 may still be
// starting), and proves the job secret. A wrong secret is not retried.
func DialStore(ctx context.Context, addr string, token []byte) (*Store, error) {
	backoff := 10 * time.Millisecond
	for {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			if _, err = Handshake(ctx, c, token, RoleDialer, []byte("store")); err == nil {
				return &Store{c: c, r: bufio.NewReader(c)}, nil
			}
			_ = c.Close()
			if errors.Is(err, ErrAuth) {
				return nil, fmt.Errorf("transport: store %s: %w", addr, err)
			}
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("transport: connecting to the rendezvous store %s: %w (last error: %v)", addr, CtxError(ctx.Err()), err)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 500*time.Millisecond)
	}
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
		if ctx.Err() != nil {
			err = CtxError(ctx.Err())
		} else if _, has := ctx.Deadline(); has && errors.As(err, &ne) && ne.Timeout() {
			err = CtxError(context.DeadlineExceeded) // the socket deadline fired first
		}
		s.broken = fmt.Errorf("transport: store: %w", err)
		return nil, s.broken
	}
	if _, err := s.c.Write(req); err != nil {
		return fail(err)
	}
	st, err := s.r.ReadByte()
	if err != nil {
		return fail(err)
	}
	var nb [4]byte
	if _, err := io.ReadFull(s.r, nb[:]); err != nil {
		return fail(err)
	}
	n := int(binary.LittleEndian.Uint32(nb[:]))
	if n > 1<<16 {
		return fail(fmt.Errorf("%w: reply with %d values", ErrProtocol, n))
	}
	vals := make([][]byte, n)
	for i := range vals {
		if vals[i], err = readBlob(s.r, maxVal); err != nil {
			return fail(err)
		}
	}
	if st != stOK {
		msg := "error"
		if len(vals) > 0 {
			msg = string(vals[0])
		}
		return fail(errors.New(msg))
	}
	return vals, nil
}

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

// Close closes the connection.
func (s *Store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.broken == nil {
		s.broken = ErrClosed
	}
	return s.c.Close()
}
