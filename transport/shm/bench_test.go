package shm_test

import (
	"testing"

	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/transporttest"
)

// BenchmarkP2P: one-way bandwidth per size, cma and ring copies, beside copy().
func BenchmarkP2P(b *testing.B) {
	for _, size := range transporttest.BenchSizes {
		b.Run("memcpy/"+transporttest.SizeName(size), func(b *testing.B) { transporttest.BenchMemcpy(b, size) })
		for _, mode := range []struct {
			name string
			cma  int
		}{{"cma", 1}, {"ring", -1}} {
			b.Run("shm-"+mode.name+"/"+transporttest.SizeName(size), func(b *testing.B) {
				ts := start(b, 2, func(c *shm.Config) { c.CMA = mode.cma })
				transporttest.BenchBandwidth(b, ts[0], ts[1], size)
			})
		}
	}
}

func BenchmarkPingPong8B(b *testing.B) {
	ts := start(b, 2, nil)
	transporttest.BenchPingPong(b, ts[0], ts[1])
}
