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

// TestDependencyDirection: cmd -> internal -> pkg/rnbd -> pkg/rtrs ->
// fabric -> pkg/ibverbs, and pkg/rnbd -> pkg/blockdev (the server's
// backends). The frontends a mapped device is offered through (NBD, the
// kernel's nbd attach, ublk) live in pkg/frontend, and only the client
// daemon joins them to RNBD. Nothing under pkg imports cmd or internal
// packages other than log, units, uring, rawio and tagpool (leaves that know nothing of
// the daemons); pkg/rtrs knows nothing of RNBD, NBD or ublk; pkg/rnbd
// knows nothing of the frontends; the backends and the frontends know
// nothing of RNBD or RTRS, nor of each other.
func TestDependencyDirection(t *testing.T) {
	forbidden := map[string][]string{
		module + "/pkg/":         {module + "/cmd/", module + "/test/"},
		module + "/pkg/rtrs":     {module + "/pkg/rnbd", module + "/pkg/blockdev"},
		module + "/pkg/rnbd":     {module + "/pkg/frontend"},
		module + "/pkg/blockdev": {module + "/pkg/rnbd", module + "/pkg/rtrs", module + "/pkg/frontend"},
		module + "/pkg/frontend": {module + "/pkg/rnbd", module + "/pkg/rtrs", module + "/pkg/blockdev"},
		module + "/internal/":    {module + "/cmd/"},
	}
	allowedInternal := map[string]bool{module + "/internal/log": true, module + "/internal/units": true,
		module + "/internal/uring": true, module + "/internal/rawio": true, module + "/internal/tagpool": true}
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
			if strings.HasPrefix(p.ImportPath, module+"/pkg/") && strings.HasPrefix(imp, module+"/internal/") && !allowedInternal[imp] {
				t.Errorf("%s imports %s", p.ImportPath, imp)
			}
			if strings.HasPrefix(p.ImportPath, module+"/pkg/rtrs/fabric") && imp == module+"/pkg/rtrs" {
				t.Errorf("%s imports pkg/rtrs: fabrics sit below the engine", p.ImportPath)
			}
		}
	}
}
