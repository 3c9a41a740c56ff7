package clientd

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/test/kit"

	"time"

	"golang.org/x/sys/unix"

	"go.uber.org/goleak"

	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/fabrictest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// rig is an RNBD server on the in-memory fabric, serving files from a
// directory, and the configuration of a client daemon beside it.
type rig struct {
	t     *testing.T
	fab   fabric.Fabric
	dir   string // the server's dev_search_path
	addr  netip.AddrPort
	srv   *rnbd.Server
	rs    *rtrs.Server
	cfg   Config
	state string
}

func newRig(t *testing.T) *rig {
	t.Helper()
	r := &rig{t: t, fab: fabrictest.NewNetwork().Fabric(), dir: t.TempDir(),
		addr: netip.MustParseAddrPort("10.30.0.1:1234")}
	r.startServer()
	tmp := t.TempDir()
	r.cfg = DefaultConfig()
	r.cfg.ControlSocket = filepath.Join(tmp, "ctl.sock")
	r.cfg.StateFile = filepath.Join(tmp, "state.json")
	r.cfg.SocketDir = filepath.Join(tmp, "run")
	r.cfg.ConnsPerPath = 2
	r.cfg.NBDBuffers = 4
	return r
}

func (r *rig) startServer() {
	r.srv = rnbd.NewServer(rnbd.SrvConfig{DevSearchPath: r.dir, Log: log.Discard()})
	scfg := rtrs.DefaultSrvConfig()
	scfg.Fabric, scfg.Handler, scfg.Listen, scfg.Log = r.fab, r.srv, []netip.AddrPort{r.addr}, log.Discard()
	scfg.QueueDepth = 64
	rs, err := rtrs.NewServer(scfg)
	if err != nil {
		r.t.Fatal(err)
	}
	r.rs = rs
	r.t.Cleanup(r.stopServer)
}

func (r *rig) stopServer() {
	r.rs.Close()
	r.srv.Close()
}

func (r *rig) file(name string, size int64) {
	r.t.Helper()
	if err := os.WriteFile(filepath.Join(r.dir, name), nil, 0o600); err != nil {
		r.t.Fatal(err)
	}
	if err := os.Truncate(filepath.Join(r.dir, name), size); err != nil {
		r.t.Fatal(err)
	}
}

func (r *rig) start() *Daemon {
	r.t.Helper()
	d, err := Start(r.cfg, Options{Fabric: r.fab, Log: log.Discard()})
	if err != nil {
		r.t.Fatal(err)
	}
	return d
}

func (r *rig) mapping(sess, dev string) api.Mapping {
	return api.Mapping{SessName: sess, Paths: []string{"ip:10.30.0.2@ip:10.30.0.1"}, DevicePath: dev}
}

func (r *rig) savedState() State {
	r.t.Helper()
	b, err := os.ReadFile(r.cfg.StateFile)
	if err != nil {
		r.t.Fatal(err)
	}
	var st State
	if err := json.Unmarshal(b, &st); err != nil {
		r.t.Fatal(err)
	}
	return st
}

// rw writes a pattern through the mapping's device and reads it back.
func rw(t *testing.T, d *Daemon, device string, off int64, fill byte) {
	t.Helper()
	m, err := d.find(device, "test")
	if err != nil {
		t.Fatal(err)
	}
	buf, err := m.dev.Session().Session().AllocBuffer(8192)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	want := bytes.Repeat([]byte{fill}, 4096)
	copy(buf.Bytes(), want)
	if err := m.dev.Do(context.Background(), rnbd.OpWrite, rnbd.FFUA, off, 4096, buf, 0); err != nil {
		t.Fatalf("write: %v", err)
	}
	if err := m.dev.Do(context.Background(), rnbd.OpRead, 0, off, 4096, buf, 4096); err != nil {
		t.Fatalf("read: %v", err)
	}
	if !bytes.Equal(buf.Bytes()[4096:], want) {
		t.Fatal("read back differs")
	}
}

