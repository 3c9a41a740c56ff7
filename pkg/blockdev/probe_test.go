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
