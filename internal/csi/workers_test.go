package csi

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rnbd/rnbd/pkg/log"
)

// apiServer serves what rnbd-csi reads of the Kubernetes API the way
// its server does: over TLS, with a bearer token; the CSINode list a
// page of `limit` at a time with a continue token, and Nodes by name.
// It answers a kubernetes configuration that reaches it.
func apiServer(t *testing.T, token string, csiNodes []storagev1.CSINode, nodes map[string]map[string]string) (KubernetesConfig, *atomic.Int32) {
	t.Helper()
	var calls atomic.Int32
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if r.Header.Get("Authorization") != "Bearer "+token {
			http.Error(w, `{"kind":"Status","reason":"Forbidden"}`, http.StatusForbidden)
			return
		}
		if name, ok := strings.CutPrefix(r.URL.Path, "/api/v1/nodes/"); ok {
			labels, ok := nodes[name]
			if !ok {
				http.NotFound(w, r)
				return
			}
			json.NewEncoder(w).Encode(corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}})
			return
		}
		if r.URL.Path != "/apis/storage.k8s.io/v1/csinodes" {
			http.NotFound(w, r)
			return
		}
		from, _ := strconv.Atoi(r.URL.Query().Get("continue"))
		limit, err := strconv.Atoi(r.URL.Query().Get("limit"))
		if err != nil || limit < 1 {
			t.Errorf("list without a limit: %s", r.URL)
			limit = len(csiNodes)
		}
		to := min(from+limit, len(csiNodes))
		list := storagev1.CSINodeList{Items: csiNodes[from:to]}
		if to < len(csiNodes) {
			list.Continue = strconv.Itoa(to)
		}
		json.NewEncoder(w).Encode(list)
	}))
	t.Cleanup(srv.Close)
	dir := t.TempDir()
	cfg := KubernetesConfig{APIServer: srv.URL, TokenFile: filepath.Join(dir, "token"), CA: filepath.Join(dir, "ca.crt")}
	if err := os.WriteFile(cfg.CA, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfg.TokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := cfg.validate(); err != nil {
		t.Fatal(err)
	}
	return cfg, &calls
}

func csiNode(name string, drivers ...storagev1.CSINodeDriver) storagev1.CSINode {
	return storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: storagev1.CSINodeSpec{Drivers: drivers}}
}

// TestWorkersKubernetes: a worker is a CSINode registering this driver
// with the node id, found on any page; another driver's registration or
// another node id is not one; a token the API server refuses is an
// error naming the RBAC it needs, not a worker missing.
func TestWorkersKubernetes(t *testing.T) {
	nodes := []storagev1.CSINode{
		csiNode("k1", storagev1.CSINodeDriver{Name: "other.csi.io", NodeID: "w-other"}),
		csiNode("k2", storagev1.CSINodeDriver{Name: DefaultDriverName, NodeID: "worker-2"}),
		csiNode("k3"),
		csiNode("k4", storagev1.CSINodeDriver{Name: "other.csi.io", NodeID: "k4"}, storagev1.CSINodeDriver{Name: DefaultDriverName, NodeID: "worker-4"}),
	}
	kc, calls := apiServer(t, "s3cret", nodes, nil)
	w, err := newWorkers(WorkersConfig{Source: WorkersKubernetes}, kc, DefaultDriverName)
	if err != nil {
		t.Fatal(err)
	}
	w.(*csiNodes).pageSize = 1 // every node on its own page
	ctx := context.Background()
	for id, want := range map[string]bool{"worker-2": true, "worker-4": true, "w-other": false, "k4": false, "k3": false, "": false} {
		calls.Store(0)
		got, err := w.has(ctx, id)
		if err != nil || got != want {
			t.Errorf("has(%q) = %v, %v; want %v", id, got, err, want)
		}
		if !want && calls.Load() != int32(len(nodes)) {
			t.Errorf("has(%q): %d pages asked, want all %d", id, calls.Load(), len(nodes))
		}
	}

	// The token rotated to one the server refuses: an error (Unavailable
	// to the CO), saying what to grant.
	if err := os.WriteFile(kc.TokenFile, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := w.has(ctx, "worker-2"); err == nil || !strings.Contains(err.Error(), "csinodes") {
		t.Errorf("refused token: %v", err)
	}

	// Outside a pod with no api_server: a clear error at start.
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	if _, err := newWorkers(WorkersConfig{Source: WorkersKubernetes}, KubernetesConfig{}, DefaultDriverName); err == nil || !strings.Contains(err.Error(), "not in a Kubernetes pod") {
		t.Errorf("no API server: %v", err)
	}
}

// TestWorkersList: the configured names, and any.
func TestWorkersList(t *testing.T) {
	w, err := newWorkers(WorkersConfig{Source: WorkersList, Names: []string{"a", "b"}}, KubernetesConfig{}, DefaultDriverName)
	if err != nil {
		t.Fatal(err)
	}
	for id, want := range map[string]bool{"a": true, "b": true, "c": false} {
		if got, _ := w.has(context.Background(), id); got != want {
			t.Errorf("list: has(%q) = %v", id, got)
		}
	}
	a, _ := newWorkers(WorkersConfig{Source: WorkersAny}, KubernetesConfig{}, DefaultDriverName)
	if got, _ := a.has(context.Background(), "anything"); !got {
		t.Error("any: refused a node id")
	}
}

// TestNodeTopologyFromNode: the node plugin reports, beside its
// configured labels, those of its Kubernetes Node named in
// topology_from_node; a key the Node has not is left out; the API
// server refusing is Unavailable (the registrar retries), not a worker
// without a zone.
func TestNodeTopologyFromNode(t *testing.T) {
	kc, _ := apiServer(t, "tok", nil, map[string]map[string]string{
		"worker-1": {"topology.kubernetes.io/zone": "b", "topology.kubernetes.io/region": "eu", "kubernetes.io/os": "linux"},
	})
	cfg := DefaultConfig()
	cfg.Kubernetes = kc
	cfg.Node.NodeID, cfg.Node.ClientSocket = "worker-1", filepath.Join(t.TempDir(), "none.sock")
	cfg.Node.Labels = map[string]string{"rack": "r7"}
	cfg.Node.TopologyFromNode = []string{"topology.kubernetes.io/zone", "topology.kubernetes.io/region", "example.com/row"}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	d, err := NewDriver(cfg, ModeNode, log.Discard())
	if err != nil {
		t.Fatal(err)
	}
	nc := csi.NewNodeClient(serveDriver(t, d))
	ctx := context.Background()
	info, err := nc.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"rack": "r7", "topology.kubernetes.io/zone": "b", "topology.kubernetes.io/region": "eu"}
	if got := info.GetAccessibleTopology().GetSegments(); !maps.Equal(got, want) || info.GetNodeId() != "worker-1" {
		t.Errorf("NodeGetInfo: %s %v, want worker-1 %v", info.GetNodeId(), got, want)
	}
	if err := os.WriteFile(kc.TokenFile, []byte("revoked"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = nc.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	wantCode(t, "NodeGetInfo with the API server refusing", err, codes.Unavailable)

	cfg.Node.TopologyFromNode = []string{"rack"}
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "also in [node] labels") {
		t.Errorf("a key both configured and read from the Node: %v", err)
	}
}
