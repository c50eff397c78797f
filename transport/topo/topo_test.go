package topo

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeSys writes files (path relative to the root: content) into a fresh sysfs root.
func fakeSys(t *testing.T, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for p, c := range files {
		full := filepath.Join(root, p)
		require.NoError(t, os.MkdirAll(filepath.Dir(full), 0o755))
		require.NoError(t, os.WriteFile(full, []byte(c+"\n"), 0o644))
	}
	return root
}

type noGPUs struct{}

func (noGPUs) GPUs() ([]GPU, error) { return nil, nil }

// A two-socket host from a fake sysfs: NUMA nodes and their CPUs, physical NICs with
// speed and node, a virtual one, and an RDMA device with an InfiniBand and a RoCE port.
func TestDiscoverSysfs(t *testing.T) {
	root := fakeSys(t, map[string]string{
		"devices/system/node/node0/cpulist":          "0-3,8-11",
		"devices/system/node/node1/cpulist":          "4-7,12-15",
		"devices/system/node/possible":               "0-1",
		"class/net/ens1f0/speed":                     "100000",
		"class/net/ens1f0/device/numa_node":          "1",
		"class/net/lo/speed":                         "-1",
		"class/net/veth0/speed":                      "10000",
		"class/infiniband/mlx5_0/device/numa_node":   "0",
		"class/infiniband/mlx5_0/ports/1/link_layer": "InfiniBand",
		"class/infiniband/mlx5_0/ports/1/state":      "4: ACTIVE",
		"class/infiniband/mlx5_0/ports/1/rate":       "200 Gb/sec (4X HDR)",
		"class/infiniband/mlx5_0/ports/2/link_layer": "Ethernet",
		"class/infiniband/mlx5_0/ports/2/state":      "1: DOWN",
	})
	t.Setenv("MOEX_HOST_ID", "host-a")
	topo := Discover(Options{Sys: root, GPUs: noGPUs{}})
	assert.Equal(t, "host-a", topo.Host)
	require.Len(t, topo.NUMA, 2)
	assert.Equal(t, []int{0, 1, 2, 3, 8, 9, 10, 11}, topo.NUMA[0].CPUs)
	assert.Equal(t, 1, topo.NodeOfCPU(13))
	assert.Equal(t, -1, topo.NodeOfCPU(99))
	nic := topo.NIC("ens1f0")
	require.NotNil(t, nic)
	assert.Equal(t, NIC{Name: "ens1f0", Speed: 100000, NUMA: 1}, *nic)
	assert.True(t, topo.NIC("lo").Virtual)
	assert.Zero(t, topo.NIC("lo").Speed)
	assert.Equal(t, -1, topo.NIC("veth0").NUMA)
	require.Len(t, topo.RDMA, 1)
	assert.Equal(t, "mlx5_0", topo.RDMA[0].Name)
	assert.Equal(t, []RDMAPort{{1, "InfiniBand", "4: ACTIVE", "200 Gb/sec (4X HDR)"}, {2, "Ethernet", "1: DOWN", ""}}, topo.RDMA[0].Ports)
	assert.Empty(t, topo.GPUs)
}

// An empty sysfs (a container that hides it) gives an empty view, not an error.
func TestDiscoverEmpty(t *testing.T) {
	topo := Discover(Options{Sys: t.TempDir(), GPUs: noGPUs{}})
	assert.Empty(t, topo.NUMA)
	assert.Empty(t, topo.NICs)
	assert.Empty(t, topo.RDMA)
}

func TestParseCPUList(t *testing.T) {
	for s, want := range map[string][]int{"0": {0}, "0-2,7": {0, 1, 2, 7}, "": nil, "3-3": {3}} {
		got, err := ParseCPUList(s)
		require.NoError(t, err, s)
		assert.Equal(t, want, got, s)
	}
	for _, bad := range []string{"a", "3-1", "-1", "0-99999999", "1,,2"} {
		_, err := ParseCPUList(bad)
		assert.Error(t, err, bad)
	}
}

