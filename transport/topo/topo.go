// Package topo describes the host a rank runs on: its identity, NUMA nodes and their
// CPUs, network interfaces with their speed and NUMA node, RDMA devices and their ports,
// and GPUs with their PCI bus, NUMA node, NVLink links and peer-to-peer status. It reads
// sysfs (a root that tests replace with a fake tree): GPUs as the PCI bus shows them
// (SysfsGPUs: bus id and NUMA node). Their NVLinks and peer-to-peer status come from
// NVIDIA's management library, through package transport/topo/nvml, which only a build
// with -tags nvml compiles (go-nvml is cgo): a program that imports moex never compiles
// it. Where no GPU is listed the view says why.
//
// `moex topo` prints it, `moex doctor` shows it, the cost model takes the network's
// speed from it, and MOEX_CPU_BIND=numa binds a rank to the NUMA node of its GPU or NIC.
// topo reads; it changes nothing on the host. It must not import coll or anything above
// transport.
package topo

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/moex-ai/moex/transport"
)

// Topology is one host's view.
type Topology struct {
	Host  string       `json:"host"` // identity (transport.HostID): MOEX_HOST_ID, else hostname and boot id
	NUMA  []NUMANode   `json:"numa"`
	NICs  []NIC        `json:"nics"`
	RDMA  []RDMADevice `json:"rdma"`
	GPUs  []GPU        `json:"gpus"`
	NoGPU string       `json:"no_gpu,omitempty"` // why no GPU is listed, if none is
}

// NUMANode is a NUMA node and its CPUs.
type NUMANode struct {
	ID   int   `json:"id"`
	CPUs []int `json:"cpus"`
}

// NIC is a network interface. Speed is in Mbit/s (0: unknown, or the link is down);
// NUMA is -1 when unknown (virtual interfaces, one-node hosts).
type NIC struct {
	Name    string `json:"name"`
	Speed   int    `json:"speed_mbps"`
	NUMA    int    `json:"numa"`
	Virtual bool   `json:"virtual"` // no device behind it (lo, veth, bridges)
}

// RDMADevice is an RDMA device (/sys/class/infiniband).
type RDMADevice struct {
	Name  string     `json:"name"`
	NUMA  int        `json:"numa"`
	Ports []RDMAPort `json:"ports"`
}

// RDMAPort is one port of an RDMA device.
type RDMAPort struct {
	Port      int    `json:"port"`
	LinkLayer string `json:"link_layer"` // InfiniBand or Ethernet (RoCE)
	State     string `json:"state"`      // e.g. "4: ACTIVE"
	Rate      string `json:"rate"`       // e.g. "200 Gb/sec (4X HDR)"
}

// GPU is one GPU: from sysfs (SysfsGPUs: no NVLink, no P2P) or NVML.
type GPU struct {
	Index  int      `json:"index"`
	Name   string   `json:"name"`
	UUID   string   `json:"uuid,omitempty"`
	BusID  string   `json:"bus_id"` // PCI bus id, domain:bus:device.function
	NUMA   int      `json:"numa"`   // -1: unknown
	NVLink []NVLink `json:"nvlink,omitempty"`
	// P2P[j] says whether this GPU reads GPU j's memory directly ("OK") or not ("NS":
	// not supported, or another NVML answer); "X" for itself.
	P2P []string `json:"p2p"`
}

// NVLink is one active NVLink of a GPU and what is at its other end.
type NVLink struct {
	Link      int    `json:"link"`
	PeerBusID string `json:"peer_bus_id"`
	Peer      int    `json:"peer"` // the GPU index at the other end, -1 for an NVSwitch or another device
}

// Options selects where Discover looks.
type Options struct {
	// Sys is the sysfs root (default /sys).
	Sys string
	// GPUs lists the GPUs (default: SysfsGPUs of Sys); moex topo built with -tags nvml
	// passes package transport/topo/nvml's source.
	GPUs GPUSource
	// Logger gets the one debug line that says why there are no GPUs.
	Logger *slog.Logger
}

