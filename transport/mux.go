package transport

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
)

// Mux is a Transport that sends each peer's traffic over the transport chosen for it
// (shared memory for ranks on this host, the network for the others). Messages to one
// peer always take the same transport, so ordering per (peer, tag) holds (Readmit may
// route a rank taken over by a new process anew: that process starts afresh).
type Mux struct {
	rank, size int
	by         atomic.Pointer[[]Transport] // per peer; Readmit may route a peer anew
	all        []Transport                 // each once, for Close
	name       string
	readmitMu  sync.Mutex
}

var _ Transport = (*Mux)(nil)
var _ PathReporter = (*Mux)(nil)

// NewMux routes peer q to by[q]. Every transport in by must cover the peers routed to it
// and have the same rank and size.
func NewMux(name string, by []Transport) (*Mux, error) {
	if len(by) == 0 {
		return nil, &ArgError{Arg: "by", Reason: "no transports"}
	}
	by = slices.Clone(by)
	m := &Mux{rank: by[0].Rank(), size: len(by), name: name}
	m.by.Store(&by)
	seen := map[Transport]bool{}
	for q, t := range by {
		if t == nil {
			return nil, &ArgError{Arg: "by", Reason: fmt.Sprintf("no transport for rank %d", q)}
		}
		if t.Rank() != m.rank || t.Size() != m.size {
			return nil, &ArgError{Arg: "by", Reason: fmt.Sprintf("%s is rank %d of %d, want %d of %d", t.Name(), t.Rank(), t.Size(), m.rank, m.size)}
		}
		if !seen[t] {
			seen[t] = true
			m.all = append(m.all, t)
		}
	}
	return m, nil
}

// Rank implements Transport.
func (m *Mux) Rank() int { return m.rank }

// Size implements Transport.
func (m *Mux) Size() int { return m.size }

// Name implements Transport.
func (m *Mux) Name() string { return m.name }

// For returns the transport that serves peer.
func (m *Mux) For(peer int) Transport { return (*m.by.Load())[peer] }

// Isend implements Transport.
func (m *Mux) Isend(peer int, tag Tag, buf []byte) (Request, error) {
	if err := CheckPeer(peer, m.size); err != nil {
		return nil, err
	}
	return m.For(peer).Isend(peer, tag, buf)
}

// IsendBatch implements Batcher, as the transport that serves peer does.
func (m *Mux) IsendBatch(peer int, tags []Tag, bufs [][]byte, reqs []Request) error {
	if err := CheckPeer(peer, m.size); err != nil {
		return err
	}
	return IsendBatch(m.For(peer), peer, tags, bufs, reqs)
}

// Irecv implements Transport.
func (m *Mux) Irecv(peer int, tag Tag, buf []byte) (Request, error) {
	if err := CheckPeer(peer, m.size); err != nil {
		return nil, err
	}
	return m.For(peer).Irecv(peer, tag, buf)
}

// Path implements PathReporter.
func (m *Mux) Path(peer int) string {
	if peer < 0 || peer >= m.size {
		return "no such peer"
	}
	if pr, ok := m.For(peer).(PathReporter); ok {
		return pr.Path(peer)
	}
	return m.For(peer).Name()
}

// Close closes every transport.
func (m *Mux) Close() error {
	var errs []error
	for _, t := range m.all {
		errs = append(errs, t.Close())
	}
	return errors.Join(errs...)
}

var _ WindowTransport = (*Mux)(nil)

// NewWindow implements WindowTransport with the first of its transports that has
// windows (shared memory): peers served by another transport cannot be mapped (Map
// returns ErrNoWindow for them). Without such a transport it returns ErrNoWindow.
func (m *Mux) NewWindow(size int) (Window, []byte, error) {
	for _, t := range m.all {
		if wt, ok := t.(WindowTransport); ok {
			w, desc, err := wt.NewWindow(size)
			if err != nil {
				return nil, nil, err
			}
			return &muxWindow{Window: w, m: m, t: t}, desc, nil
		}
	}
	return nil, nil, fmt.Errorf("%w: none of %s has windows", ErrNoWindow, m.name)
}

type muxWindow struct {
	Window
	m *Mux
	t Transport
}

func (w *muxWindow) Map(peer int, desc []byte) error {
	if err := CheckPeer(peer, w.m.size); err != nil {
		return err
	}
	if w.m.For(peer) != w.t {
		return fmt.Errorf("%w: rank %d is served by %s", ErrNoWindow, peer, w.m.For(peer).Name())
	}
	return w.Window.Map(peer, desc)
}

var _ Readmitter = (*Mux)(nil)

// Readmit gives rank peer, whose process died, to the new process at addr through the
// transport that serves peer, or, where that one cannot reach such an address (a
// shared-memory route and a tcp joiner's host:port), through another of the Mux's
// transports that can, which serves peer from then on: a process that takes over a rank
// of a job mixing shared memory and tcp listens on tcp, and every live rank reaches it
// over tcp (its own host's included).
func (m *Mux) Readmit(ctx context.Context, peer int, addr string, members []int) error {
	if err := CheckPeer(peer, m.size); err != nil {
		return err
	}
	m.readmitMu.Lock()
	defer m.readmitMu.Unlock()
	first := m.For(peer)
	order := append([]Transport{first}, slices.DeleteFunc(slices.Clone(m.all), func(t Transport) bool { return t == first })...)
	var errs []error
	for _, t := range order {
		rm, ok := t.(Readmitter)
		if !ok {
			continue
		}
		err := rm.Readmit(ctx, peer, addr, members)
		var ae *ArgError
		if errors.As(err, &ae) && ae.Arg == "addr" {
			errs = append(errs, err) // not an address this transport reaches: try the next
			continue
		}
		if err == nil && t != first {
			by := slices.Clone(*m.by.Load())
			by[peer] = t
			m.by.Store(&by)
		}
		return err
	}
	if len(errs) == 0 {
		return fmt.Errorf("%w: none of %s takes a joiner", ErrNoReadmit, m.name)
	}
	return errors.Join(errs...)
}

// Evict implements Readmitter on the transport that serves peer.
func (m *Mux) Evict(peer int) {
	if peer < 0 || peer >= m.size {
		return
	}
	if rm, ok := m.For(peer).(Readmitter); ok {
		rm.Evict(peer)
	}
}
