//go:build nvml && cgo

package nvml

import (
	"fmt"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/moex-ai/moex/transport/topo"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func pciInfo(bus string) nvml.PciInfo {
	var p nvml.PciInfo
	for i := 0; i < len(bus) && i < len(p.BusId)-1; i++ {
		p.BusId[i] = int8(bus[i])
	}
	return p
}

// server is a mock NVML of n GPUs, the first half on NUMA node 0; links(i) lists the
// bus ids at the other end of GPU i's active NVLinks; p2p says whether GPUs i and j
// read each other's memory.
func server(n int, links func(i int) []string, p2p func(i, j int) bool) *mock.Interface {
	devs := make([]*mock.Device, n)
	bus := func(i int) string { return fmt.Sprintf("00000000:%02X:00.0", 0x18+i*0x10) }
	index := map[nvml.Device]int{}
	for i := range devs {
		d := &mock.Device{
			GetNameFunc:       func() (string, nvml.Return) { return "NVIDIA H100 80GB HBM3", nvml.SUCCESS },
			GetUUIDFunc:       func() (string, nvml.Return) { return fmt.Sprintf("GPU-%d", i), nvml.SUCCESS },
			GetPciInfoFunc:    func() (nvml.PciInfo, nvml.Return) { return pciInfo(bus(i)), nvml.SUCCESS },
			GetNumaNodeIdFunc: func() (int, nvml.Return) { return i * 2 / n, nvml.SUCCESS },
			GetNvLinkStateFunc: func(l int) (nvml.EnableState, nvml.Return) {
				if l < len(links(i)) {
					return nvml.FEATURE_ENABLED, nvml.SUCCESS
				}
				return nvml.FEATURE_DISABLED, nvml.ERROR_NOT_SUPPORTED
			},
			GetNvLinkRemotePciInfoFunc: func(l int) (nvml.PciInfo, nvml.Return) { return pciInfo(links(i)[l]), nvml.SUCCESS },
		}
		devs[i] = d
		index[d] = i
	}
	for i, d := range devs {
		d.GetP2PStatusFunc = func(e nvml.Device, _ nvml.GpuP2PCapsIndex) (nvml.GpuP2PStatus, nvml.Return) {
			if p2p(i, index[e]) {
				return nvml.P2P_STATUS_OK, nvml.SUCCESS
			}
			return nvml.P2P_STATUS_NOT_SUPPORTED, nvml.SUCCESS
		}
	}
	return &mock.Interface{
		InitFunc:           func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc:       func() nvml.Return { return nvml.SUCCESS },
		ErrorStringFunc:    func(r nvml.Return) string { return fmt.Sprintf("error %d", int(r)) },
		DeviceGetCountFunc: func() (int, nvml.Return) { return n, nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			if i < 0 || i >= n {
				return nil, nvml.ERROR_INVALID_ARGUMENT
			}
			return devs[i], nvml.SUCCESS
		},
	}
}

// An 8-GPU server whose GPUs each have 18 NVLinks into NVSwitches: every pair is NV18,
// P2P works everywhere, and each GPU's NUMA node and nearest NIC come out right.
func TestNVLinkServer(t *testing.T) {
	sw := func(i int) []string {
		l := make([]string, 18)
		for k := range l {
			l[k] = fmt.Sprintf("00000000:%02X:00.0", 0xC0+k%4) // four NVSwitches
		}
		return l
	}
	lib := server(8, sw, func(i, j int) bool { return true })
	gpus, err := Source{Lib: lib}.GPUs()
	require.NoError(t, err)
	require.Len(t, gpus, 8)
	tp := &topo.Topology{GPUs: gpus, NICs: []topo.NIC{{Name: "ens1", NUMA: 1, Speed: 400000}, {Name: "ens0", NUMA: 0, Speed: 400000}}}
	for i := range gpus {
		assert.Equal(t, fmt.Sprintf("00000000:%02X:00.0", 0x18+i*0x10), gpus[i].BusID)
		assert.Equal(t, i/4, gpus[i].NUMA)
		assert.Len(t, gpus[i].NVLink, 18)
		assert.Equal(t, -1, gpus[i].NVLink[0].Peer, "an NVSwitch at the other end")
		for j := range gpus {
			if i == j {
				assert.Equal(t, "X", tp.Link(i, j))
				assert.Equal(t, "X", gpus[i].P2P[j])
				continue
			}
			assert.Equal(t, "NV18", tp.Link(i, j), "GPU %d to %d", i, j)
			assert.Equal(t, "OK", gpus[i].P2P[j])
		}
		assert.Equal(t, map[int]string{0: "ens0", 1: "ens1"}[i/4], tp.NICFor(i))
	}
}

// A PCIe-only server (no NVLink), P2P only within a NUMA node: NODE within, SYS across.
func TestPCIeServer(t *testing.T) {
	lib := server(4, func(int) []string { return nil }, func(i, j int) bool { return i/2 == j/2 })
	gpus, err := Source{Lib: lib}.GPUs()
	require.NoError(t, err)
	tp := &topo.Topology{GPUs: gpus}
	assert.Equal(t, "NODE", tp.Link(0, 1))
	assert.Equal(t, "SYS", tp.Link(1, 2))
	assert.Equal(t, "OK", gpus[0].P2P[1])
	assert.Equal(t, "NS", gpus[0].P2P[3])
	assert.Empty(t, gpus[3].NVLink)
}

// GPUs joined directly: NV<n> counts the links between the two.
func TestNVLinkDirect(t *testing.T) {
	bus := func(i int) string { return fmt.Sprintf("00000000:%02X:00.0", 0x18+i*0x10) }
	// GPU 0 and 1: four links; 0 and 2: two; 1 and 2: none.
	links := map[int][]string{0: {bus(1), bus(1), bus(1), bus(1), bus(2), bus(2)}, 1: {bus(0), bus(0), bus(0), bus(0)}, 2: {bus(0), bus(0)}}
	lib := server(3, func(i int) []string { return links[i] }, func(i, j int) bool { return true })
	gpus, err := Source{Lib: lib}.GPUs()
	require.NoError(t, err)
	tp := &topo.Topology{GPUs: gpus}
	assert.Equal(t, "NV4", tp.Link(0, 1))
	assert.Equal(t, "NV2", tp.Link(0, 2))
	assert.Equal(t, "SYS", tp.Link(1, 2), "no NVLink; GPU 1 on NUMA node 0, GPU 2 on node 1")
	assert.Equal(t, 0, gpus[1].NVLink[0].Peer)
}

// NVML that fails to start (no driver) leaves the GPUs out, with the reason.
func TestNoDriver(t *testing.T) {
	lib := &mock.Interface{
		InitFunc:        func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND },
		ErrorStringFunc: func(r nvml.Return) string { return "library not found" },
	}
	tp := topo.Discover(topo.Options{Sys: t.TempDir(), GPUs: Source{Lib: lib}})
	assert.Empty(t, tp.GPUs)
	assert.Contains(t, tp.NoGPU, "library not found")
}
