package core

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/internal/wire"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
)

// The Engine is tested here without I/O: two engines joined by fake links whose frames
// wait in a queue until the test delivers them, one at a time, so that every interleaving
// below is the one written.

type fakeX struct{}

type (
	fsend = Send[fakeX, fakeX]
	frecv = Recv[fakeX, fakeX]
)

type fkind int

const (
	fEager fkind = iota
	fRTS
	fCTS
	fFIN
	fData
	fNotice
)

type fframe struct {
	kind    fkind
	h       wire.Header
	payload []byte
	send    *fsend // an eager send that completes on delivery (hold mode)
	last    bool   // the data frame that finishes send
}

// fakeLink is one direction of a pair: what engine from sends to engine to.
type fakeLink struct {
	net      *fakeNet
	from, to int
	mu       sync.Mutex
	q        []fframe
	hold     bool // eager sends complete when delivered, not when queued
	copies   bool // Pull copies from the sender's buffer instead of asking for it
	failed   error
}

type fakeNet struct {
	e     [2]*Engine[fakeX, fakeX]
	peer  [2]*Peer[fakeX, fakeX] // peer[i]: engine i's state for the other rank
	link  [2]*fakeLink           // link[i]: engine i to the other
	close [2]bool
}

func newFakeNet(t *testing.T) *fakeNet {
	n := &fakeNet{}
	poll := busypoll.New(busypoll.Config{Mode: busypoll.Block})
	for i := range 2 {
		n.e[i] = &Engine[fakeX, fakeX]{Rank: i, Name: "fake", EagerMax: 64, Pool: obuf.Default,
			Closed:      func() bool { return n.close[i] },
			Await:       func(ctx context.Context, r *Req) error { return r.Await(ctx, poll) },
			GracePoller: poll, Grace: 5 * time.Second, Log: slog.New(slog.DiscardHandler)}
		n.link[i] = &fakeLink{net: n, from: i, to: 1 - i}
		n.peer[i] = NewPeer[fakeX, fakeX](1-i, Link[fakeX, fakeX](n.link[i]))
	}
	return n
}

func (l *fakeLink) push(f fframe) {
	l.mu.Lock()
	l.q = append(l.q, f)
	l.mu.Unlock()
}

func (l *fakeLink) Eager(h wire.Header, s *fsend) bool {
	if l.hold {
		l.push(fframe{kind: fEager, h: h, send: s})
		return false
	}
	l.push(fframe{kind: fEager, h: h, payload: bytes.Clone(s.Buf)})
	return true
}

func (l *fakeLink) Announce(h wire.Header, s *fsend) { l.push(fframe{kind: fRTS, h: h}) }

func (l *fakeLink) Withdraw(s *fsend) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, f := range l.q {
		if f.send == s || (f.kind == fRTS && f.h.ID == s.ID) {
			l.q = append(l.q[:i], l.q[i+1:]...)
			return true
		}
	}
	return false
}

func (l *fakeLink) Pull(r *frecv) {
	e := l.net.e[l.from]
	if l.copies {
		// As shm's cross-memory copy: read the sender's buffer, then tell it.
		s := l.net.e[l.to].sends.Get(r.SenderID)
		copy(r.Buf, s.Buf)
		e.Pulled(r, nil)
		l.push(fframe{kind: fFIN, h: wire.Header{ID: r.SenderID}})
		return
	}
	id := e.Register(r)
	l.push(fframe{kind: fCTS, h: wire.Header{ID: r.SenderID, Aux: id}})
}

// Push sends the message in two data frames, the second half first.
func (l *fakeLink) Push(s *fsend, recvID uint64) {
	half := len(s.Buf) / 2
	l.push(fframe{kind: fData, h: wire.Header{ID: recvID, Aux: uint64(half)}, payload: bytes.Clone(s.Buf[half:])})
	l.push(fframe{kind: fData, h: wire.Header{ID: recvID, Aux: 0}, payload: bytes.Clone(s.Buf[:half]), send: s, last: true})
}

func (l *fakeLink) Notify(id, code uint64, reason string) {
	l.push(fframe{kind: fNotice, h: wire.Header{ID: id, Aux: code}, payload: []byte(reason)})
}

func (l *fakeLink) Drop(fn func(*fsend)) {
	l.mu.Lock()
	q := l.q
	l.q = nil
	l.mu.Unlock()
	for _, f := range q {
		if f.kind == fEager && f.send != nil {
			fn(f.send)
		}
	}
}

func (l *fakeLink) Fail(err error) {
	l.failed = err
	e, p := l.net.e[l.from], l.net.peer[l.from]
	if e.MarkDead(p, err) {
		e.Reap(p)
	}
}

type bytesSource struct {
	b   []byte
	err error
}

func (s *bytesSource) CopyTo(dst []byte) error {
	if s.err != nil {
		return s.err
	}
	copy(dst, s.b)
	return nil
}

