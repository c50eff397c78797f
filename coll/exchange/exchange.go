package exchange

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/moex-ai/moex/coll/algos"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
)

// An Exchange is an AlltoAllv whose block sizes travel with the data: in each exchange
// every rank sends one block (possibly empty) to every rank and receives one from each,
// into a buffer of fixed capacity per source, and learns each block's size when it
// arrives. There is no counts round trip and nothing is allocated per exchange: the
// buffers are sized once (Config), and Slots exchanges may be in flight or hold
// received data at once. It is the primitive under the MoE low-latency mode.
//
// A block has one or more fields (Config.Fields), each received into a buffer
// of its own, so that, for instance, rows and their metadata land in separate arrays.
//
// Where the transport lets ranks write into one another's memory (inproc, shm: see
// transport.WindowTransport), the sender writes each block straight into its receiver's
// buffer (Dest returns the receiver's memory) and raises a flag there: one copy, from the
// sender's data into the place it is read. Where it reaches their registered memory by
// one-sided operations (ucx: transport.RMAWindow), the sender fills a block of its own,
// puts it into the receiver's buffer, fences and signals the flag: the receiver matches
// nothing and polls its own memory, and it tells its senders a buffer is free the same
// way (a credit signalled into theirs). With other peers blocks go as tagged messages
// into the same buffers.
//
// One exchange: Begin, then for every rank Dest (or NextDest) to get the memory of its
// block and Send to say how long each field is, then Wait; Recv then returns what each
// rank sent. Begin, like every collective, is issued in the same order on every rank.
// The data received in an exchange stays valid until the exchange Slots later begins;
// Begin while the exchange Slots earlier has not been waited for returns ErrBusy. (The
// buffers have one slot more than that, so that a rank beginning an exchange can already
// free the buffers of the next: where ranks write into each other's memory, a sender then
// rarely waits for its receiver to begin.)
type Exchange struct {
	h      Host
	sig    uint32
	fields []int // capacity of each field, bytes
	foff   []int // offset of each field's array in a slot: P buffers of its capacity, 64-aligned
	per    int   // bytes of one slot: every field's array
	slots  int   // exchanges that may hold data at once
	bufs   int   // slots of buffers: one more, so that the next exchange's is free early

	win   transport.Window    // nil: every block is a message
	rma   transport.RMAWindow // win, where its peers are reached by one-sided operations
	push  []bool              // push[q]: this rank writes its blocks into q's window
	rput  []bool              // rput[q]: this rank puts its blocks into q's window (rma)
	from  []bool              // from[q]: q writes (or puts) its blocks into this rank's window
	rfrom []bool              // rfrom[q]: q puts its blocks (rma): it reads credits, not ready words
	ctl   int                 // bytes of control words before the data, in the window

	// With rma: the records put after each block (a 64-byte word per slot and
	// destination), and the credit each slot was last given (the epoch its writers may
	// fill it for).
	recStage []byte
	recBuf   *obuf.Buf
	credited []uint64

	recv    []byte    // received blocks: [slot][field][source], in the window or recvBuf
	recvBuf *obuf.Buf // when there is no window
	send    []byte    // blocks for message peers: [slot][field][destination]
	sendBuf *obuf.Buf

	epoch  uint64 // exchanges begun
	ops    []Op   // one per slot
	closed bool

	// With Config.Profile, per source rank, when its block of the exchange being waited
	// for was seen to arrive (Comm.recordExchange), and scratch.
	seen  []int64
	order []int32
	// waitOn[q]: Wait counts rank q among those it waits for (Comm.pend, which a
	// timeout names) until q's block is seen.
	waitOn []bool
}

// Config sizes an Exchange.
type Config struct {
	// Fields are the capacities in bytes of the fields of one block (what one rank sends
	// one rank in one exchange); 1 to MaxFields of them.
	Fields []int
	// Slots is how many exchanges may be in flight or hold received data at once
	// (default 2).
	Slots int
}

