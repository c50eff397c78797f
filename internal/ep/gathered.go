package ep

import (
	"context"
	"encoding/binary"
	"fmt"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/router"
)

// The gathered mode (data-parallel attention with expert parallelism, vLLM's AgRs): a
// small all-gather of every rank's status and token count, then three AllGathervs issued
// together: every token's routing (GatheredMeta bytes: its index, its choices and their
// weights), its row, its scales. Every rank then sees every token, and its experts take
// the ones that chose them; package combine reduce-scatters the weighted sums back.
// Every token crosses to every rank: the mode trades bytes for the simplest exchange.

// GatheredMeta is the bytes of a token's routing in the gathered mode.
func (f Format) GatheredMeta() int { return 8 + 8*f.TopK }

func (s *slot[T]) startGathered(ctx context.Context, x []T, r *router.Routing, code int, inErr error, reuse bool) error {
	d := s.d
	sc := s.sc
	c := d.c
	p := c.Size()
	f := &d.f
	if !reuse && code == CodeOK {
		sc.tokens, sc.r = r.T, r
	}
	for q := 0; q < p; q++ {
		s.hdr[hdrLen+q] = 0
	}
	if code == CodeOK {
		s.hdr[hdrLen] = int64(sc.tokens)
	}
	if err := s.agree(ctx, code, inErr); err != nil {
		return err
	}
	w := hdrLen + p
	sc.from = growInts(sc.from, p)
	total := 0
	for q := 0; q < p; q++ {
		n := int(s.all[q*w+hdrLen])
		if n < 0 || n > 1<<24 {
			return fmt.Errorf("%w: rank %d says it has %d tokens", ErrMismatch, q, n)
		}
		sc.from[q] = n
		total += n
	}
	s.x, s.code, s.inErr = x, code, inErr
	// This rank's routing, rows and scales, each packed; then every rank's.
	gm, sb := f.GatheredMeta(), f.ScaleBytes()
	t := sc.tokens
	own := s.sendS.Bytes(t * (gm + f.Payload + sb))
	meta, pay, sca := own[:t*gm], own[t*gm:t*(gm+f.Payload)], own[t*(gm+f.Payload):]
	for i := 0; i < t; i++ {
		m := meta[i*gm : (i+1)*gm]
		binary.LittleEndian.PutUint32(m[0:], uint32(i))
		binary.LittleEndian.PutUint32(m[4:], uint32(r.K))
		for j := 0; j < r.K; j++ {
			binary.LittleEndian.PutUint32(m[8+8*j:], uint32(r.Experts[i*r.K+j]))
			putF32(m[12+8*j:], r.Weights[i*r.K+j])
		}
	}
	if f.Wire == d.act {
		pay = dtype.Bytes(x) // no copy: the rows are gathered from x itself
	} else {
		hid := d.cfg.Hidden
		for i := 0; i < t; i++ {
			encode(f, pay[i*f.Payload:(i+1)*f.Payload], dtype.FromBytes[float32](sca[i*sb:(i+1)*sb]), dtype.Bytes(x[i*hid:(i+1)*hid]), d.act, d.cfg.PowerOfTwoScales)
		}
	}
	all := s.recvS.Bytes(total * (gm + f.Payload + sb))
	s.gMeta, s.gPay, s.gSca = all[:total*gm], all[total*gm:total*(gm+f.Payload)], all[total*(gm+f.Payload):]
	s.gcounts = growInts(s.gcounts, p)
	var err error
	for k, v := range [3]struct {
		per       int
		send, got []byte
	}{{gm, meta, s.gMeta}, {f.Payload, pay, s.gPay}, {sb, sca, s.gSca}} {
		for q := range s.gcounts {
			s.gcounts[q] = sc.from[q] * v.per
		}
		if err = coll.IAllGathervWith(ctx, c, v.send, v.got, s.gcounts, nil, &s.gh[k]); err != nil {
			return err
		}
	}
	st := &s.stats
	st.RowsSent, st.Assignments = t*(p-1), 0
	for _, e := range r.Experts {
		if e >= 0 {
			st.Assignments++
		}
	}
	st.BytesSent = (p - 1) * t * (gm + f.Payload + sb)
	st.RowsReceived = total - t
	st.BytesReceived = (total - t) * (gm + f.Payload + sb)
	st.RowsPerRank = growInts(st.RowsPerRank, p)
	for q := range st.RowsPerRank {
		st.RowsPerRank[q] = t
	}
	return nil
}

