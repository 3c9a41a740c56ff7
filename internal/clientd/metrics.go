package clientd

import (
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rnbd/rnbd/internal/metrics"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// The client's metrics (docs/metrics.md), read from the sessions',
// paths' and devices' own counters at each scrape. Labels are names an
// operator gave (sessions, devices) or the path's addresses: bounded by
// the mappings, never per request.
var (
	pathLabels = []string{"session", "path"}
	cltDescs   = struct {
		pathReqs, pathBytes, pathInflight, pathFailovers, pathReconnects, pathUp, pathState, pathRTT, pathLat *prometheus.Desc
		sessPaths, sessUp, devReqs, devBytes, devFUA, devSize, devState, devInflight                          *prometheus.Desc
		mirLeg, mirEvents, mirCopied                                                                          *prometheus.Desc
	}{
		mirLeg: prometheus.NewDesc("rnbd_client_mirror_leg_state",
			"1 for the state of the mirror's leg (in sync, resyncing, stale, missing; the witness voting or missing; a spare, leg spareN, spare), 0 for the others.",
			[]string{"device", "mirror", "leg", "state"}, nil),
		mirEvents: prometheus.NewDesc("rnbd_client_mirror_events_total",
			"What the mirror did, by event: taken_out (a leg), fenced (a voter that held requests past mirror_leg_timeout), "+
				"commit (a generation), read_retry (a read served by another leg after an error), "+
				"repaired (a block a leg could not read, rewritten from another), cleaned (a region's bit cleared in the bitmap).",
			[]string{"device", "mirror", "event"}, nil),
		mirCopied: prometheus.NewDesc("rnbd_client_mirror_copied_bytes_total",
			"Bytes the mirror copied from one leg to others: resyncs, rebuilds, and a crash's dirty regions.", []string{"device", "mirror"}, nil),
		pathReqs: prometheus.NewDesc("rnbd_client_path_requests_total",
			"RTRS requests posted on the path (stats/rdma rd_cnt, wr_cnt), by direction.", append(pathLabels, "direction"), nil),
		pathBytes: prometheus.NewDesc("rnbd_client_path_bytes_total",
			"Bytes of the requests posted on the path (stats/rdma rd_bytes, wr_bytes), by direction.", append(pathLabels, "direction"), nil),
		pathInflight: prometheus.NewDesc("rnbd_client_path_inflight_requests",
			"Requests on the path waiting for their answers.", pathLabels, nil),
		pathFailovers: prometheus.NewDesc("rnbd_client_path_failovers_total",
			"Requests of the path that failed over to another path when it failed, counted on the path that failed "+
				"(stats/rdma failover_cnt counts them, as the kernel does, on the path that took them).", pathLabels, nil),
		pathReconnects: prometheus.NewDesc("rnbd_client_path_reconnects_total",
			"Reconnects of the path (stats/reconnects), by result.", append(pathLabels, "result"), nil),
		pathUp: prometheus.NewDesc("rnbd_client_path_up",
			"1 if the path is connected.", pathLabels, nil),
		pathState: prometheus.NewDesc("rnbd_client_path_state",
			"1 for the path's RTRS state, 0 for the others (CONNECTING, CONNECTING_ERR, RECONNECTING, CONNECTED, CLOSING, CLOSED, DEAD).",
			append(pathLabels, "state"), nil),
		pathRTT: prometheus.NewDesc("rnbd_client_path_heartbeat_rtt_seconds",
			"The path's last heartbeat round trip (cur_latency).", pathLabels, nil),
		pathLat: prometheus.NewDesc("rnbd_client_path_request_duration_seconds",
			"Time from posting a request on the path to its answer (stats/rdma_lat's log2 buckets), by direction.", append(pathLabels, "direction"), nil),
		sessPaths: prometheus.NewDesc("rnbd_client_session_paths",
			"Paths of the session.", []string{"session"}, nil),
		sessUp: prometheus.NewDesc("rnbd_client_session_connected_paths",
			"Connected paths of the session.", []string{"session"}, nil),
		devReqs: prometheus.NewDesc("rnbd_client_device_requests_total",
			"Requests submitted to the mapped device, by operation (read, write, flush, discard, secure_erase, write_zeroes).",
			[]string{"device", "session", "device_path", "op"}, nil),
		devBytes: prometheus.NewDesc("rnbd_client_device_bytes_total",
			"Bytes of the requests submitted to the mapped device, by operation.", []string{"device", "session", "device_path", "op"}, nil),
		devFUA: prometheus.NewDesc("rnbd_client_device_fua_requests_total",
			"Requests with FUA submitted to the mapped device.", []string{"device", "session", "device_path"}, nil),
		devSize: prometheus.NewDesc("rnbd_client_device_size_bytes",
			"Size of the mapped device.", []string{"device", "session", "device_path"}, nil),
		devInflight: prometheus.NewDesc("rnbd_client_device_inflight_requests",
			"Requests submitted to the mapped device and not done, those waiting for a path included.",
			[]string{"device", "session", "device_path"}, nil),
		devState: prometheus.NewDesc("rnbd_client_device_open",
			"1 if the device is open on the server (state open), 0 while it waits for a path or was closed.", []string{"device", "session", "device_path"}, nil),
	}
)

type cltCollector struct{ d *Daemon }

func (c cltCollector) Describe(ch chan<- *prometheus.Desc) {
	x := cltDescs
	for _, d := range []*prometheus.Desc{x.pathReqs, x.pathBytes, x.pathInflight, x.pathFailovers, x.pathReconnects,
		x.pathUp, x.pathState, x.pathRTT, x.pathLat, x.sessPaths, x.sessUp, x.devReqs, x.devBytes, x.devFUA, x.devSize, x.devState, x.devInflight,
		x.mirLeg, x.mirEvents, x.mirCopied} {
		ch <- d
	}
}

func (c cltCollector) Collect(ch chan<- prometheus.Metric) {
	x := cltDescs
	e := metrics.Emit{Ch: ch}
	counter, gauge := e.Counter, e.Gauge
	for _, s := range c.d.sessionList() {
		rs := s.cs.Session()
		sess := rs.Name()
		up := 0
		paths := rs.Paths()
		seen := map[string]bool{}
		for _, p := range paths {
			name := p.Name()
			if seen[name] {
				continue // two paths of the same addresses: one series
			}
			seen[name] = true
			st := p.Stats()
			cn := st.Counters()
			counter(x.pathReqs, float64(cn.ReadCount), sess, name, "read")
			counter(x.pathReqs, float64(cn.WriteCount), sess, name, "write")
			counter(x.pathBytes, float64(cn.ReadBytes), sess, name, "read")
			counter(x.pathBytes, float64(cn.WriteBytes), sess, name, "write")
			gauge(x.pathInflight, float64(cn.Inflight), sess, name)
			counter(x.pathFailovers, float64(cn.FailedOverCount), sess, name)
			counter(x.pathReconnects, float64(max(cn.ReconnectsSuccessful, 0)), sess, name, "success")
			counter(x.pathReconnects, float64(max(cn.ReconnectsFailed, 0)), sess, name, "failure")
			connected := 0.0
			if p.State() == rtrs.CltPathConnected {
				connected = 1
				up++
			}
			gauge(x.pathUp, connected, sess, name)
			now := p.State()
			for st := rtrs.CltPathConnecting; st <= rtrs.CltPathDead; st++ {
				v := 0.0
				if st == now {
					v = 1
				}
				gauge(x.pathState, v, sess, name, st.String())
			}
			gauge(x.pathRTT, p.CurLatency().Seconds(), sess, name)
			for _, dir := range []rtrs.Dir{rtrs.Read, rtrs.Write} {
				counts, sum := st.Latency(dir)
				buckets, n := metrics.Log2Buckets(counts)
				e.Histogram(x.pathLat, n, sum.Seconds(), buckets, sess, name, dir.String())
			}
		}
		gauge(x.sessPaths, float64(len(paths)), sess)
		gauge(x.sessUp, float64(up), sess)
	}
	c.d.mu.Lock()
	maps := make([]*mapped, 0, len(c.d.maps))
	for _, m := range c.d.maps {
		maps = append(maps, m)
	}
	c.d.mu.Unlock()
	for _, m := range maps {
		if m.mir != nil {
			c.collectMirror(e, m)
			continue
		}
		l := []string{m.Device, m.SessName, m.DevicePath}
		cn := m.dev.Counters()
		for _, op := range rnbd.Ops() {
			counter(x.devReqs, float64(cn.Requests[op]), append(l, strings.ToLower(op.String()))...)
			counter(x.devBytes, float64(cn.Bytes[op]), append(l, strings.ToLower(op.String()))...)
		}
		counter(x.devFUA, float64(cn.FUA), l...)
		gauge(x.devInflight, float64(cn.Inflight), l...)
		gauge(x.devSize, float64(m.dev.Size()), l...)
		open := 0.0
		if m.dev.State() == rnbd.DevOpen {
			open = 1
		}
		gauge(x.devState, open, l...)
	}
}

// legStates are the states a mirror's leg record may have, for
// rnbd_client_mirror_leg_state.
var legStates = []string{"in sync", "resyncing", "stale", "missing", "voting", "spare"}

// collectMirror emits a mirror mapping's size, legs and counters.
func (c cltCollector) collectMirror(e metrics.Emit, m *mapped) {
	x := cltDescs
	e.Gauge(x.devSize, float64(m.io.Size()), m.Device, "", "")
	for _, r := range m.mir.legRecords() {
		for _, st := range legStates {
			v := 0.0
			if st == r.State {
				v = 1
			}
			e.Gauge(x.mirLeg, v, m.Device, m.Mirror, r.Leg, st)
		}
	}
	st := m.mir.m.Stats()
	for _, ev := range []struct {
		name string
		n    uint64
	}{{"taken_out", st.TakenOut.Load()}, {"fenced", st.Fenced.Load()}, {"commit", st.Commits.Load()}, {"read_retry", st.ReadRetry.Load()}, {"repaired", st.Repaired.Load()}, {"cleaned", st.Cleaned.Load()}} {
		e.Counter(x.mirEvents, float64(ev.n), m.Device, m.Mirror, ev.name)
	}
	e.Counter(x.mirCopied, float64(st.Reconciled.Load()), m.Device, m.Mirror)
}
