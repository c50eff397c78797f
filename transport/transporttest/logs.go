package transporttest

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/moex-ai/moex/transport"
)

// Recorder is a slog.Handler that keeps every record, at every level, for tests that check
// what was logged: the level, the message and the attributes, not the rendered text. Its
// zero value is ready; it is safe for concurrent use.
type Recorder struct {
	mu   sync.Mutex
	recs []Record
}

// Record is one logged record: its attributes by key (groups flattened with dots), each
// as slog.Value.Any gives it (int64 for ints, the error itself for an error).
type Record struct {
	Level slog.Level
	Msg   string
	Attrs map[string]any
}

// Int returns the integer attribute key.
func (r Record) Int(key string) (int64, bool) {
	v, ok := r.Attrs[key].(int64)
	return v, ok
}

// Err returns the error attribute key.
func (r Record) Err(key string) error {
	err, _ := r.Attrs[key].(error)
	return err
}

// Logger returns a logger that records into r.
func (r *Recorder) Logger() *slog.Logger { return slog.New(&recordHandler{r: r}) }

// Records returns what was logged so far, oldest first.
func (r *Recorder) Records() []Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Record(nil), r.recs...)
}

// Count returns how many records match.
func (r *Recorder) Count(match func(Record) bool) int {
	n := 0
	for _, rec := range r.Records() {
		if match(rec) {
			n++
		}
	}
	return n
}

// WaitFor waits up to 10 s for a record that matches and reports whether one came.
func (r *Recorder) WaitFor(match func(Record) bool) bool {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if r.Count(match) > 0 {
			return true
		}
	}
	return false
}

// Logged matches records with message msg at level.
func Logged(level slog.Level, msg string) func(Record) bool {
	return func(r Record) bool { return r.Level == level && r.Msg == msg }
}

type recordHandler struct {
	r      *Recorder
	attrs  []slog.Attr
	prefix string
}

func (h *recordHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h *recordHandler) Handle(_ context.Context, rec slog.Record) error {
	out := Record{Level: rec.Level, Msg: rec.Message, Attrs: map[string]any{}}
	for _, a := range h.attrs {
		addAttr(out.Attrs, "", a)
	}
	rec.Attrs(func(a slog.Attr) bool {
		addAttr(out.Attrs, h.prefix, a)
		return true
	})
	h.r.mu.Lock()
	h.r.recs = append(h.r.recs, out)
	h.r.mu.Unlock()
	return nil
}

func addAttr(m map[string]any, prefix string, a slog.Attr) {
	v := a.Value.Resolve()
	if v.Kind() == slog.KindGroup {
		for _, g := range v.Group() {
			addAttr(m, prefix+a.Key+".", g)
		}
		return
	}
	m[prefix+a.Key] = v.Any()
}

func (h *recordHandler) WithAttrs(as []slog.Attr) slog.Handler {
	n := *h
	n.attrs = append([]slog.Attr(nil), h.attrs...)
	for _, a := range as {
		a.Key = h.prefix + a.Key
		n.attrs = append(n.attrs, a)
	}
	return &n
}

func (h *recordHandler) WithGroup(name string) slog.Handler {
	n := *h
	n.prefix = h.prefix + name + "."
	return &n
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
	var clean Recorder
	ts := start(3, clean.Logger())
	talk(ts, 1, 0)
	talk(ts, 2, 0)
	if err := ts[0].Close(); err != nil {
		t.Fatal(err)
	}
	left := func(r Record) bool {
		rank, _ := r.Int("rank")
		peer, _ := r.Int("peer")
		return Logged(slog.LevelDebug, name+": peer left")(r) && rank == 1 && peer == 0
	}
	clean.WaitFor(left) // the others find the goodbye on their own time
	for _, x := range ts[1:] {
		if err := x.Close(); err != nil {
			t.Fatal(err)
		}
	}
	failedMsg := func(r Record) bool { return r.Msg == name+": peer failed" }
	if clean.Count(failedMsg) != 0 || clean.Count(left) == 0 {
		t.Fatalf("a clean close logged: %+v", clean.Records())
	}

	var crash Recorder
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
	failed := func(r Record) bool {
		rank, _ := r.Int("rank")
		peer, _ := r.Int("peer")
		return Logged(slog.LevelInfo, name+": peer failed")(r) && rank == 0 && peer == 1 && r.Err("err") != nil
	}
	crash.WaitFor(failed) // it may be logged after the send failed
	if crash.Count(failed) == 0 || crash.Count(func(r Record) bool { return r.Msg == name+": peer left" }) != 0 {
		t.Fatalf("a killed peer was not logged as failed: %+v", crash.Records())
	}
}
