package ucx

import (
	"context"
	"log/slog"
	"strings"
	"time"

	"github.com/moex-ai/moex/busypoll"
)

// Config describes one rank's UCX endpoint.
type Config struct {
	Rank, Size int
	// Exchange all-gathers one blob per rank (the rendezvous store's AllGather): the
	// worker addresses.
	Exchange func(ctx context.Context, mine []byte) ([][]byte, error)
	// Peers[q] says q is reached through UCX (nil: every rank). Operations with other
	// ranks are refused (a transport.Mux sends them elsewhere).
	Peers []bool
	// EmulatedWindows reaches through windows (one-sided puts and signals) also the
	// peers whose lanes lack RMA or atomics, which UCX then emulates over active
	// messages; by default Map refuses them (transport.ErrNoWindow) and exchanges with
	// them go as tag messages: over loopback tcp, UCX 1.13's emulated puts move about
	// 145 MB/s where its tag messages move 5.5 GB/s (ucx_perftest -t ucp_put_bw and
	// tag_bw, 1 MiB). MOEX_WINDOWS=1 sets it.
	EmulatedWindows bool
	Poll            busypoll.Config
	Logger          *slog.Logger
	CancelGrace     time.Duration
}

// rdmaTransports are UCX transport names that mean an RDMA NIC (verbs, RoCE, EFA via
// libfabric does not go through UCX).
var rdmaTransports = []string{"rc", "rc_verbs", "rc_mlx5", "dc", "dc_mlx5", "ud", "ud_verbs", "ud_mlx5", "ib", "roce", "gdr_copy", "cuda_ipc"}

// isRDMA reports whether a UCX transport name is an RDMA (or GPU) one.
func isRDMA(tl string) bool {
	for _, r := range rdmaTransports {
		if tl == r || strings.HasPrefix(tl, r+"_") {
			return true
		}
	}
	return false
}

// parseLanes extracts the transport names from ucp_ep_print_info's output: lines like
// "#   lane[0]:  1:posix/memory.0 md[1] ..." give "posix".
func parseLanes(info string) []string {
	var out []string
	seen := map[string]bool{}
	for _, line := range strings.Split(info, "\n") {
		i := strings.Index(line, "lane[")
		if i < 0 {
			continue
		}
		rest := line[i:]
		j := strings.Index(rest, ":")
		if j < 0 {
			continue
		}
		f := strings.Fields(rest[j+1:])
		if len(f) == 0 {
			continue
		}
		tl := f[0]
		if k := strings.Index(tl, ":"); k >= 0 {
			tl = tl[k+1:]
		}
		if k := strings.Index(tl, "/"); k >= 0 {
			tl = tl[:k]
		}
		if tl != "" && !seen[tl] {
			seen[tl] = true
			out = append(out, tl)
		}
	}
	return out
}

// nativeRMA reports whether ucp_ep_print_info's lanes carry RMA and 64-bit atomics
// (rma#, rma_bw#, amo#): otherwise UCX emulates the windows' puts and signals over
// active messages, which the owner's worker must progress.
func nativeRMA(info string) bool {
	rma, amo := false, false
	for _, line := range strings.Split(info, "\n") {
		if !strings.Contains(line, "lane[") {
			continue
		}
		for _, f := range strings.Fields(line) {
			rma = rma || strings.HasPrefix(f, "rma#") || strings.HasPrefix(f, "rma_bw#")
			amo = amo || strings.HasPrefix(f, "amo#")
		}
	}
	return rma && amo
}