// MaxFields is the most fields an exchange block may have.
const MaxFields = 5

// ErrBusy: an operation would reuse buffers that an earlier one, not finished, still uses.
var ErrBusy = errors.New("coll: too many operations in flight")

// Host is what an exchange needs of its communicator: package coll's Comm gives it one.
type Host interface {
	Size() int
	Rank() int
	// World is comm rank q's rank on the transport.
	World(q int) int
	Transport() transport.Transport
	ID() uint32
	Pool() *obuf.Pool
	Profiling() bool
	Tracing() bool
	// OpenWindow makes this rank's window where the transport has them and agrees with
	// every rank on sig and on who mapped whom (maps[i*P+j] == 1: rank i mapped rank j's).
	OpenWindow(ctx context.Context, sig uint32, size int, what string) (transport.Window, []byte, error)
	// Begin enters an operation (in issue order) and returns its sequence number; End
	// leaves it.
	Begin(ctx context.Context) (uint32, error)
	End()
	// Fail aborts the communicator with err and returns the error the operation gives.
	Fail(err error) error
	// Aborted is done when the communicator aborts.
	Aborted() context.Context
	// Waiting counts rank q among the ranks an operation waits for (delta +1), or no more
	// (-1): a timeout names them.
	Waiting(q, delta int)
	// Progressed says the operation moved.
	Progressed()
	// Record notes when each rank's block arrived (profiling) and returns the wait for
	// the last one; Trace writes the exchange into the trace.
	Record(arrived []int64, order []int32) (wait time.Duration, last int, waited []int32)
	Trace(begun, t0 int64, wait time.Duration, last int, arrived []int64, order []int32)
	// Now is the communicator's clock, in nanoseconds.
	Now() int64
	// Invalid is the error of an invalid argument (this rank's alone: nothing aborts).
	Invalid(arg, format string, a ...any) error
}

// Window control words: ready[slot] (the owner began the exchange with this epoch in
// that slot, whose old data it no longer needs), then per (slot, source) a record
// written by the source: the epoch, the signature and the length of every field.
const (
	recEpoch = 0
	recSig   = 8
	recLens  = 16
)

// New makes an Exchange on h. It is collective: every rank calls it with the same
// configuration.
func New(ctx context.Context, h Host, cfg Config) (*Exchange, error) {
	if len(cfg.Fields) == 0 || len(cfg.Fields) > MaxFields {
		return nil, h.Invalid("Fields", "%d fields (want 1..%d)", len(cfg.Fields), MaxFields)
	}
	if cfg.Slots == 0 {
		cfg.Slots = 2
	}
	if cfg.Slots < 1 || cfg.Slots > 64 {
		return nil, h.Invalid("Slots", "%d (want 1..64)", cfg.Slots)
	}
	p := h.Size()
	x := &Exchange{h: h, slots: cfg.Slots, bufs: cfg.Slots + 1, push: make([]bool, p), rput: make([]bool, p), from: make([]bool, p), rfrom: make([]bool, p)}
	sig := []int{int(algos.OpExchange), cfg.Slots}
	for i, n := range cfg.Fields {
		if n < 0 || n > transport.MaxWindow/p {
			return nil, h.Invalid(fmt.Sprintf("Fields[%d]", i), "%d bytes", n)
		}
		x.foff = append(x.foff, x.per)
		x.fields = append(x.fields, n)
		x.per += (p*n + 63) &^ 63
		sig = append(sig, n)
	}
	total, ctl := exchangeSizes(cfg.Fields, cfg.Slots, p)
	if total > transport.MaxWindow {
		return nil, h.Invalid("Fields", "%d slots of %d ranks x %d bytes is more than %d", cfg.Slots, p, x.per/p, transport.MaxWindow)
	}
	x.sig = algos.Signature(algos.OpExchange, algos.AlgoAuto, 1, sig...)
	x.ctl = ctl
	if err := x.openWindows(ctx, total); err != nil {
		return nil, err
	}
	if x.win != nil {
		x.recv = x.win.Local()[x.ctl:]
	} else {
		x.recvBuf = h.Pool().Get(max(total, 1))
		x.recv = x.recvBuf.Bytes()[:total]
	}
	msgPeers := 0
	for q := 0; q < p; q++ {
		if q != h.Rank() && !x.push[q] {
			msgPeers++
		}
	}
	if msgPeers > 0 {
		x.sendBuf = h.Pool().Get(total)
		x.send = x.sendBuf.Bytes()[:total]
	}
	if err := x.stageRMA(); err != nil {
		x.Close()
		return nil, err
	}
	x.ops = make([]Op, x.bufs)
	for s := range x.ops {
		o := &x.ops[s]
		o.x, o.slot = x, s
		o.sent = make([]bool, p)
		o.lens = make([]int, p*len(x.fields))
		o.dests = make([][]byte, len(x.fields))
		o.reqs = make([]transport.Request, 0, 2*p*(len(x.fields)+3))
		o.reqPeer = make([]int32, 0, 2*p*(len(x.fields)+3))
		o.puts = make([]transport.Request, 0, p*(len(x.fields)+4))
		o.readyQ = func() bool { return o.Ready(o.waitQ) }
		o.arrived = o.allArrived
	}
	x.waitOn = make([]bool, p)
	if h.Profiling() {
		x.seen, x.order = make([]int64, p), make([]int32, 0, p)
	}
	return x, nil
}

