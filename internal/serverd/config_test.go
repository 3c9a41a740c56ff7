package serverd

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric/fabrictest"
)

// The example configuration in deploy/ is the defaults, written out: it
// must parse (every key known) and change nothing but where it listens,
// which is a storage network's address, not every interface, and TLS,
// which it uses (with files under /etc/rnbd/tls, and no anonymous
// clients): without it anyone who reaches the port is trusted.
func TestExampleConfigIsTheDefaults(t *testing.T) {
	cfg, err := LoadConfig("../../deploy/server.toml", true)
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Listen) == 0 || len(everywhere(cfg.Listen)) != 0 {
		t.Fatalf("deploy/server.toml listens on %v, want explicit addresses only", cfg.Listen)
	}
	want := ServerTLS{}
	want.Cert, want.Key, want.CA = "/etc/rnbd/tls/server.crt", "/etc/rnbd/tls/server.key", "/etc/rnbd/tls/ca.crt"
	want.Configured = true
	if cfg.TLS != want {
		t.Fatalf("deploy/server.toml has [tls] %+v, want %+v", cfg.TLS, want)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	d := DefaultConfig()
	cfg.Listen, cfg.TLS = d.Listen, d.TLS
	if !reflect.DeepEqual(cfg, d) {
		t.Fatalf("deploy/server.toml\n%+v\ndiffers from the defaults\n%+v", cfg, d)
	}
}

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(s string) string {
		p := filepath.Join(dir, "c.toml")
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cfg, err := LoadConfig(write("max_chunk_memory = 1048576\n"), true)
	if err != nil || cfg.MaxChunkMemory != 1<<20 {
		t.Fatalf("integer size: %v %v", cfg.MaxChunkMemory, err)
	}
	if cfg, err = LoadConfig(write(`max_chunk_memory = "2GiB"`), true); err != nil || cfg.MaxChunkMemory != 2<<30 {
		t.Fatalf("string size: %v %v", cfg.MaxChunkMemory, err)
	}
	for _, bad := range []string{`max_chunk_memory = "lots"`, `max_chunk_memory = -1`, `version = 2`, `queue_depth = "x"`} {
		if _, err := LoadConfig(write(bad), true); err == nil {
			t.Errorf("%s: accepted", bad)
		}
	}
	if _, err := LoadConfig(filepath.Join(dir, "missing.toml"), true); err == nil {
		t.Error("a missing file named explicitly was accepted")
	}
	if cfg, err := LoadConfig(filepath.Join(dir, "missing.toml"), false); err != nil || !reflect.DeepEqual(cfg, DefaultConfig()) {
		t.Errorf("missing default file: %v", err)
	}
	bad := DefaultConfig()
	bad.Listen = []string{"udp://1.2.3.4"}
	if err := bad.Validate(); err == nil {
		t.Error("udp listen address accepted")
	}
	for _, r := range []struct {
		rate  float64
		burst int
	}{{-1, 32}, {8, 0}} {
		bad = DefaultConfig()
		bad.NewPathRate, bad.NewPathBurst = r.rate, r.burst
		if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "new_path_rate") {
			t.Errorf("new_path_rate %g, new_path_burst %d: %v", r.rate, r.burst, err)
		}
	}
	off := DefaultConfig()
	off.NewPathRate, off.NewPathBurst = 0, 0
	if err := off.Validate(); err != nil {
		t.Errorf("new_path_rate 0 (no bound): %v", err)
	}
	bad = DefaultConfig()
	bad.InvalidateBy = "magic"
	if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "invalidate_by") {
		t.Errorf("invalidate_by magic: %v", err)
	}
}

func TestEverywhere(t *testing.T) {
	got := everywhere([]string{"tcp://10.0.0.5:1234", "tcp://0.0.0.0:1234", "rdma://[::]:1234", "tcp://[fd00::1]:1234"})
	if !reflect.DeepEqual(got, []string{"tcp://0.0.0.0:1234", "rdma://[::]:1234"}) {
		t.Fatalf("everywhere: %q", got)
	}
}

