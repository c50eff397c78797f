package transporttest

import (
	"context"
	"fmt"
	"testing"

	"github.com/moex-ai/moex/transport"
)

// Sizes used by the point-to-point benchmarks.
var BenchSizes = []int{64 << 10, 1 << 20, 16 << 20}

// SizeName formats a byte count the way benchmark names use it (64KiB, 1MiB).
func SizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// BenchBandwidth measures one-way bandwidth from a to b: each iteration posts the receive,
// then the send, and waits for both.
func BenchBandwidth(b *testing.B, a, bt transport.Transport, size int) {
	ctx := context.Background()
	msg := make([]byte, size)
	got := make([]byte, size)
	Pattern(msg, 1)
	tg := transport.Tag{Comm: 9, Tag: 1}
	b.SetBytes(int64(size))
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		r, err := bt.Irecv(a.Rank(), tg, got)
		if err != nil {
			b.Fatal(err)
		}
		s, err := a.Isend(bt.Rank(), tg, msg)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := r.Wait(ctx); err != nil {
			b.Fatal(err)
		}
		if _, err := s.Wait(ctx); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	if err := Check(got, 1); err != nil {
		b.Fatal(err)
	}
}

// BenchPingPong measures the round trip of an 8-byte message between a and b; the
// partner echoes from its own goroutine.
func BenchPingPong(b *testing.B, a, bt transport.Transport) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tg := transport.Tag{Comm: 9, Tag: 2}
	done := make(chan struct{})
	iters := b.N
	go func() {
		defer close(done)
		buf := make([]byte, 8)
		for i := 0; i < iters; i++ {
			r, err := bt.Irecv(a.Rank(), tg, buf)
			if err != nil {
				return
			}
			if _, err := r.Wait(ctx); err != nil {
				return
			}
			s, err := bt.Isend(a.Rank(), tg, buf)
			if err != nil {
				return
			}
			if _, err := s.Wait(ctx); err != nil {
				return
			}
		}
	}()
	msg := make([]byte, 8)
	got := make([]byte, 8)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < iters; i++ {
		r, err := a.Irecv(bt.Rank(), tg, got)
		if err != nil {
			b.Fatal(err)
		}
		s, err := a.Isend(bt.Rank(), tg, msg)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := s.Wait(ctx); err != nil {
			b.Fatal(err)
		}
		if _, err := r.Wait(ctx); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	cancel()
	<-done
}

// BenchMemcpy is the reference every bandwidth figure stands beside: Go's copy() of the
// same bytes.
func BenchMemcpy(b *testing.B, size int) {
	src := make([]byte, size)
	dst := make([]byte, size)
	Pattern(src, 2)
	b.SetBytes(int64(size))
	b.ReportAllocs()
	for b.Loop() {
		copy(dst, src)
	}
}

// BenchAllToAll runs one all-to-all per iteration among ts (ranks as goroutines of this
// process), size bytes per pair.
func BenchAllToAll(b *testing.B, ts []transport.Transport, size int) {
	n := len(ts)
	ctx := context.Background()
	type rankBufs struct {
		send, recv [][]byte
		reqs       []transport.Request
	}
	bufs := make([]rankBufs, n)
	for r := range bufs {
		for p := 0; p < n; p++ {
			bufs[r].send = append(bufs[r].send, make([]byte, size))
			bufs[r].recv = append(bufs[r].recv, make([]byte, size))
		}
	}
	start := make([]chan uint32, n)
	done := make(chan error, n)
	for r := 0; r < n; r++ {
		start[r] = make(chan uint32)
		go func(r int) {
			rb := &bufs[r]
			for seq := range start[r] {
				rb.reqs = rb.reqs[:0]
				tg := transport.Tag{Comm: 3, Seq: seq}
				var err error
				for p := 0; p < n && err == nil; p++ {
					var q transport.Request
					q, err = ts[r].Irecv(p, tg, rb.recv[p])
					rb.reqs = append(rb.reqs, q)
				}
				for p := 0; p < n && err == nil; p++ {
					var q transport.Request
					q, err = ts[r].Isend((r+p)%n, tg, rb.send[(r+p)%n])
					rb.reqs = append(rb.reqs, q)
				}
				if err == nil {
					err = transport.WaitAll(ctx, rb.reqs...)
				}
				done <- err
			}
		}(r)
	}
	b.SetBytes(int64(size * n * n))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for r := 0; r < n; r++ {
			start[r] <- uint32(i)
		}
		for r := 0; r < n; r++ {
			if err := <-done; err != nil {
				b.Fatal(err)
			}
		}
	}
	b.StopTimer()
	for r := 0; r < n; r++ {
		close(start[r])
	}
}
