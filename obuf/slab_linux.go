package obuf

import "sync"

// SlabMin is the smallest buffer carved out of a huge page: pooled buffers from SlabMin
// up to HugeThreshold are slices of 2 MiB huge-page mappings, each shared by buffers of
// one size (a slab), so that the kernel pins them a huge page at a time too. Measured
// with moex bench coll --op allreduce --transport shm --ranks 2, whose 1 MiB combine
// reads the other rank's buffer with process_vm_readv (2 CPUs, alternating, three runs):
// 512 KiB 127-133 us from 4 KiB pages against 80-84 from a slab, 1 MiB 228-235 against
// 149-156. A slab costs the memory of a whole huge page however few buffers it holds.
const SlabMin = 256 << 10

// slab is one huge page cut into buffers of one size.
type slab struct {
	mem  []byte // hugeAlloc(hugePage)
	size int    // of its buffers
	next int    // bytes handed out
	live int    // buffers handed out and not yet collected
}

func (s *slab) full() bool { return s.next+s.size > len(s.mem) }

var slabs struct {
	mu  sync.Mutex
	cur map[int]*slab // the slab being cut, by buffer size
	n   int           // slabs mapped (for tests)
}

// slabAlloc returns n bytes, n a power of two from SlabMin to half a huge page, of a slab
// of buffers of n bytes, and the slab, for slabFree once the buffer is unreachable.
func slabAlloc(n int) ([]byte, *slab, bool) {
	slabs.mu.Lock()
	defer slabs.mu.Unlock()
	s := slabs.cur[n]
	if s == nil {
		m, ok := hugeAlloc(hugePage)
		if !ok {
			return nil, nil, false
		}
		if slabs.cur == nil {
			slabs.cur = map[int]*slab{}
		}
		s = &slab{mem: m, size: n}
		slabs.cur[n] = s
		slabs.n++
	}
	b := s.mem[s.next : s.next+n : s.next+n]
	s.next += n
	s.live++
	if s.full() {
		delete(slabs.cur, n) // the next buffer of this size starts a new slab
	}
	return b, s, true
}

// slabFree counts a buffer of s out, and unmaps s once it is cut whole and none of its
// buffers is left (a slab still being cut stays, for the next buffers of its size).
func slabFree(s *slab) {
	slabs.mu.Lock()
	defer slabs.mu.Unlock()
	s.live--
	if s.live == 0 && s.full() {
		hugeFree(s.mem)
		slabs.n--
	}
}

// slabsMapped reports how many slabs are mapped.
func slabsMapped() int {
	slabs.mu.Lock()
	defer slabs.mu.Unlock()
	return slabs.n
}
