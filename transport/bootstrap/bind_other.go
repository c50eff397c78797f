//go:build !linux

package bootstrap

import "errors"

func bindToCPU(k int) (int, error) {
	return -1, errors.New("binding to a core is supported on Linux only")
}

func bindToNode(node int, cpus []int) error {
	return errors.New("binding to a NUMA node is supported on Linux only")
}
