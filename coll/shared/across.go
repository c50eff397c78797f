package shared

import (
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"unsafe"

	"github.com/moex-ai/moex/internal/memx"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
)

// Where AllReduceAcross publishes its recv buffer, for the others to read the combined
// block from: its address, and its offset in obuf's shared arena with arenaTag set (0:
// not in it). One pair of words, not one per parity: the operation that writes them next
// cannot start before every rank has read them for this one.
const (
	areaResult      = 16
	areaResultArena = 24
)

// acrossChunk is how much of a block AllReduceAcross combines at a time: the chunk of
// every rank is read into a buffer that stays in this CPU's caches (twice this, with the
// running sum), so that each byte of the send buffers crosses memory once.
const acrossChunk = 128 << 10

// CanReduceAcross reports whether AllReduceAcross can run: every peer's memory can be
// read across (process_vm_readv).
func (d *Direct) CanReduceAcross() bool { return d.pull }

// AllReduceAcross is AllReduce for buffers of any size, without copying them through the
// areas: a reduce-scatter and an all-gather in place in the ranks' own buffers. Every
// rank publishes the address of send (or its offset in obuf's shared arena); rank q then
// combines block q of every rank's send, in rank order, a chunk at a time read into a
// buffer that stays in the caches, and writes it to block q of recv; it publishes recv,
// and every rank reads the others' combined blocks into its recv. Each byte of a send
// buffer is read from memory once and each of recv written once: the copy floor of a
// reduce-scatter and an all-gather. send may be recv (in place). Every rank returns only
// once the others have read its buffers, so both are the caller's again on return. The
// result is bitwise the same as AllReduce's (same blocks, same order). Requires
// CanReduceAcross.
func (d *Direct) AllReduceAcross(ctx context.Context, turn uint64, send, recv []byte, es int, reduce func(dst, src []byte), sig uint64) (err error) {
	defer func() { d.finish(turn, err) }()
	n := len(send)
	switch {
	case len(recv) != n:
		return &transport.ArgError{Arg: "recv", Reason: fmt.Sprintf("%d bytes for a %d-byte send", len(recv), n)}
	case es <= 0 || n%es != 0:
		return &transport.ArgError{Arg: "send", Reason: fmt.Sprintf("%d bytes is not a whole number of %d-byte elements", n, es)}
	case !d.pull:
		return fmt.Errorf("%w: %d bytes, and no cross-memory attach", ErrTooLarge, n)
	}
	if err := d.awaitTurn(ctx, turn); err != nil {
		return err
	}
	d.a.Count(1, 0, 0, 0, 0)
	d.cur, d.op, d.flag = turn, "allreduce", areaPublished
	if !d.a.Hold() {
		return transport.ErrClosed
	}
	defer d.a.Release()
	// The others read send and recv by address until the last wait below ends.
	defer runtime.KeepAlive(send)
	defer runtime.KeepAlive(recv)
	me := d.rank
	par := 8 * int(turn&1)
	// The copies into recv go past the caches (unless MOEX_SHM_STREAM=0), whatever the
	// footprint: the lines of this rank's block of recv are in the others' caches, which
	// read them last time, and a plain store would fetch each from there first. Measured
	// with MOEX_SHM_STREAM=0|1 moex bench coll --op allreduce --transport shm --shared
	// (2 CPUs, alternating): P=2 4 MiB 530-546 us plain against 252-281 streamed, 2 MiB
	// 342-353 against 199-202; P=4 2 MiB 801-835 against 781-860.
	d.stream = d.a.Stream() >= 0
	atomic.StoreUint64(d.u64(me, areaArena+par), arenaOf(send, d))
	if n > 0 {
		atomic.StoreUint64(d.u64(me, areaWhere+par), uint64(uintptr(unsafe.Pointer(&send[0]))))
	}
	atomic.StoreUint64(d.u64(me, areaSig+par), sig)
	target := d.countIn()
	atomic.StoreUint64(d.u64(me, areaPublished), turn)
	d.wanted = append(d.wanted[:0], d.order...)
	if err := d.wait(ctx, areaArrived, target, func() (bool, error) { return d.arrivals(turn, sig, nil) }); err != nil {
		return err
	}

	// Every send buffer is published: combine this rank's block of them, in rank order.
	b := (n/es + d.size - 1) / d.size * es
	lo, hi := span(me, b, n)
	if err := d.reduceAcross(turn, send, recv[lo:hi], lo, hi, es, reduce); err != nil {
		return err
	}

	// Publish recv, then read the others' combined blocks from theirs.
	if n > 0 {
		atomic.StoreUint64(d.u64(me, areaResult), uint64(uintptr(unsafe.Pointer(&recv[0]))))
	}
	atomic.StoreUint64(d.u64(me, areaResultArena), arenaOf(recv, d))
	d.pulled[me]++
	d.flag = areaCombined
	target = d.countIn()
	atomic.StoreUint64(d.u64(me, areaCombined), turn)
	d.wanted = append(d.wanted[:0], d.order...)
	if err := d.wait(ctx, areaArrived, target, func() (bool, error) {
		return d.arrivals(turn, sig, func(q int) error {
			qlo, qhi := span(q, b, n)
			d.pulled[q]++
			if qhi > qlo {
				if err := d.readResult(q, recv[qlo:qhi], qlo); err != nil {
					return err
				}
			}
			d.bump(q, areaReads, uint32(uint64(d.size-1)*d.pulled[q]))
			return nil
		})
	}); err != nil {
		return err
	}
	// Every rank that read this rank's recv has finished reading its send before it
	// published its own combined block: once all have read recv, both are free.
	want := uint32(uint64(d.size-1) * d.pulled[me])
	reads := d.u32(me, areaReads)
	return d.wait(ctx, areaReads, want, func() (bool, error) { return reached(atomic.LoadUint32(reads), want), nil })
}

