package shared

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/coll/algos"
	"github.com/moex-ai/moex/internal/memx"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
)

// The shared areas (transport.Areas): every rank's, mapped by every rank, for collectives
// of the whole job that move their blocks through shared memory instead of through the
// transport's messages. Layout, from an area's start:
//
//	0    published (u64): operations this rank has published
//	8    combined (u64): reductions whose block this rank has combined (AllReduce)
//	16   AllReduceAcross's recv buffer: its address (u64), and at 24 its offset in this
//	     process's shared arena with arenaTag set, or 0 (u64)
//	64   arrived (u32 futex word): publications of the other ranks (P-1 per phase:
//	     one per operation, two for an AllReduce)
//	128  reads (u32 futex word): blocks the other ranks read from this rank's send
//	     buffers (P-1 per operation read across)
//	192  sleeping (u32): the owner is (about to be) parked on arrived or reads
//	200  signature for even operations (u64), for odd ones (u64)
//	216  where the data of even operations is (u64), of odd ones (u64): an offset in
//	     the data space for operations through it, the send buffer's address for those
//	     read across
//	232  for send buffers in this process's shared arena (obuf.NewSharedPool), their
//	     offset in it with arenaTag set, for even operations (u64), for odd ones (u64);
//	     0 for the others
//	256  the data space (transport.AreaHeader): 3 x Cap bytes
//
// An operation through the area copies its send buffer (at most areaCap bytes) into the
// data space, anywhere but where the previous operation's is: other ranks may still be
// reading that one. Every rank that reads this rank's operation n has finished n-1 (it
// published n), so older data is free. With ranks outnumbering CPUs, operations alternate
// between the two halves of the space, which stay warm in the caches the ranks share;
// with a CPU per rank they go round the whole space, like the rings, so that a rank
// rarely writes lines that another CPU still holds (writing them costs a round trip to
// that CPU per line: copying into a 64 KiB buffer that the peer had just read ran at 7
// GB/s, against 40 for the copy out). The counters only grow, so after operation n every
// rank has arrived = (P-1)n: the rank whose increment completes a count wakes the owner,
// which therefore sleeps at most once per wait, however many ranks it waits for.
const (
	areaPublished = 0
	areaCombined  = 8
	areaArrived   = 64
	areaReads     = 128
	areaSleeping  = 192
	areaSig       = 200
	areaWhere     = 216
	areaArena     = 232

	// arenaTag marks an offset in areaArena (an offset of 0 is a valid one); acrossTag,
	// there alone, a send buffer the others read across at its address (areaWhere).
	arenaTag  = 1 << 63
	acrossTag = 1 << 62

	// SharedMin is the smallest send buffer from obuf's shared arena that the others read
	// in place (shm.SharedMin says how it was measured).
	SharedMin = 16 << 10

	// AcrossMin: an AlltoAll(v) whose send buffer is larger, and on huge pages
	// (obuf.Huge), is read across (one copy, process_vm_readv) even where it fits the
	// area (two copies). Measured (moex bench coll --op alltoall --transport shm, p50,
	// us, area against across): P=2 (a CPU per rank) 256 KiB 11.7/10.1, 512 KiB
	// 21.2/16.0, 1 MiB 44.9/32.8; P=4 (2 CPUs) 256 KiB 97.5/85.4 (means 71/90), 1 MiB
	// 351/152; P=8 512 KiB 437/397, 1 MiB 770/567.
	AcrossMin = 512 << 10

	// AcrossBlockMin: a send buffer of which each other rank reads about this much or
	// more (an AllGather's whole buffer; an AllToAll's n/P, so 512 KiB at P=2, which
	// AcrossMin leaves out) is read across too, where the ranks are at most twice the
	// CPUs. Measured (moex bench coll --op allgather --transport shm, p50, us,
	// area against across, three runs): P=2 1 MiB (512 KiB blocks) 99/69, 91/124,
	// 107/79; P=4 1 MiB (256 KiB) 373/306, 349/379, 422/374; P=4 256 KiB (64 KiB)
	// 127/166; P=8 on 2 CPUs 4 MiB (512 KiB) 3925/4178, 3929/4097, 3966/4119.
	AcrossBlockMin = 256 << 10
)

