package obuf

import (
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
)

func TestClassesAndAlignment(t *testing.T) {
	p := NewPool(4)
	for _, n := range []int{0, 1, 4095, 4096, 4097, 65536, 1 << 20, 3<<20 + 5} {
		b := p.Get(n)
		if b.Len() != n || len(b.Bytes()) != n {
			t.Fatalf("Get(%d): len %d", n, b.Len())
		}
		if b.Cap() < n || (n > PageSize && b.Cap() >= 2*n) {
			t.Fatalf("Get(%d): cap %d not the next power of two", n, b.Cap())
		}
		if addr := uintptr(unsafe.Pointer(unsafe.SliceData(b.b))); addr%PageSize != 0 {
			t.Fatalf("Get(%d): address %#x not page aligned", n, addr)
		}
		b.Release()
	}
}

func TestReuseInSteadyState(t *testing.T) {
	p := NewPool(4)
	b := p.Get(10000)
	b.Release()
	allocs := p.Stats().Allocs
	for i := 0; i < 100; i++ {
		b := p.Get(9000 + i)
		b.Lend()
		b.Release()
		b.Return()
	}
	if got := p.Stats().Allocs; got != allocs {
		t.Fatalf("steady state allocated %d new buffers", got-allocs)
	}
	if n := testing.AllocsPerRun(100, func() {
		b := p.Get(1 << 20)
		b.Lend()
		b.Return()
		b.Release()
	}); n != 0 {
		t.Fatalf("Get/Lend/Return/Release allocates %v per run", n)
	}
}

// The owner may drop its reference while a send is in flight: the buffer goes back to the
// pool only when the send returns it, so nobody else can get it in between.
func TestInFlightKeepsBufferOutOfPool(t *testing.T) {
	p := NewPool(4)
	b := p.Get(5000)
	b.Lend()
	b.Release() // owner is done with it
	if b.Refs() != 1 || b.InFlight() != 1 {
		t.Fatalf("refs=%d inflight=%d", b.Refs(), b.InFlight())
	}
	c := p.Get(5000)
	if c == b {
		t.Fatal("pool handed out a buffer that a send still reads")
	}
	b.Return()
	if d := p.Get(5000); d != b {
		t.Fatal("returned buffer not reused")
	}
}

func mustPanic(t *testing.T, what string, f func()) {
	t.Helper()
	defer func() {
		if recover() == nil {
			t.Fatalf("%s did not panic", what)
		}
	}()
	f()
}

func TestDoubleReleasePanics(t *testing.T) {
	p := NewPool(4)
	b := p.Get(100)
	b.Release()
	mustPanic(t, "double release", b.Release)
}

func TestReturnWithoutLendPanics(t *testing.T) {
	b := NewPool(4).Get(100)
	mustPanic(t, "Return without Lend", b.Return)
}

func TestRetainAfterReleasePanics(t *testing.T) {
	b := NewPool(4).Get(100)
	b.Release()
	mustPanic(t, "Retain after release", func() { b.Retain() })
}

func TestResize(t *testing.T) {
	b := NewPool(4).Get(100)
	b.Resize(4096)
	if b.Len() != 4096 {
		t.Fatal(b.Len())
	}
	mustPanic(t, "Resize beyond capacity", func() { b.Resize(b.Cap() + 1) })
}

func BenchmarkGetRelease(b *testing.B) {
	p := NewPool(0)
	b.ReportAllocs()
	for b.Loop() {
		x := p.Get(64 << 10)
		x.Release()
	}
}

func TestHugeBuffers(t *testing.T) {
	p := NewPool(2)
	b := p.Get(3 << 20)
	if !b.Huge() {
		t.Skip("this platform gives no huge-page mappings (not linux)")
	}
	if addr := uintptr(unsafe.Pointer(unsafe.SliceData(b.Bytes()))); addr%(2<<20) != 0 {
		t.Fatalf("huge buffer at %#x is not 2 MiB aligned", addr)
	}
	for i := range b.Bytes() {
		b.Bytes()[i] = byte(i)
	}
	b.Release()
	if c := p.Get(3 << 20); c != b {
		t.Fatal("huge buffer not reused")
	}
	if small := p.Get(SlabMin / 2); small.Huge() {
		t.Fatal("a buffer below SlabMin is huge-page backed")
	}
}

