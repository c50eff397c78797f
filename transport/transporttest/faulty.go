package transporttest

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/moex-ai/moex/transport"
)

// Fault is what a Faulty transport does to one message it sends.
type Fault int

const (
	Pass      Fault = iota // send it as it is
	Drop                   // complete the send; never deliver it
	Delay                  // deliver it after Faulty.DelayBy
	Duplicate              // deliver it twice
	Flip                   // deliver it with one bit flipped (Faulty.FlipBit)
)

func (f Fault) String() string {
	switch f {
	case Pass:
		return "pass"
	case Drop:
		return "drop"
	case Delay:
		return "delay"
	case Duplicate:
		return "duplicate"
	case Flip:
		return "flip"
	}
	return fmt.Sprintf("fault(%d)", int(f))
}

// Msg describes a message a Faulty transport is about to send: to which peer, with which
// tag, how many bytes, and how many messages to that peer came before it.
type Msg struct {
	Peer int
	Tag  transport.Tag
	Len  int
	N    int
}

// Faulty wraps a transport and injects faults into what it sends, deterministically:
// Rule decides, for every message in the order this rank sends them, what happens to it.
// Cut takes a link down as a dead cable would. It is for tests of what the layers above
// a transport do with a network that misbehaves.
type Faulty struct {
	transport.Transport
	Rule    func(Msg) Fault // nil: every message passes
	DelayBy time.Duration   // Delay's delay (default 10ms)
	FlipBit int             // Flip's bit, counted from the message's first byte (modulo its length)

	mu     sync.Mutex
	sent   map[int]int // per peer: messages sent so far
	fired  map[Fault]int
	cut    map[int]bool // peers whose link is down
	wg     sync.WaitGroup
	ctx    context.Context // ends at Close: the delayed and duplicated sends give up
	cancel context.CancelFunc
}

// NewFaulty wraps tr.
func NewFaulty(tr transport.Transport, rule func(Msg) Fault) *Faulty {
	ctx, cancel := context.WithCancel(context.Background())
	return &Faulty{Transport: tr, Rule: rule, sent: map[int]int{}, fired: map[Fault]int{}, cut: map[int]bool{}, ctx: ctx, cancel: cancel}
}

// Fired is how many messages fault was done to: dropped, flipped, sent a second time,
// or sent late. A test asserts it, so that a rule that never matches cannot pass for a
// transport that withstands the fault.
func (f *Faulty) Fired(fault Fault) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fired[fault]
}

func (f *Faulty) fire(fault Fault) {
	f.mu.Lock()
	f.fired[fault]++
	f.mu.Unlock()
}

// Cut takes the link to peer down: sends to it and receives from it fail at once with a
// *transport.PeerError wrapping transport.ErrPeerClosed. Cut both ends for a cable.
func (f *Faulty) Cut(peer int) {
	f.mu.Lock()
	f.cut[peer] = true
	f.mu.Unlock()
}

func (f *Faulty) cutErr(peer int, op string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.cut[peer] {
		return &transport.PeerError{Rank: peer, Op: op, Err: fmt.Errorf("%w: link cut (transporttest.Faulty)", transport.ErrPeerClosed)}
	}
	return nil
}

// Isend sends buf to peer, or does to it what Rule says.
func (f *Faulty) Isend(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	if err := f.cutErr(peer, "send"); err != nil {
		return done{err: err}, nil
	}
	f.mu.Lock()
	m := Msg{Peer: peer, Tag: tag, Len: len(buf), N: f.sent[peer]}
	f.sent[peer]++
	f.mu.Unlock()
	fault := Pass
	if f.Rule != nil {
		fault = f.Rule(m)
	}
	switch fault {
	case Drop:
		f.fire(Drop)
		return done{n: len(buf)}, nil
	case Flip:
		if len(buf) == 0 {
			break
		}
		c := append([]byte(nil), buf...)
		bit := f.FlipBit % (8 * len(c))
		c[bit/8] ^= 1 << (bit % 8)
		r, err := f.Transport.Isend(peer, tag, c)
		if err != nil {
			return nil, err
		}
		f.fire(Flip)
		return sized{r, len(buf)}, nil
	case Duplicate:
		c := append([]byte(nil), buf...)
		r, err := f.Transport.Isend(peer, tag, buf)
		if err != nil {
			return nil, err
		}
		f.background(func(ctx context.Context) {
			if r2, err := f.Transport.Isend(peer, tag, c); err == nil {
				f.fire(Duplicate)
				_, _ = r2.Wait(ctx)
			}
		})
		return r, nil
	case Delay:
		c := append([]byte(nil), buf...)
		d := f.DelayBy
		if d <= 0 {
			d = 10 * time.Millisecond
		}
		ch := make(chan done, 1)
		f.background(func(ctx context.Context) {
			select {
			case <-time.After(d):
			case <-ctx.Done():
				ch <- done{err: transport.ErrClosed}
				return
			}
			r, err := f.Transport.Isend(peer, tag, c)
			if err != nil {
				ch <- done{err: err}
				return
			}
			f.fire(Delay)
			_, err = r.Wait(ctx)
			ch <- done{n: len(c), err: err}
		})
		return &later{ch: ch}, nil
	}
	return f.Transport.Isend(peer, tag, buf)
}

// Irecv receives from peer, unless its link is cut.
func (f *Faulty) Irecv(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	if err := f.cutErr(peer, "recv"); err != nil {
		return done{err: err}, nil
	}
	return f.Transport.Irecv(peer, tag, buf)
}

// background runs fn in a goroutine that Close waits for; fn's ctx ends at Close.
func (f *Faulty) background(fn func(ctx context.Context)) {
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		fn(f.ctx)
	}()
}

// Close ends the delayed and duplicated sends still pending, then closes the transport.
func (f *Faulty) Close() error {
	f.cancel()
	f.wg.Wait()
	return f.Transport.Close()
}

// done is a request that completed when it was made.
type done struct {
	n   int
	err error
}

func (d done) Test() bool                        { return true }
func (d done) Wait(context.Context) (int, error) { return d.n, d.err }

// sized reports n bytes sent for a request that sent a copy.
type sized struct {
	transport.Request
	n int
}

func (s sized) Wait(ctx context.Context) (int, error) {
	_, err := s.Request.Wait(ctx)
	return s.n, err
}

// later completes when a background send does.
type later struct {
	ch  chan done
	res *done
}

func (l *later) Test() bool {
	if l.res != nil {
		return true
	}
	select {
	case d := <-l.ch:
		l.res = &d
		return true
	default:
		return false
	}
}

func (l *later) Wait(ctx context.Context) (int, error) {
	if l.Test() {
		return l.res.n, l.res.err
	}
	select {
	case d := <-l.ch:
		return d.n, d.err
	case <-ctx.Done():
		// The copy is the message: the caller's buffer is free at once.
		return 0, transport.CtxError(ctx.Err())
	}
}
