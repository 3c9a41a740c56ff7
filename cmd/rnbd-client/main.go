// Command rnbd-client maps remote RNBD devices and serves them to NBD
// clients: `rnbd-client daemon` holds the sessions and devices, the other
// commands talk to it over its control socket.
package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/cli"
	"github.com/rnbd/rnbd/internal/clientd"
	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/output"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

func main() { cli.Main("rnbd-client", newRoot()) }

func newRoot() *cobra.Command {
	var g cli.Globals
	root := &cobra.Command{
		Use:   "rnbd-client",
		Short: "Map remote RNBD devices and serve them as NBD devices",
		Example: `  rnbd-client daemon --config /etc/rnbd/client.toml
  rnbd-client map --sessname host7 --path ip:10.0.0.5 --path ip:10.0.1.5 --device-path vol1 --as nbd
  rnbd-client device list
  rnbd-client unmap rnbd0`,
	}
	g.Add(root, clientd.DefaultControlSocket)
	root.AddCommand(newDaemon(), newMap(&g), newUnmap(&g), newRemap(&g), newResize(&g), newReplaceLeg(&g),
		newDevice(&g), newSession(&g), newPath(&g), newStats(&g), newWait(&g), newDiscover(&g))
	root.AddCommand(cli.ConfigCmd("rnbd-client", clientd.DefaultConfigFile, func(path string, mustExist bool) conf.Findings {
		_, f := clientd.CheckAll(path, mustExist)
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
		Short: "Run the client daemon (flags override the configuration file)",
		Example: `  rnbd-client daemon                          # /etc/rnbd/client.toml if it exists
  rnbd-client daemon --config /dev/null --socket-dir /run/rnbd`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg, err := cli.DaemonConfig(cmd, clientd.LoadConfig, bindDaemonFlags)
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
				return clientd.Start(cfg, clientd.Options{})
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&configFile, "config", clientd.DefaultConfigFile, "TOML configuration file")
	over := clientd.DefaultConfig()
	bindDaemonFlags(f, &over)
	cli.CompleteFlag(cmd, "log-level", cli.CompleteFrom("error", "warn", "info", "debug"))
	cli.CompleteFlag(cmd, "log-format", cli.CompleteFrom("text", "json"))
	cli.CompleteFlag(cmd, "mpath-policy", cli.CompleteFrom(api.SettingValues["mpath_policy"]...))
	cli.CompleteFlag(cmd, "config", cli.CompleteFiles("toml"))
	return cmd
}

// bindDaemonFlags binds daemon's flags to c's fields, each defaulting to
// its field's value (cli.DaemonConfig).
func bindDaemonFlags(f *pflag.FlagSet, c *clientd.Config) {
	f.StringVar(&c.ControlSocket, "control-socket", c.ControlSocket, "control socket path")
	f.StringVar(&c.StateFile, "state-file", c.StateFile, "where the mappings are kept")
	f.StringVar(&c.SocketDir, "socket-dir", c.SocketDir, "where NBD sockets of mappings without --as go")
	// Its default depends on the host: the help and the man page say
	// the rule, not this machine's number.
	f.IntVar(&c.ConnsPerPath, "conns-per-path", c.ConnsPerPath, "IO connections per path")
	f.Lookup("conns-per-path").DefValue = "the number of CPUs"
	f.TextVar(&c.MPPolicy, "mpath-policy", c.MPPolicy, "round-robin, min-inflight or min-latency")
	f.IntVar(&c.MaxReconnectAttempts, "max-reconnect-attempts", c.MaxReconnectAttempts, "-1 forever, 0 never, or N")
	f.DurationVar(&c.NoPathTimeout.Duration, "no-path-timeout", c.NoPathTimeout.Duration, "how long IO waits when no path is connected (0: fail at once)")
	f.StringVar(&c.DevLinksDir, "dev-links-dir", c.DevLinksDir, "where kernel devices get stable names, DIR/SESSNAME/DEVICE_PATH (empty: none)")
	f.StringVar(&c.MetricsListen, "metrics-listen", c.MetricsListen, "HOST:PORT to serve Prometheus metrics on at /metrics (a loopback or management address; empty: none)")
	f.DurationVar(&c.ReconnectDelay.Duration, "reconnect-delay", c.ReconnectDelay.Duration, "wait before a path's first reconnect attempt, doubled after each failed one up to 30 s (or itself if longer); 100ms to 1h")
	f.StringVar(&c.CtrlLossTmo, "ctrl-loss-tmo", c.CtrlLossTmo, "a path down this long stops reconnecting, whatever max_reconnect_attempts allows (off: no bound)")
	f.StringVar(&c.FastIOFailTmo, "fast-io-fail-tmo", c.FastIOFailTmo, "after this long without a path, IO waiting for one fails and new IO fails at once (off: IO waits no_path_timeout)")
	f.DurationVar(&c.HBInterval.Duration, "hb-interval", c.HBInterval.Duration, "heartbeat interval")
	f.IntVar(&c.HBMissedMax, "hb-missed-max", c.HBMissedMax, "heartbeats missed before a path is dead")
	f.StringVar(&c.TCPUserTimeout, "tcp-user-timeout", c.TCPUserTimeout, "how long data sent on a tcp:// path may stay unacknowledged before the connection is killed and its IO fails over (TCP_USER_TIMEOUT), or off; raise it on networks with long round trips or heavy loss")
	f.DurationVar(&c.SizePoll.Duration, "size-poll", c.SizePoll.Duration, "how often sessions ask servers for their devices' sizes, which reach the devices (0: never; remap does)")
	f.DurationVar(&c.NBDIOTimeout.Duration, "nbd-io-timeout", c.NBDIOTimeout.Duration, "the kernel nbd driver's request timeout (0: longer than IO can wait in the daemon: no_path_timeout + failure detection + 10s)")
	f.IntVar(&c.UblkQueueDepth, "ublk-queue-depth", c.UblkQueueDepth, "requests in flight per ublk queue (one queue per CPU; each takes ublk_max_io_kb of registered memory)")
	f.IntVar(&c.UblkMaxIOKB, "ublk-max-io-kb", c.UblkMaxIOKB, "largest IO a ublk device takes in one request, KiB (4 to 1024; larger IO is split by the block layer)")
	f.Var(&c.MirrorResyncRate, "mirror-resync-rate", "how fast a mirror's resync copies, bytes a second (e.g. 200MiB), IO going on meanwhile")
	f.DurationVar(&c.MirrorSpareAfter.Duration, "mirror-spare-after", c.MirrorSpareAfter.Duration, "how long a mirror's leg stays out (its storage node not back) before the first of the mapping's --spare devices takes its place, rebuilt in full")
	f.DurationVar(&c.MirrorLegTimeout.Duration, "mirror-leg-timeout", c.MirrorLegTimeout.Duration, "how long a mirror's leg may hold requests without completing any before it is fenced and taken out (IO goes on with the other legs)")
	f.IntVar(&c.NBDBuffers, "nbd-buffers", c.NBDBuffers, "NBD requests of up to 1 MiB in flight per device served over NBD (each takes 1 MiB of registered memory)")
	f.StringVar(&c.LogLevel, "log-level", c.LogLevel, "error, warn, info or debug")
	f.StringVar(&c.LogFormat, "log-format", c.LogFormat, "text or json")
	f.StringVar(&c.TLS.Cert, "tls-cert", c.TLS.Cert, "PEM certificate the client presents on tcp:// (with --tls-key and --tls-ca: TLS 1.3 only); its names are the client's identity on servers")
	f.StringVar(&c.TLS.Key, "tls-key", c.TLS.Key, "PEM private key of --tls-cert")
	f.StringVar(&c.TLS.CA, "tls-ca", c.TLS.CA, "PEM authority that servers' certificates must chain to")
	f.StringVar(&c.TLS.ServerName, "tls-server-name", c.TLS.ServerName, "name to check servers' certificates against (default: the address dialed, an IP subject alternative name)")
}

func newMap(g *cli.Globals) *cobra.Command {
	var m api.Mapping
	port := cli.Port(rtrs.DefaultPort)
	var sets, legs, spares []string
	var witness, force string
	forceFrom := -1
	cmd := &cobra.Command{
		Use:   `map [--sessname S --path P... --device-path D | "sessname=S path=P device_path=D ..." | --mirror NAME --leg LEG...]`,
		Short: "Map a remote device and serve it (prints the device and its NBD socket)",
		Long: `Map a remote device. The parameters are the kernel's map_device tokens, as
flags or as its one-line string:

  rnbd-client map --sessname s1 --path ip:10.0.0.1 --path ip:10.0.1.1 --device-path vol1
  rnbd-client map "sessname=s1 path=ip:10.0.0.1 path=ip:10.0.1.1 device_path=vol1 access_mode=rw"

A path is [ip:SRC@]ip:DST; the port is --dest-port (default 1234).

A mirror is one device over 2 or 3 legs, each a device on a different
storage node, written to every leg and read from one (docs/replication.md).
Each --leg is a map string of its own session; --create makes the mirror's
metadata on new legs, once; a mirror that refuses to assemble (a leg that
may hold stale data is all it reaches) is served only with --force BY:

  rnbd-client map --mirror vol1 --create --leg "sessname=vol1-a path=ip:10.0.0.1 device_path=vol1" \
      --leg "sessname=vol1-b path=ip:10.0.0.2 device_path=vol1"`,
		Example: `  rnbd-client map --sessname host7 --path ip:10.0.0.5 --device-path vol1          # an NBD socket, or /dev/nbdN
  rnbd-client map --sessname host7 --path ip:10.0.0.5 --path ip:10.0.1.5 --device-path vol1 --as ublk
  rnbd-client map "sessname=host7 path=ip:10.0.0.5 device_path=vol1 access_mode=ro" --as socket:/run/rnbd/vol1.sock
  rnbd-client map --sessname host7 --path ip:10.0.0.5 --device-path vol1 --set no_path_timeout=30s`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 1 {
				line, err := clientd.ParseMapString(args[0])
				if err != nil {
					return err
				}
				merge(&m, line)
			}
			if cmd.Flags().Changed("dest-port") {
				m.DestPort = uint16(port)
			}
			for _, kv := range sets {
				k, v, ok := strings.Cut(kv, "=")
				if !ok {
					return ctl.Errorf(ctl.CodeInvalid, "--set %q: want KEY=VALUE", kv)
				}
				if err := m.Settings.Parse(k, v); err != nil {
					return err
				}
			}
			for _, l := range legs {
				leg, err := clientd.ParseLegString(l)
				if err != nil {
					return err
				}
				m.Legs = append(m.Legs, leg)
			}
			for _, l := range spares {
				leg, err := clientd.ParseLegString(l)
				if err != nil {
					return err
				}
				m.Spares = append(m.Spares, leg)
			}
			if witness != "" {
				w, err := clientd.ParseLegString(witness)
				if err != nil {
					return err
				}
				m.Witness = &w
			}
			if force != "" {
				m.Force = &api.MirrorForce{By: force, From: forceFrom}
			} else if cmd.Flags().Changed("force-from") {
				return ctl.Errorf(ctl.CodeInvalid, "--force-from goes with --force BY")
			}
			if m.Mirror != "" {
				fmt.Fprintf(cmd.ErrOrStderr(), "mapping mirror %s over %d legs...\n", m.Mirror, len(m.Legs))
			} else {
				fmt.Fprintf(cmd.ErrOrStderr(), "mapping %s through session %s (%s)...\n", m.DevicePath, m.SessName, strings.Join(m.Paths, ", "))
			}
			var out api.MapResponse
			if err := g.Call(api.CltMap, nil, nil, m, &out); err != nil {
				return err
			}
			if out.Note != "" {
				fmt.Fprintf(cmd.ErrOrStderr(), "%s: %s\n", out.Device, out.Note)
			}
			if !g.Table() {
				// The device as device show gives it.
				var recs []output.Record
				if err := g.Call(api.CltDevice, []string{out.Device}, nil, nil, &recs); err != nil {
					return fmt.Errorf("%s mapped, but reading it back failed: %w", out.Device, err)
				}
				fields := api.Fields[api.CltDeviceRecord]()
				return g.Print(cmd.OutOrStdout(), "device", recs, fields, fields)
			}
			if out.Kernel != "" {
				fmt.Fprintf(cmd.OutOrStdout(), "%s mapped: %s\n", out.Device, out.Kernel)
			} else {
				sock := strings.TrimPrefix(out.As, "socket:")
				fmt.Fprintf(cmd.OutOrStdout(), "%s mapped: nbd+unix:///%s?socket=%s\n", out.Device, cmp.Or(out.Mirror, out.DevicePath), sock)
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "unmap it with: rnbd-client unmap %s\n", out.Device)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&m.SessName, "sessname", "", "session name (the server sees it; devices of one session share its paths)")
	f.StringArrayVar(&m.Paths, "path", nil, "path [ip:SRC@]ip:DST (repeat for multipath)")
	f.StringVar(&m.DevicePath, "device-path", "", "the device's name on the server")
	f.StringVar(&m.AccessMode, "access-mode", "rw", "ro, rw or migration")
	f.Var(&port, "dest-port", "server port, 1 to 65535")
	f.StringVar(&m.Transport, "transport", "auto", "auto (RDMA when every path's addresses lead to an RDMA device, else TCP), tcp or rdma")
	f.StringVar(&m.Mirror, "mirror", "", "map a mirror of this name over the --leg devices")
	f.StringArrayVar(&legs, "leg", nil, `a mirror's leg: "sessname=S path=P... device_path=D [dest_port=N]", a session of its own to a storage node of its own (2 or 3)`)
	f.StringArrayVar(&spares, "spare", nil, "a mirror's spare, as a leg: a device on another storage node that takes the place of a leg out longer than mirror_spare_after, rebuilt in full (repeatable, tried in order)")
	f.StringVar(&witness, "witness", "", "a mirror's witness, as a leg: a small device on a third storage node that holds only metadata, so that two legs can lose one")
	f.StringVar(&m.RegionSize, "region-size", "", "with --create or --create-if-new: the new mirror's bitmap region, what a resync copies for each region written while a leg was away (default 4MiB)")
	f.StringVar(&m.Size, "size", "", "a mirror's data size at least: one with less (its legs made larger, a restore larger than its snapshot) grows to it before its device is made, if every leg is in sync")
	f.BoolVar(&m.Create, "create", false, "make the mirror's metadata on its legs (new devices: it refuses one that holds a mirror's)")
	f.StringVar(&m.Adopt, "adopt", "", "the mirror whose legs and witness these are copies of, one point in time (restored from its snapshots): assembled as after a crash, they take this mirror's name")
	f.BoolVar(&m.CreateIfNew, "create-if-new", false, "make the mirror's metadata where no assembly ever served it (blank devices, or a create that stopped part way), else map the mirror as it is: a script's first map and its retries")
	f.StringVar(&force, "force", "", "serve a mirror that refuses, without the proof that its legs are current; BY (who orders it) is logged and kept on the legs")
	f.IntVar(&forceFrom, "force-from", -1, "with --force: the leg to keep as the only source (-1: the mirror's choice)")
	f.StringArrayVar(&sets, "set", nil, "a setting of the session, KEY=VALUE: "+api.SettingKeys+" (repeatable; as session set, and kept across restarts)")
	cli.CompleteFlag(cmd, "sessname", g.CompleteNames("sessname", api.CltSessions))
	cli.CompleteFlag(cmd, "access-mode", cli.CompleteFrom("ro", "rw", "migration"))
	cli.CompleteFlag(cmd, "transport", cli.CompleteFrom("auto", "tcp", "rdma"))
	cli.CompleteFlag(cmd, "set", cli.CompleteSettings(api.SettingNames, api.SettingValues))
	cmd.ValidArgsFunction = cli.CompleteFrom() // the map string is free text
	f.StringVar(&m.As, "as", "", "nbd (a kernel /dev/nbdN over netlink), ublk (a kernel /dev/ublkbN) or socket:PATH (an NBD unix socket); default nbd where the nbd module is loaded, else a socket in the daemon's socket_dir (and map says so)")
	cli.CompleteFlag(cmd, "as", func(_ *cobra.Command, _ []string, toComplete string) ([]string, cobra.ShellCompDirective) {
		if strings.HasPrefix(toComplete, "socket:") {
			return nil, cobra.ShellCompDirectiveDefault // a path after it
		}
		var out []string
		for _, w := range []string{"nbd", "ublk", "socket:"} {
			if strings.HasPrefix(w, toComplete) {
				out = append(out, w)
			}
		}
		return out, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveNoSpace
	})
	return cmd
}

// merge fills what the flags left empty from the kernel-style line.
func merge(m *api.Mapping, line api.Mapping) {
	if m.SessName == "" {
		m.SessName = line.SessName
	}
	m.Paths = append(m.Paths, line.Paths...)
	if m.DevicePath == "" {
		m.DevicePath = line.DevicePath
	}
	if line.AccessMode != "" {
		m.AccessMode = line.AccessMode
	}
	if line.DestPort != 0 {
		m.DestPort = line.DestPort
	}
	m.Settings = m.Settings.Merge(line.Settings)
}

func devCmd(g *cli.Globals, use, short string, rt api.Route, body func() any, done string) *cobra.Command {
	return g.Command(cli.Action{Use: use, Short: short, Args: 1, Complete: g.CompleteNames("devname", api.CltDevices),
		Route: rt,
		Body:  func([]string) any { return body() },
		Done:  func(args []string) string { return args[0] + " " + done },
	})
}

func newUnmap(g *cli.Globals) *cobra.Command {
	var force bool
	cmd := devCmd(g, "unmap DEV", "Unmap a device (refused while NBD clients are connected, unless --force)", api.CltDeviceUnmap,
		func() any { return api.UnmapRequest{Force: force} }, "unmapped")
	cmd.Flags().BoolVar(&force, "force", false, "disconnect its NBD clients first")
	return cmd
}

func newRemap(g *cli.Globals) *cobra.Command {
	return devCmd(g, "remap DEV", "Open the device on the server again and refresh its size and limits", api.CltDeviceRemap,
		func() any { return nil }, "remapped")
}

func newResize(g *cli.Globals) *cobra.Command {
	return g.Command(cli.Action{Use: "resize DEV SIZE", Args: 2, Complete: g.CompleteNames("devname", api.CltDevices, cli.NoName),
		Short: "Set the size the device shows (at most the remote size; seen by new NBD connections); grow a mirror once its legs have",
		Route: api.CltDeviceSize,
		Body:  func(args []string) any { return api.DeviceResizeRequest{Size: args[1]} },
		Done:  func(args []string) string { return args[0] + " resized to " + args[1] },
	})
}

func newReplaceLeg(g *cli.Globals) *cobra.Command {
	return &cobra.Command{
		Use:   `replace-leg DEV LEG "sessname=S path=P... device_path=D [dest_port=N]"`,
		Short: "Put a new device in the place of a mirror's leg (0, 1, 2) or witness whose storage node is gone for good",
		Long: `Put a new device, on a storage node of its own, in the place of a mirror's leg
or witness that is out (its storage node gone for good). The new leg is
written at once and rebuilt in full in the background (device show DEV shows
the progress; rnbd-client wait waits for it), then read; the mapping keeps it
across restarts. A leg in sync, or one resyncing, is not replaced.`,
		Example: `  rnbd-client replace-leg rnbd0 1 "sessname=vol1-c path=ip:10.0.0.3 device_path=vol1"`,
		Args:    cobra.ExactArgs(3),
		ValidArgsFunction: func(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
			if len(args) == 0 {
				return g.CompleteNames("devname", api.CltDevices)(cmd, args, toComplete)
			}
			if len(args) == 1 {
				return []string{"0", "1", "2", "witness"}, cobra.ShellCompDirectiveNoFileComp
			}
			return nil, cobra.ShellCompDirectiveNoFileComp
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := clientd.ParseLegString(args[2])
			if err != nil {
				return err
			}
			if err := g.Call(api.CltDeviceLeg, args[:2], nil, l, nil); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: leg %s replaced by %s/%s; rebuilding\n", args[0], args[1], l.SessName, l.DevicePath)
			return nil
		},
	}
}

func newDevice(g *cli.Globals) *cobra.Command {
	cmd := &cobra.Command{Use: "device", Short: "List and show mapped devices"}
	cmd.AddCommand(g.ListCmds("device", api.CltDevices, api.CltDevice, "List devices", "Show a device with every field", nil,
		[]string{"devname", "sessname", "mapping_path", "access_mode", "state", "size", "socket"}, api.Fields[api.CltDeviceRecord]())...)
	return cmd
}

func newSession(g *cli.Globals) *cobra.Command {
	cmd := &cobra.Command{Use: "session", Short: "List, show, reconnect and tune sessions"}
	cmd.AddCommand(g.ListCmds("session", api.CltSessions, api.CltSession, "List sessions", "Show a session with every field", nil,
		[]string{"sessname", "state", "path_uu", "mpath_policy", "tx_bytes", "rx_bytes", "devices"}, api.Fields[api.CltSessionRecord]())...)
	cmd.AddCommand(g.Command(cli.Action{Use: "reconnect NAME", Short: "Reconnect every path of a session", Args: 1,
		Complete: g.CompleteNames("sessname", api.CltSessions),
		Route:    api.CltSessionReconnect,
		Done:     func(args []string) string { return args[0] + " reconnected" },
	}), &cobra.Command{
		Use:   "set NAME KEY=VALUE...",
		Short: "Set " + api.SettingKeys + " of a session (kept across restarts)",
		Example: `  rnbd-client session set host7 mpath_policy=round-robin
  rnbd-client session set host7 no_path_timeout=30s fast_io_fail_tmo=10s`,
		Args: cobra.MinimumNArgs(2),
		ValidArgsFunction: func(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
			if len(args) == 0 {
				return g.CompleteNames("sessname", api.CltSessions)(cmd, args, toComplete)
			}
			return cli.CompleteSettings(api.SettingNames, api.SettingValues)(cmd, args, toComplete)
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			var req api.SetRequest
			for _, kv := range args[1:] {
				k, v, ok := strings.Cut(kv, "=")
				if !ok {
					return ctl.Errorf(ctl.CodeInvalid, "%q: want KEY=VALUE", kv)
				}
				if err := req.Parse(k, v); err != nil {
					return err
				}
			}
			if err := g.Call(api.CltSessionSet, args[:1], nil, req, nil); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s updated\n", args[0])
			return nil
		},
	})
	return cmd
}

func newPath(g *cli.Globals) *cobra.Command {
	return g.PathCmd("List, show, add, remove, reconnect and disconnect paths", "src@dst", api.CltPaths, api.CltPath,
		[]string{"sessname", "pathname", "state", "tx_bytes", "rx_bytes", "inflights"}, api.Fields[api.CltPathRecord](),
		[]cli.PathOp{
			{Name: "remove", Route: api.CltPathRemove, Short: "Disconnect a path and remove it from its session", Done: "path %s removed"},
			{Name: "reconnect", Route: api.CltPathReconnect, Short: "Reconnect a path now", Done: "path %s reconnected"},
			{Name: "disconnect", Route: api.CltPathDisconnect, Short: "Disconnect a path (it stays until reconnected or removed)", Done: "path %s disconnected"},
		},
		func(func() url.Values) []*cobra.Command {
			// The session is the path's: its one argument (the route's
			// only name), the path in the body.
			return []*cobra.Command{g.Command(cli.Action{Use: "add SESSION PATH", Short: "Add a path ([ip:SRC@]ip:DST) to a session and connect it", Args: 2,
				Complete: g.CompleteNames("sessname", api.CltSessions, cli.NoName),
				Route:    api.CltSessionAddPath,
				Body:     func(args []string) any { return api.PathRequest{Path: args[1]} },
				Done:     func(args []string) string { return "path " + args[1] + " added to " + args[0] },
			})}
		})
}

func newStats(g *cli.Globals) *cobra.Command {
	return g.StatsCmd("Show every path's stats/rdma, stats/reconnects and cur_latency_us, or reset them", api.CltStats, api.CltStatsReset,
		api.Fields[api.CltStatsRecord]())
}

// newWait is `rnbd-client wait`: for boot scripts and units ordered
// after the daemon, it waits for the daemon to answer and for every
// mapping to be open on its server.
func newWait(g *cli.Globals) *cobra.Command {
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:     "wait",
		Short:   "Wait until the daemon answers and every mapping is open on its server (exit 0), or say which is not",
		Example: `  rnbd-client wait --timeout 90s`,
		Long: `Wait until the daemon answers and every mapping is open on its server.

Mappings come back from the state file when the daemon starts. One whose
server did not answer then (state "restoring") is tried again in the
background, and wait waits for it; one whose entry in the state file is
invalid (state "not restored") never comes up by itself, and wait fails
at once naming it. Otherwise wait fails after --timeout naming the
devices still not open.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			for {
				recs, err := api.NewClient(g.Client()).Devices(ctx)
				var waiting, lost []string
				for _, r := range recs {
					name := r.DevName
					switch st := r.State; st {
					case "open":
					case clientd.StateNotRestored:
						lost = append(lost, name)
					default:
						waiting = append(waiting, name+" ("+st+")")
					}
				}
				switch {
				case err != nil && ctx.Err() == nil && !errors.Is(err, ctl.ErrNotRunning):
					return err
				case err == nil && len(lost) > 0:
					return ctl.Errorf(ctl.CodeUnavailable, "not restored at start, invalid in the state file (see the daemon's log; unmap or map them again): %s", strings.Join(lost, ", "))
				case err == nil && len(waiting) == 0:
					fmt.Fprintf(cmd.OutOrStdout(), "%d device(s) open\n", len(recs))
					return nil
				}
				select {
				case <-ctx.Done():
					if err != nil {
						return ctl.Errorf(ctl.CodeUnavailable, "the daemon did not answer within %v: %v", timeout, err)
					}
					return ctl.Errorf(ctl.CodeUnavailable, "not open after %v: %s", timeout, strings.Join(waiting, ", "))
				case <-time.After(200 * time.Millisecond):
				}
			}
		},
	}
	cmd.Flags().DurationVar(&timeout, "timeout", 90*time.Second, "how long to wait")
	return cmd
}