// GPUSource lists GPUs: SysfsGPUs, or NVML's (package transport/topo/nvml).
type GPUSource interface {
	GPUs() ([]GPU, error)
}

// Discover reads the host's topology. It does not fail: what cannot be read is left
// out (and, for GPUs, NoGPU says why).
func Discover(o Options) *Topology {
	if o.Sys == "" {
		o.Sys = "/sys"
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	t := &Topology{Host: transport.HostID()}
	t.NUMA = numaNodes(o.Sys)
	t.NICs = nics(o.Sys)
	t.RDMA = rdma(o.Sys)
	src := o.GPUs
	if src == nil {
		src = SysfsGPUs{Sys: o.Sys}
	}
	gpus, err := src.GPUs()
	if err != nil {
		t.NoGPU = err.Error()
		o.Logger.Debug("moex topo: no GPUs listed", "why", err)
	}
	t.GPUs = gpus
	return t
}

func readTrim(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

func readInt(path string, def int) int {
	v, err := strconv.Atoi(readTrim(path))
	if err != nil {
		return def
	}
	return v
}

// ParseCPUList reads a kernel CPU list ("0-3,8,10-11").
func ParseCPUList(s string) ([]int, error) {
	var cpus []int
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, nil
	}
	for _, part := range strings.Split(s, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		if err != nil || a < 0 {
			return nil, fmt.Errorf("topo: CPU list %q: bad %q", s, part)
		}
		b := a
		if isRange {
			if b, err = strconv.Atoi(hi); err != nil || b < a || b-a > 1<<16 {
				return nil, fmt.Errorf("topo: CPU list %q: bad %q", s, part)
			}
		}
		for c := a; c <= b; c++ {
			cpus = append(cpus, c)
		}
	}
	return cpus, nil
}

func numaNodes(sys string) []NUMANode {
	dirs, _ := filepath.Glob(filepath.Join(sys, "devices/system/node/node[0-9]*"))
	var nodes []NUMANode
	for _, d := range dirs {
		id, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), "node"))
		if err != nil {
			continue
		}
		cpus, err := ParseCPUList(readTrim(filepath.Join(d, "cpulist")))
		if err != nil {
			continue
		}
		nodes = append(nodes, NUMANode{ID: id, CPUs: cpus})
	}
	slices.SortFunc(nodes, func(a, b NUMANode) int { return a.ID - b.ID })
	return nodes
}

func nics(sys string) []NIC {
	dirs, _ := filepath.Glob(filepath.Join(sys, "class/net/*"))
	var out []NIC
	for _, d := range dirs {
		n := NIC{Name: filepath.Base(d), NUMA: -1}
		_, err := os.Stat(filepath.Join(d, "device"))
		n.Virtual = err != nil
		if !n.Virtual {
			n.NUMA = readInt(filepath.Join(d, "device/numa_node"), -1)
		}
		if s := readInt(filepath.Join(d, "speed"), 0); s > 0 {
			n.Speed = s
		}
		out = append(out, n)
	}
	return out
}

func rdma(sys string) []RDMADevice {
	dirs, _ := filepath.Glob(filepath.Join(sys, "class/infiniband/*"))
	var out []RDMADevice
	for _, d := range dirs {
		dev := RDMADevice{Name: filepath.Base(d), NUMA: readInt(filepath.Join(d, "device/numa_node"), -1)}
		ports, _ := filepath.Glob(filepath.Join(d, "ports/*"))
		for _, p := range ports {
			num, err := strconv.Atoi(filepath.Base(p))
			if err != nil {
				continue
			}
			dev.Ports = append(dev.Ports, RDMAPort{Port: num, LinkLayer: readTrim(filepath.Join(p, "link_layer")),
				State: readTrim(filepath.Join(p, "state")), Rate: readTrim(filepath.Join(p, "rate"))})
		}
		out = append(out, dev)
	}
	return out
}

// NodeOfCPU returns the NUMA node that holds cpu, or -1.
func (t *Topology) NodeOfCPU(cpu int) int {
	for _, n := range t.NUMA {
		if slices.Contains(n.CPUs, cpu) {
			return n.ID
		}
	}
	return -1
}