// reduceAcross combines block [lo, hi) of every rank's published send buffer (this
// rank's is send) in rank order into out (hi-lo bytes), a chunk at a time.
func (d *Direct) reduceAcross(turn uint64, send, out []byte, lo, hi, es int, reduce func(dst, src []byte)) error {
	if hi <= lo {
		return nil
	}
	if d.acc == nil {
		d.acc = make([]byte, 2*acrossChunk)
	}
	par := 8 * int(turn&1)
	chunk := acrossChunk / es * es
	for clo := lo; clo < hi; clo += chunk {
		chi := min(clo+chunk, hi)
		m := chi - clo
		acc, tmp := d.acc[:m], d.acc[acrossChunk:acrossChunk+m]
		for q := 0; q < d.size; q++ {
			dst := tmp
			if q == 0 {
				dst = acc
			}
			var src []byte
			switch arena := atomic.LoadUint64(d.u64(q, areaArena+par)); {
			case q == d.rank:
				src = send[clo:chi]
			case arena != 0:
				src = d.a.ArenaData(q, arena&^arenaTag+uint64(clo), m)
			}
			if src == nil {
				where := atomic.LoadUint64(d.u64(q, areaWhere+par))
				if err := d.a.ReadAcross(q, dst, where+uint64(clo)); err != nil {
					return d.readErr(q, err)
				}
				d.a.Count(0, 0, 0, 0, uint64(m))
				src = dst
			} else if q != d.rank {
				d.a.Count(0, 0, 0, uint64(m), 0)
			}
			switch {
			case q == 0 && &src[0] != &acc[0]:
				copy(acc, src)
			case q > 0:
				reduce(acc, src)
			}
		}
		if d.stream {
			memx.Stream(out[clo-lo:chi-lo], acc)
		} else {
			memx.Copy(out[clo-lo:chi-lo], acc)
		}
	}
	return nil
}

