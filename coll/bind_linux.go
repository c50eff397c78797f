package coll

import (
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// bindToCPU pins every thread of this process (and, by inheritance, those it starts
// later) to the k-th CPU it may run on, as MPI launchers do with --bind-to core: two busy
// ranks then never share a core while another idles. It returns the CPU.
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
	ents, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return -1, err
	}
	for _, e := range ents {
		tid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if err := unix.SchedSetaffinity(tid, &set); err != nil {
			return -1, fmt.Errorf("binding thread %d to CPU %d: %w", tid, cpu, err)
		}
	}
	return cpu, nil
}
