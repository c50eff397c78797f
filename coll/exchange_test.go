package coll

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/internal/race"
)

// xlen is the length of field f of the block src sends dst in exchange e: every rank
// computes it alike. Some are empty, some full.
func xlen(e uint64, src, dst, f, capacity int) int {
	r := rand.New(rand.NewPCG(e, uint64(src<<16|dst<<8|f)))
	switch r.IntN(5) {
	case 0:
		return 0
	case 1:
		return capacity
	}
	return r.IntN(capacity + 1)
}

// xfill writes the bytes of that block's field.
func xfill(b []byte, e uint64, src, dst, f int) {
	for i := range b {
		b[i] = byte(int(e)*31 + src*7 + dst*3 + f*11 + i)
	}
}

func xcheck(b []byte, e uint64, src, dst, f int) error {
	for i := range b {
		if want := byte(int(e)*31 + src*7 + dst*3 + f*11 + i); b[i] != want {
			return fmt.Errorf("exchange %d, %d->%d field %d byte %d of %d: %#x, want %#x", e, src, dst, f, i, len(b), b[i], want)
		}
	}
	return nil
}

// exchangeRounds runs rounds of exchanges, two in flight at a time (both begun, then
// filled, then waited for in order), and checks every byte and length that arrived.
func exchangeRounds(c *Comm, x *Exchange, fields []int, rounds int) error {
	ctx := context.Background()
	me := c.Rank()
	check := func(o *XOp) error {
		for q := 0; q < c.Size(); q++ {
			for f, capacity := range fields {
				got := o.Recv(q, f)
				if want := xlen(o.Epoch(), q, me, f, capacity); len(got) != want {
					return fmt.Errorf("exchange %d from %d field %d: %d bytes, want %d", o.Epoch(), q, f, len(got), want)
				}
				if err := xcheck(got, o.Epoch(), q, me, f); err != nil {
					return err
				}
			}
		}
		return nil
	}
	fill := func(o *XOp) error {
		lens := make([]int, len(fields))
		for {
			q, dst, err := o.NextDest(ctx)
			if err != nil || q < 0 {
				return err
			}
			for f, capacity := range fields {
				lens[f] = xlen(o.Epoch(), me, q, f, capacity)
				xfill(dst[f][:lens[f]], o.Epoch(), me, q, f)
			}
			if err := o.Send(q, lens...); err != nil {
				return err
			}
		}
	}
	for r := 0; r < rounds; r++ {
		a, err := x.Begin(ctx)
		if err != nil {
			return err
		}
		b, err := x.Begin(ctx)
		if err != nil {
			return err
		}
		if err := fill(a); err != nil {
			return err
		}
		if err := fill(b); err != nil {
			return err
		}
		if err := a.Wait(ctx); err != nil {
			return err
		}
		if err := b.Wait(ctx); err != nil {
			return err
		}
		if err := check(a); err != nil {
			return err
		}
		if err := check(b); err != nil {
			return err
		}
	}
	return nil
}

func TestExchange(t *testing.T) {
	fields := []int{100, 0, 7 << 10} // a field of no capacity travels as no message
	for _, windows := range []bool{true, false} {
		for _, p := range testPs {
			t.Run(fmt.Sprintf("windows=%v/P=%d", windows, p), func(t *testing.T) {
				noErr(t, world(t, p, Config{NoWindows: !windows}, func(c *Comm) error {
					x, err := c.NewExchange(context.Background(), ExchangeConfig{Fields: fields, Slots: 2})
					if err != nil {
						return err
					}
					defer x.Close()
					for q := 0; q < p; q++ {
						if want := windows && q != c.Rank(); x.Pushes(q) != want {
							return fmt.Errorf("pushes to %d: %v, want %v", q, x.Pushes(q), want)
						}
					}
					return exchangeRounds(c, x, fields, 4)
				}))
			})
		}
	}
}

