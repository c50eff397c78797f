//go:build linux

// Command twocopy measures the floor of an AlltoAll that moves its blocks through shared
// memory with two copies (the sender's into shared memory, the receiver's out of it), as
// moex's shared areas do for buffers up to MOEX_SHM_AREA: P processes, one memfd mapped
// by all, each rank with two halves that alternate between operations, a counter per
// rank raised after its copy-in, and waiters that poll the counters and yield the CPU
// between polls (sched_yield). Nothing else: no communicator, no deadlines, no liveness
// checks, no signatures, no parking, so that no implementation with two copies per byte
// and a yield per wait does less on this host. bench/peers/compare.sh prints it beside
// moex and Open MPI; it prints the JSON fields of `moex bench coll --json` that the
// script reads.
//
//	twocopy -ranks 4 -bytes 65536 [-iters N]
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Each rank's region: a header (its counter, its probe and timed results, one line each),
// then two halves of the send buffer's size.
const (
	hdr       = 256
	offCount  = 0   // u64: operations this rank has published
	offProbe  = 64  // u64: ns of this rank's probe operation
	offIters  = 72  // u64 (rank 0's): the timed operations
	offTime   = 128 // u64: ns of this rank's timed operations
	offWrong  = 192 // u64: wrong elements this rank received
	warmup    = 20
	rankEnv   = "TWOCOPY_RANK"
	failEnv   = "TWOCOPY_FAIL_RANK" // that rank exits at once with an error (tests)
	maxIters  = 1000
	probeSecs = 0.2
)

type result struct {
	Op     string  `json:"op"`
	Ranks  int     `json:"ranks"`
	Bytes  int     `json:"bytes"`
	Algo   string  `json:"algo"`
	TimeUS float64 `json:"time_us"`
	Wrong  int     `json:"wrong"`
	Iters  int     `json:"iters"`
}

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "twocopy:", err)
		os.Exit(1)
	}
}

func run(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("twocopy", flag.ContinueOnError)
	ranks := fs.Int("ranks", 4, "processes")
	bytes := fs.Int("bytes", 64<<10, "send buffer per rank (a multiple of 4 x ranks)")
	iters := fs.Int("iters", 0, "timed operations (0: 0.2 s worth, at most 1000, as moex bench coll and mpi_coll)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	p, n := *ranks, *bytes
	if p < 2 || p > 64 || n <= 0 || n%(4*p) != 0 {
		return fmt.Errorf("-ranks %d -bytes %d: want 2 to 64 ranks and bytes a positive multiple of 4 x ranks", p, n)
	}
	half := (n + 63) &^ 63 // each of a rank's two halves, whole cache lines
	region := hdr + 2*half
	if s := os.Getenv(rankEnv); s != "" {
		r, err := strconv.Atoi(s)
		if err != nil || r < 0 || r >= p {
			return fmt.Errorf("%s=%q: want a rank below %d", rankEnv, s, p)
		}
		if os.Getenv(failEnv) == s {
			return fmt.Errorf("rank %d: failing as %s says", r, failEnv)
		}
		return rank(r, p, n, region, *iters)
	}
	fd, err := unix.MemfdCreate("moex-twocopy", unix.MFD_CLOEXEC)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), "twocopy")
	defer f.Close()
	if err := f.Truncate(int64(p * region)); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	// Pdeathsig (below) follows the thread that starts a child: keep this one.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cmds := make([]*exec.Cmd, p)
	for r := range cmds {
		c := exec.Command(self, args...)
		c.Env = append(os.Environ(), rankEnv+"="+strconv.Itoa(r))
		c.ExtraFiles = []*os.File{f} // fd 3 in the child
		// A rank outlives nothing: if this process dies, the ranks, which would poll for
		// each other forever, die with it.
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		c.Stdout, c.Stderr = os.Stderr, os.Stderr
		if err := c.Start(); err != nil {
			for _, c := range cmds[:r] {
				c.Process.Kill()
				c.Wait()
			}
			return err
		}
		cmds[r] = c
	}
	// Wait for the ranks as they end: one that fails leaves the others polling for its
	// counter forever, so the first failure stops them all.
	type exit struct {
		rank int
		err  error
	}
	exits := make(chan exit, p)
	for r, c := range cmds {
		go func() { exits <- exit{r, c.Wait()} }()
	}
	var failed error
	for range cmds {
		if e := <-exits; e.err != nil && failed == nil {
			failed = fmt.Errorf("rank %d: %w", e.rank, e.err)
			for _, c := range cmds {
				c.Process.Kill()
			}
		}
	}
	if failed != nil {
		return failed
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, p*region, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return err
	}
	defer unix.Munmap(mem)
	res := result{Op: "alltoall", Ranks: p, Bytes: n, Algo: "twocopy"}
	var worst uint64
	for r := 0; r < p; r++ {
		worst = max(worst, *u64(mem, r*region+offTime))
		res.Wrong += int(*u64(mem, r*region+offWrong))
	}
	res.Iters = int(*u64(mem, offIters))
	res.TimeUS = float64(worst) / float64(res.Iters) / 1e3
	return json.NewEncoder(out).Encode(res)
}

