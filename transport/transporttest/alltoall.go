package transporttest

import (
	"context"
	"fmt"
	"time"

	"github.com/moex-ai/moex/transport"
)

// AllToAll is one rank's part of an all-to-all exchange through tr, for tests that run
// ranks as processes: iters rounds after warmup ones, every pair exchanging size(from,
// to) patterned bytes each round, every byte checked at the end. It returns the time per
// timed round.
func AllToAll(ctx context.Context, tr transport.Transport, rank, n, warmup, iters int, size func(from, to int) int) (time.Duration, error) {
	send := make([][]byte, n)
	recv := make([][]byte, n)
	for p := 0; p < n; p++ {
		send[p] = make([]byte, size(rank, p))
		Pattern(send[p], uint64(rank*100+p))
		recv[p] = make([]byte, size(p, rank))
	}
	reqs := make([]transport.Request, 0, 2*n)
	var start time.Time
	for it := 0; it < warmup+iters; it++ {
		if it == warmup {
			start = time.Now()
		}
		reqs = reqs[:0]
		tg := transport.Tag{Comm: 1, Seq: uint32(it)}
		for p := 0; p < n; p++ {
			r, err := tr.Irecv(p, tg, recv[p])
			if err != nil {
				return 0, err
			}
			reqs = append(reqs, r)
		}
		for p := 0; p < n; p++ {
			s, err := tr.Isend(p, tg, send[p])
			if err != nil {
				return 0, err
			}
			reqs = append(reqs, s)
		}
		if err := transport.WaitAll(ctx, reqs...); err != nil {
			return 0, err
		}
	}
	el := time.Since(start)
	for p := 0; p < n; p++ {
		if err := Check(recv[p], uint64(p*100+rank)); err != nil {
			return 0, fmt.Errorf("from rank %d: %w", p, err)
		}
	}
	return el / time.Duration(max(iters, 1)), nil
}
