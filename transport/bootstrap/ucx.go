//go:build ucx

package bootstrap

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/ucx"
)

func init() { openOptional = openUCX }

// openUCX opens UCX for peers (nil: every rank). Forced (MOEX_TRANSPORT=ucx) it is used
// whatever its lanes; otherwise only when every rank reaches its remote peers over RDMA:
// UCX over TCP is no better than moex's own tcp, which is tuned for this traffic.
func openUCX(ctx context.Context, env Env, rv *Rendezvous, peers []bool, force bool, poll busypoll.Config, log *slog.Logger) (transport.Transport, string, error) {
	w := os.Getenv("MOEX_WINDOWS")
	u, err := ucx.New(ctx, ucx.Config{Rank: env.Rank, Size: env.Size, Exchange: rv.AllGather, Peers: peers, Poll: poll, Logger: log,
		EmulatedWindows: w == "1" || w == "on"})
	if err != nil {
		if force {
			return nil, "", err
		}
		// ucx.New fails on every rank alike (its exchanges carry the failure).
		return nil, "UCX failed to start (" + err.Error() + ")", nil
	}
	lanes := lanesSummary(u, env.Rank, env.Size)
	switch {
	case force:
		return u, "ucx: MOEX_TRANSPORT=ucx (UCX " + ucx.Version() + " lanes " + lanes + ")", nil
	case u.AllRDMA():
		return u, "ucx: RDMA to every remote peer (UCX " + ucx.Version() + " lanes " + lanes + ")", nil
	}
	u.Close()
	return nil, "UCX " + ucx.Version() + " offers no RDMA lane to some rank (lanes here " + lanes + "); moex tcp is faster than UCX over TCP", nil
}

// lanesSummary lists the distinct UCX transports in use to the peers served.
func lanesSummary(u *ucx.Transport, rank, size int) string {
	seen := map[string]bool{}
	var out []string
	for q := 0; q < size; q++ {
		if q == rank {
			continue
		}
		for _, l := range u.Lanes(q) {
			if !seen[l] {
				seen[l] = true
				out = append(out, l)
			}
		}
	}
	if len(out) == 0 {
		return "[]"
	}
	return fmt.Sprintf("[%s]", strings.Join(out, " "))
}
