package clientd

import (
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/output"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// Requests of the control API.
type (
	ResizeRequest struct {
		Size string `json:"size"`
	}
	// SetRequest is a session's settings (session set, or map's for
	// the session it makes); unset fields stay as they are.
	SetRequest struct {
		MPPolicy             *string `json:"mpath_policy,omitempty"`
		MaxReconnectAttempts *int    `json:"max_reconnect_attempts,omitempty"`
		NoPathTimeout        *string `json:"no_path_timeout,omitempty"`
		// FastIOFailTmo: a duration, or "off" (rnbd.CltSession.SetFastIOFailTmo).
		FastIOFailTmo *string `json:"fast_io_fail_tmo,omitempty"`
		// CtrlLossTmo: a duration, or "off" (rtrs.CltSession.SetCtrlLossTmo).
		CtrlLossTmo *string `json:"ctrl_loss_tmo,omitempty"`
		// ReconnectDelay: a duration (rtrs.CltSession.SetReconnectDelay).
		ReconnectDelay *string `json:"reconnect_delay,omitempty"`
	}
	PathRequest struct {
		Path string `json:"path"`
	}
	UnmapRequest struct {
		Force bool `json:"force"`
	}
)

// Field lists in the rnbd tool's names (docs/control-api.md, "Records",
// has each with its JSON type).
var (
	DeviceFields  = []string{"devname", "sessname", "devpath", "mapping_path", "access_mode", "state", "size", "socket", "io_mode", "direction"}
	SessionFields = []string{"sessname", "path_cnt", "act_path_cnt", "state", "path_uu", "mpath_policy", "mpath_policy_sysfs", "no_path_timeout_sec", "no_path_since", "waiting_io", "waiting_io_fails_in_sec", "fast_io_fail_tmo_sec", "fast_io_fail_in_sec", "max_reconnect_attempts", "reconnect_delay_sec", "ctrl_loss_tmo_sec", "rx_bytes", "tx_bytes", "inflights", "devices", "transport", "direction"}
	PathFields    = []string{"sessname", "pathname", "src_addr", "dst_addr", "hca_name", "hca_port", "state", "rtrs_state", "rx_bytes", "tx_bytes", "inflights", "reconnects", "reconnect_attempts", "next_reconnect_in_sec", "ctrl_loss_in_sec", "reconnect_delay_sec", "max_reconnect_attempts", "ctrl_loss_tmo_sec", "cur_latency_us", "rdma", "direction"}
	StatsFields   = []string{"sessname", "pathname", "rdma", "reconnects", "cur_latency_us"}
)

// routes are the control API's endpoints (docs/control-api.md), one
// method each.
func (d *Daemon) routes() {
	for _, rt := range []struct {
		pattern string
		h       ctl.Handler
	}{
		{"POST /v1/devices", d.mapDevice},
		{"GET /v1/devices", d.listDevices},
		{"GET /v1/devices/{name}", d.showDevice},
		{"POST /v1/devices/{name}/unmap", d.unmapDevice},
		{"POST /v1/devices/{name}/remap", d.remapDevice},
		{"POST /v1/devices/{name}/resize", d.resizeDevice},
		{"GET /v1/sessions", d.listSessions},
		{"GET /v1/sessions/{name}", d.showSession},
		{"POST /v1/sessions/{name}/set", d.setSession},
		{"POST /v1/sessions/{name}/reconnect", d.reconnectSession},
		{"GET /v1/paths", d.listPaths},
		{"GET /v1/paths/{name}", d.showPath},
		{"POST /v1/sessions/{name}/paths", d.addPath},
		{"POST /v1/paths/{name}/remove", d.removePath},
		{"POST /v1/paths/{name}/reconnect", d.reconnectPath},
		{"POST /v1/paths/{name}/disconnect", d.disconnectPath},
		{"GET /v1/stats", d.showStats},
		{"POST /v1/stats/reset", d.resetStats},
	} {
		d.ctl.Handle(rt.pattern, rt.h)
	}
}

func (d *Daemon) mapDevice(r *http.Request) (any, error) {
	var m Mapping
	if err := ctl.Decode(r, &m); err != nil {
		return nil, err
	}
	out, note, err := d.mapNoted(r.Context(), m)
	if err != nil {
		return nil, err
	}
	return MapResponse{Mapping: out, Note: note}, nil
}

func (d *Daemon) listDevices(r *http.Request) (any, error) {
	return d.deviceRecords(""), nil
}

func (d *Daemon) showDevice(r *http.Request) (any, error) {
	if _, err := d.find(r.PathValue("name"), "device show"); err != nil {
		return nil, err
	}
	return d.deviceRecords(r.PathValue("name")), nil
}

func (d *Daemon) unmapDevice(r *http.Request) (any, error) {
	var req UnmapRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	return nil, d.Unmap(r.Context(), r.PathValue("name"), req.Force)
}

func (d *Daemon) remapDevice(r *http.Request) (any, error) {
	m, err := d.find(r.PathValue("name"), "remap")
	if err != nil {
		return nil, err
	}
	return nil, m.dev.Remap(r.Context())
}

func (d *Daemon) resizeDevice(r *http.Request) (any, error) {
	var req ResizeRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	m, err := d.find(r.PathValue("name"), "resize")
	if err != nil {
		return nil, err
	}
	n, err := units.ParseSize(req.Size)
	if err != nil {
		return nil, ctl.Errorf(ctl.CodeInvalid, "%v", err)
	}
	if err := m.dev.Resize(n); err != nil {
		return nil, err
	}
	return nil, d.resized(m.dev)
}

func (d *Daemon) listSessions(r *http.Request) (any, error) {
	return d.sessionRecords(""), nil
}

func (d *Daemon) showSession(r *http.Request) (any, error) {
	if _, err := d.findSession(r.PathValue("name")); err != nil {
		return nil, err
	}
	return d.sessionRecords(r.PathValue("name")), nil
}

func (d *Daemon) setSession(r *http.Request) (any, error) {
	var req SetRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	s, err := d.findSession(r.PathValue("name"))
	if err != nil {
		return nil, err
	}
	if err := req.check(); err != nil {
		return nil, err // nothing applied
	}
	if err := s.set(req); err != nil {
		return nil, err
	}
	return nil, d.keepSettings(r.PathValue("name"), req)
}

func (d *Daemon) reconnectSession(r *http.Request) (any, error) {
	s, err := d.findSession(r.PathValue("name"))
	if err != nil {
		return nil, err
	}
	var errs []error
	for _, p := range s.cs.Session().Paths() {
		if err := p.Reconnect(r.Context()); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", p.Name(), err))
		}
	}
	return nil, errors.Join(errs...)
}

