package shm_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/moex-ai/moex/internal/wire"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/transporttest"
)

// TestMain checks that the tests leave /dev/shm as they found it.
func TestMain(m *testing.M) {
	// Every wake-up of the progress loop must come through the doorbell, the last waiter
	// or watchPeers: with the safety-net nap an hour long, one that is lost hangs.
	shm.SetProgressNap(time.Hour)
	before := shm.SegmentsOf(os.Getpid())
	code := m.Run()
	if after := shm.SegmentsOf(os.Getpid()); code == 0 && !slices.Equal(before, after) {
		println("shm tests left segments behind:", len(after)-len(before))
		code = 1
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			println(err.Error())
			code = 1
		}
	}
	os.Exit(code)
}

func start(t testing.TB, n int, tweak func(*shm.Config)) []*shm.Transport {
	t.Helper()
	return transporttest.Start(t, n, func(ctx context.Context, r int, ex func(context.Context, []byte) ([][]byte, error)) (*shm.Transport, error) {
		cfg := shm.Config{Rank: r, Size: n, Exchange: ex}
		if tweak != nil {
			tweak(&cfg)
		}
		return shm.New(ctx, cfg)
	})
}

func factory(tweak func(*shm.Config)) transporttest.Factory {
	return func(t *testing.T, n int) *transporttest.World {
		ts := start(t, n, tweak)
		w := &transporttest.World{}
		for _, x := range ts {
			w.T = append(w.T, x)
		}
		w.Kill = func(r int) { ts[r].Kill() }
		w.Inject = func(from, to int, raw []byte) error { return ts[from].InjectRaw(to, raw) }
		w.WholeFrames = true
		return w
	}
}

func TestConformanceCMA(t *testing.T) {
	transporttest.Run(t, factory(func(c *shm.Config) { c.CMA = 1 }), transporttest.Options{})
}

// The fallback for kernels that refuse cross-memory attach: large messages through the
// rings.
func TestConformanceRingCopies(t *testing.T) {
	transporttest.Run(t, factory(func(c *shm.Config) { c.CMA = -1; c.Slots = 16; c.SlotSize = 4096; c.Rewind = 1 }), transporttest.Options{})
}

func TestPathSaysHow(t *testing.T) {
	ts := start(t, 2, nil)
	if p := ts[0].Path(1); !contains(p, "cma") || !contains(p, "same host") || !contains(p, "obuf.Shared read in place") {
		t.Fatalf("path: %q", p)
	}
	ts2 := start(t, 2, func(c *shm.Config) { c.CMA = -1 })
	if p := ts2[0].Path(1); !contains(p, "ring copies") || contains(p, "read in place") {
		t.Fatalf("path: %q", p)
	}
}

func contains(s, sub string) bool {
	return len(s) >= len(sub) && (s == sub || len(sub) == 0 || indexOf(s, sub) >= 0)
}

func indexOf(s, sub string) int {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return i
		}
	}
	return -1
}

// A rank that is not on this host is refused with an argument error.
func TestNonLocalPeer(t *testing.T) {
	ts := transporttest.Start(t, 3, func(ctx context.Context, r int, ex func(context.Context, []byte) ([][]byte, error)) (*shm.Transport, error) {
		l := []bool{true, true, false}
		if r == 2 {
			l = []bool{false, false, true}
		}
		return shm.New(ctx, shm.Config{Rank: r, Size: 3, Local: l, Exchange: ex})
	})
	_, err := ts[0].Isend(2, transport.Tag{}, nil)
	var ae *transport.ArgError
	if !errors.As(err, &ae) {
		t.Fatalf("send to a rank on another host: %v, want an ArgError", err)
	}
}

