package layers

import (
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// aliased lists the exported aliases of internal types that the public packages keep,
// and why: go doc shows an alias's comment but not its methods or fields.
var aliased = map[string]string{}

// TestPublicAPIDocumented reads the packages users import as go doc does: every exported
// type, function, method (Error, String, Unwrap and Is aside) and struct field has a doc
// comment (a field may share the
// comment of the field right above it, as a group), and no exported type is an alias of
// an internal package's (go doc would show none of its methods and fields) unless
// aliased says why.
func TestPublicAPIDocumented(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", `{{.ImportPath}} {{.Dir}} {{join .GoFiles " "}}`, module+"dispatch", module+"combine", module+"coll", module+"router", module+"obuf", module+"models", module+"busypoll", module+"transport", module+"coll/dtype").Output()
	require.NoError(t, err)
	checked := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		path, dir := f[0], f[1]
		name := path[strings.LastIndex(path, "/")+1:]
		fset := token.NewFileSet()
		var files []*ast.File
		for _, name := range f[2:] {
			file, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, parser.ParseComments)
			require.NoError(t, err)
			files = append(files, file)
		}
		p, err := doc.NewFromFiles(fset, files, path)
		require.NoError(t, err)
		assert.NotEmpty(t, p.Doc, "package %s has no doc", name)
		for _, f := range p.Funcs {
			assert.NotEmpty(t, f.Doc, "%s.%s has no doc", name, f.Name)
		}
		for _, ty := range p.Types {
			what := name + "." + ty.Name
			checked++
			assert.NotEmpty(t, ty.Doc, "%s has no doc", what)
			if ts := typeSpec(ty); ts != nil {
				if ts.Assign.IsValid() && isInternal(ts.Type) {
					_, ok := aliased[what]
					assert.True(t, ok, "%s is an alias of an internal type: go doc shows none of its methods or fields; define it here", what)
				}
				if st, ok := ts.Type.(*ast.StructType); ok {
					checkFields(t, fset, what, st.Fields.List)
				}
			}
			for _, f := range append(ty.Funcs, ty.Methods...) {
				if !conventional[f.Name] {
					assert.NotEmpty(t, f.Doc, "%s.%s has no doc", what, f.Name)
				}
			}
		}
	}
	assert.Greater(t, checked, 10, "too few types found")
}

// conventional are the methods whose contract is the standard library's interface
// (error, fmt.Stringer, errors.Is and Unwrap): no comment is asked of them.
var conventional = map[string]bool{"Error": true, "String": true, "Unwrap": true, "Is": true}

func typeSpec(ty *doc.Type) *ast.TypeSpec {
	for _, s := range ty.Decl.Specs {
		if ts, ok := s.(*ast.TypeSpec); ok && ts.Name.Name == ty.Name {
			return ts
		}
	}
	return nil
}

// isInternal says whether e names a type of another package (pkg.T or pkg.T[...]) whose
// import name is one of the project's internal packages'.
func isInternal(e ast.Expr) bool {
	if ix, ok := e.(*ast.IndexExpr); ok {
		e = ix.X
	}
	if ix, ok := e.(*ast.IndexListExpr); ok {
		e = ix.X
	}
	sel, ok := e.(*ast.SelectorExpr)
	if !ok {
		return false
	}
	id, ok := sel.X.(*ast.Ident)
	return ok && id.Name == "ep"
}

// checkFields asserts that every exported field has a comment, its own or that of the
// field right above it (a group under one comment).
func checkFields(t *testing.T, fset *token.FileSet, what string, fields []*ast.Field) {
	t.Helper()
	documented, prevEnd := false, -1
	for _, f := range fields {
		line := fset.Position(f.Pos()).Line
		own := f.Doc != nil || f.Comment != nil
		documented = own || documented && line == prevEnd+1
		prevEnd = fset.Position(f.End()).Line
		for _, n := range f.Names {
			if n.IsExported() {
				assert.True(t, documented, "%s.%s has no doc", what, n.Name)
			}
		}
	}
}
