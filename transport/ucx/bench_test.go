//go:build ucx

package ucx_test

import (
	"testing"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/transporttest"
)

// BenchmarkP2P: one-way bandwidth per size over the UCX transports UCX_TLS selects,
// beside copy(). Compare with the same benchmark in transport/tcp and transport/shm, and
// with ucx_perftest (bench/peers/ucx_compare.sh runs them all in one go).
func BenchmarkP2P(b *testing.B) {
	for _, size := range transporttest.BenchSizes {
		b.Run("memcpy/"+transporttest.SizeName(size), func(b *testing.B) { transporttest.BenchMemcpy(b, size) })
		b.Run("ucx/"+transporttest.SizeName(size), func(b *testing.B) {
			ts := start(b, 2)
			transporttest.BenchBandwidth(b, ts[0], ts[1], size)
		})
	}
}

func BenchmarkPingPong8B(b *testing.B) {
	ts := start(b, 2)
	transporttest.BenchPingPong(b, ts[0], ts[1])
}

// BenchmarkAllToAll4: one all-to-all among 4 ranks (goroutines of this process).
func BenchmarkAllToAll4(b *testing.B) {
	for _, size := range []int{64 << 10, 1 << 20} {
		b.Run(transporttest.SizeName(size), func(b *testing.B) {
			us := start(b, 4)
			ts := make([]transport.Transport, len(us))
			for i, u := range us {
				ts[i] = u
			}
			transporttest.BenchAllToAll(b, ts, size)
		})
	}
}
