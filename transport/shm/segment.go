package shm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A segment is one rank's shared-memory file in /dev/shm: a header, then one ring per
// source rank that the source writes and the owner reads. Layout (bytes):
//
//	0    magic "MOEXSHM1"
//	8    pid (u32), rank (u32)
//	16   ranks (u32), slots per ring (u32), slot size (u32), shared-area capacity (u32)
//	32   state (u32): 1 ready, 2 closed
//	64   doorbell (u32 futex word): incremented by every producer after publishing
//	128  sleeping (u32): the owner's progress loop is (about to be) parked on the doorbell
//	192  the owner's shared arena's file descriptor in its process, plus one (u64; 0:
//	     none), for the peers that map the buffers it publishes from it
//	256  ring of source 0, ring of source 1, ...
//	then the shared area of the collectives (see areas.go)
//
// A ring: head (u64, producer) at +0, tail (u64, consumer) at +64, wantSpace (u32,
// producer blocked on a full ring) at +128, then slots at +256. A slot is a wire.Header
// followed by its payload.

const (
	segMagic    = "MOEXSHM1"
	offPid      = 8
	offRank     = 12
	offRanks    = 16
	offSlots    = 20
	offSlotSize = 24
	offAreaCap  = 28
	offState    = 32
	offDoorbell = 64
	offSleeping = 128
	offArenaFD  = 192
	offRings    = 256
	ringHdr     = 256

	stateReady  = 1
	stateClosed = 2

	segPrefix = "moex-"
)

// DevShm is where segments live.
var DevShm = "/dev/shm"

type segment struct {
	mem      []byte
	name     string // file name in DevShm
	ranks    int
	slots    int
	slotSize int
	areaCap  int      // the largest buffer copied through the shared area (which holds 3x)
	file     *os.File // this rank's own segment's, kept open for a process that takes over a rank (Join)
}

func ringBytes(slots, slotSize int) int { return ringHdr + slots*slotSize }

func segmentSize(ranks, slots, slotSize, areaCap int) int {
	return offRings + ranks*ringBytes(slots, slotSize) + areaBytes(areaCap)
}

// createSegment makes and maps this rank's segment.
func createSegment(name string, rank, ranks, slots, slotSize, areaCap int) (*segment, error) {
	path := filepath.Join(DevShm, name)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("shm: creating %s: %w", path, err)
	}
	size := segmentSize(ranks, slots, slotSize, areaCap)
	if err := f.Truncate(int64(size)); err != nil {
		f.Close()
		os.Remove(path)
		return nil, fmt.Errorf("shm: sizing %s to %d bytes: %w", path, size, err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		f.Close()
		os.Remove(path)
		return nil, fmt.Errorf("shm: mapping %s: %w", path, err)
	}
	s := &segment{mem: mem, name: name, ranks: ranks, slots: slots, slotSize: slotSize, areaCap: areaCap, file: f}
	le := binary.LittleEndian
	le.PutUint32(mem[offPid:], uint32(os.Getpid()))
	le.PutUint32(mem[offRank:], uint32(rank))
	le.PutUint32(mem[offRanks:], uint32(ranks))
	le.PutUint32(mem[offSlots:], uint32(slots))
	le.PutUint32(mem[offSlotSize:], uint32(slotSize))
	le.PutUint32(mem[offAreaCap:], uint32(areaCap))
	copy(mem[0:8], segMagic)
	atomic.StoreUint32(s.u32(offState), stateReady)
	return s, nil
}

// openSegment maps a peer's segment and checks it is what the rendezvous said.
func openSegment(name string, rank, ranks int) (*segment, error) {
	path := filepath.Join(DevShm, name)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("shm: opening rank %d's segment %s: %w", rank, path, err)
	}
	defer f.Close()
	return mapSegment(f, path, rank, ranks)
}