func (d *Daemon) listPaths(r *http.Request) (any, error) {
	return d.pathRecords(r.URL.Query().Get("session"), ""), nil
}

func (d *Daemon) showPath(r *http.Request) (any, error) {
	found, err := d.lookupPaths(r.URL.Query().Get("session"), r.PathValue("name"))
	if err != nil {
		return nil, err
	}
	recs := []output.Record{}
	for _, x := range found {
		recs = append(recs, pathRecord(x.rs, x.p))
	}
	return recs, nil
}

func (d *Daemon) addPath(r *http.Request) (any, error) {
	var req PathRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	s, err := d.findSession(r.PathValue("name"))
	if err != nil {
		return nil, err
	}
	// At the session's port, as the kernel's add_path: its paths
	// share the dest_port they were mapped with.
	port := uint16(rtrs.DefaultPort)
	if ps := s.cs.Session().Paths(); len(ps) > 0 {
		port = ps[0].Addr().Dst.Port()
	}
	pa, err := rtrs.ParsePathAddr(req.Path, port)
	if err != nil {
		return nil, ctl.Errorf(ctl.CodeInvalid, "%v", err)
	}
	p, err := s.cs.Session().AddPath(r.Context(), pa)
	if err != nil {
		return nil, err
	}
	return []output.Record{pathRecord(s.cs.Session(), p)}, nil
}

