package clientd

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/rnbd/rnbd/internal/conf"
)

// The example configuration in deploy/ is the defaults, written out: it
// must parse (every key known) and change nothing but TLS, which it uses
// (with files under /etc/rnbd/tls), as the example server requires.
func TestExampleConfigIsTheDefaults(t *testing.T) {
	cfg, err := LoadConfig("../../deploy/client.toml", true)
	if err != nil {
		t.Fatal(err)
	}
	want := conf.TLS{Cert: "/etc/rnbd/tls/client.crt", Key: "/etc/rnbd/tls/client.key", CA: "/etc/rnbd/tls/ca.crt", Configured: true}
	if cfg.TLS != want {
		t.Fatalf("deploy/client.toml has [tls] %+v, want %+v", cfg.TLS, want)
	}
	d := DefaultConfig()
	cfg.TLS = d.TLS
	if !reflect.DeepEqual(cfg, d) {
		t.Fatalf("deploy/client.toml\n%+v\ndiffers from the defaults\n%+v", cfg, d)
	}
}

func TestUblkMaxIO(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "c.toml")
	for kb, ok := range map[int]bool{4: true, 512: true, 1024: true, 0: false, 6: false, 2048: false} {
		cfg := DefaultConfig()
		cfg.SocketDir = dir
		cfg.UblkMaxIOKB = kb
		if err := cfg.Validate(); (err == nil) != ok {
			t.Errorf("ublk_max_io_kb = %d: %v", kb, err)
		}
	}
	if err := os.WriteFile(p, []byte("ublk_max_io_kb = 1024\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if cfg, err := LoadConfig(p, true); err != nil || cfg.UblkMaxIOKB != 1024 {
		t.Fatalf("ublk_max_io_kb from the file: %d %v", cfg.UblkMaxIOKB, err)
	}
}

// TestConfigStrict: the client refuses what it does not know, naming
// the line and the nearest key, and a [tls] that comes to nothing.
func TestConfigStrict(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.toml")
	for _, c := range []struct{ text, want string }{
		{"mpath_policy = \"min-inflight\"\nno_path_timout = \"1m\"\n", `c.toml:2: unknown key "no_path_timout" (did you mean no_path_timeout?)`},
		{"[tsl]\ncert = \"/c\"\n", `c.toml:1: unknown table [tsl] (did you mean [tls]?)`},
		{"[tls]\nserver-name = \"s\"\n", `c.toml:2: unknown key "server-name" in [tls] (did you mean server_name?)`},
	} {
		os.WriteFile(p, []byte(c.text), 0o644)
		if _, err := LoadConfig(p, true); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want %q", c.text, err, c.want)
		}
	}
	os.WriteFile(p, []byte("[tls]\nserver_name = \"s\"\n"), 0o644)
	cfg, err := LoadConfig(p, true)
	if err != nil {
		t.Fatal(err)
	}
	cfg.SocketDir = t.TempDir()
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "sets none of cert, key and ca") {
		t.Errorf("[tls] without files: %v", err)
	}
}
