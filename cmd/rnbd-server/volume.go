// The commands of pools, volumes, snapshots and grants
// (docs/server.md, "Pools and volumes").

package main

import (
	"fmt"
	"io"
	"net/url"
	"strings"

	"github.com/spf13/cobra"

	"github.com/rnbd/rnbd/internal/cli"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/output"
	"github.com/rnbd/rnbd/internal/serverd"
)

func newVolume(g *cli.Globals) *cobra.Command {
	cmd := &cobra.Command{Use: "volume", Short: "Create, list, grow, snapshot and delete the volumes of the pools, each exported under its name"}
	cmd.AddCommand(newVolumeCreate(g))
	cmd.AddCommand(g.ListCmds("volume", "/v1/volumes", "List volumes", "Show a volume: its pool, size, source, labels, export and grants", nil,
		[]string{"name", "pool", "size", "state", "sessions", "allow_identities"}, serverd.VolumeFields)...)
	var force bool
	del := &cobra.Command{
		Use:   "delete NAME",
		Short: "Withdraw a volume's export and delete it (refused while a session has it open, unless --force); one that is gone is success",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			path := "/v1/volumes/" + url.PathEscape(args[0])
			if force {
				path += "?force=true"
			}
			if err := g.Call("DELETE", path, nil, nil); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "deleted volume %s\n", args[0])
			return nil
		},
		ValidArgsFunction: g.CompleteNames("name", "/v1/volumes"),
	}
	del.Flags().BoolVar(&force, "force", false, "close it for every session that has it open (their IO then fails with ENOTCONN), then delete it")
	cmd.AddCommand(del)
	cmd.AddCommand(&cobra.Command{
		Use:               "resize NAME SIZE",
		Short:             "Grow a volume (e.g. 20GiB); sessions that have it open learn the new size",
		Args:              cobra.ExactArgs(2),
		ValidArgsFunction: g.CompleteNames("name", "/v1/volumes", ""),
		RunE: func(cmd *cobra.Command, args []string) error {
			var rsp serverd.ResizeResponse
			if err := g.Call("POST", "/v1/volumes/"+url.PathEscape(args[0])+"/resize", serverd.ResizeRequest{Size: args[1]}, &rsp); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "resized volume %s from %d to %d bytes\n", args[0], rsp.Was, rsp.Now)
			return nil
		},
	})
	cmd.AddCommand(newSnapshot(g))
	return cmd
}

func newVolumeCreate(g *cli.Globals) *cobra.Command {
	var (
		req    serverd.VolumeRequest
		labels []string
	)
	cmd := &cobra.Command{
		Use:   "create NAME --pool POOL --size SIZE",
		Short: "Make a volume in a pool and export it under its name; the same again answers the one there",
		Long: `Make a volume in a pool, empty or a clone of a volume or a snapshot, and
export it under its name with the rules given (as map takes them).
Creating a volume that exists with the same pool, size, source and
labels succeeds and answers it; with other parameters it is refused
(already_exists) saying what differs.`,
		Example: `  rnbd-server volume create pvc-1 --pool fast --size 10GiB --grants-only
  rnbd-server volume create pvc-2 --pool fast --size 10GiB --from-snapshot snap-1 --label team=db`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req.Name = args[0]
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
			var rsp struct {
				Created bool          `json:"created"`
				Record  output.Record `json:"record"`
			}
			if err := g.Call("POST", "/v1/volumes", req, &rsp); err != nil {
				return err
			}
			return printMade(g, cmd.OutOrStdout(), "volume", rsp.Created, rsp.Record, serverd.VolumeFields,
				fmt.Sprintf("volume %s (%v bytes) in pool %s", req.Name, rsp.Record["size"], req.Pool))
		},
	}
	f := cmd.Flags()
	f.StringVar(&req.Pool, "pool", "", "the pool to make it in (pool list)")
	f.StringVar(&req.Size, "size", "", "its size, e.g. 10GiB (a multiple of 4096 bytes)")
	f.StringVar(&req.FromVolume, "from-volume", "", "make it a clone of this volume (thin snapshot, or a reflink; never a full copy)")
	f.StringVar(&req.FromSnapshot, "from-snapshot", "", "make it a clone of this snapshot")
	f.StringArrayVar(&labels, "label", nil, "KEY=VALUE kept with the volume, for the caller (repeatable)")
	cmd.MarkFlagRequired("pool")
	cmd.MarkFlagRequired("size")
	exportRuleFlags(g, cmd, &req.Export)
	cli.CompleteFlag(cmd, "pool", g.CompleteNames("name", "/v1/pools"))
	cli.CompleteFlag(cmd, "from-volume", g.CompleteNames("name", "/v1/volumes"))
	cli.CompleteFlag(cmd, "from-snapshot", g.CompleteNames("name", "/v1/snapshots"))
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
	query := func() string {
		if volume == "" {
			return ""
		}
		return "?volume=" + url.QueryEscape(volume)
	}
	lists := g.ListCmds("snapshot", "/v1/snapshots", "List snapshots", "Show a snapshot", query,
		[]string{"name", "pool", "volume", "size", "created"}, serverd.SnapshotFields)
	lists[0].Flags().StringVar(&volume, "volume", "", "only the snapshots of this volume")
	cmd.AddCommand(lists...)
	cmd.AddCommand(&cobra.Command{
		Use:               "create VOLUME NAME",
		Short:             "Take a snapshot of a volume; the same again answers the one there",
		Args:              cobra.ExactArgs(2),
		ValidArgsFunction: g.CompleteNames("name", "/v1/volumes", ""),
		RunE: func(cmd *cobra.Command, args []string) error {
			var rsp struct {
				Created bool          `json:"created"`
				Record  output.Record `json:"record"`
			}
			if err := g.Call("POST", "/v1/snapshots", serverd.SnapshotRequest{Volume: args[0], Name: args[1]}, &rsp); err != nil {
				return err
			}
			return printMade(g, cmd.OutOrStdout(), "snapshot", rsp.Created, rsp.Record, serverd.SnapshotFields,
				fmt.Sprintf("snapshot %s of volume %s", args[1], args[0]))
		},
	})
	cmd.AddCommand(&cobra.Command{
		Use:               "delete NAME",
		Short:             "Delete a snapshot; one that is gone is success",
		Args:              cobra.ExactArgs(1),
		ValidArgsFunction: g.CompleteNames("name", "/v1/snapshots"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := g.Call("DELETE", "/v1/snapshots/"+url.PathEscape(args[0]), nil, nil); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "deleted snapshot %s\n", args[0])
			return nil
		},
	})
	return cmd
}

