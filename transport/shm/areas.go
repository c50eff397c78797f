package shm

import (
	"fmt"
	"os"
	"runtime"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
)

// The shared area: at the end of every segment, transport.AreaHeader bytes of words then
// 3 x areaCap bytes of data, which package coll's shared-area collectives lay out and
// use (transport.Areas); the transport only lends it, with what those collectives need of
// the operating system: futexes, cross-memory attach, the peers' shared arenas.

const (
	// SharedMin is the smallest send buffer from obuf's shared arena that the others read
	// in place. Reading in place saves the copy into the area but makes the sender wait
	// until every reader is done, one more wait, which below this costs more than the
	// copy: moex bench coll --op alltoall --transport shm at f680dc1, which read shared
	// buffers in place at every size (2 CPUs, --iters 5000-50000, private buffers against
	// --shared, alternating): P=4 4 KiB 5.5-7.3 against 7.8-8.7
	// us, 16 KiB 8.3-8.9 against 7.6-8.5, 32 KiB 9.9-11.4 against 7.8-10.5; P=8 16 KiB
	// 37 against 25-27; P=2 4 KiB 0.8-1.2 against 1.0-1.2, 16 KiB 1.8-1.9 against 1.3-1.5.
	SharedMin = 16 << 10

	// DefaultAreaBytes is the default for the largest send buffer a shared-area operation
	// copies through the area. Larger ones are read across (process_vm_readv) from the
	// send buffer itself, where cross-memory attach works. Measured with moex bench coll
	// (alltoall, 2 CPUs): two copies through the area beat one copy across up to about
	// 1 MiB per rank.
	DefaultAreaBytes = 1 << 20
)

func areaBytes(areaCap int) int {
	if areaCap <= 0 {
		return 0
	}
	return transport.AreaHeader + 3*areaCap
}

func (s *segment) areaBase() int { return len(s.mem) - areaBytes(s.areaCap) }

// areas is the transport.Areas of a transport whose every rank is on this host.
type areas struct {
	t     *Transport
	cap   int
	pull  bool // cross-memory attach works with every peer
	procs bool // the peers are other processes
	liov  [1]unix.Iovec
	riov  [1]unix.RemoteIovec
}

var _ transport.SharedSegment = (*Transport)(nil)

// Areas implements transport.SharedSegment: nil when some rank is not on this host or
// the areas are disabled (Config.AreaBytes < 0). Only one communicator may use them: the
// first call claims them, later calls get nil.
func (t *Transport) Areas() transport.Areas {
	if t.size < 2 || t.own.areaCap <= 0 || !t.areasFree.CompareAndSwap(true, false) {
		return nil
	}
	c := t.own.areaCap
	pull := true
	for q, p := range t.list() {
		if q == t.rank {
			continue
		}
		if p == nil {
			t.areasFree.Store(true)
			return nil
		}
		c = min(c, p.seg.areaCap)
		pull = pull && p.cma
	}
	if c <= 0 {
		t.areasFree.Store(true)
		return nil
	}
	a := &areas{t: t, cap: c, pull: pull, procs: true}
	for _, p := range t.list() {
		if p != nil && p.pid == os.Getpid() && t.size > runtime.GOMAXPROCS(0) {
			a.procs = false // ranks as goroutines (tests), more than Ps: they need Go's scheduler
		}
	}
	return a
}

func (a *areas) seg(q int) *segment {
	if q == a.t.rank {
		return a.t.own
	}
	return a.t.list()[q].seg
}

func (a *areas) Area(q int) []byte {
	s := a.seg(q)
	return s.mem[s.areaBase():]
}

func (a *areas) Cap() int                                  { return a.cap }
func (a *areas) Poller() *busypoll.Poller                  { return a.t.poller }
func (a *areas) Processes() bool                           { return a.procs }
func (a *areas) Wake(word *uint32)                         { futexWakeAll(word) }
func (a *areas) CanReadAcross() bool                       { return a.pull }
func (a *areas) Closed() bool                              { return a.t.closed.Load() }
func (a *areas) Rewind() bool                              { return a.t.rewind }
func (a *areas) Stream() int                               { return a.t.stream }
func (a *areas) Release()                                  { a.t.life.RUnlock() }
func (a *areas) ArenaData(q int, off uint64, n int) []byte { return a.t.list()[q].arenaData(off, n) }

func (a *areas) Park(word *uint32, v uint32, d time.Duration) bool {
	return a.t.park(word, v, int64(d))
}

func (a *areas) ReadAcross(q int, dst []byte, addr uint64) error {
	return cmaRead(a.t.list()[q].pid, dst, addr, &a.liov, &a.riov)
}

// ShareArena publishes this process's arena file in the segment's header, where the
// peers take it (pidfd_getfd) to map the buffers this rank publishes from it.
func (a *areas) ShareArena() {
	if w := a.t.own.u64(offArenaFD); atomic.LoadUint64(w) == 0 { // the arena's fd never changes
		atomic.StoreUint64(w, uint64(obuf.SharedFD()+1))
	}
}

func (a *areas) Hold() bool {
	a.t.life.RLock()
	if a.t.closed.Load() {
		a.t.life.RUnlock()
		return false
	}
	return true
}

func (a *areas) PeerGone(q int, op string) error {
	p := a.t.list()[q]
	if p.seg.state() == stateClosed {
		return &transport.PeerError{Rank: q, Op: op, Err: fmt.Errorf("%w: closed", transport.ErrPeerClosed)}
	}
	if p.isDead() {
		return p.peerErr(op)
	}
	return nil
}

func (a *areas) Count(ops, parks, timeouts, inPlace, across uint64) {
	t := a.t
	t.areaOps.Add(ops)
	t.areaParks.Add(parks)
	t.areaTimeouts.Add(timeouts)
	t.sharedBytes.Add(inPlace)
	t.cmaBytes.Add(across)
}
