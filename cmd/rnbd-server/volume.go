// The commands of pools, volumes, snapshots and grants
// (docs/server.md, "Pools and volumes").

package main

import (
	"fmt"
	"io"
	"net/url"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/cli"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/output"
)

func newVolume(g *cli.Globals) *cobra.Command {
	cmd := &cobra.Command{Use: "volume", Short: "Create, list, grow, snapshot and delete the volumes of the pools, each exported under its name"}
	cmd.AddCommand(newVolumeCreate(g))
	cmd.AddCommand(g.ListCmds("volume", api.SrvVolumes, api.SrvVolume, "List volumes", "Show a volume: its pool, size, source, labels, export and grants", nil,
		[]string{"name", "pool", "size", "state", "sessions", "allow_identities"}, api.Fields[api.VolumeRecord]())...)
	var force bool
	del := &cobra.Command{
		Use:   "delete NAME",
		Short: "Withdraw a volume's export and delete it (refused while a session has it open, unless --force); one that is gone is success",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var rsp api.Deleted
			if err := g.Call(api.SrvVolumeDelete, args, forceQuery(force), nil, &rsp); err != nil {
				return err
			}
			if !rsp.Deleted {
				fmt.Fprintf(cmd.OutOrStdout(), "volume %s was already absent: nothing deleted\n", args[0])
				return nil
			}
			fmt.Fprintf(cmd.OutOrStdout(), "deleted volume %s\n", args[0])
			return nil
		},
		ValidArgsFunction: g.CompleteNames("name", api.SrvVolumes),
	}
	del.Flags().BoolVar(&force, "force", false, "close it for every session that has it open (their IO then fails with ENOTCONN), then delete it")
	cmd.AddCommand(del)
	cmd.AddCommand(newVolumeResize(g))
	cmd.AddCommand(newVolumeHold(g)...)
	cmd.AddCommand(newSnapshot(g))
	cmd.AddCommand(volumeGrantCmds(g)...)
	return cmd
}

// newVolumeHold is volume hold NAME --for D and volume release NAME
// TOKEN: a volume's writes held while snapshots elsewhere are taken.
func newVolumeHold(g *cli.Globals) []*cobra.Command {
	var d time.Duration
	hold := &cobra.Command{
		Use:   "hold NAME --for D",
		Short: "Hold a volume's writes, from every session, for at most D (reads go on); prints the token its release takes",
		Long: `Hold a volume's writes for at most D (at most 10s): no write, discard or
write-zeroes of any session starts on it until its release or until D is up;
reads and flushes go on. Snapshots of several volumes, on several storage
nodes, taken while all of them are held are one point in time. rnbd-csi
holds a replicated volume's legs this way for its snapshots.`,
		Example:           "  rnbd-server volume hold pvc-1 --for 2s",
		Args:              cobra.ExactArgs(1),
		ValidArgsFunction: g.CompleteNames("name", api.SrvVolumes),
		RunE: func(cmd *cobra.Command, args []string) error {
			var rsp api.Hold
			if err := g.Call(api.SrvVolumeHold, args, nil, api.HoldRequest{For: d.String()}, &rsp); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "holding volume %s until %s: token %d\n", args[0], rsp.Until.Format(time.RFC3339Nano), rsp.Token)
			return nil
		},
	}
	hold.Flags().DurationVar(&d, "for", 2*time.Second, "how long at most, if not released")
	release := &cobra.Command{
		Use:               "release NAME TOKEN",
		Short:             "End a hold of a volume's writes; says whether it held until now",
		Args:              cobra.ExactArgs(2),
		ValidArgsFunction: g.CompleteNames("name", api.SrvVolumes),
		RunE: func(cmd *cobra.Command, args []string) error {
			var rsp api.Released
			if err := g.Call(api.SrvVolumeRelease, args, nil, nil, &rsp); err != nil {
				return err
			}
			if !rsp.HeldThroughout {
				fmt.Fprintf(cmd.OutOrStdout(), "released volume %s: its time had run out before (writes ran since)\n", args[0])
				return nil
			}
			fmt.Fprintf(cmd.OutOrStdout(), "released volume %s: held until now\n", args[0])
			return nil
		},
	}
	return []*cobra.Command{hold, release}
}

