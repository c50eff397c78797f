package bench

import (
	"context"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport"
)

// naiveDispatch sends one message per (token, expert) pair, each with its own row and
// metadata, all posted at once: the per-message cost the fused path avoids (and the
// bytes of tokens sent once per expert instead of once per rank). Buffers are allocated
// once, outside the timing, so that the comparison is of messages, not of allocation.
// It returns the slowest rank's time and the total number of messages.
func naiveDispatch(ctx context.Context, c *coll.Comm, x []float32, r *router.Routing, pl *router.Placement, hid int, wire dtype.Type) (float64, int64, error) {
	p, me := c.Size(), c.Rank()
	tr := c.Transport()
	rowBytes := 8 + hid*wire.Size()
	counts := make([]int64, p)
	for i, e := range r.Experts {
		if e >= 0 {
			counts[pl.RankOf(int(e), me, i/r.K)]++
		}
	}
	all := make([]int64, p*p)
	if err := coll.AllGather(ctx, c, counts, all); err != nil {
		return 0, 0, err
	}
	var nIn, nOut int64
	for q := 0; q < p; q++ {
		nIn += all[q*p+me]
		nOut += counts[q]
	}
	inBufs, outBufs := make([][]byte, nIn), make([][]byte, nOut)
	for i := range inBufs {
		inBufs[i] = make([]byte, rowBytes)
	}
	for i := range outBufs {
		outBufs[i] = make([]byte, rowBytes)
	}
	reqs := make([]transport.Request, 0, nIn+nOut)
	sent := make([]int, p)
	const iters = 3
	var el time.Duration
	for it := 0; it <= iters; it++ {
		if err := coll.Barrier(ctx, c); err != nil {
			return 0, 0, err
		}
		start := time.Now()
		// The counts exchange, as the fused path does.
		if err := coll.AllGather(ctx, c, counts, all); err != nil {
			return 0, 0, err
		}
		reqs = reqs[:0]
		tag := transport.Tag{Comm: 0x6e616976, Seq: uint32(it)} // a private tag space
		k := 0
		for q := 0; q < p; q++ {
			for i := 0; i < int(all[q*p+me]); i++ {
				tag.Tag = uint32(i)
				rq, err := tr.Irecv(c.WorldRank(q), tag, inBufs[k])
				if err != nil {
					return 0, 0, err
				}
				k++
				reqs = append(reqs, rq)
			}
		}
		clear(sent)
		k = 0
		for i, e := range r.Experts {
			if e < 0 {
				continue
			}
			t := i / r.K
			q := pl.RankOf(int(e), me, t)
			buf := outBufs[k]
			k++
			if wire == dtype.BF16 {
				dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](buf[8:]), x[t*hid:(t+1)*hid])
			} else {
				copy(buf[8:], dtype.Bytes(x[t*hid:(t+1)*hid]))
			}
			tag.Tag = uint32(sent[q])
			sent[q]++
			rq, err := tr.Isend(c.WorldRank(q), tag, buf)
			if err != nil {
				return 0, 0, err
			}
			reqs = append(reqs, rq)
		}
		if err := transport.WaitAll(ctx, reqs...); err != nil {
			return 0, 0, err
		}
		if it > 0 {
			el += time.Since(start)
		}
	}
	v := []float64{el.Seconds() / iters * 1e6}
	if err := coll.AllReduce(ctx, c, nil, v, dtype.Max); err != nil {
		return 0, 0, err
	}
	m := []int64{nOut}
	if err := coll.AllReduce(ctx, c, nil, m, dtype.Sum); err != nil {
		return 0, 0, err
	}
	return v[0], m[0], nil
}
