package ep

import (
	"context"
	"fmt"

)

// The normal mode: one AlltoAllv of blocks, each a BlockHeader and the partial
// sums of the rows the destination sent this rank, in the order it sent them. A rank
// whose call is bad still sends every block its handle's layout calls for (header set,
// rows left as they are), so that the sizes agree and every rank learns.

func (s *cslot[T]) startNormal(ctx context.Context, y []T) error {
	cb := s.cb
	c := cb.c
	p, me := c.Size(), c.Rank()
	h := s.h
	back := h.Back()
	for i := 0; i < p; i++ {
		for j := 0; j < p; j++ {
			s.bytes[i][j] = 0
			if i != j {
				s.bytes[i][j] = BlockHeader + s.normalBlock(h, i, j)
			}
		}
	}
	if err := c.ReplanAlltoAllv(&s.plan, s.bytes, 1); err != nil {
		return err
	}
	s.send = s.sendS.Bytes(s.plan.SendBytes())
	s.recv = s.recvS.Bytes(s.plan.RecvBytes())
	off := 0
	for q := 0; q < p; q++ {
		if q == me {
			continue
		}
		n := back[me][q]
		PutHeader(s.send[off:], s.code, n, h.Fingerprint(), h.Generation())
		off += BlockHeader
		a, _ := h.Incoming(q)
		switch {
		case s.code != CodeOK:
		case cb.cfg.SumAtOrigin:
			s.putTerms(s.send[off:], y, a, a+n)
		default:
			rb := cb.f.Combined
			for i := a; i < a+n; i++ {
				s.partial(s.send[off+(i-a)*rb:off+(i-a+1)*rb], y, i)
			}
		}
		off += s.normalBlock(h, me, q)
	}
	return c.IRunAlltoAllvWith(ctx, &s.plan, s.send, s.recv, &s.pend)
}

func (s *cslot[T]) waitNormal(ctx context.Context) error {
	cb := s.cb
	p, me := cb.c.Size(), cb.c.Rank()
	if err := s.pend.Wait(ctx); err != nil {
		return err
	}
	h := s.h
	back := h.Back()
	var first error
	off := 0
	for q := 0; q < p; q++ {
		if q == me {
			continue
		}
		n := back[q][me]
		if err := s.checkHeader(q, s.recv[off:off+BlockHeader], n); err != nil && first == nil {
			first = err
		}
		off += BlockHeader + s.normalBlock(h, q, me)
	}
	if s.inErr != nil || first != nil {
		if s.inErr != nil {
			return s.inErr
		}
		return first
	}
	off = 0
	for q := 0; q < p; q++ {
		if q == me {
			continue
		}
		off += BlockHeader
		n := s.normalBlock(h, q, me)
		s.parts[q] = s.recv[off : off+n]
		off += n
	}
	return nil
}

// normalBlock is the size, after its header, of the block rank i sends rank j in the
// normal mode: a partial sum per row, or with SumAtOrigin the rows' terms.
func (s *cslot[T]) normalBlock(h Handle, i, j int) int {
	if s.cb.cfg.SumAtOrigin {
		return termsBytes(h.Back()[i][j], h.BackTerms()[i][j], s.cb.cfg.Hidden, elemSize[T]())
	}
	return h.Back()[i][j] * s.cb.f.Combined
}

// The low-latency mode: one exchange of two fields, the header and the partial sums; in
// place (inplace.go), the header alone, once this rank's outputs are published.

func (s *cslot[T]) startLL(ctx context.Context, y []T) error {
	cb := s.cb
	me := cb.c.Rank()
	h := s.h
	rb := cb.f.Combined
	if cb.board != nil && s.code == CodeOK {
		s.publish(y)
	}
	op, err := cb.x.Begin(ctx)
	if err != nil {
		return err
	}
	s.op = op
	for {
		q, dst, err := op.NextDest(ctx)
		if err != nil {
			return err
		}
		if q < 0 {
			return nil
		}
		n, sums := 0, 0
		if s.code == CodeOK && q != me {
			a, b := h.Incoming(q)
			n = b - a
			switch {
			case cb.board != nil:
			case cb.cfg.SumAtOrigin:
				sums = s.putTerms(dst[1], y, a, b)
			default:
				for i := a; i < b; i++ {
					s.partial(dst[1][(i-a)*rb:(i-a+1)*rb], y, i)
				}
				sums = n * rb
			}
		}
		PutHeader(dst[0], s.code, n, h.Fingerprint(), h.Generation())
		if err := op.Send(q, BlockHeader, sums); err != nil {
			return err
		}
	}
}

func (s *cslot[T]) waitLL(ctx context.Context) error {
	cb := s.cb
	p, me := cb.c.Size(), cb.c.Rank()
	op := s.op
	s.op = nil
	if err := op.Wait(ctx); err != nil {
		return err
	}
	h := s.h
	rb := cb.f.Combined
	var first error
	for q := 0; q < p; q++ {
		if q == me {
			continue
		}
		hb := op.Recv(q, 0)
		if len(hb) < BlockHeader {
			if first == nil {
				first = fmt.Errorf("%w: rank %d sent a %d-byte combine block", ErrMismatch, q, len(hb))
			}
			continue
		}
		n := 0
		if s.code == CodeOK {
			n = len(h.RowsTo(q))
		}
		err := s.checkHeader(q, hb, n)
		want := n * rb
		if cb.cfg.SumAtOrigin && s.code == CodeOK {
			want = s.termsExpected(q)
		}
		if err == nil && s.code == CodeOK && cb.board == nil && len(op.Recv(q, 1)) != want {
			err = fmt.Errorf("%w: rank %d sent %d bytes of partial sums for %d rows (want %d)", ErrMismatch, q, len(op.Recv(q, 1)), n, want)
		}
		if err != nil && first == nil {
			first = err
		}
	}
	if s.inErr != nil {
		return s.inErr
	}
	if first != nil {
		return first
	}
	for q := 0; q < p; q++ {
		if q != me && cb.board == nil {
			s.parts[q] = op.Recv(q, 1)
		}
	}
	return nil
}
