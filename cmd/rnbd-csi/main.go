// Command rnbd-csi is rnbd's Container Storage Interface driver: its
// identity, controller and node services on a unix socket, for
// Kubernetes' CSI sidecars and the kubelet. See internal/csi.
package main

import (
	"context"
	"errors"
	"fmt"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/rnbd/rnbd/internal/cli"
	"github.com/rnbd/rnbd/internal/csi"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/version"
	"github.com/rnbd/rnbd/pkg/log"
)

// defaultConfig is the configuration file where --config gives none.
const defaultConfig = "/etc/rnbd/csi.toml"

func main() { cli.Main("rnbd-csi", newRoot()) }

func newRoot() *cobra.Command {
	var mode, endpoint, configFile, level, nodeID, metricsListen string
	root := &cobra.Command{
		Use:   "rnbd-csi",
		Short: "rnbd's CSI driver: volumes on rnbd storage nodes for Kubernetes",
		Long: `rnbd-csi serves the CSI identity service and, by --mode, the controller
service, the node service, or both, on a unix socket. The controller creates,
publishes (grants to a worker), expands, snapshots and deletes volumes on the
storage nodes of its configuration, through their admin API. The node plugin
runs on each worker: it maps a published volume through the worker's
rnbd-client daemon, formats it (ext4 or xfs) only if it holds no file system,
mounts it, and undoes each step. docs/kubernetes.md describes it.`,
		Example: `  rnbd-csi --mode controller --endpoint unix:///csi/csi.sock --config /etc/rnbd/csi.toml
  rnbd-csi --mode node --node-id worker-1 --endpoint unix:///csi/csi.sock`,
		Args:    cobra.NoArgs,
		Version: version.Get().String(),
		RunE: func(cmd *cobra.Command, _ []string) error {
			lv, err := log.ParseLevel(level)
			if err != nil {
				return ctl.Errorf(ctl.CodeInvalid, "--log-level %q: %v", level, err)
			}
			log.SetLevel(lv)
			switch csi.Mode(mode) {
			case csi.ModeController, csi.ModeNode, csi.ModeAll:
			default:
				return ctl.Errorf(ctl.CodeInvalid, "--mode %q: want controller, node or all", mode)
			}
			cfg, err := csi.LoadConfig(configFile)
			if err != nil {
				// 3 missing, 7 unreadable, else 2 (rnbd-csi(8)).
				return cli.ConfigError(err)
			}
			if nodeID != "" {
				cfg.Node.NodeID = nodeID // one ConfigMap, a node id per worker
			}
			d, err := csi.NewDriver(cfg, csi.Mode(mode), log.L)
			if err != nil {
				return ctl.Errorf(ctl.CodeInvalid, "config %s: %v", configFile, err)
			}
			// A driver that cannot serve exits 1 whatever the errno
			// (rnbd-csi(8)), as the daemons do.
			if _, err := d.Listen(endpoint); err != nil {
				return ctl.Errorf(ctl.CodeInternal, "%v", err)
			}
			if metricsListen != "" {
				if err := d.ServeMetrics(metricsListen); err != nil {
					d.Stop()
					return ctl.Errorf(ctl.CodeInternal, "%v", err)
				}
			}
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			done := make(chan error, 1)
			go func() { done <- d.Serve() }()
			select {
			case err := <-done:
				return err
			case <-ctx.Done():
				log.L.Info("rnbd-csi stopping: the calls under way end first")
				d.Stop()
				if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
					return fmt.Errorf("serving: %w", err)
				}
				return nil
			}
		},
	}
	root.SetVersionTemplate("{{.Name}} {{.Version}}")
	// A daemon run from manifests: no completion command (the packages'
	// man pages are made by the hidden man command).
	root.CompletionOptions.DisableDefaultCmd = true
	root.AddCommand(cli.ManCmd(root, man))
	f := root.Flags()
	f.StringVar(&mode, "mode", "controller", "the services to serve: controller, node or all")
	f.StringVar(&endpoint, "endpoint", "unix:///csi/csi.sock", "the unix socket to serve on (unix:///path)")
	f.StringVar(&configFile, "config", defaultConfig, "the configuration file")
	f.StringVar(&level, "log-level", "info", "debug, info, warning or error")
	f.StringVar(&metricsListen, "metrics-listen", "", "HOST:PORT to serve Prometheus metrics on at /metrics: each CSI call counted by its gRPC code, and timed (empty: none)")
	f.StringVar(&nodeID, "node-id", "", "this worker's node id, over [node] node_id: the name of its rnbd-client's certificate (in Kubernetes, the node's name)")
	return root
}
