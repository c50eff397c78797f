package transporttest

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport"
)

// testBatch: transport.IsendBatch (a Batcher's, or Isend one by one) delivers every
// message whole, on its tag and in order within a tag, from empty and eager ones to
// rendezvous ones, to a peer and to oneself, whether the receives were posted first or
// not; a bad peer is an ArgError and posts nothing.
func testBatch(t *testing.T, f Factory) {
	w := f(t, 2)
	ctx := ctxT(t)
	sizes := []int{0, 17, 4096, 200 << 10, 31, 1<<20 + 3, 9}
	for _, to := range []int{1, 0} {
		for _, recvFirst := range []bool{true, false} {
			tags := make([]transport.Tag, len(sizes))
			msgs := make([][]byte, len(sizes))
			bufs := make([][]byte, len(sizes))
			rreqs := make([]transport.Request, len(sizes))
			for i, n := range sizes {
				tags[i] = tag(70 + uint32(i%3))
				msgs[i] = make([]byte, n)
				Pattern(msgs[i], uint64(100*to+10*i))
				bufs[i] = make([]byte, n+8)
			}
			post := func() {
				for i := range sizes {
					rreqs[i] = must(w.T[to].Irecv(0, tags[i], bufs[i]))(t)
				}
			}
			if recvFirst {
				post()
			}
			sreqs := make([]transport.Request, len(sizes))
			require.NoError(t, transport.IsendBatch(w.T[0], to, tags, msgs, sreqs))
			if !recvFirst {
				post()
			}
			for i, r := range sreqs {
				require.NotNil(t, r, "send %d", i)
				n, err := r.Wait(ctx)
				require.NoError(t, err, "send %d", i)
				require.Equal(t, sizes[i], n, "send %d", i)
			}
			for i, r := range rreqs {
				n, err := r.Wait(ctx)
				require.NoError(t, err, "to %d, receive %d", to, i)
				require.Equal(t, msgs[i], bufs[i][:n], "to %d, message %d", to, i)
			}
		}
	}
	// A batch bigger than a socket's buffers: some of it leaves in part, the rest later.
	const many = 256
	tags := make([]transport.Tag, many)
	msgs := make([][]byte, many)
	for i := range msgs {
		tags[i] = tag(80)
		msgs[i] = make([]byte, 30<<10)
		Pattern(msgs[i], uint64(7000+i))
	}
	sreqs := make([]transport.Request, many)
	require.NoError(t, transport.IsendBatch(w.T[0], 1, tags, msgs, sreqs))
	buf := make([]byte, 30<<10)
	for i := range msgs {
		n, err := must(w.T[1].Irecv(0, tag(80), buf))(t).Wait(ctx)
		require.NoError(t, err, "receive %d", i)
		require.Equal(t, msgs[i], buf[:n], "message %d", i)
	}
	for i, r := range sreqs {
		_, err := r.Wait(ctx)
		require.NoError(t, err, "send %d", i)
	}

	reqs := make([]transport.Request, 2)
	err := transport.IsendBatch(w.T[0], 2, []transport.Tag{tag(1), tag(2)}, [][]byte{{1}, {2}}, reqs)
	var ae *transport.ArgError
	require.ErrorAs(t, err, &ae)
	require.Equal(t, "peer", ae.Arg)
	require.Equal(t, []transport.Request{nil, nil}, reqs)
}