func TestTLSConfig(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.toml")
	os.WriteFile(p, []byte("[tls]\ncert = \"/x.crt\"\nkey = \"/x.key\"\nca = \"/ca.crt\"\n"), 0o644)
	cfg, err := LoadConfig(p, true)
	if err != nil || !cfg.TLS.Configured || cfg.TLS.Cert != "/x.crt" || cfg.TLS.Key != "/x.key" || cfg.TLS.CA != "/ca.crt" {
		t.Fatalf("[tls]: %+v %v", cfg.TLS, err)
	}
	cfg.TLS.Key = ""
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "cert, key and ca") {
		t.Fatalf("a certificate without its key: %v", err)
	}
	cfg.TLS.Key = "/x.key"
	if _, err := Start(cfg, Options{}); err == nil || !strings.Contains(err.Error(), "tls") {
		t.Fatalf("start with missing TLS files: %v", err)
	}
	// The server's own key of [tls]: off unless set, and only with TLS.
	if cfg.TLS.AllowAnonymousClients {
		t.Fatal("allow_anonymous_clients is on by default")
	}
	os.WriteFile(p, []byte("[tls]\ncert = \"/x.crt\"\nkey = \"/x.key\"\nca = \"/ca.crt\"\nallow_anonymous_clients = true\n"), 0o644)
	if cfg, err = LoadConfig(p, true); err != nil || !cfg.TLS.AllowAnonymousClients || cfg.TLS.Cert != "/x.crt" {
		t.Fatalf("[tls] allow_anonymous_clients: %+v %v", cfg.TLS, err)
	}
	plain := DefaultConfig()
	plain.TLS.AllowAnonymousClients = true
	if err := plain.Validate(); err == nil || !strings.Contains(err.Error(), "allow_anonymous_clients") {
		t.Fatalf("allow_anonymous_clients without TLS: %v", err)
	}
}

// TestTLSNeverDropped: a server whose configuration has [tls] runs with
// TLS or not at all. Each way the table could come to nothing is an
// error: a misspelt table or key, a table without its files, one
// emptied by flags, a partial one, files that do not load, a fabric
// that would not carry it.
func TestTLSNeverDropped(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "c.toml")
	load := func(text string) (Config, error) {
		t.Helper()
		if err := os.WriteFile(p, []byte("listen = [\"tcp://127.0.0.1:1\"]\n"+text), 0o644); err != nil {
			t.Fatal(err)
		}
		return LoadConfig(p, true)
	}
	const files = "cert = \"/x.crt\"\nkey = \"/x.key\"\nca = \"/ca.crt\"\n"
	for _, c := range []struct{ name, text, want string }{
		{"a misspelt table", "[tsl]\n" + files, `c.toml:2: unknown table [tsl] (did you mean [tls]?)`},
		{"a misspelt key", "[tls]\ncertificate = \"/x.crt\"\nkey = \"/x.key\"\nca = \"/ca.crt\"\n", `c.toml:3: unknown key "certificate" in [tls]`},
		{"the keys above the table", files + "[tls]\n", `c.toml:2: unknown key "cert" (did you mean [admin] cert or [tls] cert?)`},
	} {
		if _, err := load(c.text); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
	for _, c := range []struct{ name, text, want string }{
		{"an empty table", "[tls]\n", "sets none of cert, key and ca"},
		{"only the server's own key", "[tls]\nallow_anonymous_clients = false\n", "sets none of cert, key and ca"},
		{"empty strings", "[tls]\ncert = \"\"\nkey = \"\"\nca = \"\"\n", "sets none of cert, key and ca"},
		{"an empty inline table", "tls = {}\n", "sets none of cert, key and ca"},
		{"no ca", "[tls]\ncert = \"/x.crt\"\nkey = \"/x.key\"\n", "(ca not set)"},
		{"the client's key", "[tls]\n" + files + "server_name = \"s\"\n", "server_name is a client's setting"},
	} {
		cfg, err := load(c.text)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
		// Should it start after all, it does in the test's directory.
		cfg.ControlSocket, cfg.StateFile = filepath.Join(dir, "ctl.sock"), filepath.Join(dir, "state.json")
		if d, err := Start(cfg, Options{}); err == nil {
			d.Stop()
			t.Errorf("%s: started", c.name)
		}
	}
	// Flags that empty what the file set (rnbd-server daemon
	// --tls-cert= --tls-key= --tls-ca=) leave TLS configured: refused.
	cfg, err := load("[tls]\n" + files)
	if err != nil {
		t.Fatal(err)
	}
	cfg.TLS.Cert, cfg.TLS.Key, cfg.TLS.CA = "", "", ""
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "does not run without the TLS") {
		t.Errorf("[tls] emptied by flags: %v", err)
	}
	// Files that do not load stop the start, before anything listens.
	cfg, _ = load("[tls]\n" + files)
	cfg.ControlSocket, cfg.StateFile = filepath.Join(dir, "ctl.sock"), filepath.Join(dir, "state.json")
	if _, err := Start(cfg, Options{}); err == nil || !strings.Contains(err.Error(), "tls: ca: open /ca.crt") {
		t.Errorf("missing TLS files: %v", err)
	}
	if _, err := os.Stat(cfg.ControlSocket); err == nil {
		t.Error("the control socket was made by a start that failed on TLS")
	}
	// A fabric of the caller's would not carry it.
	if d, err := Start(cfg, Options{Fabric: fabrictest.NewNetwork().Fabric()}); err == nil || !strings.Contains(err.Error(), "tls") {
		if err == nil {
			d.Stop()
		}
		t.Errorf("TLS configured with a caller's fabric: %v", err)
	}
}
