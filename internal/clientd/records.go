// The records the control API answers with — devices, sessions,
// paths — built from the daemon's state (docs/control-api.md, "Records",
// has each field with its JSON type).

package clientd

import (
	"sort"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// seconds is a duration as records give it: a number of seconds, to
// the millisecond.
func seconds(t time.Duration) float64 {
	return float64(t.Round(time.Millisecond)) / float64(time.Second)
}

// tmoSeconds is a timer that can be off: seconds, or nil (null) for off.
func tmoSeconds(t time.Duration) *float64 {
	if t < 0 {
		return nil
	}
	s := seconds(t)
	return &s
}

// leftSeconds is a time left: seconds, or nil (null) for none (0).
func leftSeconds(t time.Duration) *float64 {
	if t <= 0 {
		return nil
	}
	s := seconds(t)
	return &s
}

// sessionList is the daemon's sessions, by name.
func (d *Daemon) sessionList() []*session {
	d.mu.Lock()
	defer d.mu.Unlock()
	var ss []*session
	for _, s := range d.sessions {
		ss = append(ss, s)
	}
	// The sessions of mirrors' legs, each a mirror's own.
	for _, m := range d.maps {
		if m.mir == nil {
			continue
		}
		ls := m.legs()
		m.mir.mu.Lock()
		for i, c := range m.mir.conns() {
			if c.cs != nil {
				ss = append(ss, &session{cs: c.cs, paths: ls[i].Paths, transport: m.Transport})
			}
		}
		m.mir.mu.Unlock()
	}
	sort.Slice(ss, func(i, j int) bool { return ss[i].cs.Session().Name() < ss[j].cs.Session().Name() })
	return ss
}

// deviceRecords are the device records (the one named, if given).
func (d *Daemon) deviceRecords(name string) []api.CltDeviceRecord {
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
	recs := []api.CltDeviceRecord{}
	// Mappings of the state file that did not come back at start: they
	// stay until restored by a retry, or unmapped.
	for _, m := range failed {
		recs = append(recs, api.CltDeviceRecord{DevName: m.Device, SessName: m.SessName, MappingPath: m.DevicePath,
			AccessMode: m.AccessMode, State: m.state(), Direction: "client", Mirror: m.Mirror, Legs: []api.CltLegRecord{}})
	}
	for _, m := range ms {
		socket := ""
		if m.Kernel == "" {
			socket = m.fe.path()
		}
		rec := api.CltDeviceRecord{DevName: m.Device, SessName: m.SessName, DevPath: m.fe.path(), MappingPath: m.DevicePath,
			AccessMode: m.AccessMode, Size: m.io.Size(), Socket: socket, IOMode: m.fe.ioMode(), Direction: "client", Mirror: m.Mirror,
			Legs: []api.CltLegRecord{}}
		if m.mir != nil {
			rec.State, rec.Legs, rec.RegionSize = m.mir.state(), m.mir.legRecords(), m.mir.m.RegionSize()
		} else {
			rec.State = m.dev.State().String()
		}
		recs = append(recs, rec)
	}
	sort.SliceStable(recs, func(i, j int) bool { return recs[i].DevName < recs[j].DevName })
	return recs
}

// sessionRecords are the session records (the one named, if given).
func (d *Daemon) sessionRecords(name string) []api.CltSessionRecord {
	recs := []api.CltSessionRecord{}
	for _, s := range d.sessionList() {
		rs := s.cs.Session()
		if name != "" && rs.Name() != name {
			continue
		}
		sum := api.NewPathSum()
		for _, p := range rs.Paths() {
			c := p.Stats().Counters()
			sum.Add(p.State() == rtrs.CltPathConnected, c.ReadBytes, c.WriteBytes, c.Inflight)
		}
		var noPathSince *string // null while it has a path
		if t := s.cs.NoPathSince(); !t.IsZero() {
			v := t.UTC().Format(time.RFC3339)
			noPathSince = &v
		}
		// fast_io_fail_tmo's time left: null when it does not run, 0
		// once it has passed (IO fails at once).
		var failIn *float64
		switch in := s.cs.FastIOFailIn(); {
		case in > 0:
			failIn = leftSeconds(in)
		case in < 0:
			failIn = new(float64)
		}
		waiting, waitFailIn := s.cs.Waiting()
		pol := rs.MPPolicy()
		recs = append(recs, api.CltSessionRecord{
			SessName: rs.Name(), PathCnt: sum.PathCnt, ActPathCnt: sum.ActPathCnt, State: sum.State, PathUU: sum.PathUU,
			MPPolicy: pol.Name(), MPPolicySysfs: pol.String(),
			NoPathTimeoutSec: seconds(s.cs.NoPathTimeout()), NoPathSince: noPathSince,
			WaitingIO: waiting, WaitingIOFailsInSec: leftSeconds(waitFailIn),
			FastIOFailTmoSec: tmoSeconds(s.cs.FastIOFailTmo()), FastIOFailInSec: failIn,
			MaxReconnectAttempts: rs.MaxReconnectAttempts(), ReconnectDelaySec: seconds(rs.ReconnectDelay()),
			CtrlLossTmoSec: tmoSeconds(rs.CtrlLossTmo()),
			RxBytes:        sum.RxBytes, TxBytes: sum.TxBytes, Inflights: sum.Inflights,
			Devices: len(s.cs.Devices()), Transport: s.transport, Direction: "client",
		})
	}
	return recs
}

// pathRecord is the record of path p of session rs.
func pathRecord(rs *rtrs.CltSession, p *rtrs.CltPath) api.CltPathRecord {
	c := p.Stats().Counters()
	a := p.Addr()
	attempts, next := p.ReconnectAttempts()
	var lossIn *float64 // null: up, given up, or no ctrl_loss_tmo
	if left, ok := p.CtrlLossIn(); ok {
		v := seconds(max(left, 0))
		lossIn = &v
	}
	return api.CltPathRecord{
		SessName: rs.Name(), PathName: p.Name(),
		SrcAddr: rtrs.FormatAddr(a.Src.Addr(), false), DstAddr: rtrs.FormatAddr(a.Dst.Addr(), false),
		HCAName: p.HCAName(), HCAPort: p.HCAPort(),
		State: p.State().SysfsString(), RTRSState: p.State().String(),
		RxBytes: c.ReadBytes, TxBytes: c.WriteBytes, Inflights: c.Inflight,
		Reconnects:        api.Reconnects{Successful: c.ReconnectsSuccessful, Failed: c.ReconnectsFailed},
		ReconnectAttempts: attempts, NextReconnectInSec: leftSeconds(next), CtrlLossInSec: lossIn,
		ReconnectDelaySec: seconds(rs.ReconnectDelay()), MaxReconnectAttempts: rs.MaxReconnectAttempts(),
		CtrlLossTmoSec: tmoSeconds(rs.CtrlLossTmo()),
		CurLatencyUs:   float64(p.CurLatency().Nanoseconds()) / 1e3,
		RDMA: api.CltRDMA{RdCnt: c.ReadCount, RdBytes: c.ReadBytes, WrCnt: c.WriteCount, WrBytes: c.WriteBytes,
			Inflight: c.Inflight, FailoverCnt: c.FailoverCount},
		Direction: "client",
	}
}

// pathRecords are the path records, of session if given (the one
// named, if given).
func (d *Daemon) pathRecords(session, name string) []api.CltPathRecord {
	recs := []api.CltPathRecord{}
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
