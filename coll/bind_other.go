//go:build !linux

package coll

import "errors"

func bindToCPU(k int) (int, error) {
	return -1, errors.New("binding to a core is supported on Linux only")
}
