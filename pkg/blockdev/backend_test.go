package blockdev

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
	"github.com/rnbd/rnbd/test/testfs"
)

// sparseFile makes an empty sparse file of size bytes in dir.
func sparseFile(t *testing.T, dir string, size int64) string {
	t.Helper()
	f, err := os.CreateTemp(dir, "backend-*.img")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(f.Name()) })
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	return f.Name()
}

func open(t *testing.T, path string, opts Options) *Backend {
	t.Helper()
	b, err := Open(path, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// Both filesystems: ext4 (/tmp, zero range supported) and tmpfs (/dev/shm,
// punch hole only: write zeroes without unmap is emulated).
var dirs = []string{os.TempDir(), "/dev/shm"}

func TestFileBackend(t *testing.T) {
	for _, dir := range dirs {
		t.Run(strings.ReplaceAll(dir, "/", "_"), func(t *testing.T) {
			path := sparseFile(t, dir, 8<<20)
			b := open(t, path, Options{})
			if b.Kind() != KindFile || b.Size() != 8<<20 || b.LogicalBlockSize() != 512 || b.PhysicalBlockSize() != 4096 {
				t.Fatalf("%v size %d lbs %d pbs %d", b.Kind(), b.Size(), b.LogicalBlockSize(), b.PhysicalBlockSize())
			}
			c := b.Caps()
			if !c.Discard || !c.FUA || !c.WriteCache || c.SecureErase {
				t.Fatalf("caps %+v", c)
			}
			data := bytes.Repeat([]byte("0123456789abcdef"), 8192) // 128 KiB
			if err := b.WriteAt(data, 1<<20, false); err != nil {
				t.Fatal(err)
			}
			if err := b.WriteAt(data, 3<<20, true); err != nil {
				t.Fatal(err)
			}
			if err := b.Flush(); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, len(data))
			if err := b.ReadAt(got, 1<<20); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("read back: %v", err)
			}
			// Discard punches a hole that reads as zeros.
			if err := b.Discard(1<<20, 64<<10); err != nil {
				t.Fatal(err)
			}
			if !testfs.IsHole(t, path, 1<<20) {
				t.Fatal("discard left data allocated")
			}
			b.ReadAt(got[:64<<10], 1<<20)
			if !bytes.Equal(got[:64<<10], make([]byte, 64<<10)) {
				t.Fatal("discarded range does not read as zeros")
			}
			// Write zeroes with NOUNMAP keeps the space allocated (on ext4
			// as unwritten extents, which SEEK_HOLE reports as holes: count
			// the blocks instead).
			before := testfs.Allocated(t, path)
			if err := b.WriteZeroes(3<<20, 64<<10, true); err != nil {
				t.Fatal(err)
			}
			if after := testfs.Allocated(t, path); after < before-8<<10 {
				t.Fatalf("write zeroes with NOUNMAP deallocated: %d -> %d bytes", before, after)
			}
			b.ReadAt(got[:64<<10], 3<<20)
			if !bytes.Equal(got[:64<<10], make([]byte, 64<<10)) {
				t.Fatal("zeroed range does not read as zeros")
			}
			// Without NOUNMAP it may deallocate, and here does.
			before = testfs.Allocated(t, path)
			if err := b.WriteZeroes(3<<20+64<<10, 64<<10, false); err != nil {
				t.Fatal(err)
			}
			if after := testfs.Allocated(t, path); after > before-48<<10 { // ext4 counts extent metadata blocks too
				t.Fatalf("write zeroes that may unmap: %d -> %d bytes allocated", before, after)
			}
			// The untouched rest of the data survived.
			b.ReadAt(got[:64<<10], 1<<20+64<<10)
			if !bytes.Equal(got[:64<<10], data[64<<10:]) {
				t.Fatal("data next to the discarded range changed")
			}
			if err := b.SecureErase(0, 4096); !errors.Is(err, syscall.EOPNOTSUPP) {
				t.Fatalf("secure erase of a file: %v", err)
			}
		})
	}
}

