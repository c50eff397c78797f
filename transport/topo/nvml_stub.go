//go:build !cgo || !linux

package topo

import "errors"

// noNVML is the GPU source of builds without cgo: go-nvml loads the driver's library
// through cgo.
type noNVML struct{}

func defaultGPUs() GPUSource { return noNVML{} }

func (noNVML) GPUs() ([]GPU, error) {
	return nil, errors.New("topo: built without cgo, so without NVML: no GPUs listed")
}
