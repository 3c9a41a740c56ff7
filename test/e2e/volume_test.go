package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/serverd"
	"github.com/rnbd/rnbd/test/kit"
	"github.com/rnbd/rnbd/test/testfs"
)

// poolConf is a [[pool]] table of a directory pool.
func poolConf(name, dir string) string {
	return fmt.Sprintf("\n[[pool]]\nname = %q\ntype = \"dir\"\npath = %q\n", name, dir)
}

// mapExport maps export name on the client as session sess and returns
// the NBD URI it is served on.
func mapExport(t *testing.T, cl *clientDaemon, port int, sess, name string) string {
	t.Helper()
	out := cl.ok("map", "--sessname", sess, "--path", "ip:127.0.0.1", "--device-path", name, "--dest-port", fmt.Sprint(port))
	_, uri, ok := strings.Cut(strings.TrimSpace(out), " mapped: ")
	if !ok {
		t.Fatalf("map output %q", out)
	}
	return uri
}

// poolFiles are the files of a directory pool, hidden ones with their
// contents ("dir/" for a directory, then its files).
func poolFiles(t *testing.T, dir string) []string {
	t.Helper()
	var names []string
	err := filepath.WalkDir(dir, func(p string, e os.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if e.IsDir() {
			rel += "/"
		}
		names = append(names, rel)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// savedVolumes are the volumes of a server's state file. The file is
// of version 2 with volumes, 1 (what the daemons before volumes read)
// without.
func savedVolumes(t *testing.T, srv *serverDaemon) []serverd.VolumeState {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(srv.dir, "state.json"))
	if err != nil {
		t.Fatal(err)
	}
	var st serverd.State
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	if want := min(len(st.Volumes), 1) + 1; st.Version != want {
		t.Fatalf("a state file of %d volumes is of version %d, want %d", len(st.Volumes), st.Version, want)
	}
	return st.Volumes
}

// TestVolumes: every volume operation on a directory pool (XFS, for
// reflinks), against the real daemons. Bad input makes nothing; create
// is idempotent by name and a conflicting one says what differs; a
// snapshot keeps the data of its moment and a clone of it has that
// data; a volume grown while a client writes and verifies under fio
// shows the client its new size; delete is busy while a session has it
// open, forced closes it, and a volume that is gone deletes again.
func TestVolumes(t *testing.T) {
	needTools(t, "qemu-io", "nbdinfo", "fio")
	pool := testfs.ReflinkDir(t)
	dir := t.TempDir()
	port := freePort(t)
	srv := startServerConf(t, dir, port, poolConf("files", pool))

	// Bad input: each refused with its class, nothing made.
	for _, c := range []struct {
		code int
		msg  string
		args []string
	}{
		{2, `name "bad/name"`, []string{"volume", "create", "bad/name", "--pool", "files", "--size", "1MiB"}},
		{2, "want a positive multiple of 4096 bytes", []string{"volume", "create", "v", "--pool", "files", "--size", "4097"}},
		{3, "no pool nope (pools: files)", []string{"volume", "create", "v", "--pool", "nope", "--size", "1MiB"}},
		{9, "allocatable", []string{"volume", "create", "v", "--pool", "files", "--size", "1TiB"}},
		{3, "no volume nope", []string{"volume", "create", "v", "--pool", "files", "--size", "1MiB", "--from-volume", "nope"}},
		{2, "KEY=VALUE", []string{"volume", "create", "v", "--pool", "files", "--size", "1MiB", "--label", "novalue"}},
	} {
		if msg := srv.fails(c.code, c.args...); !strings.Contains(msg, c.msg) {
			t.Errorf("%v: %q, want it to say %q", c.args, msg, c.msg)
		}
	}
	if vs := srv.records("volume", "list"); len(vs) != 0 {
		t.Fatalf("refused creates made %v", vs)
	}
	if fs := poolFiles(t, pool); !slices.Equal(fs, []string{".rnbd-tmp/"}) {
		t.Fatalf("refused creates left %v in the pool", fs)
	}

	// Made, exported under its name; again the same: success; other
	// parameters: already_exists, saying what differs.
	if out := srv.ok("volume", "create", "v1", "--pool", "files", "--size", "64MiB", "--label", "team=db"); !strings.Contains(out, "created volume v1 (67108864 bytes) in pool files") {
		t.Fatalf("create: %q", out)
	}
	if out := srv.ok("volume", "create", "v1", "--pool", "files", "--size", "64MiB", "--label", "team=db"); !strings.Contains(out, "exists already, as asked") {
		t.Fatalf("create again: %q", out)
	}
	if msg := srv.fails(4, "volume", "create", "v1", "--pool", "files", "--size", "128MiB", "--label", "team=db"); !strings.Contains(msg, "size 67108864 (asked 134217728)") {
		t.Fatalf("a conflicting create: %q", msg)
	}
	if msg := srv.fails(4, "map", "v1", filepath.Join(pool, "v1.img")); !strings.Contains(msg, "a volume's") {
		t.Fatalf("map over a volume's name: %q", msg)
	}
	v := srv.records("volume", "show", "v1", "--fields", "all")
	if len(v) != 1 || v[0]["size"] != float64(64<<20) || v[0]["state"] != "served" || v[0]["pool"] != "files" ||
		v[0]["labels"].(map[string]any)["team"] != "db" || v[0]["path"] != filepath.Join(pool, "v1.img") {
		t.Fatalf("volume show: %v", v)
	}
	if e := srv.records("export", "show", "v1", "--fields", "all"); len(e) != 1 || e[0]["source"] != "volume" {
		t.Fatalf("export show: %v", e)
	}

	// Data written through a client; a snapshot; more written after it.
	cl := startClient(t, dir, "--size-poll", "200ms")
	uri := mapExport(t, cl, port, "s-v1", "v1")
	qemuIO(t, uri, "write -P 0x5a 0 1M", "flush")
	srv.ok("volume", "snapshot", "create", "v1", "snap1")
	if out := srv.ok("volume", "snapshot", "create", "v1", "snap1"); !strings.Contains(out, "exists already") {
		t.Fatalf("snapshot again: %q", out)
	}
	qemuIO(t, uri, "write -P 0xa5 0 1M", "flush")
	if s := srv.records("volume", "snapshot", "list", "--volume", "v1"); len(s) != 1 || s[0]["name"] != "snap1" || s[0]["size"] != float64(64<<20) {
		t.Fatalf("snapshot list: %v", s)
	}
	// Clones: of the snapshot, its data; of the volume, the data now.
	srv.ok("volume", "create", "c1", "--pool", "files", "--size", "64MiB", "--from-snapshot", "snap1")
	srv.ok("volume", "create", "c2", "--pool", "files", "--size", "64MiB", "--from-volume", "v1")
	// A clone without --size has its source's.
	srv.ok("volume", "create", "c3", "--pool", "files", "--from-snapshot", "snap1")
	if c := srv.records("volume", "show", "c3"); len(c) != 1 || c[0]["size"] != float64(64<<20) {
		t.Fatalf("a clone of a snapshot without --size: %v, want its 64 MiB", c)
	}
	if msg := srv.fails(2, "volume", "create", "c4", "--pool", "files"); !strings.Contains(msg, "--size") {
		t.Fatalf("a create of no size and no source: %q", msg)
	}
	srv.ok("volume", "delete", "c3")
	qemuIO(t, mapExport(t, cl, port, "s-c1", "c1"), "read -P 0x5a 0 1M")
	qemuIO(t, mapExport(t, cl, port, "s-c2", "c2"), "read -P 0xa5 0 1M")
	qemuIO(t, uri, "read -P 0xa5 0 1M")

	// Grown while fio writes and verifies: the client sees the new size,
	// fio ends without an error, and the grown part takes IO.
	fio := start(t, "fio", "--name=grow", "--ioengine=nbd", "--uri="+uri, "--rw=randwrite", "--bs=4k", "--iodepth=16",
		"--size=48m", "--time_based", "--runtime=6", "--rate_iops=2000", "--verify=crc32c", "--verify_backlog=1024",
		"--verify_fatal=1", "--verify_state_save=0", "--randrepeat=0", "--output-format=json")
	srv.waitWritten("v1", "s-v1", 1000) // grown while fio writes
	if out := srv.ok("volume", "resize", "v1", "--size", "128MiB"); !strings.Contains(out, "resized volume v1 from 67108864 to 134217728 bytes") {
		t.Fatalf("volume resize: %q", out)
	}
	kit.WaitFor(t, 20*time.Second, "the client to see 128 MiB", func() bool {
		return strings.TrimSpace(run(t, time.Minute, "nbdinfo", "--size", uri)) == fmt.Sprint(128<<20)
	})
	endFio(t, fio)
	qemuIO(t, uri, "write -P 0x77 127M 1M", "read -P 0x77 127M 1M")
	if msg := srv.fails(2, "volume", "resize", "v1", "--size", "64MiB"); !strings.Contains(msg, "grows only") {
		t.Fatalf("shrinking a volume: %q", msg)
	}
	if msg := srv.fails(2, "resize", "v1", "256MiB"); !strings.Contains(msg, "volume resize") {
		t.Fatalf("export resize of a volume: %q", msg)
	}
	// The size as create takes it; the export's form says so.
	if msg := srv.fails(2, "volume", "resize", "v1", "256MiB"); !strings.Contains(msg, "volume resize v1 --size 256MiB") {
		t.Fatalf("volume resize NAME SIZE: %q", msg)
	}

	// Delete: busy while open; forced, closed for its session; absent,
	// success. Nothing left: no file, no export, no state.
	if msg := srv.fails(5, "volume", "delete", "v1"); !strings.Contains(msg, "open") {
		t.Fatalf("delete of an open volume: %q", msg)
	}
	if msg := srv.fails(7, "unmap", "v1"); !strings.Contains(msg, "volume delete") {
		t.Fatalf("unmap of a volume: %q", msg)
	}
	srv.ok("volume", "delete", "v1", "--force")
	if out := srv.ok("volume", "delete", "v1"); !strings.Contains(out, "volume v1 was already absent") {
		t.Fatalf("the delete of a volume gone: %q, want it to say it was already absent", out)
	}
	if _, err := os.Stat(filepath.Join(pool, "v1.img")); !os.IsNotExist(err) {
		t.Fatalf("v1.img after delete: %v", err)
	}
	srv.fails(3, "export", "show", "v1")
	for _, vs := range savedVolumes(t, srv) {
		if vs.Name == "v1" {
			t.Fatalf("the state file keeps v1: %+v", vs)
		}
	}
	// The snapshot outlives its volume; deleted twice, success.
	srv.ok("volume", "snapshot", "delete", "snap1")
	srv.ok("volume", "snapshot", "delete", "snap1")
	if fs := poolFiles(t, pool); !slices.Equal(fs, []string{".rnbd-snap/", ".rnbd-tmp/", "c1.img", "c2.img"}) {
		t.Fatalf("pool files %v", fs)
	}
}

// TestVolumeCrashBetweenSteps: the daemon killed (SIGKILL) between any
// two steps of a create or a delete, then started again: the retry
// converges, and nothing is left over — no orphan file, export, grant
// or state.
func TestVolumeCrashBetweenSteps(t *testing.T) {
	for _, c := range []struct {
		point  string
		delete bool
	}{
		{"volume-create-intent", false},
		{"volume-create-made", false},
		{"volume-create-exported", false},
		{"volume-delete-unmapped", true},
		{"volume-delete-intent", true},
		{"volume-delete-deleted", true},
	} {
		t.Run(c.point, func(t *testing.T) {
			pool, dir := t.TempDir(), t.TempDir()
			port := freePort(t)
			conf := poolConf("files", pool)
			srv := startServerConf(t, dir, port, conf)
			create := []string{"volume", "create", "v", "--pool", "files", "--size", "16MiB"}
			if c.delete {
				srv.ok(create...)
				srv.ok("export", "grant", "v", "host7", "--access", "ro")
			}
			srv.stop()
			srv = startServerEnv(t, dir, port, conf, []string{serverd.CrashEnv + "=" + c.point})
			step := create
			if c.delete {
				step = []string{"volume", "delete", "v"}
			}
			if _, _, code := srv.ctl(step...); code == 0 {
				t.Fatalf("%v succeeded; the daemon was to die at %s", step, c.point)
			}
			var err error
			select {
			case err = <-srv.done:
				srv.done <- err
			case <-time.After(30 * time.Second):
				t.Fatalf("the daemon did not die at %s\n%s", c.point, srv.out.String())
			}
			if ws, ok := srv.cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
				t.Fatalf("the daemon ended with %v, want SIGKILL at %s\n%s", err, c.point, srv.out.String())
			}

			srv = startServerConf(t, dir, port, conf)
			srv.ok(step...)
			vols, exports := srv.records("volume", "list"), srv.records("export", "list")
			if c.delete {
				if len(vols) != 0 || len(exports) != 0 || len(savedVolumes(t, srv)) != 0 {
					t.Fatalf("after the delete's retry: volumes %v, exports %v, state %+v", vols, exports, savedVolumes(t, srv))
				}
				srv.fails(3, "export", "grants", "v")
				if fs := poolFiles(t, pool); !slices.Equal(fs, []string{".rnbd-tmp/"}) {
					t.Fatalf("pool files after the delete's retry: %v", fs)
				}
			} else {
				st := savedVolumes(t, srv)
				if len(vols) != 1 || vols[0]["state"] != "served" || len(exports) != 1 || len(st) != 1 || st[0].Intent != "" {
					t.Fatalf("after the create's retry: volumes %v, exports %v, state %+v", vols, exports, st)
				}
				if fs := poolFiles(t, pool); !slices.Equal(fs, []string{".rnbd-tmp/", "v.img"}) {
					t.Fatalf("pool files after the create's retry: %v", fs)
				}
			}
			// And the next restart finds the same.
			srv.stop()
			srv = startServerConf(t, dir, port, conf)
			if got := srv.records("volume", "list"); len(got) != len(vols) {
				t.Fatalf("after a restart: %v, before it %v", got, vols)
			}
		})
	}
}

// TestVolumeReconcile: at start the pool is the truth. A volume whose
// file was removed behind the server's back is listed as missing, not
// served, and logged; volume delete forgets it. A volume the pool has
// and the state file does not is adopted, logged, and exported with no
// grant: no client opens it until one is given.
func TestVolumeReconcile(t *testing.T) {
	pool, dir := t.TempDir(), t.TempDir()
	port := freePort(t)
	conf := poolConf("files", pool)
	srv := startServerConf(t, dir, port, conf)
	srv.ok("volume", "create", "gone", "--pool", "files", "--size", "1MiB")
	srv.ok("volume", "create", "kept", "--pool", "files", "--size", "1MiB")
	srv.ok("volume", "create", "stray", "--pool", "files", "--size", "1MiB")
	srv.stop()
	if err := os.Remove(filepath.Join(pool, "gone.img")); err != nil {
		t.Fatal(err)
	}
	// The state file loses stray, as if it had been made by another
	// server or the file restored from an older backup.
	state := filepath.Join(dir, "state.json")
	b, _ := os.ReadFile(state)
	var st map[string]any
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	vols := st["volumes"].([]any)
	st["volumes"] = slices.DeleteFunc(vols, func(v any) bool { return v.(map[string]any)["name"] == "stray" })
	b, _ = json.Marshal(st)
	if err := os.WriteFile(state, b, 0o600); err != nil {
		t.Fatal(err)
	}

	srv = startServerConf(t, dir, port, conf)
	byName := map[string]map[string]any{}
	for _, v := range srv.records("volume", "list", "--fields", "all") {
		byName[v["name"].(string)] = v
	}
	if g := byName["gone"]; g == nil || g["state"] != "not served" || !strings.Contains(g["reason"].(string), "missing from pool files") {
		t.Fatalf("gone: %v", g)
	}
	if k := byName["kept"]; k == nil || k["state"] != "served" || k["grants_only"] != false {
		t.Fatalf("kept: %v", k)
	}
	if s := byName["stray"]; s == nil || s["state"] != "served" || s["grants_only"] != true {
		t.Fatalf("stray: %v", s)
	}
	out := srv.out.String()
	for _, want := range []string{`msg="volume missing from its pool: not served (volume delete forgets it)"`, `volume=gone`,
		`msg="volume adopted: its pool has it and the state file did not; exported with no grant (give one to open it)"`, `volume=stray`} {
		if !strings.Contains(out, want) {
			t.Fatalf("the log does not say %s:\n%s", want, out)
		}
	}
	// The adopted volume opens to no client until granted.
	cl := startClient(t, dir)
	if _, errOut, code := cl.ctl("map", "--sessname", "s1", "--path", "ip:127.0.0.1", "--device-path", "stray", "--dest-port", fmt.Sprint(port)); code != 7 {
		t.Fatalf("map of an adopted volume without a grant: exit %d %q", code, errOut)
	}
	mapExport(t, cl, port, "s2", "kept")
	srv.ok("volume", "delete", "gone")
	if vs := srv.records("volume", "list"); len(vs) != 2 {
		t.Fatalf("after deleting the missing volume: %v", vs)
	}
	for _, vs := range savedVolumes(t, srv) {
		if vs.Name == "gone" {
			t.Fatalf("the state file keeps gone")
		}
	}

	// The pool leaves the configuration: its volumes are not served,
	// saying why, and volume delete forgets them, leaving their files.
	cl.stop()
	srv.stop()
	srv = startServerConf(t, dir, port, "")
	if k := srv.records("volume", "show", "kept", "--fields", "all"); k[0]["state"] != "not served" ||
		!strings.Contains(k[0]["reason"].(string), "not in the configuration") {
		t.Fatalf("a volume of a pool no longer configured: %v", k)
	}
	srv.ok("volume", "delete", "kept")
	if vs := srv.records("volume", "list"); len(vs) != 1 || vs[0]["name"] != "stray" {
		t.Fatalf("after forgetting kept: %v", vs)
	}
	if _, err := os.Stat(filepath.Join(pool, "kept.img")); err != nil {
		t.Fatalf("forgetting a volume of a pool not configured touched its file: %v", err)
	}
}

// TestVolumePoolLate: a pool whose directory is missing when the server
// starts is not served, nor are its volumes; when the directory is back
// the server serves it without a restart (export_retry), and a client
// opens its volume and its data is there.
func TestVolumePoolLate(t *testing.T) {
	needTools(t, "qemu-io")
	base, dir := t.TempDir(), t.TempDir()
	pool := filepath.Join(base, "pool")
	if err := os.Mkdir(pool, 0o755); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	conf := "export_retry = \"200ms\"\n" + poolConf("files", pool)
	srv := startServerConf(t, dir, port, conf)
	srv.ok("volume", "create", "v1", "--pool", "files", "--size", "16MiB")
	cl := startClient(t, dir)
	qemuIO(t, mapExport(t, cl, port, "s1", "v1"), "write -P 0x3c 0 1M", "flush")
	cl.stop()
	srv.stop()

	away := filepath.Join(base, "away")
	if err := os.Rename(pool, away); err != nil {
		t.Fatal(err)
	}
	srv = startServerConf(t, dir, port, conf)
	if p := srv.records("pool", "list", "--fields", "all"); len(p) != 1 || p[0]["state"] != "not served" {
		t.Fatalf("pool list with the pool's directory missing: %v", p)
	}
	if v := srv.records("volume", "show", "v1", "--fields", "all"); v[0]["state"] != "not served" ||
		!strings.Contains(v[0]["reason"].(string), "pool files is not served") {
		t.Fatalf("v1 with its pool's directory missing: %v", v)
	}
	if err := os.Rename(away, pool); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 20*time.Second, "the pool served", func() bool {
		p := srv.records("pool", "list", "--fields", "all")
		return len(p) == 1 && p[0]["state"] == "served"
	})
	if v := srv.records("volume", "show", "v1", "--fields", "all"); v[0]["state"] != "served" {
		t.Fatalf("v1 once its pool is served: %v", v)
	}
	if out := srv.out.String(); !strings.Contains(out, `msg="pool served now"`) {
		t.Fatalf("the log does not say the pool is served now:\n%s", out)
	}
	cl = startClient(t, t.TempDir()) // a client of its own: not one that restores s1
	qemuIO(t, mapExport(t, cl, port, "s2", "v1"), "read -P 0x3c 0 1M")
}

