package bench

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
)

// P2PResult is one row of `moex bench p2p`.
type P2PResult struct {
	Transport string  `json:"transport"`
	Bytes     int     `json:"bytes"`
	RTTUS     float64 `json:"rtt_us"`        // round trip of a message of this size
	GBs       float64 `json:"bandwidth_gbs"` // one way, back-to-back messages
	MemcpyGBs float64 `json:"memcpy_gbs"`
	Path      string  `json:"path"`
}

// P2P measures ranks 0 and 1 of c (other ranks idle) for each size; rows on rank 0.
func P2P(ctx context.Context, c *coll.Comm, sizes []int, iters int) ([]P2PResult, error) {
	if c.Size() < 2 {
		return nil, fmt.Errorf("bench: p2p needs 2 ranks, have %d", c.Size())
	}
	var rows []P2PResult
	r := c.Rank()
	for _, size := range sizes {
		buf := make([]byte, size)
		it := iters
		if it <= 0 {
			it = max(10, min(2000, (256<<20)/max(size, 1)))
		}
		if err := coll.Barrier(ctx, c); err != nil {
			return nil, err
		}
		var rtt, bw float64
		if r <= 1 {
			peer := 1 - r
			roundTrips := func(n int) error {
				for i := 0; i < n; i++ {
					if r == 0 {
						if err := coll.Send(ctx, c, buf, peer, 1); err != nil {
							return err
						}
						if _, err := coll.Recv(ctx, c, buf, peer, 2); err != nil {
							return err
						}
					} else {
						if _, err := coll.Recv(ctx, c, buf, peer, 1); err != nil {
							return err
						}
						if err := coll.Send(ctx, c, buf, peer, 2); err != nil {
							return err
						}
					}
				}
				return nil
			}
			// Warm up (connections made on first use, pollers' learned spin budgets,
			// registrations), then time the round trips.
			if err := roundTrips(max(2, it/10)); err != nil {
				return nil, err
			}
			start := time.Now()
			if err := roundTrips(it); err != nil {
				return nil, err
			}
			rtt = time.Since(start).Seconds() / float64(it)
			// One way, then one acknowledgement.
			start = time.Now()
			for i := 0; i < it; i++ {
				if r == 0 {
					if err := coll.Send(ctx, c, buf, peer, 3); err != nil {
						return nil, err
					}
				} else if _, err := coll.Recv(ctx, c, buf, peer, 3); err != nil {
					return nil, err
				}
			}
			ack := []byte{1}
			if r == 0 {
				if _, err := coll.Recv(ctx, c, ack, peer, 4); err != nil {
					return nil, err
				}
			} else if err := coll.Send(ctx, c, ack, peer, 4); err != nil {
				return nil, err
			}
			el := time.Since(start).Seconds()
			bw = float64(size) * float64(it) / el / 1e9
		}
		if r == 0 {
			row := P2PResult{Transport: c.Transport().Name(), Bytes: size, RTTUS: rtt * 1e6, GBs: bw, MemcpyGBs: Memcpy(size)}
			if pr, ok := c.Transport().(interface{ Path(int) string }); ok {
				row.Path = pr.Path(c.WorldRank(1))
			}
			rows = append(rows, row)
		}
	}
	// Everyone leaves together.
	x := []int32{0}
	return rows, coll.AllReduce(ctx, c, nil, x, dtype.Sum)
}

// PrintP2P writes the rows as a table.
func PrintP2P(w io.Writer, rows []P2PResult) {
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(w, "# moex bench p2p: transport %s (%s)\n", rows[0].Transport, rows[0].Path)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "size (B)\trtt (us)\tbandwidth (GB/s)\tmemcpy (GB/s)\tratio\t")
	for _, r := range rows {
		ratio := 0.0
		if r.MemcpyGBs > 0 {
			ratio = r.GBs / r.MemcpyGBs
		}
		fmt.Fprintf(tw, "%d\t%.1f\t%.2f\t%.1f\t%.3f\t\n", r.Bytes, r.RTTUS, r.GBs, r.MemcpyGBs, ratio)
	}
	tw.Flush()
}