// newVolumeResize is volume resize NAME --size SIZE, the size given as
// create takes it.
func newVolumeResize(g *cli.Globals) *cobra.Command {
	var size string
	cmd := &cobra.Command{
		Use:     "resize NAME --size SIZE",
		Short:   "Grow a volume (--size 20GiB); sessions that have it open learn the new size",
		Example: "  rnbd-server volume resize pvc-1 --size 20GiB",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 2 {
				return ctl.Errorf(ctl.CodeInvalid, "volume resize takes its size as create does: volume resize %s --size %s", args[0], args[1])
			}
			return cobra.ExactArgs(1)(cmd, args)
		},
		ValidArgsFunction: g.CompleteNames("name", api.SrvVolumes),
		RunE: func(cmd *cobra.Command, args []string) error {
			if size == "" {
				return ctl.Errorf(ctl.CodeInvalid, "volume resize %s: give the new size, --size SIZE (e.g. 20GiB)", args[0])
			}
			var rsp api.ResizeResponse
			if err := g.Call(api.SrvVolumeResize, args[:1], nil, api.ResizeRequest{Size: size}, &rsp); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "resized volume %s from %d to %d bytes\n", args[0], rsp.Was, rsp.Now)
			return nil
		},
	}
	cmd.Flags().StringVar(&size, "size", "", "its new size, e.g. 20GiB (a multiple of 4096 bytes, not less than now)")
	return cmd
}

func newVolumeCreate(g *cli.Globals) *cobra.Command {
	var (
		req        api.VolumeRequest
		labels     []string
		grantsOnly bool
	)
	cmd := &cobra.Command{
		Use:   "create NAME --pool POOL --size SIZE",
		Short: "Make a volume in a pool and export it under its name; the same again answers the one there",
		Long: `Make a volume in a pool, empty or a clone of a volume or a snapshot, and
export it under its name with the rules given (as map takes them). A
clone without --size has its source's size. Creating a volume that
exists with the same pool, size, source and labels succeeds and answers
it; with other parameters it is refused (already_exists) saying what
differs. The export's rules of a volume that exists are not compared,
nor changed: its grants change with volume grant and revoke.`,
		Example: `  rnbd-server volume create pvc-1 --pool fast --size 10GiB --grants-only
  rnbd-server volume create pvc-2 --pool fast --from-snapshot snap-1 --label team=db`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req.Name = args[0]
			if req.Size == "" && req.FromVolume == "" && req.FromSnapshot == "" {
				return ctl.Errorf(ctl.CodeInvalid, "volume create %s: give its --size (a clone, --from-volume or --from-snapshot, may leave it out: its source's)", req.Name)
			}
			for _, l := range labels {
				k, v, ok := strings.Cut(l, "=")
				if !ok || k == "" {
					return ctl.Errorf(ctl.CodeInvalid, "--label %q: want KEY=VALUE", l)
				}
				if req.Labels == nil {
					req.Labels = map[string]string{}
				}
				req.Labels[k] = v
			}
			if cmd.Flags().Changed("grants-only") {
				req.Export.GrantsOnly = &grantsOnly
			}
			var rsp struct {
				Created bool          `json:"created"`
				Record  output.Record `json:"record"` // printed as sent
			}
			if err := g.Call(api.SrvVolumeCreate, nil, nil, req, &rsp); err != nil {
				return err
			}
			return printMade(g, cmd.OutOrStdout(), "volume", rsp.Created, rsp.Record, api.Fields[api.VolumeRecord](),
				fmt.Sprintf("volume %s (%v bytes) in pool %s", req.Name, rsp.Record["size"], req.Pool))
		},
	}
	f := cmd.Flags()
	f.StringVar(&req.Pool, "pool", "", "the pool to make it in (pool list)")
	f.StringVar(&req.Size, "size", "", "its size, e.g. 10GiB (a multiple of 4096 bytes); a clone's default is its source's")
	f.StringVar(&req.FromVolume, "from-volume", "", "make it a clone of this volume (thin snapshot, or a reflink; never a full copy)")
	f.StringVar(&req.FromSnapshot, "from-snapshot", "", "make it a clone of this snapshot")
	f.StringArrayVar(&labels, "label", nil, "KEY=VALUE kept with the volume, for the caller (repeatable)")
	cmd.MarkFlagRequired("pool")
	exportRuleFlags(g, cmd, &req.Export, &grantsOnly)
	cli.CompleteFlag(cmd, "pool", g.CompleteNames("name", api.SrvPools))
	cli.CompleteFlag(cmd, "from-volume", g.CompleteNames("name", api.SrvVolumes))
	cli.CompleteFlag(cmd, "from-snapshot", g.CompleteNames("name", api.SrvSnapshots))
	return cmd
}

