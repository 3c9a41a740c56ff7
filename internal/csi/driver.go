// The driver: the CSI services on a unix socket.

package csi

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/metrics"
	"github.com/rnbd/rnbd/pkg/log"
)

// Mode is which services a driver serves.
type Mode string

const (
	ModeController Mode = "controller"
	ModeNode       Mode = "node"
	ModeAll        Mode = "all"
)

// Driver serves the identity service and, by its mode, the controller
// and node services. It is safe for concurrent use: Listen, Serve,
// ServeMetrics and Stop may be called from different goroutines (mu
// guards what they share); the services serve calls concurrently.
type Driver struct {
	cfg  Config
	mode Mode
	log  *log.Entry
	ctrl *controller
	node *NodeServer
	// rpcs are the metrics of the calls answered; metrics serves them
	// (nil: no metrics_listen).
	rpcs *rpcMetrics

	mu sync.Mutex
	// +checklocks:mu
	metrics *metrics.Server
	// +checklocks:mu
	srv *grpc.Server
	// +checklocks:mu
	lis net.Listener
}

// NewDriver makes a driver of cfg in mode; log may be nil (log.L).
func NewDriver(cfg Config, mode Mode, l *log.Entry) (*Driver, error) {
	if l == nil {
		l = log.L
	}
	d := &Driver{cfg: cfg, mode: mode, log: l, rpcs: newRPCMetrics()}
	if mode != ModeController && mode != ModeNode && mode != ModeAll {
		return nil, fmt.Errorf("mode %q: want controller, node or all", mode)
	}
	if mode != ModeNode {
		if err := cfg.ValidateController(); err != nil {
			return nil, err
		}
		c, err := newController(cfg, l, d.rpcs)
		if err != nil {
			return nil, err
		}
		d.ctrl = c
	}
	if mode != ModeController {
		if err := cfg.ValidateNode(); err != nil {
			d.closeController()
			return nil, err
		}
		opts := NodeOptions{NodeID: cfg.Node.NodeID, Topology: cfg.Node.Labels, ClientSocket: cfg.Node.ClientSocket, Log: l}
		if keys := cfg.Node.TopologyFromNode; len(keys) > 0 {
			k, err := newKubeClient(cfg.Kubernetes)
			if err != nil {
				d.closeController()
				return nil, fmt.Errorf("[node] topology_from_node: %w", err)
			}
			opts.NodeLabels = func(ctx context.Context) (map[string]string, error) {
				labels, err := k.nodeLabels(ctx, cfg.Node.NodeID, keys)
				for _, key := range keys {
					if _, ok := labels[key]; !ok && err == nil {
						// Reported without it: the volumes of storage
						// nodes with that key are not accessible here.
						l.WithFields(log.Fields{"node": cfg.Node.NodeID, "label": key}).Warn("the Node has not the topology label")
					}
				}
				return labels, err
			}
		}
		d.node = NewNodeServer(opts)
	}
	return d, nil
}

// closeController stops what a controller made runs (its reconciler, its
// connections), where the driver is not made after all.
func (d *Driver) closeController() {
	if d.ctrl != nil {
		d.ctrl.close()
	}
}

// SocketPath is the file of an endpoint unix:///path (or unix:path, or
// a plain path).
func SocketPath(endpoint string) (string, error) {
	if !strings.Contains(endpoint, "://") && !strings.HasPrefix(endpoint, "unix:") {
		if endpoint == "" {
			return "", errors.New("no endpoint: want unix:///path/to/csi.sock")
		}
		return endpoint, nil
	}
	u, err := url.Parse(endpoint)
	if err != nil || u.Scheme != "unix" {
		return "", fmt.Errorf("endpoint %q: want unix:///path/to/csi.sock", endpoint)
	}
	p := u.Path
	if p == "" {
		p = u.Opaque
	}
	if p == "" {
		return "", fmt.Errorf("endpoint %q: no path", endpoint)
	}
	return filepath.Clean(p), nil
}

// Listen binds the endpoint's socket (one a dead driver left is
// removed; one another driver listens on is an error). Serve serves it.
func (d *Driver) Listen(endpoint string) (net.Addr, error) {
	path, err := SocketPath(endpoint)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, err
	}
	if err := ctl.ClearStaleSocket(path); err != nil {
		return nil, fmt.Errorf("endpoint %s: %w", path, err)
	}
	lis, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("endpoint %s: %w", path, err)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(d.logCalls))
	csi.RegisterIdentityServer(srv, &identity{d: d})
	if d.ctrl != nil {
		csi.RegisterControllerServer(srv, d.ctrl)
	}
	if d.node != nil {
		csi.RegisterNodeServer(srv, d.node)
	}
	d.mu.Lock()
	d.srv, d.lis = srv, lis
	d.mu.Unlock()
	d.log.WithFields(log.Fields{"endpoint": path, "mode": d.mode, "driver": d.cfg.DriverName}).Info("rnbd-csi listening")
	return lis.Addr(), nil
}

// ServeMetrics serves the driver's metrics at http://addr/metrics
// (HOST:PORT; a loopback or the pod's address), until Stop.
func (d *Driver) ServeMetrics(addr string) error {
	m, err := metrics.Listen(addr, d.rpcs, d.log)
	if err != nil {
		return err
	}
	d.mu.Lock()
	d.metrics = m
	d.mu.Unlock()
	return nil
}

// Serve serves until Stop.
func (d *Driver) Serve() error {
	d.mu.Lock()
	srv, lis := d.srv, d.lis
	d.mu.Unlock()
	if srv == nil {
		return errors.New("Serve before Listen")
	}
	err := srv.Serve(lis)
	if errors.Is(err, grpc.ErrServerStopped) {
		return nil
	}
	return err
}

// Stop lets the calls under way end, then closes the socket and
// removes it.
func (d *Driver) Stop() {
	d.mu.Lock()
	srv, lis, m := d.srv, d.lis, d.metrics
	d.mu.Unlock()
	if m != nil {
		m.Close()
	}
	if srv != nil {
		srv.GracefulStop()
	}
	if d.ctrl != nil {
		d.ctrl.close()
	}
	if srv == nil {
		return
	}
	if ua, ok := lis.Addr().(*net.UnixAddr); ok {
		os.Remove(ua.Name)
	}
}

// logCalls logs each call at debug, and a failed one at info with its
// error; and counts and times it (rpcMetrics).
func (d *Driver) logCalls(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	began := time.Now()
	resp, err := h(ctx, req)
	d.rpcs.observe(info.FullMethod, status.Code(err), time.Since(began))
	e := d.log.WithField("method", info.FullMethod)
	if err != nil {
		e.WithError(err).Info("CSI call failed")
	} else {
		e.Debug("CSI call")
	}
	return resp, err
}
