package coll_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/inproc"
)

// userTransport is a transport of a user's own: here it wraps another and counts the
// sends it was handed, as a user's RDMA or GPU transport would carry them itself.
type userTransport struct {
	transport.Transport
	sends atomic.Int64
}

func (u *userTransport) Isend(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	u.sends.Add(1)
	return u.Transport.Isend(peer, tag, buf)
}

// coll.New runs the collectives on any transport.Transport, without the bootstrap: a
// user's transport gets AllReduce, AlltoAll and Barrier right, carries their messages,
// and stays the user's to close.
func TestNewOnAnyTransport(t *testing.T) {
	const p = 4
	eps := inproc.New(p, inproc.Config{})
	users := make([]*userTransport, p)
	errs := make([]error, p)
	var wg sync.WaitGroup
	for r := range users {
		users[r] = &userTransport{Transport: eps[r]}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = func() error {
				c, err := coll.New(users[r], coll.Config{Timeout: 20 * time.Second})
				if err != nil {
					return err
				}
				defer c.Close()
				ctx := context.Background()
				x := []float32{float32(r), 1}
				if err := coll.AllReduce(ctx, c, nil, x, dtype.Sum); err != nil {
					return err
				}
				assert.Equal(t, []float32{6, 4}, x, "rank %d's sum", r)
				send, recv := make([]int32, p), make([]int32, p)
				for q := range send {
					send[q] = int32(10*r + q)
				}
				if err := coll.AlltoAll(ctx, c, send, recv); err != nil {
					return err
				}
				for q := range recv {
					assert.Equal(t, int32(10*q+r), recv[q], "rank %d's block from %d", r, q)
				}
				return coll.Barrier(ctx, c)
			}()
		}()
	}
	wg.Wait()
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
		assert.Positive(t, users[r].sends.Load(), "rank %d's messages went through the user's transport", r)
	}
	// The communicators did not close the user's transports: they still carry messages.
	tag := transport.Tag{Comm: 99, Tag: 1}
	rq, err := eps[1].Irecv(0, tag, make([]byte, 3))
	require.NoError(t, err)
	sq, err := eps[0].Isend(1, tag, []byte{1, 2, 3})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = sq.Wait(ctx)
	require.NoError(t, err)
	n, err := rq.Wait(ctx)
	require.NoError(t, err)
	assert.Equal(t, 3, n)
	for _, e := range eps {
		require.NoError(t, e.Close())
	}
	_, err = coll.New(nil, coll.Config{})
	assert.ErrorIs(t, err, coll.ErrInvalidArgument)
}
