package coll

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/moex-ai/moex/transport"
)

// openWindow makes this rank's window of size bytes where the transport has windows
// (nil where it has none), maps the peers' it can reach, and agrees with every rank on
// sig (the layout every rank writes with: they must agree before anyone writes into
// another's memory) and on who maps whom: maps[i*P+j] is 1 when rank i mapped rank j's
// window into its memory, 2 when it reaches it by one-sided operations
// (transport.RMAWindow), 0 when not at all. The window is sealed: nothing is mapped
// afterwards. It is collective.
func (c *Comm) openWindow(ctx context.Context, sig uint32, size int, what string) (transport.Window, []byte, error) {
	win, maps, _, err := c.openWindows(ctx, sig, size, what, false, true)
	return win, maps, err
}

// openWindowSpan is openWindow for windows this rank addresses (no one-sided windows:
// a board's callers store into them) that, with span, are also mapped side by side
// (transport.SpanWindow) where every rank can: the span is non-nil on every rank or on
// none.
func (c *Comm) openWindowSpan(ctx context.Context, sig uint32, size int, what string, span bool) (transport.Window, []byte, []byte, error) {
	return c.openWindows(ctx, sig, size, what, span, false)
}

// openWindows is openWindow and openWindowSpan: rma says the caller can use one-sided
// windows (transport.RMAWindow).
func (c *Comm) openWindows(ctx context.Context, sig uint32, size int, what string, span, rma bool) (transport.Window, []byte, []byte, error) {
	p := c.size
	const descMax = transport.MaxWindowDesc
	var win transport.Window
	var desc []byte
	wt, ok := c.tr.(transport.WindowTransport)
	if rt, isRMA := c.tr.(transport.RMATransport); isRMA && rt.RMAWindows() && !rma {
		ok = false // not these: the ranks then agree that nobody mapped anybody
	}
	if ok && p > 1 && !c.cfg.NoWindows {
		newWindow := wt.NewWindow
		if st, ok := c.tr.(transport.SpanTransport); ok && span {
			newWindow = func(size int) (transport.Window, []byte, error) { return st.NewSpanWindow(size) }
		}
		w, d, err := newWindow(size)
		if err == nil && len(d) <= descMax {
			win, desc = w, d
		} else if err == nil {
			w.Close()
		}
	}
	closeWin := func() {
		if win != nil {
			win.Close()
		}
	}
	// Every rank's signature and window descriptor.
	rec := make([]byte, 7+descMax)
	binary.LittleEndian.PutUint32(rec, sig)
	if win != nil {
		rec[4] = 1
		binary.LittleEndian.PutUint16(rec[5:], uint16(len(desc)))
		copy(rec[7:], desc)
	}
	all := make([]byte, p*len(rec))
	if err := AllGather(ctx, c, rec, all); err != nil {
		closeWin()
		return nil, nil, nil, err
	}
	for q := 0; q < p; q++ {
		if got := binary.LittleEndian.Uint32(all[q*len(rec):]); got != sig {
			closeWin()
			return nil, nil, nil, fmt.Errorf("%w: rank %d makes %s of another shape (signature %#x, this rank's %#x)", ErrMismatch, q, what, got, sig)
		}
	}
	mapped := make([]byte, p)
	if win != nil {
		for q := 0; q < p; q++ {
			r := all[q*len(rec) : (q+1)*len(rec)]
			n := int(binary.LittleEndian.Uint16(r[5:]))
			if q == c.rank || r[4] != 1 || n > descMax {
				continue
			}
			if err := win.Map(c.ranks[q], r[7:7+n]); err == nil {
				mapped[q] = 1
				if win.Remote(c.ranks[q]) == nil {
					mapped[q] = 2 // put and got, not addressed
				}
			} else if !errors.Is(err, transport.ErrNoWindow) {
				c.log.Warn("moex: cannot map a rank's window; exchanging messages with it instead", "rank", c.rank, "peer", q, "err", err)
			}
		}
	}
	// Every rank's map of whom it mapped; this all-gather is also the barrier after
	// which no window is mapped again.
	maps := make([]byte, p*p)
	if err := AllGather(ctx, c, mapped, maps); err != nil {
		closeWin()
		return nil, nil, nil, err
	}
	var mem []byte
	if span {
		// Every window is mapped everywhere: map them side by side, then agree that every
		// rank did before any file goes (Seal).
		ok := []byte{0}
		sw, isSpan := win.(transport.SpanWindow)
		if _, _, some := unmapped(maps, p); isSpan && !some {
			if m, err := sw.Span(c.ranks); err == nil {
				mem, ok[0] = m, 1
			} else {
				c.log.Warn("moex: cannot map the ranks' windows side by side", "rank", c.rank, "err", err)
			}
		}
		oks := make([]byte, p)
		if err := AllGather(ctx, c, ok, oks); err != nil {
			closeWin()
			return nil, nil, nil, err
		}
		for _, o := range oks {
			if o == 0 {
				mem = nil
			}
		}
	}
	if win != nil {
		win.Seal()
	}
	return win, maps, mem, nil
}

// unmapped returns a rank i of p that did not map rank j's window, if there is one (ok
// false: every rank mapped every other rank's).
func unmapped(maps []byte, p int) (i, j int, ok bool) {
	for i := 0; i < p; i++ {
		for j := 0; j < p; j++ {
			if i != j && maps[i*p+j] != 1 {
				return i, j, true
			}
		}
	}
	return 0, 0, false
}
