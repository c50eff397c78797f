package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// built is the moex command, built once for the tests that run it as a user would.
var built struct {
	sync.Once
	dir, path string
	out       []byte
	err       error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if built.dir != "" {
		os.RemoveAll(built.dir)
	}
	os.Exit(code)
}

// moexBinary builds the moex command once (go build) and returns its path.
func moexBinary(t *testing.T) string {
	t.Helper()
	built.Do(func() {
		if built.dir, built.err = os.MkdirTemp("", "moex-cmd-test"); built.err != nil {
			return
		}
		built.path = filepath.Join(built.dir, "moex")
		built.out, built.err = exec.Command("go", "build", "-o", built.path, ".").CombinedOutput()
	})
	require.NoError(t, built.err, "build: %s", built.out)
	return built.path
}
