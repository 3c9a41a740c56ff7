// rnbd-csi's configuration file: the driver's name, the storage nodes
// the controller places volumes on (their admin listeners, the fabric
// paths clients map through, their topology labels), the controller's
// provisioner certificate, and the worker node's own settings.

package csi

import (
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
)

// DefaultDriverName is the driver's name where the configuration gives
// none: what a StorageClass's provisioner and the CSIDriver object name.
const DefaultDriverName = "rnbd.csi.rnbd.io"

// DefaultPort is the fabric port of a storage node where none is given.
const DefaultPort = 1234

// configVersion is the newest configuration format this driver reads.
const configVersion = 1

// Config is rnbd-csi's configuration file.
type Config struct {
	Version int `toml:"version"`
	// DriverName is the CSI driver's name (GetPluginInfo).
	DriverName string `toml:"driver_name"`
	// StorageNodes are the rnbd-server daemons volumes are placed on.
	StorageNodes []StorageNode `toml:"storage_node"`
	// TLS is the controller's certificate (an identity [admin]
	// provisioners names on every storage node), its key, and the CA of
	// the storage nodes' admin listeners.
	TLS conf.TLS `toml:"tls"`
	// Node is the worker node's side (the node service).
	Node NodeConfig `toml:"node"`
	// Workers is how the controller knows the worker nodes.
	Workers WorkersConfig `toml:"workers"`
	// Kubernetes is where the API server is, for [workers] source
	// kubernetes and [node] topology_from_node.
	Kubernetes KubernetesConfig `toml:"kubernetes"`
	// Controller bounds the controller's calls to the storage nodes.
	Controller ControllerConfig `toml:"controller"`
}

// ControllerConfig is [controller]: how long a storage node may take to
// answer one call, how many calls each gets at once, how often the
// controller looks for the copies of a name made while a node did not
// answer (reclaim.go).
type ControllerConfig struct {
	StorageTimeout    conf.Duration `toml:"storage_timeout"`
	MaxCallsPerNode   int           `toml:"max_calls_per_node"`
	MaxQueuedPerNode  int           `toml:"max_queued_per_node"`
	ReconcileInterval conf.Duration `toml:"reconcile_interval"`
	// MirrorReplaceAfter is how long a replicated volume's leg's
	// storage node may not answer before the reconciler makes the leg
	// anew on another (0: never; mirror_replace.go).
	MirrorReplaceAfter conf.Duration `toml:"mirror_replace_after"`
}

// Defaults of [controller]. MaxCallsPerNode stays under a storage
// node's max_requests_per_identity (control-api.md, "Bounds"), so the
// controller waits its turn here rather than being refused there.
const (
	DefaultStorageTimeout    = 5 * time.Second
	DefaultMaxCallsPerNode   = 16
	DefaultMaxQueuedPerNode  = 512
	DefaultReconcileInterval = time.Minute
	// DefaultMirrorReplaceAfter is longer than a storage node's
	// reboot, which the leg's resync from the mirror's bitmap mends for
	// less than a rebuild.
	DefaultMirrorReplaceAfter = 10 * time.Minute
)

func (c ControllerConfig) validate() error {
	var errs []error
	if d := c.StorageTimeout.Duration; d < 100*time.Millisecond || d > 10*time.Minute {
		errs = append(errs, fmt.Errorf("[controller] storage_timeout %v: want 100ms to 10m", d))
	}
	if c.MaxCallsPerNode < 1 || c.MaxQueuedPerNode < 0 {
		errs = append(errs, fmt.Errorf("[controller] max_calls_per_node %d, max_queued_per_node %d: want at least 1 and 0", c.MaxCallsPerNode, c.MaxQueuedPerNode))
	}
	if d := c.MirrorReplaceAfter.Duration; d < 0 {
		errs = append(errs, fmt.Errorf("[controller] mirror_replace_after %v: want 0 (never) or more", d))
	}
	if d := c.ReconcileInterval.Duration; d < time.Second {
		errs = append(errs, fmt.Errorf("[controller] reconcile_interval %v: want 1s or more", d))
	}
	return errors.Join(errs...)
}