func (s *bytesSource) Discard() error { return nil }

// step delivers the oldest frame from engine i to the other; it reports whether there was
// one and returns the handler's error.
func (n *fakeNet) step(i int) (bool, error) {
	l := n.link[i]
	l.mu.Lock()
	if len(l.q) == 0 {
		l.mu.Unlock()
		return false, nil
	}
	f := l.q[0]
	l.q = l.q[1:]
	l.mu.Unlock()
	to, p := n.e[1-i], n.peer[1-i]
	tag := transport.Tag{Comm: f.h.Comm, Seq: f.h.Seq, Tag: f.h.Tag, Sig: f.h.Sig}
	switch f.kind {
	case fEager:
		payload := f.payload
		if f.send != nil {
			payload = f.send.Buf
		}
		_, err := to.Eager(p, tag, len(payload), &bytesSource{b: payload})
		if f.send != nil {
			f.send.Complete(len(payload), nil)
		}
		return true, err
	case fRTS:
		return true, to.Announced(p, tag, f.h.ID, f.h.Aux, 0)
	case fCTS:
		to.ClearToSend(p, f.h.ID, f.h.Aux)
	case fFIN:
		to.Copied(p, f.h.ID)
	case fData:
		_, err := to.Data(p, f.h.ID, f.h.Aux, len(f.payload), &bytesSource{b: f.payload})
		if f.last {
			n.e[i].Pushed(f.send)
		}
		return true, err
	case fNotice:
		to.Notice(p, f.h.ID, f.h.Aux, string(f.payload))
	}
	return true, nil
}

// settle delivers frames both ways until none is left.
func (n *fakeNet) settle(t *testing.T) {
	t.Helper()
	for {
		a, err := n.step(0)
		require.NoError(t, err)
		b, err := n.step(1)
		require.NoError(t, err)
		if !a && !b {
			return
		}
	}
}

func tagOf(seq uint32) transport.Tag { return transport.Tag{Comm: 7, Seq: seq, Tag: 1, Sig: 0xabc} }

func payload(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7)
	}
	return b
}

func wait(t *testing.T, r transport.Request) (int, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return r.Wait(ctx)
}

// Every path of a message, with the receive posted before the message arrives and after:
// eager, and rendezvous where the sender pushes the data or the receiver copies it.
func TestEngineDelivers(t *testing.T) {
	for _, tc := range []struct {
		name   string
		size   int
		copies bool
	}{{"eager", 40, false}, {"empty", 0, false}, {"pushed", 1000, false}, {"copied", 1000, true}} {
		for _, recvFirst := range []bool{true, false} {
			t.Run(tc.name, func(t *testing.T) {
				n := newFakeNet(t)
				n.link[1].copies = tc.copies
				msg := payload(tc.size, 3)
				got := make([]byte, tc.size+10)
				var r *frecv
				if recvFirst {
					r = n.e[1].Irecv(n.peer[1], tagOf(1), got)
				}
				s := n.e[0].Isend(n.peer[0], tagOf(1), msg)
				n.settle(t)
				if !recvFirst {
					r = n.e[1].Irecv(n.peer[1], tagOf(1), got)
					n.settle(t)
				}
				k, err := wait(t, r)
				require.NoError(t, err)
				assert.Equal(t, tc.size, k)
				assert.Equal(t, msg, got[:k])
				k, err = wait(t, s)
				require.NoError(t, err)
				assert.Equal(t, tc.size, k)
				assert.Zero(t, countLive(&n.e[0].sends)+countLive(&n.e[1].recvs), "ids left in the tables")
			})
		}
	}
}

func countLive[T any](tb *Table[T]) int {
	k := 0
	tb.Each(func(uint64, *T) { k++ })
	return k
}

// Messages with one key match receives in the order both were posted.
func TestEngineOrder(t *testing.T) {
	n := newFakeNet(t)
	a, b := payload(10, 1), payload(500, 2)
	s1 := n.e[0].Isend(n.peer[0], tagOf(5), a)
	s2 := n.e[0].Isend(n.peer[0], tagOf(5), b)
	n.settle(t)
	g1, g2 := make([]byte, 500), make([]byte, 500)
	r1 := n.e[1].Irecv(n.peer[1], tagOf(5), g1)
	r2 := n.e[1].Irecv(n.peer[1], tagOf(5), g2)
	n.settle(t)
	for _, c := range []struct {
		r    transport.Request
		want []byte
		got  []byte
	}{{r1, a, g1}, {r2, b, g2}} {
		k, err := wait(t, c.r)
		require.NoError(t, err)
		assert.Equal(t, c.want, c.got[:k])
	}
	_, err := wait(t, s1)
	require.NoError(t, err)
	_, err = wait(t, s2)
	require.NoError(t, err)
}

