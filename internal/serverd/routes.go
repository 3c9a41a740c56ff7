// The control API's routes, and the requests and records they take
// and give (docs/control-api.md).

package serverd

import (
	"fmt"
	"net/http"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/units"
)

// routes are the control API's endpoints, from the route table
// (api.ServerRoutes: each route's right is there), one handler each.
func (d *Daemon) routes() {
	for _, rt := range []struct {
		route api.Route
		h     ctl.Handler
	}{
		{api.SrvDevices, d.listDevices},
		{api.SrvDevice, d.showDevice},
		{api.SrvDeviceClose, d.closeDevice},
		{api.SrvExports, d.listExports},
		{api.SrvExport, d.showExport},
		{api.SrvExportMap, d.mapExport},
		{api.SrvExportResize, d.resizeExport},
		{api.SrvExportUnmap, d.unmapExport},
		{api.SrvExportGrants, d.listGrants},
		{api.SrvExportGrant, d.addGrant},
		{api.SrvExportRevoke, d.revokeGrant},
		{api.SrvSessions, d.listSessions},
		{api.SrvSession, d.showSession},
		{api.SrvSessionDisconnect, d.disconnectSession},
		{api.SrvSessionNames, d.listSessionNames},
		{api.SrvSessionNameBind, d.bindSessionName},
		{api.SrvSessionNameForget, d.forgetSessionName},
		{api.SrvPaths, d.listPaths},
		{api.SrvPath, d.showPath},
		{api.SrvPathDisconnect, d.disconnectPath},
		{api.SrvStats, d.showStats},
		{api.SrvStatsReset, d.resetStats},
		{api.SrvPools, d.listPools},
		{api.SrvVolumes, d.listVolumes},
		{api.SrvVolume, d.showVolume},
		{api.SrvVolumeCreate, d.createVolume},
		{api.SrvVolumeDelete, d.deleteVolume},
		{api.SrvVolumeResize, d.resizeVolume},
		{api.SrvVolumeLabels, d.setVolumeLabels},
		{api.SrvVolumeGrants, d.listVolumeGrants},
		{api.SrvVolumeGrant, d.addVolumeGrant},
		{api.SrvVolumeRevoke, d.revokeVolumeGrant},
		{api.SrvVolumeHold, d.holdVolume},
		{api.SrvVolumeRelease, d.releaseVolume},
		{api.SrvSnapshots, d.listSnapshots},
		{api.SrvSnapshot, d.showSnapshot},
		{api.SrvSnapshotCreate, d.createSnapshot},
		{api.SrvSnapshotDelete, d.deleteSnapshot},
		{api.SrvDiscover, d.discover},
	} {
		d.ctl.Handle(rt.route.Pattern(), rt.h)
	}
}

func (d *Daemon) listDevices(r *http.Request) (any, error) {
	return d.deviceRecords(""), nil
}

func (d *Daemon) showDevice(r *http.Request) (any, error) {
	rows := d.deviceRecords(r.PathValue("name"))
	if len(rows) == 0 {
		return nil, ctl.Errorf(ctl.CodeNotFound, "no device %s", r.PathValue("name"))
	}
	return rows, nil
}

func (d *Daemon) closeDevice(r *http.Request) (any, error) {
	var req api.CloseRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	n, err := d.rnbd.ForceClose(r.PathValue("name"), req.Session)
	return api.CloseResponse{Closed: n}, err
}

func (d *Daemon) listExports(r *http.Request) (any, error) {
	return d.exportRecords(""), nil
}

func (d *Daemon) showExport(r *http.Request) (any, error) {
	rows := d.exportRecords(r.PathValue("name"))
	if len(rows) == 0 {
		return nil, ctl.Errorf(ctl.CodeNotFound, "no export %s", r.PathValue("name"))
	}
	return rows, nil
}

func (d *Daemon) mapExport(r *http.Request) (any, error) {
	var req api.MapRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	c := ctl.CallerOf(r)
	if !c.Local && req.GrantsOnly == nil {
		// Made over the network: open to no one until granted, unless
		// the admin says otherwise.
		req.GrantsOnly = ptr(true)
	}
	e, err := exportOf(req)
	if err != nil {
		return nil, ctl.Errorf(ctl.CodeInvalid, "%v", err)
	}
	if !c.Local {
		if e.Path, err = d.cfg.Admin.underExportRoots(e.Path); err != nil {
			return nil, err
		}
	}
	return nil, d.Map(e)
}