// A map goes session → device → frontend → register: devices of one
// session share it, the socket is where the mapping says, the state file
// holds what a restart needs, and unmapping the last device closes the
// session.
func TestMapShareUnmap(t *testing.T) {
	r := newRig(t)
	r.file("a", 1<<20)
	r.file("b", 2<<20)
	d := r.start()
	defer d.Stop()
	ctx := context.Background()
	a, err := d.Map(ctx, r.mapping("s1", "a"))
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(r.cfg.SocketDir, "rnbd0.sock")
	if a.Device != "rnbd0" || a.As != "socket:"+sock || a.AccessMode != "rw" || a.DestPort != rtrs.DefaultPort ||
		a.Transport != "tcp" || len(a.SessUUID) != 32 || a.Kernel != "" {
		t.Fatalf("mapping %+v", a)
	}
	if st, err := os.Stat(sock); err != nil || st.Mode()&os.ModeSocket == 0 || st.Mode().Perm() != 0o600 {
		t.Fatalf("socket %s: %v %v", sock, st, err)
	}
	b, err := d.Map(ctx, r.mapping("s1", "b"))
	if err != nil {
		t.Fatal(err)
	}
	if b.Device != "rnbd1" || b.SessUUID != a.SessUUID {
		t.Fatalf("second mapping %+v", b)
	}
	if n := len(d.sessionList()); n != 1 {
		t.Fatalf("%d sessions for two devices of one session", n)
	}
	rw(t, d, "rnbd0", 0, 0xa1)
	rw(t, d, "rnbd1", 1<<20, 0xb2)
	recs := d.deviceRecords("")
	if len(recs) != 2 || recs[0].DevPath != sock || recs[0].IOMode != "nbd-socket" ||
		recs[0].Size != int64(1<<20) || recs[1].Size != int64(2<<20) || recs[0].State != "open" {
		t.Fatalf("device records %v", recs)
	}
	if st := r.savedState(); len(st.Mappings) != 2 || st.Mappings[0].Device != "rnbd0" || st.Mappings[0].SessUUID != a.SessUUID ||
		st.Mappings[0].As != a.As || st.Mappings[1].DevicePath != "b" {
		t.Fatalf("state %+v", st)
	}
	if err := d.Unmap(ctx, "rnbd0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("socket after unmap: %v", err)
	}
	if n := len(d.sessionList()); n != 1 {
		t.Fatalf("%d sessions with one device left", n)
	}
	if err := d.Unmap(ctx, "rnbd1", false); err != nil {
		t.Fatal(err)
	}
	if n := len(d.sessionList()); n != 0 {
		t.Fatalf("%d sessions with no device", n)
	}
	kit.WaitFor(t, 10*time.Second, "the server to drop the session", func() bool { return len(r.rs.Sessions()) == 0 })
	if st := r.savedState(); len(st.Mappings) != 0 {
		t.Fatalf("state after unmapping all %+v", st)
	}
	if err := d.Unmap(ctx, "rnbd0", false); ctl.Classify(err) != ctl.CodeNotFound {
		t.Fatalf("unmap of an unknown device: %v", err)
	}
}

