// A small client of the Kubernetes API, for the two things rnbd-csi
// asks of it: which workers registered the driver (the controller) and
// the topology labels of the worker's own Node (the node plugin). GETs
// with the pod's service account, no watch, no cache: both are rare
// (a publish, a registration).

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

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// In-cluster defaults: where a pod finds its service account's token
// and the API server's CA.
const (
	serviceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount"
	defaultTokenFile  = serviceAccountDir + "/token"
	defaultAPICAFile  = serviceAccountDir + "/ca.crt"
)

// KubernetesConfig is [kubernetes]: where the API server is. Empty
// keys are the pod's own, which is what a driver in the cluster wants.
type KubernetesConfig struct {
	// APIServer is https://HOST:PORT; where empty, the pod's
	// (KUBERNETES_SERVICE_HOST and _PORT).
	APIServer string `toml:"api_server"`
	// TokenFile is the bearer token (the service account's where empty).
	// It is read again at each call, as Kubernetes rotates it.
	TokenFile string `toml:"token_file"`
	// CA is the API server's CA (the service account's where empty).
	CA string `toml:"ca"`
}

func (k KubernetesConfig) validate() error {
	if k.APIServer == "" {
		return nil
	}
	if u, err := url.Parse(k.APIServer); err != nil || u.Scheme != "https" || u.Host == "" || (u.Path != "" && u.Path != "/") {
		return fmt.Errorf("[kubernetes] api_server %q: want https://HOST:PORT", k.APIServer)
	}
	return nil
}

type kubeClient struct {
	base      string // https://HOST:PORT
	tokenFile string
	hc        *http.Client
}

func newKubeClient(cfg KubernetesConfig) (*kubeClient, error) {
	base := cfg.APIServer
	if base == "" {
		host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
		if host == "" || port == "" {
			return nil, errors.New("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST and _PORT): give [kubernetes] api_server")
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
		return nil, fmt.Errorf("the API server's CA: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("the API server's CA %s: no PEM certificate in it", caFile)
	}
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}
	return &kubeClient{base: strings.TrimSuffix(base, "/"), tokenFile: tokenFile, hc: &http.Client{Transport: tr, Timeout: 20 * time.Second}}, nil
}

// get decodes the JSON object at path (with its query) into into.
func (k *kubeClient) get(ctx context.Context, path string, into any) error {
	token, err := os.ReadFile(k.tokenFile)
	if err != nil {
		return fmt.Errorf("the service account's token: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, k.base+path, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
	req.Header.Set("Accept", "application/json")
	resp, err := k.hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		hint := ""
		if resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden {
			hint = " (the RBAC of deploy/kubernetes/rbac-*.yaml gives the service account what it reads)"
		}
		return fmt.Errorf("GET %s: %s%s: %.200s", path, resp.Status, hint, body)
	}
	return json.Unmarshal(body, into)
}

// nodeLabels are the values of keys among the labels of the Node
// named name; a key the Node has not is left out.
func (k *kubeClient) nodeLabels(ctx context.Context, name string, keys []string) (map[string]string, error) {
	var n metav1.PartialObjectMetadata
	if err := k.get(ctx, "/api/v1/nodes/"+url.PathEscape(name), &n); err != nil {
		return nil, fmt.Errorf("the labels of Node %s: %w", name, err)
	}
	out := map[string]string{}
	for _, key := range keys {
		if v, ok := n.Labels[key]; ok {
			out[key] = v
		}
	}
	return out, nil
}
