package coll

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/internal/race"
)

// vcounts are uneven block sizes (one empty) scaled by base; displs, when scattered, put
// the blocks in reverse rank order with gaps between them (so that no range of blocks is
// contiguous: the algorithms that need packed blocks must not be used).
func vcounts(p, base int) []int {
	c := make([]int, p)
	for q := range c {
		c[q] = ((q*7 + 3) % 5) * base
	}
	if p > 2 {
		c[1] = 0
	}
	return c
}

func vdispls(counts []int, scattered bool) ([]int, int) {
	if !scattered {
		return nil, sum(counts)
	}
	d := make([]int, len(counts))
	o := 3
	for q := len(counts) - 1; q >= 0; q-- {
		d[q] = o
		o += counts[q] + 2
	}
	return d, o
}

func sum(s []int) int {
	t := 0
	for _, v := range s {
		t += v
	}
	return t
}

func displOf(counts, displs []int, q int) int {
	if displs != nil {
		return displs[q]
	}
	return sum(counts[:q])
}

// doV calls the generic v-form of op for dt's element size (the reductions: the type
// itself).
func doV(ctx context.Context, c *Comm, op OpKind, dt dtype.Type, send, recv []byte, counts, displs []int, redop dtype.Op, root int) error {
	switch dt {
	case dtype.U8:
		return callV(ctx, c, op, send, recv, counts, displs, redop, root)
	case dtype.BF16:
		return callV(ctx, c, op, dtype.FromBytes[dtype.BFloat16](send), dtype.FromBytes[dtype.BFloat16](recv), counts, displs, redop, root)
	case dtype.F32:
		return callV(ctx, c, op, dtype.FromBytes[float32](send), dtype.FromBytes[float32](recv), counts, displs, redop, root)
	case dtype.F64:
		return callV(ctx, c, op, dtype.FromBytes[float64](send), dtype.FromBytes[float64](recv), counts, displs, redop, root)
	case dtype.I32:
		return callV(ctx, c, op, dtype.FromBytes[int32](send), dtype.FromBytes[int32](recv), counts, displs, redop, root)
	case dtype.I64:
		return callV(ctx, c, op, dtype.FromBytes[int64](send), dtype.FromBytes[int64](recv), counts, displs, redop, root)
	case dtype.I8:
		return callV(ctx, c, op, dtype.FromBytes[int8](send), dtype.FromBytes[int8](recv), counts, displs, redop, root)
	case dtype.F16:
		return callV(ctx, c, op, dtype.FromBytes[dtype.Float16](send), dtype.FromBytes[dtype.Float16](recv), counts, displs, redop, root)
	case dtype.FP8E4M3:
		return callV(ctx, c, op, dtype.FromBytes[dtype.FP8E4M3Val](send), dtype.FromBytes[dtype.FP8E4M3Val](recv), counts, displs, redop, root)
	}
	panic(dt)
}

func callV[T dtype.Elem](ctx context.Context, c *Comm, op OpKind, send, recv []T, counts, displs []int, redop dtype.Op, root int) error {
	if send == nil {
		send = []T{} // not in place
	}
	switch op {
	case OpAllGatherv:
		return AllGatherv(ctx, c, send, recv, counts, displs)
	case OpReduceScatterv:
		return ReduceScatterv(ctx, c, send, recv, counts, redop)
	case OpGatherv:
		return Gatherv(ctx, c, send, recv, counts, displs, root)
	case OpScatterv:
		return Scatterv(ctx, c, send, counts, displs, recv, root)
	}
	panic(op)
}

// checkV runs one variable-size op on every rank of cs and compares every byte with the
// reference (the blocks each rank must hold; the gaps between scattered blocks untouched).
func checkV(t *testing.T, cs []*Comm, op OpKind, dt dtype.Type, redop dtype.Op, base int, scattered bool) {
	t.Helper()
	ctx := context.Background()
	p := len(cs)
	es := dt.Size()
	counts := vcounts(p, base)
	displs, size := vdispls(counts, scattered)
	if op == OpReduceScatterv {
		displs, size = nil, sum(counts)
	}
	root := p - 1
	outs := make([][]byte, p)
	const gap = 0xa5
	noErr(t, runOn(cs, func(c *Comm) error {
		r := c.Rank()
		var send, recv []byte
		switch op {
		case OpAllGatherv, OpGatherv:
			send = make([]byte, counts[r]*es)
			pattern(send, r, 5)
			recv = bytes.Repeat([]byte{gap}, size*es)
		case OpScatterv:
			send = bytes.Repeat([]byte{gap}, size*es)
			for q := 0; q < p; q++ {
				d := displOf(counts, displs, q)
				pattern(send[d*es:(d+counts[q])*es], q, 5)
			}
			recv = make([]byte, counts[r]*es)
		case OpReduceScatterv:
			send = make([]byte, size*es)
			fill(dt, redop, send, r)
			recv = make([]byte, counts[r]*es)
		}
		outs[r] = recv
		return doV(ctx, c, op, dt, send, recv, counts, displs, redop, root)
	}))
	for r, out := range outs {
		switch op {
		case OpAllGatherv, OpGatherv:
			if op == OpGatherv && r != root {
				continue
			}
			want := bytes.Repeat([]byte{gap}, size*es)
			for q := 0; q < p; q++ {
				d := displOf(counts, displs, q)
				pattern(want[d*es:(d+counts[q])*es], q, 5)
			}
			require.True(t, bytes.Equal(out, want), "%v %v P=%d base=%d scattered=%v: rank %d's result differs", op, dt, p, base, scattered, r)
		case OpScatterv:
			want := make([]byte, counts[r]*es)
			pattern(want, r, 5)
			require.True(t, bytes.Equal(out, want), "%v %v P=%d: rank %d's block differs", op, dt, p, r)
		case OpReduceScatterv:
			ref := reference(dt, redop, size, p)
			d := displOf(counts, nil, r)
			require.True(t, bytes.Equal(out, ref[d*es:(d+counts[r])*es]), "%v %v %v P=%d: rank %d differs from the reference", op, dt, redop, p, r)
		}
	}
}

