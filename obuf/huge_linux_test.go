package obuf

import (
	"bufio"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
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
		if v, ok := strings.CutPrefix(s.Text(), "VmSize:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")))
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

// Huge buffers that no pool keeps (their class's free list is full) are unmapped once the
// collector finds them unreachable.
func TestDroppedHugeBuffersAreUnmapped(t *testing.T) {
	p := NewPool(1)
	const n = 129 // 512 MiB dropped, never touched: address space only
	bufs := make([]*Buf, n)
	for i := range bufs {
		bufs[i] = p.Get(4 << 20)
	}
	kept := bufs[0]
	before := vmKiB(t)
	for _, b := range bufs {
		b.Release() // the first is kept, the list is then full: the others are dropped
	}
	clear(bufs)
	deadline := time.Now().Add(10 * time.Second)
	for before-vmKiB(t) < 256<<10 { // half of it, whatever else the runtime maps meanwhile
		if time.Now().After(deadline) {
			t.Fatalf("%d dropped 4 MiB buffers: the address space shrank by %d MiB", n-1, (before-vmKiB(t))>>10)
		}
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
	if c := p.Get(4 << 20); c != kept {
		t.Fatal("the kept buffer was not reused")
	}
}
