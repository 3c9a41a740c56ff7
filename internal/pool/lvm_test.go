// Tests of the LVM thin pool against a real thin pool on a loop device,
// made by lvmTestPool, which needs root, device-mapper with its
// thin-pool target and lvm2's tools: where one is missing they skip
// saying which (the VM tier's lvm part has them all, and sets
// RNBD_LVM_REQUIRED=1 to make a skip a failure). The pure parts are in
// lvm_tags_test.go and lvm_lvs_test.go.
package pool

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

var lvmSeq atomic.Int32

// lvmSkip says why a real thin pool cannot be made here ("" if it can).
func lvmSkip() string {
	if os.Geteuid() != 0 {
		return "needs root (device-mapper, loop devices)"
	}
	for _, tool := range []string{"lvcreate", "lvs", "vgcreate", "pvcreate", "vgremove", "pvremove"} {
		if _, err := exec.LookPath(tool); err != nil {
			return "no lvm2 tools (" + tool + ": Debian's lvm2 package)"
		}
	}
	if _, err := os.Stat("/dev/mapper/control"); err != nil {
		return "no device-mapper (/dev/mapper/control: the dm-mod module)"
	}
	if _, err := os.Stat("/sys/module/dm_thin_pool"); err != nil {
		exec.Command("modprobe", "dm-thin-pool").Run()
		if _, err := os.Stat("/sys/module/dm_thin_pool"); err != nil {
			return "no thin-pool target of device-mapper (the dm-thin-pool module)"
		}
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		return "no loop devices (/dev/loop-control)"
	}
	return ""
}

// run runs a tool the test needs to succeed.
func run(t *testing.T, tool string, args ...string) string {
	t.Helper()
	out, err := exec.Command(tool, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v: %s", tool, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// lvmTestPool makes a volume group on a loop device over a sparse file
// and a thin pool "thin" of dataMiB in it, removed at the end; it
// returns the volume group's name.
func lvmTestPool(t *testing.T, dataMiB int) string {
	t.Helper()
	if why := lvmSkip(); why != "" {
		if os.Getenv("RNBD_LVM_REQUIRED") != "" {
			t.Fatalf("RNBD_LVM_REQUIRED is set, but %s", why)
		}
		t.Skip(why)
	}
	img := filepath.Join(t.TempDir(), "pv.img")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(int64(dataMiB+32) << 20); err != nil {
		t.Fatal(err)
	}
	loop := attachLoop(t, f)
	f.Close()
	vg := fmt.Sprintf("rnbdtest%d.%d", os.Getpid(), lvmSeq.Add(1))
	run(t, "pvcreate", "-y", "-q", loop)
	t.Cleanup(func() { exec.Command("pvremove", "-y", "-q", loop).Run() })
	run(t, "vgcreate", "-q", vg, loop)
	t.Cleanup(func() {
		if out, err := exec.Command("vgremove", "-ff", "-y", vg).CombinedOutput(); err != nil {
			t.Errorf("vgremove %s: %v: %s", vg, err, out)
		}
	})
	run(t, "lvcreate", "-q", "-y", "--type", "thin-pool", "-L", fmt.Sprintf("%dm", dataMiB), "-n", "thin", vg)
	return vg
}

// attachLoop attaches f to a free loop device (detached when the test
// ends and LVM has let go of it: autoclear).
func attachLoop(t *testing.T, f *os.File) string {
	t.Helper()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	for range 10 {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			t.Fatalf("LOOP_CTL_GET_FREE: %v", err)
		}
		dev := fmt.Sprintf("/dev/loop%d", n)
		var l *os.File
		for range 50 { // devtmpfs makes the node
			if l, err = os.OpenFile(dev, os.O_RDWR, 0); err == nil || !errors.Is(err, os.ErrNotExist) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil {
			t.Fatal(err)
		}
		cfg := unix.LoopConfig{Fd: uint32(f.Fd()), Info: unix.LoopInfo64{Flags: unix.LO_FLAGS_AUTOCLEAR}}
		err = unix.IoctlLoopConfigure(int(l.Fd()), &cfg)
		if errors.Is(err, unix.EBUSY) { // taken by another meanwhile
			l.Close()
			continue
		}
		if err != nil {
			l.Close()
			t.Fatalf("LOOP_CONFIGURE %s: %v", dev, err)
		}
		t.Cleanup(func() { l.Close() })
		return dev
	}
	t.Fatal("no free loop device")
	return ""
}

func openLVMTest(t *testing.T, vg string) *LVMThin {
	t.Helper()
	p, removed, err := OpenLVMThin("thin", vg, "thin")
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 0 {
		t.Fatalf("a new pool removed %v", removed)
	}
	p.now = func() time.Time { return time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC) }
	return p
}

// lvsOf is the LVs of vg by name (hidden ones left out), with their
// size and tags.
func lvsOf(t *testing.T, vg string) map[string]lvRow {
	t.Helper()
	out := run(t, "lvs", "--reportformat", "json", "--units", "b", "--nosuffix", "-o", lvsFields, vg)
	rows, err := parseLVs([]byte(out))
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]lvRow{}
	for _, r := range rows {
		m[r.Name] = r
	}
	return m
}

