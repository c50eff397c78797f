package bench

import (
	"os"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/moex-ai/moex/coll"
)

// RunInfo is what a result needs to be read later: the command and the machine.
type RunInfo struct {
	Command   string `json:"command"`
	CPU       string `json:"cpu"`
	Cores     int    `json:"cores"`
	GoVersion string `json:"go"`
	Transport string `json:"transport"`
	Path      string `json:"path"` // rank 0's path to rank 1
	Poll      string `json:"poll"` // MOEX_POLL: adaptive, spin or block
	Commit    string `json:"commit"`
}

// NewRunInfo describes this run of command over c.
func NewRunInfo(c *coll.Comm, command string) *RunInfo {
	ri := &RunInfo{Command: command, CPU: CPUModel(), Cores: runtime.NumCPU(), GoVersion: runtime.Version(),
		Transport: c.Transport().Name(), Poll: os.Getenv("MOEX_POLL"), Commit: "unknown"}
	if ri.Poll == "" {
		ri.Poll = "adaptive"
	}
	if c.Size() > 1 {
		l := c.Links()[1%c.Size()]
		ri.Path = l.Path
	}
	ri.Commit = Commit()
	return ri
}

// Commit is the VCS revision this binary was built from (12 digits, "+dirty" when the
// tree had changes), or "unknown" (go run of a module without VCS data, for instance).
func Commit() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	var rev, dirty string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				dirty = "+dirty"
			}
		}
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if rev == "" {
		return "unknown"
	}
	return rev + dirty
}

// CPUModel is the CPU's model name from /proc/cpuinfo (the architecture where there is
// none).
func CPUModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return runtime.GOARCH
	}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return runtime.GOARCH
}
