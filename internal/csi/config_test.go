package csi

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rnbd/rnbd/internal/pool"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

func writeConfig(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "csi.toml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestConfig: a whole file loads with its defaults; each mistake is an
// error saying what is wrong.
func TestConfig(t *testing.T) {
	good := `
[[storage_node]]
name = "node-a"
admin = "https://10.0.9.5:1235"
paths = ["ip:10.0.8.5", "ip:10.0.9.5"]
pool = "files"
labels = { "topology.kubernetes.io/zone" = "a" }
[tls]
cert = "c.crt"
key = "c.key"
ca = "ca.crt"
[node]
node_id = "host-1"
`
	cfg, err := LoadConfig(writeConfig(t, good))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.DriverName != DefaultDriverName || cfg.StorageNodes[0].Port != DefaultPort || cfg.Node.ClientSocket != DefaultClientSocket ||
		cfg.StorageNodes[0].Labels["topology.kubernetes.io/zone"] != "a" || cfg.Workers.Source != WorkersKubernetes {
		t.Errorf("loaded %+v", cfg)
	}
	for _, tc := range []struct{ body, want string }{
		{good + "colour = 1\n", "colour"},
		{strings.Replace(good, `pool = "files"`, `pol = "files"`, 1), "pol"},
		{strings.Replace(good, `https://10.0.9.5:1235`, `http://10.0.9.5:1235`, 1), "want https://HOST:PORT"},
		{strings.Replace(good, `"ip:10.0.8.5", `, `"10.0.8.5", `, 1), "want ip:ADDRESS"},
		{strings.Replace(good, `name = "node-a"`, `name = "node/a"`, 1), "name"},
		{strings.Replace(good, `cert = "c.crt"`, ``, 1), "cert"},
		{good + "[[storage_node]]\nname = \"node-a\"\nadmin = \"https://h:1\"\npaths = [\"ip:1.2.3.4\"]\npool = \"p\"\n", "named twice"},
		{"driver_name = \"-bad\"\n" + good, "driver_name"},
		{good + "[workers]\nsource = \"kube\"\n", "want kubernetes, list or any"},
		{good + "[workers]\nsource = \"list\"\n", "no names"},
		{good + "[workers]\nnames = [\"w1\"]\n", "names are for source list"},
		{good + "[workers]\napi_server = \"https://k:6443\"\n", "did you mean [kubernetes] api_server"},
		{good + "[kubernetes]\napi_server = \"http://k:6443\"\n", "want https://HOST:PORT"},
		{strings.Replace(good, "[node]\n", "[node]\ntopology_from_node = [\"a zone\"]\n", 1), "topology_from_node"},
	} {
		_, err := LoadConfig(writeConfig(t, tc.body))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("config with %q: %v", tc.want, err)
		}
	}
	if err := (Config{DriverName: DefaultDriverName}).ValidateController(); err == nil {
		t.Error("a controller without storage nodes nor TLS")
	}
}

// TestNodeModeNeedsItsConfig: node and all modes need the node's
// identity ([node] node_id or --node-id); an unknown mode is refused.
func TestNodeModeNeedsItsConfig(t *testing.T) {
	for _, m := range []Mode{ModeNode, ModeAll, "other"} {
		if _, err := NewDriver(DefaultConfig(), m, nil); err == nil {
			t.Errorf("mode %s without a node id: no error", m)
		}
	}
	cfg := DefaultConfig()
	cfg.Node.NodeID = "worker-1"
	if _, err := NewDriver(cfg, ModeNode, nil); err != nil {
		t.Errorf("mode node with a node id: %v", err)
	}
}

// TestStorageName: a CSI name is the storage node's where the API takes
// and addresses it; any other (a '/', a blank, "." and "..", which a URL
// path cannot carry, one too long) is made one by a hash, the same for a
// retry, and its id reads back.
func TestStorageName(t *testing.T) {
	for _, name := range []string{"pvc-0f1e", "a.b", "snapshot-1_x"} {
		if got := storageName(name); got != name {
			t.Errorf("a name a pool takes, %q: %q", name, got)
		}
	}
	seen := map[string]string{}
	for _, name := range []string{"my vol/1", "my vol/2", ".", "..", "...", strings.Repeat("x", 129), "é"} {
		got := storageName(name)
		if got == name || pool.CheckName(got) != nil || got != storageName(name) {
			t.Errorf("%q: derived %q", name, got)
		}
		if other, dup := seen[got]; dup {
			t.Errorf("%q and %q are both %q", name, other, got)
		}
		seen[got] = name
		if n, v, ok := parseID(makeID("node-a", got)); !ok || n != "node-a" || v != got {
			t.Errorf("the id of %q does not read back: %q %q %v", got, n, v, ok)
		}
	}
	for _, id := range []string{"node-a/.", "node-a/..", "node-a/", "/v", "node-a", "node-a/a/b"} {
		if _, _, ok := parseID(id); ok {
			t.Errorf("parseID(%q) took it", id)
		}
	}
}

// The ConfigMap of deploy/kubernetes holds a configuration the driver
// loads as it is: strictly (no unknown key), valid for the controller,
// and for the node once the DaemonSet's --node-id gives the node id.
func TestKubernetesConfigMapLoads(t *testing.T) {
	b, err := os.ReadFile("../../deploy/kubernetes/config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var cm corev1.ConfigMap
	if err := yaml.UnmarshalStrict(b, &cm); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "csi.toml")
	if err := os.WriteFile(path, []byte(cm.Data["csi.toml"]), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(path)
	if err != nil {
		t.Fatalf("deploy/kubernetes/config.yaml's csi.toml: %v", err)
	}
	if err := cfg.ValidateController(); err != nil {
		t.Fatalf("for the controller: %v", err)
	}
	cfg.Node.NodeID = "worker-1" // --node-id=$(KUBE_NODE_NAME)
	if err := cfg.ValidateNode(); err != nil {
		t.Fatalf("for the node: %v", err)
	}
}
