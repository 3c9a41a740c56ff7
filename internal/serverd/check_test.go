package serverd

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rnbd/rnbd/internal/certs"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/ibverbs"
)

// notLocal is an address of the documentation networks this host does
// not have.
func notLocal(t *testing.T) string {
	t.Helper()
	for _, a := range []string{"203.0.113.77", "198.51.100.77", "192.0.2.77"} {
		if l, err := net.Listen("tcp", a+":0"); err == nil {
			l.Close()
			continue
		}
		return a
	}
	t.Skip("this host has every address of the documentation networks")
	return ""
}

// TestCheckAll: config check finds, on this host and at once, every
// address the daemon could not listen on (fabric, metrics, admin), an
// rdma:// address without an RDMA device, and, as warnings it starts
// with, pools and exports that are not there and a certificate a client
// would refuse as a server's; addresses of this host, a running daemon's
// port and every interface's addresses are fine.
func TestCheckAll(t *testing.T) {
	dir := t.TempDir()
	bad := notLocal(t)
	ca, err := certs.NewCA("test CA", 0)
	if err != nil {
		t.Fatal(err)
	}
	pki := filepath.Join(dir, "pki")
	if _, err := certs.WriteCA(ca, pki, filepath.Join(dir, "ca.key"), false); err != nil {
		t.Fatal(err)
	}
	cert, key, _ := ca.Issue(certs.Request{Kind: certs.KindClient, Name: "ops"})
	cp, kp, err := certs.WriteCert(pki, "ops", cert, key, false)
	if err != nil {
		t.Fatal(err)
	}
	// A port in use: the daemon, running while its file is checked.
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	rdmaWant := !ibverbs.Supported
	if devs, _ := ibverbs.Devices(); len(devs) == 0 {
		rdmaWant = true
	}
	file := filepath.Join(dir, "server.toml")
	text := fmt.Sprintf(`listen = ["tcp://%[1]s", "rdma://%[1]s:1234", "tcp://[::]:1234", "rdma://0.0.0.0", "%[2]s", "rdma://127.0.0.1:1234"]
metrics_listen = "%[1]s:9724"
[tls]
cert = %[3]q
key = %[4]q
ca = %[5]q
[admin]
listen = ["%[1]s", "127.0.0.1:0"]
admins = ["ops"]
[[pool]]
name = "gone"
type = "dir"
path = %[6]q
[[pool]]
name = "here"
type = "dir"
path = %[7]q
[[export]]
name = "e1"
path = %[8]q
`, bad, "tcp://"+busy.Addr().String(), cp, kp, filepath.Join(pki, "ca.crt"), filepath.Join(dir, "none"), dir, filepath.Join(dir, "none.img"))
	if err := os.WriteFile(file, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	_, f := CheckAll(file, true)
	var got []string
	for _, err := range f.Errors {
		got = append(got, err.Error())
	}
	want := []string{
		"listen tcp://" + bad + ": " + bad + " is not an address of this host",
		"listen rdma://" + bad + ":1234: " + bad + " is not an address of this host",
		"metrics_listen " + bad + ":9724: " + bad + " is not an address of this host",
		"[admin] listen " + bad + ": " + bad + " is not an address of this host",
	}
	if rdmaWant {
		want = append(want, "listen rdma://127.0.0.1:1234: ")
	}
	if len(got) != len(want) {
		t.Errorf("errors:\n%s\nwant %d", strings.Join(got, "\n"), len(want))
	}
	for _, w := range want {
		found := false
		for _, g := range got {
			found = found || strings.Contains(g, "config "+file+": "+w)
		}
		if !found {
			t.Errorf("no error says %q:\n%s", w, strings.Join(got, "\n"))
		}
	}
	for _, err := range f.Errors {
		if strings.Contains(err.Error(), "not an address") && (ctl.Classify(err) != ctl.CodeInvalid || !strings.Contains(err.Error(), "(its addresses: ")) {
			t.Errorf("%v: class %s, want invalid_argument naming this host's addresses", err, ctl.Classify(err))
		}
		if strings.Contains(err.Error(), "rdma://127.0.0.1") && ctl.Classify(err) != ctl.CodeNotSupported {
			t.Errorf("%v: class %s, want not_supported", err, ctl.Classify(err))
		}
	}
	warns := strings.Join(f.Warnings, "\n")
	for _, w := range []string{
		"tls: cert " + cp + " has no serverAuth extended key usage (it has clientAuth): peers refuse it as a server's",
		"[[pool]] gone: stat " + filepath.Join(dir, "none") + ": no such file or directory: the daemon starts without this pool",
		"[[export]] e1: stat " + filepath.Join(dir, "none.img") + ": no such file or directory: the daemon starts without it",
	} {
		if !strings.Contains(warns, w) {
			t.Errorf("no warning says %q:\n%s", w, warns)
		}
	}
	if len(f.Warnings) != 3 {
		t.Errorf("%d warnings, want 3:\n%s", len(f.Warnings), warns)
	}
}

// TestCheckAllMountpoint: a dir pool with mountpoint = true whose
// directory is not a mount point is a warning; one that is (/) is not.
func TestCheckAllMountpoint(t *testing.T) {
	if w := checkPool(PoolConfig{Name: "p", Type: "dir", Path: t.TempDir(), Mountpoint: true}); !strings.Contains(w, "is not a mount point (mountpoint = true)") {
		t.Errorf("a directory that is not a mount point: %q", w)
	}
	if w := checkPool(PoolConfig{Name: "p", Type: "dir", Path: "/", Mountpoint: true}); w != "" {
		t.Errorf("/: %q", w)
	}
	f, err := os.CreateTemp(t.TempDir(), "file")
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if w := checkPool(PoolConfig{Name: "p", Type: "dir", Path: f.Name()}); !strings.Contains(w, "is not a directory") {
		t.Errorf("a file: %q", w)
	}
	bin := t.TempDir()
	t.Setenv("PATH", bin)
	lvm := PoolConfig{Name: "p", Type: "lvm-thin", VolumeGroup: "vg", ThinPool: "tp"}
	if w := checkPool(lvm); !strings.Contains(w, "not checked: lvm2's tools (lvs) are not installed") {
		t.Errorf("lvm-thin without lvs: %q", w)
	}
	// lvs as lvm2's answers it: a thin pool, another LV, no such VG.
	lvs := `#!/bin/sh
case "$4" in
vg/tp) echo "  thin-pool" ;;
vg/lv) echo "  linear" ;;
*) echo "  Volume group \"novg\" not found" >&2; exit 5 ;;
esac
`
	if err := os.WriteFile(filepath.Join(bin, "lvs"), []byte(lvs), 0o755); err != nil {
		t.Fatal(err)
	}
	if w := checkPool(lvm); w != "" {
		t.Errorf("a thin pool: %q", w)
	}
	lvm.ThinPool = "lv"
	if w := checkPool(lvm); !strings.Contains(w, `vg/lv is not a thin pool (lvs says "linear")`) {
		t.Errorf("a linear LV: %q", w)
	}
	lvm.VolumeGroup, lvm.ThinPool = "novg", "tp"
	if w := checkPool(lvm); !strings.Contains(w, `lvs novg/tp: exit status 5: Volume group "novg" not found: the daemon starts without this pool`) {
		t.Errorf("no volume group: %q", w)
	}
}
