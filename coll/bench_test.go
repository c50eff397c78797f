package coll

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/coll/dtype"
)

// benchRanks runs body on every rank of n local ranks b.N times (ranks as goroutines).
func benchRanks(b *testing.B, n int, cfg Config, bytes int, body func(c *Comm) error) {
	cs, err := Local(n, cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	b.SetBytes(int64(bytes))
	b.ReportAllocs()
	b.ResetTimer()
	var wg sync.WaitGroup
	iters := b.N
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < iters; i++ {
				if err := body(c); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
}

// BenchmarkAllReduce: in-process ranks, f32 sum, per size and receive policy.
func BenchmarkAllReduce(b *testing.B) {
	ctx := context.Background()
	for _, n := range []int{2, 4} {
		for _, size := range []int{64 << 10, 1 << 20, 16 << 20} {
			for _, m := range []busypoll.Mode{busypoll.Adaptive, busypoll.Block} {
				b.Run(fmt.Sprintf("P=%d/%dKiB/%v", n, size>>10, m), func(b *testing.B) {
					bufs := make([][]float32, n)
					for i := range bufs {
						bufs[i] = make([]float32, size/4)
					}
					benchRanks(b, n, Config{Poll: &busypoll.Config{Mode: m}}, size, func(c *Comm) error {
						return AllReduce(ctx, c, nil, bufs[c.Rank()], dtype.Sum)
					})
				})
			}
		}
	}
}

// BenchmarkAlltoAll: in-process ranks, size bytes per rank.
func BenchmarkAlltoAll(b *testing.B) {
	ctx := context.Background()
	for _, n := range []int{4} {
		for _, size := range []int{64 << 10, 1 << 20, 16 << 20} {
			for _, algo := range []Algo{AlgoAuto, Pairwise, Bruck} {
				b.Run(fmt.Sprintf("P=%d/%dKiB/%v", n, size>>10, algo), func(b *testing.B) {
					send := make([][]float32, n)
					recv := make([][]float32, n)
					for i := range send {
						send[i], recv[i] = make([]float32, size/4), make([]float32, size/4)
					}
					benchRanks(b, n, Config{Algo: map[OpKind]Algo{OpAlltoAll: algo}}, size, func(c *Comm) error {
						return AlltoAll(ctx, c, send[c.Rank()], recv[c.Rank()])
					})
				})
			}
		}
	}
}

// BenchmarkBroadcastVerify: what the rooted operations' agreement (VerifyRootedMin)
// costs a Broadcast at and above its threshold, ranks as goroutines.
func BenchmarkBroadcastVerify(b *testing.B) {
	ctx := context.Background()
	for _, size := range []int{64 << 10, 1 << 20, 4 << 20} {
		for _, off := range []bool{true, false} {
			name := "verify"
			if off {
				name = "NoRootedVerify"
			}
			b.Run(fmt.Sprintf("P=4/%dKiB/%s", size>>10, name), func(b *testing.B) {
				bufs := make([][]float32, 4)
				for i := range bufs {
					bufs[i] = make([]float32, size/4)
				}
				benchRanks(b, 4, Config{NoRootedVerify: off}, size, func(c *Comm) error {
					return Broadcast(ctx, c, bufs[c.Rank()], 0)
				})
			})
		}
	}
}
