//go:build !amd64

package memx

// Stream copies src into dst (min of the lengths, as copy). On amd64 it uses
// non-temporal stores; elsewhere it is Copy.
func Stream(dst, src []byte) int { return Copy(dst, src) }