// Bad requests are refused with the right code before anything is dialled.
func TestMapRefusals(t *testing.T) {
	r := newRig(t)
	r.file("a", 1<<20)
	d := r.start()
	defer d.Stop()
	ctx := context.Background()
	if _, err := d.Map(ctx, r.mapping("s1", "a")); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(filepath.Join(r.dir, "fifo"), 0o600); err != nil {
		t.Fatal(err)
	}
	r.file("b", 1<<20)
	keep := filepath.Join(r.cfg.SocketDir, "keep")
	if err := os.WriteFile(keep, []byte("precious"), 0o600); err != nil {
		t.Fatal(err)
	}
	with := func(f func(*api.Mapping)) api.Mapping {
		m := r.mapping("s1", "a")
		f(&m)
		return m
	}
	for name, c := range map[string]struct {
		m    api.Mapping
		code ctl.Code
	}{
		"no sessname":       {with(func(m *api.Mapping) { m.SessName = "" }), ctl.CodeInvalid},
		"bad sessname":      {with(func(m *api.Mapping) { m.SessName = "a/b" }), ctl.CodeInvalid},
		"no path":           {with(func(m *api.Mapping) { m.Paths = nil }), ctl.CodeInvalid},
		"bad path":          {with(func(m *api.Mapping) { m.Paths = []string{"ip:nowhere"} }), ctl.CodeInvalid},
		"bad access mode":   {with(func(m *api.Mapping) { m.AccessMode = "rwx" }), ctl.CodeInvalid},
		"bad transport":     {with(func(m *api.Mapping) { m.Transport = "udp" }), ctl.CodeInvalid},
		"relative socket":   {with(func(m *api.Mapping) { m.As = "socket:x.sock" }), ctl.CodeInvalid},
		"unknown frontend":  {with(func(m *api.Mapping) { m.As = "iscsi" }), ctl.CodeInvalid},
		"mapped already":    {r.mapping("s1", "a"), ctl.CodeExists},
		"other paths":       {with(func(m *api.Mapping) { m.DevicePath = "b"; m.Paths = []string{"ip:10.30.0.3@ip:10.30.0.1"} }), ctl.CodeInvalid},
		"no such device":    {with(func(m *api.Mapping) { m.SessName = "s2"; m.DevicePath = "missing" }), ctl.CodeNotFound},
		"outside the files": {with(func(m *api.Mapping) { m.SessName = "s3"; m.DevicePath = "../a" }), ctl.CodeInvalid},
		// Opening a FIFO read-only would block the server until a
		// writer came.
		"a fifo": {with(func(m *api.Mapping) { m.SessName = "s4"; m.DevicePath = "fifo"; m.AccessMode = "ro" }), ctl.CodeInvalid},
		"a file at the socket's path": {with(func(m *api.Mapping) {
			m.SessName, m.DevicePath, m.As = "s5", "b", "socket:"+keep
		}), ctl.CodeExists},
	} {
		if _, err := d.Map(ctx, c.m); ctl.Classify(err) != c.code {
			t.Errorf("%s: %v (%s), want %s", name, err, ctl.Classify(err), c.code)
		}
	}
	if n := len(d.deviceRecords("")); n != 1 {
		t.Fatalf("%d devices after the refusals", n)
	}
	// A failed map leaves no session behind.
	if n := len(d.sessionList()); n != 1 {
		t.Fatalf("%d sessions after the refusals", n)
	}
	if st := r.savedState(); len(st.Mappings) != 1 {
		t.Fatalf("state after the refusals %+v", st)
	}
	if b, err := os.ReadFile(keep); err != nil || string(b) != "precious" {
		t.Fatalf("the file at the socket's path: %q %v", b, err)
	}
}