func TestCleanStale(t *testing.T) {
	// A segment named after a pid that does not exist is removed.
	name := shm.DevShm + "/moex-deadbeef-r0-p999999999"
	if err := os.WriteFile(name, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	removed, err := shm.CleanStale()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(removed, "moex-deadbeef-r0-p999999999") {
		t.Fatalf("removed %v", removed)
	}
	if _, err := os.Stat(name); !os.IsNotExist(err) {
		t.Fatal("stale segment still there")
	}
}

// A producer that finds its ring empty pads to the end and starts over at the first slot
// (warm in cache). Messages of 1 to 3 slots, one at a time (the ring empties between them:
// rewinds) and in bursts (it does not: frames wrap around the end), arrive intact.
func TestRingRewind(t *testing.T) {
	for _, rewind := range []int{1, -1} {
		t.Run(fmt.Sprintf("rewind=%d", rewind), func(t *testing.T) { testRingRewind(t, rewind) })
	}
}

func testRingRewind(t *testing.T, rewind int) {
	ts := start(t, 2, func(c *shm.Config) { c.CMA = -1; c.Slots = 8; c.SlotSize = 1024; c.Rewind = rewind })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sizes := []int{0, 1, 900, 1000, 1900, 2500, 3000, 10}
	seq := uint32(0)
	roundTrip := func(burst int) {
		var sends, recvs []transport.Request
		bufs := make([][]byte, burst)
		for i := 0; i < burst; i++ {
			n := sizes[(int(seq)+i)%len(sizes)]
			bufs[i] = make([]byte, n)
			r, err := ts[1].Irecv(0, transport.Tag{Comm: 1, Seq: seq + uint32(i)}, bufs[i])
			if err != nil {
				t.Fatal(err)
			}
			recvs = append(recvs, r)
		}
		for i := 0; i < burst; i++ {
			n := sizes[(int(seq)+i)%len(sizes)]
			msg := make([]byte, n)
			transporttest.Pattern(msg, uint64(seq)+uint64(i))
			s, err := ts[0].Isend(1, transport.Tag{Comm: 1, Seq: seq + uint32(i)}, msg)
			if err != nil {
				t.Fatal(err)
			}
			sends = append(sends, s)
		}
		for i := range sends {
			if _, err := sends[i].Wait(ctx); err != nil {
				t.Fatal(err)
			}
			n, err := recvs[i].Wait(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if n != len(bufs[i]) {
				t.Fatalf("message %d: %d bytes, want %d", seq+uint32(i), n, len(bufs[i]))
			}
			if err := transporttest.Check(bufs[i], uint64(seq)+uint64(i)); err != nil {
				t.Fatalf("message %d (%d bytes): %v", seq+uint32(i), len(bufs[i]), err)
			}
		}
		seq += uint32(burst)
	}
	for i := 0; i < 40; i++ {
		roundTrip(1)
	}
	switch rewinds := ts[0].Stats().Rewinds; {
	case rewind > 0 && rewinds == 0:
		t.Fatal("40 messages one at a time through an emptied ring: no rewind")
	case rewind < 0 && rewinds != 0:
		t.Fatalf("%d rewinds with rewinding off", rewinds)
	}
	for i := 0; i < 20; i++ {
		roundTrip(5) // 5 messages of up to 3 slots each: more than the ring holds
	}
	if st := ts[0].Stats(); st.FullRing == 0 {
		t.Logf("bursts never filled the ring (stats %+v)", st)
	}
	// Every slot sent was consumed, pads included.
	if out, in := ts[0].Stats().SlotsOut, ts[1].Stats().SlotsIn; out != in {
		t.Fatalf("rank 0 published %d slots, rank 1 consumed %d", out, in)
	}
}

// A pad frame that does not end at the end of the ring is a protocol error.
func TestRingBadPad(t *testing.T) {
	ts := start(t, 2, func(c *shm.Config) { c.Slots = 8; c.SlotSize = 1024 })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := ts[1].Irecv(0, transport.Tag{Comm: 1, Tag: 5}, make([]byte, 10))
	if err != nil {
		t.Fatal(err)
	}
	h := wire.Header{Type: wire.TypePad, Src: 0, Aux: 3} // at slot 0 of 8 it would be 8
	frame := make([]byte, wire.HeaderSize)
	h.Encode(frame)
	if err := ts[0].InjectRaw(1, frame); err != nil {
		t.Fatal(err)
	}
	_, err = r.Wait(ctx)
	var pe *transport.PeerError
	if !errors.Is(err, transport.ErrProtocol) || !errors.As(err, &pe) || pe.Rank != 0 {
		t.Fatalf("got %v, want a protocol error naming rank 0", err)
	}
}

// MOEX_SHM_CMA and MOEX_SHM_REWIND: auto, 1 or 0; MOEX_SHM_AREA: KiB, 0 for none;
// anything else is an EnvError naming the variable.
func TestConfigFromEnv(t *testing.T) {
	for _, c := range []struct {
		env               map[string]string
		cma, rewind, area int
		stream            int
		wantErrNamed      string
	}{
		{env: nil},
		{env: map[string]string{"MOEX_SHM_CMA": "0", "MOEX_SHM_REWIND": "1"}, cma: -1, rewind: 1},
		{env: map[string]string{"MOEX_SHM_CMA": "on", "MOEX_SHM_REWIND": "off"}, cma: 1, rewind: -1},
		{env: map[string]string{"MOEX_SHM_AREA": "512"}, area: 512 << 10},
		{env: map[string]string{"MOEX_SHM_STREAM": "0"}, stream: -1},
		{env: map[string]string{"MOEX_SHM_STREAM": "1"}, stream: 1},
		{env: map[string]string{"MOEX_SHM_STREAM": "always"}, wantErrNamed: "MOEX_SHM_STREAM"},
		{env: map[string]string{"MOEX_SHM_AREA": "0"}, area: -1},
		{env: map[string]string{"MOEX_SHM_REWIND": "sometimes"}, wantErrNamed: "MOEX_SHM_REWIND"},
		{env: map[string]string{"MOEX_SHM_AREA": "1M"}, wantErrNamed: "MOEX_SHM_AREA"},
		{env: map[string]string{"MOEX_SHM_AREA": "-4"}, wantErrNamed: "MOEX_SHM_AREA"},
	} {
		var cfg shm.Config
		err := cfg.ConfigFromEnv(func(k string) string { return c.env[k] })
		if c.wantErrNamed != "" {
			var ee *transport.EnvError
			if !errors.As(err, &ee) || ee.Var != c.wantErrNamed {
				t.Fatalf("%v: got %v, want an EnvError naming %s", c.env, err, c.wantErrNamed)
			}
			continue
		}
		if err != nil || cfg.CMA != c.cma || cfg.Rewind != c.rewind || cfg.AreaBytes != c.area || cfg.Stream != c.stream {
			t.Fatalf("%v: CMA %d rewind %d area %d stream %d err %v, want %d %d %d %d", c.env, cfg.CMA, cfg.Rewind, cfg.AreaBytes, cfg.Stream, err, c.cma, c.rewind, c.area, c.stream)
		}
	}
}

// A clean end is not a failure: see transporttest.LeaveLogs.
func TestLogsGoodbyeAsLeaving(t *testing.T) {
	transporttest.LeaveLogs(t, "moex shm", func(n int, log *slog.Logger) []*shm.Transport {
		return start(t, n, func(c *shm.Config) { c.Logger = log })
	})
}
