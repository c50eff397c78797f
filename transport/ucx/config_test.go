package ucx

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestParseLanes(t *testing.T) {
	info := `#
# UCP endpoint
#
#               peer: <no debug data>
#                 lane[0]:  0:posix/memory.0 md[0]           -> md[0]/posix/sysdev[255] am am_bw#0
#                 lane[1]:  3:cma/memory.0 md[2]             -> md[2]/cma/sysdev[255] rma_bw#0
#                 lane[2]:  5:tcp/lo.0 md[4]                 -> md[4]/tcp/sysdev[255] am_bw#1
#                 lane[3]: 11:rc_mlx5/mlx5_0:1.0 md[7]      -> md[7]/ib/sysdev[255] rma_bw#1 rkey_ptr
`
	got := parseLanes(info)
	if !slices.Equal(got, []string{"posix", "cma", "tcp", "rc_mlx5"}) {
		t.Fatalf("lanes %v", got)
	}
	if !isRDMA("rc_mlx5") || !isRDMA("dc_mlx5") || isRDMA("tcp") || isRDMA("posix") || isRDMA("cma") {
		t.Fatal("isRDMA")
	}
}

// Over UCX_TLS=tcp the lanes carry active messages only: the windows' puts and signals
// are emulated. Over sm (sysv, posix, cma) they carry atomics and RMA.
func TestNativeRMA(t *testing.T) {
	tcp := `#                 lane[0]:  0:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] am am_bw#0 keepalive wireup
#                  rma_bw: mds rndv_rkey_size 9
`
	sm := `#                 lane[0]:  0:sysv/memory.0 md[0]           -> md[0]/sysv/sysdev[255] amo#0 am am_bw#0
#                 lane[1]:  1:posix/memory.0 md[1]          -> md[1]/posix/sysdev[255] amo#1
#                 lane[2]:  2:cma/memory.0 md[2]            -> md[2]/cma/sysdev[255] rma_bw#0
#                  rma_bw: mds rndv_rkey_size 9
`
	assert.False(t, nativeRMA(tcp))
	assert.True(t, nativeRMA(sm))
	assert.False(t, nativeRMA(""))
}