// printMade prints what a create made or found: a sentence in a table,
// the record otherwise.
func printMade(g *cli.Globals, w io.Writer, kind string, created bool, rec output.Record, fields []string, what string) error {
	if !g.Table() {
		return g.Print(w, kind, []output.Record{rec}, fields, fields)
	}
	if created {
		fmt.Fprintf(w, "created %s\n", what)
	} else {
		fmt.Fprintf(w, "%s exists already, as asked\n", what)
	}
	return nil
}

func newSnapshot(g *cli.Globals) *cobra.Command {
	cmd := &cobra.Command{Use: "snapshot", Short: "Take, list and delete snapshots of volumes (thin snapshots on LVM, reflinks on a file system)"}
	var volume string
	query := func() url.Values {
		if volume == "" {
			return nil
		}
		return url.Values{"volume": {volume}}
	}
	lists := g.ListCmds("snapshot", api.SrvSnapshots, api.SrvSnapshot, "List snapshots", "Show a snapshot", query,
		[]string{"name", "pool", "volume", "size", "created"}, api.Fields[api.SnapshotRecord]())
	lists[0].Flags().StringVar(&volume, "volume", "", "only the snapshots of this volume")
	cli.CompleteFlag(lists[0], "volume", g.CompleteNames("name", api.SrvVolumes))
	cmd.AddCommand(lists...)
	cmd.AddCommand(&cobra.Command{
		Use:               "create VOLUME NAME",
		Short:             "Take a snapshot of a volume; the same again answers the one there",
		Args:              cobra.ExactArgs(2),
		ValidArgsFunction: g.CompleteNames("name", api.SrvVolumes, cli.NoName),
		RunE: func(cmd *cobra.Command, args []string) error {
			var rsp struct {
				Created bool          `json:"created"`
				Record  output.Record `json:"record"` // printed as sent
			}
			if err := g.Call(api.SrvSnapshotCreate, nil, nil, api.SnapshotRequest{Volume: args[0], Name: args[1]}, &rsp); err != nil {
				return err
			}
			return printMade(g, cmd.OutOrStdout(), "snapshot", rsp.Created, rsp.Record, api.Fields[api.SnapshotRecord](),
				fmt.Sprintf("snapshot %s of volume %s", args[1], args[0]))
		},
	})
	cmd.AddCommand(&cobra.Command{
		Use:               "delete NAME",
		Short:             "Delete a snapshot; one that is gone is success",
		Args:              cobra.ExactArgs(1),
		ValidArgsFunction: g.CompleteNames("name", api.SrvSnapshots),
		RunE: func(cmd *cobra.Command, args []string) error {
			var rsp api.Deleted
			if err := g.Call(api.SrvSnapshotDelete, args, nil, nil, &rsp); err != nil {
				return err
			}
			if !rsp.Deleted {
				fmt.Fprintf(cmd.OutOrStdout(), "snapshot %s was already absent: nothing deleted\n", args[0])
				return nil
			}
			fmt.Fprintf(cmd.OutOrStdout(), "deleted snapshot %s\n", args[0])
			return nil
		},
	})
	return cmd
}