// Begin refuses to reuse the slot of an exchange not waited for, the same way on every
// rank, and bad lengths are refused naming the argument.
func TestExchangeBusyAndArgs(t *testing.T) {
	ctx := context.Background()
	noErr(t, world(t, 3, Config{}, func(c *Comm) error {
		x, err := c.NewExchange(ctx, ExchangeConfig{Fields: []int{64}, Slots: 1})
		if err != nil {
			return err
		}
		defer x.Close()
		o, err := x.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := x.Begin(ctx); !errors.Is(err, ErrBusy) {
			return fmt.Errorf("second Begin with one slot: %v, want ErrBusy", err)
		}
		dst, err := o.Dest(ctx, c.Rank())
		if err != nil {
			return err
		}
		var ae *ArgError
		if err := o.Send(c.Rank(), len(dst[0])+1); !errors.As(err, &ae) || ae.Arg != "lens[0]" {
			return fmt.Errorf("too long: %v", err)
		}
		binary.LittleEndian.PutUint32(dst[0], 42)
		if err := o.Send(c.Rank(), 4); err != nil {
			return err
		}
		if err := o.Send(c.Rank(), 4); !errors.As(err, &ae) {
			return fmt.Errorf("sent twice: %v", err)
		}
		if err := o.Wait(ctx); err != nil { // empty blocks to the others
			return err
		}
		for q := 0; q < c.Size(); q++ {
			want := 0
			if q == c.Rank() {
				want = 4
			}
			if n := len(o.Recv(q, 0)); n != want {
				return fmt.Errorf("from %d: %d bytes, want %d", q, n, want)
			}
		}
		if binary.LittleEndian.Uint32(o.Recv(c.Rank(), 0)) != 42 {
			return errors.New("own block lost")
		}
		if err := o.Wait(ctx); !errors.As(err, &ae) {
			return fmt.Errorf("waited twice: %v", err)
		}
		return nil
	}))
}

// Ranks whose exchanges differ (fields) fail, every one of them, with ErrMismatch: when
// they make them, before anyone writes into another's memory.
func TestExchangeMismatch(t *testing.T) {
	for _, windows := range []bool{true, false} {
		t.Run(fmt.Sprintf("windows=%v", windows), func(t *testing.T) {
			ctx := context.Background()
			errs := world(t, 3, Config{NoWindows: !windows, Timeout: 20e9}, func(c *Comm) error {
				n := 64
				if c.Rank() == 2 {
					n = 128
				}
				x, err := c.NewExchange(ctx, ExchangeConfig{Fields: []int{n}})
				if err == nil {
					x.Close()
				}
				return err
			})
			for r, err := range errs {
				assert.ErrorIs(t, err, ErrMismatch, "rank %d", r)
			}
		})
	}
}

// An exchange allocates nothing in steady state.
func TestExchangeAllocs(t *testing.T) {
	if race.Enabled {
		t.Skip("allocation counts are meaningless under -race (sync.Pool drops items on purpose)")
	}
	for _, windows := range []bool{true, false} {
		cs := newLocal(t, 2, Config{NoWindows: !windows})
		ctx := context.Background()
		xs := make([]*Exchange, 2)
		errs := runOn(cs, func(c *Comm) error {
			var err error
			xs[c.Rank()], err = c.NewExchange(ctx, ExchangeConfig{Fields: []int{256, 4096}})
			return err
		})
		noErr(t, errs)
		step := func(x *Exchange) error {
			o, err := x.Begin(ctx)
			if err != nil {
				return err
			}
			for q := 0; q < 2; q++ {
				if _, err := o.Dest(ctx, q); err != nil {
					return err
				}
				if err := o.Send(q, 16, 1024); err != nil {
					return err
				}
			}
			return o.Wait(ctx)
		}
		other := make(chan struct{})
		done := make(chan error, 1)
		go func() {
			var err error
			for range other {
				if e := step(xs[1]); e != nil && err == nil {
					err = e
				}
			}
			done <- err
		}()
		var first error
		run := func() {
			other <- struct{}{}
			if err := step(xs[0]); err != nil && first == nil {
				first = err
			}
		}
		for i := 0; i < 10; i++ {
			run()
		}
		n := testing.AllocsPerRun(200, run)
		close(other)
		require.NoError(t, <-done)
		require.NoError(t, first)
		assert.Zero(t, n, "allocations per exchange (windows=%v)", windows)
		for _, x := range xs {
			require.NoError(t, x.Close())
		}
	}
}