// Direct runs collectives of the whole job through the shared areas of the ranks'
// segments: each rank publishes its send buffer with one counter, copied into its own
// area (up to Cap bytes) or, when larger, by address for the others to read across with
// process_vm_readv; a send buffer from obuf's shared arena (obuf.Shared, from SharedMin
// bytes) by its offset there, for the others to read in place; every rank then takes its
// blocks from the others straight away.
// An AlltoAll of P ranks thus costs each rank one store and P-1 loads of a counter where
// the rings take P-1 messages each way with their notifications (and, for large ones, an
// announcement and a reply per message), and a rank that waits sleeps about once per
// operation, not once per message: with more ranks than CPUs, where every wake-up is a
// context switch, that is most of the cost of a small AlltoAll.
//
// Operations run one at a time, in the order their turns were taken (Turn), and every
// rank must run the same operations in the same order: they are collective.
type Direct struct {
	a      transport.Areas
	size   int
	rank   int
	cap    int
	pull   bool          // larger buffers are read across (cross-memory attach works)
	blocks bool          // and buffers read in blocks of AcrossBlockMin (ranks <= 2 x CPUs)
	cpus   int           // the CPUs this process may run on
	pulled []uint64      // per rank: its operations so far that were read across
	end    int           // where the data of the last operation through the area ends
	cur    uint64        // the turn running
	phases uint64        // phases so far: each adds P-1 to every rank's arrived count
	flag   int           // the header word the running phase waits on (areaPublished, areaCombined)
	op     string        // its name, for errors
	procs  bool          // waiters yield to the kernel only (the peers are other processes)
	next   atomic.Uint64 // turns handed out
	done   atomic.Uint64 // operations finished
	broken atomic.Bool   // an operation failed: the order is lost, the rest fail too
	order  []int         // the peers, from this rank's successor on
	wanted []int         // scratch: peers not read yet
	llc    int           // the host's last-level cache, bytes (0: unknown)
	stream bool          // the running operation's blocks read in place go past the caches
	acc    []byte        // AllReduceAcross's running sum and the chunk read (2 x acrossChunk)
	// What a wait waits for now, for Waiting (another goroutine): the turn (0: none)
	// and the header word of the phase.
	waitTurn atomic.Uint64
	waitFlag atomic.Int64
	// This rank's words that Wake wakes, taken once: Wake may come after the transport
	// was closed, when the futex call fails harmlessly but the area may not be looked at.
	arrived, reads *uint32
	in             copyIn // plain or streaming stores into this rank's area
}

// New returns the shared-area collectives over a (every rank of the communicator, in the
// order of the transport's ranks).
func New(a transport.Areas, rank, size int) *Direct {
	d := &Direct{a: a, rank: rank, size: size, cap: a.Cap(), pull: a.CanReadAcross(), procs: a.Processes(), cpus: runtime.NumCPU()}
	d.blocks = size <= 2*d.cpus
	for i := 1; i < size; i++ {
		d.order = append(d.order, (rank+i)%size)
	}
	d.wanted = make([]int, 0, size)
	d.llc = memx.LastLevelCache()
	d.pulled = make([]uint64, size)
	d.arrived, d.reads = d.u32(rank, areaArrived), d.u32(rank, areaReads)
	return d
}

// Cap is the largest send buffer an operation copies through the areas (the smallest
// area of all ranks).
func (d *Direct) Cap() int { return d.cap }

// Fits reports whether an operation on send buffers of n bytes can run: through the
// areas, or read across.
func (d *Direct) Fits(n int) bool { return n <= d.cap || d.pull }

// Turn reserves the next operation's place in the order: call it when the operation is
// issued, in issue order, and pass the turn to the operation.
func (d *Direct) Turn() uint64 { return d.next.Add(1) }

// Wake interrupts a waiting operation so that it looks at its context again (a
// communicator calls it when it aborts).
func (d *Direct) Wake() {
	d.a.Wake(d.arrived)
	d.a.Wake(d.reads)
}

// u64 and u32 are the header words of rank q's area at off; data is n bytes of its data
// space from off, or nil if that is not inside it.
func (d *Direct) u64(q, off int) *uint64 { return (*uint64)(unsafe.Pointer(&d.a.Area(q)[off])) }
func (d *Direct) u32(q, off int) *uint32 { return (*uint32)(unsafe.Pointer(&d.a.Area(q)[off])) }