// TestGrants: grants given and revoked one at a time on an export,
// without touching the others, idempotent, kept in the state file
// across a restart; the last one revoked closes the export (grants
// only); the configuration file's exports are changed there.
func TestGrants(t *testing.T) {
	dir := t.TempDir()
	port := freePort(t)
	img := filepath.Join(dir, "a.img")
	kit.SparseFile(t, img, 1<<20)
	conf := fmt.Sprintf("\n[[export]]\nname = \"fixed\"\npath = %q\n", img)
	srv := startServerConf(t, dir, port, conf)
	srv.ok("map", "a", img, "--allow-identity", "old=ro")
	grants := func() map[string]any {
		m := map[string]any{}
		for _, g := range srv.records("export", "grants", "a") {
			m[g["identity"].(string)] = g["access"]
		}
		return m
	}
	srv.ok("export", "grant", "a", "host7")
	srv.ok("export", "grant", "a", "host7") // again: nothing changes
	srv.ok("export", "grant", "a", "host8", "--access", "ro")
	if g := grants(); len(g) != 3 || g["old"] != "ro" || g["host7"] != "rw" || g["host8"] != "ro" {
		t.Fatalf("grants %v", g)
	}
	srv.fails(2, "export", "grant", "a", "host9", "--access", "all")
	srv.fails(3, "export", "grant", "nope", "host9")
	if msg := srv.fails(7, "export", "grant", "fixed", "host9"); !strings.Contains(msg, "configuration file") {
		t.Fatalf("a grant on the configuration's export: %q", msg)
	}
	srv.ok("export", "revoke", "a", "old")
	srv.ok("export", "revoke", "a", "old") // gone: success

	// Kept across a restart, as given.
	srv.stop()
	srv = startServerConf(t, dir, port, conf)
	if g := grants(); len(g) != 2 || g["host7"] != "rw" || g["host8"] != "ro" {
		t.Fatalf("grants after a restart %v", g)
	}
	srv.ok("export", "revoke", "a", "host7")
	srv.ok("export", "revoke", "a", "host8")
	e := srv.records("export", "show", "a", "--fields", "all")
	if len(e) != 1 || e[0]["grants_only"] != true || len(e[0]["allow_identities"].(map[string]any)) != 0 {
		t.Fatalf("the export with its last grant revoked: %v", e)
	}
	cl := startClient(t, dir)
	if _, errOut, code := cl.ctl("map", "--sessname", "s", "--path", "ip:127.0.0.1", "--device-path", "a", "--dest-port", fmt.Sprint(port)); code != 7 {
		t.Fatalf("map of an export with no grant left: exit %d %q", code, errOut)
	}
}
