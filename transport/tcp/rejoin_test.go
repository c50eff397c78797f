package tcp_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/tcp"
	"github.com/moex-ai/moex/transport/transporttest"
)

const secret = "test-secret"

// replace starts a replacement for rank r of n and has the live ranks readmit it; it
// returns the replacement's transport, the live ranks it was told, each live rank's
// Readmit error, and the replacement's Accept error.
func replace(t *testing.T, ts []*tcp.Transport, r, n, streams int, token string, live []int) (*tcp.Transport, []int, []error, error) {
	t.Helper()
	rep, err := tcp.Listen(tcp.Config{Rank: r, Size: n, Token: []byte(token), Streams: streams})
	require.NoError(t, err)
	out := transporttest.Replace(rep.Accept, func(ctx context.Context, q int, live []int) error {
		return ts[q].Readmit(ctx, r, rep.Addr(), live)
	}, live)
	return out.T, out.Members, out.Errs, out.Accept
}

// A rank killed mid-job is taken over by a new process: the live ranks readmit it, each
// of their operations with the dead one has failed with a PeerError, and then every pair
// of ranks, the replacement included, moves messages of both protocols on every stream.
func TestReadmitReplacement(t *testing.T) {
	const n, streams, dead = 4, 2, 2
	ts := start(t, n, func(c *tcp.Config) { c.Streams = streams })
	pending, err := ts[0].Irecv(dead, transport.Tag{Comm: 1}, make([]byte, 8))
	require.NoError(t, err)
	ts[dead].Kill()
	_, err = pending.Wait(context.Background())
	var pe *transport.PeerError
	require.ErrorAs(t, err, &pe, "a receive posted with the dead rank")
	assert.Equal(t, dead, pe.Rank)

	live := []int{0, 1, 3}
	nt, members, errs, aerr := replace(t, ts, dead, n, streams, secret, live)
	require.NoError(t, aerr)
	for i, err := range errs {
		require.NoError(t, err, "rank %d's Readmit", live[i])
	}
	defer nt.Close()
	assert.Equal(t, live, members)
	all := map[int]transport.Transport{dead: nt}
	for _, q := range live {
		all[q] = ts[q]
	}
	transporttest.AllPairs(t, all, []int{0, 1, 2, 3})
	assert.Contains(t, ts[0].Path(dead), "tcp:")
}

// A replacement told of fewer live ranks (two died, one is replaced) is connected to
// them; its operations with the other dead rank fail at once with a PeerError.
func TestReadmitWithAnotherRankDead(t *testing.T) {
	const n = 4
	ts := start(t, n, nil)
	ts[2].Kill()
	ts[3].Kill()
	nt, members, errs, aerr := replace(t, ts, 3, n, 1, secret, []int{0, 1})
	require.NoError(t, aerr)
	require.NoError(t, errors.Join(errs...))
	defer nt.Close()
	assert.Equal(t, []int{0, 1}, members)
	transporttest.AllPairs(t, map[int]transport.Transport{0: ts[0], 1: ts[1], 3: nt}, []int{0, 1, 3})
	_, err := nt.Isend(2, transport.Tag{}, []byte{1})
	var pe *transport.PeerError
	require.ErrorAs(t, err, &pe)
	assert.Equal(t, 2, pe.Rank)
	assert.ErrorIs(t, err, transport.ErrPeerClosed)
}

// A replacement with another job's secret is refused: each live rank's Readmit fails
// with ErrAuth, the replacement's Accept ends with its context, and the live ranks go on
// without it.
func TestReadmitWrongSecret(t *testing.T) {
	const n = 3
	ts := start(t, n, nil)
	ts[1].Kill()
	nt, _, errs, aerr := replace(t, ts, 1, n, 1, "another-secret", []int{0, 2})
	assert.Nil(t, nt)
	assert.ErrorIs(t, aerr, transport.ErrCanceled) // replace cancels it once a Readmit failed
	for _, err := range errs {
		assert.ErrorIs(t, err, transport.ErrAuth)
	}
	transporttest.AllPairs(t, map[int]transport.Transport{0: ts[0], 2: ts[2]}, []int{0, 2})
}

// Readmit checks its arguments (transport.CheckReadmit) before it touches anything.
func TestReadmitArgs(t *testing.T) {
	ts := start(t, 3, nil)
	var ae *transport.ArgError
	assert.ErrorAs(t, ts[0].Readmit(context.Background(), 0, "127.0.0.1:1", []int{0, 1}), &ae, "itself")
	assert.ErrorAs(t, ts[0].Readmit(context.Background(), 2, "127.0.0.1:1", []int{1}), &ae, "members without this rank")
}