func wantLVs(t *testing.T, vg string, want ...string) {
	t.Helper()
	got := lvsOf(t, vg)
	var names []string
	for n := range got {
		names = append(names, n)
	}
	if len(got) != len(want) {
		t.Fatalf("LVs of %s: %v, want %v", vg, names, want)
	}
	for _, n := range want {
		if _, ok := got[n]; !ok {
			t.Fatalf("LVs of %s: %v, want %v", vg, names, want)
		}
	}
}

func devSize(t *testing.T, path string) int64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n, err := f.Seek(0, 2)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// Opening: a volume group or thin pool that is not there is ENOENT, an
// LV that is not a thin pool EINVAL.
func TestLVMOpen(t *testing.T) {
	vg := lvmTestPool(t, 32)
	run(t, "lvcreate", "-q", "-y", "-L", "4m", "-n", "plain", vg)
	for _, c := range []struct {
		vg, thin string
		errno    syscall.Errno
		says     string
	}{
		{"rnbd-no-such-vg", "thin", syscall.ENOENT, "no volume group rnbd-no-such-vg"},
		{vg, "nothin", syscall.ENOENT, "no thin pool nothin"},
		{vg, "plain", syscall.EINVAL, "not a thin pool"},
		{vg, "bad/name", syscall.EINVAL, "not an LVM name"},
	} {
		_, _, err := OpenLVMThin("thin", c.vg, c.thin)
		wantErrno(t, c.vg+"/"+c.thin, err, c.errno)
		if !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s/%s: %v, want it to say %q", c.vg, c.thin, err, c.says)
		}
	}
	// An inactive thin pool is activated (its usage is read from it).
	run(t, "lvchange", "-an", vg+"/thin")
	p := openLVMTest(t, vg)
	if !lvsOf(t, vg)["thin"].active() {
		t.Fatal("the thin pool is not active after open")
	}
	if c, err := p.Capacity(); err != nil || c.Total != 32<<20 || c.Allocatable != 32<<20 || c.MetadataSize == 0 {
		t.Fatalf("capacity of an empty pool: %+v, %v", c, err)
	}
	if p.Type() != "lvm-thin" || p.Name() != "thin" {
		t.Fatalf("%s %s", p.Type(), p.Name())
	}
}

