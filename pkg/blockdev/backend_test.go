// Tests of a whole backend, on files (ext4 and tmpfs) and on a block
// device, its options and ID; and the helpers the package's tests share.

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

	"github.com/rnbd/rnbd/test/kit"
	"github.com/rnbd/rnbd/test/testfs"
)

// sparseFile makes an empty sparse file of size bytes in dir (kit.SparseFile)
// under a name of its own, removed when the test ends: dir may be shared
// (/tmp, /dev/shm).
func sparseFile(t *testing.T, dir string, size int64) string {
	t.Helper()
	f, err := os.CreateTemp(dir, "backend-*.img")
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	t.Cleanup(func() { os.Remove(f.Name()) })
	kit.SparseFile(t, f.Name(), size)
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
