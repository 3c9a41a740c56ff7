package serverd

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/test/kit"
	"github.com/rnbd/rnbd/test/testca"
)

// TestAdminConfig: [admin] is refused without TLS, on a fabric or
// metrics address, with an identity in two roles, with a scheme; an
// address without a port gets the admin port.
func TestAdminConfig(t *testing.T) {
	tlsFiles := conf.TLS{Cert: "/x.crt", Key: "/x.key", CA: "/ca.crt"}
	for _, c := range []struct {
		name string
		edit func(*Config)
		want string // "" : valid
	}{
		{"no TLS at all", func(c *Config) { c.Admin.Listen = []string{"127.0.0.1"} }, "not cert, key and ca"},
		{"[tls]'s files", func(c *Config) { c.Admin.Listen = []string{"127.0.0.1"}; c.TLS.TLS = tlsFiles }, ""},
		{"its own files", func(c *Config) {
			c.Admin.Listen = []string{"127.0.0.1"}
			c.Admin.Cert, c.Admin.Key, c.Admin.CA = "/a.crt", "/a.key", "/ca.crt"
		}, ""},
		{"the fabric's address", func(c *Config) { c.Admin.Listen = []string{"127.0.0.1:1234"}; c.TLS.TLS = tlsFiles }, "never served on the data port"},
		{"every interface at the fabric's port", func(c *Config) { c.Admin.Listen = []string{"[::]:1234"}; c.TLS.TLS = tlsFiles }, "never served on the data port"},
		{"another address at the fabric's port", func(c *Config) { c.Admin.Listen = []string{"127.0.0.2:1234"}; c.TLS.TLS = tlsFiles }, ""},
		{"the metrics' address", func(c *Config) {
			c.Admin.Listen, c.MetricsListen = []string{"127.0.0.1:9100"}, "127.0.0.1:9100"
			c.TLS.TLS = tlsFiles
		}, "metrics_listen is there"},
		{"a scheme", func(c *Config) { c.Admin.Listen = []string{"https://127.0.0.1"}; c.TLS.TLS = tlsFiles }, "no scheme"},
		{"a bad port", func(c *Config) { c.Admin.Listen = []string{"127.0.0.1:99999"}; c.TLS.TLS = tlsFiles }, "want 1 to 65535"},
		{"two roles", func(c *Config) { c.Admin.Admins, c.Admin.Readers = []string{"a"}, []string{"b", "a"} }, "identity a has the role admin already"},
		{"local", func(c *Config) { c.Admin.Readers = []string{"local"} }, "the unix socket's root"},
		{"no connections", func(c *Config) { c.Admin.MaxConnections = 0 }, "at least 1"},
	} {
		cfg := DefaultConfig()
		cfg.Listen = []string{"tcp://127.0.0.1:1234"}
		c.edit(&cfg)
		err := cfg.Validate()
		if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
	for in, want := range map[string]string{"127.0.0.1": "127.0.0.1:1235", "10.0.0.1:7000": "10.0.0.1:7000", "[::1]": "[::1]:1235",
		"::1": "[::1]:1235", "[::]:1236": "[::]:1236", "admin.example": "admin.example:1235"} {
		if got, err := AdminAddr(in); err != nil || got != want {
			t.Errorf("AdminAddr(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	// The table is strict, as the rest of the file.
	p := filepath.Join(t.TempDir(), "c.toml")
	os.WriteFile(p, []byte("[admin]\nlisten = [\"127.0.0.1\"]\nreader = [\"x\"]\n"), 0o644)
	if _, err := LoadConfig(p, true); err == nil || !strings.Contains(err.Error(), `unknown key "reader" in [admin]`) {
		t.Errorf("[admin] with a misspelt key: %v", err)
	}
}

// TestRouteRights: the daemon registers exactly the routes of the route
// table, and every one of them, called over the admin listener by an
// identity of each role, is refused permission_denied exactly when the
// role has not the route's right: the rights table (api.ServerRoutes,
// docs/control-api.md's) is what the daemon enforces.
func TestRouteRights(t *testing.T) {
	a := startAdmin(t, func(c *Config) {})
	var want []string
	for _, r := range api.ServerRoutes {
		want = append(want, r.Pattern())
	}
	if got := a.d.ctl.Patterns(); !slices.Equal(sorted(got), sorted(want)) {
		t.Fatalf("the daemon's routes %q, the table's %q", got, want)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, role := range []ctl.Role{ctl.RoleNone, ctl.RoleReader, ctl.RoleProvisioner, ctl.RoleAdmin} {
		cl := a.client(roleIdentity[role])
		for _, r := range api.ServerRoutes {
			args := make([]string, strings.Count(r.Path, "{"))
			for i := range args {
				args[i] = "nothing-" + fmt.Sprint(i)
			}
			var body any
			if r.Method == "POST" || r.Method == "PUT" {
				body = struct{}{}
			}
			err := cl.Do(ctx, r.Method, r.URL(args...), body, nil)
			refused := ctl.Classify(err) == ctl.CodePermission && strings.Contains(fmt.Sprint(err), "may not")
			if refused == role.Has(r.Right) {
				t.Errorf("%s by a %s (right %s): %v", r.Pattern(), role, r.Right, err)
			}
		}
		cl.Close()
	}
}

func sorted(s []string) []string { s = slices.Clone(s); slices.Sort(s); return s }

// roleIdentity are the identities startAdmin gives each role.
var roleIdentity = map[ctl.Role]string{ctl.RoleNone: "nobody", ctl.RoleReader: "rita", ctl.RoleProvisioner: "paul", ctl.RoleAdmin: "ada"}

// adminDaemon is a daemon with an admin listener, and clients of it by
// certificate name.
type adminDaemon struct {
	d   *Daemon
	ca  *testca.CA
	dir string
	log func() []*log.Entry
	t   *testing.T
}

// startAdmin starts a daemon with an admin listener on loopback, ada an
// admin, paul a provisioner, rita a reader (edit may change the
// configuration).
func startAdmin(t *testing.T, edit func(*Config)) *adminDaemon {
	dir := t.TempDir()
	ca := testca.New(t, "admin-ca")
	caFile := ca.WriteCA(t, dir, "ca")
	cert, key := testca.WriteCert(t, ca.Issue(t, "srv", "127.0.0.1"), dir, "srv")
	cfg := trustConfig(t, nil)
	cfg.Admin.Listen = []string{"127.0.0.1:0"}
	cfg.Admin.Cert, cfg.Admin.Key, cfg.Admin.CA = cert, key, caFile
	cfg.Admin.Readers, cfg.Admin.Provisioners, cfg.Admin.Admins = []string{"rita"}, []string{"paul"}, []string{"ada"}
	edit(&cfg)
	lg, entries := kit.LogRecorder()
	d, err := Start(cfg, Options{Log: lg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Stop() })
	return &adminDaemon{d: d, ca: ca, dir: dir, log: entries, t: t}
}

// client is a client of the admin listener with a certificate of cn.
func (a *adminDaemon) client(cn string) *ctl.Client {
	c := a.ca.Issue(a.t, cn)
	cl, err := ctl.DialTLS("https://"+a.d.AdminAddrs()[0].String(), &tls.Config{RootCAs: a.ca.Pool(), Certificates: []tls.Certificate{c}})
	if err != nil {
		a.t.Fatal(err)
	}
	return cl
}

// audits are the audit lines logged, as "identity method object result".
func (a *adminDaemon) audits() []string {
	var out []string
	for _, e := range a.log() {
		if e.Message == ctl.AuditMsg {
			out = append(out, e.Data["identity"].(string)+" "+e.Data["method"].(string)+" "+e.Data["object"].(string)+" "+e.Data["result"].(string))
		}
	}
	return out
}

// TestMayOpen: discovery answers what an OPEN would admit by identity
// and address.
func TestMayOpen(t *testing.T) {
	g := func(s string) rnbd.Grant { x, _ := rnbd.ParseGrant(s); return x }
	from := netip.MustParseAddr("10.0.0.7")
	for _, c := range []struct {
		name   string
		e      rnbd.Export
		access string // "": not open to it
	}{
		{"open to all", rnbd.Export{}, "rw"},
		{"open to all, read-only", rnbd.Export{ReadOnly: true}, "ro"},
		{"granted ro", rnbd.Export{AllowIdentities: []rnbd.Grant{g("host7=ro"), g("other")}}, "ro"},
		{"granted twice: the widest", rnbd.Export{AllowIdentities: []rnbd.Grant{g("host7=ro"), g("h7.example=migration")}}, "migration"},
		{"granted rw, read-only", rnbd.Export{ReadOnly: true, AllowIdentities: []rnbd.Grant{g("host7")}}, "ro"},
		{"granted others", rnbd.Export{AllowIdentities: []rnbd.Grant{g("other")}}, ""},
		{"grants only, none", rnbd.Export{GrantsOnly: true}, ""},
		{"its network", rnbd.Export{AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}}, "rw"},
		{"another network", rnbd.Export{AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.0.1.0/24")}}, ""},
	} {
		got, ok := mayOpen(c.e, []string{"host7", "h7.example"}, from)
		if ok != (c.access != "") || got != c.access {
			t.Errorf("%s: %q %v, want %q", c.name, got, ok, c.access)
		}
	}
	// A caller without an address (the socket) does not pass allow_from.
	if _, ok := mayOpen(rnbd.Export{AllowFrom: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}}, nil, netip.Addr{}); ok {
		t.Errorf("an export with allow_from discovered by a caller without an address")
	}
}

// TestAdminListener: a daemon with [admin] listen answers each identity
// by its role, audits, and discovers for each what it may open; a
// provisioner may not map a path, an admin only under export_roots, and
// what an admin maps over the network is grants-only unless it says
// otherwise.
func TestAdminListener(t *testing.T) {
	roots := t.TempDir()
	a := startAdmin(t, func(c *Config) { c.Admin.ExportRoots = []string{roots} })
	d, dir := a.d, a.dir
	vol := filepath.Join(dir, "vol")
	kit.SparseFile(t, vol, 1<<20)
	inRoot := filepath.Join(roots, "disk")
	kit.SparseFile(t, inRoot, 1<<20)
	os.Symlink(vol, filepath.Join(roots, "link-out"))
	for _, e := range []rnbd.Export{{Name: "all", Path: vol, ReadOnly: true}, {Name: "ritas", Path: vol, AllowIdentities: []rnbd.Grant{{Identity: "rita", Access: "ro"}}}} {
		if err := d.Map(e); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	call := func(cn string, rt api.Route, args []string, body, out any) error {
		cl := a.client(cn)
		defer cl.Close()
		return api.Call(ctx, cl, rt, args, nil, body, out)
	}
	err := call("rita", api.SrvExportMap, nil, api.MapRequest{Name: "x", Path: vol}, nil)
	if ctl.Classify(err) != ctl.CodePermission || !strings.Contains(err.Error(), "identity rita (role reader) may not POST /v1/exports") {
		t.Fatalf("a reader's map: %v", err)
	}
	err = call("paul", api.SrvSessionNameBind, []string{"s1"}, api.BindRequest{Identity: "x"}, nil)
	if ctl.Classify(err) != ctl.CodePermission || !strings.Contains(err.Error(), "the admin right") {
		t.Fatalf("a provisioner's session bind: %v", err)
	}
	// A provisioner maps no path, resizes and unmaps no export, grants
	// no export that is not a volume's.
	for _, c := range []struct {
		rt   api.Route
		args []string
		body any
	}{
		{api.SrvExportMap, nil, api.MapRequest{Name: "pauls", Path: "/etc/shadow"}},
		{api.SrvExportResize, []string{"all"}, api.ResizeRequest{Size: "1TiB"}},
		{api.SrvExportUnmap, []string{"all"}, nil},
		{api.SrvExportGrant, []string{"ritas"}, api.GrantRequest{Identity: "paul"}},
		{api.SrvVolumeGrant, []string{"ritas"}, api.GrantRequest{Identity: "paul"}},
	} {
		err := call("paul", c.rt, c.args, c.body, nil)
		if c.rt == api.SrvVolumeGrant {
			if ctl.Classify(err) != ctl.CodeNotFound {
				t.Errorf("a provisioner's grant of an export that is no volume: %v", err)
			}
			continue
		}
		if ctl.Classify(err) != ctl.CodePermission {
			t.Errorf("a provisioner's %s: %v", c.rt.Pattern(), err)
		}
	}
	// An admin maps only beneath export_roots, links and ".." (sent
	// as they are, not cleaned here) resolved.
	for _, p := range []string{vol, "/etc/shadow", filepath.Join(roots, "link-out"), roots + "/../" + filepath.Base(dir) + "/vol", roots + "/.."} {
		if err := call("ada", api.SrvExportMap, nil, api.MapRequest{Name: "outside", Path: p}, nil); ctl.Classify(err) != ctl.CodePermission {
			t.Errorf("an admin's map of %s outside export_roots: %v", p, err)
		}
	}
	if err := call("ada", api.SrvExportMap, nil, api.MapRequest{Name: "adas", Path: inRoot}, nil); err != nil {
		t.Fatalf("an admin's map beneath export_roots: %v", err)
	}
	var recs []api.ExportRecord
	if err := call("rita", api.SrvExport, []string{"adas"}, nil, &recs); err != nil || len(recs) != 1 || !recs[0].GrantsOnly || recs[0].Path != inRoot {
		t.Fatalf("an export an admin mapped over the network: %+v %v, want grants-only", recs, err)
	}
	if err := call("ada", api.SrvExportMap, nil, api.MapRequest{Name: "adas-open", Path: inRoot, GrantsOnly: ptr(false)}, nil); err != nil {
		t.Fatalf("an admin's map open to all: %v", err)
	}
	discover := func(cn string) []api.DiscoverRecord {
		var recs []api.DiscoverRecord
		if err := call(cn, api.SrvDiscover, nil, nil, &recs); err != nil {
			t.Fatalf("discover by %s: %v", cn, err)
		}
		return recs
	}
	if got := discover("rita"); len(got) != 3 || got[0].Name != "adas-open" || got[2].Name != "ritas" || got[2].Access != "ro" ||
		got[2].Size == nil || *got[2].Size != 1<<20 || got[1].Access != "ro" || !got[1].ReadOnly {
		t.Errorf("rita discovers %+v", got)
	}
	if got := discover("nobody"); len(got) != 2 || got[0].Name != "adas-open" || got[0].Access != "rw" || got[1].Name != "all" {
		t.Errorf("nobody discovers %+v", got)
	}
	want := []string{"rita POST /v1/exports permission_denied", "paul PUT /v1/session-names/s1 permission_denied"}
	if got := a.audits(); len(got) < 2 || !slices.Equal(got[:2], want) || !slices.Contains(got, "ada POST /v1/exports ok") {
		t.Errorf("audit lines %q, want %q first and an admin's map ok", got, want)
	}
}

// TestExportNamesAddressable: an export named "." or ".." is refused,
// by map and in the configuration file: the control API could not name
// it again.
func TestExportNamesAddressable(t *testing.T) {
	for _, name := range []string{".", ".."} {
		if _, err := exportOf(api.MapRequest{Name: name, Path: "/srv/x.img"}); err == nil || !strings.Contains(err.Error(), "cannot address") {
			t.Errorf("export %q: %v", name, err)
		}
		cfg := DefaultConfig()
		cfg.Exports = []api.MapRequest{{Name: name, Path: "/srv/x.img"}}
		if err := cfg.Validate(); err == nil {
			t.Errorf("[[export]] %q accepted", name)
		}
	}
	if _, err := exportOf(api.MapRequest{Name: "vg/lv.1", Path: "/srv/x.img"}); err != nil {
		t.Errorf("a name with a slash and a dot: %v", err)
	}
}

// TestProvisionerVolumes: over the network a provisioner's volume is
// grants-only by default, and one open to every client is refused (an
// admin may make it); a provisioner grants a volume's export through
// the volume's routes and, as a controller of an earlier release does,
// through the export's, which refuse it any export not a volume's.
func TestProvisionerVolumes(t *testing.T) {
	a := startAdmin(t, func(c *Config) {
		c.Pools = []PoolConfig{{Name: "files", Type: "dir", Path: t.TempDir()}}
	})
	vol := filepath.Join(a.dir, "plain")
	kit.SparseFile(t, vol, 1<<20)
	if err := a.d.Map(rnbd.Export{Name: "plain", Path: vol}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	paul, ada := api.NewServer(a.client("paul")), api.NewServer(a.client("ada"))
	rec, err := paul.CreateVolume(ctx, api.VolumeRequest{Name: "v", Pool: "files", Size: "1MiB"})
	if err != nil || !rec.Record.GrantsOnly {
		t.Fatalf("a provisioner's volume, grants_only unsaid: %+v %v; want grants-only", rec.Record, err)
	}
	_, err = paul.CreateVolume(ctx, api.VolumeRequest{Name: "open", Pool: "files", Size: "1MiB", Export: api.MapRequest{GrantsOnly: ptr(false)}})
	if ctl.Classify(err) != ctl.CodePermission || !strings.Contains(err.Error(), "only an admin may") {
		t.Fatalf("a provisioner's volume open to every client: %v, want permission_denied", err)
	}
	if rec, err := ada.CreateVolume(ctx, api.VolumeRequest{Name: "open", Pool: "files", Size: "1MiB", Export: api.MapRequest{GrantsOnly: ptr(false)}}); err != nil || rec.Record.GrantsOnly {
		t.Fatalf("an admin's volume open to every client: %+v %v", rec.Record, err)
	}
	cl := a.client("paul")
	grant := func(rt api.Route, export string) error {
		return api.Call(ctx, cl, rt, []string{export}, nil, api.GrantRequest{Identity: "host-1"}, nil)
	}
	if err := grant(api.SrvVolumeGrant, "v"); err != nil {
		t.Errorf("a provisioner's grant of a volume: %v", err)
	}
	if err := grant(api.SrvExportGrant, "v"); err != nil {
		t.Errorf("a provisioner's grant of a volume's export on the export's route: %v", err)
	}
	for _, rt := range []api.Route{api.SrvExportGrant, api.SrvVolumeGrant} {
		if err := grant(rt, "plain"); err == nil {
			t.Errorf("a provisioner's grant of an export not a volume's on %s: granted", rt.Pattern())
		}
	}
	if err := api.Call(ctx, cl, api.SrvExportRevoke, []string{"plain", "x"}, nil, nil, nil); ctl.Classify(err) != ctl.CodePermission {
		t.Errorf("a provisioner's revoke on an export not a volume's: %v", err)
	}
	if gs, _ := ada.VolumeGrants(ctx, "v"); len(gs) != 1 || gs[0].Identity != "host-1" {
		t.Errorf("the volume's grants: %+v", gs)
	}
	for _, e := range a.d.rnbd.Exports() {
		if e.Name == "plain" && len(e.AllowIdentities) != 0 {
			t.Errorf("the plain export was granted: %+v", e.AllowIdentities)
		}
	}
}