func (d *Direct) data(q int, off uint64, n int) []byte {
	area := d.a.Area(q)
	space := uint64(len(area) - transport.AreaHeader)
	if off > space || uint64(n) > space-off {
		return nil
	}
	o := transport.AreaHeader + int(off)
	return area[o : o+n : o+n]
}

// ErrTooLarge is returned for an operation that Fits refuses.
var ErrTooLarge = errors.New("coll: buffer larger than the shared area, and cross-memory attach refused")

// AllToAll exchanges blocks: send and recv hold one equal block per rank, in rank order;
// block q of send goes to rank q, and block q of recv comes from rank q. sig identifies
// the operation (kind, sizes): a rank that finds another rank published a different sig
// for the same turn returns a transport.PeerError wrapping transport.ErrMismatch, naming
// it. send and recv must not overlap. ctx ends the wait (with ctx's error); a peer that
// dies or closes is reported as a PeerError naming it (the transport's liveness checks
// also abort the communicator, through ctx).
func (d *Direct) AllToAll(ctx context.Context, turn uint64, send, recv []byte, sig uint64) (err error) {
	defer func() { d.finish(turn, err) }()
	p := d.size
	n := len(send)
	if len(recv) != n || n%p != 0 {
		return &transport.ArgError{Arg: "recv", Reason: fmt.Sprintf("send %d bytes, recv %d: want equal lengths, a multiple of %d ranks", n, len(recv), p)}
	}
	if !d.Fits(n) {
		return fmt.Errorf("%w: %d bytes, the area holds %d", ErrTooLarge, n, d.cap)
	}
	return d.exchange(ctx, turn, send, recv, sig, nil)
}

// VLayout is the layout of an AlltoAllv through the areas (algos.VLayout).
type VLayout = algos.VLayout

// AllToAllv is AllToAll with blocks of any size (lay). send must be at least
// lay.SrcLen[r] bytes (r: this rank); only those are published. send may be this rank's
// own block of recv (an AllGather in place): the others' blocks must not overlap it.
func (d *Direct) AllToAllv(ctx context.Context, turn uint64, send, recv []byte, lay *VLayout, sig uint64) (err error) {
	defer func() { d.finish(turn, err) }()
	if err := d.checkLayout(lay, len(send), len(recv)); err != nil {
		return err
	}
	return d.exchange(ctx, turn, send[:lay.SrcLen[d.rank]], recv, sig, lay)
}

func (d *Direct) checkLayout(lay *VLayout, send, recv int) error {
	p := d.size
	if lay == nil || len(lay.RecvOff) != p || len(lay.RecvLen) != p || len(lay.SrcOff) != p || len(lay.SrcLen) != p {
		return &transport.ArgError{Arg: "layout", Reason: fmt.Sprintf("want %d entries in each of its four lists", p)}
	}
	for q := 0; q < p; q++ {
		switch {
		case lay.RecvOff[q] < 0 || lay.RecvLen[q] < 0 || lay.RecvOff[q]+lay.RecvLen[q] > recv:
			return &transport.ArgError{Arg: "recv", Reason: fmt.Sprintf("block from rank %d ([%d,+%d)) outside the %d-byte buffer", q, lay.RecvOff[q], lay.RecvLen[q], recv)}
		case lay.SrcOff[q] < 0 || lay.SrcLen[q] < 0 || lay.SrcOff[q]+lay.RecvLen[q] > lay.SrcLen[q]:
			return &transport.ArgError{Arg: "layout", Reason: fmt.Sprintf("block from rank %d ([%d,+%d)) outside its %d-byte send buffer", q, lay.SrcOff[q], lay.RecvLen[q], lay.SrcLen[q])}
		case !d.Fits(lay.SrcLen[q]):
			return fmt.Errorf("%w: rank %d sends %d bytes, the area holds %d", ErrTooLarge, q, lay.SrcLen[q], d.cap)
		}
	}
	if me := d.rank; lay.SrcLen[me] > send {
		return &transport.ArgError{Arg: "send", Reason: fmt.Sprintf("%d bytes, the layout sends %d", send, lay.SrcLen[me])}
	}
	return nil
}

