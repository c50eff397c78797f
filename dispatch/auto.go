package dispatch

import (
	"context"
	"errors"
	"fmt"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
)

// auto is the Auto mode: a choice, per step, between the low-latency protocol and the
// normal one, which every rank makes alike without a round of its own. Every step tries
// the low-latency exchange; a rank whose tokens do not fit says so in its headers
// (codeTooMany). Reading them, every rank then grows the low-latency buffers for the step
// and runs it again (lowLatency.grow, where every rank maps every rank's memory and the
// grown buffers fit Config.MaxBufferBytes), or runs it in the normal mode. The slot
// records which protocol ran the step (slot.m): its schedule, its view and the combine's
// way back are that protocol's. Nothing outside this file knows that a step may change
// protocols.
type auto struct {
	d    *core
	ll   *lowLatency // replaced when it grows
	nm   *normal
	last flat // the protocol of the last step that completed
}

// errOverflow is the low-latency attempt of a step that some rank's tokens did not fit:
// every rank then runs the step in the normal protocol.
var errOverflow = errors.New("dispatch: the step does not fit the low-latency buffers")

// errGrown is the low-latency attempt of a step that some rank's tokens did not fit,
// after which every rank grew the buffers: every rank then runs the step again.
var errGrown = errors.New("dispatch: the low-latency buffers grew for the step")

func newAuto(ctx context.Context, d *core) (*auto, error) {
	a := &auto{d: d, nm: newNormal(d)}
	ll, err := newLowLatency(ctx, d)
	if err != nil {
		return nil, err
	}
	a.ll, a.last = ll, ll
	ll.overflow = a.overflow
	return a, nil
}

func (a *auto) flats() []flat      { return []flat{a.ll, a.nm} }
func (a *auto) capacity() int      { return 0 } // a step that does not fit runs anyway
func (a *auto) readsInPlace() bool { return a.last.readsInPlace() }

// staging is the low-latency protocol's: the next step tries it first.
func (a *auto) staging(idx int) []byte { return a.ll.staging(idx) }

func (a *auto) bytes() int { return a.ll.bytes() + a.nm.bytes() }

func (a *auto) close() error { return errors.Join(a.ll.close(), a.nm.close()) }

func (a *auto) start(ctx context.Context, s *step) error {
	if s.reuse {
		return s.m.start(ctx, s) // Redispatch: the protocol that ran the step
	}
	// Tokens that do not fit are not this rank's bad input here (the Auto mode's
	// capacity is any number, so nothing else says codeTooMany): the attempt says so in
	// its headers, and wait runs the step another way.
	if s.code == codeOK && s.tokens > a.ll.capacity() {
		s.code, s.inErr = codeTooMany, fmt.Errorf("%w: %d tokens, MaxTokens is %d", ErrInput, s.tokens, a.ll.capacity())
	}
	return a.ll.start(ctx, s)
}

func (a *auto) wait(ctx context.Context, s *step) (arrived, error) {
	got, err := s.m.wait(ctx, s)
	grown := errors.Is(err, errGrown)
	if grown || errors.Is(err, errOverflow) {
		if s.code == codeTooMany { // this rank's tokens are good: they only did not fit
			s.code, s.inErr = codeOK, nil
		}
		s.moved = moved{}
		if grown {
			// Every rank grew its buffers for the step: every rank runs it again in the
			// low-latency protocol, then frees the old buffers (the tokens may lie in
			// the old staging).
			s.fp = a.d.fp
			if err = a.ll.start(ctx, s); err == nil {
				got, err = a.ll.wait(ctx, s)
			}
			err = errors.Join(err, a.d.retire())
		} else if err = a.nm.start(ctx, s); err == nil {
			got, err = a.nm.wait(ctx, s)
		}
	}
	if err == nil {
		a.last = s.m
	}
	return got, err
}

// overflow is what the low-latency protocol does, in the Auto mode, with a step that some
// rank's tokens did not fit, whose headers op holds: it grows the buffers if every rank
// can (errGrown), else the step runs in the normal mode (errOverflow). Every rank reads
// the same headers, so every rank decides alike.
func (a *auto) overflow(ctx context.Context, s *step, op *coll.XOp) error {
	m2, err := a.ll.grow(ctx, s, op)
	switch {
	case err != nil:
		return err
	case m2 != nil:
		m2.overflow, a.ll = a.overflow, m2
		return errGrown
	}
	return errOverflow
}

// autoPolicy is the Auto mode's policy: a step takes the low-latency protocol when every
// rank's tokens fit MaxTokens; else, where the rows and outputs are read in place, the
// buffers grow for it (grownTokens) and it takes the low-latency protocol over them;
// else the normal one. The rest is the low-latency protocol's, which every step tries.
type autoPolicy struct{ llPlan }

func (autoPolicy) step(cfg Config, ccfg CombineConfig, out dtype.Type, most int, shared bool) (Config, CombineConfig) {
	cfg.Mode = LowLatency
	if most <= cfg.MaxTokens {
		return cfg, ccfg
	}
	mt := 0
	if c, err := combineDefaults(cfg, ccfg, out); err == nil {
		if rows, _ := (llPlan{}).inPlace(cfg, c, out, shared); rows {
			mt = grownTokens(cfg, out, []backOf{{c, out}}, most)
		}
	}
	if mt > 0 {
		cfg.MaxTokens = mt
		return cfg, ccfg
	}
	cfg.Mode, cfg.PushRows, ccfg.SendPartials = Normal, false, false
	return cfg, ccfg
}