// StorageNode is one rnbd-server: where its admin API listens, how
// clients reach its fabric, and where it stands (topology).
type StorageNode struct {
	// Name is the storage node's name: the first part of the volume
	// ids of its volumes ("<name>/<volume>"), so it never changes.
	Name string `toml:"name"`
	// Admin is its admin listener, https://HOST:PORT.
	Admin string `toml:"admin"`
	// Paths are the fabric addresses clients map its volumes through
	// ("ip:10.0.8.5"), one per path of a multipath session.
	Paths []string `toml:"paths"`
	// Port is its fabric port (DefaultPort where 0).
	Port int `toml:"port"`
	// Pool is the pool volumes go to where a StorageClass names none.
	Pool string `toml:"pool"`
	// Labels are its topology: a key and value per topology key
	// ("topology.kubernetes.io/zone" = "a"). A volume on it is
	// accessible from nodes with the same labels.
	Labels map[string]string `toml:"labels"`
}

// NodeConfig is the node service's: the local rnbd-client, the node's
// identity and its topology.
type NodeConfig struct {
	// ClientSocket is rnbd-client's control socket.
	ClientSocket string `toml:"client_socket"`
	// NodeID is the node's identity: a name of the certificate its
	// rnbd-client presents to the storage nodes (the identity a publish
	// grants).
	NodeID string `toml:"node_id"`
	// Labels are the node's topology (the same keys as the storage
	// nodes').
	Labels map[string]string `toml:"labels"`
	// TopologyFromNode are topology keys read from the labels of the
	// worker's Kubernetes Node (named by NodeID) at each NodeGetInfo:
	// one ConfigMap serves workers in different zones.
	TopologyFromNode []string `toml:"topology_from_node"`
}

// DefaultClientSocket is rnbd-client's control socket.
const DefaultClientSocket = "/run/rnbd/client.sock"

// DefaultConfig is the configuration before the file is read.
func DefaultConfig() Config {
	return Config{Version: configVersion, DriverName: DefaultDriverName, Node: NodeConfig{ClientSocket: DefaultClientSocket},
		Workers: WorkersConfig{Source: WorkersKubernetes},
		Controller: ControllerConfig{StorageTimeout: conf.Duration{Duration: DefaultStorageTimeout}, MaxCallsPerNode: DefaultMaxCallsPerNode,
			MaxQueuedPerNode: DefaultMaxQueuedPerNode, ReconcileInterval: conf.Duration{Duration: DefaultReconcileInterval},
			MirrorReplaceAfter: conf.Duration{Duration: DefaultMirrorReplaceAfter}}}
}

// LoadConfig reads the configuration file at path (which must exist)
// over the defaults and validates it. Unknown keys are errors.
func LoadConfig(path string) (Config, error) {
	cfg := DefaultConfig()
	if err := conf.LoadConfig(path, true, &cfg, func() int { return cfg.Version }, configVersion, &cfg.TLS); err != nil {
		return Config{}, err
	}
	for i := range cfg.StorageNodes {
		if cfg.StorageNodes[i].Port == 0 {
			cfg.StorageNodes[i].Port = DefaultPort
		}
	}
	if err := cfg.Validate(); err != nil {
		return Config{}, fmt.Errorf("config %s: %w", path, err)
	}
	return cfg, nil
}

