// The control API's routes of pools, volumes, snapshots and grants
// (docs/control-api.md), and the answers they give.

package serverd

import (
	"net/http"

	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/rnbd"
)

// CreatedResponse wraps a record a POST made or found: Created is false
// when it was there already with the same parameters (a retry).
type CreatedResponse struct {
	Created bool           `json:"created"`
	Record  map[string]any `json:"record"`
}

func (d *Daemon) listPools(r *http.Request) (any, error) { return d.poolRecords(), nil }

func (d *Daemon) listVolumes(r *http.Request) (any, error) { return d.volumeRecords(""), nil }

func (d *Daemon) showVolume(r *http.Request) (any, error) {
	rows := d.volumeRecords(r.PathValue("name"))
	if len(rows) == 0 {
		return nil, ctl.Errorf(ctl.CodeNotFound, "no volume %s", r.PathValue("name"))
	}
	return rows, nil
}

func (d *Daemon) createVolume(r *http.Request) (any, error) {
	var req VolumeRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	rec, created, err := d.CreateVolume(req)
	if err != nil {
		return nil, err
	}
	return CreatedResponse{Created: created, Record: rec}, nil
}

func (d *Daemon) deleteVolume(r *http.Request) (any, error) {
	return nil, d.DeleteVolume(r.PathValue("name"), r.URL.Query().Get("force") == "true")
}

func (d *Daemon) resizeVolume(r *http.Request) (any, error) {
	var req ResizeRequest
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
	was, err := d.ResizeVolume(r.PathValue("name"), n)
	if err != nil {
		return nil, err
	}
	return ResizeResponse{Was: was, Now: n}, nil
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
	var req SnapshotRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	s, created, err := d.CreateSnapshot(req)
	if err != nil {
		return nil, err
	}
	return CreatedResponse{Created: created, Record: snapshotRecord(s)}, nil
}

func (d *Daemon) deleteSnapshot(r *http.Request) (any, error) {
	return nil, d.DeleteSnapshot(r.PathValue("name"))
}

func (d *Daemon) listGrants(r *http.Request) (any, error) {
	return d.grantRecords(r.PathValue("name"))
}

func (d *Daemon) addGrant(r *http.Request) (any, error) {
	var req GrantRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	if req.Access == "" {
		req.Access = "rw"
	}
	g := rnbd.Grant{Identity: req.Identity, Access: req.Access}
	if _, err := rnbd.ParseAccessMode(g.Access); err != nil || g.Identity == "" {
		return nil, ctl.Errorf(ctl.CodeInvalid, "grant %q: want an identity and access ro, rw or migration", g.String())
	}
	return nil, d.Grant(r.PathValue("name"), g)
}

func (d *Daemon) revokeGrant(r *http.Request) (any, error) {
	return nil, d.Revoke(r.PathValue("name"), r.PathValue("identity"))
}
