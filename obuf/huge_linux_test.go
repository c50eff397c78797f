package obuf

import (
	"bufio"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"
)

// vmKiB is this process's virtual size (VmSize), in KiB.
func vmKiB(t *testing.T) int {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if f := strings.Fields(s.Text()); len(f) >= 2 && f[0] == "VmSize:" { // VmSize: 123456 kB
			n, err := strconv.Atoi(f[1])
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatal("no VmSize in /proc/self/status")
	return 0
}

// A huge mapping takes only its own pages (the alignment slack goes back) and all of
// them go back when it is freed: 500 of them leave the address space as it was. (Each
// kept 6 MiB of it before, 2 MiB of that slack; the runtime may map a few hundred MiB of
// its own meanwhile, under the race detector.)
func TestHugeMappingsGoBack(t *testing.T) {
	before := vmKiB(t)
	for i := 0; i < 500; i++ {
		m, ok := hugeAlloc(3 << 20)
		if !ok {
			t.Fatal("no mapping")
		}
		hugeFree(m)
	}
	if d := vmKiB(t) - before; d > 512<<10 {
		t.Fatalf("500 huge buffers mapped and freed grew the address space by %d MiB", d>>10)
	}
}

// hugeAt reports whether addr lies in a mapping advised to use huge pages (VmFlags hg in
// /proc/self/smaps): one of obuf's, whatever else the runtime maps around them.
func hugeAt(t *testing.T, addr uintptr) bool {
	b, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		t.Fatal(err)
	}
	in := false
	for _, l := range strings.Split(string(b), "\n") {
		if flags, ok := strings.CutPrefix(l, "VmFlags:"); ok {
			if in && slices.Contains(strings.Fields(flags), "hg") {
				return true
			}
			continue
		}
		f := strings.Fields(l)
		if len(f) == 0 {
			continue
		}
		if lo, hi, ok := strings.Cut(f[0], "-"); ok {
			a, err1 := strconv.ParseUint(lo, 16, 64)
			z, err2 := strconv.ParseUint(hi, 16, 64)
			if err1 == nil && err2 == nil {
				in = uint64(addr) >= a && uint64(addr) < z
			}
		}
	}
	return false
}

// Huge buffers that no pool keeps (their class's free list is full) are unmapped once the
// collector finds them unreachable.
func TestDroppedHugeBuffersAreUnmapped(t *testing.T) {
	p := NewPool(1)
	bufs := make([]*Buf, 9)
	addrs := make([]uintptr, len(bufs))
	for i := range bufs {
		bufs[i] = p.Get(4 << 20)
		addrs[i] = uintptr(unsafe.Pointer(unsafe.SliceData(bufs[i].Bytes())))
		if !hugeAt(t, addrs[i]) {
			if i == 0 {
				t.Skip("this kernel keeps no huge-page advice (no VmFlags hg): obuf's mappings cannot be told apart")
			}
			t.Fatalf("buffer %d at %#x: no huge-page mapping there", i, addrs[i])
		}
	}
	kept := bufs[0]
	for _, b := range bufs {
		b.Release() // the first is kept, the list is then full: the others are dropped
	}
	clear(bufs)
	deadline := time.Now().Add(10 * time.Second)
	for i := 1; i < len(addrs); {
		if !hugeAt(t, addrs[i]) {
			i++
			continue
		}
		if time.Now().After(deadline) {
			t.Fatalf("dropped buffer %d at %#x is still mapped", i, addrs[i])
		}
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
	if !hugeAt(t, addrs[0]) {
		t.Fatal("the kept buffer was unmapped")
	}
	if c := p.Get(4 << 20); c != kept {
		t.Fatal("the kept buffer was not reused")
	}
}

// Huge says where obuf mapped huge pages, as the kernel's smaps does: for a slab buffer
// and a huge buffer (and any slice inside them), not for a Go slice, a buffer below
// SlabMin, a range that runs past its mapping, nor for a huge buffer's memory after
// it was unmapped.
func TestHugeSaysWhereHugePagesAre(t *testing.T) {
	p := NewPool(0)
	slabBuf, hugeBuf, small := p.Get(SlabMin), p.Get(3<<20), p.Get(64<<10)
	for _, c := range []struct {
		name string
		b    []byte
		want bool
	}{
		{"slab", slabBuf.Bytes(), true},
		{"huge", hugeBuf.Bytes(), true},
		{"inside huge", hugeBuf.Bytes()[1<<20 : 2<<20], true},
		{"small", small.Bytes(), false},
		{"go slice", make([]byte, 1<<20), false},
		{"empty", nil, false},
	} {
		if got := Huge(c.b); got != c.want {
			t.Errorf("%s: Huge %v, want %v", c.name, got, c.want)
		}
		if len(c.b) > 0 && c.want && !hugeAt(t, uintptr(unsafe.Pointer(&c.b[0]))) {
			t.Errorf("%s: smaps does not say huge pages where Huge does", c.name)
		}
	}
	// A range from inside the mapping to past its end is not in it.
	hb := hugeBuf.Bytes()
	end := unsafe.Slice((*byte)(unsafe.Pointer(&hb[len(hb)-1])), 4<<20)
	if Huge(end) {
		t.Error("a range past the mapping's end: Huge true")
	}
	m, ok := hugeAlloc(4 << 20)
	if !ok {
		t.Fatal("no mapping")
	}
	if !Huge(m) {
		t.Fatal("a fresh mapping: Huge false")
	}
	at := uintptr(unsafe.Pointer(&m[0]))
	hugeFree(m)
	if hugeMaps.holds(at, 1) {
		t.Error("an unmapped mapping is still in the set")
	}
	slabBuf.Release()
	hugeBuf.Release()
	small.Release()
}
