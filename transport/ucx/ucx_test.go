//go:build ucx

package ucx_test

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"slices"
	"testing"
	"time"
	"unsafe"

	"go.uber.org/goleak"

	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/transporttest"
	"github.com/moex-ai/moex/transport/ucx"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func start(t testing.TB, n int) []*ucx.Transport { return startLog(t, n, nil) }

func startLog(t testing.TB, n int, log *slog.Logger) []*ucx.Transport {
	return startWith(t, n, func(c *ucx.Config) { c.Logger = log })
}

func startWith(t testing.TB, n int, tweak func(*ucx.Config)) []*ucx.Transport {
	t.Helper()
	return transporttest.Start(t, n, func(ctx context.Context, r int, ex func(context.Context, []byte) ([][]byte, error)) (*ucx.Transport, error) {
		cfg := ucx.Config{Rank: r, Size: n, Exchange: ex, CancelGrace: 2 * time.Second}
		tweak(&cfg)
		return ucx.New(ctx, cfg)
	})
}

// factory's transports reach every peer through windows, emulated RMA included, so
// that the conformance suite checks them over every UCX_TLS.
func factory(t *testing.T, n int) *transporttest.World {
	return factoryWith(t, n, func(c *ucx.Config) { c.EmulatedWindows = true })
}

func factoryWith(t *testing.T, n int, tweak func(*ucx.Config)) *transporttest.World {
	ts := startWith(t, n, tweak)
	w := &transporttest.World{}
	for _, x := range ts {
		w.T = append(w.T, x)
	}
	if ts[0].PeerErrors() {
		w.Kill = func(r int) { ts[r].Kill() }
	}
	return w
}

// A clean end is not a failure: see transporttest.LeaveLogs.
func TestLogsGoodbyeAsLeaving(t *testing.T) {
	if !start(t, 2)[0].PeerErrors() {
		t.Skip("UCX over UCX_TLS=" + os.Getenv("UCX_TLS") + " does not report peer failures: a killed peer cannot be told from a slow one")
	}
	transporttest.LeaveLogs(t, "moex ucx", func(n int, log *slog.Logger) []*ucx.Transport { return startLog(t, n, log) })
}

// The conformance suite, over whichever UCX transports UCX_TLS selects (CI runs it with
// UCX_TLS=tcp and UCX_TLS=sm).
func TestConformance(t *testing.T) {
	t.Logf("UCX %s, UCX_TLS=%q", ucx.Version(), os.Getenv("UCX_TLS"))
	transporttest.Run(t, factory, transporttest.Options{SkipAllocs: "UCX requests are C memory; Go-side allocations are not the measure here",
		LateSends: "UCX cannot cancel a rendezvous send it has announced; the request is left to UCX, which completes it if a receive matches it"})
}

// Where ranks outnumber CPUs, the whole contract holds so too.
func TestConformanceOversubscribed(t *testing.T) {
	transporttest.Run(t, func(t *testing.T, n int) *transporttest.World {
		return factoryWith(t, n, func(c *ucx.Config) { c.Poll.Oversubscribed, c.EmulatedWindows = true, true })
	}, transporttest.Options{SkipAllocs: "UCX requests are C memory; Go-side allocations are not the measure here",
		LateSends: "UCX cannot cancel a rendezvous send it has announced; the request is left to UCX, which completes it if a receive matches it"})
}

func TestPathNamesTheTransports(t *testing.T) {
	ts := start(t, 2)
	p := ts[0].Path(1)
	t.Logf("path: %s (lanes %v)", p, ts[0].Lanes(1))
	if len(ts[0].Lanes(1)) == 0 {
		t.Fatalf("no lanes read back: %s", p)
	}
}

// Registered buffers are mapped with UCX once, however many messages use them (whole or
// in part), and the bytes arrive intact: private buffers on huge pages, and shared ones
// (obuf.NewSharedPool, mappings of a memfd).
func TestRegisterOncePerBuffer(t *testing.T) {
	for name, pool := range map[string]*obuf.Pool{"private": obuf.NewPool(2), "shared": obuf.NewSharedPool(2)} {
		t.Run(name, func(t *testing.T) { testRegisterOncePerBuffer(t, pool, name == "shared") })
	}
}

