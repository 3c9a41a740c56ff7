package clientd

import (
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// routes are the control API's endpoints (docs/control-api.md), one
// method each.
func (d *Daemon) routes() {
	for _, rt := range []struct {
		route api.Route
		h     ctl.Handler
	}{
		{api.CltMap, d.mapDevice},
		{api.CltDevices, d.listDevices},
		{api.CltDevice, d.showDevice},
		{api.CltDeviceUnmap, d.unmapDevice},
		{api.CltDeviceRemap, d.remapDevice},
		{api.CltDeviceSize, d.resizeDevice},
		{api.CltDeviceLeg, d.replaceLeg},
		{api.CltSessions, d.listSessions},
		{api.CltSession, d.showSession},
		{api.CltSessionSet, d.setSession},
		{api.CltSessionReconnect, d.reconnectSession},
		{api.CltPaths, d.listPaths},
		{api.CltPath, d.showPath},
		{api.CltSessionAddPath, d.addPath},
		{api.CltPathRemove, d.removePath},
		{api.CltPathReconnect, d.reconnectPath},
		{api.CltPathDisconnect, d.disconnectPath},
		{api.CltStats, d.showStats},
		{api.CltStatsReset, d.resetStats},
	} {
		d.ctl.Handle(rt.route.Pattern(), rt.h)
	}
}

func (d *Daemon) mapDevice(r *http.Request) (any, error) {
	var m api.Mapping
	if err := ctl.Decode(r, &m); err != nil {
		return nil, err
	}
	out, note, err := d.mapNoted(r.Context(), m)
	if err != nil {
		return nil, err
	}
	return api.MapResponse{Mapping: out, Note: note}, nil
}

func (d *Daemon) listDevices(r *http.Request) (any, error) {
	return d.deviceRecords(""), nil
}

func (d *Daemon) showDevice(r *http.Request) (any, error) {
	// A mapping not restored at start is shown too, as device list
	// shows it.
	if recs := d.deviceRecords(r.PathValue("name")); len(recs) > 0 {
		return recs, nil
	}
	_, err := d.find(r.PathValue("name"), "device show")
	return nil, err
}

func (d *Daemon) unmapDevice(r *http.Request) (any, error) {
	var req api.UnmapRequest
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
	if m.mir != nil {
		// A leg opened again is taken out and checked as it rejoins:
		// a remap would only degrade the mirror.
		return nil, ctl.Errorf(ctl.CodeNotSupported, "%s is a mirror: remap is for a device of one storage node; a mirror's leg that is out is dialled again every 5 s and rejoins by itself (replace-leg puts another device in its place)", m.Device)
	}
	return nil, m.dev.Remap(r.Context())
}

func (d *Daemon) resizeDevice(r *http.Request) (any, error) {
	var req api.DeviceResizeRequest
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
	if m.mir != nil {
		// A mirror grows (pkg/mirror.Grow) once its legs have.
		if err := m.mir.m.Grow(r.Context(), n); err != nil {
			return nil, err
		}
		return nil, d.showSize(func(x *mapped) bool { return x == m }, m.io)
	}
	if err := m.dev.Resize(n); err != nil {
		return nil, err
	}
	return nil, d.resized(m.dev)
}

func (d *Daemon) replaceLeg(r *http.Request) (any, error) {
	var l api.Leg
	if err := ctl.Decode(r, &l); err != nil {
		return nil, err
	}
	return nil, d.ReplaceLeg(r.Context(), r.PathValue("name"), r.PathValue("leg"), l)
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
	var req api.SetRequest
	if err := ctl.Decode(r, &req); err != nil {
		return nil, err
	}
	s, err := d.findSession(r.PathValue("name"))
	if err != nil {
		return nil, err
	}
	if err := checkSettings(req); err != nil {
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
	recs := []api.CltPathRecord{}
	for _, x := range found {
		recs = append(recs, pathRecord(x.rs, x.p))
	}
	return recs, nil
}

func (d *Daemon) addPath(r *http.Request) (any, error) {
	var req api.PathRequest
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
	return []api.CltPathRecord{pathRecord(s.cs.Session(), p)}, nil
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
	recs := []api.CltStatsRecord{}
	for _, p := range d.pathRecords("", "") {
		recs = append(recs, api.CltStatsRecord{SessName: p.SessName, PathName: p.PathName, RDMA: p.RDMA, Reconnects: p.Reconnects,
			CurLatencyUs: p.CurLatencyUs})
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

func (s *session) set(req api.SetRequest) error {
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
func checkSettings(req api.SetRequest) error {
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
func (d *Daemon) keepSettings(name string, req api.SetRequest) error {
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