// AllReduce combines the buffers of all ranks with reduce and leaves the result, bitwise
// identical, in recv on every rank. send (which may be recv: in place) is at most Cap
// bytes of es-byte elements. Two phases through the areas: every rank copies send into
// its area; rank q combines block q (the buffer cut into P blocks of whole elements) of
// every rank's copy, in rank order, into recv and its area; then every rank copies the
// others' combined blocks. Each block is combined once, by one rank, in rank order:
// the result does not depend on which rank ran it, nor on P's placement on CPUs.
// reduce(dst, src) combines src into dst; it is called for every block but the first
// of each rank's block.
func (d *Direct) AllReduce(ctx context.Context, turn uint64, send, recv []byte, es int, reduce func(dst, src []byte), sig uint64) (err error) {
	defer func() { d.finish(turn, err) }()
	n := len(send)
	switch {
	case len(recv) != n:
		return &transport.ArgError{Arg: "recv", Reason: fmt.Sprintf("%d bytes for a %d-byte send", len(recv), n)}
	case es <= 0 || n%es != 0:
		return &transport.ArgError{Arg: "send", Reason: fmt.Sprintf("%d bytes is not a whole number of %d-byte elements", n, es)}
	case n > d.cap:
		return fmt.Errorf("%w: %d bytes, the area holds %d", ErrTooLarge, n, d.cap)
	}
	// Blocks of whole elements, the last ones shorter (or empty).
	b := (n/es + d.size - 1) / d.size * es
	return d.combine(ctx, turn, send, recv, b, true, reduce, sig)
}

// ReduceScatter combines the send buffers of all ranks (P equal blocks each, at most Cap
// bytes in all) with reduce, and leaves block r of the result (r: this rank) in recv:
// every rank copies send into its area, then combines its block of every rank's copy, in
// rank order. See AllReduce.
func (d *Direct) ReduceScatter(ctx context.Context, turn uint64, send, recv []byte, reduce func(dst, src []byte), sig uint64) (err error) {
	defer func() { d.finish(turn, err) }()
	n := len(send)
	switch {
	case n != d.size*len(recv):
		return &transport.ArgError{Arg: "send", Reason: fmt.Sprintf("%d bytes, want %d ranks x %d (recv)", n, d.size, len(recv))}
	case n > d.cap:
		return fmt.Errorf("%w: %d bytes, the area holds %d", ErrTooLarge, n, d.cap)
	}
	return d.combine(ctx, turn, send, recv, len(recv), false, reduce, sig)
}

// span is block q of b bytes (the last ones cut short) of n bytes.
func span(q, b, n int) (int, int) {
	lo := min(q*b, n)
	return lo, min(lo+b, n)
}

// combine runs AllReduce (all: the combined blocks are then exchanged; recv is the whole
// buffer) and ReduceScatter (recv is this rank's block), arguments checked; b: the block.
func (d *Direct) combine(ctx context.Context, turn uint64, send, recv []byte, b int, all bool, reduce func(dst, src []byte), sig uint64) error {
	if err := d.awaitTurn(ctx, turn); err != nil {
		return err
	}
	d.a.Count(1, 0, 0, 0, 0)
	d.cur, d.op, d.flag = turn, "reducescatter", areaPublished
	if all {
		d.op = "allreduce"
	}
	if !d.a.Hold() {
		return transport.ErrClosed
	}
	defer d.a.Release()
	n := len(send)
	me := d.rank
	par := 8 * int(turn&1)
	off := d.place(turn, n)
	mine := d.data(me, uint64(off), n)
	memx.Copy(mine, send)
	atomic.StoreUint64(d.u64(me, areaWhere+par), uint64(off))
	atomic.StoreUint64(d.u64(me, areaSig+par), sig)
	target := d.countIn()
	atomic.StoreUint64(d.u64(me, areaPublished), turn)
	d.wanted = append(d.wanted[:0], d.order...)
	if err := d.wait(ctx, areaArrived, target, func() (bool, error) { return d.arrivals(turn, sig, nil) }); err != nil {
		return err
	}

	// Every copy is in: combine this rank's block of them, in rank order.
	lo, hi := span(me, b, n) // empty for the last ranks when n < P elements
	dst := recv[:hi-lo]
	if all {
		dst = recv[lo:hi]
	}
	for q := 0; q < d.size; q++ {
		src := mine
		if q != me {
			var err error
			if src, err = d.peerData(q, turn, n); err != nil {
				return err
			}
		}
		if q == 0 {
			memx.Copy(dst, src[lo:hi])
		} else if hi > lo {
			reduce(dst, src[lo:hi])
		}
	}
	if !all {
		return nil
	}

	// Publish the combined block where it came from (the others read only their own
	// blocks of this copy), then take theirs.
	copy(mine[lo:hi], dst)
	d.flag = areaCombined
	target = d.countIn()
	atomic.StoreUint64(d.u64(me, areaCombined), turn)
	d.wanted = append(d.wanted[:0], d.order...)
	return d.wait(ctx, areaArrived, target, func() (bool, error) {
		return d.arrivals(turn, sig, func(q int) error {
			src, err := d.peerData(q, turn, n)
			if err == nil {
				qlo, qhi := span(q, b, n)
				memx.Copy(recv[qlo:qhi], src[qlo:qhi])
			}
			return err
		})
	})
}

