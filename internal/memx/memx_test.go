package memx

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
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

// Stream copies exactly what copy would, at every alignment of either side and every
// length around the 64-byte lines it streams, and leaves the bytes around dst alone.
func TestStream(t *testing.T) {
	src := make([]byte, 5000)
	for i := range src {
		src[i] = byte(i*13 + i>>8)
	}
	for _, n := range []int{0, 1, 15, 63, 64, 65, 127, 128, 200, 1000, 4096 + 17} {
		for so := 0; so < 3; so++ {
			for do := 0; do < 70; do += 7 {
				dst := make([]byte, n+do+80)
				for i := range dst {
					dst[i] = 0xAA
				}
				if got := Stream(dst[do:do+n], src[so:so+n]); got != n {
					t.Fatalf("n=%d: copied %d", n, got)
				}
				if !bytes.Equal(dst[do:do+n], src[so:so+n]) {
					t.Fatalf("n=%d, src+%d, dst+%d: wrong bytes", n, so, do)
				}
				if bytes.Count(dst[:do], []byte{0xAA}) != do || bytes.Count(dst[do+n:], []byte{0xAA}) != 80 {
					t.Fatalf("n=%d, src+%d, dst+%d: wrote outside dst", n, so, do)
				}
			}
		}
	}
	if got := Stream(make([]byte, 10), src); got != 10 {
		t.Fatalf("into 10 bytes: copied %d", got)
	}
}

// BenchmarkStream: streaming stores against Copy, for 512 KiB blocks taken round 64 MiB
// of buffers (more than a last-level cache holds), as an 8-rank 4 MiB AlltoAll moves them,
// and for one 512 KiB block copied again and again (which the caches hold).
func BenchmarkStream(b *testing.B) {
	const blk, total = 512 << 10, 32 << 20
	src, dst := make([]byte, total), make([]byte, total)
	for name, cp := range map[string]func(d, s []byte) int{"copy": Copy, "stream": Stream} {
		b.Run(name+"/cold", func(b *testing.B) {
			b.SetBytes(blk)
			i := 0
			for b.Loop() {
				o := (i * blk) % total
				cp(dst[o:o+blk], src[o:o+blk])
				i++
			}
		})
		b.Run(name+"/cached", func(b *testing.B) {
			b.SetBytes(blk)
			for b.Loop() {
				cp(dst[:blk], src[:blk])
			}
		})
	}
}

func TestReadLLC(t *testing.T) {
	dir := t.TempDir()
	for i, size := range []string{"32K", "1024K\n", "32768K", "bogus", "2M"} {
		d := filepath.Join(dir, fmt.Sprintf("index%d", i))
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "size"), []byte(size), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if got := readLLC(dir); got != 32<<20 {
		t.Fatalf("readLLC = %d, want %d", got, 32<<20)
	}
	if got := readLLC(filepath.Join(dir, "none")); got != 0 {
		t.Fatalf("readLLC of nothing = %d", got)
	}
	t.Logf("this host's last-level cache: %d KiB", LastLevelCache()>>10)
}
