package shm_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/coll/shared"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The collectives through the shared areas (package coll/shared), run on the areas of
// shm transports (transport.Areas).

// areasOf is the shared-area collectives of one rank, nil where it has no areas.
func areasOf(tr *shm.Transport) *shared.Direct {
	a := tr.Areas()
	if a == nil {
		return nil
	}
	return shared.New(a, tr.Rank(), tr.Size())
}

// directs claims every rank's areas.
func directs(t *testing.T, ts []*shm.Transport) []*shared.Direct {
	t.Helper()
	ds := make([]*shared.Direct, len(ts))
	for r, tr := range ts {
		if ds[r] = areasOf(tr); ds[r] == nil {
			t.Fatalf("rank %d: no areas", r)
		}
		if tr.Areas() != nil {
			t.Fatalf("rank %d: areas claimed twice", r)
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

// reportRanks fails t (without stopping it) with every rank's error.
func reportRanks(t *testing.T, errs []error) {
	t.Helper()
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
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
			reportRanks(t, errs)
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

// vcounts is operation op's count matrix among p ranks: counts[q][r] bytes from q to r,
// zeros included, rows of different lengths (some through a 4 KiB area, some above it).
func vcounts(op, p int) [][]int {
	m := make([][]int, p)
	for q := range m {
		m[q] = make([]int, p)
		for r := range m[q] {
			switch (op + q*3 + r) % 5 {
			case 0:
				m[q][r] = 0
			case 1:
				m[q][r] = 1 + q
			case 2:
				m[q][r] = 700 + 10*r
			case 3:
				m[q][r] = 100 * (q + 1)
			default:
				m[q][r] = 3000 * ((op + q) % 3) // rows of rank q beyond the area every third op
			}
		}
	}
	return m
}

// vlayout is rank r's VLayout for counts (blocks packed in rank order on both sides),
// with its send and receive sizes.
func vlayout(counts [][]int, r int) (lay *shared.VLayout, send, recv int) {
	p := len(counts)
	lay = &shared.VLayout{RecvOff: make([]int, p), RecvLen: make([]int, p), SrcOff: make([]int, p), SrcLen: make([]int, p)}
	for q := 0; q < p; q++ {
		lay.RecvOff[q], lay.RecvLen[q] = recv, counts[q][r]
		recv += counts[q][r]
		for j, n := range counts[q] {
			if j == r {
				lay.SrcOff[q] = lay.SrcLen[q]
			}
			lay.SrcLen[q] += n
		}
	}
	return lay, lay.SrcLen[r], recv
}

// Blocks of every size, zero included, from ranks whose send buffers go through their
// areas and ranks whose buffers are read across, in the same operation: every byte
// arrives where the layout says.
func TestDirectAllToAllv(t *testing.T) {
	for _, cma := range []int{0, -1} {
		t.Run(fmt.Sprintf("cma=%d", cma), func(t *testing.T) {
			const p, ops = 4, 12
			ts := start(t, p, func(cfg *shm.Config) { cfg.AreaBytes = 4096; cfg.CMA = cma })
			ds := directs(t, ts)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			errs := onRanks(p, func(r int) error {
				for op := 0; op < ops; op++ {
					counts := vcounts(op, p)
					if cma != 0 {
						for q := range counts { // without CMA every row must fit the area
							for j := range counts[q] {
								counts[q][j] %= 1000
							}
						}
					}
					lay, ns, nr := vlayout(counts, r)
					send := make([]byte, ns+5) // longer than the layout: only its part is sent
					at := 0
					for j := 0; j < p; j++ {
						fill(send[at:at+counts[r][j]], op, r, j)
						at += counts[r][j]
					}
					recv := make([]byte, nr)
					if err := ds[r].AllToAllv(ctx, ds[r].Turn(), send, recv, lay, uint64(op)); err != nil {
						return fmt.Errorf("op %d: %w", op, err)
					}
					for q := 0; q < p; q++ {
						want := make([]byte, counts[q][r])
						fill(want, op, q, r)
						if got := recv[lay.RecvOff[q]:][:lay.RecvLen[q]]; string(got) != string(want) {
							return fmt.Errorf("op %d: the %d bytes from rank %d are wrong", op, len(want), q)
						}
					}
				}
				return nil
			})
			reportRanks(t, errs)
			if st := ts[0].Stats(); (cma == 0) != (st.CMABytes > 0) {
				t.Fatalf("CMA %d: stats %+v", cma, st)
			}
		})
	}
}

// An AllGather (each rank's block in place in recv, published as its send buffer) whose
// blocks every other rank reads whole: blocks of shared.AcrossBlockMin on obuf's huge
// pages are read across even though they fit the areas; smaller ones, and blocks of a Go
// slice (4 KiB pages, which process_vm_readv pins one at a time), go through them; every
// byte arrives.
func TestDirectAllGatherReadsAcross(t *testing.T) {
	for _, c := range []struct {
		block        int
		huge, across bool
	}{{shared.AcrossBlockMin, true, true}, {shared.AcrossBlockMin, false, false}, {shared.AcrossBlockMin / 4, true, false}} {
		t.Run(fmt.Sprintf("block=%d/huge=%v", c.block, c.huge), func(t *testing.T) {
			const p = 2
			ts := start(t, p, func(cfg *shm.Config) { cfg.AreaBytes = 4 * shared.AcrossBlockMin })
			ds := directs(t, ts)
			require.Greater(t, ds[0].Cap(), c.block, "the block fits the area")
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			before := ts[0].Stats().CMABytes
			errs := onRanks(p, func(r int) error {
				lay := &shared.VLayout{RecvOff: make([]int, p), RecvLen: make([]int, p), SrcOff: make([]int, p), SrcLen: make([]int, p)}
				for q := 0; q < p; q++ {
					lay.RecvOff[q], lay.RecvLen[q], lay.SrcLen[q] = q*c.block, c.block, c.block
				}
				recv := make([]byte, p*c.block)
				if c.huge {
					b := obuf.NewPool(0).Get(p * c.block)
					defer b.Release()
					recv = b.Bytes()
					if !obuf.Huge(recv) && c.block >= obuf.SlabMin {
						return fmt.Errorf("obuf's %d-byte buffer is not on huge pages", len(recv))
					}
				}
				fill(recv[r*c.block:(r+1)*c.block], 1, r, 0)
				if err := ds[r].AllToAllv(ctx, ds[r].Turn(), recv[r*c.block:(r+1)*c.block], recv, lay, 1); err != nil {
					return err
				}
				for q := 0; q < p; q++ {
					want := make([]byte, c.block)
					fill(want, 1, q, 0)
					if !bytes.Equal(recv[q*c.block:(q+1)*c.block], want) {
						return fmt.Errorf("the block of rank %d is wrong", q)
					}
				}
				return nil
			})
			reportRanks(t, errs)
			read := ts[0].Stats().CMABytes - before
			if c.across {
				assert.Equal(t, uint64(c.block), read, "rank 0 read rank 1's block across")
			} else {
				assert.Zero(t, read, "the blocks went through the areas")
			}
		})
	}
}

// Operations issued before the previous ones finished (Turn taken in order, run by
// several goroutines at once) run in turn order.
// mix is a reduction that depends on the order of its operands (x*3 + y on
// little-endian uint32s), so that a result says in which order the ranks were combined.
func mix(dst, src []byte) {
	for i := 0; i+4 <= len(dst); i += 4 {
		x := binary.LittleEndian.Uint32(dst[i:])
		binary.LittleEndian.PutUint32(dst[i:], x*3+binary.LittleEndian.Uint32(src[i:]))
	}
}

// input is rank r's buffer of n bytes (uint32s) for operation op.
func input(op, r, n int) []byte {
	b := make([]byte, n)
	for i := 0; i+4 <= n; i += 4 {
		binary.LittleEndian.PutUint32(b[i:], uint32(op*1000003+r*7919+i*5+1))
	}
	return b
}

// combined is what combining every rank's input for op in rank order gives. Every rank
// checks against it, so it is computed once per (op, p, n) and shared (read only): under
// the race detector, eight ranks each combining eight inputs of megabytes took longer
// than the operations under test.
func combined(op, p, n int) []byte {
	key := [3]int{op, p, n}
	references.Lock()
	defer references.Unlock()
	if acc, ok := references.m[key]; ok {
		return acc
	}
	acc := input(op, 0, n)
	for q := 1; q < p; q++ {
		mix(acc, input(op, q, n))
	}
	if references.m == nil {
		references.m = make(map[[3]int][]byte)
	}
	references.m[key] = acc
	return acc
}

var references struct {
	sync.Mutex
	m map[[3]int][]byte
}

// AllReduce and ReduceScatter through the areas, between AllToAlls (the phases of the
// ones and the others count on the same counters), with buffers of fewer elements than
// ranks, blocks that do not divide evenly, in place and not, the area going round its
// space: every rank gets the combination of every rank's buffer in rank order, bit for
// bit.
func TestDirectReduce(t *testing.T) {
	for _, p := range []int{3, 4} {
		t.Run(fmt.Sprintf("p=%d", p), func(t *testing.T) {
			ts := start(t, p, func(cfg *shm.Config) { cfg.AreaBytes = 4096 })
			ds := directs(t, ts)
			sizes := []int{4, 4 * p, 4096, 40, 4 * (p + 1), 4096, 1000, 4 * (250 / p * p), 8, 4096}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			errs := onRanks(p, func(r int) (err error) {
				defer func() {
					if err != nil {
						cancel() // the others would wait for this rank
					}
				}()
				for op, n := range sizes {
					d := ds[r]
					want := combined(op, p, n)
					switch op % 3 {
					case 0, 1: // AllReduce, in place on even ops
						send, recv := input(op, r, n), make([]byte, n)
						if op%2 == 0 {
							recv = send
						}
						if err := d.AllReduce(ctx, d.Turn(), send, recv, 4, mix, uint64(n)); err != nil {
							return fmt.Errorf("op %d: AllReduce of %d bytes: %w", op, n, err)
						}
						if !bytes.Equal(recv, want) {
							return fmt.Errorf("op %d: AllReduce of %d bytes: wrong result", op, n)
						}
					case 2:
						b := n / p &^ 3
						send, recv := input(op, r, b*p), make([]byte, b)
						want = combined(op, p, b*p)[r*b : (r+1)*b]
						if err := d.ReduceScatter(ctx, d.Turn(), send, recv, mix, uint64(n)); err != nil {
							return fmt.Errorf("op %d: ReduceScatter of %d bytes: %w", op, b*p, err)
						}
						if !bytes.Equal(recv, want) {
							return fmt.Errorf("op %d: ReduceScatter of %d bytes: wrong block", op, b*p)
						}
					}
					// An AllToAll between every reduction.
					m := 64 * p
					recv := make([]byte, m)
					if err := d.AllToAll(ctx, d.Turn(), sendFor(op, r, p, m), recv, 7); err != nil {
						return fmt.Errorf("op %d: AllToAll: %w", op, err)
					}
					if err := checkRecv(recv, op, r, p); err != nil {
						return err
					}
				}
				return nil
			})
			reportRanks(t, errs)
		})
	}
}

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
	// An AllReduce against AllToAlls, and the reverse.
	for bad := 0; bad < 2; bad++ {
		ds := directs(t, start(t, p, nil))
		errs := onRanks(p, func(r int) error {
			n := 64 * p
			if (r == 1) == (bad == 0) {
				return ds[r].AllReduce(ctx, ds[r].Turn(), make([]byte, n), make([]byte, n), 4, mix, 1)
			}
			return ds[r].AllToAll(ctx, ds[r].Turn(), make([]byte, n), make([]byte, n), 2)
		})
		for r, err := range errs {
			if !errors.Is(err, transport.ErrMismatch) {
				t.Fatalf("AllReduce against AllToAll, rank %d: got %v, want ErrMismatch", r, err)
			}
		}
	}
	err := ds[0].AllToAll(ctx, ds[0].Turn(), make([]byte, 3), make([]byte, 3), 3)
	if !errors.Is(err, shared.ErrBroken) {
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
	ts3 := start(t, p, nil)
	d3 := directs(t, ts3)
	ts3[1].Close()
	err = d3[0].AllReduce(ctx, d3[0].Turn(), make([]byte, 12), make([]byte, 12), 4, mix, 3)
	if !errors.Is(err, transport.ErrPeerClosed) || !errors.As(err, &pe) || pe.Rank != 1 {
		t.Fatalf("AllReduce: got %v, want a PeerError naming rank 1", err)
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
	if err := ds[0].AllToAll(ctx, ds[0].Turn(), make([]byte, 2048), make([]byte, 2048), 0); !errors.Is(err, shared.ErrTooLarge) {
		t.Fatalf("2 KiB through a 1 KiB area without CMA: %v", err)
	}
	lay, _, _ := vlayout([][]int{{10, 20}, {30, 2000}}, 0)
	for _, c := range []struct {
		what       string
		send, recv int
		edit       func(l *shared.VLayout)
		want       error
	}{
		{"short lists", 30, 40, func(l *shared.VLayout) { l.SrcOff = l.SrcOff[:1] }, nil},
		{"recv too small", 30, 39, nil, nil},
		{"send too small", 29, 40, nil, nil},
		{"block past its send buffer", 30, 40, func(l *shared.VLayout) { l.SrcOff[1] = 2010 }, nil},
		{"negative offset", 30, 40, func(l *shared.VLayout) { l.RecvOff[0] = -1 }, nil},
		{"row beyond the area", 30, 40, nil, shared.ErrTooLarge},
	} {
		l := *lay
		l.RecvOff, l.RecvLen, l.SrcOff, l.SrcLen = slices.Clone(l.RecvOff), slices.Clone(l.RecvLen), slices.Clone(l.SrcOff), slices.Clone(l.SrcLen)
		if c.edit != nil {
			c.edit(&l)
		}
		if c.want == nil {
			l.SrcLen[1] = 30 // fits the area: only the edit is wrong
		}
		d := directs(t, start(t, 2, func(c *shm.Config) { c.AreaBytes = 1024; c.CMA = -1 }))[0] // an error ends a Direct
		err := d.AllToAllv(ctx, d.Turn(), make([]byte, c.send), make([]byte, c.recv), &l, 0)
		if c.want != nil && !errors.Is(err, c.want) || c.want == nil && !errors.As(err, &ae) {
			t.Fatalf("AllToAllv, %s: %v", c.what, err)
		}
	}
	for _, c := range []struct {
		what           string
		rs             bool
		send, recv, es int
		want           error
	}{
		{"AllReduce, recv shorter", false, 64, 60, 4, nil},
		{"AllReduce, part of an element", false, 62, 62, 4, nil},
		{"AllReduce, no element size", false, 64, 64, 0, nil},
		{"AllReduce beyond the area", false, 2048, 2048, 4, shared.ErrTooLarge},
		{"ReduceScatter, recv not a block", true, 64, 30, 4, nil},
		{"ReduceScatter beyond the area", true, 2048, 1024, 4, shared.ErrTooLarge},
	} {
		d := directs(t, start(t, 2, func(c *shm.Config) { c.AreaBytes = 1024 }))[0]
		var err error
		if c.rs {
			err = d.ReduceScatter(ctx, d.Turn(), make([]byte, c.send), make([]byte, c.recv), mix, 0)
		} else {
			err = d.AllReduce(ctx, d.Turn(), make([]byte, c.send), make([]byte, c.recv), c.es, mix, 0)
		}
		if c.want != nil && !errors.Is(err, c.want) || c.want == nil && !errors.As(err, &ae) {
			t.Fatalf("%s: %v", c.what, err)
		}
	}
	ts2 := start(t, 2, func(c *shm.Config) { c.AreaBytes = -1 })
	if ts2[0].Areas() != nil {
		t.Fatal("areas with the area disabled")
	}
}

// BenchmarkDirectAllToAll: ranks as goroutines of one process, with send buffers from
// the heap (through the area or read across) and from obuf.Shared (read in place).
func BenchmarkDirectAllToAll(b *testing.B) {
	for _, p := range []int{2, 4} {
		for _, n := range []int{64 << 10, 4 << 20} {
			for _, inArena := range []bool{false, true} {
				b.Run(fmt.Sprintf("p=%d/%dKiB/shared=%v", p, n>>10, inArena), func(b *testing.B) {
					ts := start(b, p, nil)
					ds := make([]*shared.Direct, p)
					for r := range ts {
						ds[r] = areasOf(ts[r])
					}
					ctx := context.Background()
					b.SetBytes(int64(n))
					b.ResetTimer()
					errs := onRanks(p, func(r int) error {
						send, recv := make([]byte, n), make([]byte, n)
						if inArena {
							sb := obuf.Shared.Get(n)
							defer sb.Release()
							send = sb.Bytes()
						}
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
}

// AllReduceAcross combines buffers of any size in place in the ranks' own buffers: on
// 2 to 8 ranks, with fewer elements than ranks, blocks that do not divide evenly and
// blocks of several chunks, from private buffers (read across) and from obuf.Shared's
// (read in place), in place and not, between AllToAlls through the areas: every rank
// gets the combination of every rank's buffer in rank order, bit for bit, and its send
// buffer is left as it was.
func TestDirectAllReduceAcross(t *testing.T) {
	for _, p := range []int{2, 3, 5, 8} {
		t.Run(fmt.Sprintf("p=%d", p), func(t *testing.T) {
			ts := start(t, p, func(cfg *shm.Config) { cfg.AreaBytes = 4096 })
			ds := directs(t, ts)
			require.True(t, ds[0].CanReduceAcross(), "cross-memory attach works between goroutines of one process")
			sizes := []int{4, 4 * (p - 1), 4*p*1000 + 12, 4096 + 4, 3*128<<10*p + 4*p + 4, 40}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			errs := onRanks(p, func(r int) (err error) {
				defer func() {
					if err != nil {
						cancel() // the others would wait for this rank
					}
				}()
				d := ds[r]
				for op, n := range sizes {
					for _, arena := range []bool{false, true} {
						for _, inPlace := range []bool{false, true} {
							if err := func() error {
								what := fmt.Sprintf("op %d, %d bytes, shared %v, in place %v", op, n, arena, inPlace)
								in := input(op, r, n)
								send, recv := slices.Clone(in), make([]byte, n)
								if arena {
									sb, rb := obuf.Shared.Get(n), obuf.Shared.Get(n)
									defer sb.Release()
									defer rb.Release()
									send, recv = sb.Bytes(), rb.Bytes()
									copy(send, in)
								}
								if inPlace {
									recv = send
								}
								if err := d.AllReduceAcross(ctx, d.Turn(), send, recv, 4, mix, uint64(n)); err != nil {
									return fmt.Errorf("%s: %w", what, err)
								}
								if !bytes.Equal(recv, combined(op, p, n)) {
									return fmt.Errorf("%s: wrong result", what)
								}
								if !inPlace && !bytes.Equal(send, in) {
									return fmt.Errorf("%s: send buffer changed", what)
								}
								return nil
							}(); err != nil {
								return err
							}
						}
					}
					m := 64 * p
					recv := make([]byte, m)
					if err := d.AllToAll(ctx, d.Turn(), sendFor(op, r, p, m), recv, 7); err != nil {
						return fmt.Errorf("op %d: AllToAll: %w", op, err)
					}
					if err := checkRecv(recv, op, r, p); err != nil {
						return err
					}
				}
				return nil
			})
			for r, err := range errs {
				assert.NoError(t, err, "rank %d", r)
			}
		})
	}
}

// ReduceScatterAcross combines send buffers of any size (P blocks each) in place in the
// ranks' own buffers: on 2 to 8 ranks, blocks of one element, blocks of several chunks,
// from private buffers (read across) and from obuf.Shared's (read in place), between
// AllToAlls through the areas and AllReduceAcrosses (all count on the same counters):
// every rank gets its block of the combination of every rank's buffer in rank order, bit
// for bit, and its send buffer is left as it was.
func TestDirectReduceScatterAcross(t *testing.T) {
	for _, p := range []int{2, 3, 5, 8} {
		t.Run(fmt.Sprintf("p=%d", p), func(t *testing.T) {
			ds := directs(t, start(t, p, func(cfg *shm.Config) { cfg.AreaBytes = 4096 }))
			blocks := []int{4, 4096 + 4, 3*128<<10 + 8, 40}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			errs := onRanks(p, func(r int) (err error) {
				defer func() {
					if err != nil {
						cancel() // the others would wait for this rank
					}
				}()
				d := ds[r]
				for op, b := range blocks {
					n := b * p
					for _, arena := range []bool{false, true} {
						if err := func() error {
							what := fmt.Sprintf("op %d, blocks of %d bytes, shared %v", op, b, arena)
							in := input(op, r, n)
							send, recv := slices.Clone(in), make([]byte, b)
							if arena {
								sb := obuf.Shared.Get(n)
								defer sb.Release()
								send = sb.Bytes()
								copy(send, in)
							}
							if err := d.ReduceScatterAcross(ctx, d.Turn(), send, recv, 4, mix, uint64(n)); err != nil {
								return fmt.Errorf("%s: %w", what, err)
							}
							if !bytes.Equal(recv, combined(op, p, n)[r*b:(r+1)*b]) {
								return fmt.Errorf("%s: wrong result", what)
							}
							if !bytes.Equal(send, in) {
								return fmt.Errorf("%s: send buffer changed", what)
							}
							return nil
						}(); err != nil {
							return err
						}
					}
					full := make([]byte, n)
					if err := d.AllReduceAcross(ctx, d.Turn(), input(op, r, n), full, 4, mix, uint64(n)); err != nil {
						return fmt.Errorf("op %d: AllReduceAcross: %w", op, err)
					}
					if !bytes.Equal(full, combined(op, p, n)) {
						return fmt.Errorf("op %d: AllReduceAcross: wrong result", op)
					}
					m := 64 * p
					recv := make([]byte, m)
					if err := d.AllToAll(ctx, d.Turn(), sendFor(op, r, p, m), recv, 7); err != nil {
						return fmt.Errorf("op %d: AllToAll: %w", op, err)
					}
					if err := checkRecv(recv, op, r, p); err != nil {
						return err
					}
				}
				return nil
			})
			for r, err := range errs {
				assert.NoError(t, err, "rank %d", r)
			}
		})
	}
}

// Ranks whose AllReduceAcross differ (in size) all get ErrMismatch; a rank that closes
// instead of taking part is named in a PeerError; buffers of unequal sizes (for
// ReduceScatterAcross too) are refused with an ArgError before anything is published.
func TestDirectAllReduceAcrossErrors(t *testing.T) {
	const p, n = 3, 64 << 10
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ds := directs(t, start(t, p, nil))
	errs := onRanks(p, func(r int) error {
		m := n
		if r == 2 {
			m = 2 * n
		}
		return ds[r].AllReduceAcross(ctx, ds[r].Turn(), make([]byte, m), make([]byte, m), 4, mix, uint64(m))
	})
	for r, err := range errs {
		require.ErrorIs(t, err, transport.ErrMismatch, "rank %d", r)
	}

	ts := start(t, p, nil)
	ds = directs(t, ts)
	ts[1].Close()
	err := ds[0].AllReduceAcross(ctx, ds[0].Turn(), make([]byte, n), make([]byte, n), 4, mix, n)
	var pe *transport.PeerError
	require.ErrorIs(t, err, transport.ErrPeerClosed)
	require.ErrorAs(t, err, &pe)
	assert.Equal(t, 1, pe.Rank)

	ds = directs(t, start(t, 2, nil))
	var ae *transport.ArgError
	err = ds[0].AllReduceAcross(ctx, ds[0].Turn(), make([]byte, n), make([]byte, n/2), 4, mix, n)
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, "recv", ae.Arg)
	err = ds[1].AllReduceAcross(ctx, ds[1].Turn(), make([]byte, 6), make([]byte, 6), 4, mix, 6)
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, "send", ae.Arg)
	err = ds[0].ReduceScatterAcross(ctx, ds[0].Turn(), make([]byte, n), make([]byte, n), 4, mix, n)
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, "send", ae.Arg, "a send of one block for two ranks")
	err = ds[1].ReduceScatterAcross(ctx, ds[1].Turn(), make([]byte, 12), make([]byte, 6), 4, mix, 12)
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, "recv", ae.Arg, "blocks of a partial element")
}

// BenchmarkDirectAllReduceAcross: the reduce-scatter and all-gather in place in the
// ranks' buffers, from the heap (read across) and from obuf.Shared (read in place), f32
// sums; ranks as goroutines of one process.
func BenchmarkDirectAllReduceAcross(b *testing.B) {
	sum := func(dst, src []byte) { dtype.Reduce(dtype.F32, dtype.Sum, dst, src) }
	for _, p := range []int{2, 4} {
		for _, n := range []int{4 << 20} {
			for _, inArena := range []bool{false, true} {
				b.Run(fmt.Sprintf("p=%d/%dKiB/shared=%v", p, n>>10, inArena), func(b *testing.B) {
					ts := start(b, p, nil)
					ds := make([]*shared.Direct, p)
					for r := range ts {
						ds[r] = areasOf(ts[r])
					}
					ctx := context.Background()
					b.SetBytes(int64(n))
					b.ResetTimer()
					errs := onRanks(p, func(r int) error {
						send, recv := make([]byte, n), make([]byte, n)
						if inArena {
							sb, rb := obuf.Shared.Get(n), obuf.Shared.Get(n)
							defer sb.Release()
							defer rb.Release()
							send, recv = sb.Bytes(), rb.Bytes()
						}
						for i := 0; i < b.N; i++ {
							if err := ds[r].AllReduceAcross(ctx, ds[r].Turn(), send, recv, 4, sum, 1); err != nil {
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
}
