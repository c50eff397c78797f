package layers

import (
	"os/exec"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const module = "github.com/moex-ai/moex/"

// level is each package's height: a package imports only packages of lower levels. A
// package not listed fails the test, so a new one must be placed.
var level = map[string]int{
	"internal/race": 0, "internal/long": 0, "internal/wire": 0, "internal/memx": 0, "internal/launch": 0, "internal/hosts": 0, "coll/dtype": 0,
	"busypoll": 0, "router": 0, "obuf": 0, "internal/layers": 0,
	"transport": 1, "coll/algos": 2, "transport/internal/core": 2,
	"transport/inproc": 3, "coll/exchange": 3, "coll/agree": 2, "coll/health": 1, "coll/shared": 3, "transport/topo": 3, "transport/topo/nvml": 4, "transport/ucx": 3, "transport/transporttest": 3,
	"transport/shm": 4, "transport/tcp": 4,
	"transport/bootstrap": 5, "transport/bootstrap/etcd": 6,
	"coll":     6,
	"dispatch": 8, "combine": 9, "models": 10,
	"bench": 11, "bench/peers/twocopy": 11,
	"bench/perfdoc": 12, "cmd/moex": 12,
}

// debt lists the imports that break DESIGN.md's rule that coll imports the transport
// contract (and the bootstrap, which opens the transports) and no concrete transport.
// None is left; the test fails when one comes back.
var debt = map[string][]string{
	"coll": nil,
}

// TestForbiddenImports: every package's moex imports are of lower levels, and coll
// imports no concrete transport: the contract and the bootstrap only.
func TestForbiddenImports(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", `{{.ImportPath}} {{join .Imports " "}}`, module+"...").Output()
	require.NoError(t, err)
	seen := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		pkg := strings.TrimPrefix(f[0], module)
		lv, ok := level[pkg]
		if !assert.True(t, ok, "package %s has no level: place it in layers_test.go", pkg) {
			continue
		}
		seen++
		var concrete []string
		for _, imp := range f[1:] {
			if !strings.HasPrefix(imp, module) {
				continue
			}
			dep := strings.TrimPrefix(imp, module)
			dl, ok := level[dep]
			assert.True(t, ok, "%s imports %s, which has no level", pkg, dep)
			assert.Less(t, dl, lv, "%s (level %d) imports %s (level %d): a lower package imports a higher one", pkg, lv, dep, dl)
			if pkg == "coll" && strings.HasPrefix(dep, "transport/") && dep != "transport/bootstrap" {
				concrete = append(concrete, dep)
			}
		}
		if strings.HasPrefix(pkg, "bench") || strings.HasPrefix(pkg, "cmd/") {
			for _, imp := range f[1:] {
				for _, tr := range []string{"inproc", "shm", "tcp", "ucx"} {
					assert.NotEqual(t, module+"transport/"+tr, imp, "%s names a concrete transport: ask for a capability (transport.Counting, transport.Killer) or the bootstrap instead", pkg)
				}
			}
		}
		if strings.HasPrefix(pkg, "internal/") {
			for _, imp := range f[1:] {
				assert.False(t, strings.HasPrefix(imp, module), "%s imports %s: the internal packages are leaves", pkg, imp)
			}
		}
		if pkg == "coll" {
			sort.Strings(concrete)
			assert.Equal(t, debt["coll"], concrete, "coll imports a concrete transport")
		}
	}
	assert.Greater(t, seen, 20, "go list found too few packages")
}

// TestNoCgoInTheLibrary: a program that imports moex's packages (all but the command
// and the benchmarks) does not compile go-nvml, whose cgo prints pages of warnings on a
// first build; only a build with -tags nvml does, and only for moex topo.
func TestNoCgoInTheLibrary(t *testing.T) {
	for _, tags := range []string{"", "nvml"} {
		out, err := exec.Command("go", "list", "-tags", tags, "-deps", module+"coll", module+"dispatch", module+"combine", module+"models", module+"router", module+"obuf").Output()
		require.NoError(t, err)
		for _, dep := range strings.Fields(string(out)) {
			assert.False(t, strings.HasPrefix(dep, "github.com/NVIDIA/"), "with tags %q the library compiles %s", tags, dep)
		}
	}
	out, err := exec.Command("go", "list", "-tags", "nvml", "-deps", module+"cmd/moex").Output()
	require.NoError(t, err)
	assert.Contains(t, strings.Fields(string(out)), "github.com/NVIDIA/go-nvml/pkg/nvml", "moex built with -tags nvml asks NVML")
}