// Buffers from SlabMin to 2 MiB are cut out of 2 MiB huge pages shared by buffers of one
// size, and a slab is unmapped once all of its buffers are unreachable.
func TestSlabBuffers(t *testing.T) {
	if SlabMin >= HugeThreshold {
		t.Skip("this platform gives no huge-page mappings (not linux)")
	}
	var mapped int
	func() {
		p := NewPool(1)
		var a *Buf
		for n0 := slabsMapped(); slabsMapped() == n0; { // until one starts a slab
			a = p.Get(1 << 20)
			defer runtime.KeepAlive(a)
		}
		b := p.Get(1 << 20) // the rest of that slab
		require.True(t, a.Huge())
		require.True(t, b.Huge())
		pa, pb := uintptr(unsafe.Pointer(unsafe.SliceData(a.Bytes()))), uintptr(unsafe.Pointer(unsafe.SliceData(b.Bytes())))
		require.Equal(t, pa&^(2<<20-1), pb&^(2<<20-1), "two 1 MiB buffers in one huge page")
		require.NotEqual(t, pa, pb)
		require.Equal(t, 1<<20, a.Cap())
		for i := range a.Bytes() { // writing one does not touch the other
			a.Bytes()[i] = 1
		}
		clear(b.Bytes())
		require.Equal(t, byte(1), a.Bytes()[len(a.Bytes())-1])
		n := slabsMapped()
		c := p.Get(1 << 20) // the slab is cut whole: a new one
		mapped = slabsMapped()
		require.Equal(t, n+1, mapped)
		runtime.KeepAlive(c)
	}()
	// Unreachable (never released to a pool that would keep them): the whole slab goes,
	// the one still being cut stays for the next buffers of its size.
	require.Eventually(t, func() bool {
		runtime.GC()
		return slabsMapped() < mapped
	}, 5*time.Second, 10*time.Millisecond)
}

func TestRegCacheRegistersOnce(t *testing.T) {
	calls, released := 0, 0
	c := NewRegCache(func(b []byte) (any, error) { calls++; return calls, nil }, func(h any) { released++ })
	p := NewPool(2)
	a, b := p.Get(10000), p.Get(3<<20)
	for i := 0; i < 5; i++ {
		if h, err := c.Register(a); err != nil || h != 1 {
			t.Fatalf("register a: %v %v", h, err)
		}
	}
	if h, _ := c.Register(b); h != 2 {
		t.Fatalf("register b: %v", h)
	}
	if calls != 2 {
		t.Fatalf("%d registrations for 2 buffers", calls)
	}
	// A send from the middle of a registered buffer finds its handle; foreign memory none.
	if h := c.Lookup(a.Bytes()[100:200]); h != 1 {
		t.Fatalf("lookup inside a: %v", h)
	}
	if h := c.Lookup(b.Bytes()[1<<20:]); h != 2 {
		t.Fatalf("lookup inside b: %v", h)
	}
	if h := c.Lookup(make([]byte, 100)); h != nil {
		t.Fatalf("lookup of foreign memory: %v", h)
	}
	c.Close()
	if released != 2 || c.Len() != 0 {
		t.Fatalf("released %d", released)
	}
}

// A Scratch grows by trading its buffer for a bigger one, keeps its storage while it
// fits, and gives it back on Release: no allocation in steady state.
func TestScratch(t *testing.T) {
	p := NewPool(4)
	s := Scratch{Pool: p}
	a := s.Bytes(100)
	if len(a) != 100 {
		t.Fatalf("len %d", len(a))
	}
	a[0] = 7
	if b := s.Bytes(4000); &b[0] != &a[0] || b[0] != 7 {
		t.Fatal("a size within the capacity changed the storage")
	}
	big := s.Bytes(3 << 20)
	if len(big) != 3<<20 {
		t.Fatalf("len %d", len(big))
	}
	if st := p.Stats(); st.Releases != 1 {
		t.Fatalf("growing released %d buffers, want 1", st.Releases)
	}
	allocs := testing.AllocsPerRun(100, func() { s.Bytes(1 << 20); s.Bytes(3 << 20) })
	if allocs != 0 {
		t.Fatalf("%v allocations per steady-state use", allocs)
	}
	s.Release()
	if st := p.Stats(); st.Gets != st.Releases {
		t.Fatalf("gets %d, releases %d after Release", st.Gets, st.Releases)
	}
	s.Release() // twice is harmless
}

// Capacity says what capacity Get gives.
func TestCapacity(t *testing.T) {
	p := NewPool(0)
	for _, n := range []int{0, 1, 4096, 4097, 5000, 3 << 20, 1<<28 + 1, 1<<30 + 1} {
		if n > 1<<30 {
			require.Equal(t, n, Capacity(n), "beyond the largest class")
			continue
		}
		b := p.Get(n)
		require.Equal(t, b.Cap(), Capacity(n), "Get(%d)", n)
		b.Release()
	}
}

// A Scratch's Cap is the size class it holds: what Bytes returns without growing.
func TestScratchCap(t *testing.T) {
	s := Scratch{Pool: NewPool(0)}
	require.Zero(t, s.Cap(), "before the first Bytes")
	s.Bytes(5000)
	require.Equal(t, 8192, s.Cap(), "5000 bytes take the 8 KiB class")
	s.Bytes(8192)
	require.Equal(t, 8192, s.Cap(), "a size within the capacity keeps the storage")
	s.Bytes(3 << 20)
	require.Equal(t, 4<<20, s.Cap())
	s.Release()
	require.Zero(t, s.Cap(), "after Release")
}
