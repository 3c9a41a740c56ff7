// The control API's routes of pools, volumes, snapshots and grants
// (docs/control-api.md), and the answers they give.

package serverd

import (
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/rnbd"
)

func (d *Daemon) listPools(r *http.Request) (any, error) { return d.poolRecords(), nil }

func (d *Daemon) listVolumes(r *http.Request) (any, error) { return d.volumeRecords("") }

func (d *Daemon) showVolume(r *http.Request) (any, error) {
	rows, err := d.volumeRecords(r.PathValue("name"))
	if err != nil {
		return nil, err
	}
	if len(rows) == 0 {
		return nil, ctl.Errorf(ctl.CodeNotFound, "no volume %s", r.PathValue("name"))
	}
	return rows, nil
}

func (d *Daemon) createVolume(r *http.Request) (any, error) {
	var req api.VolumeRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	if c := ctl.CallerOf(r); !c.Local {
		switch {
		case req.Export.GrantsOnly == nil:
			// Made over the network: open to no one until granted.
			req.Export.GrantsOnly = ptr(true)
		case !*req.Export.GrantsOnly && c.Role != ctl.RoleAdmin:
			return nil, ctl.Errorf(ctl.CodePermission, "identity %s (role %s) may not make volume %s open to every client (grants_only false): "+
				"only an admin may; a provisioner's volumes open to the identities granted", c.Identity, c.Role, req.Name)
		}
	}
	rec, created, err := d.CreateVolume(r.Context(), req)
	if err != nil {
		return nil, err
	}
	return api.CreatedVolume{Created: created, Record: rec}, nil
}

func (d *Daemon) deleteVolume(r *http.Request) (any, error) {
	var ifLabels map[string]string
	for _, kv := range r.URL.Query()["if_label"] {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, ctl.Errorf(ctl.CodeInvalid, "if_label %q: want KEY=VALUE", kv)
		}
		if ifLabels == nil {
			ifLabels = map[string]string{}
		}
		ifLabels[k] = v
	}
	deleted, err := d.DeleteVolume(r.Context(), r.PathValue("name"), r.URL.Query().Get("force") == "true", ifLabels)
	return api.Deleted{Deleted: deleted}, err
}

func (d *Daemon) resizeVolume(r *http.Request) (any, error) {
	var req api.ResizeRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	if req.Force {
		return nil, ctl.Errorf(ctl.CodeInvalid, "a volume grows only: force does not apply")
	}
	n, err := units.ParseSize(req.Size)
	if err != nil {
		return nil, ctl.Errorf(ctl.CodeInvalid, "size %q: %v", req.Size, err)
	}
	was, err := d.ResizeVolume(r.Context(), r.PathValue("name"), n)
	if err != nil {
		return nil, err
	}
	return api.ResizeResponse{Was: was, Now: n}, nil
}

func (d *Daemon) setVolumeLabels(r *http.Request) (any, error) {
	var req api.LabelsRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	return nil, d.SetVolumeLabels(r.Context(), r.PathValue("name"), req.Labels)
}

func (d *Daemon) holdVolume(r *http.Request) (any, error) {
	var req api.HoldRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	max, err := time.ParseDuration(req.For)
	if err != nil {
		return nil, ctl.Errorf(ctl.CodeInvalid, "for %q: %v", req.For, err)
	}
	return d.HoldVolume(r.Context(), r.PathValue("name"), max)
}

func (d *Daemon) releaseVolume(r *http.Request) (any, error) {
	token, err := strconv.ParseUint(r.PathValue("token"), 10, 64)
	if err != nil {
		return nil, ctl.Errorf(ctl.CodeInvalid, "token %q: %v", r.PathValue("token"), err)
	}
	held, err := d.ReleaseVolume(r.Context(), r.PathValue("name"), token)
	return api.Released{HeldThroughout: held}, err
}

func (d *Daemon) listSnapshots(r *http.Request) (any, error) {
	return d.snapshotRecords("", r.URL.Query().Get("volume"))
}

func (d *Daemon) showSnapshot(r *http.Request) (any, error) {
	rows, err := d.snapshotRecords(r.PathValue("name"), "")
	if err == nil && len(rows) == 0 {
		err = ctl.Errorf(ctl.CodeNotFound, "no snapshot %s", r.PathValue("name"))
	}
	return rows, err
}

func (d *Daemon) createSnapshot(r *http.Request) (any, error) {
	var req api.SnapshotRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	s, created, err := d.CreateSnapshot(r.Context(), req)
	if err != nil {
		return nil, err
	}
	return api.CreatedSnapshot{Created: created, Record: snapshotRecord(s)}, nil
}

func (d *Daemon) deleteSnapshot(r *http.Request) (any, error) {
	deleted, err := d.DeleteSnapshot(r.Context(), r.PathValue("name"))
	return api.Deleted{Deleted: deleted}, err
}

// Grants of any export (the admin's; a provisioner's of the volumes'
// only, so that a controller of a release before the volume routes
// keeps working with this storage node), and of a volume's (the
// provisioner's routes).

func (d *Daemon) listGrants(r *http.Request) (any, error) {
	return d.grantRecords(r.PathValue("name"))
}

// exportGrants is which exports the caller of an export's grant route
// may change: any for an admin, the volumes' for a provisioner.
func exportGrants(r *http.Request) grantScope {
	if ctl.CallerOf(r).Role == ctl.RoleAdmin {
		return anyExport
	}
	return volumesOnlyRefused
}

func (d *Daemon) addGrant(r *http.Request) (any, error) {
	g, err := grantOf(r)
	if err != nil {
		return nil, err
	}
	return nil, d.Grant(r.PathValue("name"), g, exportGrants(r))
}

func (d *Daemon) revokeGrant(r *http.Request) (any, error) {
	return nil, d.Revoke(r.PathValue("name"), r.PathValue("identity"), exportGrants(r))
}

func (d *Daemon) listVolumeGrants(r *http.Request) (any, error) {
	name := r.PathValue("name")
	if !d.isVolume(name) {
		return nil, ctl.Errorf(ctl.CodeNotFound, "no volume %s", name)
	}
	return d.grantRecords(name)
}

func (d *Daemon) addVolumeGrant(r *http.Request) (any, error) {
	g, err := grantOf(r)
	if err != nil {
		return nil, err
	}
	return nil, d.Grant(r.PathValue("name"), g, volumesOnly)
}

func (d *Daemon) revokeVolumeGrant(r *http.Request) (any, error) {
	return nil, d.Revoke(r.PathValue("name"), r.PathValue("identity"), volumesOnly)
}

// grantOf is the grant a request's body gives: an identity, and ro, rw
// (the default) or migration.
func grantOf(r *http.Request) (rnbd.Grant, error) {
	var req api.GrantRequest
	if err := ctl.Decode(r, &req); err != nil {
		return rnbd.Grant{}, err
	}
	if req.Access == "" {
		req.Access = "rw"
	}
	g := rnbd.Grant{Identity: req.Identity, Access: req.Access}
	if _, err := rnbd.ParseAccessMode(g.Access); err != nil || g.Identity == "" {
		return g, ctl.Errorf(ctl.CodeInvalid, "grant %q: want an identity and access ro, rw or migration", g.String())
	}
	return g, nil
}

func ptr[T any](v T) *T { return &v }
