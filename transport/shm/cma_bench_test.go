package shm

import (
	"os"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport/transporttest"
)

// BenchmarkCMARead: process_vm_readv (cmaRead, the single copy across) beside memcpy, for
// a P=4 64 KiB AlltoAll's blocks (16 KiB), its send buffer and a large buffer, read from
// this process (the kernel copies the same way as from another process); then cold, as
// in a P=8 4 MiB AlltoAll: 512 KiB blocks from 32 MiB of huge-page buffers (obuf, as moex
// bench's) into 32 MiB more, which no cache holds, and from 32 MiB of 4 KiB pages.
func BenchmarkCMARead(b *testing.B) {
	var liov [1]unix.Iovec
	var riov [1]unix.RemoteIovec
	cma := func(b *testing.B, d, s []byte) {
		if err := cmaRead(os.Getpid(), d, uint64(uintptr(unsafe.Pointer(&s[0]))), &liov, &riov); err != nil {
			b.Skipf("process_vm_readv refused here: %v", err)
		}
	}
	for _, size := range []int{16 << 10, 64 << 10, 1 << 20} {
		b.Run("memcpy/"+transporttest.SizeName(size), func(b *testing.B) { transporttest.BenchMemcpy(b, size) })
		b.Run("cma/"+transporttest.SizeName(size), func(b *testing.B) {
			src, dst := make([]byte, size), make([]byte, size)
			transporttest.Pattern(src, 2)
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				cma(b, dst, src)
			}
		})
	}
	const total, blk = 32 << 20, 512 << 10
	huge, dst := obuf.Default.Get(total), obuf.Default.Get(total)
	defer huge.Release()
	defer dst.Release()
	// The same from 4 KiB pages: what a rank's send buffer from make() may get.
	small, err := unix.Mmap(-1, 0, total, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Munmap(small)
	_ = unix.Madvise(small, unix.MADV_NOHUGEPAGE)
	transporttest.Pattern(huge.Bytes(), 3)
	transporttest.Pattern(small, 3)
	clear(dst.Bytes())
	cold := func(b *testing.B, src []byte, cp func(b *testing.B, dst, src []byte)) {
		b.SetBytes(blk)
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			// Blocks from all over the source, as the ranks' reads are.
			so, do := (i*7*blk)%total, (i*blk)%total
			cp(b, dst.Bytes()[do:do+blk], src[so:so+blk])
			i++
		}
	}
	memcpy := func(_ *testing.B, d, s []byte) { copy(d, s) }
	b.Run("memcpy/cold-512KiB", func(b *testing.B) { cold(b, huge.Bytes(), memcpy) })
	b.Run("cma/cold-512KiB", func(b *testing.B) { cold(b, huge.Bytes(), cma) })
	b.Run("memcpy/cold-512KiB-4KiB-pages", func(b *testing.B) { cold(b, small, memcpy) })
	b.Run("cma/cold-512KiB-4KiB-pages", func(b *testing.B) { cold(b, small, cma) })
}