// exchangeSizes returns the bytes of an exchange's buffers (Slots+1 slots, each with
// every field's array of P blocks, 64-byte aligned) and of the control words before them
// in a window (a 64-byte word per slot, per (slot, source) and per (slot, receiver),
// rounded up to a page).
func exchangeSizes(fields []int, slots, p int) (data, ctl int) {
	per := 0
	for _, n := range fields {
		per += (p*n + 63) &^ 63
	}
	bufs := slots + 1
	return bufs * per, ((bufs+2*bufs*p)*64 + 4095) &^ 4095
}

// Bytes is the memory (Exchange.Bytes) that an exchange of cfg holds on each of
// ranks ranks, where every other rank writes its blocks into this rank's memory (windows:
// inproc, or shm with every rank on one host) or where they travel as messages (windows
// false). Where some peers write and others send, it is the messages' figure plus the
// window's control words. It runs nothing, and checks nothing NewExchange would refuse.
func Bytes(cfg Config, ranks int, windows bool) int {
	if cfg.Slots == 0 {
		cfg.Slots = 2
	}
	data, ctl := exchangeSizes(cfg.Fields, cfg.Slots, ranks)
	switch {
	case ranks < 2: // nobody to send to: a buffer of its own
		return data
	case windows:
		return ctl + data
	}
	return 2 * data // received into one buffer, sent from another
}

// openWindows makes the windows where the transport has them, and agrees with every
// rank on which pairs write into each other's memory.
func (x *Exchange) openWindows(ctx context.Context, data int) error {
	h := x.h
	p, me := h.Size(), h.Rank()
	win, maps, err := h.OpenWindow(ctx, x.sig, x.ctl+data, "an exchange")
	if err != nil {
		return err
	}
	x.win = win
	x.rma, _ = win.(transport.RMAWindow)
	any := false
	for q := 0; q < p; q++ {
		x.push[q] = maps[me*p+q] == mappedDirect
		x.rput[q] = maps[me*p+q] == mappedRMA && x.rma != nil
		x.from[q] = maps[q*p+me] == mappedDirect || maps[q*p+me] == mappedRMA && x.rma != nil
		x.rfrom[q] = maps[q*p+me] == mappedRMA && x.rma != nil
		any = any || x.push[q] || x.from[q] || x.rput[q]
	}
	if x.win != nil && !any {
		x.closeWindow()
	}
	return nil
}