// Made by name with its metadata in the LV's tags; a retry answers it;
// other parameters are EEXIST saying what differs; a pool opened again
// reads the same; bad input is EINVAL and makes nothing.
func TestLVMCreateIdempotent(t *testing.T) {
	vg := lvmTestPool(t, 64)
	p := openLVMTest(t, vg)
	hostile := hostileLabel(MaxLabelBytes - 3)
	labels := map[string]string{"pvc": hostile}
	v, created, err := p.Create(Spec{Name: "vol_1", Size: 1 << 20, Labels: labels})
	if err != nil || !created {
		t.Fatalf("create: %v, created %v", err, created)
	}
	if v.Path != "/dev/"+vg+"/rnbd.v.vol+1" || devSize(t, v.Path) < 1<<20 {
		t.Fatalf("path %s", v.Path)
	}
	lv := lvsOf(t, vg)["rnbd.v.vol+1"]
	if lv.Segtype != "thin" || lv.Pool != "thin" || len(lv.Tags) < 10 {
		t.Fatalf("the LV: %+v", lv)
	}
	again, created, err := p.Create(Spec{Name: "vol_1", Size: 1 << 20, Labels: map[string]string{"pvc": hostile}})
	if err != nil || created || !again.Created.Equal(v.Created) {
		t.Fatalf("the same create again: %+v, created %v, %v", again, created, err)
	}
	_, _, err = p.Create(Spec{Name: "vol_1", Size: 2 << 20, Labels: labels})
	wantErrno(t, "another size", err, syscall.EEXIST)
	if !strings.Contains(err.Error(), "size 1048576 (asked 2097152)") {
		t.Fatalf("the refusal does not say what differs: %v", err)
	}
	_, _, err = p.Create(Spec{Name: "vol_1", Size: 1 << 20})
	wantErrno(t, "other labels", err, syscall.EEXIST)
	p2 := openLVMTest(t, vg)
	got, err := p2.Get("vol_1")
	if err != nil || got.Size != 1<<20 || got.Pool != "thin" || got.Labels["pvc"] != hostile || !got.Created.Equal(v.Created) || got.Path != v.Path {
		t.Fatalf("read again: %+v, %v", got, err)
	}
	// A name too long for LVM as it is: a hashed LV, the same volume.
	long := strings.Repeat("n", 128)
	lv2 := lvName(vg, kindVolume, long)
	if _, _, err := p.Create(Spec{Name: long, Size: 4096}); err != nil {
		t.Fatal(err)
	}
	if g, err := p.Get(long); err != nil || g.Name != long || g.Path != "/dev/"+vg+"/"+lv2 || devSize(t, g.Path) < 4096 {
		t.Fatalf("long name: %+v, %v", g, err)
	}
	vs, err := p.List()
	if err != nil || len(vs) != 2 || vs[0].Name != long || vs[1].Name != "vol_1" {
		t.Fatalf("list %v, %v", vs, err)
	}
	_, err = p.Get("nope")
	wantErrno(t, "get of nothing", err, syscall.ENOENT)
	for _, s := range []Spec{{Name: "a/b", Size: 4096}, {Name: "s", Size: 4097}, {Name: "s", Size: 0},
		{Name: "l", Size: 4096, Labels: map[string]string{"k": strings.Repeat("v", MaxLabelBytes)}},
		{Name: "c", Size: 4096, From: "vol_1", FromSnapshot: "x"}} {
		_, _, err := p.Create(s)
		wantErrno(t, fmt.Sprintf("%+.60v", s), err, syscall.EINVAL)
	}
	_, _, err = p.Create(Spec{Name: "c", Size: 4096, From: "nope"})
	wantErrno(t, "a clone of nothing", err, syscall.ENOENT)
	_, _, err = p.Create(Spec{Name: "c", Size: 4096, FromSnapshot: "nope"})
	wantErrno(t, "a clone of no snapshot", err, syscall.ENOENT)
	wantLVs(t, vg, "thin", "rnbd.v.vol+1", lv2)
}

