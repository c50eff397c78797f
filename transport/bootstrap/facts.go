package bootstrap

import (
	"strings"

	"golang.org/x/sys/unix"

	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/ucx"
)

// Facts are what the bootstrap knows of this host's transports: what moex doctor reports
// without naming a transport of its own.
type Facts struct {
	// ShmDir is where the shared-memory segments live; StaleSegments counts those left
	// by processes that died (a job removes them when it starts).
	ShmDir        string
	StaleSegments int
	// SharedMin is the size from which send buffers of obuf.Shared are read in place by
	// the other ranks over shared memory.
	SharedMin int
	// UCX says whether this binary was built with UCX (-tags ucx), and its version.
	UCX        bool
	UCXVersion string
}

// HostFacts collects the Facts of this host.
func HostFacts() Facts {
	f := Facts{ShmDir: shm.DevShm, SharedMin: shm.SharedMin, UCX: ucx.Built(), UCXVersion: ucx.Version()}
	for _, s := range shm.Segments() {
		var pid int
		if i := strings.LastIndex(s, "-p"); i >= 0 {
			pid = atoiPrefix(s[i+2:])
		}
		if pid > 0 && unix.Kill(pid, 0) == unix.ESRCH {
			f.StaleSegments++
		}
	}
	return f
}

// atoiPrefix reads the decimal number at the start of s (0 if none).
func atoiPrefix(s string) int {
	n := 0
	for _, c := range s {
		if c < '0' || c > '9' {
			break
		}
		n = n*10 + int(c-'0')
	}
	return n
}