// A restart restores every mapping under its device name and session UUID;
// one that cannot come back stays in the state file and is tried again
// until its server answers (or it is unmapped); one whose entry is
// invalid waits for the operator.
func TestRestart(t *testing.T) {
	defer func(d time.Duration) { restoreRetryFirst = d }(restoreRetryFirst)
	restoreRetryFirst = 20 * time.Millisecond
	r := newRig(t)
	r.file("a", 1<<20)
	r.file("b", 1<<20)
	d := r.start()
	ctx := context.Background()
	a, err := d.Map(ctx, r.mapping("s1", "a"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Map(ctx, api.Mapping{SessName: "s2", Paths: []string{"ip:10.30.0.3@ip:10.30.0.1"}, DevicePath: "b",
		AccessMode: "ro", As: "socket:" + filepath.Join(r.cfg.SocketDir, "b.sock")}); err != nil {
		t.Fatal(err)
	}
	rw(t, d, "rnbd0", 8192, 0x5c)
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := d.Stop(); err != nil { // a second Stop does nothing
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the server to drop the sessions", func() bool { return len(r.rs.Sessions()) == 0 })

	d = r.start()
	recs := d.deviceRecords("")
	if len(recs) != 2 || recs[0].DevName != "rnbd0" || recs[1].DevName != "rnbd1" ||
		recs[1].AccessMode != "ro" || recs[1].Socket != filepath.Join(r.cfg.SocketDir, "b.sock") {
		t.Fatalf("devices after the restart %v", recs)
	}
	m, _ := d.find("rnbd0", "test")
	if m.SessUUID != a.SessUUID {
		t.Fatalf("session UUID %s after the restart, was %s", m.SessUUID, a.SessUUID)
	}
	rw(t, d, "rnbd0", 8192, 0x5d)
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}

	// Without the server, nothing comes back: the mappings stay saved,
	// are tried again, and unmapping one that failed only forgets it.
	r.stopServer()
	d = r.start()
	defer func() { d.Stop() }()
	for _, r := range d.deviceRecords("") {
		if r.State != StateRestoring {
			t.Fatalf("device restored without a server: %v", r)
		}
	}
	if n := len(d.deviceRecords("")); n != 2 {
		t.Fatalf("device list shows %d mappings not restored, want 2", n)
	}
	if st := r.savedState(); len(st.Mappings) != 2 {
		t.Fatalf("state after a failed restore %+v", st)
	}
	if err := d.Unmap(ctx, "rnbd1", false); err != nil {
		t.Fatal(err)
	}
	if st := r.savedState(); len(st.Mappings) != 1 || st.Mappings[0].Device != "rnbd0" {
		t.Fatalf("state after forgetting rnbd1 %+v", st)
	}
	// Settings given to the session meanwhile are kept for the mapping
	// being restored, and come back with it.
	pol := "round-robin"
	if err := d.keepSettings("s1", api.SetRequest{MPPolicy: &pol}); err != nil {
		t.Fatal(err)
	}
	if st := r.savedState(); st.Mappings[0].Settings.MPPolicy == nil || *st.Mappings[0].Settings.MPPolicy != pol {
		t.Fatalf("settings of a mapping being restored %+v", st.Mappings[0].Settings)
	}
	// The name of a mapping that did not come back is not given away.
	r.startServer()
	r.file("c", 1<<20)
	c, err := d.Map(ctx, r.mapping("s3", "c"))
	if err != nil || c.Device != "rnbd1" {
		t.Fatalf("map beside a failed mapping: %+v %v", c, err)
	}
	// With its server back, the retry restores rnbd0: its data is there.
	kit.WaitFor(t, 10*time.Second, "rnbd0 to be restored by a retry", func() bool {
		recs := d.deviceRecords("rnbd0")
		return len(recs) == 1 && recs[0].State != StateRestoring
	})
	rw(t, d, "rnbd0", 8192, 0x5d)
	if st := r.savedState(); len(st.Mappings) != 2 || st.Mappings[0].Settings.MPPolicy == nil || *st.Mappings[0].Settings.MPPolicy != pol {
		t.Fatalf("state after the retry %+v", st)
	}
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}

	// An entry of the state file that is wrong is not tried again.
	st := r.savedState()
	st.Mappings[0].AccessMode = "bogus"
	b, _ := json.Marshal(st)
	if err := os.WriteFile(r.cfg.StateFile, b, 0o600); err != nil {
		t.Fatal(err)
	}
	d = r.start()
	if recs := d.deviceRecords("rnbd0"); len(recs) != 1 || recs[0].State != StateNotRestored {
		t.Fatalf("an invalid entry: %v", recs)
	}
}

// normalize fills the defaults and types the request once.
func TestNormalize(t *testing.T) {
	s, err := normalize(api.Mapping{SessName: "s", Paths: []string{"ip:10.0.0.1", "ip:10.0.0.2@ip:10.0.1.1"}, DevicePath: "d",
		AccessMode: "migration", DestPort: 4000, Transport: "tcp", As: "socket:/run/x.sock"})
	if err != nil {
		t.Fatal(err)
	}
	if s.mode != rnbd.AccessMigration || len(s.paths) != 2 || s.paths[0].Dst != netip.MustParseAddrPort("10.0.0.1:4000") ||
		s.paths[1].Src.Addr() != netip.MustParseAddr("10.0.0.2") || s.fe != feSocket || s.sock != "/run/x.sock" {
		t.Fatalf("spec %+v", s)
	}
	s, err = normalize(api.Mapping{SessName: "s", Paths: []string{"ip:10.0.0.1"}, DevicePath: "d", As: "socket"})
	if err != nil || s.AccessMode != "rw" || s.mode != rnbd.AccessRW || s.DestPort != rtrs.DefaultPort || s.sock != "" {
		t.Fatalf("defaults %+v %v", s, err)
	}
	s.named("rnbd7", "/run/rnbd")
	if s.Device != "rnbd7" || s.sock != "/run/rnbd/rnbd7.sock" || s.As != "socket:/run/rnbd/rnbd7.sock" {
		t.Fatalf("named %+v", s)
	}
}

// TestNormalizeFrontends: without --as a mapping is /dev/nbdN where the
// nbd driver is loaded, else a socket — and then map says so (the note);
// --as nbd and --as ublk without their driver are refused, suggesting
// only what this kernel has.
func TestNormalizeFrontends(t *testing.T) {
	defer func(n, u func() bool) { haveNBD, haveUblk = n, u }(haveNBD, haveUblk)
	m := api.Mapping{SessName: "s", Paths: []string{"ip:10.0.0.1"}, DevicePath: "d"}
	as := func(a string) api.Mapping { c := m; c.As = a; return c }
	for _, c := range []struct {
		nbd, ublk bool
		as        string
		fe        feKind
		note, err string // substrings; "" none
	}{
		{nbd: true, as: "", fe: feNBD},
		{nbd: false, as: "", fe: feSocket, note: "this kernel has no nbd driver (modprobe nbd), so the device is served on an NBD socket, not as /dev/nbdN"},
		{nbd: false, as: "socket", fe: feSocket},
		{nbd: false, as: "socket:/run/x.sock", fe: feSocket},
		{nbd: false, as: "nbd", err: "this kernel has no nbd driver (modprobe nbd); map with --as socket:PATH instead"},
		{nbd: true, ublk: false, as: "ublk", err: "no ublk driver (modprobe ublk_drv); map with --as nbd or --as socket:PATH instead"},
		{nbd: false, ublk: false, as: "ublk", err: "no ublk driver (modprobe ublk_drv), nor the nbd driver for --as nbd (modprobe nbd); map with --as socket:PATH instead"},
		{nbd: false, ublk: true, as: "ublk", fe: feUblk},
	} {
		haveNBD, haveUblk = func() bool { return c.nbd }, func() bool { return c.ublk }
		s, err := normalize(as(c.as))
		what := fmt.Sprintf("nbd %v ublk %v --as %q", c.nbd, c.ublk, c.as)
		if c.err != "" {
			if ctl.Classify(err) != ctl.CodeNotSupported || !strings.Contains(fmt.Sprint(err), c.err) {
				t.Errorf("%s: %v, want not_supported saying %q", what, err, c.err)
			}
			continue
		}
		if err != nil || s.fe != c.fe || (c.note == "") != (s.note == "") || !strings.Contains(s.note, c.note) {
			t.Errorf("%s: fe %v note %q err %v, want fe %v note %q", what, s.fe, s.note, err, c.fe, c.note)
		}
	}
}

func TestParseMapString(t *testing.T) {
	m, err := ParseMapString("sessname=s1 path=ip:10.0.0.1 path=ip:10.0.1.1 device_path=vol1 access_mode=ro dest_port=1235")
	if err != nil || m.SessName != "s1" || len(m.Paths) != 2 || m.DevicePath != "vol1" || m.AccessMode != "ro" || m.DestPort != 1235 {
		t.Fatalf("%+v %v", m, err)
	}
	for line, code := range map[string]ctl.Code{
		"sessname":            ctl.CodeInvalid,
		"bogus=1":             ctl.CodeInvalid,
		"dest_port=0":         ctl.CodeInvalid,
		"dest_port=70000":     ctl.CodeInvalid,
		"nr_poll_queues=4":    ctl.CodeNotSupported,
		"device_path= path=x": ctl.CodeInvalid,
	} {
		if _, err := ParseMapString(line); ctl.Classify(err) != code {
			t.Errorf("%q: %v, want %s", line, err, code)
		}
	}
}

// TestSameDeviceTwoSessions: one device_path mapped through two sessions
// (two servers may both export vol0) gives two devices, each on its own
// socket under the same NBD name. The daemon's NBD server filed exports
// by that name and refused the second with EEXIST.
func TestSameDeviceTwoSessions(t *testing.T) {
	r := newRig(t)
	r.file("a", 1<<20)
	d := r.start()
	defer d.Stop()
	ctx := context.Background()
	m1, err := d.Map(ctx, r.mapping("s1", "a"))
	if err != nil {
		t.Fatal(err)
	}
	m := r.mapping("s2", "a")
	m.AccessMode = "ro"
	m2, err := d.Map(ctx, m)
	if err != nil {
		t.Fatalf("the same device through a second session: %v", err)
	}
	if m1.Device == m2.Device || m1.As == m2.As {
		t.Fatalf("two mappings share a device or a socket: %+v %+v", m1, m2)
	}
	rw(t, d, m1.Device, 0, 0x5a)
	if err := d.Unmap(ctx, m1.Device, false); err != nil {
		t.Fatal(err)
	}
	// The second mapping is still served, under the shared name.
	if _, err := exec.LookPath("nbdinfo"); err == nil {
		sock := strings.TrimPrefix(m2.As, "socket:")
		out, err := exec.Command("nbdinfo", "--size", "nbd+unix:///a?socket="+sock).CombinedOutput()
		if err != nil || strings.TrimSpace(string(out)) != "1048576" {
			t.Fatalf("nbdinfo on the second mapping's socket: %v %s", err, out)
		}
	}
	if err := d.Unmap(ctx, m2.Device, false); err != nil {
		t.Fatal(err)
	}
}

// TestNoDeviceNamesTheMapping: a command given the server's name of a
// device (device_path) rather than the mapping's (rnbd0) is not_found,
// saying which mappings have that name and what to run instead.
func TestNoDeviceNamesTheMapping(t *testing.T) {
	r := newRig(t)
	r.file("vol", 1<<20)
	d := r.start()
	defer d.Stop()
	ctx := context.Background()
	if _, err := d.Map(ctx, r.mapping("s1", "vol")); err != nil {
		t.Fatal(err)
	}
	err := d.Unmap(ctx, "vol", false)
	if ctl.Classify(err) != ctl.CodeNotFound || err.Error() != "no device vol; vol is mapped as rnbd0 (session s1): unmap rnbd0" {
		t.Fatalf("unmap vol: %v", err)
	}
	if _, err := d.find("vol", "remap"); err == nil || !strings.HasSuffix(err.Error(), ": remap rnbd0") {
		t.Fatalf("remap vol: %v", err)
	}
	m := r.mapping("s2", "vol")
	m.AccessMode = "ro"
	if _, err := d.Map(ctx, m); err != nil {
		t.Fatal(err)
	}
	err = d.Unmap(ctx, "vol", false)
	if err == nil || err.Error() != "no device vol; vol is mapped as rnbd0 (session s1), rnbd1 (session s2): unmap one of them" {
		t.Fatalf("unmap vol, mapped twice: %v", err)
	}
	if err := d.Unmap(ctx, "other", false); err == nil || err.Error() != "no device other" {
		t.Fatalf("unmap of a name nothing has: %v", err)
	}
	for _, dev := range []string{"rnbd0", "rnbd1"} {
		if err := d.Unmap(ctx, dev, false); err != nil {
			t.Fatal(err)
		}
	}
}
