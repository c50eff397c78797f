package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var moexName = regexp.MustCompile(`^MOEX_[A-Z0-9_]*[A-Z0-9]`)

// readNames returns every MOEX_ name that a string literal of the module's non-test code
// starts with ("MOEX_TIMEOUT", "MOEX_BENCH_WORKER=1"), with one place it occurs.
func readNames(t *testing.T) map[string]string {
	t.Helper()
	root, err := filepath.Abs("../..")
	require.NoError(t, err)
	names := map[string]string{}
	fset := token.NewFileSet()
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		if path == filepath.Join(root, "cmd", "moex", "envvars.go") {
			return nil // the registry itself
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			lit, ok := n.(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				return true
			}
			s, err := strconv.Unquote(lit.Value)
			if err != nil {
				return true
			}
			if m := moexName.FindString(s); m != "" {
				if _, seen := names[m]; !seen {
					rel, _ := filepath.Rel(root, path)
					names[m] = rel + ":" + strconv.Itoa(fset.Position(lit.Pos()).Line)
				}
			}
			return true
		})
		return nil
	})
	require.NoError(t, err)
	require.NotEmpty(t, names, "no MOEX_ names found under %s", root)
	return names
}

// TestEveryVariableIsRegistered fails when the code reads or sets a MOEX_ variable that
// the registry lacks, and when the registry keeps one that no code mentions.
func TestEveryVariableIsRegistered(t *testing.T) {
	names := readNames(t)
	for name, where := range names {
		_, ok := lookupVar(name)
		assert.True(t, ok, "%s (at %s) is not in envVars", name, where)
	}
	seen := map[string]bool{}
	for _, v := range envVars {
		assert.False(t, seen[v.Name], "%s is registered twice", v.Name)
		seen[v.Name] = true
		_, ok := names[v.Name]
		assert.True(t, ok, "%s is registered but no code reads it", v.Name)
		assert.NotEmpty(t, v.Default, v.Name)
		assert.NotEmpty(t, v.Meaning, v.Name)
		assert.NotEmpty(t, v.Owner, v.Name)
	}
}

// TestDefaultsFromTheCode checks the defaults that come from constants against the values
// the code applies.
func TestDefaultsFromTheCode(t *testing.T) {
	want := map[string]string{"MOEX_SPIN_US": "1000", "MOEX_YIELD_US": "200", "MOEX_TIMEOUT": "5m0s", "MOEX_SHM_AREA": "1024", "MOEX_NET_GBITS": "the NIC's speed from sysfs, else 24"}
	for name, def := range want {
		v, ok := lookupVar(name)
		require.True(t, ok, name)
		assert.Equal(t, def, v.Default, name)
	}
}