// arrivals hands take (if not nil) the peers still wanted that have raised the running
// phase's flag (d.flag) for turn, drops them from d.wanted, and reports whether none is
// left. On publication it checks their signature first (a different one is an error).
// An error ends the operation (and the Direct: see finish).
func (d *Direct) arrivals(turn, sig uint64, take func(q int) error) (bool, error) {
	if d.waitTurn.Load() != turn || d.waitFlag.Load() != int64(d.flag) {
		d.waitFlag.Store(int64(d.flag))
		d.waitTurn.Store(turn)
	}
	par := 8 * int(turn&1)
	k := 0
	for _, q := range d.wanted {
		if atomic.LoadUint64(d.u64(q, d.flag)) < turn {
			d.wanted[k] = q
			k++
			continue
		}
		if d.flag == areaPublished {
			if got := atomic.LoadUint64(d.u64(q, areaSig+par)); got != sig {
				return false, d.mismatch(q, turn, got, sig)
			}
		}
		if take != nil {
			if err := take(q); err != nil {
				return false, err
			}
		}
	}
	d.wanted = d.wanted[:k]
	return k == 0, nil
}

// Waiting lists the peers (transport ranks) whose arrival this rank's running
// shared-area operation waits for; nil when none waits. Safe from any goroutine (a
// watchdog naming the ranks that made no progress).
func (d *Direct) Waiting() []int {
	turn, flag := d.waitTurn.Load(), int(d.waitFlag.Load())
	if turn == 0 || d.done.Load() >= turn {
		return nil
	}
	var out []int
	for _, q := range d.order {
		if atomic.LoadUint64(d.u64(q, flag)) < turn {
			out = append(out, q)
		}
	}
	return out
}

func (d *Direct) mismatch(q int, turn, got, sig uint64) error {
	return &transport.PeerError{Rank: q, Op: d.op, Err: fmt.Errorf(
		"%w: rank %d published operation %d with signature %#x, this rank's is %#x",
		transport.ErrMismatch, q, turn, got, sig)}
}

// peerData is the n bytes rank q published for turn in its area.
func (d *Direct) peerData(q int, turn uint64, n int) ([]byte, error) {
	where := atomic.LoadUint64(d.u64(q, areaWhere+8*int(turn&1)))
	data := d.data(q, where, n)
	if data == nil {
		return nil, &transport.PeerError{Rank: q, Op: d.op, Err: fmt.Errorf(
			"%w: rank %d published %d bytes at offset %d of its area", transport.ErrProtocol, q, n, where)}
	}
	return data, nil
}

// block says where this rank's block from rank q is: at src of q's send buffer, which is
// total bytes long, n bytes, going to dst of recv. lay nil: an AllToAll of total bytes.
func (d *Direct) block(lay *VLayout, q, total int) (src, n, dst, qtotal int) {
	if lay == nil {
		b := total / d.size
		return d.rank * b, b, q * b, total
	}
	return lay.SrcOff[q], lay.RecvLen[q], lay.RecvOff[q], lay.SrcLen[q]
}