// A message longer than its receive, or sent with another signature, fails the receive;
// an announced one fails its send too, through the receiver's notice.
func TestEngineRejects(t *testing.T) {
	for _, tc := range []struct {
		name     string
		size     int
		sig      uint32
		want     error
		sendFail bool
	}{
		{"eager truncated", 50, 0xabc, transport.ErrTruncated, false},
		{"announced truncated", 500, 0xabc, transport.ErrTruncated, true},
		{"eager mismatch", 10, 0xdef, transport.ErrMismatch, false},
		{"announced mismatch", 500, 0xdef, transport.ErrMismatch, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newFakeNet(t)
			tag := tagOf(2)
			tag.Sig = tc.sig
			s := n.e[0].Isend(n.peer[0], tag, payload(tc.size, 1))
			r := n.e[1].Irecv(n.peer[1], tagOf(2), make([]byte, 20))
			n.settle(t)
			_, err := wait(t, r)
			require.ErrorIs(t, err, tc.want)
			var pe *transport.PeerError
			require.ErrorAs(t, err, &pe)
			assert.Equal(t, 0, pe.Rank)
			_, err = wait(t, s)
			if tc.sendFail {
				require.ErrorIs(t, err, tc.want)
				require.ErrorAs(t, err, &pe)
				assert.Equal(t, 1, pe.Rank)
			} else {
				require.NoError(t, err)
			}
		})
	}
}

// ended is a context whose deadline has passed (in fake time too).
func ended() context.Context {
	ctx, cancel := context.WithDeadline(context.Background(), time.Unix(0, 0))
	cancel()
	return ctx
}

// A send whose frame has not left is withdrawn at once and never delivered.
func TestEngineCancelQueued(t *testing.T) {
	for _, size := range []int{10, 500} {
		n := newFakeNet(t)
		n.link[0].hold = true
		s := n.e[0].Isend(n.peer[0], tagOf(3), payload(size, 1))
		_, err := s.Wait(ended())
		require.ErrorIs(t, err, transport.ErrTimeout, "size %d", size)
		r := n.e[1].Irecv(n.peer[1], tagOf(3), make([]byte, size))
		n.settle(t)
		assert.False(t, r.Test(), "size %d: a withdrawn send was delivered", size)
		_, err = r.Wait(ended())
		require.ErrorIs(t, err, transport.ErrTimeout)
		assert.Zero(t, countLive(&n.e[0].sends))
	}
}

// waitAside runs Wait on another goroutine (it waits for frames the test delivers).
func waitAside(r transport.Request, ctx context.Context) <-chan error {
	ch := make(chan error, 1)
	go func() {
		_, err := r.Wait(ctx)
		ch <- err
	}()
	return ch
}

// settleUntil delivers frames until ch has a result. It runs in a synctest bubble:
// after each round of deliveries it waits until every goroutine of the test is blocked
// (the waiter has acted on what arrived), so no wall-clock pause is needed and a round
// that brings nothing new is certain.
func (n *fakeNet) settleUntil(t *testing.T, ch <-chan error) error {
	t.Helper()
	for range 100 {
		synctest.Wait()
		select {
		case err := <-ch:
			return err
		default:
		}
		_, err := n.step(0)
		require.NoError(t, err)
		_, err = n.step(1)
		require.NoError(t, err)
	}
	t.Fatal("Wait did not return after 100 rounds of deliveries")
	return nil
}

// An announcement that is out but unmatched is asked back: the receiver gives it back,
// the send fails with the context's error, and a receive posted later does not get it.
func TestEngineCancelAnnounced(t *testing.T) { synctest.Test(t, testEngineCancelAnnounced) }

func testEngineCancelAnnounced(t *testing.T) {
	n := newFakeNet(t)
	s := n.e[0].Isend(n.peer[0], tagOf(4), payload(500, 1))
	n.settle(t) // the announcement is unexpected at rank 1
	err := n.settleUntil(t, waitAside(s, ended()))
	require.ErrorIs(t, err, transport.ErrTimeout)
	require.NoError(t, n.link[0].failed, "the peer was failed instead of answering")
	r := n.e[1].Irecv(n.peer[1], tagOf(4), make([]byte, 500))
	n.settle(t)
	assert.False(t, r.Test(), "a withdrawn announcement was delivered")
	_, err = r.Wait(ended())
	require.ErrorIs(t, err, transport.ErrTimeout)
	assert.Zero(t, countLive(&n.e[0].sends))
}

// An announcement matched before the sender's cancel arrives is delivered whole, and the
// send reports success: a cancelled send is never half delivered.
func TestEngineCancelAfterMatch(t *testing.T) { synctest.Test(t, testEngineCancelAfterMatch) }