func (x *Exchange) closeWindow() {
	if x.win != nil {
		x.win.Close()
		x.win, x.rma = nil, nil
	}
	clear(x.push)
	clear(x.rput)
	clear(x.from)
	clear(x.rfrom)
}

// Slots is how many exchanges may be in flight or hold data at once.
func (x *Exchange) Slots() int { return x.slots }

// Bytes is the memory the exchange holds on this rank (ExchangeBytes): the window the
// other ranks write their blocks into (with its control words), or the buffer they are
// received into, and the send buffer where some peers take messages. Each has room for
// Slots+1 exchanges of one block per rank at the fields' capacities, so it grows with the
// ranks and the capacities and with nothing else. It is address space: a page takes
// physical memory when it is first written. It is 0 after Close.
func (x *Exchange) Bytes() int {
	n := len(x.send)
	if x.win != nil {
		return n + len(x.win.Local())
	}
	return n + len(x.recv)
}

// Pushes reports whether this rank writes its blocks for rank q straight into q's memory
// with plain stores (Dest is q's memory), rather than putting or sending them.
func (x *Exchange) Pushes(q int) bool { return x.push[q] }

// Puts reports whether this rank puts its blocks for rank q into q's registered memory
// with one-sided operations (transport.RMAWindow: ucx), then signals them.
func (x *Exchange) Puts(q int) bool { return x.rput[q] }

// Path says how this rank's blocks reach rank q: "local", "stores into its window",
// "puts into its window, then a signal (one-sided)" or "tag messages".
func (x *Exchange) Path(q int) string {
	switch {
	case q == x.h.Rank():
		return "local"
	case x.push[q]:
		return "stores into its window"
	case x.rput[q]:
		return "puts into its window, then a signal (one-sided)"
	}
	return "tag messages"
}

// OneSided reports whether this rank's blocks for rank q land in q's memory with no
// receive posted at q: stored there (Pushes) or put there (transport.RMAWindow).
func (x *Exchange) OneSided(q int) bool { return x.push[q] || x.rput[q] }

// Close releases the buffers and windows. It is local; every exchange begun must have
// been waited for.
func (x *Exchange) Close() error {
	if x.closed {
		return nil
	}
	x.closed = true
	for s := range x.ops {
		_ = x.ops[s].drainPuts(x.h.Aborted()) // before their staging goes back to the pool
	}
	var err error
	if x.win != nil {
		err = x.win.Close()
		x.win = nil
	}
	if x.recvBuf != nil {
		x.recvBuf.Release()
		x.recvBuf = nil
	}
	if x.sendBuf != nil {
		x.sendBuf.Release()
		x.sendBuf = nil
	}
	if x.recBuf != nil {
		x.recBuf.Release()
		x.recBuf = nil
	}
	x.recv, x.send, x.recStage = nil, nil, nil
	return err
}

// field returns field f of block (slot s, peer q) of mem, a [slot][field][peer] array.
func (x *Exchange) field(mem []byte, s, f, q int) []byte {
	n := x.fields[f]
	o := s*x.per + x.foff[f] + q*n
	return mem[o : o+n : o+n]
}

func (x *Exchange) u64(mem []byte, off int) *uint64 { return (*uint64)(unsafe.Pointer(&mem[off])) }

func (x *Exchange) readyOff(s int) int     { return s * 64 }
func (x *Exchange) recordOff(s, q int) int { return (x.bufs + s*x.h.Size() + q) * 64 }

