package serverd

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/rnbd/rnbd/pkg/rnbd"
)

// unitMountinfo is part of what rnbd-server's packaged unit saw in
// scripts/test-deb-systemd.sh's container (systemd 252): / read-only on a
// writable ext4 (ProtectSystem=strict), /srv/rnbd and the state
// directory writable, /tmp and /var/tmp PrivateTmp= directories.
const unitMountinfo = `273 234 254:0 /var/tmp/rnbd-nspawn.gDCjH1 / ro,nosuid,relatime shared:59 master:2 - ext4 /dev/vda rw,discard
274 273 0:39 / /tmp rw,nosuid,nodev shared:75 master:3 - tmpfs tmpfs rw,size=2468412k,nr_inodes=409600
293 273 0:42 / /run rw,nosuid,nodev shared:98 master:7 - tmpfs tmpfs rw,size=4936820k,nr_inodes=819200,mode=755
301 293 0:42 /rnbd /run/rnbd rw,nosuid,nodev shared:106 master:7 - tmpfs tmpfs rw,size=4936820k,nr_inodes=819200,mode=755
313 273 254:0 /var/tmp/rnbd-nspawn.gDCjH1/srv/rnbd /srv/rnbd rw,nosuid,relatime shared:119 master:2 - ext4 /dev/vda rw,discard
317 274 0:39 /systemd-private-08f86c551b874d6981e1808da7c6adf4-rnbd-server.service-DsRMNh/tmp /tmp rw,nosuid,nodev shared:76 master:3 - tmpfs tmpfs rw,size=2468412k
318 273 254:0 /var/tmp/rnbd-nspawn.gDCjH1/var/lib/rnbd /var/lib/rnbd rw,nosuid,relatime shared:120 master:2 - ext4 /dev/vda rw,discard
321 273 8:17 / /mnt/archive\040disks ro,relatime shared:121 - ext4 /dev/sdb1 ro
421 273 254:0 /var/tmp/rnbd-nspawn.gDCjH1/var/tmp/systemd-private-08f86c551b874d6981e1808da7c6adf4-rnbd-server.service-21uLhn/tmp /var/tmp rw,nosuid,relatime shared:160 master:2 - ext4 /dev/vda rw,discard
`

// hostMountinfo is a host's: no sandbox, /tmp a tmpfs of its own.
const hostMountinfo = `22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard
30 27 0:30 / /tmp rw,nosuid,nodev shared:5 - tmpfs tmpfs rw
31 27 254:0 /srv/images /var/lib/images ro,relatime shared:1 - ext4 /dev/vda rw,discard
`

const unitCgroup = "9:name=systemd:/system.slice/rnbd-server.service\n8:pids:/\n0::/system.slice/rnbd-server.service\n"

