package layers

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The limits on a source file (lines) and on a function (lines from func to its closing
// brace), tests excepted: past them a file wants splitting by concern, a function into
// steps.
const (
	maxFileLines = 900
	maxFuncLines = 150
)

// TestSizes: no non-test Go file of the module is over maxFileLines, and no function
// over maxFuncLines.
func TestSizes(t *testing.T) {
	root, err := filepath.Abs("../..")
	require.NoError(t, err)
	_, err = os.Stat(filepath.Join(root, "go.mod"))
	require.NoError(t, err, "the module's root")
	fset := token.NewFileSet()
	files := 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != root && (strings.HasPrefix(name, ".") || name == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		files++
		rel, _ := filepath.Rel(root, path)
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		lines := fset.File(f.Pos()).LineCount()
		assert.LessOrEqual(t, lines, maxFileLines, "%s: %d lines", rel, lines)
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Body == nil {
				continue
			}
			n := fset.Position(fn.End()).Line - fset.Position(fn.Pos()).Line + 1
			assert.LessOrEqual(t, n, maxFuncLines, "%s: func %s is %d lines", rel, fn.Name.Name, n)
		}
		return nil
	})
	require.NoError(t, err)
	require.Greater(t, files, 100, "the walk found the module's files")
}
