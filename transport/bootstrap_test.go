package transport

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func pipePair(t *testing.T) (net.Conn, net.Conn) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ch := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		ch <- c
	}()
	a, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	b := <-ch
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

func TestHandshake(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		ta, tb string
		ok     bool
	}{{"same secret", "s3cret", "s3cret", true}, {"wrong secret", "s3cret", "guess", false}} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := pipePair(t)
			var wg sync.WaitGroup
			var hb []byte
			var errB error
			wg.Add(1)
			go func() {
				defer wg.Done()
				hb, errB = Handshake(ctx, b, []byte(tc.tb), RoleAcceptor, []byte("from-b"))
				if errB != nil {
					b.Close()
				}
			}()
			ha, errA := Handshake(ctx, a, []byte(tc.ta), RoleDialer, []byte("from-a"))
			if errA != nil {
				a.Close()
			}
			wg.Wait()
			if tc.ok {
				if errA != nil || errB != nil || string(ha) != "from-b" || string(hb) != "from-a" {
					t.Fatalf("a: %q %v; b: %q %v", ha, errA, hb, errB)
				}
				return
			}
			if !errors.Is(errA, ErrAuth) || !errors.Is(errB, ErrAuth) {
				t.Fatalf("wrong secret accepted: a=%v b=%v", errA, errB)
			}
		})
	}
}

func TestHandshakeDeadline(t *testing.T) {
	a, _ := pipePair(t) // the other side never answers
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := Handshake(ctx, a, []byte("x"), RoleDialer, nil); err == nil {
		t.Fatal("handshake with a silent peer succeeded")
	}
}

func TestErrors(t *testing.T) {
	err := &PeerError{Rank: 3, Op: "recv", Err: ErrPeerClosed}
	if !errors.Is(err, ErrPeerClosed) {
		t.Fatal("PeerError does not unwrap")
	}
	ce := CtxError(context.DeadlineExceeded)
	if !errors.Is(ce, ErrTimeout) || !errors.Is(ce, context.DeadlineExceeded) {
		t.Fatal(ce)
	}
	ce = CtxError(context.Canceled)
	if !errors.Is(ce, ErrCanceled) || errors.Is(ce, ErrTimeout) {
		t.Fatal(ce)
	}
}
