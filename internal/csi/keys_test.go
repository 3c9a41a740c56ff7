package csi

import (
	"flag"
	"testing"

	"github.com/rnbd/rnbd/internal/conf"
)

var update = flag.Bool("update", false, "write ConfigKeys' table into docs/kubernetes.md")

// TestConfigKeysDoc: ConfigKeys documents every key and table of Config
// once and no other, its plain defaults are DefaultConfig's, and
// docs/kubernetes.md has its table (rnbd-csi.toml(5) is made from it
// too; cmd/rnbd-csi's test checks the page).
func TestConfigKeysDoc(t *testing.T) {
	if err := conf.CheckKeys(ConfigKeys, DefaultConfig()); err != nil {
		t.Error(err)
	}
	if err := conf.SyncDoc("../../docs/kubernetes.md", "csi", ConfigKeys, *update); err != nil {
		t.Error(err)
	}
}
