package shm

import (
	"os"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/transport/transporttest"
)

// BenchmarkCMARead: process_vm_readv (cmaRead, the single copy across) beside memcpy, for
// a P=4 64 KiB AlltoAll's blocks (16 KiB), its send buffer and a large buffer, read from
// this process (the kernel copies the same way as from another process).
func BenchmarkCMARead(b *testing.B) {
	for _, size := range []int{16 << 10, 64 << 10, 1 << 20} {
		b.Run("memcpy/"+transporttest.SizeName(size), func(b *testing.B) { transporttest.BenchMemcpy(b, size) })
		b.Run("cma/"+transporttest.SizeName(size), func(b *testing.B) {
			src, dst := make([]byte, size), make([]byte, size)
			transporttest.Pattern(src, 2)
			var liov [1]unix.Iovec
			var riov [1]unix.RemoteIovec
			addr := uint64(uintptr(unsafe.Pointer(&src[0])))
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				if err := cmaRead(os.Getpid(), dst, addr, &liov, &riov); err != nil {
					b.Skipf("process_vm_readv refused here: %v", err)
				}
			}
		})
	}
}
