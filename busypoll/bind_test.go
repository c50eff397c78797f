package busypoll

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// A rank bound to one CPU after it started is seen as such (and its transports wait as
// where ranks outnumber CPUs: see Config.HoldP).
func TestBoundToOneCPU(t *testing.T) {
	var all unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &all))
	if all.Count() < 2 {
		t.Skipf("this process may use %d CPU; binding to one changes nothing", all.Count())
	}
	got := make(chan [2]bool, 1)
	go func() {
		// The thread is bound alone and never unlocked: it ends with the goroutine.
		runtime.LockOSThread()
		before := BoundToOneCPU()
		var one unix.CPUSet
		for c := 0; c < 1024; c++ {
			if all.IsSet(c) {
				one.Set(c)
				break
			}
		}
		if err := unix.SchedSetaffinity(0, &one); err != nil {
			got <- [2]bool{before, false}
			return
		}
		got <- [2]bool{before, BoundToOneCPU()}
	}()
	r := <-got
	require.False(t, r[0], "a thread that may use %d CPUs", all.Count())
	require.True(t, r[1], "a thread bound to one CPU")
}