// TestPastTheEnd: IO beyond the end fails whole; nothing is written, the
// file does not grow.
func TestPastTheEnd(t *testing.T) {
	path := sparseFile(t, os.TempDir(), 1<<20)
	b := open(t, path, Options{})
	buf := make([]byte, 8192)
	for _, c := range []struct {
		name string
		err  error
		want syscall.Errno
	}{
		{"read straddling the end", b.ReadAt(buf, 1<<20-4096), syscall.EINVAL},
		{"read past the end", b.ReadAt(buf, 2<<20), syscall.EINVAL},
		{"write straddling the end", b.WriteAt(buf, 1<<20-4096, false), syscall.ENOSPC},
		{"write past the end", b.WriteAt(buf, 1<<20, true), syscall.ENOSPC},
		{"negative offset", b.WriteAt(buf, -512, false), syscall.ENOSPC},
		{"discard past the end", b.Discard(1<<20-512, 1024), syscall.ENOSPC},
		{"zeroes past the end", b.WriteZeroes(1<<20, 512, true), syscall.ENOSPC},
	} {
		if !errors.Is(c.err, c.want) || !errors.Is(c.err, ErrOutOfRange) {
			t.Errorf("%s: %v, want %v", c.name, c.err, c.want)
		}
	}
	st, _ := os.Stat(path)
	if st.Size() != 1<<20 {
		t.Fatalf("file grew to %d", st.Size())
	}
	if !testfs.IsHole(t, path, 1<<20-4096) {
		t.Fatal("a refused write wrote the part that fitted")
	}
}

// Refresh serves the file's new size, grown or shrunk, in whole logical
// blocks; IO follows it.
func TestRefresh(t *testing.T) {
	path := sparseFile(t, os.TempDir(), 1<<20)
	b := open(t, path, Options{LogicalBlockSize: 4096})
	buf := make([]byte, 4096)
	if err := b.WriteAt(buf, 1<<20, false); !errors.Is(err, ErrOutOfRange) {
		t.Fatalf("write past the end before the refresh: %v", err)
	}
	os.Truncate(path, 2<<20+100) // the tail short of a block does not count
	if was, now, err := b.Refresh(); err != nil || was != 1<<20 || now != 2<<20 || b.Size() != 2<<20 {
		t.Fatalf("refresh after growing: %d → %d, %v; size %d", was, now, err, b.Size())
	}
	if err := b.WriteAt(buf, 2<<20-4096, false); err != nil {
		t.Fatalf("write in the grown part: %v", err)
	}
	os.Truncate(path, 512<<10)
	if _, now, err := b.Refresh(); err != nil || now != 512<<10 {
		t.Fatalf("refresh after shrinking: %d %v", now, err)
	}
	if err := b.ReadAt(buf, 512<<10); !errors.Is(err, ErrOutOfRange) {
		t.Fatalf("read past the new end: %v", err)
	}
}

// TestCap: a cut's cap refuses writes past it at once, outlives a
// Refresh, and waits for the writes that began before it — not for
// those that begin after — or gives up with ETIMEDOUT.
func TestCap(t *testing.T) {
	path := sparseFile(t, t.TempDir(), 8<<20)
	b := open(t, path, Options{})
	g := b.beginWrite() // a write in flight, checked against 8 MiB
	done := make(chan error, 1)
	go func() { done <- b.Cap(4<<20, 10*time.Second, 1) }()
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
	waitFor("the cap", func() bool { return b.wgen.Load() != 0 }) // flipped: what begins now is not waited for
	if err := b.WriteAt(make([]byte, 4096), 5<<20, false); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("write past the cap: %v, want ENOSPC", err)
	}
	if _, now, err := b.Refresh(); err != nil || now != 4<<20 {
		t.Fatalf("Refresh under the cap: %d %v, want %d", now, err, 4<<20)
	}
	later := b.beginWrite() // begins after the cap: not waited for
	select {
	case err := <-done:
		t.Fatalf("Cap returned (%v) with a write from before it in flight", err)
	case <-time.After(50 * time.Millisecond):
	}
	b.endWrite(g)
	if err := <-done; err != nil {
		t.Fatalf("Cap: %v", err)
	}
	// A write that does not end: the cap gives up, and one tried again
	// still waits for it (it counts in a generation two flips back).
	for i := 0; i < 3; i++ {
		if err := b.Cap(2<<20, 20*time.Millisecond, 2); !errors.Is(err, syscall.ETIMEDOUT) {
			t.Fatalf("Cap %d with a write that does not end: %v, want ETIMEDOUT", i, err)
		}
		b.Uncap(2)
	}
	b.endWrite(later)
	if err := b.Cap(2<<20, 10*time.Second, 3); err != nil {
		t.Fatalf("Cap after the write ended: %v", err)
	}
	// A cap taken over by a later one: the first's Uncap lifts nothing.
	b.Uncap(1)
	if _, now, err := b.Refresh(); err != nil || now != 2<<20 {
		t.Fatalf("Refresh after the Uncap of a cap taken over: %d %v, want %d", now, err, 2<<20)
	}
	b.Uncap(3)
	if _, now, err := b.Refresh(); err != nil || now != 8<<20 {
		t.Fatalf("Refresh after Uncap: %d %v, want %d", now, err, 8<<20)
	}
}