func (d *Daemon) resizeExport(r *http.Request) (any, error) {
	var req api.ResizeRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	n, err := units.ParseSize(req.Size)
	if err != nil {
		return nil, ctl.Errorf(ctl.CodeInvalid, "size %q: %v", req.Size, err)
	}
	if d.isVolume(r.PathValue("name")) {
		return nil, ctl.Errorf(ctl.CodeInvalid, "export %s is a volume's: volume resize grows it (in its pool too)", r.PathValue("name"))
	}
	was, err := d.rnbd.Resize(r.PathValue("name"), n, req.Force)
	if err != nil {
		return nil, err
	}
	return api.ResizeResponse{Was: was, Now: n}, nil
}

func (d *Daemon) unmapExport(r *http.Request) (any, error) {
	return nil, d.Unmap(r.PathValue("name"), r.URL.Query().Get("force") == "true")
}

func (d *Daemon) listSessions(r *http.Request) (any, error) {
	return d.sessionRecords(""), nil
}

func (d *Daemon) showSession(r *http.Request) (any, error) {
	rows := d.sessionRecords(r.PathValue("name"))
	if len(rows) == 0 {
		return nil, ctl.Errorf(ctl.CodeNotFound, "no session %s", r.PathValue("name"))
	}
	return rows, nil
}

func (d *Daemon) disconnectSession(r *http.Request) (any, error) {
	x := d.findSession(r.PathValue("name"))
	if x == nil {
		return nil, ctl.Errorf(ctl.CodeNotFound, "no session %s", r.PathValue("name"))
	}
	for _, p := range x.Paths() {
		p.Disconnect()
	}
	return nil, nil
}

func (d *Daemon) listSessionNames(r *http.Request) (any, error) {
	rows := []api.SessionNameRecord{}
	for _, o := range d.rnbd.SessionOwners() {
		rows = append(rows, api.SessionNameRecord{SessName: o.Name, Identity: o.Identity})
	}
	return rows, nil
}

func (d *Daemon) bindSessionName(r *http.Request) (any, error) {
	var req api.BindRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	n, err := d.rnbd.BindSessionName(r.PathValue("name"), req.Identity)
	if err != nil {
		return nil, err
	}
	if err := d.saveState(); err != nil {
		return nil, fmt.Errorf("name bound, but saving the state file failed: %w", err)
	}
	return api.BindResponse{Disconnected: n}, nil
}

func (d *Daemon) forgetSessionName(r *http.Request) (any, error) {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	if _, err := d.rnbd.ForgetSessionName(r.PathValue("name")); err != nil {
		return nil, err
	}
	if err := d.saveState(); err != nil {
		return nil, fmt.Errorf("name freed, but saving the state file failed: %w", err)
	}
	return nil, nil
}

func (d *Daemon) listPaths(r *http.Request) (any, error) {
	return d.pathRecords("", r.URL.Query().Get("session")), nil
}

func (d *Daemon) showPath(r *http.Request) (any, error) {
	found, err := d.lookupPaths(r.PathValue("name"), r.URL.Query().Get("session"))
	if err != nil {
		return nil, err
	}
	rows := []api.SrvPathRecord{}
	for _, p := range found {
		rows = append(rows, pathRecord(p))
	}
	return rows, nil
}

func (d *Daemon) disconnectPath(r *http.Request) (any, error) {
	p, err := d.findPath(r.PathValue("name"), r.URL.Query().Get("session"))
	if err != nil {
		return nil, err
	}
	p.Disconnect()
	return nil, nil
}

func (d *Daemon) showStats(r *http.Request) (any, error) {
	return d.statRecords(), nil
}

func (d *Daemon) resetStats(r *http.Request) (any, error) {
	for _, x := range d.rtrs.Sessions() {
		for _, p := range x.Paths() {
			p.Stats().Reset()
		}
	}
	return nil, nil
}
