package clientd

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/rnbd/rnbd/internal/conf"
)

// The example configuration in deploy/ is the defaults, written out: it
// must parse without warnings and change nothing but TLS, which it uses
// (with files under /etc/rnbd/tls), as the example server requires.
func TestExampleConfigIsTheDefaults(t *testing.T) {
	cfg, warnings, err := LoadConfig("../../deploy/client.toml", true)
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) != 0 {
		t.Fatalf("warnings: %v", warnings)
	}
	want := conf.TLS{Cert: "/etc/rnbd/tls/client.crt", Key: "/etc/rnbd/tls/client.key", CA: "/etc/rnbd/tls/ca.crt"}
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
	if cfg, _, err := LoadConfig(p, true); err != nil || cfg.UblkMaxIOKB != 1024 {
		t.Fatalf("ublk_max_io_kb from the file: %d %v", cfg.UblkMaxIOKB, err)
	}
}