// mapSegment maps the peer's segment open as f (named path in errors) and checks it is
// rank's of ranks.
func mapSegment(f *os.File, path string, rank, ranks int) (*segment, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.Size() < offRings {
		return nil, fmt.Errorf("shm: rank %d's segment %s is too small (%d bytes)", rank, path, st.Size())
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("shm: mapping %s: %w", path, err)
	}
	le := binary.LittleEndian
	s := &segment{mem: mem, name: filepath.Base(path), ranks: int(le.Uint32(mem[offRanks:])), slots: int(le.Uint32(mem[offSlots:])),
		slotSize: int(le.Uint32(mem[offSlotSize:])), areaCap: int(le.Uint32(mem[offAreaCap:]))}
	switch {
	case string(mem[:8]) != segMagic:
		err = fmt.Errorf("shm: %s is not a moex segment", path)
	case int(le.Uint32(mem[offRank:])) != rank || s.ranks != ranks:
		err = fmt.Errorf("shm: %s belongs to rank %d of %d, expected rank %d of %d", path, le.Uint32(mem[offRank:]), s.ranks, rank, ranks)
	case int(st.Size()) != segmentSize(s.ranks, s.slots, s.slotSize, s.areaCap):
		err = fmt.Errorf("shm: %s has %d bytes, its header says %d", path, st.Size(), segmentSize(s.ranks, s.slots, s.slotSize, s.areaCap))
	}
	if err != nil {
		unix.Munmap(mem)
		return nil, err
	}
	return s, nil
}

func (s *segment) u32(off int) *uint32 { return (*uint32)(unsafe.Pointer(&s.mem[off])) }
func (s *segment) u64(off int) *uint64 { return (*uint64)(unsafe.Pointer(&s.mem[off])) }

func (s *segment) state() uint32 { return atomic.LoadUint32(s.u32(offState)) }

func (s *segment) unmap() {
	if s.mem != nil {
		unix.Munmap(s.mem)
		s.mem = nil
	}
	if s.file != nil {
		s.file.Close()
		s.file = nil
	}
}

// ring is a view of one single-producer single-consumer ring inside a segment.
type ring struct {
	seg      *segment
	base     int // offset of the ring header
	slots    uint64
	slotSize int
}

func (s *segment) ring(src int) ring {
	return ring{seg: s, base: offRings + src*ringBytes(s.slots, s.slotSize), slots: uint64(s.slots), slotSize: s.slotSize}
}

func (r ring) head() *uint64      { return r.seg.u64(r.base) }
func (r ring) tail() *uint64      { return r.seg.u64(r.base + 64) }
func (r ring) wantSpace() *uint32 { return r.seg.u32(r.base + 128) }

func (r ring) slot(i uint64) []byte {
	off := r.base + ringHdr + int(i%r.slots)*r.slotSize
	return r.seg.mem[off : off+r.slotSize : off+r.slotSize]
}

// ring the owner's doorbell after publishing, waking it if it sleeps.
func (s *segment) ringDoorbell() {
	atomic.AddUint32(s.u32(offDoorbell), 1)
	if atomic.LoadUint32(s.u32(offSleeping)) != 0 {
		futexWake(s.u32(offDoorbell))
	}
}

const (
	opFutexWait = 0
	opFutexWake = 1
)

// futexWaitOn sleeps while *addr == val, at most timeoutNS. The word is in a shared
// mapping: no FUTEX_PRIVATE_FLAG.
// It reports whether it slept until the timeout.
func futexWaitOn(addr *uint32, val uint32, timeoutNS int64) (timedOut bool) {
	ts := unix.NsecToTimespec(timeoutNS)
	_, _, e := syscall.Syscall6(syscall.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), opFutexWait, uintptr(val), uintptr(unsafe.Pointer(&ts)), 0, 0)
	return e == syscall.ETIMEDOUT
}

// futexPark is futexWaitOn as a raw system call, which the Go runtime does not see: the
// goroutine keeps its P while it sleeps, as it would while spinning, and the process does
// not go idle. It ends at timeoutNS, at a wake-up, or at a signal (EINTR), so the
// runtime's preemption requests (a garbage collection's, or the scheduler's after 10 ms on
// a P) are met at once.
func futexPark(addr *uint32, val uint32, timeoutNS int64) (timedOut bool) {
	ts := unix.NsecToTimespec(timeoutNS)
	_, _, e := syscall.RawSyscall6(syscall.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), opFutexWait, uintptr(val), uintptr(unsafe.Pointer(&ts)), 0, 0)
	return e == syscall.ETIMEDOUT
}

