package bootstrap

import (
	"log/slog"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// ProcsShare gives each rank its share of the CPUs where tcp or ucx ranks share them with
// more Ps than that, and nothing otherwise.
func TestProcsShare(t *testing.T) {
	for _, tc := range []struct {
		transport          string
		procs, cpus, ranks int
		want               int
	}{
		{"tcp", 2, 2, 4, 1},   // more ranks than CPUs: at least one P
		{"tcp", 2, 2, 2, 1},   // a CPU each
		{"ucx", 8, 8, 2, 4},   // four each
		{"tcp", 16, 16, 3, 5}, // rounded down
		{"shm+tcp", 16, 16, 8, 0},
		{"shm+ucx", 16, 16, 8, 0},
		{"tcp", 1, 2, 4, 0}, // already at the share
		{"tcp", 4, 8, 2, 0}, // at the share
		{"tcp", 8, 8, 1, 0}, // one rank: the CPUs are its own
		{"shm", 2, 2, 8, 0}, // shm's waiters keep their Ps on purpose
		{"inproc", 2, 2, 4, 0},
	} {
		assert.Equal(t, tc.want, ProcsShare(tc.transport, tc.procs, tc.cpus, tc.ranks), "%+v", tc)
	}
}

// MOEX_GOMAXPROCS takes keep (or nothing) and auto; anything else is an ArgError naming it.
func TestProcsPolicy(t *testing.T) {
	for v, want := range map[string]bool{"": false, "keep": false, "auto": true} {
		t.Setenv("MOEX_GOMAXPROCS", v)
		auto, err := procsPolicy()
		require.NoError(t, err, "%q", v)
		assert.Equal(t, want, auto, "%q", v)
	}
	for _, v := range []string{"1", "Auto", "share", "on"} {
		t.Setenv("MOEX_GOMAXPROCS", v)
		_, err := procsPolicy()
		var ae *ArgError
		require.ErrorAs(t, err, &ae, "%q", v)
		assert.Equal(t, "MOEX_GOMAXPROCS", ae.Arg)
	}
}

// shareProcs sets the share where ProcsShare gives one, and leaves a GOMAXPROCS that the
// environment sets.
func TestShareProcs(t *testing.T) {
	if runtime.NumCPU() < 2 {
		t.Skipf("one CPU: every rank's share is the one P it has")
	}
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	log := slog.New(slog.DiscardHandler)
	ranks := runtime.NumCPU() * 2 // more ranks than CPUs: a share of 1

	runtime.GOMAXPROCS(runtime.NumCPU())
	t.Setenv("GOMAXPROCS", "")
	shareProcs(Env{}, "shm", ranks, log)
	assert.Equal(t, runtime.NumCPU(), runtime.GOMAXPROCS(0), "shm keeps its Ps")
	shareProcs(Env{}, "tcp", ranks, log)
	assert.Equal(t, 1, runtime.GOMAXPROCS(0), "tcp ranks sharing CPUs take their share")

	runtime.GOMAXPROCS(runtime.NumCPU())
	t.Setenv("GOMAXPROCS", "2")
	shareProcs(Env{}, "tcp", ranks, log)
	assert.Equal(t, runtime.NumCPU(), runtime.GOMAXPROCS(0), "a GOMAXPROCS in the environment wins")
}
