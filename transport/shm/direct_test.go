package shm_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/shm"
)

// directs claims every rank's Direct.
func directs(t *testing.T, ts []*shm.Transport) []*shm.Direct {
	t.Helper()
	ds := make([]*shm.Direct, len(ts))
	for r, tr := range ts {
		if ds[r] = tr.Direct(); ds[r] == nil {
			t.Fatalf("rank %d: no Direct", r)
		}
		if tr.Direct() != nil {
			t.Fatalf("rank %d: Direct claimed twice", r)
		}
	}
	return ds
}

// fill fills block q of rank r's send buffer for operation op.
func fill(b []byte, op, r, q int) {
	for i := range b {
		b[i] = byte(op*31 + r*7 + q*13 + i*3)
	}
}

// onRanks runs f for every rank at once, each in a goroutine, and returns their errors.
func onRanks(p int, f func(r int) error) []error {
	errs := make([]error, p)
	var wg sync.WaitGroup
	for r := 0; r < p; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = f(r)
		}()
	}
	wg.Wait()
	return errs
}

// sendFor is rank r's send buffer of n bytes for operation op among p ranks.
func sendFor(op, r, p, n int) []byte {
	send, b := make([]byte, n), n/p
	for q := 0; q < p; q++ {
		fill(send[q*b:(q+1)*b], op, r, q)
	}
	return send
}

// checkRecv says which block of rank r's receive buffer for operation op is wrong.
func checkRecv(recv []byte, op, r, p int) error {
	b := len(recv) / p
	want := make([]byte, b)
	for q := 0; q < p; q++ {
		fill(want, op, q, r)
		if string(recv[q*b:(q+1)*b]) != string(want) {
			got := recv[q*b : (q+1)*b]
			i := 0
			for got[i] == want[i] {
				i++
			}
			guess := -1
			for o := 0; o < 20; o++ {
				fill(want, o, q, r)
				if got[i] == want[i] && got[i+1] == want[i+1] && got[i+7] == want[i+7] {
					guess = o
				}
			}
			return fmt.Errorf("rank %d, op %d (%d bytes): block from rank %d wrong from byte %d of %d (got %d; looks like op %d)", r, op, len(recv), q, i, b, got[i], guess)
		}
	}
	return nil
}

