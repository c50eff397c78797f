package shm_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/moex-ai/moex/coll/shared"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/transporttest"
	"github.com/stretchr/testify/assert"
)

// Send buffers from a shared pool are read in place by the other ranks (one copy), mixed
// in the same operations with ranks whose buffers are private (through the area or read
// across), at sizes through and beyond the area, the shared buffers reused from operation
// to operation: every byte arrives where it belongs, and the counters say the shared
// buffers were read in place.
func TestDirectSharedBuffers(t *testing.T) {
	// As the host's cache decides, and with every block streamed (Config.Stream).
	for _, stream := range []int{0, 1} {
		t.Run(fmt.Sprintf("stream=%d", stream), func(t *testing.T) { testDirectSharedBuffers(t, stream) })
	}
}

func testDirectSharedBuffers(t *testing.T, stream int) {
	const p = 4
	ts := start(t, p, func(cfg *shm.Config) { cfg.AreaBytes = 4096; cfg.Stream = stream })
	ds := directs(t, ts)
	pool := obuf.NewSharedPool(0)
	sizes := []int{4096, 64, 1 << 20, 4096 + 4*p, 0, 1 << 20, 4000, 256 << 10, 4096, p * (16<<10 + 12)} // the last: blocks at unaligned offsets
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errs := onRanks(p, func(r int) error {
		for op, n := range sizes {
			var send []byte
			if r%2 == 0 || op%3 == 0 { // odd ranks' buffers are private in most operations
				b := pool.Get(n)
				defer b.Release()
				if n > 0 && !b.Shared() {
					return fmt.Errorf("no shared buffer: %v", obuf.SharedErr())
				}
				send = b.Bytes()
				copy(send, sendFor(op, r, p, n))
			} else {
				send = sendFor(op, r, p, n)
			}
			recv := make([]byte, n)
			if err := ds[r].AllToAll(ctx, ds[r].Turn(), send, recv, uint64(n)); err != nil {
				return fmt.Errorf("op %d (%d bytes): %w", op, n, err)
			}
			if err := checkRecv(recv, op, r, p); err != nil {
				return err
			}
		}
		// AlltoAllv, every rank's rows shared.
		for op := 0; op < 6; op++ {
			counts := vcounts(op, p)
			lay, ns, nr := vlayout(counts, r)
			b := pool.Get(ns)
			defer b.Release()
			at := 0
			for j := 0; j < p; j++ {
				fill(b.Bytes()[at:at+counts[r][j]], op, r, j)
				at += counts[r][j]
			}
			recv := make([]byte, nr)
			if err := ds[r].AllToAllv(ctx, ds[r].Turn(), b.Bytes(), recv, lay, uint64(op)); err != nil {
				return fmt.Errorf("v op %d: %w", op, err)
			}
			for q := 0; q < p; q++ {
				want := make([]byte, counts[q][r])
				fill(want, op, q, r)
				if got := recv[lay.RecvOff[q]:][:lay.RecvLen[q]]; !bytes.Equal(got, want) {
					return fmt.Errorf("v op %d: the %d bytes from rank %d are wrong", op, len(want), q)
				}
			}
		}
		return nil
	})
	reportRanks(t, errs)
	for r, tr := range ts {
		if st := tr.Stats(); st.SharedBytes == 0 || st.CMABytes == 0 {
			t.Errorf("rank %d: stats %+v: want bytes read in place and across", r, st)
		}
	}
}

// A rank that cannot map a peer's shared arena reads that peer's shared buffers across
// instead (the bytes still arrive), and says so once in its log.
func TestDirectSharedFallsBack(t *testing.T) {
	const p = 3
	var logs transporttest.Recorder
	ts := start(t, p, func(cfg *shm.Config) { cfg.AreaBytes = 4096; cfg.Logger = logs.Logger() })
	ds := directs(t, ts)
	if err := shm.BreakArena(ts[1], 0); err != nil {
		t.Fatal(err)
	}
	const n = 3 * 8000 // above SharedMin
	reportRanks(t, sharedAllToAlls(ds, 4, n))
	if st := ts[1].Stats(); st.CMABytes != 4*n/p || st.SharedBytes != 4*n/p {
		t.Errorf("rank 1: %d bytes across, %d in place; want %d each (rank 0's across, rank 2's in place)", st.CMABytes, st.SharedBytes, 4*n/p)
	}
	if st := ts[2].Stats(); st.CMABytes != 0 {
		t.Errorf("rank 2 read %d bytes across", st.CMABytes)
	}
	fallback := func(r transporttest.Record) bool {
		peer, _ := r.Int("peer")
		return transporttest.Logged(slog.LevelWarn, "moex shm: cannot map a rank's shared buffers; reading them across instead")(r) && peer == 0
	}
	assert.Equal(t, 1, logs.Count(fallback), "warnings of the fallback to reading across: %+v", logs.Records())
}

// arenaUse counts this process's open file descriptors and its read-only mappings of
// shared arenas: those of peers' arenas (its own buffers are mapped read-write).
func arenaUse(t *testing.T) (fds, maps int) {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	m, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(m), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[1] == "r--s" && strings.Contains(l, "/memfd:"+obuf.ArenaName) {
			maps++
		}
	}
	return len(ents), maps
}

// Close gives back what reading peers' shared buffers took: the memfds taken from them
// and the mappings of their arenas.
func TestDirectSharedCloses(t *testing.T) {
	const p, n = 3, 3 << 13    // above SharedMin
	keep := obuf.Shared.Get(n) // the process's own arena exists before the count
	defer keep.Release()
	fds, maps := arenaUse(t)
	ts := start(t, p, func(cfg *shm.Config) { cfg.AreaBytes = 4096 })
	ds := directs(t, ts)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errs := onRanks(p, func(r int) error {
		b := obuf.Shared.Get(n)
		defer b.Release()
		copy(b.Bytes(), sendFor(0, r, p, n))
		recv := make([]byte, n)
		if err := ds[r].AllToAll(ctx, ds[r].Turn(), b.Bytes(), recv, 1); err != nil {
			return err
		}
		return checkRecv(recv, 0, r, p)
	})
	reportRanks(t, errs)
	if f, m := arenaUse(t); f < fds+p*(p-1) || m != maps+p*(p-1) {
		t.Fatalf("while open: %d fds and %d peer arena mappings, want at least %d and %d (one per rank and peer)", f, m, fds+p*(p-1), maps+p*(p-1))
	}
	for _, tr := range ts {
		tr.Close()
	}
	if f, m := arenaUse(t); f != fds || m != maps {
		t.Fatalf("after Close: %d fds and %d arena mappings, want %d and %d as before", f, m, fds, maps)
	}
}

// sharedAllToAlls runs ops AllToAlls on every rank of ds at once, each send buffer of n
// bytes from obuf.Shared (read in place, or across), and checks every block received.
func sharedAllToAlls(ds []*shared.Direct, ops, n int) []error {
	p := len(ds)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return onRanks(p, func(r int) error {
		for op := 0; op < ops; op++ {
			b := obuf.Shared.Get(n)
			defer b.Release()
			copy(b.Bytes(), sendFor(op, r, p, n))
			recv := make([]byte, n)
			if err := ds[r].AllToAll(ctx, ds[r].Turn(), b.Bytes(), recv, 1); err != nil {
				return fmt.Errorf("op %d: %w", op, err)
			}
			if err := checkRecv(recv, op, r, p); err != nil {
				return err
			}
		}
		return nil
	})
}
