package inproc_test

import (
	"testing"

	"github.com/moex-ai/moex/transport/inproc"
	"github.com/moex-ai/moex/transport/transporttest"
)

// BenchmarkP2P: one-way bandwidth per size, beside copy() of the same bytes.
func BenchmarkP2P(b *testing.B) {
	for _, size := range transporttest.BenchSizes {
		b.Run("memcpy/"+transporttest.SizeName(size), func(b *testing.B) { transporttest.BenchMemcpy(b, size) })
		b.Run("inproc/"+transporttest.SizeName(size), func(b *testing.B) {
			eps := inproc.New(2, inproc.Config{})
			defer eps[0].Close()
			defer eps[1].Close()
			transporttest.BenchBandwidth(b, eps[0], eps[1], size)
		})
	}
}

func BenchmarkPingPong8B(b *testing.B) {
	eps := inproc.New(2, inproc.Config{})
	defer eps[0].Close()
	defer eps[1].Close()
	transporttest.BenchPingPong(b, eps[0], eps[1])
}
