package bootstrap

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/transport/topo"
)

// TestBindKeepsProcs binds a child process to one CPU the way Init does, and a second
// child with sched_setaffinity alone, at the same time, and watches GOMAXPROCS in both
// for 5 s: the runtime brings it down to the mask in the second (about a second after),
// and must not where bindToCPU kept it.
func TestBindKeepsProcs(t *testing.T) {
	if mode := os.Getenv("MOEX_BIND_HELPER"); mode != "" {
		bindHelper(mode)
		return
	}
	if runtime.GOMAXPROCS(0) < 2 {
		t.Skip("GOMAXPROCS is 1 here: nothing for the runtime to bring down")
	}
	t.Parallel()
	run := func(mode string, res chan<- string) {
		cmd := exec.Command(os.Args[0], "-test.run=^TestBindKeepsProcs$", "-test.count=1")
		cmd.Env = append(os.Environ(), "MOEX_BIND_HELPER="+mode)
		out, err := cmd.CombinedOutput()
		for _, l := range strings.Split(string(out), "\n") {
			if r, ok := strings.CutPrefix(l, "result "); ok && err == nil {
				res <- r
				return
			}
		}
		res <- fmt.Sprintf("child failed (%v):\n%s", err, out)
	}
	raw, bound := make(chan string, 1), make(chan string, 1)
	go run("raw", raw)
	go run("bind", bound)
	ctl, got := <-raw, <-bound
	if !strings.HasPrefix(ctl, "procs=1 after=") {
		t.Skipf("the runtime did not bring GOMAXPROCS down to a one-CPU mask within 5 s (%s): nothing to guard against", ctl)
	}
	// The bound child reports GOMAXPROCS at the end and its default before binding (not
	// this process's, which -test.cpu may have set).
	var procs, mask, def int
	_, err := fmt.Sscanf(got, "procs=%d mask=%d default=%d", &procs, &mask, &def)
	require.NoError(t, err, "bound child: %s", got)
	require.Greater(t, def, 1, "bound child: %s", got)
	assert.Equal(t, 1, mask, "bound child's CPU mask")
	assert.Equal(t, def, procs, "bound child's GOMAXPROCS: the default it had before binding (without bindToCPU the runtime followed the mask: %s)", ctl)
}

// bindHelper is a child of TestBindKeepsProcs: "raw" binds every thread with
// sched_setaffinity, "bind" runs bindToCPU; both watch GOMAXPROCS for 5 s and report
// when it dropped to 1 (raw), or what it and the mask's size are at the end (bind).
func bindHelper(mode string) {
	// The testing package sets GOMAXPROCS (-test.cpu), which turns the runtime's updates
	// off: turn them back on, as in a program that never set it.
	runtime.SetDefaultGOMAXPROCS()
	def := runtime.GOMAXPROCS(0)
	if mode == "raw" {
		var set unix.CPUSet
		set.Set(0)
		ents, _ := os.ReadDir("/proc/self/task")
		for _, e := range ents {
			if tid, err := strconv.Atoi(e.Name()); err == nil {
				_ = unix.SchedSetaffinity(tid, &set)
			}
		}
	} else if _, err := bindToCPU(0); err != nil {
		fmt.Println("result bind failed:", err)
		return
	}
	start := time.Now()
	for time.Since(start) < 5*time.Second {
		if runtime.GOMAXPROCS(0) == 1 && mode == "raw" {
			fmt.Printf("result procs=1 after=%v\n", time.Since(start).Round(time.Millisecond))
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		fmt.Println("result getaffinity failed:", err)
		return
	}
	fmt.Printf("result procs=%d mask=%d default=%d\n", runtime.GOMAXPROCS(0), set.Count(), def)
}

// TestBindToNode binds a child process to the CPUs and memory of NUMA node 0 as
// MOEX_CPU_BIND=numa does: every thread's affinity is the node's CPUs, and the memory
// policy prefers the node.
func TestBindToNode(t *testing.T) {
	if os.Getenv("MOEX_NODE_HELPER") != "" {
		tp := topo.Discover(topo.Options{})
		n := tp.Node(0)
		if n == nil {
			fmt.Println("no node 0")
			os.Exit(3)
		}
		if err := bindToNode(0, n.CPUs); err != nil {
			fmt.Println("bind:", err)
			os.Exit(1)
		}
		var set unix.CPUSet
		if err := unix.SchedGetaffinity(0, &set); err != nil {
			fmt.Println(err)
			os.Exit(1)
		}
		var mode int32
		var mask [16]uint64
		if _, _, e := unix.Syscall6(unix.SYS_GET_MEMPOLICY, uintptr(unsafe.Pointer(&mode)), uintptr(unsafe.Pointer(&mask[0])), 1024, 0, 0, 0); e != 0 {
			fmt.Println("get_mempolicy:", e)
			os.Exit(1)
		}
		fmt.Printf("cpus=%d want=%d mode=%d node0=%v\n", set.Count(), len(n.CPUs), mode, mask[0]&1 == 1)
		os.Exit(0)
	}
	if topo.Discover(topo.Options{}).Node(0) == nil {
		t.Skip("this host reports no NUMA node 0 in sysfs")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestBindToNode$", "-test.count=1")
	cmd.Env = append(os.Environ(), "MOEX_NODE_HELPER=1")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	var cpus, want, mode int
	var node0 bool
	_, err = fmt.Sscanf(strings.TrimSpace(string(out)), "cpus=%d want=%d mode=%d node0=%t", &cpus, &want, &mode, &node0)
	require.NoError(t, err, "%s", out)
	assert.Equal(t, want, cpus, "every CPU of the node, and no other")
	assert.Equal(t, mpolPreferred, mode)
	assert.True(t, node0)
}
