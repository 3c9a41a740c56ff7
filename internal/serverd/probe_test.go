package serverd

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/test/testfs"
)

// TestPathProbe: a path that answers gives its FileInfo or its error at
// once; one on a mount that does not answer gives ETIMEDOUT after the
// wait, and is not stat'ed again while that stat hangs (the next look
// answers at once); past maxProbesPending hanging paths, new ones are not
// looked at (ETIMEDOUT, saying so).
func TestPathProbe(t *testing.T) {
	mnt := testfs.HungMount(t)
	dir := t.TempDir()
	file := filepath.Join(dir, "f")
	if err := os.WriteFile(file, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	var pp pathProbe
	hung := filepath.Join(mnt, "disk.img")
	began := time.Now()
	got := pp.look([]string{file, filepath.Join(dir, "missing"), hung, file}, 200*time.Millisecond)
	if took := time.Since(began); took < 200*time.Millisecond || took > 5*time.Second {
		t.Fatalf("look took %v, want the wait", took)
	}
	if r := got[file]; r.err != nil || r.fi.Size() != 1 {
		t.Fatalf("a file: %+v", r)
	}
	if r := got[filepath.Join(dir, "missing")]; !errors.Is(r.err, fs.ErrNotExist) {
		t.Fatalf("a missing file: %v", r.err)
	}
	if r := got[hung]; !errors.Is(r.err, syscall.ETIMEDOUT) {
		t.Fatalf("a path that does not answer: %v", r.err)
	}
	began = time.Now()
	if _, err := pp.stat(hung); !errors.Is(err, syscall.ETIMEDOUT) || time.Since(began) > time.Second {
		t.Fatalf("the hanging path again: %v after %v, want ETIMEDOUT at once", err, time.Since(began))
	}
	var many []string
	for i := range maxProbesPending {
		many = append(many, filepath.Join(mnt, "d", string(rune('a'+i%26)), time.Duration(i).String()))
	}
	pp.look(many, 10*time.Millisecond)
	// Past the bound no new path is looked at, not even one that would
	// answer: each could hold another thread.
	for _, p := range []string{filepath.Join(mnt, "another"), filepath.Join(dir, "other")} {
		if _, err := pp.stat(p); !errors.Is(err, syscall.ETIMEDOUT) {
			t.Fatalf("a new path past the bound: %v", err)
		}
	}
	pp.mu.Lock()
	n := len(pp.pending)
	pp.mu.Unlock()
	if n > maxProbesPending {
		t.Fatalf("%d stats pending, bound %d", n, maxProbesPending)
	}
	// An OPEN's look: at once for the path known to hang; and past the
	// bound, no verdict (nil) for the others, whose OPENs go on.
	began = time.Now()
	if err := pp.answers(hung); !errors.Is(err, syscall.ETIMEDOUT) || time.Since(began) > time.Second {
		t.Fatalf("an OPEN's look at the hanging path: %v after %v, want ETIMEDOUT at once", err, time.Since(began))
	}
	if err := pp.answers(file); err != nil {
		t.Fatalf("an OPEN's look at a file past the bound: %v, want no verdict", err)
	}
}

// TestPathProbeMany: one look at many more paths than maxProbesPending
// that all answer (a thousand exports at start) looks at every one:
// those past the bound wait for a stat of the look to return, rather
// than being left not served.
func TestPathProbeMany(t *testing.T) {
	dir := t.TempDir()
	var paths []string
	for i := range 20 * maxProbesPending {
		p := filepath.Join(dir, time.Duration(i).String())
		if err := os.WriteFile(p, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
	}
	var pp pathProbe
	got := pp.look(paths, 30*time.Second)
	for _, p := range paths {
		if r := got[p]; r.err != nil || r.fi == nil {
			t.Fatalf("%s: %+v", p, r)
		}
	}
}