// exchange runs an AllToAll (lay nil) or AllToAllv whose arguments were checked.
func (d *Direct) exchange(ctx context.Context, turn uint64, send, recv []byte, sig uint64, lay *VLayout) error {
	if err := d.awaitTurn(ctx, turn); err != nil {
		return err
	}
	d.a.Count(1, 0, 0, 0, 0)
	d.cur, d.op, d.flag = turn, "alltoall", areaPublished
	if lay != nil {
		d.op = "alltoallv"
	}
	if !d.a.Hold() {
		return transport.ErrClosed
	}
	defer d.a.Release()
	p := d.size
	n := len(send)
	me := d.rank
	// Up to Cap, a Go slice's send buffer (4 KiB pages, which process_vm_readv pins one
	// at a time) goes through the area, where obuf did not map it on huge pages
	// (obuf.Huge), unless it is an AlltoAll's over AcrossMin with more ranks than CPUs.
	// Measured (moex bench coll --transport shm --heap, 1 MiB, mean and p50 us, two runs
	// each, across against the area): AllGather P=4 479-493 (p50 463-472) against
	// 227-254 (316-337), P=2 131-136 against 120-142; AlltoAll P=2 86-87 (73-75)
	// against 54-59 (45-49), P=4 282-312 (268-297) against 308-314 (424); from obuf's
	// buffers across stays faster (AllGather P=2 88-90 against 110-113).
	huge := obuf.Huge(send)
	pull := n > d.cap || d.pull && (n > AcrossMin && (huge || d.size > d.cpus) || huge && d.blocks && d.perPeer(n, lay) >= AcrossBlockMin)
	par := 8 * int(turn&1)
	// A send buffer in the shared arena is read in place by the others (one copy), at its
	// address with process_vm_readv by a rank that cannot map the arena. Cross-memory
	// attach must work for that, and it does wherever taking the arena's memfd does. The
	// readers take the way from what is published here (acrossTag, arenaTag), not from the
	// size.
	var arena uint64
	if pull {
		arena = acrossTag
	}
	if d.pull && n >= SharedMin {
		if off, ok := obuf.Locate(send); ok {
			arena = uint64(off) | arenaTag
			pull = true
			d.a.ShareArena()
		}
	}
	atomic.StoreUint64(d.u64(me, areaArena+par), arena)
	d.stream = d.a.Stream() > 0 || (d.a.Stream() == 0 && d.llc > 0 && d.footprint(n, lay) > d.llc)
	var inT time.Duration // a timed copy into the area (copyIn): how long, how many bytes
	var inN int
	if pull {
		d.pulled[me]++
		if n > 0 {
			atomic.StoreUint64(d.u64(me, areaWhere+par), uint64(uintptr(unsafe.Pointer(&send[0]))))
		}
	} else {
		off := d.place(turn, n)
		buf := d.data(me, uint64(off), n)
		cp, timed := d.in.copier(d.a.Stream(), n) // see copyIn
		var t0 time.Time
		if timed {
			t0 = time.Now()
		}
		if lay == nil {
			// Block by block, the first ones read first.
			b := n / p
			for _, q := range d.order {
				cp(buf[q*b:(q+1)*b], send[q*b:(q+1)*b])
			}
		} else {
			cp(buf, send)
		}
		if timed {
			inT = time.Since(t0)
			inN = n
			if lay == nil {
				inN = n - n/p // this rank's own block is not copied in
			}
		}
		atomic.StoreUint64(d.u64(me, areaWhere+par), uint64(off))
	}
	atomic.StoreUint64(d.u64(me, areaSig+par), sig)
	target := d.countIn()
	atomic.StoreUint64(d.u64(me, areaPublished), turn)
	if src, bn, dst, _ := d.block(lay, me, n); bn > 0 && &recv[dst] != &send[src] {
		t0 := time.Now()
		memx.Copy(recv[dst:dst+bn], send[src:src+bn])
		if inN > 0 {
			d.in.observe(inN, inT, bn, time.Since(t0))
		}
	}
	d.wanted = append(d.wanted[:0], d.order...)
	if err := d.wait(ctx, areaArrived, target, func() (bool, error) {
		return d.arrivals(turn, sig, func(q int) error { return d.take(q, turn, recv, n, lay) })
	}); err != nil {
		return err
	}
	if pull {
		// The others read from send: it is ours again once they all have. Until then
		// only its address is in use, which Go does not count: keep it alive, or the
		// collector may hand its memory to someone else while they read.
		defer runtime.KeepAlive(send)
		want := uint32(uint64(p-1) * d.pulled[me])
		reads := d.u32(me, areaReads)
		if err := d.wait(ctx, areaReads, want, func() (bool, error) { return reached(atomic.LoadUint32(reads), want), nil }); err != nil {
			return err
		}
	}
	return nil
}