func (s *slot[T]) waitGathered(ctx context.Context) error {
	d := s.d
	var first error
	for k := range s.gh {
		if err := s.gh[k].Wait(ctx); err != nil && first == nil {
			first = err
		}
	}
	if first != nil {
		return first
	}
	if err := s.viewGathered(); err != nil {
		return err
	}
	d.stats = s.stats
	return nil
}

// viewGathered builds the expert-major view over every rank's tokens (in rank order, then
// each rank's token order): an entry per choice of a local expert.
func (s *slot[T]) viewGathered() error {
	d := s.d
	sc := s.sc
	p, me, hid, k := d.c.Size(), d.c.Rank(), d.cfg.Hidden, d.cfg.TopK
	pl := sc.pl
	f := &d.f
	gm := f.GatheredMeta()
	nLocal := len(pl.Local[me])
	total := len(s.gMeta) / gm
	o := &s.out
	o.hidden, o.ExpertMajor, o.format = hid, false, f
	o.Counts = growInts(o.Counts, nLocal)
	clear(o.Counts)
	o.Offsets = growInts(o.Offsets, nLocal+1)
	// each calls fn for every local choice of every token, checking what came from the wire.
	each := func(fn func(q, i, g, le int, w float32)) error {
		g := 0
		for q := 0; q < p; q++ {
			for i := 0; i < sc.from[q]; i++ {
				m := s.gMeta[g*gm : (g+1)*gm]
				if int(binary.LittleEndian.Uint32(m[0:])) != i || int(binary.LittleEndian.Uint32(m[4:])) != k {
					return fmt.Errorf("%w: rank %d's token %d came with bad routing", ErrMismatch, q, i)
				}
				for j := 0; j < k; j++ {
					e := int(int32(binary.LittleEndian.Uint32(m[8+8*j:])))
					if e < -1 || e >= pl.Experts {
						return fmt.Errorf("%w: rank %d's token %d chose expert %d of %d", ErrMismatch, q, i, e, pl.Experts)
					}
					if e >= 0 && pl.RankOf(e, q, i) == me {
						fn(q, i, g, pl.LocalIndex(me, e), getF32(m[12+8*j:]))
					}
				}
				g++
			}
		}
		return nil
	}
	contribs := 0
	if err := each(func(_, _, _, le int, _ float32) { o.Counts[le]++; contribs++ }); err != nil {
		return err
	}
	entries := layoutEntries(o, d.cfg.Align)
	s.allocEntries(entries, total, contribs)
	switch {
	case d.cfg.Quantized:
		o.X, o.Q, o.Scales = nil, s.gPay, dtype.FromBytes[float32](s.gSca)
	case f.Wire == d.act:
		o.X, o.Q, o.Scales = dtype.FromBytes[T](s.gPay), nil, nil // where the rows arrived
	default:
		o.X, o.Q, o.Scales = dtype.FromBytes[T](s.xS.Bytes(total*hid*int(sizeOf[T]()))), nil, nil
		sca := dtype.FromBytes[float32](s.gSca)
		for g := 0; g < total; g++ {
			decode(f, dtype.Bytes(o.X[g*hid:(g+1)*hid]), d.act, s.gPay[g*f.Payload:(g+1)*f.Payload], sca[g*f.Scales:(g+1)*f.Scales])
		}
	}
	s.padEntries(false)
	fill := d.fillScratch(nLocal)
	// Incoming rows are every rank's tokens; a token's entries are its local choices (in
	// the order of its choices), none for the others.
	ci, row := 0, 0
	for q := 0; q <= p; q++ {
		sc.originStart[q] = row
		if q < p {
			row += sc.from[q]
		}
	}
	last := -1
	_ = each(func(q, i, g, le int, w float32) {
		for last < g {
			last++
			sc.start[last] = int32(ci)
		}
		dst := o.Offsets[le] + fill[le]
		fill[le]++
		o.Row[dst] = int32(g)
		o.Origin[dst], o.Source[dst], o.Weight[dst] = int32(q), int32(i), w
		o.Expert[dst] = int32(pl.Local[me][le])
		sc.entries[ci], sc.weights[ci] = int32(dst), w
		ci++
	})
	for last < total {
		last++
		sc.start[last] = int32(ci)
	}
	return nil
}
