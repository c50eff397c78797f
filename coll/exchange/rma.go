package exchange

import (
	"context"
	"encoding/binary"

	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
)

// One-sided exchanges: where the transport reaches a peer's window by puts and signals
// (transport.RMAWindow: ucx), a sender fills its own staging, puts each block and its
// record into the receiver's window, fences, and signals the record's epoch; receivers
// hand out their buffers by signalling credit words in their senders' windows.

// How rank i reached rank j's window, in OpenWindow's maps.
const (
	mappedDirect = 1 // plain stores (Window.Remote)
	mappedRMA    = 2 // one-sided operations (transport.RMAWindow)
)

// stageRMA makes what puts need, where this rank puts into some peer's window: the
// records' staging, and the registration of the blocks' staging (once, never per put).
func (x *Exchange) stageRMA() error {
	if x.rma == nil {
		return nil
	}
	p := x.h.Size()
	x.credited = make([]uint64, x.bufs)
	x.recBuf = x.h.Pool().Get(x.bufs * p * 64)
	x.recStage = x.recBuf.Bytes()[:x.bufs*p*64]
	for _, b := range []*obuf.Buf{x.recBuf, x.sendBuf} {
		if b == nil {
			continue
		}
		if err := x.rma.Register(b); err != nil {
			return err
		}
	}
	return nil
}

// creditOff is the word, in a sender's window, where receiver q says the sender may put
// into q's buffers of slot s for the epoch it holds (rma).
func (x *Exchange) creditOff(s, q int) int { return (x.bufs + (x.bufs+s)*x.h.Size() + q) * 64 }

// drainPuts waits for the one-sided operations this slot posted when it was last used
// (long complete, as a rule): the staging they read is about to be written again.
func (o *Op) drainPuts(ctx context.Context) error {
	var first error
	for i, r := range o.puts {
		if _, err := r.Wait(ctx); err != nil && first == nil {
			first = err
		}
		o.puts[i] = nil
	}
	o.puts = o.puts[:0]
	return first
}

// credit tells every rank that puts into this rank's window that its buffers of slot s
// may be filled for the exchange of epoch e: a signal into each one's credit word for
// this rank (the one-sided counterpart of the ready word they would load).
func (o *Op) credit(s int, e uint64) error {
	x := o.x
	if x.credited[s] >= e {
		return nil
	}
	d := e - x.credited[s]
	x.credited[s] = e
	for q := 0; q < x.h.Size(); q++ {
		if !x.rfrom[q] {
			continue
		}
		r, err := x.rma.Signal(x.h.World(q), x.creditOff(s, x.h.Rank()), d)
		if err != nil {
			return err
		}
		o.puts = append(o.puts, r)
	}
	return nil
}

// put puts this rank's block for q (filled in the staging Dest returned) into q's
// window, then its record, and after a fence signals the record's epoch: q, polling the
// epoch in its own memory, then finds the block and the lengths in place.
func (o *Op) put(q int, lens []int) error {
	x := o.x
	h := x.h
	wq, me := h.World(q), h.Rank()
	track := func(r transport.Request, err error) error {
		if r != nil {
			o.puts = append(o.puts, r)
		}
		return err
	}
	for f, n := range lens {
		if n == 0 {
			continue
		}
		off := x.ctl + o.slot*x.per + x.foff[f] + me*x.fields[f]
		if err := track(x.rma.Put(wq, off, x.field(x.send, o.slot, f, q)[:n])); err != nil {
			return err
		}
	}
	rec := x.recStage[(o.slot*h.Size()+q)*64:][:64]
	binary.LittleEndian.PutUint64(rec[recSig:], uint64(x.sig))
	for f, n := range lens {
		binary.LittleEndian.PutUint64(rec[recLens+8*f:], uint64(n))
	}
	at := x.recordOff(o.slot, me)
	if err := track(x.rma.Put(wq, at+recSig, rec[recSig:recLens+8*len(lens)])); err != nil {
		return err
	}
	if err := x.rma.Fence(); err != nil {
		return err
	}
	// The epoch word of a slot goes s+1, s+1+bufs, ...: add what takes it from the last.
	d := o.epoch
	if d > uint64(x.bufs) {
		d = uint64(x.bufs)
	}
	return track(x.rma.Signal(wq, at+recEpoch, d))
}
