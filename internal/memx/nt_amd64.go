package memx

import "unsafe"

// streamBlocks copies n bytes, a multiple of 64, from src to dst (16-byte aligned) with
// non-temporal stores, and fences them.
//
//go:noescape
func streamBlocks(dst, src *byte, n uintptr)

// Stream copies src into dst (min of the lengths, as copy) with non-temporal stores:
// the destination's lines are written to memory without being read into the caches
// first, and without evicting what the caches hold. That pays when the copy's buffers
// together exceed the last-level cache, so that every line would come from memory and go
// back anyway; where they fit, Copy is faster. The stores are fenced before it returns.
func Stream(dst, src []byte) int {
	n := min(len(dst), len(src))
	// A head up to dst's next 64-byte boundary, whole lines streamed, a tail.
	head := min(n, int(-uintptr(unsafe.Pointer(unsafe.SliceData(dst)))&63))
	copy(dst[:head], src[:head])
	body := (n - head) &^ 63
	if body > 0 {
		streamBlocks(&dst[head], &src[head], uintptr(body))
	}
	copy(dst[head+body:n], src[head+body:n])
	return n
}