// Op is one exchange in flight (see Exchange).
type Op struct {
	x       *Exchange
	slot    int
	epoch   uint64
	seq     uint32
	begun   bool
	sent    []bool
	nsent   int
	lens    []int // [peer][field]: what each rank sent this one (after Wait), or this rank sent itself
	dests   [][]byte
	reqs    []transport.Request
	reqPeer []int32 // per request: peer*MaxFields + field for a receive, -1 for a send
	// puts are the one-sided operations posted in this slot (blocks, records, signals,
	// credits): their completion only frees the staging, so they are waited for when
	// the slot is next begun (or at Close), not by Wait.
	puts []transport.Request

	btags []transport.Tag // Send's batch to one peer (scratch)
	bbufs [][]byte
	breqs [MaxFields]transport.Request

	waitQ  int         // the peer Dest waits for
	readyQ func() bool // o.Ready(o.waitQ), made once: a closure per wait would allocate
	// arrived reports whether every block written into this rank's memory has arrived,
	// noting each as it is first seen (allArrived).
	arrived func() bool
	t0      int64 // when Wait started waiting (nanotime)
	begunAt int64 // when Begin started it (unix ns), with Config.TraceDir
}

// Begin starts the next exchange: receives are posted, and the ranks that write into
// this rank's memory may do so.
func (x *Exchange) Begin(ctx context.Context) (*Op, error) {
	h := x.h
	if x.closed {
		return nil, transport.ErrClosed
	}
	e := x.epoch + 1
	s := int((e - 1) % uint64(x.bufs))
	o := &x.ops[s]
	if o.begun || x.ops[int(e%uint64(x.bufs))].begun { // exchange e-Slots is still in flight
		return nil, fmt.Errorf("%w: exchange %d would reuse the buffers of exchange %d, not waited for (%d slots)", ErrBusy, e, e-uint64(x.slots), x.slots)
	}
	seq, err := h.Begin(ctx)
	if err != nil {
		return nil, err
	}
	if err := o.drainPuts(h.Aborted()); err != nil {
		o.begun = true // for finish, which ends the operation
		return o, o.abort(err)
	}
	x.epoch = e
	o.epoch, o.seq, o.begun, o.nsent = e, seq, true, 0
	if h.Tracing() {
		o.begunAt = time.Now().UnixNano()
	}
	clear(o.sent)
	clear(o.lens)
	o.reqs, o.reqPeer = o.reqs[:0], o.reqPeer[:0]
	tag := transport.Tag{Comm: h.ID(), Seq: o.seq, Sig: x.sig}
	for q := 0; q < h.Size(); q++ {
		if q == h.Rank() || x.from[q] {
			continue
		}
		for f, capacity := range x.fields {
			if capacity == 0 {
				continue // always empty: no message (the scales of an unscaled wire, say)
			}
			tag.Tag = uint32(f)
			r, err := h.Transport().Irecv(h.World(q), tag, x.field(x.recv, s, f, q))
			if err != nil {
				return o, o.abort(err)
			}
			o.reqs, o.reqPeer = append(o.reqs, r), append(o.reqPeer, int32(q*MaxFields+f))
		}
	}
	if x.win != nil {
		// This exchange's buffers may be written; so may the next one's: they hold the
		// data of exchange e-Slots, dead from now on. Senders of the next exchange then
		// find them free without waiting for this rank to begin it.
		own := x.win.Local()
		if r := x.u64(own, x.readyOff(s)); atomic.LoadUint64(r) < e {
			atomic.StoreUint64(r, e)
		}
		n := int(e % uint64(x.bufs))
		if !x.ops[n].begun {
			atomic.StoreUint64(x.u64(own, x.readyOff(n)), e+1)
		}
		for q := 0; q < h.Size(); q++ {
			if x.from[q] && !x.rfrom[q] {
				x.win.Notify(h.World(q))
			}
		}
		if x.rma != nil {
			if err := o.credit(s, e); err != nil {
				return o, o.abort(err)
			}
			if !x.ops[n].begun {
				if err := o.credit(n, e+1); err != nil {
					return o, o.abort(err)
				}
			}
		}
	}
	return o, nil
}

