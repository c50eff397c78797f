package shm_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/transporttest"
)

// Where the kernel refuses process_vm_readv between the ranks (Yama's ptrace_scope 2 or
// 3, or a peer that did not let them attach), the single copy gives way to the rings:
// every byte of every pair of ranks still arrives, nothing is read across, the path and
// a warning say why; a configuration that requires the single copy (CMA: 1) fails at New
// with a *PtraceError naming the call and the setting (every rank fails; one that
// comes after another failed may find its segment gone instead).
func TestPtraceRefusedSingleCopy(t *testing.T) {
	defer shm.RefusePtrace("process_vm_readv")()
	var logs transporttest.Recorder
	const n = 3
	ts := start(t, n, func(cfg *shm.Config) { cfg.Logger = logs.Logger() })
	all := map[int]transport.Transport{}
	for r, x := range ts {
		all[r] = x
	}
	transporttest.AllPairs(t, all, []int{0, 1, 2})
	for r, x := range ts {
		assert.Zero(t, x.Stats().CMABytes, "rank %d read across", r)
		assert.Contains(t, x.Path((r+1)%n), "ring copies (cross-memory attach refused", "rank %d", r)
	}
	assert.Equal(t, n, logs.Count(transporttest.Logged(slog.LevelWarn, "moex shm: process_vm_readv refused; large messages go through the rings")))

	ex := transporttest.NewExchange(n)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errs := onRanks(n, func(r int) error {
		x, err := shm.New(ctx, shm.Config{Rank: r, Size: n, Exchange: ex.For(r), CMA: 1})
		if err == nil {
			x.Close()
		}
		return err
	})
	named := 0
	for r, err := range errs {
		require.Error(t, err, "rank %d", r)
		var pe *shm.PtraceError
		if !errors.As(err, &pe) { // a rank that came later found a failed rank's segment gone
			continue
		}
		named++
		require.ErrorIs(t, err, shm.ErrPtrace, "rank %d", r)
		require.ErrorIs(t, err, unix.EPERM, "rank %d", r)
		assert.Equal(t, "process_vm_readv", pe.Op)
		assert.NotEqual(t, r, pe.Rank, "rank %d names a peer", r)
	}
	assert.NotZero(t, named, "ranks whose error is a *PtraceError: %v", errs)
}

// Where the kernel refuses pidfd_getfd, a rank cannot map its peers' shared arenas: it
// reads their shared buffers across instead (process_vm_readv), every byte right.
func TestPtraceRefusedArena(t *testing.T) {
	defer shm.RefusePtrace("pidfd_getfd")()
	const p = 3
	ts := start(t, p, func(cfg *shm.Config) { cfg.AreaBytes = 4096 })
	ds := directs(t, ts)
	const n = 3 * 8000 // above SharedMin
	reportRanks(t, sharedAllToAlls(ds, 3, n))
	for r, x := range ts {
		st := x.Stats()
		assert.Zero(t, st.SharedBytes, "rank %d read in place", r)
		assert.Equal(t, uint64(3*2*n/p), st.CMABytes, "rank %d: bytes read across", r)
	}
}

// Where the kernel refuses pidfd_getfd, a new process cannot take a dead rank over on
// this host (it maps the live ranks' segments with it): Accept fails with a PeerError
// whose cause is a *PtraceError naming the call and the setting to change, not a crash.
func TestPtraceRefusedRejoin(t *testing.T) {
	const n, dead = 3, 1
	ts := start(t, n, nil)
	ts[dead].Kill()
	restore := shm.RefusePtrace("pidfd_getfd")
	_, _, _, aerr := replace(t, ts, dead, n, []int{0, 2}, nil)
	restore()
	var pe *transport.PeerError
	require.ErrorAs(t, aerr, &pe)
	var ptr *shm.PtraceError
	require.ErrorAs(t, aerr, &ptr)
	require.True(t, errors.Is(aerr, shm.ErrPtrace) && errors.Is(aerr, unix.EPERM), "%v", aerr)
	assert.Equal(t, "pidfd_getfd", ptr.Op)
	assert.Equal(t, pe.Rank, ptr.Rank)
	assert.Contains(t, []int{0, 2}, ptr.Rank)
}
