package ep

import (
	"context"
	"fmt"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
)

// The gathered mode: every rank sums its experts' outputs for every token (zeros for the
// tokens none of its experts took) and one ReduceScatterv, in the combine type, brings
// each rank the sum of its own tokens' rows, summed in the reduce-scatter's order. A
// small all-gather of every rank's status and dispatch runs beside it, so that a rank
// whose call is bad (it sends zeros) fails every rank in the same call.

func (s *cslot[T]) startGathered(ctx context.Context, y []T) error {
	cb := s.cb
	c := cb.c
	p := c.Size()
	h := s.h
	hid, rb := cb.cfg.Hidden, cb.f.Combined
	s.gcounts = growInts(s.gcounts, p)
	total := 0
	for q := 0; q < p; q++ {
		a, b := h.Incoming(q)
		s.gcounts[q] = (b - a) * hid
		total += b - a
	}
	part := s.sendS.Bytes(total * rb)
	for g := 0; g < total; g++ {
		dst := part[g*rb : (g+1)*rb]
		if s.code == CodeOK {
			s.partial(dst, y, g)
		} else {
			clear(dst)
		}
	}
	s.st[0], s.st[1], s.st[2] = int64(s.code), int64(h.Fingerprint()), int64(h.Generation())
	s.stAll = growI64(s.stAll, 3*p)
	if err := coll.IAllGatherWith(ctx, c, s.st[:], s.stAll, &s.sh); err != nil {
		return err
	}
	mine := s.gcounts[c.Rank()]
	if cb.f.Combine == dtype.F32 {
		recv := dtype.FromBytes[float32](s.accS.Bytes(mine * 4))
		if isF32[T]() && s.code == CodeOK {
			recv = dtype.FromBytes[float32](dtype.Bytes(s.out))
		}
		s.acc = recv
		return coll.IReduceScattervWith(ctx, c, dtype.FromBytes[float32](part), recv, s.gcounts, dtype.Sum, &s.pend)
	}
	recv := dtype.FromBytes[dtype.BFloat16](s.accS.Bytes(mine * 2))
	if !isF32[T]() && s.code == CodeOK {
		recv = dtype.FromBytes[dtype.BFloat16](dtype.Bytes(s.out))
	}
	s.accB = recv
	return coll.IReduceScattervWith(ctx, c, dtype.FromBytes[dtype.BFloat16](part), recv, s.gcounts, dtype.Sum, &s.pend)
}

func (s *cslot[T]) waitGathered(ctx context.Context) error {
	err := s.pend.Wait(ctx)
	if e := s.sh.Wait(ctx); err == nil {
		err = e
	}
	if err != nil {
		return err
	}
	if s.inErr != nil {
		return s.inErr
	}
	for q := 0; q < s.cb.c.Size(); q++ {
		code, fp, gen := s.stAll[3*q], uint64(s.stAll[3*q+1]), uint64(s.stAll[3*q+2])
		switch {
		case fp != s.h.Fingerprint():
			return fmt.Errorf("%w: rank %d combines the dispatches of another configuration or placement", ErrMismatch, q)
		case code != CodeOK:
			return &PeerInputError{Rank: q, Code: int(code)}
		case gen != s.h.Generation():
			return fmt.Errorf("%w: rank %d combines dispatch %d, this rank dispatch %d", ErrMismatch, q, gen, s.h.Generation())
		}
	}
	// The sum arrived in the combine type: into out, unless out is of another type.
	n := len(s.out)
	switch {
	case s.cb.f.Combine == dtype.F32 && !isF32[T]():
		dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](dtype.Bytes(s.out)), s.acc[:n])
	case s.cb.f.Combine == dtype.BF16 && isF32[T]():
		dtype.BF16ToF32(dtype.FromBytes[float32](dtype.Bytes(s.out)), s.accB[:n])
	}
	return nil
}

func growI64(s []int64, n int) []int64 {
	if cap(s) < n {
		return make([]int64, n)
	}
	return s[:n]
}
