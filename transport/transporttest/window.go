package transporttest

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport"
)

// testWindows checks one-sided windows (transport.WindowTransport) where the transport
// has them: every rank writes a block into every peer's window, publishes it with a flag
// and notifies; every rank waits for its flags and checks each block's bytes, for several
// rounds (one rank late each round, so that waiters park and must be woken).
func testWindows(t *testing.T, f Factory) {
	const n, block, rounds = 4, 40 << 10, 6
	w := f(t, n)
	if _, ok := w.T[0].(transport.WindowTransport); !ok {
		t.Skipf("%s has no one-sided windows (transport.WindowTransport)", w.T[0].Name())
	}
	// Bad sizes are refused, naming the argument.
	_, _, err := w.T[0].(transport.WindowTransport).NewWindow(-1)
	var ae *transport.ArgError
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, "size", ae.Arg)

	// Layout of each window: a flag word per source (64 bytes apart), then a block per source.
	size := 64*n + n*block
	wins := make([]transport.Window, n)
	descs := make([][]byte, n)
	for r := range wins {
		wins[r], descs[r], err = w.T[r].(transport.WindowTransport).NewWindow(size)
		require.NoError(t, err)
		require.Len(t, wins[r].Local(), size)
	}
	defer func() {
		for _, win := range wins {
			assert.NoError(t, win.Close())
		}
	}()
	for r, win := range wins {
		for q := range wins {
			require.NoError(t, win.Map(q, descs[q]), "rank %d maps rank %d", r, q)
		}
		other := (r + 1) % n
		assert.Error(t, win.Map(other, []byte{1, 2, 3}), "a garbage descriptor is refused")
		require.NoError(t, win.Map(other, descs[other]))
	}
	for _, win := range wins {
		win.Seal()
	}
	flag := func(mem []byte, src int) *uint64 { return (*uint64)(unsafe.Pointer(&mem[64*src])) }
	data := func(mem []byte, src int) []byte { return mem[64*n+src*block : 64*n+(src+1)*block] }
	ctx := ctxT(t)
	for round := uint64(1); round <= rounds; round++ {
		late := int(round) % n
		var wg sync.WaitGroup
		errs := make([]error, n)
		for r := 0; r < n; r++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if r == late {
					time.Sleep(20 * time.Millisecond)
				}
				for q := 0; q < n; q++ {
					if q == r {
						continue
					}
					if rw, ok := wins[r].(transport.RMAWindow); ok {
						errs[r] = errors.Join(errs[r], putBlock(ctx, rw, q, 64*n+r*block, 64*r, round<<8|uint64(r)<<4|uint64(q), block))
						continue
					}
					mem := wins[r].Remote(q)
					Pattern(data(mem, r), round<<8|uint64(r)<<4|uint64(q))
					atomic.StoreUint64(flag(mem, r), round)
					wins[r].Notify(q)
				}
				own := wins[r].Local()
				if err := wins[r].Wait(ctx, func() bool {
					for q := 0; q < n; q++ {
						if q != r && atomic.LoadUint64(flag(own, q)) < round {
							return false
						}
					}
					return true
				}); err != nil {
					errs[r] = err
					return
				}
				for q := 0; q < n; q++ {
					if q == r {
						continue
					}
					if err := Check(data(own, q), round<<8|uint64(q)<<4|uint64(r)); err != nil {
						errs[r] = errors.Join(errs[r], err)
					}
				}
			}()
		}
		wg.Wait()
		for r, err := range errs {
			require.NoError(t, err, "round %d rank %d", round, r)
		}
		// Where peers are reached by one-sided operations, a rank reads back with Get the
		// block it put.
		if rw, ok := wins[0].(transport.RMAWindow); ok {
			got := make([]byte, block)
			for q := 1; q < n; q++ {
				req, err := rw.Get(q, 64*n, got)
				require.NoError(t, err)
				_, err = req.Wait(ctx)
				require.NoError(t, err)
				require.NoError(t, Check(got, round<<8|uint64(q)), "rank 0 gets its block back from rank %d", q)
			}
		}
		// Everyone has read this round before anyone writes the next.
	}
	// A wait whose condition never holds ends with its context.
	short, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
	defer cancel()
	err = wins[1].Wait(short, func() bool { return false })
	assert.Error(t, err)
}

// putBlock writes a patterned block at off of peer's window and then adds 1 to the flag
// word at flagOff, after a fence: the one-sided counterpart of a store and a flag.
func putBlock(ctx context.Context, w transport.RMAWindow, peer, off, flagOff int, seed uint64, n int) error {
	src := make([]byte, n)
	Pattern(src, seed)
	put, err := w.Put(peer, off, src)
	if err != nil {
		return err
	}
	if err := w.Fence(); err != nil {
		return err
	}
	sig, err := w.Signal(peer, flagOff, 1)
	if err != nil {
		return err
	}
	_, err1 := put.Wait(ctx)
	_, err2 := sig.Wait(ctx)
	return errors.Join(err1, err2)
}

// testSpans checks transport.SpanTransport where the transport has it: every rank's
// span shows every window (its own included) at its stride, in the order asked, aliasing
// the memory that Local and Remote give; spans and windows close without a trace.
func testSpans(t *testing.T, f Factory) {
	const n = 3
	const size = 3*4096 + 100 // not a whole number of pages
	w := f(t, n)
	st, ok := w.T[0].(transport.SpanTransport)
	if !ok {
		t.Skipf("%s cannot map windows side by side (transport.SpanTransport)", w.T[0].Name())
	}
	_, _, err := st.NewSpanWindow(-1)
	var ae *transport.ArgError
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, "size", ae.Arg)

	wins := make([]transport.SpanWindow, n)
	descs := make([][]byte, n)
	for r := range wins {
		wins[r], descs[r], err = w.T[r].(transport.SpanTransport).NewSpanWindow(size)
		require.NoError(t, err)
		require.Len(t, wins[r].Local(), size)
	}
	defer func() {
		for _, win := range wins {
			assert.NoError(t, win.Close())
		}
	}()
	for r, win := range wins {
		for q := range wins {
			require.NoError(t, win.Map(q, descs[q]), "rank %d maps rank %d", r, q)
		}
	}
	for r := range wins {
		Pattern(wins[r].Local(), uint64(r)+1)
	}
	stride := transport.SpanStride(size)
	require.Zero(t, stride%4096)
	require.GreaterOrEqual(t, stride, size)
	order := []int{2, 0, 1}
	spans := make([][]byte, n)
	for r, win := range wins {
		spans[r], err = win.Span(order)
		require.NoError(t, err, "rank %d", r)
		require.Len(t, spans[r], n*stride)
		again, err := win.Span(order)
		require.NoError(t, err)
		assert.Same(t, &spans[r][0], &again[0], "a second Span returns the first")
		for i, q := range order {
			require.NoError(t, Check(spans[r][i*stride:i*stride+size], uint64(q)+1), "rank %d's span, window of rank %d", r, q)
		}
	}
	for _, win := range wins {
		win.Seal()
	}
	// A write through one rank's span reaches the owner's Local and another rank's Remote.
	spans[1][0*stride+5] = 0xAB // window of rank 2
	assert.Equal(t, byte(0xAB), wins[2].Local()[5])
	assert.Equal(t, byte(0xAB), wins[0].Remote(2)[5])
	assert.Equal(t, byte(0xAB), spans[0][5])
}
