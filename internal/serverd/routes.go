// The control API's routes, and the requests and records they take
// and give (docs/control-api.md).

package serverd

import (
	"fmt"
	"net/http"

	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/output"
	"github.com/rnbd/rnbd/internal/units"
)

// Requests of the control API.
type (
	CloseRequest struct {
		Session string `json:"session"`
	}
	// BindRequest gives a session name to a client identity
	// (rnbd.Server.BindSessionName).
	BindRequest struct {
		Identity string `json:"identity"`
	}
	// BindResponse: Disconnected is 1 if a session that had the name
	// under another identity was disconnected.
	BindResponse struct {
		Disconnected int `json:"disconnected"`
	}
	// ResizeRequest: Size as "20GiB" or bytes; Force shrinks an export
	// that sessions have open (rnbd.Server.Resize).
	ResizeRequest struct {
		Size  string `json:"size"`
		Force bool   `json:"force,omitempty"`
	}
	ResizeResponse struct {
		Was int64 `json:"was"`
		Now int64 `json:"now"`
	}
	CloseResponse struct {
		Closed int `json:"closed"`
	}
)

// Field lists of the records the API returns, in the rnbd tool's names
// (docs/control-api.md, "Records", has each with its JSON type).
var (
	DeviceFields = []string{"devname", "devpath", "sessname", "mapping_path", "access_mode", "read_only", "device_id", "state", "write_cache", "rx_sect", "tx_sect", "flush_cnt", "fua_cnt", "discard_cnt", "wzero_cnt", "source", "reason",
		"allow", "allow_from", "allow_identities", "max_sessions", "migration", "write_through", "direction"}
	ExportFields      = []string{"name", "path", "read_only", "allow", "allow_from", "allow_identities", "max_sessions", "migration", "write_through", "grants_only", "source", "not_served"}
	SessionFields     = []string{"sessname", "path_cnt", "act_path_cnt", "state", "path_uu", "rx_bytes", "tx_bytes", "inflights", "devices", "peer", "direction"}
	SessionNameFields = []string{"sessname", "identity"}
	PathFields        = []string{"sessname", "pathname", "src_addr", "dst_addr", "hca_name", "hca_port", "state", "rx_bytes", "tx_bytes", "inflights", "direction"}
	StatsFields       = []string{"sessname", "pathname", "rdma", "inflights"}
)

// routes are the control API's endpoints (docs/control-api.md), one
// method each.
func (d *Daemon) routes() {
	for _, rt := range []struct {
		pattern string
		h       ctl.Handler
	}{
		{"GET /v1/devices", d.listDevices},
		{"GET /v1/devices/{name}", d.showDevice},
		{"POST /v1/devices/{name}/close", d.closeDevice},
		{"GET /v1/exports", d.listExports},
		{"GET /v1/exports/{name}", d.showExport},
		{"POST /v1/exports", d.mapExport},
		{"POST /v1/exports/{name}/resize", d.resizeExport},
		{"DELETE /v1/exports/{name}", d.unmapExport},
		{"GET /v1/sessions", d.listSessions},
		{"GET /v1/sessions/{name}", d.showSession},
		{"POST /v1/sessions/{name}/disconnect", d.disconnectSession},
		{"GET /v1/session-names", d.listSessionNames},
		{"PUT /v1/session-names/{name}", d.bindSessionName},
		{"DELETE /v1/session-names/{name}", d.forgetSessionName},
		{"GET /v1/paths", d.listPaths},
		{"GET /v1/paths/{name}", d.showPath},
		{"POST /v1/paths/{name}/disconnect", d.disconnectPath},
		{"GET /v1/stats", d.showStats},
		{"POST /v1/stats/reset", d.resetStats},
		{"GET /v1/pools", d.listPools},
		{"GET /v1/volumes", d.listVolumes},
		{"GET /v1/volumes/{name}", d.showVolume},
		{"POST /v1/volumes", d.createVolume},
		{"DELETE /v1/volumes/{name}", d.deleteVolume},
		{"POST /v1/volumes/{name}/resize", d.resizeVolume},
		{"GET /v1/snapshots", d.listSnapshots},
		{"GET /v1/snapshots/{name}", d.showSnapshot},
		{"POST /v1/snapshots", d.createSnapshot},
		{"DELETE /v1/snapshots/{name}", d.deleteSnapshot},
		{"GET /v1/exports/{name}/grants", d.listGrants},
		{"POST /v1/exports/{name}/grants", d.addGrant},
		{"DELETE /v1/exports/{name}/grants/{identity}", d.revokeGrant},
	} {
		d.ctl.Handle(rt.pattern, rt.h)
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
	var req CloseRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	n, err := d.rnbd.ForceClose(r.PathValue("name"), req.Session)
	return CloseResponse{Closed: n}, err
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
	var req MapRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	e, err := req.Export()
	if err != nil {
		return nil, ctl.Errorf(ctl.CodeInvalid, "%v", err)
	}
	return nil, d.Map(e)
}

func (d *Daemon) resizeExport(r *http.Request) (any, error) {
	var req ResizeRequest
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
	return ResizeResponse{Was: was, Now: n}, nil
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
	rows := []output.Record{}
	for _, o := range d.rnbd.SessionOwners() {
		rows = append(rows, output.Record{"sessname": o.Name, "identity": o.Identity})
	}
	return rows, nil
}

func (d *Daemon) bindSessionName(r *http.Request) (any, error) {
	var req BindRequest
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
	return BindResponse{Disconnected: n}, nil
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
	rows := []output.Record{}
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
