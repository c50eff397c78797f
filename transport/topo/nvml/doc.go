// Package nvml lists GPUs through NVIDIA's management library (github.com/NVIDIA/go-nvml,
// loaded at run time): their names, UUIDs, NUMA nodes, active NVLinks with what is at the
// other end, and peer-to-peer read status, for topo.Discover (Options.GPUs).
//
// go-nvml is cgo and its headers warn as they compile, so this package's code is built
// only with the nvml tag (and cgo): `go build -tags nvml ./cmd/moex` gives `moex topo`
// NVML's view. Without the tag the package is empty and topo lists GPUs from sysfs
// (topo.SysfsGPUs). Nothing else in moex imports it.
package nvml
