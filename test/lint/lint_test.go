package lint

import (
	"encoding/json"
	"io"
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/rnbd/rnbd"

type pkg struct {
	ImportPath string
	Doc        string
	Name       string
	CgoFiles   []string
	Imports    []string
}

func packages(t *testing.T) []pkg {
	t.Helper()
	out, err := exec.Command("go", "list", "-json", module+"/...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	var ps []pkg
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p pkg
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	return ps
}

// TestPackageDocs: every package says what it is.
func TestPackageDocs(t *testing.T) {
	for _, p := range packages(t) {
		if strings.TrimSpace(p.Doc) == "" {
			t.Errorf("%s has no package documentation", p.ImportPath)
		}
	}
}

// TestCgoOnlyInIbverbs: only pkg/ibverbs may import "C".
func TestCgoOnlyInIbverbs(t *testing.T) {
	for _, p := range packages(t) {
		if len(p.CgoFiles) > 0 && p.ImportPath != module+"/pkg/ibverbs" {
			t.Errorf("%s uses cgo (%v); only pkg/ibverbs may", p.ImportPath, p.CgoFiles)
		}
	}
}

// TestDependencyDirection: the floors, each importing only those below
// it — cmd (the binaries) -> internal (the daemons, their control API,
// configuration and command line) -> pkg (the libraries: pkg/rnbd ->
// pkg/rtrs -> fabric -> pkg/ibverbs, pkg/mirror (a mapping over several
// RNBD devices) -> pkg/rnbd -> pkg/blockdev, the frontends, and the
// leaves pkg/log and pkg/tagpool; what only pkg/ uses
// is under pkg/internal or its one user's internal/). test/ and tools/
// sit beside them: no binary, daemon or library imports them (tests
// may: TestImports are not the package's). Within pkg: pkg/rtrs knows
// nothing of RNBD, NBD or ublk; pkg/rnbd knows nothing of the frontends
// or of mirrors, pkg/mirror nothing of the frontends;
// the backends and the frontends know nothing of RNBD or RTRS, nor of
// each other; the fabrics sit below the engine. No exceptions.
func TestDependencyDirection(t *testing.T) {
	above := []string{module + "/cmd/", module + "/test/", module + "/tools/"}
	forbidden := map[string][]string{
		module + "/pkg/":         append([]string{module + "/internal/"}, above...),
		module + "/internal/":    above,
		module + "/cmd/":         above[1:],
		module + "/pkg/rtrs":     {module + "/pkg/rnbd", module + "/pkg/mirror", module + "/pkg/blockdev", module + "/pkg/frontend"},
		module + "/pkg/rnbd":     {module + "/pkg/mirror", module + "/pkg/frontend"},
		module + "/pkg/mirror":   {module + "/pkg/frontend"},
		module + "/pkg/blockdev": {module + "/pkg/rnbd", module + "/pkg/rtrs", module + "/pkg/mirror", module + "/pkg/frontend"},
		module + "/pkg/frontend": {module + "/pkg/rnbd", module + "/pkg/rtrs", module + "/pkg/mirror", module + "/pkg/blockdev"},
	}
	for _, p := range packages(t) {
		for _, imp := range p.Imports {
			for prefix, bad := range forbidden {
				if !strings.HasPrefix(p.ImportPath, prefix) {
					continue
				}
				for _, b := range bad {
					if strings.HasPrefix(imp, b) {
						t.Errorf("%s imports %s", p.ImportPath, imp)
					}
				}
			}
			if strings.HasPrefix(p.ImportPath, module+"/pkg/rtrs/fabric") && imp == module+"/pkg/rtrs" {
				t.Errorf("%s imports pkg/rtrs: fabrics sit below the engine", p.ImportPath)
			}
		}
	}
}