func TestReadOnlyAndOptions(t *testing.T) {
	path := sparseFile(t, os.TempDir(), 1<<20+100)
	b := open(t, path, Options{ReadOnly: true, LogicalBlockSize: 4096, PhysicalBlockSize: 4096})
	if b.Size() != 1<<20 {
		t.Fatalf("size %d: the partial block at the end must not be addressable", b.Size())
	}
	if err := b.WriteAt(make([]byte, 4096), 0, false); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("write to a read-only backend: %v", err)
	}
	if b.Caps().Discard {
		t.Fatal("a read-only backend offers discard")
	}
	if _, err := Open(path, Options{LogicalBlockSize: 1000}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("logical block size 1000: %v", err)
	}
	if _, err := Open(t.TempDir(), Options{}); !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.EISDIR) {
		t.Fatalf("opening a directory: %v", err)
	}
	b2 := open(t, path, Options{ReadOnly: true})
	if b2.ID() != b.ID() {
		t.Fatalf("two opens of one file: %s != %s", b2.ID(), b.ID())
	}
	other := open(t, sparseFile(t, os.TempDir(), 4096), Options{})
	if other.ID() == b.ID() {
		t.Fatal("two files with one ID")
	}
}

func TestDirect(t *testing.T) {
	path := sparseFile(t, os.TempDir(), 1<<20)
	b, err := Open(path, Options{Direct: true})
	if err != nil {
		t.Skipf("O_DIRECT not available on %s: %v", os.TempDir(), err)
	}
	defer b.Close()
	buf := tcp.AlignedBytes(1 << 16) // O_DIRECT wants aligned memory
	copy(buf, "direct")
	if err := b.WriteAt(buf[:4096], 8192, true); err != nil {
		t.Fatal(err)
	}
	got := tcp.AlignedBytes(1 << 16)
	if err := b.ReadAt(got[:4096], 8192); err != nil || string(got[:6]) != "direct" {
		t.Fatalf("%q %v", got[:6], err)
	}
}

// TestWriteThrough: a write-through backend reports no write cache and
// writes through an O_DSYNC descriptor; discards and write-zeroes work.
func TestWriteThrough(t *testing.T) {
	for _, dir := range dirs {
		t.Run(strings.ReplaceAll(dir, "/", "_"), func(t *testing.T) {
			path := sparseFile(t, dir, 1<<20)
			b := open(t, path, Options{WriteThrough: true})
			if c := b.Caps(); c.WriteCache || c.FUA || !b.WriteThrough() {
				t.Fatalf("write-through caps %+v", c)
			}
			if !dsync(t, b.writer(false)) {
				t.Fatal("a plain write of a write-through backend is not O_DSYNC")
			}
			data := bytes.Repeat([]byte("durable!"), 2048) // 16 KiB
			if err := b.WriteAt(data, 8192, false); err != nil {
				t.Fatal(err)
			}
			if err := b.Discard(8192, 4096); err != nil {
				t.Fatal(err)
			}
			if err := b.WriteZeroes(12288, 4096, true); err != nil {
				t.Fatal(err)
			}
			got, _ := os.ReadFile(path)
			if !bytes.Equal(got[8192:16384], make([]byte, 8192)) || !bytes.Equal(got[16384:24576], data[8192:]) {
				t.Fatal("write, discard and write-zeroes did not land")
			}
			plain := open(t, path, Options{})
			if dsync(t, plain.writer(false)) || !dsync(t, plain.writer(true)) || !plain.Caps().WriteCache {
				t.Fatal("a default backend: plain writes must be cached, FUA writes O_DSYNC")
			}
			if ro := open(t, path, Options{ReadOnly: true, WriteThrough: true}); ro.WriteThrough() {
				t.Fatal("a read-only backend claims write-through")
			}
		})
	}
}