// The printed matrix reads as nvidia-smi's: a row per GPU with its links to every GPU
// and NIC, CPU and NUMA affinity; then the nodes, NICs and RDMA devices.
func TestPrint(t *testing.T) {
	topo := &Topology{Host: "h",
		NUMA: []NUMANode{{0, []int{0, 1, 2, 3}}, {1, []int{4, 5, 6, 7}}},
		NICs: []NIC{{Name: "ens0", Speed: 200000, NUMA: 1}, {Name: "lo", NUMA: -1, Virtual: true}},
		RDMA: []RDMADevice{{Name: "mlx5_0", NUMA: 0, Ports: []RDMAPort{{1, "InfiniBand", "4: ACTIVE", "400 Gb/sec"}}}},
		GPUs: []GPU{
			{Index: 0, Name: "H200", BusID: "0000:18:00.0", NUMA: 0, NVLink: []NVLink{{0, "0000:28:00.0", 1}, {1, "0000:28:00.0", 1}}, P2P: []string{"X", "OK"}},
			{Index: 1, Name: "H200", BusID: "0000:28:00.0", NUMA: 1, NVLink: []NVLink{{0, "0000:18:00.0", 0}, {1, "0000:18:00.0", 0}}, P2P: []string{"OK", "X"}},
		}}
	var b strings.Builder
	topo.Print(&b)
	out := b.String()
	for _, want := range []string{"GPU0  X     NV2   NODE    SYS   0-3", "GPU1  NV2   X     SYS     NODE  4-7", "mlx5_0", "ens0", "NIC ens0",
		"200 Gbit/s", "NUMA node 1  CPUs 4-7", "P2P read: X OK", "port 1 InfiniBand 4: ACTIVE"} {
		assert.Contains(t, out, want)
	}
	assert.NotContains(t, strings.Split(out, "\n")[2], "lo", "virtual NICs are not columns")
}

// A rank's node is its GPU's, else its NIC's, else an RDMA device's, else the nodes in
// turn.
func TestNodeFor(t *testing.T) {
	nodes := []NUMANode{{0, []int{0, 1}}, {1, []int{2, 3}}}
	withGPUs := &Topology{NUMA: nodes, GPUs: []GPU{{NUMA: 1}, {NUMA: 0}}}
	n, why := withGPUs.NodeFor(2, "")
	assert.Equal(t, 1, n, why)
	assert.Contains(t, why, "GPU 0")
	withNIC := &Topology{NUMA: nodes, NICs: []NIC{{Name: "ens1", NUMA: 1}}, RDMA: []RDMADevice{{Name: "mlx5_0", NUMA: 0}}}
	n, _ = withNIC.NodeFor(0, "ens1")
	assert.Equal(t, 1, n)
	n, why = withNIC.NodeFor(0, "")
	assert.Equal(t, 0, n)
	assert.Contains(t, why, "mlx5_0")
	bare := &Topology{NUMA: nodes}
	n, _ = bare.NodeFor(3, "")
	assert.Equal(t, 1, n)
	n, _ = (&Topology{}).NodeFor(0, "")
	assert.Equal(t, -1, n)
}

// GPUs from sysfs: NVIDIA display and 3D controllers in bus order, with their NUMA
// nodes; other vendors' devices and NVIDIA's non-GPU functions (audio) are left out; a
// host without one says why. NodeFor then binds to the GPU's node.
func TestSysfsGPUs(t *testing.T) {
	dev := func(bus, vendor, class, device, node string) map[string]string {
		d := "bus/pci/devices/" + bus + "/"
		return map[string]string{d + "vendor": vendor, d + "class": class, d + "device": device, d + "numa_node": node}
	}
	files := map[string]string{"devices/system/node/node0/cpulist": "0-7", "devices/system/node/node1/cpulist": "8-15"}
	for _, m := range []map[string]string{
		dev("0000:c1:00.0", "0x10de", "0x030200", "0x2330", "1"),
		dev("0000:c1:00.1", "0x10de", "0x040300", "0x22bc", "1"), // HDMI audio
		dev("0000:18:00.0", "0x10de", "0x030000", "0x2330", "0"),
		dev("0000:3a:00.0", "0x1002", "0x030200", "0x74a1", "0"), // another vendor's
		dev("0000:41:00.0", "0x10de", "0x030200", "0x2330", "-1"),
	} {
		for k, v := range m {
			files[k] = v
		}
	}
	root := fakeSys(t, files)
	tp := Discover(Options{Sys: root})
	require.Len(t, tp.GPUs, 3)
	assert.Empty(t, tp.NoGPU)
	for i, want := range []struct {
		bus  string
		numa int
	}{{"0000:18:00.0", 0}, {"0000:41:00.0", -1}, {"0000:C1:00.0", 1}} {
		g := tp.GPUs[i]
		assert.Equal(t, i, g.Index)
		assert.Equal(t, want.bus, g.BusID)
		assert.Equal(t, want.numa, g.NUMA)
		assert.Equal(t, "NVIDIA PCI device 0x2330", g.Name)
		assert.Nil(t, g.P2P)
	}
	node, why := tp.NodeFor(2, "")
	assert.Equal(t, 1, node, why)
	var b strings.Builder
	tp.Print(&b)
	assert.Contains(t, b.String(), "NVLinks are not known")

	empty := Discover(Options{Sys: fakeSys(t, map[string]string{"bus/pci/devices/0000:00:00.0/vendor": "0x8086"})})
	assert.Empty(t, empty.GPUs)
	assert.Contains(t, empty.NoGPU, "no NVIDIA GPU")
}
