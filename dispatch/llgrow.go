package dispatch

import (
	"context"
	"errors"
	"math/bits"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
)

// Growing the Auto mode's low-latency buffers. A step that some rank's tokens do not fit
// fails its low-latency attempt on every rank alike (the headers say so). Where the rows
// and the expert outputs are read in place (every rank maps every rank's memory), every
// rank then grows the buffers of the dispatcher and of its combiners for the step's
// largest token count, rounded up to a power of two, and the step runs again in the
// low-latency mode: a prefill step moves each row once, as a decode step does, rather
// than through the normal mode's AlltoAllv. The decision is the headers', so it is the
// same on every rank: the grown buffers must fit Config.MaxBufferBytes, and no rank may
// have another dispatch in use (the grown buffers replace every slot's).

// grow grows the buffers for step s, whose headers op holds, if every rank
// can, and returns the protocol over the grown buffers (nil where they did not grow).
// It is collective (every rank that reads the same headers makes the same choice).
func (m *lowLatency) grow(ctx context.Context, s *step, op *coll.XOp) (*lowLatency, error) {
	d := m.d
	if d.cfg.MaxBufferBytes < 0 || m.rowsPer == 0 || len(d.backs) == 0 {
		return nil, nil // nothing read in place, or no combiner to grow with
	}
	// Another dispatch started since this one (its header could not say so): its
	// buffers are in use. Every rank is in the same state here, as ranks start and wait
	// for their dispatches in the same order (the fallback's collectives need it too).
	if !d.othersFree(s.idx) {
		return nil, nil
	}
	most := 0
	for q := 0; q < d.c.Size(); q++ {
		h := readHeader(op.Recv(q, 0))
		if h.flags&flagBusy != 0 {
			return nil, nil
		}
		most = max(most, int(h.flags>>32))
	}
	backs := make([]backOf, len(d.backs))
	for i, cb := range d.backs {
		backs[i] = backOf{cb.cfg, cb.out}
	}
	mt := grownTokens(d.cfg, d.act, backs, most)
	if mt == 0 {
		return nil, nil
	}
	cfg := d.cfg
	cfg.MaxTokens = mt
	// From here every rank makes the same buffers, collectively, in the same order.
	old := d.cfg
	d.cfg = cfg
	m2, err := newLowLatency(ctx, d)
	if err != nil {
		d.cfg = old
		return nil, err
	}
	closers := []func() error{m.close}
	for _, cb := range d.backs {
		closeOld, err := cb.regrow(ctx, m2)
		if err != nil {
			// The ranks fail together (the makings are collective); what was made is freed.
			d.cfg = old
			return nil, errors.Join(err, m2.close())
		}
		closers = append(closers, closeOld)
	}
	for _, o := range d.slots {
		o.valid = false // their buffers are gone: their Outputs and Handles are stale
	}
	d.fp, d.fpBuf = fingerprint(d.fpBuf, d.cfg)
	// The old buffers go once the step has run again: its tokens may lie in the old
	// staging (Dispatcher.Buffer), where the run again reads them.
	d.retired = append(d.retired, closers...)
	return m2, nil
}

// retire frees the buffers a growth replaced.
func (d *core) retire() error {
	var errs []error
	for _, c := range d.retired {
		errs = append(errs, c())
	}
	d.retired = d.retired[:0]
	return errors.Join(errs...)
}

// backOf is what the size of a combiner's buffers depends on.
type backOf struct {
	cfg CombineConfig
	out dtype.Type
}

// grownTokens is the MaxTokens the low-latency buffers of a dispatcher of cfg (defaults
// filled; its activations act) and of its combiners grow to for a step whose largest
// rank has most tokens: the next power of two, where the buffers of the rows read in
// place then fit cfg.MaxBufferBytes; 0 where they do not grow.
func grownTokens(cfg Config, act dtype.Type, backs []backOf, most int) int {
	if cfg.MaxBufferBytes < 0 || most <= cfg.MaxTokens || len(backs) == 0 {
		return 0
	}
	mt := 1 << bits.Len(uint(most-1)) // the next power of two
	if mt > MaxLowLatencyTokens {
		return 0
	}
	cfg.MaxTokens = mt
	if stagingRows(NewFormat(cfg), mt, cfg.Placement.Ranks) == 0 {
		return 0 // too large to stage in place
	}
	need := llBytes(cfg, act, true)
	for _, b := range backs {
		need += llCombineBytes(cfg, b.cfg, b.out, true)
	}
	if need > cfg.MaxBufferBytes {
		return 0
	}
	return mt
}
