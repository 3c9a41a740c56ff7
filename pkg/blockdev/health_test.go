// Tests of Health: a file renamed, replaced, shrunk or deleted.

package blockdev

import (
	"os"
	"strings"
	"testing"
)

// Health finds a file renamed away with another put in its place, a
// shrink, and a deletion; a healthy file has nothing to report.
func TestHealth(t *testing.T) {
	dir := t.TempDir()
	p := sparseFile(t, dir, 1<<20)
	b, err := Open(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.Health(); err != nil {
		t.Fatalf("healthy: %v", err)
	}
	if err := os.Rename(p, p+".old"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, make([]byte, 1<<20), 0o600); err != nil { // the same name again
		t.Fatal(err)
	}
	if err := b.Health(); err == nil || !strings.Contains(err.Error(), "replaced") {
		t.Fatalf("replaced: %v", err)
	}
	os.Remove(p)
	os.Rename(p+".old", p)
	if err := os.Truncate(p, 4096); err != nil {
		t.Fatal(err)
	}
	if err := b.Health(); err == nil || !strings.Contains(err.Error(), "shrank") {
		t.Fatalf("shrunk: %v", err)
	}
	os.Remove(p)
	if err := b.Health(); err == nil || !strings.Contains(err.Error(), "deleted") {
		t.Fatalf("deleted: %v", err)
	}
}
