// Tests of the directory pool on the real file systems of this machine
// (/tmp, and tmpfs in /dev/shm): files, extended attributes, statfs.
package pool

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/test/testfs"
)

func openTest(t *testing.T, dir string) *Dir {
	t.Helper()
	p, removed, err := OpenDir("p", dir, DirOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 0 {
		t.Fatalf("a new pool removed %v", removed)
	}
	p.now = func() time.Time { return time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC) }
	return p
}

func wantErrno(t *testing.T, what string, err error, errno syscall.Errno) {
	t.Helper()
	if !errors.Is(err, errno) {
		t.Fatalf("%s: %v, want %v", what, err, errno)
	}
}

// Made by name with its metadata on the file; a retry with the same
// parameters answers the volume made; other parameters are EEXIST saying
// what differs; the metadata is what a pool opened again reads.
func TestCreateIdempotent(t *testing.T) {
	dir := t.TempDir()
	p := openTest(t, dir)
	labels := map[string]string{"pvc": "data-0"}
	v, created, err := p.Create(Spec{Name: "vol-1", Size: 1 << 20, Labels: labels})
	if err != nil || !created {
		t.Fatalf("create: %v, created %v", err, created)
	}
	fi, err := os.Stat(filepath.Join(dir, "vol-1.img"))
	if err != nil || fi.Size() != 1<<20 || v.Path != filepath.Join(dir, "vol-1.img") {
		t.Fatalf("the volume's file: %v, %v; path %s", fi, err, v.Path)
	}
	again, created, err := p.Create(Spec{Name: "vol-1", Size: 1 << 20, Labels: map[string]string{"pvc": "data-0"}})
	if err != nil || created || again.Created != v.Created {
		t.Fatalf("the same create again: %+v, created %v, %v; want the volume made, not made again", again, created, err)
	}
	_, _, err = p.Create(Spec{Name: "vol-1", Size: 2 << 20, Labels: labels})
	wantErrno(t, "a create of another size", err, syscall.EEXIST)
	if !strings.Contains(err.Error(), "size 1048576 (asked 2097152)") {
		t.Fatalf("the refusal does not say what differs: %v", err)
	}
	p2 := openTest(t, dir)
	got, err := p2.Get("vol-1")
	if err != nil || got.Size != 1<<20 || got.Pool != "p" || got.Labels["pvc"] != "data-0" || !got.Created.Equal(v.Created) {
		t.Fatalf("read again: %+v, %v", got, err)
	}
}

// Bad names and sizes are refused with EINVAL, and nothing is made.
func TestCreateRefusesBadInput(t *testing.T) {
	dir := t.TempDir()
	p := openTest(t, dir)
	for _, name := range []string{"", "a/b", ".", "..", "...", "../x", "-x", "a b", strings.Repeat("x", 129), "é"} {
		_, _, err := p.Create(Spec{Name: name, Size: 4096})
		wantErrno(t, "name "+name, err, syscall.EINVAL)
	}
	for _, size := range []int64{0, -4096, 4097, 1000} {
		_, _, err := p.Create(Spec{Name: "s", Size: size})
		wantErrno(t, "a size", err, syscall.EINVAL)
	}
	_, _, err := p.Create(Spec{Name: "l", Size: 4096, Labels: map[string]string{"k": strings.Repeat("v", MaxLabelBytes)}})
	wantErrno(t, "labels over the bound", err, syscall.EINVAL)
	_, _, err = p.Create(Spec{Name: "l", Size: 4096, Labels: map[string]string{"": "v"}})
	wantErrno(t, "a label without a key", err, syscall.EINVAL)
	// At the bound, the metadata still fits ext4's one block of
	// attributes.
	if _, _, err := p.Create(Spec{Name: "l", Size: 4096, Labels: map[string]string{"k": strings.Repeat("v", MaxLabelBytes-1)}}); err != nil {
		t.Fatalf("labels at the bound: %v", err)
	}
	if err := p.Delete("l"); err != nil {
		t.Fatal(err)
	}
	es, _ := os.ReadDir(dir)
	for _, e := range es {
		if e.Name() != tmpDir {
			t.Fatalf("%s made by a refused create", e.Name())
		}
	}
}

