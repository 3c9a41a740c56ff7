package blockdev

import (
	"bytes"
	"errors"
	"fmt"
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

// TestOpenChangesNothing: opening a sparse file for writing allocates
// nothing (the probes of zero range and hole punching past its end give
// back what they take).
func TestOpenChangesNothing(t *testing.T) {
	for _, dir := range dirs {
		path := sparseFile(t, dir, 1<<20)
		b := open(t, path, Options{})
		if got := testfs.Allocated(t, path); got != 0 {
			t.Errorf("%s: opening a sparse file allocated %d bytes (caps %+v)", dir, got, b.Caps())
		}
	}
}

// TestRangeCheckPast2GiB: discard, write-zeroes and secure erase check
// their whole range, not only its first 2 GiB.
func TestRangeCheckPast2GiB(t *testing.T) {
	b := open(t, sparseFile(t, os.TempDir(), 3<<30), Options{})
	if err := b.WriteZeroes(0, 4<<30, false); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("write zeroes of 4 GiB on a 3 GiB file: %v, want ENOSPC", err)
	}
	if err := b.Discard(1<<30, 3<<30); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("discard past the end: %v, want ENOSPC", err)
	}
	if b.Size() != 3<<30 {
		t.Errorf("size %d", b.Size())
	}
}

// loopDevice attaches img to a loop device with extra losetup flags
// (root only), and returns it.
func loopDevice(t *testing.T, img string, flags ...string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to set up a loop device")
	}
	out, err := exec.Command("losetup", append(append([]string{"--find", "--show"}, flags...), img)...).CombinedOutput()
	if err != nil {
		t.Skipf("no loop device: %v %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	return dev
}

// TestPartitionLimits: a partition has no request queue of its own in
// sysfs; its disk's write cache, discard and IO limits are its own. Read
// from the partition's directory they were all missing, so an O_DIRECT
// export of a partition on a disk with a volatile cache reported none and
// clients never flushed.
func TestPartitionLimits(t *testing.T) {
	img := sparseFile(t, os.TempDir(), 32<<20)
	disk := loopDevice(t, img, "--partscan")
	// One partition from sector 2048 to the end, made by BLKPG (addpart):
	// no partition table to parse, which not every kernel can.
	if out, err := exec.Command("addpart", disk, "1", "2048", fmt.Sprint((32<<20)/512-2048)).CombinedOutput(); err != nil {
		t.Skipf("addpart: %v %s", err, out)
	}
	part := disk + "p1"
	for end := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(part); err == nil {
			break
		} else if time.Now().After(end) {
			t.Skipf("no partition device %s: %v", part, err)
		}
	}
	wc := filepath.Join("/sys/block", filepath.Base(disk), "queue/write_cache")
	if err := os.WriteFile(wc, []byte("write back"), 0); err != nil {
		t.Fatalf("turning the loop device's write cache on: %v", err)
	}
	whole := open(t, disk, Options{Direct: true}).Caps()
	p := open(t, part, Options{Direct: true})
	got := p.Caps()
	if !got.WriteCache || !got.FUA {
		t.Errorf("O_DIRECT partition of a disk with a write cache: caps %+v, want a write cache and FUA", got)
	}
	if got.Discard != whole.Discard || got.MaxIOBytes != whole.MaxIOBytes || got.ZeroRange != whole.ZeroRange ||
		got.MaxSegments != whole.MaxSegments {
		t.Errorf("partition caps %+v, disk's %+v", got, whole)
	}
	if p.Size() != (32<<20)-2048*512 {
		t.Errorf("partition size %d", p.Size())
	}
}

// TestDirectFileOn4Kn: a file opened O_DIRECT on a file system over a
// disk of 4 KiB logical sectors serves 4 KiB logical blocks: 512-byte
// aligned O_DIRECT IO fails there with EINVAL.
func TestDirectFileOn4Kn(t *testing.T) {
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("needs mkfs.ext4")
	}
	img := sparseFile(t, os.TempDir(), 64<<20)
	dev := loopDevice(t, img, "--sector-size", "4096")
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", dev).CombinedOutput(); err != nil {
		t.Skipf("mkfs.ext4: %v %s", err, out)
	}
	mnt := t.TempDir()
	if err := unix.Mount(dev, mnt, "ext4", 0, ""); err != nil {
		t.Skipf("mount: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	path := filepath.Join(mnt, "disk.img")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, 1<<20); err != nil {
		t.Fatal(err)
	}
	b := open(t, path, Options{Direct: true})
	if b.LogicalBlockSize() != 4096 || b.PhysicalBlockSize() < 4096 {
		t.Fatalf("O_DIRECT file on a 4Kn disk: block sizes %d/%d, want 4096", b.LogicalBlockSize(), b.PhysicalBlockSize())
	}
	buf := tcp.AlignedBytes(8192)
	copy(buf, bytes.Repeat([]byte("4kn!"), 2048))
	if err := b.WriteAt(buf[:4096], 4096, false); err != nil {
		t.Fatalf("aligned write: %v", err)
	}
	got := tcp.AlignedBytes(4096)
	if err := b.ReadAt(got, 4096); err != nil || !bytes.Equal(got, buf[:4096]) {
		t.Fatalf("read back: %v", err)
	}
	// Buffered, the file keeps 512-byte blocks.
	if lbs := open(t, path, Options{}).LogicalBlockSize(); lbs != 512 {
		t.Errorf("buffered open: logical block size %d, want 512", lbs)
	}
	// Asked for 512-byte blocks with O_DIRECT: refused, saying why.
	if _, err := Open(path, Options{Direct: true, LogicalBlockSize: 512}); err == nil || !strings.Contains(err.Error(), "aligned to 4096") {
		t.Errorf("O_DIRECT with 512-byte blocks on a 4Kn disk: %v", err)
	}
}
