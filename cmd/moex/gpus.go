//go:build !(nvml && cgo)

package main

import "github.com/moex-ai/moex/transport/topo"

// gpuSource is where moex topo and moex doctor list GPUs: sysfs in this build (no
// NVLinks); a build with -tags nvml asks NVML.
func gpuSource() topo.GPUSource { return nil }