// driverNameRE is the CSI spec's rule for a plugin name: at most 63
// characters, a domain name's (alphanumerics, '-', '.'), starting and
// ending with an alphanumeric.
var driverNameRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9.-]{0,61}[A-Za-z0-9])?$`)

// nodeNameRE: a storage node's name is part of volume ids, which must
// not hold a '/' in it.
var nodeNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

// Validate says what is wrong with the configuration, all of it at once.
func (c Config) Validate() error {
	var errs []error
	if !driverNameRE.MatchString(c.DriverName) {
		errs = append(errs, fmt.Errorf("driver_name %q: want at most 63 of A-Z a-z 0-9 . -, starting and ending with a letter or digit", c.DriverName))
	}
	seen := map[string]bool{}
	for i, n := range c.StorageNodes {
		where := fmt.Sprintf("storage_node %d", i+1)
		if n.Name != "" {
			where = fmt.Sprintf("storage_node %q", n.Name)
		}
		switch {
		case n.Name == "":
			errs = append(errs, fmt.Errorf("%s: no name", where))
		case !nodeNameRE.MatchString(n.Name):
			errs = append(errs, fmt.Errorf("%s: name: want 1 to 63 of A-Z a-z 0-9 . _ -, starting with a letter or digit", where))
		case seen[n.Name]:
			errs = append(errs, fmt.Errorf("%s: named twice", where))
		}
		seen[n.Name] = true
		if u, err := url.Parse(n.Admin); err != nil || u.Scheme != "https" || u.Host == "" || (u.Path != "" && u.Path != "/") {
			errs = append(errs, fmt.Errorf("%s: admin %q: want https://HOST:PORT (its admin listener)", where, n.Admin))
		}
		if len(n.Paths) == 0 {
			errs = append(errs, fmt.Errorf("%s: no paths: give the fabric addresses clients map through (paths = [\"ip:10.0.8.5\"])", where))
		}
		for _, p := range n.Paths {
			if !strings.HasPrefix(p, "ip:") && !strings.HasPrefix(p, "gid:") || strings.ContainsAny(p, " ,@") {
				errs = append(errs, fmt.Errorf("%s: path %q: want ip:ADDRESS (or gid:GID)", where, p))
			}
		}
		if n.Port < 1 || n.Port > 65535 {
			errs = append(errs, fmt.Errorf("%s: port %d: want 1 to 65535", where, n.Port))
		}
		if n.Pool == "" {
			errs = append(errs, fmt.Errorf("%s: no pool: name the pool volumes go to where a StorageClass names none", where))
		}
		for k := range n.Labels {
			if k == "" || strings.ContainsAny(k, " =,") {
				errs = append(errs, fmt.Errorf("%s: label %q: want a topology key (topology.kubernetes.io/zone)", where, k))
			}
		}
	}
	if err := c.TLS.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := c.Workers.validate(); err != nil {
		errs = append(errs, err)
	}
	if err := c.Kubernetes.validate(); err != nil {
		errs = append(errs, err)
	}
	if err := c.Controller.validate(); err != nil {
		errs = append(errs, err)
	}
	for _, k := range c.Node.TopologyFromNode {
		if k == "" || strings.ContainsAny(k, " =,") {
			errs = append(errs, fmt.Errorf("[node] topology_from_node %q: want a label key (topology.kubernetes.io/zone)", k))
		}
		if _, ok := c.Node.Labels[k]; ok {
			errs = append(errs, fmt.Errorf("[node] topology_from_node %q: also in [node] labels; give it in one of them", k))
		}
	}
	return errors.Join(errs...)
}

// ValidateController checks what the controller service needs beyond
// Validate: storage nodes, and the certificate it talks to them with.
func (c Config) ValidateController() error {
	var errs []error
	if len(c.StorageNodes) == 0 {
		errs = append(errs, errors.New("no [[storage_node]]: the controller places volumes on the storage nodes listed"))
	}
	if c.TLS.Cert == "" || c.TLS.Key == "" || c.TLS.CA == "" {
		errs = append(errs, errors.New("[tls] cert, key and ca are needed: the controller talks to the storage nodes' admin listeners with a provisioner's certificate"))
	}
	return errors.Join(errs...)
}

// ValidateNode checks what the node service needs: its identity and
// its rnbd-client's socket.
func (c Config) ValidateNode() error {
	var errs []error
	if c.Node.NodeID == "" {
		errs = append(errs, errors.New("[node] node_id is needed: the name of the certificate this node's rnbd-client presents (what a publish grants)"))
	}
	if c.Node.ClientSocket == "" {
		errs = append(errs, errors.New("[node] client_socket is empty: want rnbd-client's control socket"))
	}
	return errors.Join(errs...)
}

// storageNode is the storage node of that name, or nil.
func (c Config) storageNode(name string) *StorageNode {
	for i := range c.StorageNodes {
		if c.StorageNodes[i].Name == name {
			return &c.StorageNodes[i]
		}
	}
	return nil
}
