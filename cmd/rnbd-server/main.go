// Command rnbd-server exports files and block devices over RNBD/RTRS:
// "rnbd-server daemon" serves, the other commands control the running
// daemon through its socket. See docs/server.md.
package main

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/cli"
	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/output"
	"github.com/rnbd/rnbd/internal/serverd"
	"github.com/rnbd/rnbd/internal/units"
)

func main() { cli.Main("rnbd-server", newRoot()) }

func newRoot() *cobra.Command {
	var g cli.Globals
	root := &cobra.Command{
		Use:   "rnbd-server",
		Short: "Export files and block devices over RNBD/RTRS",
		Long: `rnbd-server exports files and block devices to rnbd clients over RTRS.

Run "rnbd-server daemon" to serve; the other commands control the running
daemon through its control socket.`,
		Example: `  rnbd-server daemon --config /etc/rnbd/server.toml
  rnbd-server map vol1 /dev/vg0/vol1 --allow-identity host7
  rnbd-server device list --format json
  rnbd-server session list --fields all`,
	}
	g.Add(root, serverd.DefaultControlSocket)
	g.AddRemote(root)
	root.AddCommand(
		newDaemon(),
		newMap(&g), newUnmap(&g), newResize(&g),
		newExport(&g), newDevice(&g), newSession(&g), newPath(&g), newStats(&g),
		newVolume(&g), newPool(&g),
	)
	root.AddCommand(cli.ConfigCmd("rnbd-server", serverd.DefaultConfigFile, func(path string, mustExist bool) conf.Findings {
		_, f := serverd.CheckAll(path, mustExist)
		return f
	}))
	root.AddCommand(g.CertCmd())
	g.AddVersion(root)
	root.AddCommand(cli.ManCmd(root, man))
	return root
}

