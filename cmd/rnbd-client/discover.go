package main

import (
	"context"
	"time"

	"github.com/spf13/cobra"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/cli"
	"github.com/rnbd/rnbd/internal/clientd"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/output"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// newDiscover is `rnbd-client discover`: the exports a server grants this
// client's identity, asked of its admin listener with the client's own
// certificate (docs/control-api.md, "Discovery"). The daemon is not
// involved: the command talks to the server itself.
func newDiscover(g *cli.Globals) *cobra.Command {
	var path, configFile string
	port := cli.Port(ctl.DefaultAdminPort)
	var t clientd.Config
	cmd := &cobra.Command{
		Use:   "discover --path ip:HOST",
		Short: "List the exports a server grants this client's identity (name, size, access, read-only)",
		Long: `List the exports a server grants this client's identity: those it may
open by its certificate's names (allow_identities) and its address
(allow_from), each with its size in bytes, the most it may open it for
(ro, rw or migration) and whether the export is read-only.

The question goes to the server's admin listener ([admin] listen, port
1235 by default) over TLS 1.3 with the client's certificate: [tls] of
the client's configuration file, or --tls-cert, --tls-key and --tls-ca.
Every certificate of the server's CA may ask; no role is needed.`,
		Example: `  rnbd-client discover --path ip:10.0.0.5
  rnbd-client discover --path ip:10.0.0.5 --port 1235 --tls-cert host7.crt --tls-key host7.key --tls-ca ca.crt --format json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if path == "" {
				return ctl.Errorf(ctl.CodeInvalid, "--path: give the server's address, ip:HOST")
			}
			p, err := rtrs.ParsePathAddr(path, uint16(port))
			if err != nil {
				return ctl.Errorf(ctl.CodeInvalid, "--path: %v", err)
			}
			if p.GID {
				return ctl.Errorf(ctl.CodeInvalid, "--path %s: discovery goes over TCP to the admin listener: give ip:HOST", path)
			}
			cfg, err := clientd.LoadConfig(configFile, cmd.Flags().Changed("config"))
			if err != nil {
				return cli.ConfigError(err)
			}
			// The flags override the file's [tls], one by one.
			tc := cfg.TLS
			for _, f := range []struct {
				flag string
				dst  *string
				v    string
			}{{"tls-cert", &tc.Cert, t.TLS.Cert}, {"tls-key", &tc.Key, t.TLS.Key}, {"tls-ca", &tc.CA, t.TLS.CA}, {"tls-server-name", &tc.ServerName, t.TLS.ServerName}} {
				if cmd.Flags().Changed(f.flag) {
					*f.dst = f.v
				}
			}
			c, err := cli.RemoteClient("https://"+p.Dst.String(), tc, "the client's [tls] cert, key and ca, or --tls-cert, --tls-key and --tls-ca")
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), time.Minute)
			defer cancel()
			var recs []output.Record
			if err := api.Call(ctx, c, api.SrvDiscover, nil, nil, nil, &recs); err != nil {
				return err
			}
			fields := api.Fields[api.DiscoverRecord]()
			return g.Print(cmd.OutOrStdout(), "export", recs, fields, fields)
		},
	}
	f := cmd.Flags()
	f.StringVar(&path, "path", "", "the server, ip:HOST (as map's --path; a source address before @ is ignored)")
	f.Var(&port, "port", "the server's admin port ([admin] listen), 1 to 65535")
	f.StringVar(&configFile, "config", clientd.DefaultConfigFile, "the client's configuration file, whose [tls] is used (if it exists)")
	f.StringVar(&t.TLS.Cert, "tls-cert", "", "PEM certificate to present (default: the configuration's [tls] cert); its names are the identity asked about")
	f.StringVar(&t.TLS.Key, "tls-key", "", "PEM private key of --tls-cert")
	f.StringVar(&t.TLS.CA, "tls-ca", "", "PEM authority the server's certificate must chain to")
	f.StringVar(&t.TLS.ServerName, "tls-server-name", "", "name to check the server's certificate against (default: the address dialed)")
	cli.CompleteFlag(cmd, "config", cli.CompleteFiles("toml"))
	return cmd
}