// abort fails the exchange on every rank (the communicator aborts) and ends it here.
func (o *Op) abort(err error) error {
	h := o.x.h
	err = h.Fail(err)
	o.finish()
	return err
}

// finish ends the exchange: its requests are waited for (they fail at once once the
// communicator aborted) and the slot is free again.
func (o *Op) finish() {
	if !o.begun {
		return
	}
	for i, r := range o.reqs {
		if r != nil {
			_, _ = r.Wait(o.x.h.Aborted())
			o.reqs[i] = nil
		}
	}
	o.begun = false
	o.x.h.End()
}

// Epoch is the exchange's number on its Exchange (1 for the first).
func (o *Op) Epoch() uint64 { return o.epoch }

// Ready reports whether Dest(q) would return without waiting.
func (o *Op) Ready(q int) bool {
	x := o.x
	switch {
	case x.push[q]:
		return atomic.LoadUint64(x.u64(x.win.Remote(x.h.World(q)), x.readyOff(o.slot))) >= o.epoch
	case x.rput[q]:
		return atomic.LoadUint64(x.u64(x.win.Local(), x.creditOff(o.slot, q))) >= o.epoch
	}
	return true
}

// Dest returns the memory of this rank's block for rank q, one slice per field, each of
// the field's capacity: q's own buffers when this rank writes into q's memory (it may
// have to wait until q has begun the exchange), otherwise a send buffer. They must be
// filled before Send(q, ...). The slice of fields is reused by the next Dest call; the
// memory each field names stays this exchange's block for q until Wait returns, and
// this rank may read back what it wrote there (to copy it into another rank's block).
func (o *Op) Dest(ctx context.Context, q int) ([][]byte, error) {
	x := o.x
	h := x.h
	if err := o.check(q); err != nil {
		return nil, err
	}
	mem, at := x.send, q
	if q != h.Rank() && !o.Ready(q) {
		o.waitQ = q
		h.Waiting(q, 1) // a timeout names q
		err := x.win.Wait(h.Aborted(), o.readyQ)
		h.Waiting(q, -1)
		if err != nil {
			return nil, o.abort(err)
		}
	}
	switch {
	case q == h.Rank():
		mem = x.recv
	case x.push[q]:
		mem, at = x.win.Remote(h.World(q))[x.ctl:], h.Rank()
	}
	for f := range x.fields {
		o.dests[f] = x.field(mem, o.slot, f, at)
	}
	return o.dests, nil
}

// NextDest is Dest for a rank that has not been sent to yet and can be written without
// waiting, if there is one (the lowest after this rank, cyclically), else the first that
// becomes ready. It returns q = -1 when every rank has been sent to.
func (o *Op) NextDest(ctx context.Context) (int, [][]byte, error) {
	h := o.x.h
	if o.nsent == h.Size() {
		return -1, nil, nil
	}
	first := -1
	for i := 0; i < h.Size(); i++ {
		q := (h.Rank() + i) % h.Size()
		if o.sent[q] {
			continue
		}
		if first < 0 {
			first = q
		}
		if o.Ready(q) {
			b, err := o.Dest(ctx, q)
			return q, b, err
		}
	}
	b, err := o.Dest(ctx, first)
	return first, b, err
}

func (o *Op) check(q int) error {
	h := o.x.h
	switch {
	case !o.begun:
		return h.Invalid("exchange", "not begun (or already waited for)")
	case q < 0 || q >= h.Size():
		return h.Invalid("rank", "%d out of range [0,%d)", q, h.Size())
	case o.sent[q]:
		return h.Invalid("rank", "rank %d's block was sent already", q)
	}
	return nil
}

