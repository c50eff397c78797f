package obuf

import (
	"bytes"
	"runtime"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// peerView maps n bytes at off of this process's shared arena through a second file
// descriptor, as another process that took the arena's memfd would.
func peerView(t *testing.T, off int64, n int) []byte {
	t.Helper()
	fd, err := unix.Dup(SharedFD())
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	page := off &^ (PageSize - 1)
	m, err := unix.Mmap(fd, page, int(off-page)+n, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(m) })
	return m[off-page:]
}

// Shared buffers are found by address, anywhere inside them, and another mapping of the
// arena at the offset Locate gives sees the bytes written through the buffer.
func TestSharedPoolLocate(t *testing.T) {
	p := NewSharedPool(0)
	var bufs []*Buf
	for _, n := range []int{1, 4096, 64 << 10, 100000, 3 << 20} {
		b := p.Get(n)
		bufs = append(bufs, b)
		if !b.Shared() {
			t.Fatalf("%d bytes: not shared (%v)", n, SharedErr())
		}
		data := b.Bytes()
		for i := range data {
			data[i] = byte(i*31 + n)
		}
		off, ok := Locate(data)
		if !ok {
			t.Fatalf("%d bytes: Locate found nothing", n)
		}
		if n >= 4096 && off%4096 != 0 {
			t.Fatalf("%d bytes at offset %d: not page aligned", n, off)
		}
		if !bytes.Equal(peerView(t, off, n), data) {
			t.Fatalf("%d bytes: the arena at %d holds other bytes", n, off)
		}
		if n > 10 {
			sub, ok := Locate(data[7 : n-3])
			if !ok || sub != off+7 {
				t.Fatalf("%d bytes: inner slice at %d, %v; want %d", n, sub, ok, off+7)
			}
			// A slice that runs past the buffer's storage is not inside it.
			over := unsafe.Slice(&data[0], b.Cap()+1)
			if _, ok := Locate(over); ok {
				t.Fatalf("%d bytes: a slice past the buffer's end was located", n)
			}
		}
	}
	if !ArenaFile(SharedFD()) {
		t.Fatal("ArenaFile does not know the arena's own memfd")
	}
	if _, ok := Locate(make([]byte, 4096)); ok {
		t.Fatal("heap memory located in the arena")
	}
	if _, ok := Locate(Default.Get(64 << 10).Bytes()); ok {
		t.Fatal("a private pool's buffer located in the arena")
	}
	if ArenaFile(0) {
		t.Fatal("stdin taken for the arena")
	}
	for _, b := range bufs {
		b.Release()
	}
}

func arenaSize(t *testing.T) (size, blocks int64) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(SharedFD(), &st); err != nil {
		t.Fatal(err)
	}
	return st.Size, st.Blocks
}

// Shared buffers that no pool keeps are unmapped once unreachable, their pages go back
// (punched out of the file), and the next buffers of their size take their ranges: the
// arena does not grow with buffers made and dropped.
func TestDroppedSharedBuffersGoBack(t *testing.T) {
	p := NewSharedPool(1)
	const n = 1 << 20
	get := func() (*Buf, int64) {
		b := p.Get(n)
		if !b.Shared() {
			t.Fatalf("not shared: %v", SharedErr())
		}
		clear(b.Bytes()) // touch every page
		off, _ := Locate(b.Bytes())
		return b, off
	}
	bufs := make([]*Buf, 8)
	offs := map[int64]bool{}
	for i := range bufs {
		var off int64
		bufs[i], off = get()
		offs[off] = true
	}
	size, blocks := arenaSize(t)
	for _, b := range bufs {
		b.Release() // the first is kept; the others are dropped
	}
	clear(bufs)
	deadline := time.Now().Add(10 * time.Second)
	for {
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
		_, now := arenaSize(t)
		if blocks-now >= 7*n/512 { // st_blocks counts 512-byte units
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("dropped buffers kept their pages: %d blocks before, %d now", blocks, now)
		}
	}
	for i := 0; i < 8; i++ {
		b, off := get()
		if !offs[off] {
			t.Fatalf("a new buffer took offset %d, not one of the dropped ranges", off)
		}
		defer b.Release()
	}
	if now, _ := arenaSize(t); now != size {
		t.Fatalf("the arena grew from %d to %d bytes", size, now)
	}
}
