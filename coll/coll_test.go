package coll

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/internal/long"
	"github.com/moex-ai/moex/internal/race"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(testMain{m})
}

// testMain removes the moex commands the tests built once they have run.
type testMain struct{ m *testing.M }

func (tm testMain) Run() int {
	code := tm.m.Run()
	if builtDir != "" {
		_ = os.RemoveAll(builtDir)
	}
	return code
}

var testPs = []int{1, 2, 3, 4, 5, 7, 8}

// newLocal returns n local ranks, closed when the test ends.
func newLocal(t testing.TB, n int, cfg Config) []*Comm {
	t.Helper()
	cs, err := Local(n, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, c := range cs {
			c.Close()
		}
	})
	return cs
}

// world runs f on every rank of n local ranks and returns each rank's error.
func world(t testing.TB, n int, cfg Config, f func(c *Comm) error) []error {
	t.Helper()
	return runOn(newLocal(t, n, cfg), f)
}

func runOn(cs []*Comm, f func(c *Comm) error) []error {
	errs := make([]error, len(cs))
	var wg sync.WaitGroup
	for i, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f(c)
		}()
	}
	wg.Wait()
	return errs
}

func noErr(t testing.TB, errs []error) {
	t.Helper()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
}

// ---- typed test data without generics at the call sites: everything goes through bytes ----

// fill writes element values chosen so that every reduction of up to 8 of them is exact in
// every type (small integers; for prod, 1, 2 and -1), and depends on (rank, index).
func fill(dt dtype.Type, op dtype.Op, b []byte, rank int) {
	n := len(b) / dt.Size()
	for i := 0; i < n; i++ {
		h := (i*7 + rank*13 + i*rank) % 5
		var v float64
		switch op {
		case dtype.Prod:
			v = [...]float64{1, 2, -1, 1, 2}[h]
		default:
			v = float64(h - 2)
		}
		if dt == dtype.U8 && v < 0 {
			v = -v
		}
		setElem(dt, b, i, v)
	}
}

func setElem(dt dtype.Type, b []byte, i int, v float64) {
	switch dt {
	case dtype.F32:
		dtype.FromBytes[float32](b)[i] = float32(v)
	case dtype.F64:
		dtype.FromBytes[float64](b)[i] = v
	case dtype.I32:
		dtype.FromBytes[int32](b)[i] = int32(v)
	case dtype.I64:
		dtype.FromBytes[int64](b)[i] = int64(v)
	case dtype.U8:
		b[i] = uint8(v)
	case dtype.I8:
		dtype.FromBytes[int8](b)[i] = int8(v)
	case dtype.BF16:
		dtype.FromBytes[dtype.BFloat16](b)[i] = dtype.ToBF16(float32(v))
	case dtype.F16:
		dtype.FromBytes[dtype.Float16](b)[i] = dtype.ToF16(float32(v))
	case dtype.FP8E4M3:
		dtype.FromBytes[dtype.FP8E4M3Val](b)[i] = dtype.ToFP8(float32(v))
	}
}

// The generic API is exercised by dispatching on the dtype.
func doAllReduce(ctx context.Context, c *Comm, dt dtype.Type, send, recv []byte, op dtype.Op) error {
	switch dt {
	case dtype.F32:
		return AllReduce(ctx, c, dtype.FromBytes[float32](send), dtype.FromBytes[float32](recv), op)
	case dtype.F64:
		return AllReduce(ctx, c, dtype.FromBytes[float64](send), dtype.FromBytes[float64](recv), op)
	case dtype.I32:
		return AllReduce(ctx, c, dtype.FromBytes[int32](send), dtype.FromBytes[int32](recv), op)
	case dtype.I64:
		return AllReduce(ctx, c, dtype.FromBytes[int64](send), dtype.FromBytes[int64](recv), op)
	case dtype.U8:
		return AllReduce(ctx, c, send, recv, op)
	case dtype.I8:
		return AllReduce(ctx, c, dtype.FromBytes[int8](send), dtype.FromBytes[int8](recv), op)
	case dtype.BF16:
		return AllReduce(ctx, c, dtype.FromBytes[dtype.BFloat16](send), dtype.FromBytes[dtype.BFloat16](recv), op)
	case dtype.F16:
		return AllReduce(ctx, c, dtype.FromBytes[dtype.Float16](send), dtype.FromBytes[dtype.Float16](recv), op)
	case dtype.FP8E4M3:
		return AllReduce(ctx, c, dtype.FromBytes[dtype.FP8E4M3Val](send), dtype.FromBytes[dtype.FP8E4M3Val](recv), op)
	}
	panic(dt)
}

