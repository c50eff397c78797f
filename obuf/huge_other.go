//go:build !linux

package obuf

// HugeThreshold is the size from which buffers are huge-page backed mappings.
const HugeThreshold = 2 << 20

func hugeAlloc(n int) ([]byte, bool) { return nil, false }

func hugeFree(m []byte) {}
