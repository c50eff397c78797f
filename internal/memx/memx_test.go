package memx

import (
	"bytes"
	"fmt"
	"testing"
)

func TestCopy(t *testing.T) {
	for _, n := range []int{0, 1, Piece - 1, Piece, Piece + 1, 3*Piece + 17} {
		src := make([]byte, n)
		for i := range src {
			src[i] = byte(i*7 + i>>9)
		}
		for _, extra := range []int{0, 5} {
			dst := make([]byte, n+extra)
			for i := range dst {
				dst[i] = 0xAA
			}
			if got := Copy(dst, src); got != n {
				t.Fatalf("n=%d: copied %d", n, got)
			}
			if !bytes.Equal(dst[:n], src) || bytes.Count(dst[n:], []byte{0xAA}) != extra {
				t.Fatalf("n=%d, dst %d longer: wrong bytes", n, extra)
			}
		}
		if n > 0 {
			short := make([]byte, n-1)
			if got := Copy(short, src); got != n-1 || !bytes.Equal(short, src[:n-1]) {
				t.Fatalf("n=%d into %d bytes: copied %d", n, n-1, got)
			}
		}
	}
}

// BenchmarkCopy: copy against Copy for buffers below and above the size from which
// copy streams past the caches.
func BenchmarkCopy(b *testing.B) {
	for _, n := range []int{256 << 10, 2 << 20, 8 << 20} {
		src, dst := make([]byte, n), make([]byte, n)
		b.Run(fmt.Sprintf("copy/%dKiB", n>>10), func(b *testing.B) {
			b.SetBytes(int64(n))
			for i := 0; i < b.N; i++ {
				copy(dst, src)
			}
		})
		b.Run(fmt.Sprintf("memx/%dKiB", n>>10), func(b *testing.B) {
			b.SetBytes(int64(n))
			for i := 0; i < b.N; i++ {
				Copy(dst, src)
			}
		})
	}
}