func newDaemon() *cobra.Command {
	var configFile string
	cmd := &cobra.Command{
		Use:   "daemon",
		Short: "Run the server daemon (flags override the configuration file)",
		Example: `  rnbd-server daemon                          # /etc/rnbd/server.toml if it exists
  rnbd-server daemon --config /dev/null --listen tcp://127.0.0.1
  rnbd-server daemon --listen tcp://10.0.0.1 --listen tcp://10.0.1.1 --dev-search-path /srv/rnbd`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg, err := cli.DaemonConfig(cmd, serverd.LoadConfig, bindDaemonFlags)
			if err != nil {
				return err
			}
			if err := cli.SetupLog(cfg.LogLevel, cfg.LogFormat); err != nil {
				return err
			}
			if err := cfg.Validate(); err != nil {
				return cli.ConfigError(err)
			}
			return cli.RunDaemon(func() (cli.Daemon, error) {
				// The Go runtime's memory limit follows the chunk
				// budget, unless the operator set one (GOMEMLIMIT).
				return serverd.Start(cfg, serverd.Options{GoMemoryLimit: os.Getenv("GOMEMLIMIT") == ""})
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&configFile, "config", serverd.DefaultConfigFile, "TOML configuration file")
	over := serverd.DefaultConfig()
	bindDaemonFlags(f, &over)
	cli.CompleteFlag(cmd, "log-level", cli.CompleteFrom("error", "warn", "info", "debug"))
	cli.CompleteFlag(cmd, "log-format", cli.CompleteFrom("text", "json"))
	cli.CompleteFlag(cmd, "invalidate-by", cli.CompleteFrom("window", "registration"))
	cli.CompleteFlag(cmd, "config", cli.CompleteFiles("toml"))
	return cmd
}

// bindDaemonFlags binds daemon's flags to c's fields, each defaulting to
// its field's value (cli.DaemonConfig).
func bindDaemonFlags(f *pflag.FlagSet, c *serverd.Config) {
	f.StringArrayVar(&c.Listen, "listen", c.Listen, "address to listen on, tcp://HOST[:PORT] or rdma://HOST[:PORT] (repeatable; 0.0.0.0 is every IPv4 address, [::] every address of both families; default both transports on 0.0.0.0, RDMA where the machine has it)")
	f.StringVar(&c.DevSearchPath, "dev-search-path", c.DevSearchPath, "resolve device names beneath this directory (may contain %SESSNAME%)")
	f.BoolVar(&c.AllowMigration, "allow-migration", c.AllowMigration, "let devices under dev_search_path be opened with access_mode=migration beside a writer, as the kernel's server does")
	f.StringArrayVar(&c.SearchAllowFrom, "dev-search-path-allow-from", c.SearchAllowFrom, "a network (CIDR) or address that devices under dev_search_path may be opened from (repeatable; none: any)")
	f.StringArrayVar(&c.SearchAllowIdentities, "dev-search-path-allow-identity", c.SearchAllowIdentities, "a client identity (TLS certificate name) that may open devices under dev_search_path, NAME or NAME=ro|rw|migration (repeatable; none: any client)")
	f.IntVar(&c.QueueDepth, "queue-depth", c.QueueDepth, "chunks per path: requests in flight per client session")
	f.IntVar(&c.MaxChunkSize, "chunk-size", c.MaxChunkSize, "bytes per chunk, a power of two (the largest IO is 4 KiB less)")
	// Its default depends on the host: the help and the man page say
	// the rule, not this machine's number.
	f.Var(&c.MaxChunkMemory, "max-chunk-memory", "memory all paths may take together, chunks and connection buffers; a path past it is refused (0: no bound)")
	f.Lookup("max-chunk-memory").DefValue = "a quarter of RAM, at most 8GiB"
	f.Var(optSize{&c.MaxChunkMemoryPerClient}, "max-chunk-memory-per-client", "what one client (one identity with TLS, else one address) may hold of max-chunk-memory; a path past it is refused (0: no bound of its own)")
	f.Lookup("max-chunk-memory-per-client").DefValue = "a quarter of max-chunk-memory, at least 8 paths' worth"
	f.StringVar(&c.MetricsListen, "metrics-listen", c.MetricsListen, "HOST:PORT to serve Prometheus metrics on at /metrics (a loopback or management address; empty: none)")
	f.BoolVar(&c.BindSessionNames, "bind-session-names", c.BindSessionNames, "with TLS, a session name belongs to the client identity whose session first opens a device with it, kept in the state file; others are refused it")
	f.Float64Var(&c.NewPathRate, "new-path-rate", c.NewPathRate, "new paths one client (one address, and one identity with TLS) may make a second after a burst of --new-path-burst; more are refused with EAGAIN and retried (0: no bound)")
	f.IntVar(&c.NewPathBurst, "new-path-burst", c.NewPathBurst, "new paths one client may make at once before --new-path-rate applies")
	f.IntVar(&c.MaxSessionsPerClient, "max-sessions-per-client", c.MaxSessionsPerClient, "sessions one client may have: one identity with TLS, else one address (0: no bound); one more is refused with EUSERS")
	f.BoolVar(&c.AlwaysInvalidate, "always-invalidate", c.AlwaysInvalidate, "rotate each chunk's rkey after every IO")
	f.StringVar(&c.InvalidateBy, "invalidate-by", c.InvalidateBy, "how always_invalidate revokes a chunk's rkey on RDMA: window (memory windows bound by work requests, where the device has them) or registration")
	f.BoolVar(&c.DirectIO, "direct-io", c.DirectIO, "open backends with O_DIRECT")
	f.DurationVar(&c.HBInterval.Duration, "hb-interval", c.HBInterval.Duration, "heartbeat interval")
	f.DurationVar(&c.ExportRetry.Duration, "export-retry", c.ExportRetry.Duration, "how often an export that could not be served is tried again")
	f.IntVar(&c.HBMissedMax, "hb-missed-max", c.HBMissedMax, "heartbeats missed before a path is dead")
	f.StringVar(&c.TCPUserTimeout, "tcp-user-timeout", c.TCPUserTimeout, "how long data sent on a tcp:// path may stay unacknowledged before the connection is killed (TCP_USER_TIMEOUT), or off; raise it on networks with long round trips or heavy loss")
	f.StringVar(&c.ControlSocket, "control-socket", c.ControlSocket, "control socket path")
	f.StringVar(&c.StateFile, "state-file", c.StateFile, "where the explicit exports are kept")
	f.StringVar(&c.LogLevel, "log-level", c.LogLevel, "error, warn, info or debug")
	f.StringVar(&c.LogFormat, "log-format", c.LogFormat, "text or json")
	f.StringVar(&c.TLS.Cert, "tls-cert", c.TLS.Cert, "PEM certificate the server presents on tcp:// (with --tls-key and --tls-ca: TLS 1.3 only, client certificates required)")
	f.StringVar(&c.TLS.Key, "tls-key", c.TLS.Key, "PEM private key of --tls-cert")
	f.StringVar(&c.TLS.CA, "tls-ca", c.TLS.CA, "PEM authority that clients' certificates must chain to; their names are the identities of allow_identities")
	f.BoolVar(&c.TLS.AllowAnonymousClients, "tls-allow-anonymous-clients", c.TLS.AllowAnonymousClients, "accept a client certificate of --tls-ca that names no identity (no CN, no DNS, URI or e-mail SAN): such a client is counted by its address and may open the exports that grant no identities (default: refused with EACCES)")
}

// optSize is a flag of a size that is unset (nil) until given.
type optSize struct{ p **units.Size }

func (o optSize) String() string {
	if *o.p == nil {
		return "0"
	}
	return (*o.p).String()
}

func (o optSize) Set(s string) error {
	v := new(units.Size)
	if err := v.Set(s); err != nil {
		return err
	}
	*o.p = v
	return nil
}

func (o optSize) Type() string { return "size" }

func newMap(g *cli.Globals) *cobra.Command {
	var (
		req        api.MapRequest
		grantsOnly bool
	)
	cmd := &cobra.Command{
		Use:   "map NAME PATH",
		Short: "Export PATH (a file or block device) under NAME",
		Example: `  truncate -s 1G /srv/rnbd/disk0.img && rnbd-server map disk0 /srv/rnbd/disk0.img
  rnbd-server map vol1 /dev/vg0/vol1 --allow-identity host7 --allow-identity backup=ro
  rnbd-server map vol2 /dev/vg0/vol2 --allow host7 --allow-from 10.0.0.0/24 --max-sessions 1`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			p, err := filepath.Abs(args[1])
			if err != nil {
				return err
			}
			req.Name, req.Path = args[0], p
			if cmd.Flags().Changed("grants-only") {
				req.GrantsOnly = &grantsOnly
			}
			if err := g.Call(api.SrvExportMap, nil, nil, req, nil); err != nil {
				return err
			}
			if !g.Table() {
				// The export as export show gives it.
				var recs []output.Record
				if err := g.Call(api.SrvExport, args[:1], nil, nil, &recs); err != nil {
					return fmt.Errorf("exported %s as %s, but reading it back failed: %w", p, args[0], err)
				}
				fields := api.Fields[api.ExportRecord]()
				return g.Print(cmd.OutOrStdout(), "export", recs, fields, fields)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "exported %s as %s\n", p, args[0])
			return nil
		},
	}
	// NAME is new; PATH is a file or device.
	cmd.ValidArgsFunction = func(_ *cobra.Command, args []string, _ string) ([]string, cobra.ShellCompDirective) {
		if len(args) == 1 {
			return nil, cobra.ShellCompDirectiveDefault
		}
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	exportRuleFlags(g, cmd, &req, &grantsOnly)
	return cmd
}

// exportRuleFlags are the flags of an export's rules, map's and volume
// create's.
func exportRuleFlags(g *cli.Globals, cmd *cobra.Command, req *api.MapRequest, grantsOnly *bool) {
	f := cmd.Flags()
	f.BoolVar(&req.ReadOnly, "ro", false, "export read-only: sessions may only open it ro")
	f.StringArrayVar(&req.Allow, "allow", nil, "session allowed to open it (repeatable; default: every session)")
	f.StringArrayVar(&req.AllowFrom, "allow-from", nil, "network (CIDR) or address clients may open it from: the address of the path the OPEN arrives on (repeatable; default: any)")
	f.StringArrayVar(&req.AllowIdentities, "allow-identity", nil, "client identity allowed to open it, NAME or NAME=ro|rw|migration (the most it may open it for; default rw): a name of the client's TLS certificate, its subject common name or a DNS, URI or e-mail alternative name (repeatable; set, clients without TLS cannot open it)")
	f.BoolVar(grantsOnly, "grants-only", false, "only the identities granted (--allow-identity, export grant) may open it; with none, no client may (over the admin listener, the default; --grants-only=false opens it to every client the other rules admit)")
	f.IntVar(&req.MaxSessions, "max-sessions", 0, "sessions that may have it open at once (0: no bound); one more OPEN is refused with EUSERS")
	f.BoolVar(&req.Migration, "migration", false, "let a second session open it read-write with access_mode=migration beside a writer (live migration)")
	f.BoolVar(&req.WriteThrough, "write-through", false, "make every write durable when it completes, and show clients no write cache (they need not flush)")
	cli.CompleteFlag(cmd, "allow", g.CompleteNames("sessname", api.SrvSessions))
}

func newUnmap(g *cli.Globals) *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "unmap NAME",
		Short: "Withdraw an export (refused while open unless --force)",
		Example: `  rnbd-server unmap vol1
  rnbd-server unmap vol1 --force   # its sessions' IO then fails with ENOTCONN`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := g.Call(api.SrvExportUnmap, args, forceQuery(force), nil, nil); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "unmapped %s\n", args[0])
			return nil
		},
	}
	cmd.Flags().BoolVar(&force, "force", false, "close it for every session that has it open (their IO then fails with ENOTCONN)")
	cmd.ValidArgsFunction = g.CompleteNames("name", api.SrvExports)
	return cmd
}