func (d *Daemon) removePath(r *http.Request) (any, error) {
	p, err := d.pathOf(r)
	if err != nil {
		return nil, err
	}
	return nil, p.Remove()
}

func (d *Daemon) reconnectPath(r *http.Request) (any, error) {
	p, err := d.pathOf(r)
	if err != nil {
		return nil, err
	}
	return nil, p.Reconnect(r.Context())
}

func (d *Daemon) disconnectPath(r *http.Request) (any, error) {
	p, err := d.pathOf(r)
	if err != nil {
		return nil, err
	}
	return nil, p.Disconnect()
}

func (d *Daemon) showStats(r *http.Request) (any, error) {
	recs := []output.Record{}
	for _, rec := range d.pathRecords("", "") {
		s := output.Record{}
		for _, f := range StatsFields {
			s[f] = rec[f]
		}
		recs = append(recs, s)
	}
	return recs, nil
}

func (d *Daemon) resetStats(r *http.Request) (any, error) {
	for _, s := range d.sessionList() {
		for _, p := range s.cs.Session().Paths() {
			p.Stats().ResetRDMA()
			p.Stats().ResetReconnects()
			p.Stats().ResetLatency()
		}
	}
	return nil, nil
}

func (s *session) set(req SetRequest) error {
	cs := s.cs
	if req.MPPolicy != nil {
		p, err := rtrs.ParseMPPolicy(*req.MPPolicy)
		if err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "%v", err)
		}
		if err := cs.Session().SetMPPolicy(p); err != nil {
			return err
		}
	}
	if req.MaxReconnectAttempts != nil {
		if err := cs.Session().SetMaxReconnectAttempts(*req.MaxReconnectAttempts); err != nil {
			return err
		}
	}
	if req.NoPathTimeout != nil {
		t, err := time.ParseDuration(*req.NoPathTimeout)
		if err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "no_path_timeout %q: %v", *req.NoPathTimeout, err)
		}
		if err := cs.SetNoPathTimeout(t); err != nil {
			return err
		}
	}
	if req.FastIOFailTmo != nil {
		t, err := ParseTmo(*req.FastIOFailTmo)
		if err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "fast_io_fail_tmo: %v", err)
		}
		cs.SetFastIOFailTmo(t)
	}
	if req.CtrlLossTmo != nil {
		t, err := ParseTmo(*req.CtrlLossTmo)
		if err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "ctrl_loss_tmo: %v", err)
		}
		cs.Session().SetCtrlLossTmo(t)
	}
	if req.ReconnectDelay != nil {
		t, err := parseReconnectDelay(*req.ReconnectDelay)
		if err != nil {
			return err
		}
		if err := cs.Session().SetReconnectDelay(t); err != nil {
			return err
		}
	}
	return nil
}

// parseReconnectDelay parses reconnect_delay: a duration from 100 ms to
// an hour.
func parseReconnectDelay(v string) (time.Duration, error) {
	t, err := time.ParseDuration(v)
	if err != nil || t < rtrs.MinReconnectDelayLimit || t > rtrs.MaxReconnectDelayLimit {
		return 0, ctl.Errorf(ctl.CodeInvalid, "reconnect_delay %q: want a duration from %v to %v", v, rtrs.MinReconnectDelayLimit, rtrs.MaxReconnectDelayLimit)
	}
	return t, nil
}