// testView writes a mountinfo and a cgroup file for a view.
func testView(t *testing.T, mountinfo, cgroup string) view {
	t.Helper()
	dir := t.TempDir()
	v := view{mountinfo: filepath.Join(dir, "mountinfo"), cgroup: filepath.Join(dir, "cgroup")}
	if err := os.WriteFile(v.mountinfo, []byte(mountinfo), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(v.cgroup, []byte(cgroup), 0o644); err != nil {
		t.Fatal(err)
	}
	return v
}

// TestViewReadOnly: a read-write export of a regular file the daemon
// sees read-only is refused with EROFS, saying why from the mount it is
// on — the unit's sandbox (naming the unit and the drop-in's
// ReadWritePaths= for the file's directory), a file system mounted
// read-only, a read-only mount of a writable one — and that --ro exports
// it. A read-only export, a writable file and a path that did not stat
// are not its business.
func TestViewReadOnly(t *testing.T) {
	unit := testView(t, unitMountinfo, unitCgroup)
	host := testView(t, hostMountinfo, "0::/user.slice/session-3.scope\n")
	rw := rnbd.Export{Name: "out", Path: "/var/lib/rnbd-images/out.img"}
	roFile := probed{readOnly: true}
	for _, c := range []struct {
		what string
		v    view
		e    rnbd.Export
		want []string
	}{
		{"under the unit", unit, rw, []string{"export out: /var/lib/rnbd-images/out.img is on a file system that rnbd-server.service sees read-only",
			"ProtectSystem=", "(systemctl edit rnbd-server.service: [Service] ReadWritePaths=/var/lib/rnbd-images) and restart the unit",
			"export it read-only (--ro)"}},
		{"a read-only file system under the unit", unit, rnbd.Export{Name: "a", Path: "/mnt/archive disks/a.img"},
			[]string{"mounted read-only (/dev/sdb1 on /mnt/archive disks)", "remount it read-write", "--ro"}},
		{"a read-only bind mount", host, rnbd.Export{Name: "img", Path: "/var/lib/images/x.img"},
			[]string{"read-only mount (on /var/lib/images) of a file system that is writable", "--ro"}},
		{"no mount table", view{mountinfo: "/nonexistent", cgroup: "/nonexistent"}, rw,
			[]string{"file system this daemon sees read-only", "--ro"}},
	} {
		err := c.v.readOnly(c.e, roFile)
		if !errors.Is(err, syscall.EROFS) {
			t.Fatalf("%s: %v, want EROFS", c.what, err)
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %q does not say %q", c.what, err, w)
			}
		}
		if c.v != unit && strings.Contains(err.Error(), "systemctl") {
			t.Errorf("%s: %q names a unit, and there is none", c.what, err)
		}
	}
	for _, c := range []struct {
		what string
		e    rnbd.Export
		p    probed
	}{
		{"a read-only export", rnbd.Export{Name: "out", Path: rw.Path, ReadOnly: true}, roFile},
		{"a writable file", rw, probed{}},
		{"a path that did not stat", rw, probed{err: fs.ErrNotExist, readOnly: true}},
		{"a relative path", rnbd.Export{Name: "out", Path: "out.img"}, roFile},
	} {
		if err := unit.readOnly(c.e, c.p); err != nil {
			t.Errorf("%s: %v", c.what, err)
		}
	}
}

// TestViewMissing: "no such file or directory" for a path under /tmp or
// /var/tmp, where the daemon's own is a PrivateTmp= directory, says so
// (and stays ENOENT); elsewhere, with the host's /tmp, or for another
// error, the error is as it was.
func TestViewMissing(t *testing.T) {
	unit := testView(t, unitMountinfo, unitCgroup)
	host := testView(t, hostMountinfo, "0::/\n")
	enoent := func(p string) error {
		return fmt.Errorf("export x: %w", &fs.PathError{Op: "stat", Path: p, Err: syscall.ENOENT})
	}
	for _, tmp := range []string{"/var/tmp", "/tmp"} {
		err := unit.missing(tmp+"/disk0.img", enoent(tmp+"/disk0.img"))
		if !errors.Is(err, syscall.ENOENT) {
			t.Fatalf("%s: %v, want ENOENT", tmp, err)
		}
		for _, w := range []string{"stat " + tmp + "/disk0.img: no such file or directory; rnbd-server.service has a " + tmp +
			" of its own (PrivateTmp=yes), not the host's", "/srv/rnbd", "ReadWritePaths="} {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %q does not say %q", tmp, err, w)
			}
		}
	}
	for _, c := range []struct {
		what string
		v    view
		path string
		err  error
	}{
		{"outside /tmp", unit, "/srv/rnbd/disk0.img", enoent("/srv/rnbd/disk0.img")},
		{"a name that only starts as /tmp", unit, "/tmpfoo/disk0.img", enoent("/tmpfoo/disk0.img")},
		{"another error", unit, "/var/tmp/disk0.img", fmt.Errorf("export x: %w", syscall.EACCES)},
		{"the host's /tmp", host, "/tmp/disk0.img", enoent("/tmp/disk0.img")},
		{"the host's /var/tmp", host, "/var/tmp/disk0.img", enoent("/var/tmp/disk0.img")},
	} {
		if got := c.v.missing(c.path, c.err); got != c.err {
			t.Errorf("%s: %v, want the error as it was", c.what, got)
		}
	}
}