// forceQuery is ?force=true if force.
func forceQuery(force bool) url.Values {
	if !force {
		return nil
	}
	return url.Values{"force": {"true"}}
}

func newResize(g *cli.Globals) *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:     "resize NAME SIZE",
		Short:   "Set an exported file's size (e.g. 20GiB); clients with it open learn it within seconds",
		Example: `  rnbd-server resize disk0 20GiB`,
		Long: `Set an exported file's size (e.g. 20GiB, a multiple of 512 bytes). rnbd
clients that have it open learn the new size within their size poll (5 s)
and apply it to their devices; the kernel's rnbd client learns it when it
remaps. Shrinking an export a session has open is refused unless --force.
A block device is resized by its own tools (lvextend, ...): clients learn
its new size the same way.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			var rsp api.ResizeResponse
			req := api.ResizeRequest{Size: args[1], Force: force}
			if err := g.Call(api.SrvExportResize, args[:1], nil, req, &rsp); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "resized %s from %d to %d bytes\n", args[0], rsp.Was, rsp.Now)
			return nil
		},
	}
	cmd.Flags().BoolVar(&force, "force", false, "shrink it even though sessions have it open (what lies past the new end is lost to them)")
	cmd.ValidArgsFunction = g.CompleteNames("name", api.SrvExports, cli.NoName)
	return cmd
}

func newExport(g *cli.Globals) *cobra.Command {
	cmd := &cobra.Command{Use: "export", Short: "List and show exports with their access rules (map and unmap change them); give and revoke grants"}
	cmd.AddCommand(g.ListCmds("export", api.SrvExports, api.SrvExport, "List exports with their access rules",
		"Show an export: its access rules, where it comes from, why it is not served", nil,
		[]string{"name", "path", "read_only", "allow", "allow_from", "allow_identities", "max_sessions", "migration", "write_through"}, api.Fields[api.ExportRecord]())...)
	cmd.AddCommand(exportGrantCmds(g)...)
	return cmd
}

func newDevice(g *cli.Globals) *cobra.Command {
	cmd := &cobra.Command{Use: "device", Short: "List, show and close exported devices"}
	cmd.AddCommand(g.ListCmds("device", api.SrvDevices, api.SrvDevice, "List exports and the devices sessions have open",
		"Show a device with every session that has it open", nil,
		[]string{"devname", "sessname", "mapping_path", "access_mode", "state"}, api.Fields[api.SrvDeviceRecord]())...)
	var session string
	closeCmd := &cobra.Command{
		Use:   "close NAME",
		Short: "Force-close a device for a session (all sessions without --session); its id stays reserved",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var resp api.CloseResponse
			if err := g.Call(api.SrvDeviceClose, args, nil, api.CloseRequest{Session: session}, &resp); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "closed %s for %d session(s)\n", args[0], resp.Closed)
			return nil
		},
	}
	closeCmd.Flags().StringVar(&session, "session", "", "only for this session")
	closeCmd.ValidArgsFunction = g.CompleteNames("devname", api.SrvDevices)
	cli.CompleteFlag(closeCmd, "session", g.CompleteNames("sessname", api.SrvSessions))
	cmd.AddCommand(closeCmd)
	return cmd
}

func newSession(g *cli.Globals) *cobra.Command {
	cmd := &cobra.Command{Use: "session", Short: "List, show and disconnect client sessions; list and free the session names bound to identities"}
	cmd.AddCommand(g.ListCmds("session", api.SrvSessions, api.SrvSession, "List client sessions", "Show a session", nil,
		[]string{"sessname", "state", "path_uu", "tx_bytes", "rx_bytes", "devices"}, api.Fields[api.SrvSessionRecord]())...)
	cmd.AddCommand(g.Command(cli.Action{Use: "disconnect NAME", Short: "Disconnect every path of a session (its devices close)", Args: 1,
		Route:    api.SrvSessionDisconnect,
		Done:     func(args []string) string { return "disconnecting " + args[0] },
		Complete: g.CompleteNames("sessname", api.SrvSessions),
	}))
	cmd.AddCommand(cli.Fields(&cobra.Command{
		Use:   "names",
		Short: "List the session names bound to client identities (TLS): only that identity may take the name",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			fields := api.Fields[api.SessionNameRecord]()
			return g.List(cmd.OutOrStdout(), api.SrvSessionNames, nil, nil, "session-name", fields, fields)
		},
	}, []string{"sessname", "identity"}))
	cmd.AddCommand(&cobra.Command{
		Use:               "bind NAME IDENTITY",
		ValidArgsFunction: g.CompleteNames("sessname", api.SrvSessionNames, cli.NoName),
		Short:             "Give a session name to a client identity (TLS), in advance or instead of another; a session that has it under another identity is disconnected",
		Args:              cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			var resp api.BindResponse
			if err := g.Call(api.SrvSessionNameBind, args[:1], nil, api.BindRequest{Identity: args[1]}, &resp); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "session name %s bound to %s", args[0], args[1])
			if resp.Disconnected > 0 {
				fmt.Fprint(cmd.OutOrStdout(), "; the session that had it under another identity was disconnected")
			}
			fmt.Fprintln(cmd.OutOrStdout())
			return nil
		},
	})
	cmd.AddCommand(&cobra.Command{
		Use:               "forget NAME",
		ValidArgsFunction: g.CompleteNames("sessname", api.SrvSessionNames),
		Short:             "Free a session name bound to an identity (not while a session has it): the next identity to take it binds it",
		Args:              cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := g.Call(api.SrvSessionNameForget, args, nil, nil, nil); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "session name %s freed\n", args[0])
			return nil
		},
	})
	return cmd
}

func newPath(g *cli.Globals) *cobra.Command {
	return g.PathCmd("List, show and disconnect paths", "client@server", api.SrvPaths, api.SrvPath,
		[]string{"sessname", "pathname", "state", "tx_bytes", "rx_bytes", "inflights"}, api.Fields[api.SrvPathRecord](),
		[]cli.PathOp{{Name: "disconnect", Route: api.SrvPathDisconnect, Short: "Disconnect a path (without waiting, as the kernel's)", Done: "disconnecting %s"}}, nil)
}

func newStats(g *cli.Globals) *cobra.Command {
	return g.StatsCmd("Show every path's stats/rdma (rd_cnt, rd_bytes, wr_cnt, wr_bytes) and inflight, or reset them", api.SrvStats, api.SrvStatsReset,
		api.Fields[api.SrvStatsRecord]())
}