// The correctness matrix of the variable-size forms: every algorithm (by override),
// every element type, every reduction for ReduceScatterv, uneven counts with an empty
// block, blocks packed and scattered.
func TestVariableSizeMatrix(t *testing.T) {
	for _, p := range testPs {
		for _, op := range []OpKind{OpAllGatherv, OpReduceScatterv, OpGatherv, OpScatterv} {
			for _, algo := range Algorithms[op] {
				if algo == Shared {
					continue // needs every rank in its own process over shm: TestMultiProcessShm
				}
				t.Run(fmt.Sprintf("P=%d/%v/%v", p, op, algo), func(t *testing.T) {
					cs := newLocal(t, p, Config{Algo: map[OpKind]Algo{op: algo}})
					for _, dt := range dtype.Types {
						for _, base := range []int{1, 37} {
							if op == OpReduceScatterv {
								for _, redop := range dtype.Ops {
									checkV(t, cs, op, dt, redop, base, false)
								}
								continue
							}
							checkV(t, cs, op, dt, dtype.Sum, base, false)
							checkV(t, cs, op, dt, dtype.Sum, base, true)
						}
					}
				})
			}
		}
	}
}

// The hierarchical plans with ranks on pretend hosts, and big blocks for every algorithm.
func TestVariableSizeHierAndLarge(t *testing.T) {
	for _, hosts := range [][]int{{0, 0, 1, 1}, {0, 1, 0, 1}, {0, 0, 0, 1, 1, 1}} {
		cs := newLocal(t, len(hosts), Config{Hosts: hosts, Algo: map[OpKind]Algo{OpAllGatherv: Hier, OpReduceScatterv: Hier}})
		checkV(t, cs, OpAllGatherv, dtype.F32, dtype.Sum, 300, false)
		checkV(t, cs, OpAllGatherv, dtype.F32, dtype.Sum, 300, true)
		checkV(t, cs, OpReduceScatterv, dtype.F32, dtype.Sum, 300, false)
	}
	for _, algo := range []Algo{Ring, RecDoubling, Bruck} {
		cs := newLocal(t, 4, Config{Algo: map[OpKind]Algo{OpAllGatherv: algo}})
		checkV(t, cs, OpAllGatherv, dtype.F32, dtype.Sum, 100_000, false)
	}
}

// Ranks whose counts disagree fail, every one of them, with ErrMismatch; bad counts are
// an ArgError naming them.
func TestVariableSizeErrors(t *testing.T) {
	ctx := context.Background()
	errs := world(t, 3, Config{}, func(c *Comm) error {
		counts := []int{2, 3, 4}
		if c.Rank() == 1 {
			counts = []int{2, 3, 5}
		}
		recv := make([]float32, sum(counts))
		return AllGatherv(ctx, c, make([]float32, counts[c.Rank()]), recv, counts, nil)
	})
	for r, err := range errs {
		assert.ErrorIs(t, err, ErrMismatch, "rank %d", r)
	}
	cs := newLocal(t, 1, Config{})
	var ae *ArgError
	err := AllGatherv(ctx, cs[0], []float32{1}, make([]float32, 1), []int{-1}, nil)
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, "counts[0]", ae.Arg)
	cs = newLocal(t, 1, Config{})
	err = ReduceScatterv(ctx, cs[0], make([]float32, 3), make([]float32, 2), []int{3}, dtype.Sum)
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, "recv", ae.Arg)
	cs = newLocal(t, 1, Config{})
	err = Gatherv(ctx, cs[0], make([]float32, 2), make([]float32, 2), []int{2}, []int{1}, 0)
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, "recv", ae.Arg)
	assert.True(t, errors.Is(err, ErrInvalidArgument))
}

// With counts that repeat, the variable-size forms allocate nothing.
func TestVariableSizeAllocs(t *testing.T) {
	if race.Enabled {
		t.Skip("allocation counts are meaningless under -race (sync.Pool drops items on purpose)")
	}
	ctx := context.Background()
	cs := newLocal(t, 2, Config{})
	counts := []int{5, 9}
	recvs := [][]float32{make([]float32, 14), make([]float32, 14)}
	out := [][]float32{make([]float32, 5), make([]float32, 9)}
	step := func(c *Comm) error {
		if err := AllGatherv(ctx, c, nil, recvs[c.Rank()], counts, nil); err != nil {
			return err
		}
		return ReduceScatterv(ctx, c, recvs[c.Rank()], out[c.Rank()], counts, dtype.Sum)
	}
	other := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		var err error
		for range other {
			if e := step(cs[1]); e != nil && err == nil {
				err = e
			}
		}
		done <- err
	}()
	var first error
	run := func() {
		other <- struct{}{}
		if err := step(cs[0]); err != nil && first == nil {
			first = err
		}
	}
	for i := 0; i < 5; i++ {
		run()
	}
	n := testing.AllocsPerRun(50, run)
	close(other)
	require.NoError(t, <-done)
	require.NoError(t, first)
	assert.Zero(t, n, "allocations per AllGatherv + ReduceScatterv")
}