func dsync(t *testing.T, f *os.File) bool {
	t.Helper()
	fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0)
	if err != nil {
		t.Fatal(err)
	}
	return fl&unix.O_DSYNC == unix.O_DSYNC
}

// TestBlockDevice runs the same operations on a loop device (root only).
func TestBlockDevice(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to set up a loop device")
	}
	img := sparseFile(t, os.TempDir(), 16<<20)
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Skipf("no loop device: %v %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	b := open(t, dev, Options{})
	if b.Kind() != KindBlockDevice || b.Size() != 16<<20 || b.LogicalBlockSize() != 512 {
		t.Fatalf("%v size %d lbs %d", b.Kind(), b.Size(), b.LogicalBlockSize())
	}
	if !strings.HasPrefix(b.ID(), "blk:7:") {
		t.Fatalf("id %s", b.ID())
	}
	data := bytes.Repeat([]byte{0xab}, 1<<20)
	if err := b.WriteAt(data, 4<<20, true); err != nil {
		t.Fatal(err)
	}
	if err := b.Flush(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 1<<20)
	if err := b.ReadAt(got, 4<<20); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back: %v", err)
	}
	if !b.Caps().Discard {
		t.Fatal("a loop device over ext4 should discard")
	}
	// The page cache is a write cache in front of a device without one:
	// opened without O_DIRECT it must be flushed.
	wc := filepath.Join("/sys/block", filepath.Base(dev), "queue/write_cache")
	if err := os.WriteFile(wc, []byte("write through"), 0); err != nil {
		t.Fatalf("turning the loop device's write cache off: %v", err)
	}
	if c := open(t, dev, Options{}).Caps(); !c.WriteCache || !c.FUA {
		t.Fatalf("buffered open of a device without a write cache: caps %+v, want a write cache", c)
	}
	if d, err := Open(dev, Options{Direct: true}); err == nil {
		if d.Caps().WriteCache {
			t.Fatal("O_DIRECT open of a device without a write cache reports one")
		}
		d.Close()
	}
	if err := b.Discard(4<<20, 64<<10); err != nil {
		t.Fatalf("BLKDISCARD: %v", err)
	}
	if err := b.WriteZeroes(4<<20+64<<10, 64<<10, true); err != nil {
		t.Fatalf("write zeroes: %v", err)
	}
	b.ReadAt(got[:128<<10], 4<<20)
	if !bytes.Equal(got[:128<<10], make([]byte, 128<<10)) {
		t.Fatal("discarded and zeroed ranges do not read as zeros")
	}
	if err := b.WriteAt(data[:4096], 16<<20, false); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("write past the device: %v", err)
	}
	// The device's image file saw the discard as a hole.
	if !testfs.IsHole(t, img, 4<<20) {
		t.Fatal("BLKDISCARD did not reach the image file")
	}
	// A read-only loop device refuses a read-write open.
	out, err = exec.Command("losetup", "--find", "--show", "--read-only", img).CombinedOutput()
	if err != nil {
		t.Skipf("read-only loop device: %v %s", err, out)
	}
	ro := strings.TrimSpace(string(out))
	defer exec.Command("losetup", "-d", ro).Run()
	if _, err := Open(ro, Options{}); err == nil {
		t.Fatal("read-write open of a read-only device succeeded")
	}
	rb := open(t, ro, Options{ReadOnly: true})
	if err := rb.ReadAt(got[:4096], 4<<20+128<<10); err != nil || got[0] != 0xab {
		t.Fatalf("read from the read-only device: %v", err)
	}
	_ = filepath.Base
}

