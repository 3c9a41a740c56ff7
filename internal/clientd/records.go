// The records the control API answers with — devices, sessions,
// paths — built from the daemon's state (docs/control-api.md, "Records",
// has each field with its JSON type).

package clientd

import (
	"sort"
	"time"

	"github.com/rnbd/rnbd/internal/output"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// seconds is a duration as records give it: a number of seconds, to
// the millisecond.
func seconds(t time.Duration) float64 {
	return float64(t.Round(time.Millisecond)) / float64(time.Second)
}

// tmoSeconds is a timer that can be off: seconds, or nil (null) for off.
func tmoSeconds(t time.Duration) any {
	if t < 0 {
		return nil
	}
	return seconds(t)
}

// leftSeconds is a time left: seconds, or nil (null) for none (0).
func leftSeconds(t time.Duration) any {
	if t <= 0 {
		return nil
	}
	return seconds(t)
}

// sessionList is the daemon's sessions, by name.
func (d *Daemon) sessionList() []*session {
	d.mu.Lock()
	defer d.mu.Unlock()
	var ss []*session
	for _, s := range d.sessions {
		ss = append(ss, s)
	}
	sort.Slice(ss, func(i, j int) bool { return ss[i].cs.Session().Name() < ss[j].cs.Session().Name() })
	return ss
}

// deviceRecords are the device records (the one named, if given).
func (d *Daemon) deviceRecords(name string) []output.Record {
	d.mu.Lock()
	var ms []*mapped
	for _, m := range d.maps {
		if name == "" || m.Device == name {
			ms = append(ms, m)
		}
	}
	var failed []failedMapping
	for _, m := range d.failed {
		if d.maps[m.Device] != nil {
			continue // restored a moment ago: listed as it is now
		}
		if name == "" || m.Device == name {
			failed = append(failed, m)
		}
	}
	d.mu.Unlock()
	sort.Slice(ms, func(i, j int) bool { return ms[i].Device < ms[j].Device })
	recs := []output.Record{}
	// Mappings of the state file that did not come back at start: they
	// stay until restored by a retry, or unmapped.
	for _, m := range failed {
		recs = append(recs, output.Record{
			"devname": m.Device, "sessname": m.SessName, "devpath": "", "mapping_path": m.DevicePath,
			"access_mode": m.AccessMode, "state": m.state(), "size": 0,
			"socket": "", "io_mode": "", "direction": "client",
		})
	}
	for _, m := range ms {
		socket := ""
		if m.Kernel == "" {
			socket = m.fe.path()
		}
		recs = append(recs, output.Record{
			"devname": m.Device, "sessname": m.SessName, "devpath": m.fe.path(), "mapping_path": m.DevicePath,
			"access_mode": m.AccessMode, "state": m.dev.State().String(), "size": m.dev.Size(),
			"socket": socket, "io_mode": m.fe.ioMode(), "direction": "client",
		})
	}
	sort.SliceStable(recs, func(i, j int) bool { return recs[i]["devname"].(string) < recs[j]["devname"].(string) })
	return recs
}

// sessionRecords are the session records (the one named, if given).
func (d *Daemon) sessionRecords(name string) []output.Record {
	recs := []output.Record{}
	for _, s := range d.sessionList() {
		rs := s.cs.Session()
		if name != "" && rs.Name() != name {
			continue
		}
		var sum output.PathSum
		for _, p := range rs.Paths() {
			c := p.Stats().Counters()
			sum.Add(p.State() == rtrs.CltPathConnected, c.ReadBytes, c.WriteBytes, c.Inflight)
		}
		var noPathSince any // null while it has a path
		if t := s.cs.NoPathSince(); !t.IsZero() {
			noPathSince = t.UTC().Format(time.RFC3339)
		}
		// fast_io_fail_tmo's time left: null when it does not run, 0
		// once it has passed (IO fails at once).
		var failIn any
		switch in := s.cs.FastIOFailIn(); {
		case in > 0:
			failIn = seconds(in)
		case in < 0:
			failIn = 0
		}
		waiting, waitFailIn := s.cs.Waiting()
		pol := rs.MPPolicy()
		recs = append(recs, sum.Fields(output.Record{
			"sessname": rs.Name(), "mpath_policy": pol.Name(), "mpath_policy_sysfs": pol.String(), "transport": s.transport,
			"no_path_timeout_sec": seconds(s.cs.NoPathTimeout()), "no_path_since": noPathSince,
			"waiting_io": waiting, "waiting_io_fails_in_sec": leftSeconds(waitFailIn),
			"fast_io_fail_tmo_sec": tmoSeconds(s.cs.FastIOFailTmo()), "fast_io_fail_in_sec": failIn,
			"max_reconnect_attempts": rs.MaxReconnectAttempts(), "ctrl_loss_tmo_sec": tmoSeconds(rs.CtrlLossTmo()),
			"reconnect_delay_sec": seconds(rs.ReconnectDelay()), "devices": len(s.cs.Devices()), "direction": "client",
		}))
	}
	return recs
}

// pathRecord is the record of path p of session rs.
func pathRecord(rs *rtrs.CltSession, p *rtrs.CltPath) output.Record {
	c := p.Stats().Counters()
	a := p.Addr()
	attempts, next := p.ReconnectAttempts()
	var lossIn any // null: up, given up, or no ctrl_loss_tmo
	if left, ok := p.CtrlLossIn(); ok {
		lossIn = seconds(max(left, 0))
	}
	return output.Record{
		"sessname": rs.Name(), "pathname": p.Name(),
		"src_addr": rtrs.FormatAddr(a.Src.Addr(), false), "dst_addr": rtrs.FormatAddr(a.Dst.Addr(), false),
		"hca_name": p.HCAName(), "hca_port": p.HCAPort(),
		"state": p.State().SysfsString(), "rtrs_state": p.State().String(),
		"rx_bytes": c.ReadBytes, "tx_bytes": c.WriteBytes, "inflights": c.Inflight,
		// The kernel's stats/reconnects, "successful failed", by name.
		"reconnects":         output.Object{{Key: "successful", Value: c.ReconnectsSuccessful}, {Key: "failed", Value: c.ReconnectsFailed}},
		"cur_latency_us":     float64(p.CurLatency().Nanoseconds()) / 1e3,
		"reconnect_attempts": attempts, "next_reconnect_in_sec": leftSeconds(next), "ctrl_loss_in_sec": lossIn,
		"reconnect_delay_sec": seconds(rs.ReconnectDelay()), "max_reconnect_attempts": rs.MaxReconnectAttempts(),
		"ctrl_loss_tmo_sec": tmoSeconds(rs.CtrlLossTmo()),
		// The kernel's stats/rdma, "rd_cnt rd_bytes wr_cnt wr_bytes
		// inflight failover_cnt", by name.
		"rdma": output.Object{{Key: "rd_cnt", Value: c.ReadCount}, {Key: "rd_bytes", Value: c.ReadBytes},
			{Key: "wr_cnt", Value: c.WriteCount}, {Key: "wr_bytes", Value: c.WriteBytes},
			{Key: "inflight", Value: c.Inflight}, {Key: "failover_cnt", Value: c.FailoverCount}},
		"direction": "client",
	}
}

// pathRecords are the path records, of session if given (the one
// named, if given).
func (d *Daemon) pathRecords(session, name string) []output.Record {
	recs := []output.Record{}
	for _, s := range d.sessionList() {
		rs := s.cs.Session()
		if session != "" && rs.Name() != session {
			continue
		}
		for _, p := range rs.Paths() {
			if name == "" || p.Name() == name {
				recs = append(recs, pathRecord(rs, p))
			}
		}
	}
	return recs
}
