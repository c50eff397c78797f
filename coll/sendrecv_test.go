package coll

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// sendRecvPattern is the byte i of the message from rank `from` under tag.
func sendRecvPattern(from, tag, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(from*29 + tag*7 + i)
	}
	return b
}

// A batch in which every rank lists its receives before its sends (a deadlock for
// blocking calls) completes, with eager and rendezvous sizes, several tags per pair and
// two messages under one tag arriving in order.
func TestSendRecvBatch(t *testing.T) {
	const p = 4
	sizes := []int{0, 100, 300 << 10} // the last goes rendezvous on every transport
	got := make([][][]byte, p)
	errs := world(t, p, Config{}, func(c *Comm) error {
		me := c.Rank()
		var ops []P2P
		var recvs [][]byte
		for q := 0; q < p; q++ {
			if q == me {
				continue
			}
			for tag, n := range sizes {
				for k := 0; k < 2; k++ {
					b := make([]byte, n+k)
					recvs = append(recvs, b)
					ops = append(ops, P2P{Peer: q, Tag: tag, Buf: b, Recv: true})
				}
			}
		}
		for q := 0; q < p; q++ {
			if q == me {
				continue
			}
			for tag, n := range sizes {
				for k := 0; k < 2; k++ {
					ops = append(ops, P2P{Peer: q, Tag: tag, Buf: sendRecvPattern(me, tag, n+k)})
				}
			}
		}
		got[me] = recvs
		return SendRecv(context.Background(), c, ops)
	})
	for r := 0; r < p; r++ {
		require.NoError(t, errs[r], "rank %d", r)
		i := 0
		for q := 0; q < p; q++ {
			if q == r {
				continue
			}
			for tag, n := range sizes {
				for k := 0; k < 2; k++ {
					assert.Equal(t, sendRecvPattern(q, tag, n+k), got[r][i], "rank %d from %d tag %d message %d", r, q, tag, k)
					i++
				}
			}
		}
	}
}

// A receive whose message is shorter than its buffer fails that rank with an ArgError
// naming the op, and the peer waiting on it with an AbortError, not a hang.
func TestSendRecvShortMessage(t *testing.T) {
	errs := world(t, 2, Config{}, func(c *Comm) error {
		ctx := context.Background()
		if c.Rank() == 0 {
			if err := SendRecv(ctx, c, []P2P{{Peer: 1, Tag: 3, Buf: make([]byte, 10)}}); err != nil {
				return err
			}
			// Rank 1 fails and aborts: the next operation here fails too.
			return SendRecv(ctx, c, []P2P{{Peer: 1, Tag: 4, Buf: make([]byte, 8), Recv: true}})
		}
		return SendRecv(ctx, c, []P2P{{Peer: 0, Tag: 3, Buf: make([]byte, 16), Recv: true}})
	})
	var ae *ArgError
	require.ErrorAs(t, errs[1], &ae)
	assert.Equal(t, "ops[0].Buf", ae.Arg)
	var abort *AbortError
	require.ErrorAs(t, errs[0], &abort)
	assert.Equal(t, 1, abort.Rank)
}

// Bad peers and tags are refused before anything is posted, and leave the communicator
// usable.
func TestSendRecvBadArgs(t *testing.T) {
	errs := world(t, 2, Config{}, func(c *Comm) error {
		ctx := context.Background()
		for _, ops := range [][]P2P{{{Peer: 2}}, {{Peer: -1}}, {{Peer: 0, Tag: -1}}} {
			err := SendRecv(ctx, c, ops)
			if !errors.Is(err, ErrInvalidArgument) {
				return fmt.Errorf("ops %+v: got %v, want an ArgError", ops, err)
			}
		}
		return Barrier(ctx, c)
	})
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
}
