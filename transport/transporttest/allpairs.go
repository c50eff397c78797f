package transporttest

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/moex-ai/moex/transport"
)

// AllPairs sends a message from every rank of ranks to every other (one of 100 bytes and
// one of 3 MiB, past any eager limit) and checks every byte that arrived.
func AllPairs(t *testing.T, ts map[int]transport.Transport, ranks []int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	msg := func(from, to, size int) []byte {
		b := make([]byte, size)
		for i := range b {
			b[i] = byte(from*37 + to*11 + i)
		}
		return b
	}
	var wg sync.WaitGroup
	errs := make(chan error, 4*len(ranks)*len(ranks))
	for _, from := range ranks {
		for _, to := range ranks {
			if from == to {
				continue
			}
			for k, size := range []int{100, 3 << 20} {
				tag := transport.Tag{Comm: 9, Tag: uint32(k)}
				wg.Add(2)
				go func() {
					defer wg.Done()
					r, err := ts[from].Isend(to, tag, msg(from, to, size))
					if err == nil {
						_, err = r.Wait(ctx)
					}
					if err != nil {
						errs <- fmt.Errorf("%d -> %d, %d bytes: send: %w", from, to, size, err)
					}
				}()
				go func() {
					defer wg.Done()
					buf := make([]byte, size)
					r, err := ts[to].Irecv(from, tag, buf)
					if err == nil {
						_, err = r.Wait(ctx)
					}
					switch {
					case err != nil:
						errs <- fmt.Errorf("%d -> %d, %d bytes: recv: %w", from, to, size, err)
					case !bytes.Equal(buf, msg(from, to, size)):
						errs <- fmt.Errorf("%d -> %d, %d bytes: wrong bytes", from, to, size)
					}
				}()
			}
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
