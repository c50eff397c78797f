package shm_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/transporttest"
)

// replace makes a new process's segment for rank r of n and has the live ranks readmit
// it; it returns the new transport, the live ranks it was told, each live rank's Readmit
// error, and Accept's.
func replace(t *testing.T, ts []*shm.Transport, r, n int, live []int, addr func(string) string) (*shm.Transport, []int, []error, error) {
	t.Helper()
	j, err := shm.Join(shm.Config{Rank: r, Size: n})
	require.NoError(t, err)
	at := j.Addr()
	if addr != nil {
		at = addr(at)
	}
	out := transporttest.Replace(j.Accept, func(ctx context.Context, q int, live []int) error {
		return ts[q].Readmit(ctx, r, at, live)
	}, live)
	return out.T, out.Members, out.Errs, out.Accept
}

func openFDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// A rank killed mid-job is taken over by a new process on the host: its operations with
// the dead one have failed with a PeerError, the live ranks readmit the new one, and then
// every pair of ranks moves messages through the rings and across (process_vm_readv);
// then, once all are closed, no segment and no file descriptor is left.
func TestReadmitNewProcess(t *testing.T) {
	for _, c := range []struct {
		name  string
		tweak func(*shm.Config)
	}{{"cma", func(c *shm.Config) { c.CMA = 1 }}, {"rings", func(c *shm.Config) { c.CMA = -1 }}} {
		t.Run(c.name, func(t *testing.T) {
			const n, dead = 4, 2
			fds := openFDs(t)
			ts := start(t, n, c.tweak)
			pending, err := ts[0].Irecv(dead, transport.Tag{Comm: 1}, make([]byte, 8))
			require.NoError(t, err)
			ts[dead].Kill()
			_, err = pending.Wait(context.Background())
			var pe *transport.PeerError
			require.ErrorAs(t, err, &pe, "a receive posted with the dead rank")
			assert.Equal(t, dead, pe.Rank)

			live := []int{0, 1, 3}
			nt, members, errs, aerr := replace(t, ts, dead, n, live, nil)
			require.NoError(t, aerr)
			require.NoError(t, errors.Join(errs...))
			assert.Equal(t, live, members)
			all := map[int]transport.Transport{dead: nt}
			for _, q := range live {
				all[q] = ts[q]
			}
			transporttest.AllPairs(t, all, []int{0, 1, 2, 3})
			assert.Contains(t, ts[0].Path(dead), "same host")
			require.NoError(t, nt.Close())
			for _, q := range live {
				require.NoError(t, ts[q].Close())
			}
			assert.Equal(t, fds, openFDs(t), "file descriptors")
			assert.Empty(t, shm.SegmentsOf(os.Getpid()))
		})
	}
}

// A new process told of fewer live ranks (two died, one is taken over) is connected to
// them; its operations with the other dead rank fail at once with a PeerError; it can be
// taken over again after it dies too.
func TestReadmitWithAnotherRankDead(t *testing.T) {
	const n = 4
	ts := start(t, n, nil)
	ts[2].Kill()
	ts[3].Kill()
	nt, members, errs, aerr := replace(t, ts, 3, n, []int{0, 1}, nil)
	require.NoError(t, aerr)
	require.NoError(t, errors.Join(errs...))
	assert.Equal(t, []int{0, 1}, members)
	transporttest.AllPairs(t, map[int]transport.Transport{0: ts[0], 1: ts[1], 3: nt}, []int{0, 1, 3})
	_, err := nt.Isend(2, transport.Tag{}, []byte{1})
	var pe *transport.PeerError
	require.ErrorAs(t, err, &pe)
	assert.Equal(t, 2, pe.Rank)
	assert.ErrorIs(t, err, transport.ErrPeerClosed)

	nt.Kill() // and once more
	nt2, _, errs, aerr := replace(t, ts, 3, n, []int{0, 1}, nil)
	require.NoError(t, aerr)
	require.NoError(t, errors.Join(errs...))
	defer nt2.Close()
	transporttest.AllPairs(t, map[int]transport.Transport{0: ts[0], 1: ts[1], 3: nt2}, []int{0, 1, 3})
}

// An address that is not a new process's segment is refused by every live rank with a
// typed error, the new process's Accept ends with its context, and the live ranks go on.
func TestReadmitBadAddress(t *testing.T) {
	const n = 3
	ts := start(t, n, nil)
	ts[1].Kill()
	for _, bad := range []func(string) string{
		func(string) string { return "127.0.0.1:4000" },
		func(a string) string { // a process that does not exist
			f := strings.Split(a, ":")
			return strings.Join([]string{f[0], f[1], "2147483647", f[3]}, ":")
		},
		func(string) string { return shm.AddrPrefix + "moex-nosuch-r1-p1:1:0" },
	} {
		nt, _, errs, aerr := replace(t, ts, 1, n, []int{0, 2}, bad)
		assert.Nil(t, nt)
		assert.ErrorIs(t, aerr, context.Canceled)
		for _, err := range errs {
			var ae *transport.ArgError
			var pe *transport.PeerError
			assert.True(t, errors.As(err, &ae) || errors.As(err, &pe), "%v", err)
		}
	}
	transporttest.AllPairs(t, map[int]transport.Transport{0: ts[0], 2: ts[2]}, []int{0, 2})
}

// Readmit checks its arguments (transport.CheckReadmit) before it touches anything.
func TestReadmitArgs(t *testing.T) {
	ts := start(t, 3, nil)
	var ae *transport.ArgError
	assert.ErrorAs(t, ts[0].Readmit(context.Background(), 0, shm.AddrPrefix+"moex-x-r1-p1:1:0", []int{0, 1}), &ae, "itself")
	assert.ErrorAs(t, ts[0].Readmit(context.Background(), 2, shm.AddrPrefix+"moex-x-r1-p1:1:0", []int{1}), &ae, "members without this rank")
}
