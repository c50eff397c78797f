package layers

import (
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// collFiles orders coll's files from the bottom up: a file uses only what is declared in
// files before it (or in itself). The errors and the vocabulary (the names of package
// algos, where the planners, the cost model and the registry live) come first, then the
// communicator's state (its types, so that the files of its behaviour sit above it), the
// control channel, the executor, and the operations; what makes and ends communicators
// comes last. A new file must be placed here.
var collFiles = []string{
	"errors.go", "names.go", "state.go", "choose.go", "comm.go", "exec.go", "profile.go", "trace.go", "run.go",
	"async.go", "ops.go", "alltoallv.go", "vops.go", "window.go", "exchangehost.go", "board.go", "group.go", "world.go", "shrink.go", "grow.go", "envvars.go",
}

// TestCollFilesPointDown: no file of coll uses a package-level name (a type, function,
// variable, constant or method) declared in a file above it, so that the package reads
// from the bottom up and a change to a file touches only the files above it.
func TestCollFilesPointDown(t *testing.T) {
	// The files of a plain build (go list applies the build constraints), and the
	// imports from their export data, which go list builds (the source importer
	// type-checks every dependency again: ten times as slow).
	out, err := exec.Command("go", "list", "-f", "{{.Dir}}\t{{join .GoFiles \"\\t\"}}", module+"coll").Output()
	require.NoError(t, err)
	listed := strings.Split(strings.TrimSpace(string(out)), "\t")
	fset := token.NewFileSet()
	var files []*ast.File
	for _, name := range listed[1:] {
		f, err := parser.ParseFile(fset, filepath.Join(listed[0], name), nil, parser.SkipObjectResolution)
		require.NoError(t, err)
		assert.Contains(t, collFiles, name, "coll/%s has no place in collFiles: put it there", name)
		files = append(files, f)
	}
	out, err = exec.Command("go", "list", "-export", "-deps", "-f", "{{.ImportPath}}\t{{.Export}}", module+"coll").Output()
	require.NoError(t, err)
	export := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if path, file, ok := strings.Cut(line, "\t"); ok {
			export[path] = file
		}
	}
	lookup := func(path string) (io.ReadCloser, error) { return os.Open(export[path]) }
	info := &types.Info{Uses: map[*ast.Ident]types.Object{}}
	conf := types.Config{Importer: importer.ForCompiler(fset, "gc", lookup)}
	pkg, err := conf.Check("github.com/moex-ai/moex/coll", fset, files, info)
	require.NoError(t, err)
	rank := func(pos token.Pos) int { return slices.Index(collFiles, filepath.Base(fset.Position(pos).Filename)) }
	arrows := map[string]bool{}
	for id, obj := range info.Uses {
		if obj.Pkg() != pkg || !obj.Pos().IsValid() {
			continue
		}
		fn, isFunc := obj.(*types.Func)
		method := isFunc && fn.Type().(*types.Signature).Recv() != nil
		if obj.Parent() != pkg.Scope() && !method {
			continue // locals, parameters, fields
		}
		from, to := rank(id.Pos()), rank(obj.Pos())
		if from >= 0 && to > from {
			arrows[filepath.Base(fset.Position(id.Pos()).Filename)+" -> "+obj.Name()+" ("+collFiles[to]+")"] = true
		}
	}
	var list []string
	for a := range arrows {
		list = append(list, a)
	}
	slices.Sort(list)
	assert.Empty(t, list, "uses of names declared in a file above the user")
}