// Send says that this rank's block for q is in the memory Dest(q) returned, lens[f]
// bytes of field f, and sends it. Every rank, this one included, must be sent a block
// (an empty one is fine) before Wait, which sends empty blocks where Send was not called.
func (o *Op) Send(q int, lens ...int) error {
	x := o.x
	h := x.h
	if err := o.check(q); err != nil {
		return err
	}
	if len(lens) != len(x.fields) {
		return h.Invalid("lens", "%d lengths for %d fields", len(lens), len(x.fields))
	}
	for f, n := range lens {
		if n < 0 || n > x.fields[f] {
			return h.Invalid(fmt.Sprintf("lens[%d]", f), "%d bytes, the field holds %d", n, x.fields[f])
		}
	}
	o.sent[q] = true
	o.nsent++
	switch {
	case q == h.Rank():
		copy(o.lens[q*len(x.fields):], lens)
	case x.push[q]:
		mem := x.win.Remote(h.World(q))
		rec := x.recordOff(o.slot, h.Rank())
		for f, n := range lens {
			atomic.StoreUint64(x.u64(mem, rec+recLens+8*f), uint64(n))
		}
		atomic.StoreUint64(x.u64(mem, rec+recSig), uint64(x.sig))
		atomic.StoreUint64(x.u64(mem, rec+recEpoch), o.epoch)
		x.win.Notify(h.World(q))
	case x.rput[q]:
		if err := o.put(q, lens); err != nil {
			return o.abort(err)
		}
	default:
		// The fields go as one batch: over tcp, one system call for them all.
		tag := transport.Tag{Comm: h.ID(), Seq: o.seq, Sig: x.sig}
		o.btags, o.bbufs = o.btags[:0], o.bbufs[:0]
		for f, n := range lens {
			if x.fields[f] == 0 {
				continue
			}
			tag.Tag = uint32(f)
			o.btags, o.bbufs = append(o.btags, tag), append(o.bbufs, x.field(x.send, o.slot, f, q)[:n])
		}
		err := transport.IsendBatch(h.Transport(), h.World(q), o.btags, o.bbufs, o.breqs[:])
		for _, r := range o.breqs[:len(o.bbufs)] {
			if r != nil {
				o.reqs, o.reqPeer = append(o.reqs, r), append(o.reqPeer, -1)
			}
		}
		clear(o.breqs[:len(o.bbufs)])
		clear(o.bbufs)
		if err != nil {
			return o.abort(err)
		}
	}
	h.Progressed()
	return nil
}

