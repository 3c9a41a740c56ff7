// Which worker nodes exist: a publish to a node id no worker has is
// NotFound, as the CSI spec asks, not a grant to an identity nobody
// holds. In Kubernetes the workers are the CSINode objects that list
// this driver (node-driver-registrar writes them from NodeGetInfo);
// elsewhere the configuration lists them.

package csi

import (
	"context"
	"errors"
	"fmt"
	"net/url"

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

// WorkersConfig is [workers]: how the controller knows the worker
// nodes a volume may be published to.
type WorkersConfig struct {
	// Source is kubernetes (the default), list or any.
	Source string `toml:"source"`
	// Names are the workers' node ids (source list).
	Names []string `toml:"names"`
}

// validate says what is wrong with [workers].
func (w WorkersConfig) validate() error {
	var errs []error
	switch w.Source {
	case WorkersKubernetes, WorkersAny:
	case WorkersList:
		if len(w.Names) == 0 {
			errs = append(errs, errors.New("[workers] source list: no names: give the workers' node ids (names = [\"worker-1\"])"))
		}
		for _, n := range w.Names {
			if n == "" {
				errs = append(errs, errors.New("[workers] names: an empty node id"))
			}
		}
	default:
		errs = append(errs, fmt.Errorf("[workers] source %q: want kubernetes, list or any", w.Source))
	}
	if w.Source != WorkersList && len(w.Names) > 0 {
		errs = append(errs, fmt.Errorf("[workers] names are for source list, not %s", w.Source))
	}
	return errors.Join(errs...)
}

// workers answers whether a node id is a worker's, and where it stands.
type workers interface {
	// has: the worker exists. An error is the look failing (the CO
	// retries), not the worker missing.
	has(ctx context.Context, nodeID string) (bool, error)
	// topology is the worker's topology, the values of the keys it
	// reported in NodeGetInfo; known false where the source cannot
	// tell (then a publish is not held to it).
	topology(ctx context.Context, nodeID string) (segs map[string]string, known bool, err error)
	// String says where the workers were looked for.
	String() string
}

func newWorkers(cfg WorkersConfig, kc KubernetesConfig, driverName string) (workers, error) {
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
	k, err := newKubeClient(kc)
	if err != nil {
		return nil, fmt.Errorf("[workers] source kubernetes (the default): %w; outside Kubernetes, list the workers (source = \"list\", names = [...])", err)
	}
	return &csiNodes{kube: k, driverName: driverName, pageSize: 500}, nil
}

type nameSet map[string]bool

func (s nameSet) has(_ context.Context, id string) (bool, error) { return s[id], nil }

func (s nameSet) String() string { return "not one of [workers] names" }

func (nameSet) topology(context.Context, string) (map[string]string, bool, error) {
	return nil, false, nil
}

type anyWorker struct{}

func (anyWorker) has(context.Context, string) (bool, error) { return true, nil }

func (anyWorker) String() string { return "any node id is taken" }

func (anyWorker) topology(context.Context, string) (map[string]string, bool, error) {
	return nil, false, nil
}

// csiNodes looks the node id up among the cluster's CSINode objects:
// a worker is one whose kubelet registered this driver with that node
// id. It lists them (a page at a time) rather than get one by name, as
// a node id need not be its node's name.
type csiNodes struct {
	kube       *kubeClient
	driverName string
	pageSize   int
}

func (k *csiNodes) String() string {
	return "no CSINode registers driver " + k.driverName + " with that node id (is its node plugin running?)"
}

func (k *csiNodes) has(ctx context.Context, id string) (bool, error) {
	n, _, err := k.find(ctx, id)
	return n != "", err
}

// topology is the worker's topology: the keys its driver registered in
// its CSINode, with the values its Node's labels give them (the kubelet
// writes a registered plugin's topology onto its Node).
func (k *csiNodes) topology(ctx context.Context, id string) (map[string]string, bool, error) {
	node, keys, err := k.find(ctx, id)
	if err != nil || node == "" {
		return nil, false, err
	}
	labels, err := k.kube.nodeLabels(ctx, node, keys)
	return labels, err == nil, err
}

// find is the name of the Node whose CSINode registers this driver with
// node id id, and the topology keys it registered ("" if none does).
func (k *csiNodes) find(ctx context.Context, id string) (node string, keys []string, err error) {
	cont := ""
	for {
		q := url.Values{"limit": {fmt.Sprint(k.pageSize)}}
		if cont != "" {
			q.Set("continue", cont)
		}
		var list storagev1.CSINodeList
		if err := k.kube.get(ctx, "/apis/storage.k8s.io/v1/csinodes?"+q.Encode(), &list); err != nil {
			return "", nil, fmt.Errorf("listing CSINodes: %w", err)
		}
		for _, n := range list.Items {
			for _, d := range n.Spec.Drivers {
				if d.Name == k.driverName && d.NodeID == id {
					return n.Name, d.TopologyKeys, nil
				}
			}
		}
		if cont = list.Continue; cont == "" {
			return "", nil, nil
		}
	}
}
