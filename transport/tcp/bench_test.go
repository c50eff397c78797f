package tcp_test

import (
	"testing"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/tcp"
	"github.com/moex-ai/moex/transport/transporttest"
)

// BenchmarkP2P: one-way bandwidth per size and stream count, beside copy() of the same
// bytes (go test -bench P2P ./transport/tcp).
func BenchmarkP2P(b *testing.B) {
	for _, size := range transporttest.BenchSizes {
		b.Run("memcpy/"+transporttest.SizeName(size), func(b *testing.B) { transporttest.BenchMemcpy(b, size) })
		for _, streams := range []int{1, 2, 4} {
			b.Run("tcp/streams="+string(rune('0'+streams))+"/"+transporttest.SizeName(size), func(b *testing.B) {
				ts := start(b, 2, func(c *tcp.Config) { c.Streams = streams })
				transporttest.BenchBandwidth(b, ts[0], ts[1], size)
			})
		}
	}
}

// BenchmarkPingPong8B: round trip of 8 bytes with the receivers busy-polling (adaptive,
// spin) and blocking.
func BenchmarkPingPong8B(b *testing.B) {
	for _, m := range []busypoll.Mode{busypoll.Adaptive, busypoll.Spin, busypoll.Block} {
		b.Run("poll="+m.String(), func(b *testing.B) {
			ts := start(b, 2, func(c *tcp.Config) {
				c.Poll.Mode = m
				if m == busypoll.Block {
					c.BusyPollUS = -1
				}
			})
			transporttest.BenchPingPong(b, ts[0], ts[1])
		})
	}
}

// BenchmarkAllToAll8InProc: 8 ranks as goroutines of one process over TCP loopback,
// 32 KiB per pair, under each receive policy.
func BenchmarkAllToAll8InProc(b *testing.B) {
	for _, m := range []busypoll.Mode{busypoll.Adaptive, busypoll.Block} {
		b.Run("poll="+m.String(), func(b *testing.B) {
			ts := start(b, 8, func(c *tcp.Config) { c.Poll.Mode = m })
			var tt []transport.Transport
			for _, x := range ts {
				tt = append(tt, x)
			}
			transporttest.BenchAllToAll(b, tt, 32<<10)
		})
	}
}
