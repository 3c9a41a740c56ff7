// Which worker nodes exist: a publish to a node id no worker has is
// NotFound, as the CSI spec asks, not a grant to an identity nobody
// holds. In Kubernetes the workers are the CSINode objects that list
// this driver (node-driver-registrar writes them from NodeGetInfo);
// elsewhere the configuration lists them.

package csi

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	storagev1 "k8s.io/api/storage/v1"
)

// Where the controller learns the workers ([workers] source).
const (
	// WorkersKubernetes: the CSINode objects of the cluster the
	// controller runs in, read with its service account.
	WorkersKubernetes = "kubernetes"
	// WorkersList: the node ids of [workers] names.
	WorkersList = "list"
	// WorkersAny: no check; a publish grants any node id.
	WorkersAny = "any"
)

// In-cluster defaults: where a pod finds the API server and its
// service account's token and CA.
const (
	serviceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount"
	defaultTokenFile  = serviceAccountDir + "/token"
	defaultAPICAFile  = serviceAccountDir + "/ca.crt"
)

// WorkersConfig is [workers]: how the controller knows the worker
// nodes a volume may be published to.
type WorkersConfig struct {
	// Source is kubernetes (the default), list or any.
	Source string `toml:"source"`
	// Names are the workers' node ids (source list).
	Names []string `toml:"names"`
	// APIServer is the Kubernetes API server (source kubernetes):
	// https://HOST:PORT; where empty, the pod's own
	// (KUBERNETES_SERVICE_HOST and _PORT).
	APIServer string `toml:"api_server"`
	// TokenFile is the bearer token (the service account's where empty).
	// It is read again at each look, as Kubernetes rotates it.
	TokenFile string `toml:"token_file"`
	// CA is the API server's CA (the service account's where empty).
	CA string `toml:"ca"`
}

// validate says what is wrong with [workers].
func (w WorkersConfig) validate() error {
	var errs []error
	switch w.Source {
	case WorkersKubernetes:
		if w.APIServer != "" {
			if u, err := url.Parse(w.APIServer); err != nil || u.Scheme != "https" || u.Host == "" {
				errs = append(errs, fmt.Errorf("[workers] api_server %q: want https://HOST:PORT", w.APIServer))
			}
		}
	case WorkersList:
		if len(w.Names) == 0 {
			errs = append(errs, errors.New("[workers] source list: no names: give the workers' node ids (names = [\"worker-1\"])"))
		}
		for _, n := range w.Names {
			if n == "" {
				errs = append(errs, errors.New("[workers] names: an empty node id"))
			}
		}
	case WorkersAny:
	default:
		errs = append(errs, fmt.Errorf("[workers] source %q: want kubernetes, list or any", w.Source))
	}
	if w.Source != WorkersList && len(w.Names) > 0 {
		errs = append(errs, fmt.Errorf("[workers] names are for source list, not %s", w.Source))
	}
	if w.Source != WorkersKubernetes && (w.APIServer != "" || w.TokenFile != "" || w.CA != "") {
		errs = append(errs, fmt.Errorf("[workers] api_server, token_file and ca are for source kubernetes, not %s", w.Source))
	}
	return errors.Join(errs...)
}

// workers answers whether a node id is a worker's.
type workers interface {
	// has: the worker exists. An error is the look failing (the CO
	// retries), not the worker missing.
	has(ctx context.Context, nodeID string) (bool, error)
	// String says where the workers were looked for.
	String() string
}

func newWorkers(cfg WorkersConfig, driverName string) (workers, error) {
	switch cfg.Source {
	case WorkersList:
		m := make(nameSet, len(cfg.Names))
		for _, n := range cfg.Names {
			m[n] = true
		}
		return m, nil
	case WorkersAny:
		return anyWorker{}, nil
	}
	return newCSINodes(cfg, driverName)
}

type nameSet map[string]bool

func (s nameSet) has(_ context.Context, id string) (bool, error) { return s[id], nil }

func (s nameSet) String() string { return "not one of [workers] names" }

type anyWorker struct{}

func (anyWorker) has(context.Context, string) (bool, error) { return true, nil }

func (anyWorker) String() string { return "any node id is taken" }

// csiNodes looks the node id up among the cluster's CSINode objects:
// a worker is one whose kubelet registered this driver with that node
// id. It lists them (a page at a time) rather than get one by name, as
// a node id need not be its node's name.
type csiNodes struct {
	base       string // https://HOST:PORT
	tokenFile  string
	driverName string
	hc         *http.Client
	pageSize   int
}

func newCSINodes(cfg WorkersConfig, driverName string) (*csiNodes, error) {
	base := cfg.APIServer
	if base == "" {
		host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
		if host == "" || port == "" {
			return nil, errors.New("[workers] source kubernetes: not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST and _PORT): give api_server, or source = \"list\" with the workers' node ids")
		}
		base = "https://" + net.JoinHostPort(host, port)
	}
	tokenFile, caFile := cfg.TokenFile, cfg.CA
	if tokenFile == "" {
		tokenFile = defaultTokenFile
	}
	if caFile == "" {
		caFile = defaultAPICAFile
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("[workers] ca: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("[workers] ca %s: no PEM certificate in it", caFile)
	}
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}
	return &csiNodes{base: strings.TrimSuffix(base, "/"), tokenFile: tokenFile, driverName: driverName,
		hc: &http.Client{Transport: tr, Timeout: 20 * time.Second}, pageSize: 500}, nil
}

func (k *csiNodes) String() string {
	return "no CSINode registers driver " + k.driverName + " with that node id (is its node plugin running?)"
}

func (k *csiNodes) has(ctx context.Context, id string) (bool, error) {
	token, err := os.ReadFile(k.tokenFile)
	if err != nil {
		return false, fmt.Errorf("the service account's token: %w", err)
	}
	cont := ""
	for {
		q := url.Values{"limit": {fmt.Sprint(k.pageSize)}}
		if cont != "" {
			q.Set("continue", cont)
		}
		list, err := k.get(ctx, "/apis/storage.k8s.io/v1/csinodes?"+q.Encode(), strings.TrimSpace(string(token)))
		if err != nil {
			return false, err
		}
		for _, n := range list.Items {
			for _, d := range n.Spec.Drivers {
				if d.Name == k.driverName && d.NodeID == id {
					return true, nil
				}
			}
		}
		if cont = list.Continue; cont == "" {
			return false, nil
		}
	}
}

func (k *csiNodes) get(ctx context.Context, path, token string) (*storagev1.CSINodeList, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, k.base+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Accept", "application/json")
	resp, err := k.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("listing CSINodes: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("listing CSINodes: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		hint := ""
		if resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden {
			hint = " (the controller's service account needs get and list on storage.k8s.io csinodes: deploy/kubernetes/rbac-controller.yaml)"
		}
		return nil, fmt.Errorf("listing CSINodes: %s%s: %.200s", resp.Status, hint, body)
	}
	var list storagev1.CSINodeList
	if err := json.Unmarshal(body, &list); err != nil {
		return nil, fmt.Errorf("listing CSINodes: %w", err)
	}
	return &list, nil
}
