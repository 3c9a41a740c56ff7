package clientd

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rnbd/rnbd/internal/ctl"
)

// TestCheckAll: config check reports every problem at once: a wrong
// value and a metrics_listen address this host does not have.
func TestCheckAll(t *testing.T) {
	bad := ""
	for _, a := range []string{"203.0.113.77", "198.51.100.77"} {
		if l, err := net.Listen("tcp", a+":0"); err == nil {
			l.Close()
			continue
		}
		bad = a
		break
	}
	if bad == "" {
		t.Skip("this host has every address of the documentation networks")
	}
	file := filepath.Join(t.TempDir(), "client.toml")
	if err := os.WriteFile(file, []byte("conns_per_path = 0\nmetrics_listen = \""+bad+":9725\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, f := CheckAll(file, true)
	if len(f.Errors) != 2 || !strings.Contains(f.Errors[0].Error(), "conns_per_path must be at least 1") ||
		!strings.Contains(f.Errors[1].Error(), "config "+file+": metrics_listen "+bad+":9725: "+bad+" is not an address of this host") ||
		ctl.Classify(f.Errors[1]) != ctl.CodeInvalid {
		t.Errorf("errors %v", f.Errors)
	}
	if err := os.WriteFile(file, []byte("metrics_listen = \"127.0.0.1:9725\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, f := CheckAll(file, true); len(f.Errors)+len(f.Warnings) != 0 {
		t.Errorf("a good file: %+v", f)
	}
}