// TestOpenBeneath: names that leave the directory are refused, whatever
// route they take; names inside it open, through symlinks too.
func TestOpenBeneath(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "exports")
	os.MkdirAll(filepath.Join(dir, "sub"), 0o755)
	secret := filepath.Join(root, "secret")
	os.WriteFile(secret, make([]byte, 4096), 0o600)
	os.WriteFile(filepath.Join(dir, "disk"), make([]byte, 8192), 0o600)
	os.WriteFile(filepath.Join(dir, "sub", "disk2"), make([]byte, 8192), 0o600)
	os.Symlink("disk", filepath.Join(dir, "inside"))
	os.Symlink(secret, filepath.Join(dir, "absolute-out"))
	os.Symlink("../secret", filepath.Join(dir, "relative-out"))
	os.Symlink("/proc/self/root"+secret, filepath.Join(dir, "magic"))
	for _, name := range []string{"disk", "/disk", "//sub//disk2", "sub/disk2", "inside"} {
		b, err := OpenBeneath(dir, name, Options{ReadOnly: true})
		if err != nil {
			t.Errorf("%q: %v", name, err)
			continue
		}
		b.Close()
	}
	for _, name := range []string{"../secret", "sub/../../secret", "absolute-out", "relative-out", "magic", secret} {
		b, err := OpenBeneath(dir, name, Options{ReadOnly: true})
		if err == nil {
			b.Close()
			t.Errorf("%q opened: it leads out of %s", name, dir)
			continue
		}
		if !errors.Is(err, ErrEscapes) && !errors.Is(err, syscall.ENOENT) && !errors.Is(err, syscall.ELOOP) {
			t.Errorf("%q: %v", name, err)
		}
	}
	if _, err := OpenBeneath(dir, "", Options{}); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("empty name: %v", err)
	}
	if _, err := OpenBeneath(dir, "missing", Options{}); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("missing file: %v", err)
	}
}

// A FIFO, a character device, a directory or a socket is refused without
// being opened: a FIFO's open would block until a writer comes (it used
// to wedge the server with its session lock held), a device's open may
// have effects. Through Open and OpenBeneath, read-only and read-write.
func TestSpecialFilesRefused(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	os.Mkdir(filepath.Join(dir, "subdir"), 0o755)
	os.Symlink("/dev/null", filepath.Join(dir, "null"))
	for _, name := range []string{"fifo", "subdir", "null"} {
		for _, ro := range []bool{true, false} {
			done := make(chan error, 2)
			go func() {
				_, err := Open(filepath.Join(dir, name), Options{ReadOnly: ro})
				done <- err
				_, err = OpenBeneath(dir, name, Options{ReadOnly: ro})
				done <- err
			}()
			for i := 0; i < 2; i++ {
				select {
				case err := <-done:
					if name == "null" && i == 1 {
						// Beneath, the absolute symlink leads out first.
						if !errors.Is(err, ErrEscapes) {
							t.Errorf("%s beneath: %v, want ErrEscapes", name, err)
						}
						continue
					}
					if !errors.Is(err, ErrNotBlockLike) || !errors.Is(err, syscall.EINVAL) || !strings.Contains(err.Error(), name) {
						t.Errorf("%s (read-only %v): %v, want ErrNotBlockLike naming it", name, ro, err)
					}
				case <-time.After(10 * time.Second):
					// The goroutine stays blocked in open: unblock it.
					if f, err := os.OpenFile(fifo, os.O_RDWR, 0); err == nil {
						defer f.Close()
					}
					t.Fatalf("%s (read-only %v): open blocked", name, ro)
				}
			}
		}
	}
}

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