func testRegisterOncePerBuffer(t *testing.T, pool *obuf.Pool, shared bool) {
	ts := start(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	src, dst := pool.Get(4<<20), pool.Get(4<<20)
	defer src.Release()
	defer dst.Release()
	if src.Shared() != shared || dst.Shared() != shared {
		t.Fatalf("buffers shared %v and %v, want %v (%v)", src.Shared(), dst.Shared(), shared, obuf.SharedErr())
	}
	for _, b := range []*obuf.Buf{src, dst} {
		if err := ts[0].Register(b); err != nil {
			t.Fatal(err)
		}
		if err := ts[1].Register(b); err != nil {
			t.Fatal(err)
		}
	}
	before := ts[0].Registrations() + ts[1].Registrations()
	for i, n := range []int{100, 64 << 10, 1 << 20, 4 << 20, 3<<20 + 7} {
		off := (i * 4096) % (1 << 20)
		n = min(n, src.Len()-off)
		msg, got := src.Bytes()[off:off+n], dst.Bytes()[:n]
		transporttest.Pattern(msg, uint64(i+1))
		tg := transport.Tag{Comm: 4, Tag: uint32(i)}
		r, err := ts[1].Irecv(0, tg, got)
		if err != nil {
			t.Fatal(err)
		}
		s, err := ts[0].Isend(1, tg, msg)
		if err != nil {
			t.Fatal(err)
		}
		if err := transport.WaitAll(ctx, r, s); err != nil {
			t.Fatal(err)
		}
		if err := transporttest.Check(got, uint64(i+1)); err != nil {
			t.Fatalf("%d bytes at offset %d: %v", n, off, err)
		}
	}
	if after := ts[0].Registrations() + ts[1].Registrations(); after != before {
		t.Fatalf("%d more registrations for messages in registered buffers", after-before)
	}
	if before != 4 {
		t.Fatalf("%d registrations for 2 buffers on 2 ranks", before)
	}
}

// The device path (a raw pointer and a memory type, as a CUDA-enabled UCX takes device
// memory) moves host memory given as a pointer; a memory type this UCX cannot move is
// refused with an ArgError naming it, not handed to UCX.
func TestDevicePointerPath(t *testing.T) {
	ts := start(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	t.Logf("memory types: %v", ts[0].MemTypes())
	pool := obuf.NewPool(2)
	src, dst := pool.Get(4<<20), pool.Get(4<<20) // mmap'd: outside the Go heap
	defer src.Release()
	defer dst.Release()
	for i, n := range []int{64, 1 << 20} {
		transporttest.Pattern(src.Bytes()[:n], uint64(i+7))
		tg := transport.Tag{Comm: 5, Tag: uint32(i)}
		r, err := ts[1].IrecvDevice(0, tg, uintptr(unsafe.Pointer(unsafe.SliceData(dst.Bytes()))), n, transport.MemHost)
		if err != nil {
			t.Fatal(err)
		}
		s, err := ts[0].IsendDevice(1, tg, uintptr(unsafe.Pointer(unsafe.SliceData(src.Bytes()))), n, transport.MemHost)
		if err != nil {
			t.Fatal(err)
		}
		got, err := r.Wait(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if got != n {
			t.Fatalf("received %d bytes, want %d", got, n)
		}
		if err := transporttest.Check(dst.Bytes()[:n], uint64(i+7)); err != nil {
			t.Fatal(err)
		}
	}
	if !slices.Contains(ts[0].MemTypes(), transport.MemCUDA) {
		_, err := ts[0].IsendDevice(1, transport.Tag{Comm: 5, Tag: 9}, 0x1000, 64, transport.MemCUDA)
		var ae *transport.ArgError
		if !errors.As(err, &ae) || ae.Arg != "mt" {
			t.Fatalf("CUDA memory on a UCX without CUDA: got %v, want an ArgError on mt", err)
		}
	}
	if _, err := ts[0].IsendDevice(1, transport.Tag{Comm: 5, Tag: 9}, 0, 64, transport.MemHost); err == nil {
		t.Fatal("nil pointer accepted")
	}
}
