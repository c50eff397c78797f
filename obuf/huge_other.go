//go:build !linux

package obuf

// HugeThreshold is the size from which buffers are huge-page backed mappings.
const HugeThreshold = 2 << 20

func hugeAlloc(n int) ([]byte, bool) { return nil, false }

func hugeFree(m []byte) {}

// Huge reports false: obuf maps no huge pages here.
func Huge(p []byte) bool { return false }

// SlabMin is the smallest buffer carved out of a huge page (none here).
const SlabMin = HugeThreshold

type slab struct{}

func slabAlloc(n int) ([]byte, *slab, bool) { return nil, nil, false }

func slabFree(s *slab) {}

func slabsMapped() int { return 0 }
