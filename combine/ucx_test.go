//go:build ucx

package combine_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The MoE stages between processes over UCX (whatever lanes UCX_TLS gives it; CI runs
// tcp): every mode, wire type and activation type, checked as over shm and tcp.
func TestMoEProcessesUCX(t *testing.T) {
	exe := filepath.Join(t.TempDir(), "moex")
	out, err := exec.Command("go", "build", "-tags", "ucx", "-o", exe, "github.com/moex-ai/moex/cmd/moex").CombinedOutput()
	require.NoError(t, err, "building moex: %s", out)
	cmd := exec.Command(exe, "run", "-n", "4", "--", os.Args[0], "-test.run=^TestHelperMoERank$")
	cmd.Env = append(os.Environ(), "MOEX_COMBINE_HELPER=ucx", "MOEX_TRANSPORT=ucx")
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "moex run: %s", out)
	require.Equal(t, 4, strings.Count(string(out), " ok"), "ranks ok:\n%s", out)
}

// Serving through a SIGKILL over UCX (CI: UCX_TLS=tcp): the survivors shrink, recover
// and serve on, every token checked.
func TestServingSurvivesKillUCX(t *testing.T) {
	exe := filepath.Join(t.TempDir(), "moex")
	out, err := exec.Command("go", "build", "-tags", "ucx", "-o", exe, "github.com/moex-ai/moex/cmd/moex").CombinedOutput()
	require.NoError(t, err, "building moex: %s", out)
	serveKilled(t, exe, "ucx")
}