func newPool(g *cli.Globals) *cobra.Command {
	cmd := &cobra.Command{Use: "pool", Short: "List the pools volumes are made in, with their capacity"}
	cmd.AddCommand(cli.Fields(&cobra.Command{
		Use:   "list",
		Short: "List the pools of the configuration, with their capacity and state",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return g.List(cmd.OutOrStdout(), "/v1/pools", "pool", []string{"name", "type", "where", "state", "total", "used", "allocatable", "volumes"}, serverd.PoolFields)
		},
	}, serverd.PoolFields))
	return cmd
}

// grantCmds are export grant, revoke and grants: an identity's access
// to an export, given and taken one at a time.
func grantCmds(g *cli.Globals) []*cobra.Command {
	var access string
	grant := &cobra.Command{
		Use:   "grant NAME IDENTITY",
		Short: "Let a client identity (TLS) open an export, without touching its other grants; the export then opens to its grants only",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := g.Call("POST", "/v1/exports/"+url.PathEscape(args[0])+"/grants", serverd.GrantRequest{Identity: args[1], Access: access}, nil); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "granted %s %s access to %s\n", args[1], access, args[0])
			return nil
		},
		ValidArgsFunction: g.CompleteNames("name", "/v1/exports", ""),
	}
	grant.Flags().StringVar(&access, "access", "rw", "the most it may open it for: ro, rw or migration")
	cli.CompleteFlag(grant, "access", cli.CompleteFrom("ro", "rw", "migration"))
	revoke := &cobra.Command{
		Use:   "revoke NAME IDENTITY",
		Short: "Take a client identity's grant off an export (its next open is refused; one it has open stays until closed)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := g.Call("DELETE", "/v1/exports/"+url.PathEscape(args[0])+"/grants/"+url.PathEscape(args[1]), nil, nil); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "revoked %s's access to %s\n", args[1], args[0])
			return nil
		},
		ValidArgsFunction: g.CompleteNames("name", "/v1/exports", ""),
	}
	grants := cli.Fields(&cobra.Command{
		Use:               "grants NAME",
		Short:             "List the identities an export grants access to",
		Args:              cobra.ExactArgs(1),
		ValidArgsFunction: g.CompleteNames("name", "/v1/exports"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.List(cmd.OutOrStdout(), "/v1/exports/"+url.PathEscape(args[0])+"/grants", "grant", serverd.GrantFields, serverd.GrantFields)
		},
	}, serverd.GrantFields)
	return []*cobra.Command{grant, revoke, grants}
}
