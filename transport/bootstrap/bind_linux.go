package bootstrap

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

// bindToCPU pins every thread of this process (and, by inheritance, those it starts
// later) to the k-th CPU it may run on, as MPI launchers do with --bind-to core: two busy
// ranks then never share a core while another idles. It returns the CPU.
//
// GOMAXPROCS stays what it was. The runtime would bring it down to the one CPU of the
// mask (it looks about once a second); with one P, the transport's own goroutines (the
// progress loop, the abort watchers, timers) run only when the rank's waiting goroutine
// gives the P up, and that rank polls other processes' memory without giving it up.
// With the Ps kept, their threads share the CPU through the kernel, and they sleep but
// when there is work. Measured with moex bench coll --op alltoall --ranks 2 --transport
// shm, 64 KiB, runs of 10^6 operations (4-9 s, so that the runtime's update comes early
// in them): 3.7-3.8 us with the Ps kept, 6.8-9.0 with the update to one P.
func bindToCPU(k int) (int, error) {
	var allowed unix.CPUSet
	if err := unix.SchedGetaffinity(0, &allowed); err != nil {
		return -1, err
	}
	var cpus []int
	for c := 0; c < 1024 && len(cpus) < allowed.Count(); c++ {
		if allowed.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	if len(cpus) == 0 {
		return -1, fmt.Errorf("no CPU in the affinity mask")
	}
	cpu := cpus[k%len(cpus)]
	var set unix.CPUSet
	set.Set(cpu)
	if err := bindThreads(&set); err != nil {
		return -1, err
	}
	return cpu, nil
}

// bindThreads sets every thread's affinity to set, keeping GOMAXPROCS (see bindToCPU).
func bindThreads(set *unix.CPUSet) error {
	procs := runtime.GOMAXPROCS(0)
	ents, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return err
	}
	for _, e := range ents {
		tid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if err := unix.SchedSetaffinity(tid, set); err != nil {
			return fmt.Errorf("binding thread %d: %w", tid, err)
		}
	}
	runtime.GOMAXPROCS(procs) // the same value: no change now, and no update later
	return nil
}

// mpolPreferred is set_mempolicy's MPOL_PREFERRED: allocate on the node, fall back to
// others when it is full.
const mpolPreferred = 1

// bindToNode pins every thread of this process to cpus (the CPUs of a NUMA node, those
// of them it may run on) and makes the node the preferred place for its memory
// (set_mempolicy MPOL_PREFERRED; existing pages stay where they are).
func bindToNode(node int, cpus []int) error {
	var allowed, set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &allowed); err != nil {
		return err
	}
	for _, c := range cpus {
		if allowed.IsSet(c) {
			set.Set(c)
		}
	}
	if set.Count() == 0 {
		return fmt.Errorf("no CPU of NUMA node %d in this process's affinity mask", node)
	}
	if err := bindThreads(&set); err != nil {
		return err
	}
	if node < 0 || node >= 1024 {
		return nil
	}
	var mask [1024 / 64]uint64
	mask[node/64] |= 1 << (node % 64)
	if _, _, e := unix.Syscall(unix.SYS_SET_MEMPOLICY, mpolPreferred, uintptr(unsafe.Pointer(&mask[0])), 1024); e != 0 {
		return fmt.Errorf("set_mempolicy(MPOL_PREFERRED, node %d): %w", node, e)
	}
	return nil
}
