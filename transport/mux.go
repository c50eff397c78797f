package transport

import (
	"errors"
	"fmt"
)

// Mux is a Transport that sends each peer's traffic over the transport chosen for it
// (shared memory for ranks on this host, the network for the others). Messages to one
// peer always take the same transport, so ordering per (peer, tag) holds.
type Mux struct {
	rank, size int
	by         []Transport // per peer
	all        []Transport // each once, for Close
	name       string
}

var _ Transport = (*Mux)(nil)
var _ PathReporter = (*Mux)(nil)

// NewMux routes peer q to by[q]. Every transport in by must cover the peers routed to it
// and have the same rank and size.
func NewMux(name string, by []Transport) (*Mux, error) {
	if len(by) == 0 {
		return nil, &ArgError{Arg: "by", Reason: "no transports"}
	}
	m := &Mux{rank: by[0].Rank(), size: len(by), by: by, name: name}
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
func (m *Mux) For(peer int) Transport { return m.by[peer] }

// Isend implements Transport.
func (m *Mux) Isend(peer int, tag Tag, buf []byte) (Request, error) {
	if err := CheckPeer(peer, m.size); err != nil {
		return nil, err
	}
	return m.by[peer].Isend(peer, tag, buf)
}

// IsendBatch implements Batcher, as the transport that serves peer does.
func (m *Mux) IsendBatch(peer int, tags []Tag, bufs [][]byte, reqs []Request) error {
	if err := CheckPeer(peer, m.size); err != nil {
		return err
	}
	return IsendBatch(m.by[peer], peer, tags, bufs, reqs)
}

// Irecv implements Transport.
func (m *Mux) Irecv(peer int, tag Tag, buf []byte) (Request, error) {
	if err := CheckPeer(peer, m.size); err != nil {
		return nil, err
	}
	return m.by[peer].Irecv(peer, tag, buf)
}

// Path implements PathReporter.
func (m *Mux) Path(peer int) string {
	if peer < 0 || peer >= m.size {
		return "no such peer"
	}
	if pr, ok := m.by[peer].(PathReporter); ok {
		return pr.Path(peer)
	}
	return m.by[peer].Name()
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
	if w.m.by[peer] != w.t {
		return fmt.Errorf("%w: rank %d is served by %s", ErrNoWindow, peer, w.m.by[peer].Name())
	}
	return w.Window.Map(peer, desc)
}
