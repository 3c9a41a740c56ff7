package cli

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/rnbd/rnbd/internal/certs"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/output"
)

// DefaultCertsDir is where the packaged configurations look for their
// TLS files.
const DefaultCertsDir = "/etc/rnbd/tls"

// CertFields are cert list's fields.
var CertFields = []string{"file", "kind", "names", "ips", "usages", "not_after", "key", "status"}

// CertCmd is "cert": making an authority and the certificates of nodes
// and clients, and listing a directory of them (internal/certs), as
// cockroach's cert commands do. Both binaries have it, so that the
// machine holding the authority's key needs either package only.
func (g *Globals) CertCmd() *cobra.Command {
	var dir, caKey string
	cmd := &cobra.Command{
		Use:   "cert",
		Short: "Make an authority and the certificates of storage nodes and clients; list a directory of them",
		Long: `Make the certificates TLS on the fabric and the admin listener run on:
an authority (create-ca), a storage node's certificate (create-node: its
listeners', naming the addresses clients dial) and a client's (create-client:
a worker's rnbd-client, or an operator's or orchestrator's on the admin
listener, its name the identity that grants and roles name). Keys are ECDSA
P-256, written 0600; no file is replaced without --overwrite. The authority's
key signs the others: keep it off the storage nodes and the workers, on the
machine that issues certificates. Your organisation's PKI does as well: the
daemons need PEM files with the usages and names these commands give
(docs/operations.md, "TLS on the TCP fabric").`,
		Example: `  rnbd-server cert create-ca --ca-key /root/rnbd-ca.key
  rnbd-server cert create-node storage-a 10.0.9.5 storage-a.example --ca-key /root/rnbd-ca.key --file server
  rnbd-server cert create-client ops --ca-key /root/rnbd-ca.key
  rnbd-server cert list`,
	}
	f := cmd.PersistentFlags()
	f.StringVar(&dir, "certs-dir", DefaultCertsDir, "the directory of the certificates: ca.crt, and NAME.crt and NAME.key of each")
	f.StringVar(&caKey, "ca-key", "", "the authority's private key (PEM): written by create-ca, read by create-node and create-client; keep it outside --certs-dir, on the machine that issues certificates")
	CompleteFlag(cmd, "certs-dir", func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
		return nil, cobra.ShellCompDirectiveFilterDirs
	})
	CompleteFlag(cmd, "ca-key", CompleteFiles("key"))
	needKey := func() error {
		if caKey == "" {
			return ctl.Errorf(ctl.CodeInvalid, "give --ca-key: the authority's private key, which signs the certificate")
		}
		return nil
	}

	var overwrite bool
	caLife := lifetime(certs.DefaultCALifetime)
	var caName string
	createCA := &cobra.Command{
		Use:   "create-ca",
		Short: "Make an authority: ca.crt in the certificates directory, and its key",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := needKey(); err != nil {
				return err
			}
			ca, err := certs.NewCA(caName, time.Duration(caLife))
			if err != nil {
				return ctl.Errorf(ctl.CodeInvalid, "%v", err)
			}
			path, err := certs.WriteCA(ca, dir, caKey, overwrite)
			if err != nil {
				return certError(err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "wrote %s (authority %q, valid until %s) and its key %s\n",
				path, caName, day(ca.Cert.NotAfter), caKey)
			return nil
		},
	}
	createCA.Flags().StringVar(&caName, "name", "rnbd CA", "the authority's common name")
	createCA.Flags().Var(&caLife, "lifetime", "how long it is valid: a duration (87600h) or days or years (3650d, 10y)")
	createCA.Flags().BoolVar(&overwrite, "overwrite", false, "replace ca.crt and the key if they exist (every certificate of the old authority then stops being trusted where the new ca.crt is installed)")

	issue := func(kind certs.Kind, use, short, long, example string, minArgs int, usage string) *cobra.Command {
		var base string
		var overwrite bool
		life := lifetime(certs.DefaultLifetime)
		c := &cobra.Command{
			Use:     use,
			Short:   short,
			Long:    long,
			Example: example,
			Args:    cobra.ExactArgs(1),
			RunE: func(cmd *cobra.Command, args []string) error {
				if err := needKey(); err != nil {
					return err
				}
				ca, err := certs.LoadCA(dir, caKey)
				if err != nil {
					return certError(err)
				}
				cert, key, err := ca.Issue(certs.Request{Kind: kind, Name: args[0], Hosts: args[1:], Lifetime: time.Duration(life)})
				if err != nil {
					return ctl.Errorf(ctl.CodeInvalid, "%v", err)
				}
				if base == "" {
					base = args[0]
				}
				cp, kp, err := certs.WriteCert(dir, base, cert, key, overwrite)
				if err != nil {
					return certError(err)
				}
				what := fmt.Sprintf("%s %q, %s", kind, args[0], usage)
				if len(args) > 1 {
					what += ", for " + strings.Join(args[1:], ", ")
				}
				fmt.Fprintf(cmd.OutOrStdout(), "wrote %s and %s (%s; valid until %s)\n", cp, kp, what, day(cert.NotAfter))
				return nil
			},
		}
		if minArgs > 1 {
			c.Args = func(cmd *cobra.Command, args []string) error {
				if len(args) < minArgs {
					return ctl.Errorf(ctl.CodeInvalid, "%s: give the node's NAME and the addresses and host names clients dial (at least one)", cmd.UseLine())
				}
				return nil
			}
		}
		c.ValidArgsFunction = CompleteFrom()
		c.Flags().StringVar(&base, "file", "", "the files' name in --certs-dir, FILE.crt and FILE.key (default: NAME)")
		c.Flags().Var(&life, "lifetime", "how long it is valid: a duration (17520h) or days or years (730d, 2y); at most the authority's")
		c.Flags().BoolVar(&overwrite, "overwrite", false, "replace the files if they exist (a renewal: the daemons load a renewed certificate from their next connection on)")
		return c
	}
	node := issue(certs.KindNode, "create-node NAME ADDR...",
		"Make a storage node's certificate (its fabric's and admin listener's), naming the addresses and host names clients dial",
		`Make a storage node's certificate and key, signed by the authority: its
common name NAME (the node's identity where it is a client), the extended key
usages serverAuth and clientAuth, and each ADDR as a subject alternative name
(an IP address as an IP name, a host name as a DNS one). rnbd-client checks
the address it dials against them (or tls.server_name), and rnbd-server
--server the host of its URL: name every address and host name clients use.`,
		`  rnbd-server cert create-node storage-a 10.0.9.5 10.0.10.5 storage-a.example --ca-key /root/rnbd-ca.key
  rnbd-server cert create-node storage-a 10.0.9.5 --ca-key /root/rnbd-ca.key --file server   # server.crt, as server.toml names it`,
		2, "serverAuth and clientAuth")
	client := issue(certs.KindClient, "create-client NAME",
		"Make a client's certificate: NAME is its identity (a worker, an operator, an orchestrator)",
		`Make a client's certificate and key, signed by the authority: its common
name NAME, its only name, is the identity servers know it by: what an
export's allow_identities and grants name for a worker's rnbd-client, and what
[admin]'s admins, provisioners and readers name on the admin listener. Its
extended key usage is clientAuth.`,
		`  rnbd-client cert create-client worker-1 --ca-key /root/rnbd-ca.key --file client   # client.crt, as client.toml names it
  rnbd-server cert create-client csi-controller --ca-key /root/rnbd-ca.key`,
		1, "clientAuth")

	list := Fields(&cobra.Command{
		Use:   "list",
		Short: "List the certificates of the directory: names, usages, expiry, whether the key matches and the authority signed them",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ents, err := certs.List(dir, time.Now())
			if err != nil {
				return certError(err)
			}
			recs := make([]output.Record, 0, len(ents))
			for _, e := range ents {
				r := output.Record{"file": e.File, "kind": string(e.Kind), "names": e.Names, "ips": e.IPs,
					"usages": e.Usages, "not_after": "", "key": e.Key, "status": e.Status}
				if !e.NotAfter.IsZero() {
					r["not_after"] = e.NotAfter.UTC().Format(time.RFC3339)
				}
				recs = append(recs, r)
			}
			return g.Print(cmd.OutOrStdout(), "certificate", recs,
				[]string{"file", "kind", "names", "usages", "not_after", "key", "status"}, CertFields)
		},
	}, CertFields)
	cmd.AddCommand(createCA, node, client, list)
	return cmd
}