func testEngineCancelAfterMatch(t *testing.T) {
	for _, copies := range []bool{false, true} {
		n := newFakeNet(t)
		n.link[1].copies = copies
		msg := payload(500, 9)
		got := make([]byte, 500)
		s := n.e[0].Isend(n.peer[0], tagOf(6), msg)
		r := n.e[1].Irecv(n.peer[1], tagOf(6), got)
		_, err := n.step(0) // the announcement: matched, the answer queued
		require.NoError(t, err)
		err = n.settleUntil(t, waitAside(s, ended()))
		require.NoError(t, err, "copies %v", copies)
		require.NoError(t, n.link[0].failed, "the peer was failed")
		k, err := wait(t, r)
		require.NoError(t, err)
		assert.Equal(t, msg, got[:k])
	}
}

// A dead peer fails what is pending with it and what is started later, with a PeerError
// naming it; messages it sent before dying stay deliverable, announcements do not.
func TestEnginePeerDies(t *testing.T) {
	n := newFakeNet(t)
	n.link[0].hold = true
	early := payload(30, 4)
	n.e[1].Isend(n.peer[1], tagOf(10), early)
	n.e[1].Isend(n.peer[1], tagOf(11), payload(500, 1))
	n.settle(t) // rank 0 holds an eager message and an announcement, both unmatched
	posted := n.e[0].Irecv(n.peer[0], tagOf(12), make([]byte, 8))
	announced := n.e[0].Isend(n.peer[0], tagOf(13), payload(500, 2))
	queued := n.e[0].Isend(n.peer[0], tagOf(14), payload(8, 2)) // held in the link
	dead := errors.New("gone")
	n.link[0].Fail(dead)
	for _, r := range []transport.Request{posted, announced, queued} {
		_, err := wait(t, r)
		var pe *transport.PeerError
		require.ErrorAs(t, err, &pe)
		assert.Equal(t, 1, pe.Rank)
		assert.ErrorIs(t, err, dead)
	}
	later := n.e[0].Isend(n.peer[0], tagOf(15), payload(8, 1))
	_, err := wait(t, later)
	assert.ErrorIs(t, err, dead)
	got := make([]byte, 30)
	k, err := wait(t, n.e[0].Irecv(n.peer[0], tagOf(10), got))
	require.NoError(t, err, "a message sent before the peer died")
	assert.Equal(t, early, got[:k])
	_, err = wait(t, n.e[0].Irecv(n.peer[0], tagOf(11), make([]byte, 500)))
	assert.ErrorIs(t, err, dead, "an announcement of a dead peer")
	assert.Zero(t, countLive(&n.e[0].sends)+countLive(&n.e[0].recvs))
}

// A closing transport's pending operations fail with ErrClosed, not a PeerError.
func TestEngineClosed(t *testing.T) {
	n := newFakeNet(t)
	r := n.e[0].Irecv(n.peer[0], tagOf(1), make([]byte, 8))
	n.close[0] = true
	n.link[0].Fail(transport.ErrClosed)
	_, err := wait(t, r)
	require.ErrorIs(t, err, transport.ErrClosed)
	var pe *transport.PeerError
	assert.False(t, errors.As(err, &pe))
}

// Data frames for a receive that does not exist, or outside its message, are protocol
// errors; a payload that cannot be read leaves its receive to the reaper.
func TestEngineBadFrames(t *testing.T) {
	n := newFakeNet(t)
	_, err := n.e[1].Data(n.peer[1], 12345, 0, 4, &bytesSource{b: make([]byte, 4)})
	require.ErrorIs(t, err, transport.ErrProtocol)

	n.e[0].Isend(n.peer[0], tagOf(2), payload(500, 1))
	r := n.e[1].Irecv(n.peer[1], tagOf(2), make([]byte, 500))
	_, err = n.step(0)
	require.NoError(t, err)
	var cts fframe
	n.link[1].mu.Lock()
	cts = n.link[1].q[0]
	n.link[1].mu.Unlock()
	_, err = n.e[1].Data(n.peer[1], cts.h.Aux, 400, 200, &bytesSource{b: make([]byte, 200)})
	require.ErrorIs(t, err, transport.ErrProtocol, "data past the message's end")
	require.ErrorIs(t, n.e[1].Announced(n.peer[1], tagOf(3), 1, wire.MaxLength+1, 0), transport.ErrProtocol)

	broken := errors.New("stream broke")
	r2 := n.e[1].Irecv(n.peer[1], tagOf(4), make([]byte, 8))
	_, err = n.e[1].Eager(n.peer[1], tagOf(4), 8, &bytesSource{err: broken})
	require.ErrorIs(t, err, broken)
	assert.False(t, r2.Test(), "a receive completed with bytes that were not read")
	n.link[1].Fail(err)
	for _, q := range []transport.Request{r, r2} {
		_, err := wait(t, q)
		require.ErrorIs(t, err, broken)
	}
}
