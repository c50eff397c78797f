package transporttest

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moex-ai/moex/transport"
)

// Logs collects the text log of several ranks (a slog text handler at debug level) for
// tests that check what a transport said.
type Logs struct {
	mu sync.Mutex
	b  strings.Builder
}

// Logger returns a logger that writes into l.
func (l *Logs) Logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func (l *Logs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *Logs) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// WaitFor waits up to 10 s for a line that contains sub.
func (l *Logs) WaitFor(sub string) {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline) && !strings.Contains(l.String(), sub); {
		time.Sleep(time.Millisecond)
	}
}

// LeaveLogs checks how a transport logs its peers' ends: a peer that closes is leaving
// ("<name>: peer left", debug level), not failing, since every rank sees every other one
// leave at a clean end; a peer that vanishes without its goodbye (Kill) is failing
// ("<name>: peer failed", with the error). start starts n ranks that log to log; name is
// the transport's log prefix ("moex shm").
func LeaveLogs[T interface {
	transport.Transport
	Kill()
}](t *testing.T, name string, start func(n int, log *slog.Logger) []T) {
	t.Helper()
	msg := make([]byte, 8)
	Pattern(msg, 80)
	talk := func(ts []T, a, b int) { // a message a -> b
		t.Helper()
		w := &World{}
		for _, x := range ts {
			w.T = append(w.T, x)
		}
		if err := Check(exchange(t, w, a, b, tag(80), msg, true), 80); err != nil {
			t.Fatal(err)
		}
	}
	var clean Logs
	ts := start(3, clean.Logger())
	talk(ts, 1, 0)
	talk(ts, 2, 0)
	if err := ts[0].Close(); err != nil {
		t.Fatal(err)
	}
	left := fmt.Sprintf("msg=\"%s: peer left\" rank=1 peer=0", name)
	clean.WaitFor(left) // the others find the goodbye on their own time
	for _, x := range ts[1:] {
		if err := x.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if s := clean.String(); strings.Contains(s, "peer failed") || !strings.Contains(s, left) {
		t.Fatalf("a clean close logged:\n%s", s)
	}

	var crash Logs
	ts = start(2, crash.Logger())
	// A message each way first: transports that connect on first use (UCX) can only see
	// a peer die over a connection.
	talk(ts, 1, 0)
	talk(ts, 0, 1)
	ts[1].Kill()
	// The survivor finds out when it next talks to the dead rank: here with a send
	// large enough that it cannot just go into a socket's buffer, waited on as long as
	// the conformance suite waits for a dead peer to be found.
	req, err := ts[0].Isend(1, tag(81), make([]byte, 4<<20))
	if err == nil {
		_, err = req.Wait(ctxT(t))
	}
	if pe := (*transport.PeerError)(nil); !errors.As(err, &pe) || pe.Rank != 1 || errors.Is(err, transport.ErrPeerLeft) {
		t.Fatalf("a send to a killed peer: %v, want a *PeerError naming rank 1 (not ErrPeerLeft)", err)
	}
	failed := fmt.Sprintf("msg=\"%s: peer failed\" rank=0 peer=1", name)
	crash.WaitFor(failed) // it may be logged after the send failed
	if s := crash.String(); !strings.Contains(s, failed) || strings.Contains(s, "peer left") {
		t.Fatalf("a killed peer was not logged as failed:\n%s", s)
	}
}