// certError gives a certificate command's error its class.
func certError(err error) error {
	if errors.Is(err, certs.ErrExists) {
		return ctl.Errorf(ctl.CodeExists, "%v", err)
	}
	if ctl.Classify(err) == ctl.CodeInternal {
		return ctl.Errorf(ctl.CodeInvalid, "%v", err)
	}
	return err
}

func day(t time.Time) string { return t.UTC().Format(time.DateOnly) }

// lifetime is a flag of a duration that also takes days and years
// (365 days): 10y, 730d, 8760h.
type lifetime time.Duration

func (l *lifetime) String() string {
	d := time.Duration(*l)
	if d%(365*24*time.Hour) == 0 {
		return strconv.FormatInt(int64(d/(365*24*time.Hour)), 10) + "y"
	}
	if d%(24*time.Hour) == 0 {
		return strconv.FormatInt(int64(d/(24*time.Hour)), 10) + "d"
	}
	return d.String()
}

func (l *lifetime) Set(s string) error {
	var d time.Duration
	var u time.Duration
	if len(s) > 1 {
		u = map[byte]time.Duration{'d': 24 * time.Hour, 'y': 365 * 24 * time.Hour}[s[len(s)-1]]
	}
	if u != 0 {
		n, err := strconv.ParseInt(s[:len(s)-1], 10, 64)
		if err != nil || n > int64(1<<63-1)/int64(u) {
			return fmt.Errorf("%q: want a number of days or years (730d, 2y) or a duration (17520h)", s)
		}
		d = time.Duration(n) * u
	} else {
		var err error
		if d, err = time.ParseDuration(s); err != nil {
			return fmt.Errorf("%q: want a duration (17520h) or days or years (730d, 2y)", s)
		}
	}
	if d <= 0 {
		return fmt.Errorf("%q: want a positive lifetime", s)
	}
	*l = lifetime(d)
	return nil
}

func (l *lifetime) Type() string { return "lifetime" }
