package tcp

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"

	"golang.org/x/sync/errgroup"

	"github.com/moex-ai/moex/transport"
)

// A rank whose process died can be taken over by a new one while the job runs: the new
// process listens (Listen), the live ranks agree to admit it and each dials it on every
// stream (Readmit), greeting it with the list of live ranks, and it becomes a Transport
// connected to each of them (Replacement.Accept).

// ErrReplaced is what operations with a peer still thought alive complete with when
// Readmit gives its rank to a new process.
var ErrReplaced = fmt.Errorf("%w: its rank was given to a replacement", transport.ErrPeerClosed)

// joinMagic starts the greeting of a live rank to a replacement.
const joinMagic = "MXTJ"

// joinHello is a live rank's greeting to a replacement: its own hello, and the live ranks
// every one of which dials the replacement.
type joinHello struct {
	hello
	members []int
}

func (h joinHello) encode() []byte {
	b := []byte(joinMagic)
	for _, v := range []uint32{h.rank, h.size, h.stream, h.streams, uint32(len(h.members))} {
		b = binary.LittleEndian.AppendUint32(b, v)
	}
	for _, m := range h.members {
		b = binary.LittleEndian.AppendUint32(b, uint32(m))
	}
	return b
}

func decodeJoinHello(b []byte) (joinHello, error) {
	le := binary.LittleEndian
	if len(b) < 24 || string(b[:4]) != joinMagic {
		return joinHello{}, fmt.Errorf("%w: bad greeting of a live rank", transport.ErrProtocol)
	}
	h := joinHello{hello: hello{le.Uint32(b[4:]), le.Uint32(b[8:]), le.Uint32(b[12:]), le.Uint32(b[16:])}}
	n := int(le.Uint32(b[20:]))
	if n < 1 || n >= int(h.size) || len(b) != 24+4*n {
		return joinHello{}, fmt.Errorf("%w: a greeting of %d bytes naming %d live ranks of %d", transport.ErrProtocol, len(b), n, h.size)
	}
	h.members = make([]int, n)
	for i := range h.members {
		h.members[i] = int(le.Uint32(b[24+4*i:]))
	}
	return h, nil
}

// Replacement is a process taking over a rank of a running job: it listens until the
// job's live ranks have connected to it.
type Replacement struct {
	t  *Transport
	ln net.Listener
}

// Listen starts a replacement for rank cfg.Rank of cfg.Size ranks (cfg.Exchange is not
// used): it listens on cfg.Bind, at Addr, for the live ranks, which dial it once they
// have agreed to admit it (Readmit).
func Listen(cfg Config) (*Replacement, error) {
	if cfg.Size < 2 {
		return nil, &transport.ArgError{Arg: "Size", Reason: fmt.Sprintf("%d: a replacement joins a job of at least two ranks", cfg.Size)}
	}
	t, err := newTransport(cfg)
	if err != nil {
		return nil, err
	}
	bind := cfg.Bind
	if bind == "" {
		bind = "127.0.0.1"
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(bind, "0"))
	if err != nil {
		_ = t.self.Close()
		return nil, fmt.Errorf("tcp: listen on %s: %w", bind, err)
	}
	return &Replacement{t: t, ln: ln}, nil
}

// Addr is where the live ranks reach the replacement.
func (r *Replacement) Addr() string { return r.ln.Addr().String() }

// Accept waits, until ctx ends, for every live rank to connect on every stream, and
// returns the replacement's transport and the live ranks, as their greetings name them
// (they agree, or the connection is refused). Operations with a rank that was not live
// fail with a PeerError. The listener is closed when Accept returns; on error the
// connections made are closed too.
func (r *Replacement) Accept(ctx context.Context) (*Transport, []int, error) {
	t := r.t
	defer r.ln.Close()
	conns := make([][]*net.TCPConn, t.size)
	var mu sync.Mutex
	acc := &liveRanks{t: t}
	if err := t.acceptAll(ctx, r.ln, acc, conns, &mu, t.token); err != nil {
		for _, cs := range conns {
			for _, c := range cs {
				if c != nil {
					_ = c.Close()
				}
			}
		}
		_ = t.self.Close()
		return nil, nil, err
	}
	t.install(conns)
	return t, slices.Clone(acc.members), nil
}

