package transport_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/inproc"
)

// Point-to-point over any transport: rank 0 sends a message to rank 1 under a tag,
// rank 1 receives it into its own buffer. Both calls return at once; Wait completes
// them (with a deadline: a peer that never answers is an error, not a hang), and the
// send's buffer may be reused only after its Wait.
func Example() {
	eps := inproc.New(2, inproc.Config{}) // or shm, tcp, ucx: the same calls
	defer func() {
		for _, ep := range eps {
			ep.Close()
		}
	}()
	var t0, t1 transport.Transport = eps[0], eps[1]
	tag := transport.Tag{Comm: 1, Seq: 1, Tag: 7}
	buf := make([]byte, 64)
	recv, err := t1.Irecv(0, tag, buf)
	if err != nil {
		log.Fatal(err)
	}
	send, err := t0.Isend(1, tag, []byte("hello, rank 1"))
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := recv.Wait(ctx) // the bytes that arrived; each request is waited for once
	if err != nil {
		log.Fatal(err)
	}
	if _, err := send.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("rank 1 got %d bytes: %q over %s\n", n, buf[:n], t1.Name())
	// Output: rank 1 got 13 bytes: "hello, rank 1" over inproc
}
