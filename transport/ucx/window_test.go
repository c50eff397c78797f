//go:build ucx

package ucx_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/ucx"
)

// startRMA starts n transports that reach every peer through windows, emulated RMA
// included.
func startRMA(t *testing.T, n int) []*ucx.Transport {
	return startWith(t, n, func(c *ucx.Config) { c.EmulatedWindows = true })
}

// openWindows makes a window of size bytes on every rank and maps every peer's.
func openWindows(t *testing.T, ts []*ucx.Transport, size int) []transport.RMAWindow {
	return openWindowsB(t, ts, size)
}

func openWindowsB(t testing.TB, ts []*ucx.Transport, size int) []transport.RMAWindow {
	t.Helper()
	wins := make([]transport.RMAWindow, len(ts))
	descs := make([][]byte, len(ts))
	for r, x := range ts {
		w, d, err := x.NewWindow(size)
		require.NoError(t, err)
		rw, ok := w.(transport.RMAWindow)
		require.True(t, ok, "a ucx window is reached by one-sided operations")
		assert.LessOrEqual(t, len(d), transport.MaxWindowDesc)
		wins[r], descs[r] = rw, d
		t.Cleanup(func() { rw.Close() })
	}
	for r, w := range wins {
		for q := range ts {
			if q != r {
				require.NoError(t, w.Map(q, descs[q]), "rank %d maps rank %d", r, q)
				assert.True(t, w.Reaches(q))
				assert.Nil(t, w.Remote(q), "a ucx window is not addressable")
			}
		}
		w.Seal()
	}
	return wins
}

func word(mem []byte, off int) *uint64 { return (*uint64)(unsafe.Pointer(&mem[off])) }

func waitReq(t *testing.T, r transport.Request, err error) {
	t.Helper()
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = r.Wait(ctx)
	require.NoError(t, err)
}

