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

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/output"
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

// TestRouteRights: every route of the daemon needs the right the roles
// table of docs/control-api.md gives it: reads for GET, provision for
// volumes, snapshots, exports and grants, admin for the rest (server
// settings, disconnects, closes, resets), discover for discovery.
func TestRouteRights(t *testing.T) {
	d, err := Start(trustConfig(t, nil), Options{Log: log.Discard()})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Stop()
	provision := []string{"POST /v1/exports", "DELETE /v1/exports/{name}", "POST /v1/exports/{name}/resize",
		"POST /v1/volumes", "DELETE /v1/volumes/{name}", "POST /v1/volumes/{name}/resize", "POST /v1/snapshots",
		"DELETE /v1/snapshots/{name}", "POST /v1/exports/{name}/grants", "DELETE /v1/exports/{name}/grants/{identity}"}
	patterns := d.ctl.Patterns()
	for _, p := range patterns {
		want := ctl.RightAdmin
		switch {
		case p == "GET /v1/discover":
			want = ctl.RightDiscover
		case strings.HasPrefix(p, "GET "):
			want = ctl.RightRead
		case slices.Contains(provision, p):
			want = ctl.RightProvision
		}
		if got := routeRight(p); got != want {
			t.Errorf("%s needs %s, want %s", p, got, want)
		}
	}
	for _, p := range []string{"PUT /v1/session-names/{name}", "DELETE /v1/session-names/{name}", "POST /v1/sessions/{name}/disconnect",
		"POST /v1/paths/{name}/disconnect", "POST /v1/devices/{name}/close", "POST /v1/stats/reset", "POST /v1/something-new"} {
		if got := routeRight(p); got != ctl.RightAdmin {
			t.Errorf("%s needs %s, want admin", p, got)
		}
	}
	// An entry of the table for a route the daemon does not have is a
	// typo, or a route to come.
	for p := range routeRights {
		if !slices.Contains(patterns, p) {
			t.Logf("rights table: %s is not a route (yet)", p)
		}
	}
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
// by its role, audits, and discovers for each what it may open.
func TestAdminListener(t *testing.T) {
	dir := t.TempDir()
	ca := testca.New(t, "admin-ca")
	caFile := ca.WriteCA(t, dir, "ca")
	cert, key := testca.WriteCert(t, ca.Issue(t, "srv", "127.0.0.1"), dir, "srv")
	cfg := trustConfig(t, nil)
	cfg.Admin.Listen = []string{"127.0.0.1:0"}
	cfg.Admin.Cert, cfg.Admin.Key, cfg.Admin.CA = cert, key, caFile
	cfg.Admin.Readers, cfg.Admin.Provisioners = []string{"rita"}, []string{"paul"}
	lg, entries := kit.LogRecorder()
	d, err := Start(cfg, Options{Log: lg})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Stop()
	vol := filepath.Join(dir, "vol")
	kit.SparseFile(t, vol, 1<<20)
	for _, e := range []rnbd.Export{{Name: "all", Path: vol, ReadOnly: true}, {Name: "ritas", Path: vol, AllowIdentities: []rnbd.Grant{{Identity: "rita", Access: "ro"}}}} {
		if err := d.Map(e); err != nil {
			t.Fatal(err)
		}
	}
	addr := "https://" + d.AdminAddrs()[0].String()
	client := func(cn string) *ctl.Client {
		c := ca.Issue(t, cn)
		cl, err := ctl.DialTLS(addr, &tls.Config{RootCAs: ca.Pool(), Certificates: []tls.Certificate{c}})
		if err != nil {
			t.Fatal(err)
		}
		return cl
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = client("rita").Do(ctx, "POST", "/v1/exports", MapRequest{Name: "x", Path: vol}, nil)
	if ctl.Classify(err) != ctl.CodePermission || !strings.Contains(err.Error(), "identity rita (role reader) may not POST /v1/exports") {
		t.Fatalf("a reader's map: %v", err)
	}
	err = client("paul").Do(ctx, "PUT", "/v1/session-names/s1", BindRequest{Identity: "x"}, nil)
	if ctl.Classify(err) != ctl.CodePermission || !strings.Contains(err.Error(), "the admin right") {
		t.Fatalf("a provisioner's session bind: %v", err)
	}
	if err := client("paul").Do(ctx, "POST", "/v1/exports", MapRequest{Name: "pauls", Path: vol}, nil); err != nil {
		t.Fatalf("a provisioner's map: %v", err)
	}
	discover := func(cn string) []output.Record {
		var recs []output.Record
		if err := client(cn).Do(ctx, "GET", "/v1/discover", nil, &recs); err != nil {
			t.Fatalf("discover by %s: %v", cn, err)
		}
		return recs
	}
	if got := discover("rita"); len(got) != 3 || got[1]["name"] != "pauls" || got[2]["name"] != "ritas" || got[2]["access"] != "ro" ||
		fmt.Sprint(got[2]["size"]) != "1048576" || got[0]["access"] != "ro" || got[0]["read_only"] != true {
		t.Errorf("rita discovers %v", got)
	}
	if got := discover("nobody"); len(got) != 2 || got[0]["name"] != "all" || got[1]["name"] != "pauls" || got[1]["access"] != "rw" {
		t.Errorf("nobody discovers %v", got)
	}
	var audits []string
	for _, e := range entries() {
		if e.Message == ctl.AuditMsg {
			audits = append(audits, e.Data["identity"].(string)+" "+e.Data["method"].(string)+" "+e.Data["object"].(string)+" "+e.Data["result"].(string))
		}
	}
	want := []string{"rita POST /v1/exports permission_denied", "paul PUT /v1/session-names/s1 permission_denied", "paul POST /v1/exports ok"}
	if !slices.Equal(audits, want) {
		t.Errorf("audit lines %q, want %q", audits, want)
	}
}