// check says what is wrong with the settings, without applying them.
func (req SetRequest) check() error {
	if req.MPPolicy != nil {
		if _, err := rtrs.ParseMPPolicy(*req.MPPolicy); err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "%v", err)
		}
	}
	if n := req.MaxReconnectAttempts; n != nil && (*n < -1 || *n > 9999) {
		return ctl.Errorf(ctl.CodeInvalid, "max_reconnect_attempts %d: want -1 to 9999", *n)
	}
	if req.NoPathTimeout != nil {
		if t, err := time.ParseDuration(*req.NoPathTimeout); err != nil || t < 0 {
			return ctl.Errorf(ctl.CodeInvalid, "no_path_timeout %q: want a duration of 0 or more", *req.NoPathTimeout)
		}
	}
	if req.FastIOFailTmo != nil {
		if _, err := ParseTmo(*req.FastIOFailTmo); err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "fast_io_fail_tmo: %v", err)
		}
	}
	if req.CtrlLossTmo != nil {
		if _, err := ParseTmo(*req.CtrlLossTmo); err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "ctrl_loss_tmo: %v", err)
		}
	}
	if req.ReconnectDelay != nil {
		if _, err := parseReconnectDelay(*req.ReconnectDelay); err != nil {
			return err
		}
	}
	return nil
}

// Merge overlays what o sets on req.
func (req SetRequest) Merge(o SetRequest) SetRequest {
	if o.MPPolicy != nil {
		req.MPPolicy = o.MPPolicy
	}
	if o.MaxReconnectAttempts != nil {
		req.MaxReconnectAttempts = o.MaxReconnectAttempts
	}
	if o.NoPathTimeout != nil {
		req.NoPathTimeout = o.NoPathTimeout
	}
	if o.FastIOFailTmo != nil {
		req.FastIOFailTmo = o.FastIOFailTmo
	}
	if o.CtrlLossTmo != nil {
		req.CtrlLossTmo = o.CtrlLossTmo
	}
	if o.ReconnectDelay != nil {
		req.ReconnectDelay = o.ReconnectDelay
	}
	return req
}

// ParseTmo parses a timer that can be off: a duration, or "off" (or a
// negative one).
func ParseTmo(v string) (time.Duration, error) {
	if v == "off" || v == "-1" {
		return -1, nil
	}
	t, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("%q: want a duration or off", v)
	}
	return max(t, -1), nil
}

// keepSettings records settings of session name in its mappings, so
// that a restart dials it with them, and saves the state.
func (d *Daemon) keepSettings(name string, req SetRequest) error {
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	d.mu.Lock()
	for _, m := range d.maps {
		if m.SessName == name {
			m.Settings = m.Settings.Merge(req)
		}
	}
	// A mapping still being restored comes back with them too.
	for i := range d.failed {
		if d.failed[i].SessName == name {
			d.failed[i].Settings = d.failed[i].Settings.Merge(req)
		}
	}
	d.mu.Unlock()
	if err := d.saveState(); err != nil {
		return fmt.Errorf("the settings apply, but saving them in the state file failed: %w", err)
	}
	return nil
}

// sessPath is a path and its session.
type sessPath struct {
	rs *rtrs.CltSession
	p  *rtrs.CltPath
}

func (x sessPath) name() string    { return x.p.Name() }
func (x sessPath) session() string { return x.rs.Name() }

// lookupPaths finds the paths a name as typed names, within session if
// given: their name, or the same written another way
// (rtrs.MatchPathName).
func (d *Daemon) lookupPaths(session, name string) ([]sessPath, error) {
	var all []sessPath
	for _, s := range d.sessionList() {
		rs := s.cs.Session()
		if session != "" && rs.Name() != session {
			continue
		}
		for _, p := range rs.Paths() {
			all = append(all, sessPath{rs, p})
		}
	}
	return ctl.Lookup("path", name, all, sessPath.name, func(x sessPath) bool {
		a := x.p.Addr()
		return rtrs.MatchPathName(name, a.Src.Addr(), a.Dst.Addr())
	})
}

// pathOf is the path a request names: {name}, within ?session= if given
// (findPath).
func (d *Daemon) pathOf(r *http.Request) (*rtrs.CltPath, error) {
	return d.findPath(r.URL.Query().Get("session"), r.PathValue("name"))
}

// findPath is the one path a name as typed names (lookupPaths).
func (d *Daemon) findPath(session, name string) (*rtrs.CltPath, error) {
	found, err := d.lookupPaths(session, name)
	if err != nil {
		return nil, err
	}
	x, err := ctl.One("path", name, found, sessPath.name, sessPath.session)
	return x.p, err
}