// Every rank puts a block into the next rank's window, fences and signals; the next
// rank sees the signal in its own memory and then the whole block: the ordering RDMA
// users rely on (data, fence, flag), with no receive posted anywhere.
func TestWindowPutSignal(t *testing.T) {
	const n, size, block = 3, 1 << 20, 300 << 10
	ts := startRMA(t, n)
	before := make([]transport.Counters, n)
	for r, x := range ts {
		before[r] = x.Counters()
	}
	wins := openWindows(t, ts, size)
	for round := 1; round <= 3; round++ {
		var g errgroup.Group
		for r := range n {
			g.Go(func() error {
				to, from := (r+1)%n, (r+n-1)%n
				src := make([]byte, block)
				for i := range src {
					src[i] = byte(r*31 + i*7 + round)
				}
				req, err := wins[r].Put(to, 4096, src)
				if err != nil {
					return err
				}
				if err := wins[r].Fence(); err != nil {
					return err
				}
				sig, err := wins[r].Signal(to, 64, 1)
				if err != nil {
					return err
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				for _, q := range []transport.Request{req, sig} {
					if _, err := q.Wait(ctx); err != nil {
						return err
					}
				}
				own := wins[r].Local()
				if err := wins[r].Wait(ctx, func() bool { return atomic.LoadUint64(word(own, 64)) >= uint64(round) }); err != nil {
					return err
				}
				for i, b := range own[4096 : 4096+block] {
					if want := byte(from*31 + i*7 + round); b != want {
						return errors.New("a byte of the block differs from what the peer put")
					}
				}
				return nil
			})
		}
		require.NoError(t, g.Wait(), "round %d", round)
	}
	for r, x := range ts {
		c := x.Counters()
		assert.Zero(t, c.MessagesIn-before[r].MessagesIn, "rank %d posted tag receives", r)
		assert.Equal(t, uint64(6), c.RMAOps-before[r].RMAOps, "rank %d: a put and a signal a round", r)
	}
}

// Get reads a peer's window in place.
func TestWindowGet(t *testing.T) {
	ts := startRMA(t, 2)
	wins := openWindows(t, ts, 64<<10)
	own := wins[1].Local()
	for i := range own {
		own[i] = byte(i * 13)
	}
	dst := make([]byte, 10000)
	r, err := wins[0].Get(1, 1000, dst)
	waitReq(t, r, err)
	assert.Equal(t, own[1000:11000], dst)
}

// Out-of-range operations and bad descriptors are typed errors; nothing is sent.
func TestWindowBadArguments(t *testing.T) {
	ts := startRMA(t, 2)
	wins := openWindows(t, ts, 4096)
	var arg *transport.ArgError
	_, err := wins[0].Put(1, 4000, make([]byte, 200))
	require.ErrorAs(t, err, &arg)
	assert.Equal(t, "off", arg.Arg)
	_, err = wins[0].Get(1, -1, make([]byte, 1))
	require.ErrorAs(t, err, &arg)
	_, err = wins[0].Signal(1, 12, 1)
	require.ErrorAs(t, err, &arg)
	_, err = wins[0].Put(0, 0, make([]byte, 1))
	require.ErrorAs(t, err, &arg, "this rank's own window is not reached by Put")
	_, _, err = ts[0].NewWindow(-1)
	require.ErrorAs(t, err, &arg)
	w, _, err := ts[0].NewWindow(4096)
	require.NoError(t, err)
	defer w.Close()
	require.ErrorIs(t, w.Map(1, []byte{1, 2, 3}), transport.ErrProtocol)
	bad := make([]byte, 16+8)
	bad[8] = 0xff
	bad[15] = 0xff // a size past MaxWindow
	require.ErrorIs(t, w.Map(1, bad), transport.ErrProtocol)
}

// Windows hold one registration each, made once; the transport's Close gives back every
// one, of windows closed (kept until then: a peer may still put into them) and of
// windows left open.
func TestWindowRegistrationsReleased(t *testing.T) {
	ts := startRMA(t, 2)
	base := ts[0].MemHandles()
	wins := openWindows(t, ts, 1<<20)
	assert.Equal(t, base+1, ts[0].MemHandles())
	for _, w := range wins {
		require.NoError(t, w.Close())
	}
	assert.Equal(t, base+1, ts[0].MemHandles(), "a closed window's registration waits for the transport's Close")
	_ = openWindows(t, ts, 4096) // left open: the transports' Close releases them
	assert.Equal(t, base+2, ts[1].MemHandles())
	for _, x := range ts {
		require.NoError(t, x.Close())
		assert.Zero(t, x.MemHandles(), "rank %d holds registrations after Close", x.Rank())
	}
}

// A peer that dies while this rank waits for its signal ends the wait with a PeerError
// naming it, where UCX reports failures (over sm moex's process watch does that for
// processes; ranks in one process cannot be told apart here).
func TestWindowWaitDeadPeer(t *testing.T) {
	ts := startRMA(t, 2)
	if !ts[0].PeerErrors() {
		t.Skip("these UCX lanes do not report a failed peer (UCX_TLS=sm): the process watch covers ranks as processes (coll's UCX tests)")
	}
	wins := openWindows(t, ts, 4096)
	go func() {
		time.Sleep(100 * time.Millisecond)
		ts[1].Kill()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err := wins[0].Wait(ctx, func() bool { return false })
	var pe *transport.PeerError
	require.ErrorAs(t, err, &pe)
	assert.Equal(t, 1, pe.Rank)
}

// By default a peer whose lanes lack RMA (UCX_TLS=tcp) is not reached through windows:
// Map says ErrNoWindow, and exchanges with it go as tag messages.
func TestWindowEmulatedRefusedByDefault(t *testing.T) {
	ts := start(t, 2)
	w, _, err := ts[0].NewWindow(4096)
	require.NoError(t, err)
	defer w.Close()
	_, desc, err := ts[1].NewWindow(4096)
	require.NoError(t, err)
	err = w.Map(1, desc)
	if ts[0].NativeRMA(1) {
		require.NoError(t, err, "lanes with RMA and atomics: %v", ts[0].Lanes(1))
		return
	}
	require.ErrorIs(t, err, transport.ErrNoWindow, "lanes %v", ts[0].Lanes(1))
	assert.Contains(t, ts[0].Path(1), "tag messages")
}