// More than the pool can promise is ENOSPC, and nothing is made; what
// sparse volumes may still claim counts against what is allocatable.
func TestCreateOverCapacity(t *testing.T) {
	dir := t.TempDir()
	p := openTest(t, dir)
	c, err := p.Capacity()
	if err != nil || c.Allocatable <= 0 || c.Total < c.Allocatable {
		t.Fatalf("capacity %+v, %v", c, err)
	}
	over := (c.Allocatable/BlockSize + 1) * BlockSize
	_, _, err = p.Create(Spec{Name: "big", Size: over})
	wantErrno(t, "a volume over the allocatable space", err, syscall.ENOSPC)
	if _, err := os.Stat(filepath.Join(dir, "big.img")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a refused create left a file: %v", err)
	}
	half := (c.Allocatable / 2 / BlockSize) * BlockSize
	if _, _, err := p.Create(Spec{Name: "half", Size: half}); err != nil {
		t.Fatal(err)
	}
	c2, err := p.Capacity()
	if err != nil || c2.Promised < half-1<<20 {
		t.Fatalf("capacity after a sparse volume of %d: %+v, %v", half, c2, err)
	}
	_, _, err = p.Create(Spec{Name: "again", Size: half + 64<<20})
	wantErrno(t, "a second volume over what is left to promise", err, syscall.ENOSPC)
}

