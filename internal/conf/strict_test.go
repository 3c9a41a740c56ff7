package conf

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/units"
)

// testConfig has the shapes the daemons' configurations have: keys,
// a table with an embedded struct, an array of tables, a value type.
type testConfig struct {
	Version  int        `toml:"version"`
	Listen   []string   `toml:"listen"`
	Interval Duration   `toml:"hb_interval"`
	Memory   units.Size `toml:"max_chunk_memory"`
	TLS      struct {
		TLS
		Anonymous bool `toml:"allow_anonymous_clients"`
	} `toml:"tls"`
	Export []struct {
		Name string `toml:"name"`
		Path string `toml:"path"`
	} `toml:"export"`
}

func loadTest(t *testing.T, text string) (testConfig, Meta, error) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "c.toml")
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	c := testConfig{Version: 1}
	m, err := LoadTOML(p, true, &c, func() int { return c.Version }, 1)
	if err != nil {
		// The messages name the file; the cases below do not.
		err = errorString(strings.ReplaceAll(err.Error(), p, "F"))
	}
	return c, m, err
}

type errorString string

func (e errorString) Error() string { return string(e) }

// TestUnknownKeys: a key or table the configuration does not have is
// an error naming it, its line, and the nearest known name at that
// place; every unknown one is named, each once, an unknown table's keys
// not again.
func TestUnknownKeys(t *testing.T) {
	for _, c := range []struct{ name, text, want string }{
		{"a typo at the top", "version = 1\n\nlisen = [\"tcp://[::]:1234\"]\n",
			`config F:3: unknown key "lisen" (did you mean listen?)`},
		{"a typo in a table's name", "listen = []\n[tsl]\ncert = \"/c\"\nkey = \"/k\"\nca = \"/a\"\n",
			`config F:2: unknown table [tsl] (did you mean [tls]?)`},
		{"a key of a table, in it", "[tls]\ncert = \"/c\"\nkye = \"/k\"\n",
			`config F:3: unknown key "kye" in [tls] (did you mean key?)`},
		{"a key of the embedded struct's table", "[tls]\nallow_anonymous_client = true\n",
			`config F:2: unknown key "allow_anonymous_client" in [tls] (did you mean allow_anonymous_clients?)`},
		{"a flag's spelling", "# comment\nmax-chunk-memory = \"1GiB\"\n",
			`config F:2: unknown key "max-chunk-memory" (did you mean max_chunk_memory?)`},
		{"a table's key at the top", "cert = \"/c\"\n",
			`config F:1: unknown key "cert" (did you mean [tls] cert?)`},
		{"a top key after a table", "[tls]\ncert = \"/c\"\nlisten = [\"tcp://10.0.0.1\"]\n",
			`config F:3: unknown key "listen" in [tls] (did you mean listen at the top, before any table?)`},
		{"nothing near", "frobnicate = 1\n",
			`config F:1: unknown key "frobnicate"`},
		{"a dotted key", "tls.certt = \"/c\"\n",
			`config F:1: unknown key "certt" in [tls] (did you mean cert?)`},
		{"in an inline table", "tls = { cert = \"/c\", kye = \"/k\" }\n",
			`config F:1: unknown key "kye" in [tls] (did you mean key?)`},
		{"in each table of an array", "[[export]]\nname = \"a\"\npaht = \"/a\"\n[[export]]\nname = \"b\"\npaht = \"/b\"\n",
			"config F:3: unknown key \"paht\" in [export] (did you mean path?)\nconfig F:6: unknown key \"paht\" in [export] (did you mean path?)"},
		{"an array of tables' name", "[[exports]]\nname = \"a\"\n",
			`config F:1: unknown table [[exports]] (did you mean [[export]]?)`},
		{"after a multi-line array and string", "listen = [\n  \"tcp://a\",\n  # lisen = 1\n]\nx = \"\"\"\nlisen = 2\n\"\"\"\nlisen = 3\n",
			"config F:5: unknown key \"x\"\nconfig F:8: unknown key \"lisen\" (did you mean listen?)"},
		{"quoted", "\"hb interval\" = \"1s\"\n",
			`config F:1: unknown key "hb interval" (did you mean hb_interval?)`},
	} {
		_, _, err := loadTest(t, c.text)
		if err == nil || err.Error() != c.want {
			t.Errorf("%s:\n%s\ngot  %v\nwant %s", c.name, c.text, err, c.want)
		}
	}
	// What is known loads, and says which tables it had.
	cfg, m, err := loadTest(t, "listen = [\"tcp://10.0.0.1\"]\nhb_interval = \"2s\"\nmax_chunk_memory = \"1GiB\"\n[tls]\ncert = \"/c\"\nallow_anonymous_clients = true\n[[export]]\nname = \"a\"\npath = \"/a\"\n")
	if err != nil || cfg.Interval.Duration != 2*time.Second || cfg.Memory != 1<<30 || cfg.TLS.Cert != "/c" || !cfg.TLS.Anonymous ||
		len(cfg.Export) != 1 || !m.Defined("tls") || m.Defined("nothing") {
		t.Fatalf("known keys: %+v %v %v", cfg, m.Defined("tls"), err)
	}
}

// TestNewerVersionFirst: a newer file is refused for its version, not
// for the keys this daemon does not know yet.
func TestNewerVersionFirst(t *testing.T) {
	_, _, err := loadTest(t, "version = 2\nnew_key = 1\n")
	if err == nil || err.Error() != "config F: version 2 is newer than this daemon understands (1)" {
		t.Fatalf("newer version: %v", err)
	}
}

func TestDistance(t *testing.T) {
	for _, c := range []struct {
		a, b string
		d    int
	}{{"tsl", "tls", 1}, {"lisen", "listen", 1}, {"", "ab", 2}, {"kitten", "sitting", 3}, {"same", "same", 0}} {
		if d := distance(c.a, c.b); d != c.d {
			t.Errorf("distance(%q, %q) = %d, want %d", c.a, c.b, d, c.d)
		}
	}
}