// Wait completes the exchange: empty blocks go to the ranks not sent to, and it returns
// once every rank's block has arrived. On error the communicator is aborted (as with
// every collective) and the error names the rank at fault where one is.
func (o *Op) Wait(ctx context.Context) error {
	x := o.x
	h := x.h
	if !o.begun {
		return h.Invalid("exchange", "not begun (or already waited for)")
	}
	var zero [MaxFields]int
	for q := 0; q < h.Size(); q++ {
		if !o.sent[q] {
			if _, err := o.Dest(ctx, q); err != nil {
				return err
			}
			if err := o.Send(q, zero[:len(x.fields)]...); err != nil {
				return err
			}
		}
	}
	nf := len(x.fields)
	prof := x.seen != nil
	if prof {
		o.t0 = x.h.Now()
		clear(x.seen)
	}
	// Every receive not complete counts its sender among the ranks this rank waits for
	// (Comm.pend) until it completes, so that a timeout names the ranks whose blocks
	// never came.
	for _, v := range o.reqPeer {
		if v >= 0 {
			h.Waiting(int(v/MaxFields), 1)
		}
	}
	for i, r := range o.reqs {
		v := int(o.reqPeer[i])
		blocked := prof && v >= 0 && !r.Test()
		n, err := r.Wait(h.Aborted())
		o.reqs[i] = nil
		if v >= 0 {
			h.Waiting(int(v/MaxFields), -1)
		}
		if err != nil {
			for j := i + 1; j < len(o.reqs); j++ {
				if v := o.reqPeer[j]; v >= 0 {
					h.Waiting(int(v/MaxFields), -1)
				}
			}
			return o.abort(err)
		}
		if v >= 0 {
			o.lens[v/MaxFields*nf+v%MaxFields] = n
			if blocked {
				x.seen[v/MaxFields] = max(x.seen[v/MaxFields], o.since())
			}
		}
	}
	if x.win != nil {
		own := x.win.Local()
		for q := range x.h.Size() {
			switch {
			case !x.from[q]:
			case o.blockArrived(own, q):
				if prof {
					x.seen[q] = -1 // before this rank waited for it
				}
			default:
				x.waitOn[q] = true
				h.Waiting(q, 1)
			}
		}
		err := x.win.Wait(h.Aborted(), o.arrived)
		for q, on := range x.waitOn {
			if on {
				x.waitOn[q] = false
				h.Waiting(q, -1)
			}
		}
		if err != nil {
			return o.abort(err)
		}
		for q := 0; q < h.Size(); q++ {
			if !x.from[q] {
				continue
			}
			rec := x.recordOff(o.slot, q)
			if got := atomic.LoadUint64(x.u64(own, rec+recSig)); got != uint64(x.sig) {
				return o.abort(&transport.PeerError{Rank: h.World(q), Op: "exchange", Err: fmt.Errorf(
					"%w: rank %d's exchange block has signature %#x, this rank's is %#x", transport.ErrMismatch, q, got, x.sig)})
			}
			for f := 0; f < nf; f++ {
				n := atomic.LoadUint64(x.u64(own, rec+recLens+8*f))
				if n > uint64(x.fields[f]) {
					return o.abort(&transport.PeerError{Rank: h.World(q), Op: "exchange", Err: fmt.Errorf(
						"%w: rank %d says it wrote %d bytes into a %d-byte field", transport.ErrProtocol, q, n, x.fields[f])})
				}
				o.lens[q*nf+f] = int(n)
			}
		}
	}
	o.finish()
	if prof {
		wait, last, waited := h.Record(x.seen, x.order)
		if h.Tracing() {
			h.Trace(o.begunAt, o.t0, wait, last, x.seen, waited)
		}
	}
	return nil
}

// since is the time since Wait started waiting, in nanoseconds, at least 1.
func (o *Op) since() int64 { return max(1, o.x.h.Now()-o.t0) }

// blockArrived reports whether rank q, which writes into this rank's memory (own), has
// published its block of this exchange.
func (o *Op) blockArrived(own []byte, q int) bool {
	x := o.x
	return atomic.LoadUint64(x.u64(own, x.recordOff(o.slot, q)+recEpoch)) >= o.epoch
}

// allArrived reports whether every rank that writes into this rank's memory has
// published its block of this exchange. A block seen for the first time stops counting
// its sender among the ranks this rank waits for (x.waitOn), and, profiled, notes when
// (x.seen).
func (o *Op) allArrived() bool {
	x := o.x
	own := x.win.Local()
	all := true
	for q := 0; q < x.h.Size(); q++ {
		switch {
		case !x.from[q] || !x.waitOn[q]:
		case o.blockArrived(own, q):
			x.waitOn[q] = false
			x.h.Waiting(q, -1)
			if x.seen != nil {
				x.seen[q] = o.since()
			}
		default:
			all = false
		}
	}
	return all
}

// Recv returns field f of the block rank q sent in this exchange (after Wait), valid
// until the exchange that reuses the slot begins.
func (o *Op) Recv(q, f int) []byte {
	return o.x.field(o.x.recv, o.slot, f, q)[:o.lens[q*len(o.x.fields)+f]]
}

// Field returns the buffers of field f of every rank's block in this exchange, rank by
// rank: rank q's is at q times the field's capacity (valid as Recv's).
func (o *Op) Field(f int) []byte {
	x := o.x
	o0 := o.slot*x.per + x.foff[f]
	return x.recv[o0 : o0+x.h.Size()*x.fields[f]]
}