// A volume grows (its metadata with it); shrinking is refused; a crash
// between the metadata and the file is finished by the next resize.
func TestResize(t *testing.T) {
	p := openTest(t, t.TempDir())
	v, _, err := p.Create(Spec{Name: "g", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	g, err := p.Resize("g", 4<<20)
	if err != nil || g.Size != 4<<20 {
		t.Fatalf("grow: %+v, %v", g, err)
	}
	if fi, _ := os.Stat(v.Path); fi.Size() != 4<<20 {
		t.Fatalf("the file is %d bytes after the grow", fi.Size())
	}
	if got, _ := p.Get("g"); got.Size != 4<<20 {
		t.Fatalf("the metadata says %d after the grow", got.Size)
	}
	_, err = p.Resize("g", 1<<20)
	wantErrno(t, "a shrink", err, syscall.EINVAL)
	_, err = p.Resize("none", 1<<20)
	wantErrno(t, "the resize of no volume", err, syscall.ENOENT)
	// A crash after the metadata, before the file: the same size again
	// finishes it.
	if err := os.Truncate(v.Path, 2<<20); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Resize("g", 4<<20); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(v.Path); fi.Size() != 4<<20 {
		t.Fatalf("a half-done grow was left at %d bytes", fi.Size())
	}
}

// Deleting removes the volume; one that is gone is success; a file of the
// name that is not the pool's volume is not removed.
func TestDelete(t *testing.T) {
	dir := t.TempDir()
	p := openTest(t, dir)
	v, _, err := p.Create(Spec{Name: "d", Size: 4096})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Delete("d"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(v.Path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the volume's file after delete: %v", err)
	}
	if err := p.Delete("d"); err != nil {
		t.Fatalf("the delete of a volume gone: %v, want success", err)
	}
	foreign := filepath.Join(dir, "f.img")
	if err := os.WriteFile(foreign, []byte("not a volume"), 0o600); err != nil {
		t.Fatal(err)
	}
	wantErrno(t, "the delete of a file that is not a volume", p.Delete("f"), syscall.ENOENT)
	if _, err := os.Stat(foreign); err != nil {
		t.Fatalf("a file that is not a volume was removed: %v", err)
	}
	vs, err := p.List()
	if err != nil || len(vs) != 0 {
		t.Fatalf("list: %+v, %v; want no volume (f.img is not one)", vs, err)
	}
}

// What a crash left half-made is removed when the pool is opened, and a
// retry of the create then makes the volume.
func TestHalfMadeRemovedAtOpen(t *testing.T) {
	dir := t.TempDir()
	openTest(t, dir)
	half := filepath.Join(dir, tmpDir, "c.img")
	if err := os.WriteFile(half, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	p, removed, err := OpenDir("p", dir, DirOptions{})
	if err != nil || len(removed) != 1 || removed[0] != "c.img" {
		t.Fatalf("open: removed %v, %v", removed, err)
	}
	if _, err := os.Stat(half); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the half-made volume is still there: %v", err)
	}
	if _, created, err := p.Create(Spec{Name: "c", Size: 8192}); err != nil || !created {
		t.Fatalf("the retry: created %v, %v", created, err)
	}
	vs, err := p.List()
	if err != nil || len(vs) != 1 || vs[0].Name != "c" {
		t.Fatalf("list: %+v, %v", vs, err)
	}
}

// A clone is a reflink or nothing: on a file system without reflinks
// (ext4, tmpfs) it is refused with EOPNOTSUPP saying so, no full copy is
// made, and nothing is left behind.
func TestCloneNeedsReflinks(t *testing.T) {
	for _, base := range []string{os.TempDir(), "/dev/shm"} {
		dir, err := os.MkdirTemp(base, "pool-")
		if err != nil {
			t.Skip(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		p := openTest(t, dir)
		src, _, err := p.Create(Spec{Name: "src", Size: 1 << 20})
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(src.Path, []byte("data"), 0o600); err != nil {
			t.Fatal(err)
		}
		_, _, err = p.Create(Spec{Name: "copy", Size: 1 << 20, From: "src"})
		if err == nil {
			// A file system with reflinks: the clone has the data.
			b, _ := os.ReadFile(filepath.Join(dir, "copy.img"))
			if string(b[:4]) != "data" {
				t.Fatalf("%s: the clone does not have the source's data", base)
			}
			continue
		}
		wantErrno(t, base+": a clone", err, syscall.EOPNOTSUPP)
		if !strings.Contains(err.Error(), "reflinks") {
			t.Fatalf("%s: the refusal does not say why: %v", base, err)
		}
		if _, err := os.Stat(filepath.Join(dir, "copy.img")); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s: a refused clone left its file", base)
		}
		if es, _ := os.ReadDir(filepath.Join(dir, tmpDir)); len(es) != 0 {
			t.Fatalf("%s: a refused clone left %v half-made", base, es)
		}
		_, _, err = p.Create(Spec{Name: "copy", Size: 1 << 20, From: "none"})
		wantErrno(t, "a clone of no volume", err, syscall.ENOENT)
	}
}

// The metadata moves with the file: a volume whose file was renamed by
// hand into another volume's name is not taken for that volume.
func TestMetadataNamesItsVolume(t *testing.T) {
	p := openTest(t, t.TempDir())
	a, _, err := p.Create(Spec{Name: "a", Size: 4096})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(a.Path, p.path("b")); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Get("b"); err == nil || !strings.Contains(err.Error(), `metadata of volume "a"`) {
		t.Fatalf("b carrying a's metadata: %v", err)
	}
	buf := make([]byte, 4096)
	if _, err := unix.Getxattr(p.path("b"), xattr, buf); err != nil {
		t.Fatalf("the metadata did not move with the file: %v", err)
	}
}

// On a file system with reflinks (XFS on a loop device), a snapshot is
// the volume's data at that moment: writes to the volume after it do
// not reach it, a clone of it has it, a clone of the volume has the
// volume's data now. Taking one again of the same volume answers it; of
// another volume is EEXIST; deleting it twice succeeds.
func TestSnapshotsOnReflinks(t *testing.T) {
	p := openTest(t, testfs.ReflinkDir(t))
	v, _, err := p.Create(Spec{Name: "v", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	writeDev(t, v.Path, 4096, []byte("before"))
	s, created, err := p.CreateSnapshot("v", "s1", nil)
	if err != nil || !created || s.Volume != "v" || s.Size != 1<<20 {
		t.Fatalf("snapshot: %+v %v %v", s, created, err)
	}
	if again, created, err := p.CreateSnapshot("v", "s1", nil); err != nil || created || again.Name != "s1" {
		t.Fatalf("the same snapshot again: %+v %v %v", again, created, err)
	}
	if _, _, err := p.Create(Spec{Name: "w", Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	_, _, err = p.CreateSnapshot("w", "s1", nil)
	wantErrno(t, "s1 of another volume", err, syscall.EEXIST)
	writeDev(t, v.Path, 4096, []byte("after!"))

	c, _, err := p.Create(Spec{Name: "c", Size: 2 << 20, FromSnapshot: "s1"})
	if err != nil {
		t.Fatal(err)
	}
	if got := string(readDev(t, c.Path, 4096, 6)); got != "before" || c.SourceSnapshot != "s1" || c.Size != 2<<20 {
		t.Fatalf("clone of s1: %q, %+v", got, c)
	}
	if fi, _ := os.Stat(c.Path); fi.Size() != 2<<20 {
		t.Fatalf("clone of s1 is %d bytes, want %d", fi.Size(), 2<<20)
	}
	d, _, err := p.Create(Spec{Name: "d", Size: 1 << 20, From: "v"})
	if err != nil {
		t.Fatal(err)
	}
	if got := string(readDev(t, d.Path, 4096, 6)); got != "after!" {
		t.Fatalf("clone of v: %q", got)
	}
	_, _, err = p.Create(Spec{Name: "e", Size: 4096, FromSnapshot: "s1"})
	wantErrno(t, "a clone smaller than its snapshot", err, syscall.EINVAL)
	_, _, err = p.Create(Spec{Name: "e", Size: 1 << 20, FromSnapshot: "nope"})
	wantErrno(t, "a clone of no snapshot", err, syscall.ENOENT)
	_, _, err = p.Create(Spec{Name: "c", Size: 2 << 20, FromSnapshot: "s2"}) // (s2 need not exist: c does)
	wantErrno(t, "c again from another snapshot", err, syscall.EEXIST)

	ss, err := p.Snapshots()
	if err != nil || len(ss) != 1 || ss[0].Name != "s1" || ss[0].Volume != "v" {
		t.Fatalf("snapshots: %+v %v", ss, err)
	}
	// The volume goes; its snapshot stays, and still clones.
	if err := p.Delete("v"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := p.Create(Spec{Name: "f", Size: 1 << 20, FromSnapshot: "s1"}); err != nil {
		t.Fatalf("a clone of a snapshot whose volume is gone: %v", err)
	}
	for range 2 {
		if err := p.DeleteSnapshot("s1"); err != nil {
			t.Fatal(err)
		}
	}
	if ss, _ := p.Snapshots(); len(ss) != 0 {
		t.Fatalf("snapshots after delete: %+v", ss)
	}
	var names []string
	vs, _ := p.List()
	for _, v := range vs {
		names = append(names, v.Name)
	}
	if strings.Join(names, " ") != "c d f w" {
		t.Fatalf("volumes %v, want c d f w (the snapshot is none)", names)
	}
}

// A snapshot is a reflink or nothing: on ext4 it is refused with
// EOPNOTSUPP saying why, and nothing is left.
func TestSnapshotNeedsReflinks(t *testing.T) {
	p := openTest(t, t.TempDir())
	if _, _, err := p.Create(Spec{Name: "v", Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	_, _, err := p.CreateSnapshot("v", "s", nil)
	if err == nil {
		t.Fatalf("%s has reflinks: the test wants one without (ext4)", os.TempDir())
	}
	wantErrno(t, "a snapshot without reflinks", err, syscall.EOPNOTSUPP)
	if !strings.Contains(err.Error(), "reflinks") {
		t.Fatalf("the refusal does not say why: %v", err)
	}
	if ss, err := p.Snapshots(); err != nil || len(ss) != 0 {
		t.Fatalf("a refused snapshot left %+v (%v)", ss, err)
	}
	_, _, err = p.CreateSnapshot("nope", "s", nil)
	wantErrno(t, "a snapshot of no volume", err, syscall.ENOENT)
}

// A pool whose file system is not mounted makes nothing: with
// mountpoint, a directory that is not a mount point is refused at open;
// and a pool whose file system was unmounted since it was opened refuses
// every change (ENOTCONN), never writing to the directory under it.
func TestPoolNotMounted(t *testing.T) {
	dir := t.TempDir()
	_, _, err := OpenDir("p", dir, DirOptions{Mountpoint: true})
	wantErrno(t, "a directory that is not a mount point", err, syscall.ENOTCONN)
	if !strings.Contains(err.Error(), "not a mount point") {
		t.Fatalf("the refusal does not say why: %v", err)
	}
	mnt := testfs.ReflinkDir(t)
	p, _, err := OpenDir("p", filepath.Dir(mnt), DirOptions{Mountpoint: true})
	if err != nil {
		t.Fatalf("a mount point: %v", err)
	}
	if _, _, err := p.Create(Spec{Name: "v", Size: 4096}); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("umount", "-l", filepath.Dir(mnt)).CombinedOutput(); err != nil {
		t.Fatalf("umount: %v %s", err, out)
	}
	_, _, err = p.Create(Spec{Name: "w", Size: 4096})
	wantErrno(t, "a create on an unmounted pool", err, syscall.ENOTCONN)
	wantErrno(t, "a delete on an unmounted pool", p.Delete("v"), syscall.ENOTCONN)
	if es, _ := os.ReadDir(filepath.Dir(mnt)); len(es) != 0 {
		t.Fatalf("the pool wrote %v under its unmounted file system", es)
	}
}