// Grow only; the device grows; a crash between lvextend and the tags is
// finished by a retry.
func TestLVMResize(t *testing.T) {
	vg := lvmTestPool(t, 64)
	p := openLVMTest(t, vg)
	v, _, err := p.Create(Spec{Name: "r", Size: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := p.Resize("r", 8<<20); err != nil || got.Size != 8<<20 {
		t.Fatalf("the same size: %+v, %v", got, err)
	}
	_, err = p.Resize("r", 4<<20)
	wantErrno(t, "smaller", err, syscall.EINVAL)
	_, err = p.Resize("r", (8<<20)+1)
	wantErrno(t, "not a multiple of 4096", err, syscall.EINVAL)
	_, err = p.Resize("nope", 8<<20)
	wantErrno(t, "no such volume", err, syscall.ENOENT)
	_, err = p.Resize("r", 128<<20)
	wantErrno(t, "over the pool", err, syscall.ENOSPC)
	if got, err := p.Resize("r", 16<<20); err != nil || got.Size != 16<<20 || devSize(t, v.Path) != 16<<20 {
		t.Fatalf("grown: %+v, %v; device %d bytes", got, err, devSize(t, v.Path))
	}
	if got, _ := p.Get("r"); got.Size != 16<<20 {
		t.Fatalf("read again: %d bytes", got.Size)
	}
	// A crash after lvextend, before the tags: the volume still says
	// its old size, and a retry only records the new one.
	run(t, "lvextend", "-q", "-y", "-L", "24m", vg+"/rnbd.v.r")
	if got, _ := p.Get("r"); got.Size != 16<<20 {
		t.Fatalf("after a half-done resize: %d bytes, want the old 16 MiB", got.Size)
	}
	if got, err := p.Resize("r", 24<<20); err != nil || got.Size != 24<<20 {
		t.Fatalf("retry: %+v, %v", got, err)
	}
	if got, _ := p.Get("r"); got.Size != 24<<20 || devSize(t, got.Path) != 24<<20 {
		t.Fatalf("after the retry: %+v", got)
	}
}

// Delete removes the LV; gone is success; an LV that only has the name
// of a volume, and any other LV, are never touched.
func TestLVMDeleteAndForeignLVs(t *testing.T) {
	vg := lvmTestPool(t, 64)
	p := openLVMTest(t, vg)
	run(t, "lvcreate", "-q", "-y", "--type", "thin", "--thinpool", "thin", "-V", "4m", "-n", "other", vg)
	run(t, "lvcreate", "-q", "-y", "--type", "thin", "--thinpool", "thin", "-V", "4m", "-n", "rnbd.v.x", "--addtag", "mine", vg)
	if _, _, err := p.Create(Spec{Name: "d", Size: 4 << 20}); err != nil {
		t.Fatal(err)
	}
	if err := p.Delete("d"); err != nil {
		t.Fatal(err)
	}
	if err := p.Delete("d"); err != nil {
		t.Fatalf("delete of what is gone: %v", err)
	}
	_, err := p.Get("x")
	wantErrno(t, "an LV without our tags", err, syscall.ENOENT)
	wantErrno(t, "delete of it", p.Delete("x"), syscall.ENOENT)
	_, _, err = p.Create(Spec{Name: "x", Size: 4 << 20})
	wantErrno(t, "create over it", err, syscall.EEXIST)
	if vs, err := p.List(); err != nil || len(vs) != 0 {
		t.Fatalf("list: %v, %v", vs, err)
	}
	// Another pool's volume in the same volume group is not this one's.
	other, _, err := OpenLVMThin("other-pool", vg, "thin")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := other.Create(Spec{Name: "y", Size: 4 << 20}); err != nil {
		t.Fatal(err)
	}
	_, err = p.Get("y")
	wantErrno(t, "another pool's volume", err, syscall.ENOENT)
	wantErrno(t, "delete of another pool's volume", p.Delete("y"), syscall.ENOENT)
	wantLVs(t, vg, "thin", "other", "rnbd.v.x", "rnbd.v.y")
	if tags := lvsOf(t, vg)["rnbd.v.x"].Tags; len(tags) != 1 || tags[0] != "mine" {
		t.Fatalf("the foreign LV's tags: %v", tags)
	}
}

// Snapshots are read-only images at a moment, active; clones of a
// snapshot or of a volume are writable thin snapshots, grown to the size
// asked; each is idempotent by name.
func TestLVMSnapshotsAndClones(t *testing.T) {
	vg := lvmTestPool(t, 64)
	p := openLVMTest(t, vg)
	v, _, err := p.Create(Spec{Name: "v1", Size: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	first := bytes.Repeat([]byte("first..."), 512)
	second := bytes.Repeat([]byte("second.."), 512)
	writeDev(t, v.Path, 1<<20, first)
	s, created, err := p.CreateSnapshot("v1", "s1", nil)
	if err != nil || !created || s.Volume != "v1" || s.Size != 8<<20 || s.Path != "/dev/"+vg+"/rnbd.s.s1" {
		t.Fatalf("snapshot: %+v, %v, %v", s, created, err)
	}
	writeDev(t, v.Path, 1<<20, second)
	if got := readDev(t, s.Path, 1<<20, len(first)); !bytes.Equal(got, first) {
		t.Fatal("the snapshot does not hold the data of its moment")
	}
	if lvsOf(t, vg)["rnbd.s.s1"].writable() {
		t.Fatal("the snapshot's LV is writable")
	}
	if f, err := os.OpenFile(s.Path, os.O_WRONLY, 0); err == nil {
		_, err = f.WriteAt(second, 1<<20)
		if err == nil {
			err = f.Sync()
		}
		f.Close()
		if err == nil {
			t.Fatal("a write to the snapshot succeeded")
		}
	}
	if got := readDev(t, s.Path, 1<<20, len(first)); !bytes.Equal(got, first) {
		t.Fatal("the snapshot changed")
	}
	if again, created, err := p.CreateSnapshot("v1", "s1", nil); err != nil || created || !again.Created.Equal(s.Created) {
		t.Fatalf("the same snapshot again: %+v, %v, %v", again, created, err)
	}
	if _, _, err := p.Create(Spec{Name: "v0", Size: 4 << 20}); err != nil {
		t.Fatal(err)
	}
	_, _, err = p.CreateSnapshot("v0", "s1", nil)
	wantErrno(t, "a snapshot of that name of another volume", err, syscall.EEXIST)
	_, _, err = p.CreateSnapshot("nope", "s2", nil)
	wantErrno(t, "a snapshot of nothing", err, syscall.ENOENT)

	// A clone of the snapshot, grown: it has the snapshot's data and
	// is writable without touching the snapshot.
	c, created, err := p.Create(Spec{Name: "c1", Size: 16 << 20, FromSnapshot: "s1"})
	if err != nil || !created || c.SourceSnapshot != "s1" || c.Size != 16<<20 || devSize(t, c.Path) != 16<<20 {
		t.Fatalf("clone of s1: %+v, %v, %v", c, created, err)
	}
	if got := readDev(t, c.Path, 1<<20, len(first)); !bytes.Equal(got, first) {
		t.Fatal("the clone does not hold its snapshot's data")
	}
	writeDev(t, c.Path, 12<<20, second)
	if got := readDev(t, c.Path, 12<<20, len(second)); !bytes.Equal(got, second) {
		t.Fatal("the clone's grown part does not keep what is written")
	}
	if tags := lvsOf(t, vg)["rnbd.v.c1"].Tags; strings.Contains(strings.Join(tags, ","), tagIncomplete) {
		t.Fatalf("the clone is left marked incomplete: %v", tags)
	}
	if again, created, err := p.Create(Spec{Name: "c1", Size: 16 << 20, FromSnapshot: "s1"}); err != nil || created || again.Size != 16<<20 {
		t.Fatalf("the same clone again: %+v, %v, %v", again, created, err)
	}
	_, _, err = p.Create(Spec{Name: "c1", Size: 16 << 20, From: "v1"})
	wantErrno(t, "the clone's name from another source", err, syscall.EEXIST)
	_, _, err = p.Create(Spec{Name: "c2", Size: 4 << 20, FromSnapshot: "s1"})
	wantErrno(t, "a clone smaller than its snapshot", err, syscall.EINVAL)

	// A clone of the volume, the same size: one lvcreate.
	c2, _, err := p.Create(Spec{Name: "c2", Size: 8 << 20, From: "v1"})
	if err != nil || c2.Source != "v1" || devSize(t, c2.Path) != 8<<20 {
		t.Fatalf("clone of v1: %+v, %v", c2, err)
	}
	if got := readDev(t, c2.Path, 1<<20, len(second)); !bytes.Equal(got, second) {
		t.Fatal("the clone of v1 does not hold v1's data")
	}
	ss, err := p.Snapshots()
	if err != nil || len(ss) != 1 || ss[0].Name != "s1" || ss[0].Volume != "v1" {
		t.Fatalf("snapshots %+v, %v", ss, err)
	}
	// The origin can go; its snapshot and clones stay.
	if err := p.Delete("v1"); err != nil {
		t.Fatal(err)
	}
	if got := readDev(t, s.Path, 1<<20, len(first)); !bytes.Equal(got, first) {
		t.Fatal("the snapshot lost its data with its volume")
	}
	if err := p.DeleteSnapshot("s1"); err != nil {
		t.Fatal(err)
	}
	if err := p.DeleteSnapshot("s1"); err != nil {
		t.Fatalf("delete of a snapshot that is gone: %v", err)
	}
	if ss, err := p.Snapshots(); err != nil || len(ss) != 0 {
		t.Fatalf("snapshots after delete: %v, %v", ss, err)
	}
	if got := readDev(t, c.Path, 1<<20, len(first)); !bytes.Equal(got, first) {
		t.Fatal("the clone lost its data with its snapshot")
	}
	wantLVs(t, vg, "thin", "rnbd.v.v0", "rnbd.v.c1", "rnbd.v.c2")
}

// Over what the pool can promise is ENOSPC and makes nothing; a full
// thin pool refuses volumes, growth and snapshots naming what is full,
// and takes them again once space is freed.
func TestLVMCapacityAndFull(t *testing.T) {
	vg := lvmTestPool(t, 64)
	p := openLVMTest(t, vg)
	_, _, err := p.Create(Spec{Name: "big", Size: (64 << 20) + 4096})
	wantErrno(t, "over the pool", err, syscall.ENOSPC)
	wantLVs(t, vg, "thin")
	v, _, err := p.Create(Spec{Name: "big", Size: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	c, err := p.Capacity()
	if err != nil || c.Total != 64<<20 || c.Promised != 64<<20 || c.Allocatable != 0 || c.MetadataUsed <= 0 || c.MetadataUsed > c.MetadataSize {
		t.Fatalf("capacity %+v, %v", c, err)
	}
	_, _, err = p.Create(Spec{Name: "more", Size: 4096})
	wantErrno(t, "nothing allocatable", err, syscall.ENOSPC)
	_, err = p.Resize("big", (64<<20)+(4<<20))
	wantErrno(t, "growth past the pool", err, syscall.ENOSPC)
	// 62 MiB written: over the high-water mark.
	f, err := os.OpenFile(v.Path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	chunk := bytes.Repeat([]byte{0xa5}, 1<<20)
	for i := range 62 {
		if _, err := f.WriteAt(chunk, int64(i)<<20); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	c, err = p.Capacity()
	if err != nil || c.Used < 62<<20 || c.Promised > 2<<20 {
		t.Fatalf("capacity after the writes: %+v, %v", c, err)
	}
	_, _, err = p.Create(Spec{Name: "more", Size: 4096})
	wantErrno(t, "a full pool", err, syscall.ENOSPC)
	if !strings.Contains(err.Error(), "full: data") {
		t.Fatalf("the refusal does not say the data is full: %v", err)
	}
	_, err = p.Resize("big", (64<<20)+(4<<20))
	wantErrno(t, "growth in a full pool", err, syscall.ENOSPC)
	_, _, err = p.CreateSnapshot("big", "s", nil)
	wantErrno(t, "a snapshot in a full pool", err, syscall.ENOSPC)
	if !strings.Contains(err.Error(), "full: data") {
		t.Fatalf("the refusal does not say the data is full: %v", err)
	}
	wantLVs(t, vg, "thin", "rnbd.v.big")
	if err := p.Delete("big"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := p.Create(Spec{Name: "more", Size: 4096}); err != nil {
		t.Fatalf("after space is freed: %v", err)
	}
}

// A clone a crash left between its lvcreate and its lvextend (tagged
// incomplete) is not a volume; open removes it, and so does a retry.
func TestLVMHalfMadeClone(t *testing.T) {
	vg := lvmTestPool(t, 64)
	p := openLVMTest(t, vg)
	if _, _, err := p.Create(Spec{Name: "v", Size: 4 << 20}); err != nil {
		t.Fatal(err)
	}
	half := func(name string) {
		tags, err := encodeTags(lvmMeta{Kind: kindVolume, Name: name, Pool: "thin", Size: 8 << 20, Source: "v", Created: time.Now().UTC()})
		if err != nil {
			t.Fatal(err)
		}
		args := []string{"-q", "-y", "-s", "-kn", "-n", "rnbd.v." + name}
		args = append(append(args, tagArgs("--addtag", append(tags, tagIncomplete))...), vg+"/rnbd.v.v")
		run(t, "lvcreate", args...)
	}
	half("c")
	_, err := p.Get("c")
	wantErrno(t, "a half-made clone", err, syscall.ENOENT)
	if vs, _ := p.List(); len(vs) != 1 {
		t.Fatalf("list shows a half-made clone: %v", vs)
	}
	_, removed, err := OpenLVMThin("thin", vg, "thin")
	if err != nil || len(removed) != 1 || !strings.Contains(removed[0], "rnbd.v.c") {
		t.Fatalf("open: removed %v, %v", removed, err)
	}
	wantLVs(t, vg, "thin", "rnbd.v.v")
	half("c")
	c, created, err := p.Create(Spec{Name: "c", Size: 8 << 20, From: "v"})
	if err != nil || !created || devSize(t, c.Path) != 8<<20 {
		t.Fatalf("retry over a half-made clone: %+v, %v, %v", c, created, err)
	}
	if tags := lvsOf(t, vg)["rnbd.v.c"].Tags; strings.Contains(strings.Join(tags, ","), tagIncomplete) {
		t.Fatalf("left incomplete: %v", tags)
	}
	// Deleting what a crash left half-made removes it too.
	half("d")
	if err := p.Delete("d"); err != nil {
		t.Fatal(err)
	}
	wantLVs(t, vg, "thin", "rnbd.v.v", "rnbd.v.c")
}

// An inactive volume (a node restarted without activating it) is
// activated by Get: its Path is a device.
func TestLVMGetActivates(t *testing.T) {
	vg := lvmTestPool(t, 32)
	p := openLVMTest(t, vg)
	v, _, err := p.Create(Spec{Name: "a", Size: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	run(t, "lvchange", "-an", vg+"/rnbd.v.a")
	if _, err := os.Stat(v.Path); err == nil {
		t.Fatalf("%s still there after lvchange -an", v.Path)
	}
	if got, err := p.Get("a"); err != nil || devSize(t, got.Path) != 4<<20 {
		t.Fatalf("get: %+v, %v", got, err)
	}
}