// byteElems wraps a byte view as the right element slice for the non-reducing ops, where
// only the element size matters: u8 for 1, bf16 for 2, f32 for 4, f64 for 8.
func asElems(dt dtype.Type, b []byte) any {
	switch dt.Size() {
	case 1:
		return b
	case 2:
		return dtype.FromBytes[dtype.BFloat16](b)
	case 4:
		return dtype.FromBytes[float32](b)
	}
	return dtype.FromBytes[float64](b)
}

// nilIfEmpty keeps in-place calls distinguishable: a nil send means in place.
func view(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// reference reduces every rank's input in rank order with the kernels themselves.
func reference(dt dtype.Type, op dtype.Op, n, p int) []byte {
	acc := make([]byte, n*dt.Size())
	fill(dt, op, acc, 0)
	tmp := make([]byte, len(acc))
	for r := 1; r < p; r++ {
		fill(dt, op, tmp, r)
		dtype.Reduce(dt, op, acc, tmp)
	}
	dtype.Finish(dt, op, acc, p)
	return acc
}

func sizesFor(dt dtype.Type, big bool) []int {
	s := []int{0, 1, 13}
	if big {
		s = append(s, (1<<20)/dt.Size())
	}
	return s
}

// bigFor says whether the 1 MiB size runs for dt: for every type with -long; f32 alone
// in the quick cut (the schedules depend only on the size, which f32 covers).
func bigFor(dt dtype.Type) bool {
	if !long.Enabled() {
		return dt == dtype.F32
	}
	return true
}

// matrixPs are the rank counts of the matrices: all of testPs with -long; in the quick cut
// one rank, the powers of two 2 and 8, and 3, a power of two and a remainder, as 5 and 7
// are (which -long adds, with 4).
func matrixPs() []int {
	if long.Enabled() {
		return testPs
	}
	return []int{1, 2, 3, 8}
}

// oneOfItsSize says whether dt stands for its element size at 1 MiB: the schedules and
// chunking of a large operation depend on the element size alone (each type's kernel is
// checked at 64 KiB).
func oneOfItsSize(dt dtype.Type) bool {
	switch dt {
	case dtype.U8, dtype.BF16, dtype.F32, dtype.F64:
		return true
	}
	return false
}

// algoSets returns configurations that between them run every algorithm of every op.
func algoSets() []map[OpKind]Algo {
	var sets []map[OpKind]Algo
	most := 0
	for _, as := range Algorithms {
		most = max(most, len(as))
	}
	for i := 0; i < most; i++ {
		m := map[OpKind]Algo{}
		for op, as := range Algorithms {
			m[op] = as[i%len(as)]
		}
		sets = append(sets, m)
	}
	return sets
}

func TestAllReduceMatrix(t *testing.T) {
	ctx := context.Background()
	for _, p := range matrixPs() {
		for si, algos := range algoSets() {
			if si > 0 && algos[OpAllReduce] == algoSets()[0][OpAllReduce] {
				continue
			}
			name := fmt.Sprintf("P=%d/%v", p, algos[OpAllReduce])
			t.Run(name, func(t *testing.T) {
				cs := newLocal(t, p, Config{Algo: algos})
				for _, dt := range dtype.Types {
					for _, op := range dtype.Ops {
						sizes := sizesFor(dt, bigFor(dt) && op == dtype.Sum && oneOfItsSize(dt))
						if op == dtype.Sum && long.Enabled() {
							sizes = append(sizes, (64<<10)/dt.Size()) // every type's kernel beyond the small sizes
						}
						for _, n := range sizes {
							checkAllReduce(t, ctx, cs, dt, op, n)
						}
					}
				}
			})
		}
	}
}

// checkAllReduce runs an AllReduce of n elements on every rank, in and out of place, and
// compares every rank's result, bit for bit, with the reference.
func checkAllReduce(t *testing.T, ctx context.Context, cs []*Comm, dt dtype.Type, op dtype.Op, n int) {
	t.Helper()
	p := len(cs)
	want := reference(dt, op, n, p)
	for _, inPlace := range []bool{false, true} {
		outs := make([][]byte, p)
		noErr(t, runOn(cs, func(c *Comm) error {
			in := make([]byte, n*dt.Size())
			fill(dt, op, in, c.Rank())
			out := make([]byte, len(in))
			outs[c.Rank()] = out
			if inPlace {
				copy(out, in)
				return doAllReduce(ctx, c, dt, nil, out, op)
			}
			return doAllReduce(ctx, c, dt, view(in), out, op)
		}))
		for r, out := range outs {
			if !bytes.Equal(out, want) {
				t.Fatalf("%v %v n=%d inPlace=%v: rank %d differs from the reference", dt, op, n, inPlace, r)
			}
		}
	}
}

func TestDataMovementMatrix(t *testing.T) {
	ctx := context.Background()
	types := []dtype.Type{dtype.U8, dtype.BF16, dtype.F32, dtype.F64, dtype.I32, dtype.I8, dtype.F16, dtype.I64, dtype.FP8E4M3}
	// Every type at 64 KiB; 1 MiB for one type of each element size, since data
	// movement depends on the element size alone (the large paths: rendezvous, chunks,
	// the shared areas' limit).
	sizes := func(dt dtype.Type) []int {
		s := []int{0, 1, 13, (64 << 10) / dt.Size()}
		switch dt {
		case dtype.U8, dtype.BF16, dtype.F32, dtype.F64:
			s = append(s, (1<<20)/dt.Size())
		}
		return s
	}
	if !long.Enabled() {
		// The quick cut: one type of each element size, and 64 KiB in place of 1 MiB:
		// data movement depends on the element size alone, the race detector on the
		// schedules, not on how long the copies are; -long takes every type, and 1 MiB.
		types = []dtype.Type{dtype.U8, dtype.BF16, dtype.F32, dtype.F64}
		sizes = func(dt dtype.Type) []int { return []int{0, 1, 13, (64 << 10) / dt.Size()} }
	}
	for _, p := range matrixPs() {
		seen := map[string]bool{}
		for _, algos := range algoSets() {
			name := fmt.Sprintf("P=%d/bcast=%v,ag=%v,a2a=%v,rs=%v,red=%v", p, algos[OpBroadcast], algos[OpAllGather], algos[OpAlltoAll], algos[OpReduceScatter], algos[OpReduce])
			if seen[name] {
				continue // a set that differs only in the AllReduce algorithm
			}
			seen[name] = true
			t.Run(name, func(t *testing.T) {
				cs := newLocal(t, p, Config{Algo: algos})
				for _, dt := range types {
					for _, n := range sizes(dt) {
						es := dt.Size()
						for _, inPlace := range []bool{false, true} {
							checkBroadcast(t, ctx, cs, dt, n, p-1)
							checkReduce(t, ctx, cs, dt, n, p/2, inPlace)
							checkAllGather(t, ctx, cs, dt, n, inPlace)
							checkAlltoAll(t, ctx, cs, dt, n, inPlace)
							if !inPlace {
								checkReduceScatter(t, ctx, cs, dt, n)
								checkScatterGather(t, ctx, cs, dt, n, 0)
							}
						}
						_ = es
					}
				}
			})
		}
	}
}

func pattern(b []byte, rank, salt int) {
	for i := range b {
		b[i] = byte(i*31 + rank*7 + salt*3 + i>>8)
	}
}

func checkBroadcast(t *testing.T, ctx context.Context, cs []*Comm, dt dtype.Type, n, root int) {
	t.Helper()
	p := len(cs)
	bufs := make([][]byte, p)
	noErr(t, runOn(cs, func(c *Comm) error {
		b := make([]byte, n*dt.Size())
		if c.Rank() == root {
			pattern(b, root, 1)
		}
		bufs[c.Rank()] = b
		switch e := asElems(dt, b).(type) {
		case []byte:
			return Broadcast(ctx, c, e, root)
		case []dtype.BFloat16:
			return Broadcast(ctx, c, e, root)
		case []float32:
			return Broadcast(ctx, c, e, root)
		case []float64:
			return Broadcast(ctx, c, e, root)
		}
		return nil
	}))
	want := make([]byte, n*dt.Size())
	pattern(want, root, 1)
	for r, b := range bufs {
		if !bytes.Equal(b, want) {
			t.Fatalf("broadcast %v n=%d root=%d: rank %d wrong", dt, n, root, r)
		}
	}
}

func checkReduce(t *testing.T, ctx context.Context, cs []*Comm, dt dtype.Type, n, root int, inPlace bool) {
	t.Helper()
	p := len(cs)
	op := dtype.Max
	if dt == dtype.I32 || dt == dtype.F64 {
		op = dtype.Sum
	}
	var got []byte
	inputs := make([][]byte, p)
	noErr(t, runOn(cs, func(c *Comm) error {
		in := make([]byte, n*dt.Size())
		fill(dt, op, in, c.Rank())
		inputs[c.Rank()] = append([]byte(nil), in...)
		var out []byte
		if c.Rank() == root {
			out = make([]byte, len(in))
			got = out
			if inPlace {
				copy(out, in)
				in = nil
			}
		}
		return doReduce(ctx, c, dt, in, out, op, root)
	}))
	if want := reference(dt, op, n, p); !bytes.Equal(got, want) {
		t.Fatalf("reduce %v %v n=%d root=%d inPlace=%v: wrong result at root", dt, op, n, root, inPlace)
	}
	// Inputs of non-roots are left alone.
	for r := range cs {
		in := make([]byte, n*dt.Size())
		fill(dt, op, in, r)
		if !bytes.Equal(in, inputs[r]) {
			t.Fatalf("reduce modified rank %d's input", r)
		}
	}
}

func doReduce(ctx context.Context, c *Comm, dt dtype.Type, send, recv []byte, op dtype.Op, root int) error {
	if send != nil && len(send) == 0 {
		send = []byte{}
	}
	switch dt {
	case dtype.F32:
		return Reduce(ctx, c, dtype.FromBytes[float32](send), dtype.FromBytes[float32](recv), op, root)
	case dtype.F64:
		return Reduce(ctx, c, nilOr(dtype.FromBytes[float64](send), send), dtype.FromBytes[float64](recv), op, root)
	case dtype.I32:
		return Reduce(ctx, c, nilOr(dtype.FromBytes[int32](send), send), dtype.FromBytes[int32](recv), op, root)
	case dtype.BF16:
		return Reduce(ctx, c, nilOr(dtype.FromBytes[dtype.BFloat16](send), send), dtype.FromBytes[dtype.BFloat16](recv), op, root)
	case dtype.F16:
		return Reduce(ctx, c, nilOr(dtype.FromBytes[dtype.Float16](send), send), dtype.FromBytes[dtype.Float16](recv), op, root)
	case dtype.I64:
		return Reduce(ctx, c, nilOr(dtype.FromBytes[int64](send), send), dtype.FromBytes[int64](recv), op, root)
	case dtype.I8:
		return Reduce(ctx, c, nilOr(dtype.FromBytes[int8](send), send), dtype.FromBytes[int8](recv), op, root)
	case dtype.FP8E4M3:
		return Reduce(ctx, c, nilOr(dtype.FromBytes[dtype.FP8E4M3Val](send), send), dtype.FromBytes[dtype.FP8E4M3Val](recv), op, root)
	}
	return Reduce(ctx, c, send, recv, op, root)
}

// nilOr keeps "not in place, zero elements" distinct from "in place" (nil).
func nilOr[T dtype.Elem](s []T, b []byte) []T {
	if b != nil && s == nil {
		return []T{}
	}
	return s
}

func checkAllGather(t *testing.T, ctx context.Context, cs []*Comm, dt dtype.Type, n int, inPlace bool) {
	t.Helper()
	p := len(cs)
	bs := n * dt.Size()
	outs := make([][]byte, p)
	noErr(t, runOn(cs, func(c *Comm) error {
		in := make([]byte, bs)
		pattern(in, c.Rank(), 2)
		out := make([]byte, p*bs)
		outs[c.Rank()] = out
		var send []byte = in
		if inPlace {
			copy(out[c.Rank()*bs:], in)
			send = nil
		}
		switch dt.Size() {
		case 1:
			return AllGather(ctx, c, send, out)
		case 2:
			return AllGather(ctx, c, nilOr(dtype.FromBytes[dtype.BFloat16](send), send), dtype.FromBytes[dtype.BFloat16](out))
		case 4:
			return AllGather(ctx, c, nilOr(dtype.FromBytes[float32](send), send), dtype.FromBytes[float32](out))
		}
		return AllGather(ctx, c, nilOr(dtype.FromBytes[float64](send), send), dtype.FromBytes[float64](out))
	}))
	want := make([]byte, p*bs)
	for r := 0; r < p; r++ {
		pattern(want[r*bs:(r+1)*bs], r, 2)
	}
	for r, out := range outs {
		if !bytes.Equal(out, want) {
			t.Fatalf("allgather %v n=%d inPlace=%v: rank %d wrong", dt, n, inPlace, r)
		}
	}
}

func checkAlltoAll(t *testing.T, ctx context.Context, cs []*Comm, dt dtype.Type, n int, inPlace bool) {
	t.Helper()
	p := len(cs)
	bs := n * dt.Size()
	outs := make([][]byte, p)
	noErr(t, runOn(cs, func(c *Comm) error {
		in := make([]byte, p*bs)
		for j := 0; j < p; j++ {
			pattern(in[j*bs:(j+1)*bs], c.Rank()*100+j, 3)
		}
		out := make([]byte, p*bs)
		if inPlace {
			copy(out, in)
			in = out
		}
		outs[c.Rank()] = out
		switch dt.Size() {
		case 1:
			return AlltoAll(ctx, c, in, out)
		case 2:
			return AlltoAll(ctx, c, dtype.FromBytes[dtype.BFloat16](in), dtype.FromBytes[dtype.BFloat16](out))
		case 4:
			return AlltoAll(ctx, c, dtype.FromBytes[float32](in), dtype.FromBytes[float32](out))
		}
		return AlltoAll(ctx, c, dtype.FromBytes[float64](in), dtype.FromBytes[float64](out))
	}))
	for r, out := range outs {
		for i := 0; i < p; i++ {
			want := make([]byte, bs)
			pattern(want, i*100+r, 3)
			if !bytes.Equal(out[i*bs:(i+1)*bs], want) {
				t.Fatalf("alltoall %v n=%d inPlace=%v: rank %d block from %d wrong", dt, n, inPlace, r, i)
			}
		}
	}
}

func checkReduceScatter(t *testing.T, ctx context.Context, cs []*Comm, dt dtype.Type, n int) {
	t.Helper()
	p := len(cs)
	op := dtype.Sum
	outs := make([][]byte, p)
	noErr(t, runOn(cs, func(c *Comm) error {
		in := make([]byte, p*n*dt.Size())
		fill(dt, op, in, c.Rank())
		keep := append([]byte(nil), in...)
		out := make([]byte, n*dt.Size())
		outs[c.Rank()] = out
		var err error
		switch dt {
		case dtype.U8:
			err = ReduceScatter(ctx, c, in, out, op)
		case dtype.BF16:
			err = ReduceScatter(ctx, c, dtype.FromBytes[dtype.BFloat16](in), dtype.FromBytes[dtype.BFloat16](out), op)
		case dtype.F32:
			err = ReduceScatter(ctx, c, dtype.FromBytes[float32](in), dtype.FromBytes[float32](out), op)
		case dtype.F64:
			err = ReduceScatter(ctx, c, dtype.FromBytes[float64](in), dtype.FromBytes[float64](out), op)
		case dtype.I32:
			err = ReduceScatter(ctx, c, dtype.FromBytes[int32](in), dtype.FromBytes[int32](out), op)
		case dtype.I8:
			err = ReduceScatter(ctx, c, dtype.FromBytes[int8](in), dtype.FromBytes[int8](out), op)
		case dtype.F16:
			err = ReduceScatter(ctx, c, dtype.FromBytes[dtype.Float16](in), dtype.FromBytes[dtype.Float16](out), op)
		case dtype.I64:
			err = ReduceScatter(ctx, c, dtype.FromBytes[int64](in), dtype.FromBytes[int64](out), op)
		case dtype.FP8E4M3:
			err = ReduceScatter(ctx, c, dtype.FromBytes[dtype.FP8E4M3Val](in), dtype.FromBytes[dtype.FP8E4M3Val](out), op)
		}
		if err == nil && !bytes.Equal(in, keep) {
			err = errors.New("reduce-scatter modified its input")
		}
		return err
	}))
	want := reference(dt, op, p*n, p)
	bs := n * dt.Size()
	for r, out := range outs {
		if !bytes.Equal(out, want[r*bs:(r+1)*bs]) {
			t.Fatalf("reducescatter %v n=%d: rank %d wrong", dt, n, r)
		}
	}
}

func checkScatterGather(t *testing.T, ctx context.Context, cs []*Comm, dt dtype.Type, n, root int) {
	t.Helper()
	p := len(cs)
	bs := n * dt.Size()
	outs := make([][]byte, p)
	gathered := make([]byte, p*bs)
	noErr(t, runOn(cs, func(c *Comm) error {
		var src []byte
		if c.Rank() == root {
			src = make([]byte, p*bs)
			pattern(src, 9, 4)
		}
		out := make([]byte, bs)
		outs[c.Rank()] = out
		if err := Scatter(ctx, c, src, out, root); err != nil {
			return err
		}
		var dst []byte
		if c.Rank() == root {
			dst = gathered
		}
		return Gather(ctx, c, out, dst, root)
	}))
	want := make([]byte, p*bs)
	pattern(want, 9, 4)
	for r, out := range outs {
		if !bytes.Equal(out, want[r*bs:(r+1)*bs]) {
			t.Fatalf("scatter %v n=%d: rank %d wrong", dt, n, r)
		}
	}
	if !bytes.Equal(gathered, want) {
		t.Fatalf("gather %v n=%d: root has the wrong blocks", dt, n)
	}
}

func TestBarrierWaitsForEveryone(t *testing.T) {
	for _, p := range testPs {
		var entered sync.WaitGroup
		entered.Add(p)
		var mu sync.Mutex
		arrived := 0
		noErr(t, world(t, p, Config{}, func(c *Comm) error {
			if c.Rank() == p-1 {
				time.Sleep(20 * time.Millisecond)
			}
			mu.Lock()
			arrived++
			mu.Unlock()
			if err := Barrier(context.Background(), c); err != nil {
				return err
			}
			mu.Lock()
			defer mu.Unlock()
			if arrived != p {
				return fmt.Errorf("rank %d left the barrier with %d of %d arrived", c.Rank(), arrived, p)
			}
			return nil
		}))
	}
}

func TestSendRecv(t *testing.T) {
	ctx := context.Background()
	noErr(t, world(t, 3, Config{}, func(c *Comm) error {
		next, prev := (c.Rank()+1)%3, (c.Rank()+2)%3
		for tag := 0; tag < 3; tag++ {
			if err := Send(ctx, c, []int64{int64(c.Rank()*10 + tag)}, next, tag); err != nil {
				return err
			}
		}
		for tag := 2; tag >= 0; tag-- {
			buf := make([]int64, 4)
			n, err := Recv(ctx, c, buf, prev, tag)
			if err != nil {
				return err
			}
			if n != 1 || buf[0] != int64(prev*10+tag) {
				return fmt.Errorf("tag %d: got %v (n=%d)", tag, buf, n)
			}
		}
		return nil
	}))
}

func TestSplit(t *testing.T) {
	ctx := context.Background()
	noErr(t, world(t, 6, Config{}, func(c *Comm) error {
		color := c.Rank() % 2
		if c.Rank() == 5 {
			color = Undefined
		}
		sub, err := c.Split(ctx, color, -c.Rank()) // reverse order by key
		if err != nil {
			return err
		}
		if c.Rank() == 5 {
			if sub != nil {
				return errors.New("undefined color got a communicator")
			}
			return nil
		}
		defer sub.Close()
		wantSize := 3
		if color == 1 {
			wantSize = 2 // ranks 1 and 3 (5 opted out)
		}
		if sub.Size() != wantSize {
			return fmt.Errorf("rank %d: sub size %d want %d", c.Rank(), sub.Size(), wantSize)
		}
		// Keys reverse the order: the highest parent rank is sub rank 0.
		v := []int32{int32(c.Rank())}
		all := make([]int32, sub.Size())
		if err := AllGather(ctx, sub, v, all); err != nil {
			return err
		}
		for i := 1; i < len(all); i++ {
			if all[i] > all[i-1] || int(all[i])%2 != color {
				return fmt.Errorf("rank %d: sub members %v", c.Rank(), all)
			}
		}
		// The parent keeps working alongside the child.
		x := []float64{1}
		return AllReduce(ctx, sub, nil, x, dtype.Sum)
	}))
}

func TestSplitHosts(t *testing.T) {
	ctx := context.Background()
	hosts := []int{0, 0, 1, 1, 2, 2}
	noErr(t, world(t, 6, Config{Hosts: hosts}, func(c *Comm) error {
		if c.Hosts() != 3 {
			return fmt.Errorf("hosts = %d", c.Hosts())
		}
		intra, inter, err := c.SplitHosts(ctx)
		if err != nil {
			return err
		}
		defer intra.Close()
		defer inter.Close()
		if intra.Size() != 2 || inter.Size() != 3 {
			return fmt.Errorf("intra %d inter %d", intra.Size(), inter.Size())
		}
		return nil
	}))
}

func TestNonBlockingAndGroup(t *testing.T) {
	ctx := context.Background()
	noErr(t, world(t, 4, Config{}, func(c *Comm) error {
		a := []float32{float32(c.Rank()), 1}
		b := make([]int32, 4)
		for i := range b {
			b[i] = int32(c.Rank()*4 + i)
		}
		bOut := make([]int32, 4)
		var g Group
		g.Add(IAllReduce(ctx, c, nil, a, dtype.Sum))
		g.Add(IAlltoAll(ctx, c, b, bOut))
		h, err := IBroadcast(ctx, c, []float64{float64(c.Rank())}, 2)
		g.Add(h, err)
		if err := g.Wait(ctx); err != nil {
			return err
		}
		if a[0] != 6 || a[1] != 4 {
			return fmt.Errorf("allreduce %v", a)
		}
		for i := range bOut {
			if bOut[i] != int32(i*4+c.Rank()) {
				return fmt.Errorf("alltoall %v", bOut)
			}
		}
		if !h.Test() {
			return errors.New("handle not complete after Wait")
		}
		return nil
	}))
}

func TestBucketer(t *testing.T) {
	ctx := context.Background()
	noErr(t, world(t, 3, Config{}, func(c *Comm) error {
		b := NewBucketer[float32](c, dtype.Sum, 64) // 16 floats per bucket
		for round := 0; round < 3; round++ {
			var ts [][]float32
			for i := 0; i < 10; i++ {
				t := make([]float32, 1+i*3) // sizes straddle buckets; one is larger than a bucket
				for k := range t {
					t[k] = float32(c.Rank() + k + round)
				}
				ts = append(ts, t)
				if err := b.Add(ctx, t); err != nil {
					return err
				}
			}
			if err := b.Wait(ctx); err != nil {
				return err
			}
			for _, x := range ts {
				for k, v := range x {
					if want := float32(3*(k+round) + 3); v != want {
						return fmt.Errorf("round %d: got %v want %v", round, v, want)
					}
				}
			}
		}
		return nil
	}))
}

// Steady-state operations allocate nothing.
func TestAllocsPerOp(t *testing.T) {
	if race.Enabled {
		t.Skip("allocation counts are meaningless under -race (sync.Pool drops items on purpose)")
	}
	// One host; and two hosts, where the model weighs the hierarchical AllReduce.
	for _, cfg := range []Config{{}, {Hosts: []int{0, 0, 1, 1}, Link: &CostNet, HostLink: &CostShm}} {
		p := max(2, len(cfg.Hosts))
		cs := newLocal(t, p, cfg)
		ctx := context.Background()
		const runs = 200
		bufs := make([][]float32, p)
		a2as := make([][]float32, p)
		for r := range bufs {
			bufs[r], a2as[r] = make([]float32, 1<<14), make([]float32, 1<<14)
		}
		step := func(r int) {
			// A failure is reported and aborts the communicator, so that no rank waits
			// for the one that stopped.
			for _, err := range []error{
				AllReduce(ctx, cs[r], nil, bufs[r], dtype.Sum),
				AlltoAll(ctx, cs[r], bufs[r], a2as[r]),
				Broadcast(ctx, cs[r], bufs[r], 0),
			} {
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
					cs[r].Abort("test failed")
					return
				}
			}
		}
		others := make([]chan struct{}, p)
		var wg sync.WaitGroup
		for r := 1; r < p; r++ {
			others[r] = make(chan struct{})
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range others[r] {
					step(r)
				}
			}()
		}
		op := func() {
			for r := 1; r < p; r++ {
				others[r] <- struct{}{}
			}
			step(0)
		}
		for i := 0; i < 20; i++ {
			op()
		}
		n := testing.AllocsPerRun(runs, op)
		for r := 1; r < p; r++ {
			close(others[r])
		}
		wg.Wait()
		if n > 0 {
			t.Fatalf("hosts %v: %.2f allocations per AllReduce+AlltoAll+Broadcast", cfg.Hosts, n)
		}
	}
}

// Ranks in one process (inproc) have no shared areas, and SharedMemory says so (the
// multi-process tests over shm check that it says yes there).
func TestSharedMemoryInproc(t *testing.T) {
	cs, err := Local(2, Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	if cs[0].SharedMemory() {
		t.Fatal("inproc communicator reports shared memory")
	}
}
