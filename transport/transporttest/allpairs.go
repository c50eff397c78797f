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

// Readmitted is what Replace returns: the new process's transport and the live ranks it
// was told (nil on error), each live rank's Readmit error (in the order of live), and the
// new process's Accept error.
type Readmitted[T any] struct {
	T       T
	Members []int
	Errs    []error
	Accept  error
}

// Replace has a new process take over rank r: accept is its side (Accept, until the
// context ends), and every live rank q calls readmit(ctx, q, live) at once; once a
// Readmit fails, Accept is cancelled, as the new process will not hear from every live
// rank. It gives them five seconds.
func Replace[T any](accept func(context.Context) (T, []int, error), readmit func(ctx context.Context, q int, live []int) error, live []int) Readmitted[T] {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	actx, cancelAccept := context.WithCancel(ctx)
	defer cancelAccept()
	var out Readmitted[T]
	accepted := make(chan struct{})
	go func() {
		defer close(accepted)
		out.T, out.Members, out.Accept = accept(actx)
	}()
	out.Errs = make([]error, len(live))
	var wg sync.WaitGroup
	for i, q := range live {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out.Errs[i] = readmit(ctx, q, live)
		}()
	}
	wg.Wait()
	for _, err := range out.Errs {
		if err != nil {
			cancelAccept()
			break
		}
	}
	<-accepted
	return out
}