// TestOpenLeavesMtime: opening a tmpfs file for writes, its probes and
// populate included, changes nothing a backup would see. (Elsewhere the
// discard probe moves the mtime: probeFile.)
func TestOpenLeavesMtime(t *testing.T) {
	onTmpfs(t)
	path := sparseFile(t, "/dev/shm", 8<<20)
	past := time.Now().Add(-time.Hour).Truncate(time.Second)
	if err := os.Chtimes(path, past, past); err != nil {
		t.Fatal(err)
	}
	b := open(t, path, Options{})
	if !b.Caps().Discard {
		t.Fatal("no discard on tmpfs")
	}
	if m := b.mp.m.Load(); m != nil {
		m.pop.Wait()
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(path); err != nil || !st.ModTime().Equal(past) {
		t.Fatalf("open and close moved the mtime to %v (err %v), was %v", st.ModTime(), err, past)
	}
}

// TestWriteErrorsNamePath: a write that fails on the backend names the
// file, whichever descriptor it went through — the FUA one (O_DSYNC,
// opened through /proc/self/fd) included, and on a write-through backend,
// whose every write goes there. Provoked with a file system that is full.
func TestWriteErrorsNamePath(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a small tmpfs")
	}
	mnt := t.TempDir()
	if err := unix.Mount("rnbd-blockdev-test", mnt, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	path := sparseFile(t, mnt, 16<<20) // 16 MiB on a file system of 1 MiB
	data := bytes.Repeat([]byte{0x5a}, 2<<20)
	for i, c := range []struct {
		name string
		opts Options
		fua  bool
	}{
		{"plain", Options{}, false},
		{"FUA", Options{}, true},
		{"write-through", Options{WriteThrough: true}, false},
	} {
		b := open(t, path, c.opts)
		// Each past what the one before filled.
		off := int64(i) * 4 << 20
		err := b.WriteAt(data, off, c.fua)
		if !errors.Is(err, syscall.ENOSPC) {
			t.Fatalf("%s write of 2 MiB on a full 1 MiB file system: %v, want ENOSPC", c.name, err)
		}
		if msg := err.Error(); !strings.Contains(msg, path) || strings.Contains(msg, "/proc/") {
			t.Errorf("%s write: %q does not name the file %s", c.name, msg, path)
		}
	}
}

// TestShrinkBehind: a file cut behind the server's back is not a resize
// to PollSize (a size poll) as it is to Refresh (the server's own
// resize): the size served stays, every IO that reaches past the file's
// end fails with EIO — writes too, which would grow the file back — and
// what lies below it is served as before; a grow back heals it, a grow
// past it is served, and a failed cut (Cap, Uncap) leaves it as it was.
// On ext4 through the workers' IO, on tmpfs through the inline IO too
// (TryWriteAt, the file's mapping).
func TestShrinkBehind(t *testing.T) {
	for _, dir := range dirs {
		t.Run(strings.ReplaceAll(dir, "/", "_"), func(t *testing.T) {
			testShrinkBehind(t, dir)
		})
	}
}

func testShrinkBehind(t *testing.T, dir string) {
	path := sparseFile(t, dir, 8<<20)
	b := open(t, path, Options{})
	low, high := bytes.Repeat([]byte("low!"), 256<<10), bytes.Repeat([]byte("high"), 1024) // 1 MiB at 0, 4 KiB at 6 MiB
	if err := b.WriteAt(low, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := b.WriteAt(high, 6<<20, false); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, 2<<20+100); err != nil { // the tail short of a block does not count
		t.Fatal(err)
	}
	was, now, err := b.PollSize()
	var se *ShrinkError
	if !errors.As(err, &se) || se.Served != 8<<20 || se.Size != 2<<20 || se.Path != path || was != 8<<20 || now != 8<<20 {
		t.Fatalf("poll of the file cut to 2 MiB: %d → %d, %v; want 8 MiB kept and a ShrinkError from 8 MiB to 2 MiB", was, now, err)
	}
	if b.Size() != 8<<20 {
		t.Fatalf("the size served went to %d on a shrink behind the server", b.Size())
	}
	if herr := b.Health(); herr == nil || herr.Error() != err.Error() {
		t.Fatalf("the health check says %v, the poll %v: one change, one message", herr, err)
	}
	if _, _, again := b.PollSize(); again == nil || again.Error() != err.Error() {
		t.Fatalf("poll again: %v", again)
	}
	past := make([]byte, 8192)
	eio := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, syscall.EIO) || !errors.Is(err, ErrPastFileEnd) || !strings.Contains(err.Error(), path) {
			t.Errorf("%s past the file's end: %v, want EIO naming the file", what, err)
		}
	}
	eio("write", b.WriteAt(past, 6<<20, false))
	eio("FUA write", b.WriteAt(past, 6<<20, true))
	eio("write straddling the end", b.WriteAt(past, 2<<20-4096, false))
	eio("read", b.ReadAt(past, 6<<20))
	eio("discard", b.Discard(4<<20, 1<<20))
	eio("write-zeroes", b.WriteZeroes(4<<20, 1<<20, true))
	eio("write-zeroes unmapping", b.WriteZeroes(4<<20, 1<<20, false))
	if done, err := b.TryWriteAt(past, 5<<20); done {
		eio("inline write", err)
	}
	if done, err := b.TryReadAt(past, 5<<20); done {
		eio("inline read", err)
	}
	if err := b.WriteAt(past, 9<<20, false); !errors.Is(err, syscall.ENOSPC) || !errors.Is(err, ErrOutOfRange) {
		t.Errorf("write past the size served: %v, want ENOSPC", err)
	}
	if n := fileSize(t, path); n != 2<<20+100 {
		t.Fatalf("the file is %d bytes after the refused IO, want it left at %d", n, 2<<20+100)
	}
	// Below the end: served as before.
	got := make([]byte, len(low))
	if err := b.ReadAt(got, 0); err != nil || !bytes.Equal(got, low) {
		t.Fatalf("read below the end: %v", err)
	}
	if done, err := b.TryReadAt(got[:4096], 4096); done && (err != nil || !bytes.Equal(got[:4096], low[4096:8192])) {
		t.Fatalf("inline read below the end: %v", err)
	}
	if err := b.WriteAt(low[:4096], 2<<20-4096, true); err != nil {
		t.Fatalf("write below the end: %v", err)
	}
	// A forced cut that failed (its cap lifted, nothing cut) leaves it
	// as it was: the size served, the shrink.
	if err := b.Cap(2<<20, time.Second, 7); err != nil {
		t.Fatal(err)
	}
	b.Uncap(7)
	if was, now, err := b.PollSize(); !errors.As(err, &se) || was != 2<<20 || now != 8<<20 {
		t.Fatalf("poll after a cut that failed: %d → %d, %v; want 8 MiB back and the shrink", was, now, err)
	}
	// Grown back: healed, IO past the old cut works again.
	if err := os.Truncate(path, 8<<20); err != nil {
		t.Fatal(err)
	}
	if was, now, err := b.PollSize(); err != nil || was != 8<<20 || now != 8<<20 {
		t.Fatalf("poll of the file grown back: %d → %d, %v", was, now, err)
	}
	if err := b.Health(); err != nil {
		t.Fatalf("health once grown back: %v", err)
	}
	if err := b.WriteAt(high, 6<<20, false); err != nil {
		t.Fatalf("write once grown back: %v", err)
	}
	if err := b.ReadAt(got[:len(high)], 6<<20); err != nil || !bytes.Equal(got[:len(high)], high) {
		t.Fatalf("read once grown back: %v", err)
	}
	// Cut again, then grown past the size served: the grow is served.
	os.Truncate(path, 1<<20)
	if _, _, err := b.PollSize(); !errors.As(err, &se) {
		t.Fatalf("poll of the file cut again: %v", err)
	}
	os.Truncate(path, 12<<20)
	if was, now, err := b.PollSize(); err != nil || was != 8<<20 || now != 12<<20 {
		t.Fatalf("poll of the file grown past the size served: %d → %d, %v", was, now, err)
	}
	if err := b.WriteAt(high, 11<<20, false); err != nil {
		t.Fatalf("write in the grown part: %v", err)
	}
	// Cut again and Refreshed (rnbd-server resize --force): the new size
	// is served, IO past it is out of range, not EIO.
	os.Truncate(path, 2<<20)
	if was, now, err := b.Refresh(); err != nil || was != 12<<20 || now != 2<<20 {
		t.Fatalf("refresh of the file cut: %d → %d, %v", was, now, err)
	}
	if err := b.WriteAt(past, 6<<20, false); !errors.Is(err, ErrOutOfRange) || !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("write past the size served once refreshed: %v, want ENOSPC", err)
	}
	if _, _, err := b.PollSize(); err != nil {
		t.Fatalf("poll once refreshed: %v", err)
	}
}

// fileSize is the size of the file at path.
func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}