// perPeer is about how many bytes of this rank's send buffer (n bytes) each other rank
// reads: an AllToAll's n/P; in an AllToAllv, what this rank reads of each (the layouts
// of an AllGather, and of most AllToAllvs, are symmetric), on average.
func (d *Direct) perPeer(n int, lay *VLayout) int {
	if lay == nil || d.size == 1 {
		return n / d.size
	}
	sum := 0
	for q, b := range lay.RecvLen {
		if q != d.rank {
			sum += b
		}
	}
	return sum / (d.size - 1)
}

// footprint is about how many bytes an AllToAll (lay nil; n: the send buffer) or AlltoAllv
// touches on this host: every rank's send buffer and as much again received. Above the
// last-level cache, the blocks read in place from shared buffers are copied with
// non-temporal stores (memx.Stream): every line would come from memory and go back
// anyway, and streaming skips reading the destination's lines first. Measured with
// MOEX_SHM_STREAM=0|1 moex bench coll --op alltoall --transport shm --shared --min-bytes
// 4M --max-bytes 4M (2 CPUs, 32 MiB L3; runs alternating): P=8 (64 MiB touched)
// 1067-1622 us streamed against 1875-2625 (5 runs); P=2 (16 MiB, which the cache holds)
// 274-326 against 183-212 (5 runs); P=4 (32 MiB, as much as the cache) either way by
// the hour, 581-858 against 622-1074 (8 runs) and 535-667 against 462-749 (8 runs), so
// it does not stream.
func (d *Direct) footprint(n int, lay *VLayout) int {
	if lay == nil {
		return 2 * d.size * n
	}
	total := 0
	for _, l := range lay.SrcLen {
		total += l
	}
	return 2 * total
}

// countIn starts a phase: it counts this rank in on every other rank's arrived count,
// and returns the count this rank waits for on its own. Call it before raising the flag
// that the others wait for: a rank that sees every flag of a phase raised, finishes it
// and counts itself in for the next one, must find the counts of this phase complete, or
// the increment that completes one would be its own, for another target, and nobody
// would wake the rank that sleeps on it.
func (d *Direct) countIn() uint32 {
	d.phases++
	target := uint32(uint64(d.size-1) * d.phases)
	for _, q := range d.order {
		d.bump(q, areaArrived, target)
	}
	return target
}

// place picks where in the data space operation turn puts its n bytes (see the layout).
func (d *Direct) place(turn uint64, n int) int {
	space := len(d.a.Area(d.rank)) - transport.AreaHeader // 3 x this rank's capacity
	var off int
	if d.a.Rewind() {
		off = int(turn&1) * (space / 2 &^ 63) // each half holds areaCap: 3/2 cap >= cap
	} else if off = d.end; off+n > space {
		// From the start: the previous operation's data, at most areaCap bytes, ends
		// beyond 3 cap - n >= 2 cap, so it starts beyond cap >= n.
		off = 0
	}
	d.end = (off + n + 63) &^ 63
	return off
}

// reached compares counters that wrap around.
func reached(v, target uint32) bool { return int32(v-target) >= 0 }

// bump adds one to rank q's counter at off, and wakes q if that completes target and q
// sleeps.
func (d *Direct) bump(q, off int, target uint32) {
	if atomic.AddUint32(d.u32(q, off), 1) == target && atomic.LoadUint32(d.u32(q, areaSleeping)) != 0 {
		d.a.Wake(d.u32(q, off))
	}
}

