//go:build nvml && cgo

package nvml

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/moex-ai/moex/transport/topo"
)

// Source lists GPUs through an NVML interface: nvml.New() (the driver's libnvidia-ml,
// loaded at run time) or go-nvml's mock.
type Source struct{ Lib nvml.Interface }

var _ topo.GPUSource = Source{}

// New returns the source of the driver's library.
func New() Source { return Source{Lib: nvml.New()} }

// nvmlErr turns an NVML return code into an error.
func nvmlErr(lib nvml.Interface, what string, ret nvml.Return) error {
	if ret == nvml.SUCCESS {
		return nil
	}
	return fmt.Errorf("topo: NVML %s: %s", what, lib.ErrorString(ret))
}

// busID reads a PCI bus id out of NVML's fixed-size C string.
func busID(p nvml.PciInfo) string {
	b := make([]byte, 0, len(p.BusId))
	for _, c := range p.BusId {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	return string(b)
}

// GPUs implements GPUSource: every GPU's name, bus id, NUMA node, active NVLinks (and the
// GPU at their other end) and peer-to-peer read status with every other GPU.
func (s Source) GPUs() (gpus []topo.GPU, err error) {
	lib := s.Lib
	defer func() {
		if r := recover(); r != nil { // the library could not be loaded
			gpus, err = nil, fmt.Errorf("topo: NVML unavailable: %v", r)
		}
	}()
	if err := nvmlErr(lib, "init", lib.Init()); err != nil {
		return nil, err
	}
	defer lib.Shutdown()
	n, ret := lib.DeviceGetCount()
	if err := nvmlErr(lib, "device count", ret); err != nil {
		return nil, err
	}
	devs := make([]nvml.Device, n)
	gpus = make([]topo.GPU, n)
	byBus := map[string]int{}
	for i := range devs {
		d, ret := lib.DeviceGetHandleByIndex(i)
		if err := nvmlErr(lib, fmt.Sprintf("device %d", i), ret); err != nil {
			return nil, err
		}
		devs[i] = d
		g := topo.GPU{Index: i, NUMA: -1}
		g.Name, _ = d.GetName()
		g.UUID, _ = d.GetUUID()
		if pci, ret := d.GetPciInfo(); ret == nvml.SUCCESS {
			g.BusID = busID(pci)
			byBus[g.BusID] = i
		}
		if node, ret := d.GetNumaNodeId(); ret == nvml.SUCCESS {
			g.NUMA = node
		}
		gpus[i] = g
	}
	for i, d := range devs {
		for l := 0; l < nvml.NVLINK_MAX_LINKS; l++ {
			st, ret := d.GetNvLinkState(l)
			if ret != nvml.SUCCESS || st != nvml.FEATURE_ENABLED {
				continue
			}
			pci, ret := d.GetNvLinkRemotePciInfo(l)
			if ret != nvml.SUCCESS {
				continue
			}
			peer, ok := byBus[busID(pci)]
			if !ok {
				peer = -1
			}
			gpus[i].NVLink = append(gpus[i].NVLink, topo.NVLink{Link: l, PeerBusID: busID(pci), Peer: peer})
		}
		gpus[i].P2P = make([]string, n)
		for j, e := range devs {
			if i == j {
				gpus[i].P2P[j] = "X"
				continue
			}
			st, ret := d.GetP2PStatus(e, nvml.P2P_CAPS_INDEX_READ)
			switch {
			case ret != nvml.SUCCESS:
				gpus[i].P2P[j] = "NS"
			case st == nvml.P2P_STATUS_OK:
				gpus[i].P2P[j] = "OK"
			default:
				gpus[i].P2P[j] = "NS"
			}
		}
	}
	return gpus, nil
}
