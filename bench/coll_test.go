package bench

import (
	"bytes"
	"context"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/transport"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// With profiling, a straggler shows up as wait, and is named.
func TestCollProfileStraggler(t *testing.T) {
	const p, late = 3, 1
	o := CollOpts{Op: coll.OpAllReduce, MinBytes: 4096, MaxBytes: 4096, DType: dtype.F32, RedOp: dtype.Sum,
		Iters: 5, Check: true, Profile: true, StraggleRank: late, StraggleDelay: 5 * time.Millisecond}
	rows := onRanks(t, p, coll.Config{Profile: true}, func(c *coll.Comm) ([]CollResult, error) { return Coll(context.Background(), c, o) })
	if len(rows) != 1 {
		t.Fatalf("%d rows", len(rows))
	}
	r := rows[0]
	if r.Wrong != 0 {
		t.Fatalf("%d wrong", r.Wrong)
	}
	if r.LastRank == nil || *r.LastRank != late {
		t.Fatalf("last rank %v, want %d", r.LastRank, late)
	}
	if r.WaitUS < 2500 {
		t.Errorf("wait %.1f us per op behind a 5 ms straggler", r.WaitUS)
	}
	var out bytes.Buffer
	PrintColl(&out, rows)
	if !strings.Contains(out.String(), "wait (us)") || !strings.Contains(out.String(), "last rank") {
		t.Errorf("table without the profile columns:\n%s", out.String())
	}
}

// The copy floor is a positive time for a real AlltoAll, nothing for one with no bytes
// per block, and the AlltoAll rows carry it.
func TestCopyFloor(t *testing.T) {
	if d := CopyFloor(4, 64<<10); d <= 0 {
		t.Fatalf("CopyFloor(4, 64 KiB) = %v", d)
	}
	if d := CopyFloor(4, 3); d != 0 {
		t.Fatalf("CopyFloor(4, 3) = %v, want 0", d)
	}
	// The reduce floors: a ReduceScatter is the first half of an AllReduce; both nothing
	// for buffers of fewer elements than ranks.
	for _, f := range []func(p, n int) time.Duration{ReduceScatterFloor, AllReduceFloor, AllGatherFloor} {
		if d := f(4, 1<<20); d <= 0 {
			t.Fatalf("floor of 1 MiB on 4 ranks = %v", d)
		}
		if d := f(4, 3); d != 0 {
			t.Fatalf("floor of 3 bytes on 4 ranks = %v, want 0", d)
		}
	}
	cs, err := coll.Local(2, coll.Config{})
	if err != nil {
		t.Fatal(err)
	}
	rows := make([][]CollResult, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rows[r], errs[r] = Coll(context.Background(), c, CollOpts{Op: coll.OpAlltoAll, MinBytes: 64 << 10, MaxBytes: 64 << 10, Iters: 3})
		}()
	}
	wg.Wait()
	for r, c := range cs {
		c.Close()
		if errs[r] != nil {
			t.Fatal(errs[r])
		}
	}
	if len(rows[0]) != 1 || rows[0][0].FloorUS <= 0 || rows[0][0].Wrong != 0 {
		t.Fatalf("rows %+v", rows[0])
	}
}

// Sizes are whole operations: rounded down to the granularity (element size, times the
// ranks for split buffers), but a size asked for never becomes an empty operation.
func TestSizes(t *testing.T) {
	for _, c := range []struct {
		op       coll.OpKind
		min, max int
		ranks    int
		want     []int
	}{
		{coll.OpAlltoAll, 10, 10, 3, []int{12}},
		{coll.OpAlltoAll, 0, 100, 3, []int{0, 12, 24, 60}},
		{coll.OpAllReduce, 64 << 10, 256 << 10, 3, []int{64 << 10, 128 << 10, 256 << 10}},
		{coll.OpAllReduce, 6, 6, 3, []int{4}},
		{coll.OpReduceScatter, 100, 100, 8, []int{96}},
	} {
		got := sizes(CollOpts{Op: c.op, DType: dtype.F32, MinBytes: c.min, MaxBytes: c.max, Factor: 2}, c.ranks)
		if !slices.Equal(got, c.want) {
			t.Errorf("%v %d-%d bytes, %d ranks: sizes %v, want %v", c.op, c.min, c.max, c.ranks, got, c.want)
		}
	}
}

// The benchmark's buffers stay theirs while the collector runs: huge obuf buffers that
// nothing holds are unmapped by it, so the benchmark must hold them.
func TestCollBuffersOutliveCollections(t *testing.T) {
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
				runtime.GC()
			}
		}
	}()
	o := CollOpts{Op: coll.OpAlltoAll, MinBytes: 4 << 20, MaxBytes: 4 << 20, Iters: 20, Check: true}
	rows := onRanks(t, 2, coll.Config{}, func(c *coll.Comm) ([]CollResult, error) { return Coll(context.Background(), c, o) })
	close(stop)
	<-done
	if len(rows) != 1 || rows[0].Wrong != 0 {
		t.Fatalf("rows %+v", rows)
	}
}

// The benchmark takes its buffers where it is told, says so in its rows, and refuses to
// take them from two places.
func TestCollBuffers(t *testing.T) {
	for _, c := range []struct {
		heap, shared bool
		want         string
	}{{false, false, "obuf"}, {true, false, "heap"}, {false, true, "shared"}} {
		o := CollOpts{Op: coll.OpAlltoAll, MinBytes: 64 << 10, MaxBytes: 64 << 10, Iters: 5, Check: true, Heap: c.heap, Shared: c.shared}
		rows := onRanks(t, 2, coll.Config{}, func(c *coll.Comm) ([]CollResult, error) { return Coll(context.Background(), c, o) })
		if len(rows) != 1 || rows[0].Wrong != 0 || rows[0].Buffers != c.want {
			t.Fatalf("heap %v shared %v: rows %+v, want buffers %q", c.heap, c.shared, rows, c.want)
		}
	}
	cs, err := coll.Local(1, coll.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer cs[0].Close()
	o := CollOpts{Op: coll.OpAlltoAll, MinBytes: 64 << 10, MaxBytes: 64 << 10, Iters: 5, Heap: true, Shared: true}
	_, err = Coll(context.Background(), cs[0], o)
	var ae *transport.ArgError
	require.ErrorAs(t, err, &ae, "heap and shared")
	assert.Equal(t, "Heap", ae.Arg)
}
