package csi

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// apiServer serves the CSINode list of a cluster the way the
// Kubernetes API server does: over TLS, with a bearer token, a page of
// `limit` at a time with a continue token.
func apiServer(t *testing.T, token string, nodes []storagev1.CSINode) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	var calls atomic.Int32
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if r.URL.Path != "/apis/storage.k8s.io/v1/csinodes" {
			http.NotFound(w, r)
			return
		}
		if r.Header.Get("Authorization") != "Bearer "+token {
			http.Error(w, `{"kind":"Status","reason":"Forbidden"}`, http.StatusForbidden)
			return
		}
		from, _ := strconv.Atoi(r.URL.Query().Get("continue"))
		limit, err := strconv.Atoi(r.URL.Query().Get("limit"))
		if err != nil || limit < 1 {
			t.Errorf("list without a limit: %s", r.URL)
			limit = len(nodes)
		}
		to := min(from+limit, len(nodes))
		list := storagev1.CSINodeList{Items: nodes[from:to]}
		if to < len(nodes) {
			list.Continue = strconv.Itoa(to)
		}
		json.NewEncoder(w).Encode(list)
	}))
	t.Cleanup(srv.Close)
	return srv, &calls
}

func csiNode(name string, drivers ...storagev1.CSINodeDriver) storagev1.CSINode {
	return storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: storagev1.CSINodeSpec{Drivers: drivers}}
}

// TestWorkersKubernetes: a worker is a CSINode registering this driver
// with the node id, found on any page; another driver's registration or
// another node id is not one; a token the API server refuses is an
// error naming the RBAC it needs, not a worker missing.
func TestWorkersKubernetes(t *testing.T) {
	dir := t.TempDir()
	nodes := []storagev1.CSINode{
		csiNode("k1", storagev1.CSINodeDriver{Name: "other.csi.io", NodeID: "w-other"}),
		csiNode("k2", storagev1.CSINodeDriver{Name: DefaultDriverName, NodeID: "worker-2"}),
		csiNode("k3"),
		csiNode("k4", storagev1.CSINodeDriver{Name: "other.csi.io", NodeID: "k4"}, storagev1.CSINodeDriver{Name: DefaultDriverName, NodeID: "worker-4"}),
	}
	srv, calls := apiServer(t, "s3cret", nodes)
	ca := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := WorkersConfig{Source: WorkersKubernetes, APIServer: srv.URL, TokenFile: token, CA: ca}
	if err := cfg.validate(); err != nil {
		t.Fatal(err)
	}
	w, err := newWorkers(cfg, DefaultDriverName)
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
	if err := os.WriteFile(token, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := w.has(ctx, "worker-2"); err == nil || !strings.Contains(err.Error(), "csinodes") {
		t.Errorf("refused token: %v", err)
	}

	// Outside a pod with no api_server: a clear error at start.
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	if _, err := newWorkers(WorkersConfig{Source: WorkersKubernetes}, DefaultDriverName); err == nil || !strings.Contains(err.Error(), "not in a Kubernetes pod") {
		t.Errorf("no API server: %v", err)
	}
}

// TestWorkersList: the configured names, and any.
func TestWorkersList(t *testing.T) {
	w, err := newWorkers(WorkersConfig{Source: WorkersList, Names: []string{"a", "b"}}, DefaultDriverName)
	if err != nil {
		t.Fatal(err)
	}
	for id, want := range map[string]bool{"a": true, "b": true, "c": false} {
		if got, _ := w.has(context.Background(), id); got != want {
			t.Errorf("list: has(%q) = %v", id, got)
		}
	}
	a, _ := newWorkers(WorkersConfig{Source: WorkersAny}, DefaultDriverName)
	if got, _ := a.has(context.Background(), "anything"); !got {
		t.Error("any: refused a node id")
	}
}