func newPool(g *cli.Globals) *cobra.Command {
	cmd := &cobra.Command{Use: "pool", Short: "List the pools volumes are made in, with their capacity"}
	fields := api.Fields[api.PoolRecord]()
	cmd.AddCommand(cli.Fields(&cobra.Command{
		Use:   "list",
		Short: "List the pools of the configuration, with their capacity and state",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return g.List(cmd.OutOrStdout(), api.SrvPools, nil, nil, "pool", []string{"name", "type", "where", "state", "total", "used", "allocatable", "volumes"}, fields)
		},
	}, fields))
	return cmd
}

// grantRoutes are the routes of an object's grants: an export's (the
// admin's) or a volume's (a provisioner's too).
type grantRoutes struct {
	kind                 string // "export", "volume"
	list, grant, revoke  api.Route
	names                api.Route // what NAME completes from
	grantHelp, listShort string
}

// grantCmds are grant, revoke and grants of an export or a volume: an
// identity's access, given and taken one at a time.
func grantCmds(g *cli.Globals, r grantRoutes) []*cobra.Command {
	var access string
	grant := &cobra.Command{
		Use:   "grant NAME IDENTITY",
		Short: r.grantHelp,
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := g.Call(r.grant, args[:1], nil, api.GrantRequest{Identity: args[1], Access: access}, nil); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "granted %s %s access to %s %s\n", args[1], access, r.kind, args[0])
			return nil
		},
		ValidArgsFunction: g.CompleteNames("name", r.names, cli.NoName),
	}
	grant.Flags().StringVar(&access, "access", "rw", "the most it may open it for: ro, rw or migration")
	cli.CompleteFlag(grant, "access", cli.CompleteFrom("ro", "rw", "migration"))
	revoke := &cobra.Command{
		Use:   "revoke NAME IDENTITY",
		Short: "Take a client identity's grant off " + r.kind + " NAME (its next open is refused; one it has open stays until closed)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := g.Call(r.revoke, args, nil, nil, nil); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "revoked %s's access to %s %s\n", args[1], r.kind, args[0])
			return nil
		},
		ValidArgsFunction: g.CompleteNames("name", r.names, cli.NoName),
	}
	fields := api.Fields[api.GrantRecord]()
	grants := cli.Fields(&cobra.Command{
		Use:               "grants NAME",
		Short:             r.listShort,
		Args:              cobra.ExactArgs(1),
		ValidArgsFunction: g.CompleteNames("name", r.names),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.List(cmd.OutOrStdout(), r.list, args, nil, "grant", fields, fields)
		},
	}, fields)
	return []*cobra.Command{grant, revoke, grants}
}

// exportGrantCmds are export grant, revoke and grants.
func exportGrantCmds(g *cli.Globals) []*cobra.Command {
	return grantCmds(g, grantRoutes{kind: "export", list: api.SrvExportGrants, grant: api.SrvExportGrant, revoke: api.SrvExportRevoke,
		names:     api.SrvExports,
		grantHelp: "Let a client identity (TLS) open an export, without touching its other grants; the export then opens to its grants only",
		listShort: "List the identities an export grants access to"})
}

// volumeGrantCmds are volume grant, revoke and grants: what a
// provisioner may do of grants.
func volumeGrantCmds(g *cli.Globals) []*cobra.Command {
	return grantCmds(g, grantRoutes{kind: "volume", list: api.SrvVolumeGrants, grant: api.SrvVolumeGrant, revoke: api.SrvVolumeRevoke,
		names:     api.SrvVolumes,
		grantHelp: "Let a client identity (TLS) open a volume's export, without touching its other grants (a provisioner's right)",
		listShort: "List the identities a volume grants access to"})
}