// Close releases a replacement whose Accept was not called.
func (r *Replacement) Close() error { return r.ln.Close() }

// liveRanks accepts the live ranks' greetings to a replacement: the first names the live
// ranks, and the others must name the same.
type liveRanks struct {
	t       *Transport
	members []int
}

func (a *liveRanks) admit(greeting []byte) (int, int, string) {
	t := a.t
	h, err := decodeJoinHello(greeting)
	switch {
	case err != nil:
		return 0, 0, err.Error()
	case int(h.rank) == t.rank || int(h.rank) >= t.size || int(h.stream) >= t.streams ||
		h.size != uint32(t.size) || h.streams != uint32(t.streams):
		return 0, 0, fmt.Sprintf("unexpected hello: rank %d of %d, stream %d of %d", h.rank, h.size, h.stream, h.streams)
	case !slices.Contains(h.members, int(h.rank)) || slices.Contains(h.members, t.rank):
		return 0, 0, fmt.Sprintf("rank %d names live ranks %v", h.rank, h.members)
	case a.members == nil:
		for _, m := range h.members {
			if m < 0 || m >= t.size {
				return 0, 0, fmt.Sprintf("rank %d names live ranks %v", h.rank, h.members)
			}
		}
		a.members = h.members
	case !slices.Equal(a.members, h.members):
		return 0, 0, fmt.Sprintf("rank %d names live ranks %v, another %v", h.rank, h.members, a.members)
	}
	return int(h.rank), int(h.stream), ""
}

func (a *liveRanks) missing(got int) int {
	if a.members == nil {
		return 1
	}
	return len(a.members)*a.t.streams - got
}

// Readmit gives rank peer, whose process died, to the replacement listening at addr: it
// dials it on every stream, greeting it with members (the live ranks, this one among
// them, as every one of them names them), and from then on operations with peer reach
// the new process. A peer still thought alive is failed first (its operations complete
// with ErrReplaced): the caller has agreed with the other live ranks that it died.
// Readmit honours ctx; on error peer stays as it was (or failed).
func (t *Transport) Readmit(ctx context.Context, peer int, addr string, members []int) error {
	if err := transport.CheckReadmit(t.rank, t.size, peer, members); err != nil {
		return err
	}
	if t.closed.Load() {
		return transport.ErrClosed
	}
	t.readmitMu.Lock()
	defer t.readmitMu.Unlock()
	if old := t.peers[peer].Load(); old != nil && old.c.Dead() == nil {
		old.fail(ErrReplaced)
	}
	conns := make([]*net.TCPConn, t.streams)
	g, gctx := errgroup.WithContext(ctx)
	for s := range conns {
		g.Go(func() error {
			h := joinHello{hello{uint32(t.rank), uint32(t.size), uint32(s), uint32(t.streams)}, members}
			c, err := t.dial(gctx, addr, peer, h.encode(), t.token)
			conns[s] = c
			return err
		})
	}
	err := g.Wait()
	t.peersMu.Lock()
	if err == nil && t.closed.Load() {
		err = transport.ErrClosed
	}
	if err != nil {
		t.peersMu.Unlock()
		for _, c := range conns {
			if c != nil {
				_ = c.Close()
			}
		}
		if errors.Is(err, transport.ErrClosed) {
			return err
		}
		return &transport.PeerError{Rank: peer, Op: "connect", Err: err}
	}
	pr := t.newPeer(peer, conns)
	t.peers[peer].Store(pr)
	pr.start()
	t.peersMu.Unlock()
	t.log.Info("moex tcp: readmitted", "rank", t.rank, "peer", peer, "addr", addr)
	return nil
}

// Evict closes the connections to peer that Readmit made; its operations fail with
// transport.ErrEvicted.
func (t *Transport) Evict(peer int) {
	if peer < 0 || peer >= t.size || peer == t.rank {
		return
	}
	t.readmitMu.Lock()
	defer t.readmitMu.Unlock()
	if p := t.peers[peer].Load(); p != nil && p.c.Dead() == nil {
		p.fail(transport.ErrEvicted)
		t.log.Info("moex tcp: evicted", "rank", t.rank, "peer", peer)
	}
}

var _ transport.Readmitter = (*Transport)(nil)
