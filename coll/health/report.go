package health

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
)

// ReportDirVar names the directory where a launcher (moex run) collects its ranks'
// reports.
const ReportDirVar = "MOEX_LAUNCH_REPORT"

// blameOnce makes a process report one root cause to its launcher: the first abort's.
var blameOnce sync.Once

// ReportBlame tells the launcher that this process, rank of the world, holds rank blame
// responsible for the abort of the given kind; a process reports once (its first
// abort), so that the launcher blames the root cause rather than the first survivor
// that exited because of it. Without a launcher's directory it does nothing.
func ReportBlame(rank, blame int, kind Kind) {
	dir := os.Getenv(ReportDirVar)
	if dir == "" {
		return
	}
	blameOnce.Do(func() {
		name := filepath.Join(dir, fmt.Sprintf("rank%d", rank))
		_ = os.WriteFile(name, []byte(fmt.Sprintf("blame %d %s\n", blame, kind)), 0o600)
	})
}

// The stages of joining that ReportJoin reports.
const (
	Joining = "join" // began joining the world
	Joined  = "up"   // joined it
)

// ReportJoin tells the launcher that this process, rank of the world, reached a stage
// of joining: a rank that exits before it joins while others wait for it is then named
// at once, not after the others' start-up deadline.
func ReportJoin(rank int, stage string) {
	dir := os.Getenv(ReportDirVar)
	if dir == "" {
		return
	}
	_ = os.WriteFile(filepath.Join(dir, fmt.Sprintf("rank%d.%s", rank, stage)), nil, 0o600)
}

// StopFile is the file of the reports directory in which a launcher that stops the job
// (a rank failed) writes why, before it signals the other ranks: the rank it blames and
// how that rank ended, as "RANK TEXT". Their operations that fail because they were
// stopped then say so (StopReason).
const StopFile = "stop"

// StopReason is what the launcher wrote in StopFile: the rank (of the world) it blames
// for stopping the job, and how that rank ended; -1 and "" when it is not stopping it,
// or there is no launcher.
func StopReason() (int, string) {
	dir := os.Getenv(ReportDirVar)
	if dir == "" {
		return -1, ""
	}
	b, err := os.ReadFile(filepath.Join(dir, StopFile))
	if err != nil {
		return -1, ""
	}
	if len(b) > MaxReason {
		b = b[:MaxReason]
	}
	rank, why, ok := strings.Cut(strings.TrimSpace(string(b)), " ")
	r, err := strconv.Atoi(rank)
	if !ok || err != nil || r < 0 {
		return -1, ""
	}
	return r, why
}
