//go:build nvml && cgo

package main

import (
	"github.com/moex-ai/moex/transport/topo"
	"github.com/moex-ai/moex/transport/topo/nvml"
)

// gpuSource is where moex topo and moex doctor list GPUs: NVML in this build (-tags
// nvml), with NVLinks and peer-to-peer status.
func gpuSource() topo.GPUSource { return nvml.New() }
