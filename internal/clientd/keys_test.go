package clientd

import (
	"flag"
	"testing"

	"github.com/rnbd/rnbd/internal/conf"
)

var update = flag.Bool("update", false, "write ConfigKeys' table into docs/client.md")

// TestConfigKeysDoc: ConfigKeys documents every key and table of Config
// once and no other, its plain defaults are DefaultConfig's, and
// docs/client.md has its table (rnbd-client.toml(5) is made from it too;
// cmd/rnbd-client holds its flags to the daemon's).
func TestConfigKeysDoc(t *testing.T) {
	if err := conf.CheckKeys(ConfigKeys, DefaultConfig()); err != nil {
		t.Error(err)
	}
	if err := conf.SyncDoc("../../docs/client.md", "clientd", ConfigKeys, *update); err != nil {
		t.Error(err)
	}
}