func u64(mem []byte, off int) *uint64 { return (*uint64)(unsafe.Pointer(&mem[off])) }

// rank runs one rank: warm-up, a probe that sets the count as the other tools do, the
// timed operations, and a check of the last one's blocks.
func rank(r, p, n, region, iters int) error {
	halfBytes := (region - hdr) / 2
	mem, err := unix.Mmap(3, 0, p*region, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return err
	}
	defer unix.Munmap(mem)
	b := n / p
	send, recv := make([]byte, n), make([]byte, n)
	for i := 0; i < n; i += 4 {
		*(*uint32)(unsafe.Pointer(&send[i])) = uint32(r<<24 | i/4)
	}
	count := func(q int) *uint64 { return u64(mem, q*region+offCount) }
	half := func(q int, op uint64) []byte {
		o := q*region + hdr + int(op&1)*halfBytes
		return mem[o : o+n : o+n]
	}
	var op uint64
	// One operation: copy the others' blocks into this rank's half for op, publish, take
	// the own block, then each other rank's block as its counter shows it published.
	step := func() {
		op++
		h := half(r, op)
		for i := 1; i < p; i++ {
			q := (r + i) % p
			copy(h[q*b:(q+1)*b], send[q*b:(q+1)*b])
		}
		atomic.StoreUint64(count(r), op)
		copy(recv[r*b:(r+1)*b], send[r*b:(r+1)*b])
		var got uint64 = 1 << r
		for got != 1<<p-1 {
			for i := 1; i < p; i++ {
				q := (r + i) % p
				if got&(1<<q) == 0 && atomic.LoadUint64(count(q)) >= op {
					copy(recv[q*b:(q+1)*b], half(q, op)[r*b:(r+1)*b])
					got |= 1 << q
				}
			}
			if got != 1<<p-1 {
				syscall.RawSyscall(syscall.SYS_SCHED_YIELD, 0, 0, 0)
			}
		}
	}
	for i := 0; i < warmup; i++ {
		step()
	}
	t := time.Now()
	step()
	atomic.StoreUint64(u64(mem, r*region+offProbe), uint64(time.Since(t)))
	if iters <= 0 {
		// Everyone's probe is in once everyone has finished the next operation.
		step()
		var worst uint64
		for q := 0; q < p; q++ {
			worst = max(worst, atomic.LoadUint64(u64(mem, q*region+offProbe)))
		}
		iters = int(math.Min(maxIters, math.Max(5, probeSecs/max(float64(worst)/1e9, 1e-7))))
	}
	if r == 0 {
		atomic.StoreUint64(u64(mem, offIters), uint64(iters))
	}
	for i := 0; i < max(5, iters/10); i++ { // untimed, as moex bench coll and mpi_coll do
		step()
	}
	t = time.Now()
	for i := 0; i < iters; i++ {
		step()
	}
	atomic.StoreUint64(u64(mem, r*region+offTime), uint64(time.Since(t)))
	var wrong uint64
	for q := 0; q < p; q++ {
		for i := 0; i < b; i += 4 {
			if *(*uint32)(unsafe.Pointer(&recv[q*b+i])) != uint32(q<<24|(r*b+i)/4) {
				wrong++
			}
		}
	}
	atomic.StoreUint64(u64(mem, r*region+offWrong), wrong)
	return nil
}