// Node returns NUMA node id, or nil.
func (t *Topology) Node(id int) *NUMANode {
	for i := range t.NUMA {
		if t.NUMA[i].ID == id {
			return &t.NUMA[i]
		}
	}
	return nil
}

// NIC returns the interface named name, or nil.
func (t *Topology) NIC(name string) *NIC {
	for i := range t.NICs {
		if t.NICs[i].Name == name {
			return &t.NICs[i]
		}
	}
	return nil
}

// Link names how GPU i reaches GPU j, as `nvidia-smi topo -m` does: X (itself), NV<n>
// (n NVLinks between them, directly or through NVSwitches), NODE (PCIe within one NUMA
// node), SYS (across NUMA nodes, over the inter-socket link); PHB when the NUMA nodes
// are unknown.
func (t *Topology) Link(i, j int) string {
	if i == j {
		return "X"
	}
	a, b := t.GPUs[i], t.GPUs[j]
	n := 0
	switched := 0
	for _, l := range a.NVLink {
		switch {
		case l.Peer == j:
			n++
		case l.Peer < 0:
			switched++
		}
	}
	if n == 0 && switched > 0 && len(b.NVLink) > 0 && slices.ContainsFunc(b.NVLink, func(l NVLink) bool { return l.Peer < 0 }) {
		n = switched // both on NVSwitches: every link reaches every GPU of the fabric
	}
	switch {
	case n > 0:
		return fmt.Sprintf("NV%d", n)
	case a.NUMA < 0 || b.NUMA < 0:
		return "PHB"
	case a.NUMA == b.NUMA:
		return "NODE"
	}
	return "SYS"
}

// NICFor returns the RDMA device, else the physical network interface, closest to
// GPU g (same NUMA node), or "" when there is none.
func (t *Topology) NICFor(g int) string {
	node := t.GPUs[g].NUMA
	for _, d := range t.RDMA {
		if d.NUMA == node || node < 0 {
			return d.Name
		}
	}
	for _, n := range t.NICs {
		if !n.Virtual && (n.NUMA == node || node < 0) {
			return n.Name
		}
	}
	return ""
}

// NodeFor picks the NUMA node for the rank with local index localRank: its GPU's (GPU
// localRank, modulo the GPUs), else that of the NIC named nic, else of an RDMA device
// (taken in turn by local index), else the nodes taken in turn. It returns -1 when the
// host reports no NUMA node, and says why.
func (t *Topology) NodeFor(localRank int, nic string) (int, string) {
	if len(t.GPUs) > 0 {
		g := localRank % len(t.GPUs)
		if n := t.GPUs[g].NUMA; n >= 0 {
			return n, fmt.Sprintf("the NUMA node of GPU %d", g)
		}
	}
	if n := t.NIC(nic); n != nil && n.NUMA >= 0 {
		return n.NUMA, "the NUMA node of NIC " + nic
	}
	var rd []RDMADevice
	for _, d := range t.RDMA {
		if d.NUMA >= 0 {
			rd = append(rd, d)
		}
	}
	if len(rd) > 0 {
		d := rd[localRank%len(rd)]
		return d.NUMA, "the NUMA node of RDMA device " + d.Name
	}
	if len(t.NUMA) > 0 {
		n := t.NUMA[localRank%len(t.NUMA)].ID
		return n, fmt.Sprintf("NUMA node %d: no GPU or NIC says where, so the nodes are taken in turn", n)
	}
	return -1, "the host reports no NUMA node"
}

// InterfaceOf names the network interface that holds address ip, or "".
func InterfaceOf(ip string) string {
	want := net.ParseIP(ip)
	if want == nil {
		return ""
	}
	ifs, _ := net.Interfaces()
	for _, ifc := range ifs {
		addrs, _ := ifc.Addrs()
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && ipn.IP.Equal(want) {
				return ifc.Name
			}
		}
	}
	return ""
}