// Every rank sends a distinct block to every rank, through the area (buffers up to
// AreaBytes) and read across (larger), in turns that switch between the two, with
// operations of the same ranks and sizes back to back, the area going round its space
// (and, with rewinding, alternating halves): every byte arrives where it belongs, and the
// counters say what happened.
func TestDirectAllToAll(t *testing.T) {
	for _, c := range []struct{ cma, rewind int }{{0, -1}, {-1, -1}, {0, 1}} {
		cma := c.cma
		t.Run(fmt.Sprintf("cma=%d,rewind=%d", c.cma, c.rewind), func(t *testing.T) {
			const p = 4
			ts := start(t, p, func(cfg *shm.Config) { cfg.AreaBytes = 4096; cfg.CMA = cma; cfg.Rewind = c.rewind })
			ds := directs(t, ts)
			if ds[0].Cap() != 4096 {
				t.Fatalf("Cap %d, want 4096", ds[0].Cap())
			}
			pull := cma == 0 // cross-memory attach works here unless disabled
			if ds[0].Fits(1<<20) != pull {
				t.Fatalf("Fits(1 MiB) = %v with CMA %d", ds[0].Fits(1<<20), cma)
			}
			sizes := []int{0, p, 4096, 4096 + 4*p, 1 << 20, 64, 1 << 20, 1 << 20, 4000, 4000, 4096, 4096, 3000, 2000, 4096, 100}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			errs := onRanks(p, func(r int) error {
				for op, n := range sizes {
					if n > ds[r].Cap() && !pull {
						continue
					}
					recv := make([]byte, n)
					if err := ds[r].AllToAll(ctx, ds[r].Turn(), sendFor(op, r, p, n), recv, uint64(n)); err != nil {
						return fmt.Errorf("op %d (%d bytes): %w", op, n, err)
					}
					if err := checkRecv(recv, op, r, p); err != nil {
						return err
					}
				}
				return nil
			})
			for r, err := range errs {
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
			if t.Failed() {
				t.FailNow()
			}
			st := ts[0].Stats()
			if st.DirectOps == 0 || (pull && st.CMABytes == 0) || (!pull && st.CMABytes != 0) {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

// Operations issued before the previous ones finished (Turn taken in order, run by
// several goroutines at once) run in turn order.
func TestDirectTurns(t *testing.T) {
	const p, ops = 3, 8
	ts := start(t, p, nil)
	ds := directs(t, ts)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, p*ops)
	for r := 0; r < p; r++ {
		for op := 0; op < ops; op++ {
			turn := ds[r].Turn()
			n := (op + 1) * 64 * p
			send, recv := sendFor(op, r, p, n), make([]byte, n)
			wg.Add(1)
			go func() {
				defer wg.Done()
				err := ds[r].AllToAll(ctx, turn, send, recv, uint64(n))
				if err == nil {
					err = checkRecv(recv, op, r, p)
				}
				if err != nil {
					errs <- err
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// Ranks that run different operations in the same turn get ErrMismatch naming a peer,
// and every operation after that fails at once.
func TestDirectMismatch(t *testing.T) {
	const p = 3
	ts := start(t, p, nil)
	ds := directs(t, ts)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errs := onRanks(p, func(r int) error {
		n := 64 * p
		if r == 2 {
			n = 128 * p
		}
		return ds[r].AllToAll(ctx, ds[r].Turn(), make([]byte, n), make([]byte, n), uint64(n))
	})
	for r, err := range errs {
		var pe *transport.PeerError
		if !errors.Is(err, transport.ErrMismatch) || !errors.As(err, &pe) {
			t.Fatalf("rank %d: got %v, want a PeerError wrapping ErrMismatch", r, err)
		}
		if (r == 2) == (pe.Rank == 2) {
			t.Fatalf("rank %d blames rank %d", r, pe.Rank)
		}
	}
	err := ds[0].AllToAll(ctx, ds[0].Turn(), make([]byte, 3), make([]byte, 3), 3)
	if !errors.Is(err, shm.ErrBroken) {
		t.Fatalf("after a failed operation: %v, want ErrBroken", err)
	}
}

// A rank that closes instead of taking part is reported, naming it, and a rank whose
// context ends stops waiting: nothing hangs.
func TestDirectPeerGone(t *testing.T) {
	const p = 3
	ts := start(t, p, nil)
	ds := directs(t, ts)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ts[2].Close()
	t0 := time.Now()
	err := ds[0].AllToAll(ctx, ds[0].Turn(), make([]byte, 3), make([]byte, 3), 3)
	var pe *transport.PeerError
	if !errors.Is(err, transport.ErrPeerClosed) || !errors.As(err, &pe) || pe.Rank != 2 {
		t.Fatalf("got %v, want a PeerError naming rank 2", err)
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Fatalf("took %v", d)
	}
	short, cancel2 := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel2()
	// Rank 1 waits for rank 0, which never comes (rank 2's closure is seen only among
	// the peers still missing: rank 1 finds it too, or its context ends).
	err = ds[1].AllToAll(short, ds[1].Turn(), make([]byte, 3), make([]byte, 3), 3)
	if err == nil {
		t.Fatal("rank 1 finished an AllToAll that rank 0 and 2 did not take part in")
	}
}

// Buffers that cannot be exchanged are refused with an ArgError or ErrTooLarge.
func TestDirectBadArgs(t *testing.T) {
	ts := start(t, 2, func(c *shm.Config) { c.AreaBytes = 1024; c.CMA = -1 })
	ds := directs(t, ts)
	ctx := context.Background()
	var ae *transport.ArgError
	if err := ds[0].AllToAll(ctx, ds[0].Turn(), make([]byte, 3), make([]byte, 3), 0); !errors.As(err, &ae) {
		t.Fatalf("3 bytes over 2 ranks: %v", err)
	}
	ds = directs(t, start(t, 2, func(c *shm.Config) { c.AreaBytes = 1024; c.CMA = -1 }))
	if err := ds[0].AllToAll(ctx, ds[0].Turn(), make([]byte, 2048), make([]byte, 2048), 0); !errors.Is(err, shm.ErrTooLarge) {
		t.Fatalf("2 KiB through a 1 KiB area without CMA: %v", err)
	}
	ts2 := start(t, 2, func(c *shm.Config) { c.AreaBytes = -1 })
	if ts2[0].Direct() != nil {
		t.Fatal("Direct with the area disabled")
	}
}

// BenchmarkDirectAllToAll: ranks as goroutines of one process, each with its own
// transport, exchanging through the shared areas (64 KiB per rank: through the area; 4 MiB:
// read across).
func BenchmarkDirectAllToAll(b *testing.B) {
	for _, p := range []int{2, 4} {
		for _, n := range []int{64 << 10, 4 << 20} {
			b.Run(fmt.Sprintf("p=%d/%dKiB", p, n>>10), func(b *testing.B) {
				ts := start(b, p, nil)
				ds := make([]*shm.Direct, p)
				for r := range ts {
					ds[r] = ts[r].Direct()
				}
				ctx := context.Background()
				b.SetBytes(int64(n))
				b.ResetTimer()
				errs := onRanks(p, func(r int) error {
					send, recv := make([]byte, n), make([]byte, n)
					for i := 0; i < b.N; i++ {
						if err := ds[r].AllToAll(ctx, ds[r].Turn(), send, recv, 1); err != nil {
							return err
						}
					}
					return nil
				})
				for _, err := range errs {
					if err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