// wait polls cond under the transport's policy until it reports done, parking, when the
// policy says so, on this rank's counter at off until it reaches target (and every few
// milliseconds looking at ctx, the transport and the peers still wanted).
func (d *Direct) wait(ctx context.Context, off int, target uint32, cond func() (bool, error)) error {
	word := d.u32(d.rank, off)
	sleeping := d.u32(d.rank, areaSleeping)
	poller := d.a.Poller()
	var checked time.Time
	for {
		spin := poller.Begin()
		if d.procs {
			spin = poller.BeginProcess()
		}
		for {
			done, err := cond()
			if err != nil || done {
				spin.End()
				return err
			}
			if spin.Idle() {
				// Announce, then sleep unless the count is complete already; the rank
				// that completes it wakes us. Wake up every few milliseconds to look
				// at ctx and at the peers' liveness.
				atomic.StoreUint32(sleeping, 1)
				if v := atomic.LoadUint32(word); !reached(v, target) && ctx.Err() == nil {
					timedOut := uint64(0)
					if d.a.Park(word, v, 2*time.Millisecond) {
						timedOut = 1
					}
					d.a.Count(0, 1, timedOut, 0, 0)
				} else {
					busypoll.OSYield() // counted in, about to publish: let it
				}
				atomic.StoreUint32(sleeping, 0)
				spin.End()
				break
			}
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if d.a.Closed() {
			return transport.ErrClosed
		}
		if now := time.Now(); now.Sub(checked) > 5*time.Millisecond {
			checked = now
			// Look once more first: a peer that published, found something wrong
			// (a mismatch) and closed is not missing, and its publication says why.
			if done, err := cond(); err != nil || done {
				return err
			}
			if err := d.checkPeers(); err != nil {
				return err
			}
		}
	}
}

// take copies rank q's block of the AllToAll(v) of turn into recv: from q's area, in
// place from q's send buffer in its shared arena, or read across from its send buffer
// (counting the read at q for the last two).
func (d *Direct) take(q int, turn uint64, recv []byte, total int, lay *VLayout) error {
	src, n, at, qtotal := d.block(lay, q, total)
	dst := recv[at : at+n]
	arena := atomic.LoadUint64(d.u64(q, areaArena+8*int(turn&1)))
	if arena == 0 { // in q's area (peerData checks that it fits)
		data, err := d.peerData(q, turn, qtotal)
		if err != nil {
			return err
		}
		memx.Copy(dst, data[src:src+n])
		return nil
	}
	where := atomic.LoadUint64(d.u64(q, areaWhere+8*int(turn&1)))
	d.pulled[q]++
	var data []byte // in place, when q's buffer is in its arena and this rank can map it
	if arena&arenaTag != 0 && n > 0 {
		data = d.a.ArenaData(q, arena&^arenaTag+uint64(src), n)
	}
	switch {
	case data != nil:
		if d.stream {
			memx.Stream(dst, data)
		} else {
			memx.Copy(dst, data)
		}
		d.a.Count(0, 0, 0, uint64(n), 0)
	case n > 0:
		if err := d.a.ReadAcross(q, dst, where+uint64(src)); err != nil {
			return &transport.PeerError{Rank: q, Op: d.op, Err: fmt.Errorf("%w: reading rank %d's buffer: %v", transport.ErrPeerClosed, q, err)}
		}
		d.a.Count(0, 0, 0, 0, uint64(n))
	}
	d.bump(q, areaReads, uint32(uint64(d.size-1)*d.pulled[q]))
	return nil
}

// checkPeers reports a peer that has not published yet and never will: the transport
// found it dead (its process exited; watchPeers looks every 20 ms), or
// its segment says it closed.
func (d *Direct) checkPeers() error {
	for _, q := range d.wanted {
		if atomic.LoadUint64(d.u64(q, d.flag)) >= d.cur {
			continue // raised its flag after all: the next look takes it
		}
		if err := d.a.PeerGone(q, d.op); err != nil {
			return err
		}
	}
	return nil
}

// ErrBroken is returned by the operations after one that failed: the ranks may no longer
// agree on which operation is which.
var ErrBroken = errors.New("coll: an earlier shared-area operation failed")

// awaitTurn waits until the operations before turn have finished (only operations
// issued without waiting for the previous ones queue here).
func (d *Direct) awaitTurn(ctx context.Context, turn uint64) error {
	for d.done.Load() != turn-1 {
		switch {
		case d.broken.Load():
			return ErrBroken
		case ctx.Err() != nil:
			return ctx.Err()
		case d.a.Closed():
			return transport.ErrClosed
		}
		time.Sleep(20 * time.Microsecond)
	}
	if d.broken.Load() {
		return ErrBroken
	}
	return nil
}

// finish ends turn: the next may start, or, when it failed, every later one fails.
func (d *Direct) finish(turn uint64, err error) {
	if err != nil {
		d.broken.Store(true)
		return
	}
	d.done.Store(turn)
}