// An exchange holds, for Slots+1 exchanges, one block per rank at the fields'
// capacities (each field's array 64-byte aligned): received into a window after 64-byte
// control words, one per slot and per (slot, source), rounded up to a page; or into a
// buffer, with a send buffer beside it. ExchangeBytes says so before it is made, nothing
// changes from exchange to exchange, and Close gives it all back.
func TestExchangeBytes(t *testing.T) {
	fields := []int{100, 0, 7 << 10}
	const slots = 2
	for _, windows := range []bool{true, false} {
		for _, p := range testPs {
			t.Run(fmt.Sprintf("windows=%v/P=%d", windows, p), func(t *testing.T) {
				data := 0
				for _, n := range fields {
					data += (p*n + 63) &^ 63
				}
				data *= slots + 1
				var want int
				switch {
				case windows && p > 1:
					want = ((slots+1)*(1+p)*64+4095)&^4095 + data
				case p > 1:
					want = 2 * data
				default: // nothing to send to another rank
					want = data
				}
				assert.Equal(t, want, ExchangeBytes(ExchangeConfig{Fields: fields, Slots: slots}, p, windows), "ExchangeBytes")
				got := make([]int, p)
				noErr(t, world(t, p, Config{NoWindows: !windows}, func(c *Comm) error {
					x, err := c.NewExchange(context.Background(), ExchangeConfig{Fields: fields, Slots: slots})
					if err != nil {
						return err
					}
					before := x.Bytes()
					if err := exchangeRounds(c, x, fields, 2); err != nil {
						return err
					}
					if x.Bytes() != before {
						return fmt.Errorf("rank %d: %d bytes before the exchanges, %d after", c.Rank(), before, x.Bytes())
					}
					got[c.Rank()] = before
					if err := x.Close(); err != nil {
						return err
					}
					if x.Bytes() != 0 {
						return fmt.Errorf("rank %d: %d bytes after Close", c.Rank(), x.Bytes())
					}
					return nil
				}))
				for r, n := range got {
					assert.Equal(t, want, n, "rank %d", r)
				}
			})
		}
	}
}

// An exchange that a rank never joins times out on the others naming that rank (the
// ranks whose blocks never came, or whose buffers never opened), windows and messages
// alike; exchanges that complete leave nobody counted as waited for.
func TestExchangeTimeoutNamesTheRank(t *testing.T) {
	for _, windows := range []bool{true, false} {
		t.Run(fmt.Sprintf("windows=%v", windows), func(t *testing.T) {
			const p, silent = 3, 2
			cs := newLocal(t, p, Config{Timeout: 300 * time.Millisecond, NoWindows: !windows})
			ctx := context.Background()
			xs := make([]*Exchange, p)
			noErr(t, runOn(cs, func(c *Comm) error {
				x, err := c.NewExchange(ctx, ExchangeConfig{Fields: []int{64, 1 << 10}})
				xs[c.Rank()] = x
				if err != nil {
					return err
				}
				return exchangeRounds(c, x, []int{64, 1 << 10}, 2)
			}))
			for _, c := range cs {
				for q := range c.pend {
					require.Zero(t, c.pend[q].Load(), "rank %d counts rank %d as waited for after complete exchanges", c.Rank(), q)
				}
			}
			errs := runOn(cs[:silent], func(c *Comm) error {
				o, err := xs[c.Rank()].Begin(ctx)
				if err != nil {
					return err
				}
				return o.Wait(ctx)
			})
			for r, err := range errs {
				require.ErrorIs(t, err, ErrTimeout, "rank %d", r)
				var te *TimeoutError
				require.ErrorAs(t, err, &te, "rank %d", r)
				assert.Contains(t, te.Waiting, silent, "rank %d: %v", r, err)
				if len(te.Stuck) > 0 { // where this rank's own watchdog asked who is stuck
					assert.Equal(t, []int{silent}, te.Stuck, "rank %d: %v", r, err)
				}
			}
		})
	}
}