// openTransports counts this process's open transports.
var openTransports atomic.Int32

// rawParks reports whether this rank's goroutines sleep holding their Ps (futexPark):
// where ranks outnumber CPUs, when this process has this one rank (whose wake-ups all come
// from other processes; a rank of the same process would need a P to wake it) and two Ps
// or more. A sleep through the runtime (Syscall) lets the runtime take the P away and the
// process go idle, and each wake-up from idle sets the runtime's monitor thread (sysmon)
// polling every 20 us again; where ranks outnumber CPUs those polls take the CPUs from
// the ranks, many times a step. The cost of holding the P is that the process's other
// goroutines get it only when the scheduler preempts the sleeper (within 10 ms).
func (t *Transport) rawParks() bool {
	return t.oversubscribed && openTransports.Load() == 1 && runtime.GOMAXPROCS(0) >= 2
}

// park sleeps as futexPark where rawParks allows, else as futexWaitOn.
func (t *Transport) park(addr *uint32, val uint32, timeoutNS int64) (timedOut bool) {
	if t.rawParks() {
		return futexPark(addr, val, timeoutNS)
	}
	return futexWaitOn(addr, val, timeoutNS)
}

// rawNap bounds the progress loop's sleeps that hold a P, so that, even without
// asynchronous preemption, nothing waits longer for the P.
const rawNap = 10 * time.Millisecond

// The wakes never block: raw system calls, which the Go runtime need not track (see
// busypoll's osYield).
func futexWakeAll(addr *uint32) {
	syscall.RawSyscall6(syscall.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), opFutexWake, 1<<31-1, 0, 0, 0)
}

func futexWake(addr *uint32) {
	syscall.RawSyscall6(syscall.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), opFutexWake, 1, 0, 0, 0)
}

// segmentName is "moex-<job>-r<rank>-p<pid>": the pid lets a later start find segments of
// dead processes without opening them.
func segmentName(job string, rank int) string {
	return fmt.Sprintf("%s%s-r%d-p%d", segPrefix, job, rank, os.Getpid())
}

// CleanStale removes segments whose creating process is gone (a job that crashed before
// its segments were unlinked). It returns the names removed.
func CleanStale() ([]string, error) {
	ents, err := os.ReadDir(DevShm)
	if err != nil {
		return nil, err
	}
	var removed []string
	for _, e := range ents {
		n := e.Name()
		if pid := segmentPid(n); pid > 0 && processGone(pid) {
			if os.Remove(filepath.Join(DevShm, n)) == nil {
				removed = append(removed, n)
			}
		}
	}
	return removed, nil
}

// segmentPid is the pid in a segment's name, 0 for a name that is not a segment's.
func segmentPid(name string) int {
	i := strings.LastIndex(name, "-p")
	if !strings.HasPrefix(name, segPrefix) || i < 0 {
		return 0
	}
	pid, err := strconv.Atoi(name[i+2:])
	if err != nil || pid <= 0 {
		return 0
	}
	return pid
}

func processGone(pid int) bool { return errors.Is(unix.Kill(pid, 0), unix.ESRCH) }

// Segments lists the moex segments present in DevShm (for tests and moex doctor).
func Segments() []string {
	ents, _ := os.ReadDir(DevShm)
	var out []string
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), segPrefix) {
			out = append(out, e.Name())
		}
	}
	return out
}

// SegmentsOf lists the moex segments in DevShm that process pid made (for tests: those of
// this process, whatever other processes do meanwhile).
func SegmentsOf(pid int) []string {
	var out []string
	for _, n := range Segments() {
		if segmentPid(n) == pid {
			out = append(out, n)
		}
	}
	return out
}

// StaleSegments lists the moex segments in DevShm whose process is gone (what CleanStale
// removes): a process that exits leaves none.
func StaleSegments() []string {
	var out []string
	for _, n := range Segments() {
		if pid := segmentPid(n); pid > 0 && processGone(pid) {
			out = append(out, n)
		}
	}
	return out
}
