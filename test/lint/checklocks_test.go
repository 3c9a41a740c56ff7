package lint

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os/exec"
	"strings"
	"testing"
)

// TestChecklocksOneFieldALine: in a struct with +checklocks annotations,
// every field is declared on its own. The checklocks analyzer (make vet)
// pairs annotations with fields by position, and a declaration of two
// names ("posted, sent int") shifts every annotation after it onto the
// wrong field — it checked the wrong thing without a word.
func TestChecklocksOneFieldALine(t *testing.T) {
	out, err := exec.Command("git", "-C", "../..", "ls-files", "*.go").Output()
	if err != nil {
		t.Skipf("git ls-files: %v", err)
	}
	fset := token.NewFileSet()
	for _, name := range strings.Fields(string(out)) {
		path := "../../" + name
		f, err := parser.ParseFile(fset, path, nil, parser.ParseComments|parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			st, ok := n.(*ast.StructType)
			if !ok {
				return true
			}
			annotated := false
			for _, fl := range st.Fields.List {
				for _, cg := range []*ast.CommentGroup{fl.Doc, fl.Comment} {
					if cg != nil && strings.Contains(cg.Text(), "+checklocks") {
						annotated = true
					}
				}
			}
			if !annotated {
				return true
			}
			for _, fl := range st.Fields.List {
				if len(fl.Names) > 1 {
					t.Errorf("%s: %d fields in one declaration in a struct with +checklocks annotations: one a line",
						fset.Position(fl.Pos()), len(fl.Names))
				}
			}
			return true
		})
	}
}