// ReduceScatterAcross is ReduceScatter for send buffers of any size (P blocks of
// len(recv) bytes), without copying them through the areas: every rank publishes the
// address of send (or its offset in obuf's shared arena), then combines its block of
// every rank's send, in rank order, a chunk at a time read into a buffer that stays in
// the caches, into recv. Each byte of a send buffer is read from memory once, and recv
// written once. Every rank returns only once the others have read its send, so it is
// the caller's again on return. The result is bitwise ReduceScatter's. Requires
// CanReduceAcross.
func (d *Direct) ReduceScatterAcross(ctx context.Context, turn uint64, send, recv []byte, es int, reduce func(dst, src []byte), sig uint64) (err error) {
	defer func() { d.finish(turn, err) }()
	n, b := len(send), len(recv)
	switch {
	case n != d.size*b:
		return &transport.ArgError{Arg: "send", Reason: fmt.Sprintf("%d bytes, want %d ranks x %d (recv)", n, d.size, b)}
	case es <= 0 || b%es != 0:
		return &transport.ArgError{Arg: "recv", Reason: fmt.Sprintf("%d bytes is not a whole number of %d-byte elements", b, es)}
	case !d.pull:
		return fmt.Errorf("%w: %d bytes, and no cross-memory attach", ErrTooLarge, n)
	}
	if err := d.awaitTurn(ctx, turn); err != nil {
		return err
	}
	d.a.Count(1, 0, 0, 0, 0)
	d.cur, d.op, d.flag = turn, "reducescatter", areaPublished
	if !d.a.Hold() {
		return transport.ErrClosed
	}
	defer d.a.Release()
	defer runtime.KeepAlive(send) // the others read it by address until the last wait ends
	me := d.rank
	par := 8 * int(turn&1)
	d.stream = d.a.Stream() >= 0 // see AllReduceAcross
	atomic.StoreUint64(d.u64(me, areaArena+par), arenaOf(send, d))
	if n > 0 {
		atomic.StoreUint64(d.u64(me, areaWhere+par), uint64(uintptr(unsafe.Pointer(&send[0]))))
	}
	atomic.StoreUint64(d.u64(me, areaSig+par), sig)
	d.pulled[me]++
	target := d.countIn()
	atomic.StoreUint64(d.u64(me, areaPublished), turn)
	d.wanted = append(d.wanted[:0], d.order...)
	if err := d.wait(ctx, areaArrived, target, func() (bool, error) { return d.arrivals(turn, sig, nil) }); err != nil {
		return err
	}
	if err := d.reduceAcross(turn, send, recv, me*b, (me+1)*b, es, reduce); err != nil {
		return err
	}
	// This rank is done with the others' buffers: tell each; then wait until every
	// other rank is done with this one's.
	for _, q := range d.order {
		d.pulled[q]++
		d.bump(q, areaReads, uint32(uint64(d.size-1)*d.pulled[q]))
	}
	want := uint32(uint64(d.size-1) * d.pulled[me])
	reads := d.u32(me, areaReads)
	return d.wait(ctx, areaReads, want, func() (bool, error) { return reached(atomic.LoadUint32(reads), want), nil })
}

func (d *Direct) readErr(q int, err error) error {
	return &transport.PeerError{Rank: q, Op: d.op, Err: fmt.Errorf("%w: reading rank %d's buffer: %v", transport.ErrPeerClosed, q, err)}
}

// arenaOf is buf's offset in obuf's shared arena with arenaTag set, for the others to
// read it in place, or 0 when it is not there (or too small to pay).
func arenaOf(buf []byte, d *Direct) uint64 {
	off, ok := obuf.Locate(buf)
	if !ok || len(buf) < SharedMin {
		return 0
	}
	d.a.ShareArena()
	return uint64(off) | arenaTag
}

// readResult copies rank q's combined block, at off of its recv, into dst: in place from
// q's shared arena where this rank maps it, else read across.
func (d *Direct) readResult(q int, dst []byte, off int) error {
	if arena := atomic.LoadUint64(d.u64(q, areaResultArena)); arena != 0 {
		if src := d.a.ArenaData(q, arena&^arenaTag+uint64(off), len(dst)); src != nil {
			if d.stream {
				memx.Stream(dst, src)
			} else {
				memx.Copy(dst, src)
			}
			d.a.Count(0, 0, 0, uint64(len(dst)), 0)
			return nil
		}
	}
	where := atomic.LoadUint64(d.u64(q, areaResult))
	if err := d.a.ReadAcross(q, dst, where+uint64(off)); err != nil {
		return d.readErr(q, err)
	}
	d.a.Count(0, 0, 0, 0, uint64(len(dst)))
	return nil
}
