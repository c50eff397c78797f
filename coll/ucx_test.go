//go:build ucx

package coll

import (
	"strings"
	"testing"
)

// MOEX_TRANSPORT=ucx carries every collective over UCX (whatever lanes UCX picks:
// UCX_TLS decides; CI runs tcp and sm).
func TestMultiProcessUCX(t *testing.T) {
	moex := buildMoex(t) // the launcher; the ranks are this test binary, built with ucx
	for _, n := range []int{2, 4} {
		out := moexRun(t, moex, n, "subset", "MOEX_TRANSPORT=ucx")
		if c := strings.Count(out, " ok transport=ucx"); c != n {
			t.Fatalf("want %d ranks ok over ucx:\n%s", n, out)
		}
	}
}

// Under the automatic choice, UCX is used between hosts only when it offers RDMA; with
// no RDMA NIC (this machine, CI) moex's tcp is used and the log says why.
func TestUCXAutoWithoutRDMAUsesTCP(t *testing.T) {
	moex := buildMoex(t) // the launcher; the ranks are this test binary, built with ucx
	out := moexRun(t, moex, 4, "subset", "MOEX_TRANSPORT=auto", "MOEX_COLL_TWO_HOSTS=1", "MOEX_DEBUG=INFO")
	if c := strings.Count(out, " ok transport=shm+tcp"); c != 4 {
		t.Fatalf("want 4 ranks ok over shm+tcp:\n%s", out)
	}
	if !strings.Contains(out, "offers no RDMA lane") {
		t.Fatalf("the log does not say why UCX was not used:\n%s", out)
	}
}

// A rank process that dies mid-collective is named in every other rank's error, quickly,
// whether UCX reports the failure (tcp lanes) or moex watches the process (shared-memory
// lanes, which cannot report it).
func TestMultiProcessUCXDeadPeer(t *testing.T) {
	moex := buildMoex(t)
	for _, tls := range []string{"tcp", "sm"} {
		t.Run(tls, func(t *testing.T) {
			out := moexRun(t, moex, 4, "death", "MOEX_TRANSPORT=ucx", "UCX_TLS="+tls)
			if c := strings.Count(out, " ok"); c != 4 {
				t.Fatalf("%d of 4 ranks ok:\n%s", c, out)
			}
			if c := strings.Count(out, "rank 1"); c < 3 {
				t.Fatalf("survivors did not name rank 1:\n%s", out)
			}
		})
	}
}

// A rank killed with SIGKILL: the survivors shrink their communicator over UCX and carry
// on, whether UCX reports the death (tcp lanes) or moex watches the process (sm).
func TestMultiProcessUCXShrink(t *testing.T) {
	moex := buildMoex(t)
	for _, tls := range []string{"tcp", "sm"} {
		t.Run(tls, func(t *testing.T) { shrinkRun(t, moex, "ucx", "MOEX_TRANSPORT=ucx", "UCX_TLS="+tls) })
	}
}
