package topo

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// SysfsGPUs lists the NVIDIA GPUs that the PCI bus shows in sysfs (vendor 0x10de, a
// display or 3D controller), in PCI bus order, which is NVML's and CUDA's with
// CUDA_DEVICE_ORDER=PCI_BUS_ID: each with its bus id, PCI device id and NUMA node. It
// needs neither cgo nor the driver's library, and knows no NVLink or peer-to-peer
// status (GPU.NVLink and GPU.P2P stay empty): the NVML source (package
// transport/topo/nvml, built with -tags nvml) gives those.
type SysfsGPUs struct {
	Sys string // the sysfs root (default /sys)
}

// The PCI vendor of NVIDIA, and the class codes of a VGA and a 3D controller.
const (
	pciVendorNVIDIA = "0x10de"
	pciClassVGA     = "0x0300"
	pciClass3D      = "0x0302"
)

// GPUs implements GPUSource.
func (s SysfsGPUs) GPUs() ([]GPU, error) {
	sys := s.Sys
	if sys == "" {
		sys = "/sys"
	}
	dirs, err := filepath.Glob(filepath.Join(sys, "bus/pci/devices/*"))
	if err != nil {
		return nil, fmt.Errorf("topo: listing PCI devices: %w", err)
	}
	slices.Sort(dirs) // the directory names are the bus ids
	var gpus []GPU
	for _, d := range dirs {
		class := readTrim(filepath.Join(d, "class"))
		if readTrim(filepath.Join(d, "vendor")) != pciVendorNVIDIA ||
			!(strings.HasPrefix(class, pciClassVGA) || strings.HasPrefix(class, pciClass3D)) {
			continue
		}
		gpus = append(gpus, GPU{
			Index: len(gpus),
			Name:  "NVIDIA PCI device " + readTrim(filepath.Join(d, "device")),
			BusID: strings.ToUpper(filepath.Base(d)),
			NUMA:  readInt(filepath.Join(d, "numa_node"), -1),
		})
	}
	if len(gpus) == 0 {
		if _, err := os.Stat(filepath.Join(sys, "bus/pci/devices")); err != nil {
			return nil, errors.New("topo: no PCI bus in sysfs")
		}
		return nil, errors.New("topo: no NVIDIA GPU on the PCI bus")
	}
	return gpus, nil
}
