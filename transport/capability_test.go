package transport_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/inproc"
)

// The capabilities reach through a Mux: its counters are its transports' summed, and
// Kill kills every one of them, which the peers see as a peer closed.
func TestCapabilitiesThroughMux(t *testing.T) {
	eps := inproc.New(2, inproc.Config{})
	defer eps[1].Close()
	m, err := transport.NewMux("mux", []transport.Transport{eps[0], eps[0]})
	require.NoError(t, err)
	before, ok := transport.CountersOf(m)
	require.True(t, ok, "inproc counts")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tag := transport.Tag{Comm: 1, Tag: 7}
	r, err := eps[1].Irecv(0, tag, make([]byte, 100))
	require.NoError(t, err)
	s, err := m.Isend(1, tag, make([]byte, 100))
	require.NoError(t, err)
	_, err = s.Wait(ctx)
	require.NoError(t, err)
	_, err = r.Wait(ctx)
	require.NoError(t, err)
	after, _ := transport.CountersOf(m)
	assert.Equal(t, before.MessagesOut+1, after.MessagesOut)
	assert.Equal(t, before.BytesOut+100, after.BytesOut)

	require.True(t, transport.Kill(m))
	r, err = eps[1].Irecv(0, tag, make([]byte, 100))
	require.NoError(t, err)
	_, err = r.Wait(ctx)
	require.ErrorIs(t, err, transport.ErrPeerClosed, "the killed rank is a peer closed")
	var pe *transport.PeerError
	require.ErrorAs(t, err, &pe)
	assert.Equal(t, 0, pe.Rank)
}

// A readmit's arguments: no rank may readmit itself or a rank out of range, and the live
// ranks must include it and exclude the replaced one.
func TestCheckReadmit(t *testing.T) {
	require.NoError(t, transport.CheckReadmit(0, 3, 2, []int{0, 1}))
	for _, c := range []struct {
		peer    int
		members []int
	}{{0, []int{0, 1}}, {3, []int{0, 1}}, {-1, []int{0, 1}}, {2, []int{1}}, {2, []int{0, 2}}, {2, []int{0, 1, 2}}} {
		var ae *transport.ArgError
		assert.ErrorAs(t, transport.CheckReadmit(0, 3, c.peer, c.members), &ae, "%+v", c)
	}
}
