package transport_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport"
)

// joinable is a transport of rank 0 of 3 that takes joiners whose address starts with
// its scheme, and refuses others as not its kind of address (an ArgError on "addr").
type joinable struct {
	transport.Transport // the methods a Mux routes (not called here)
	name                string
	admitted, evicted   []int
	fail                error // what Readmit of its kind of address returns
}

func (j *joinable) Rank() int    { return 0 }
func (j *joinable) Size() int    { return 3 }
func (j *joinable) Name() string { return j.name }

func (j *joinable) Readmit(_ context.Context, peer int, addr string, _ []int) error {
	if len(addr) < len(j.name) || addr[:len(j.name)] != j.name {
		return &transport.ArgError{Arg: "addr", Reason: fmt.Sprintf("%q is not a %s address", addr, j.name)}
	}
	if j.fail == nil {
		j.admitted = append(j.admitted, peer)
	}
	return j.fail
}

func (j *joinable) Evict(peer int) { j.evicted = append(j.evicted, peer) }

// A Mux gives a rank to a joiner through the transport that serves it where that one
// reaches the joiner's address, else through another that does, which serves the rank
// from then on (a tcp joiner of a rank this rank reached over shared memory); Evict goes
// to the rank's transport; a connection failure is not retried elsewhere, and an address
// none of them reaches is an error.
func TestMuxReadmitRoutesAnew(t *testing.T) {
	shm, tcp := &joinable{name: "shm"}, &joinable{name: "tcp"}
	m, err := transport.NewMux("shm+tcp", []transport.Transport{shm, shm, tcp})
	require.NoError(t, err)
	rm := transport.ReadmitterOf(m, 1)
	require.NotNil(t, rm)
	ctx := context.Background()

	require.NoError(t, rm.Readmit(ctx, 1, "shm:seg", []int{0, 2}))
	assert.Same(t, shm, m.For(1), "a joiner the serving transport reaches stays there")
	require.NoError(t, rm.Readmit(ctx, 1, "tcp:10.0.0.1:5000", []int{0, 2}))
	assert.Same(t, tcp, m.For(1), "rank 1 is served by tcp once its joiner is reached over tcp")
	assert.Equal(t, []int{1}, tcp.admitted)
	rm.Evict(1)
	assert.Equal(t, []int{1}, tcp.evicted)
	assert.Empty(t, shm.evicted)

	tcp.fail = &transport.PeerError{Rank: 2, Op: "connect", Err: errors.New("refused")}
	var pe *transport.PeerError
	require.ErrorAs(t, rm.Readmit(ctx, 2, "tcp:10.0.0.1:5001", []int{0, 1}), &pe)
	assert.Same(t, tcp, m.For(2))
	var ae *transport.ArgError
	require.ErrorAs(t, rm.Readmit(ctx, 2, "ucx:x", []int{0, 1}), &ae)
	assert.Equal(t, "addr", ae.Arg)
}
