package serverd

import (
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/internal/metrics"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// The server's metrics (docs/metrics.md), read from its sessions',
// paths' and open devices' counters at each scrape. Labels: session and
// path names, export or device names, the errno of a refusal: bounded,
// never per request.
var srvDescs = struct {
	pathReqs, pathBytes, pathInflight, pathUp, pathLat, sessions, sessPaths *prometheus.Desc
	devBytes, devReqs, devFUA, devInflight, openDevices, exports            *prometheus.Desc
	devProblem, shrinks                                                     *prometheus.Desc
	chunkMem, chunkMax, refused                                             *prometheus.Desc
}{
	pathReqs: prometheus.NewDesc("rnbd_server_path_requests_total",
		"RTRS requests received on the path (stats/rdma rd_cnt, wr_cnt), by direction: read sends data to the client.",
		[]string{"session", "path", "direction"}, nil),
	pathBytes: prometheus.NewDesc("rnbd_server_path_bytes_total",
		"Bytes of the requests received on the path (stats/rdma rd_bytes, wr_bytes), by direction.",
		[]string{"session", "path", "direction"}, nil),
	pathInflight: prometheus.NewDesc("rnbd_server_path_inflight_requests",
		"Requests of the path handed to RNBD and not answered yet.", []string{"session", "path"}, nil),
	pathUp: prometheus.NewDesc("rnbd_server_path_up",
		"1 if the path is connected; 0 also for a path of the session that went while the session stayed, "+
			"until it connects again or the session ends.", []string{"session", "path"}, nil),
	pathLat: prometheus.NewDesc("rnbd_server_path_request_duration_seconds",
		"Time from a request's arrival on the path to its answer being posted: the backend's work and the wait for it "+
			"(log2 buckets, as the client's), by direction.", []string{"session", "path", "direction"}, nil),
	sessions: prometheus.NewDesc("rnbd_server_sessions",
		"Client sessions the server has.", nil, nil),
	sessPaths: prometheus.NewDesc("rnbd_server_session_paths",
		"Paths of the session.", []string{"session"}, nil),
	devBytes: prometheus.NewDesc("rnbd_server_device_bytes_total",
		"Bytes read and written on a device a session has open, since it opened it, by direction.",
		[]string{"session", "device", "direction"}, nil),
	devReqs: prometheus.NewDesc("rnbd_server_device_requests_total",
		"Requests on a device a session has open, since it opened it, by operation (read, write, flush, discard, write_zeroes; "+
			"a write with PREFLUSH counts as a flush too).",
		[]string{"session", "device", "op"}, nil),
	devFUA: prometheus.NewDesc("rnbd_server_device_fua_requests_total",
		"Requests with FUA on a device a session has open, since it opened it.", []string{"session", "device"}, nil),
	devInflight: prometheus.NewDesc("rnbd_server_device_inflight_requests",
		"Requests of a session on a device running on the backend now.", []string{"session", "device"}, nil),
	devProblem: prometheus.NewDesc("rnbd_server_device_backing_problem",
		"1 while the backing file of a device a session has open was found deleted, replaced by another, shrunk behind the server "+
			"(not by rnbd-server resize) or not answering, by the health check or a size poll; 0 when healthy.",
		[]string{"session", "device"}, nil),
	shrinks: prometheus.NewDesc("rnbd_server_backing_shrinks_total",
		"Backing files found shorter than the size their clients are served (cut behind the server, not by rnbd-server resize), "+
			"by device; each new size found counts once.", []string{"device"}, nil),
	openDevices: prometheus.NewDesc("rnbd_server_open_devices",
		"Devices open by sessions (one per session and device).", nil, nil),
	exports: prometheus.NewDesc("rnbd_server_exports",
		"Explicit exports served.", nil, nil),
	chunkMem: prometheus.NewDesc("rnbd_server_chunk_memory_bytes",
		"Memory the paths are counted for against max_chunk_memory: chunks and connection buffers.", nil, nil),
	chunkMax: prometheus.NewDesc("rnbd_server_chunk_memory_limit_bytes",
		"max_chunk_memory (0: no bound).", nil, nil),
	refused: prometheus.NewDesc("rnbd_server_refused_connections_total",
		"Connection requests refused, by the errno answered (EUSERS: too many sessions of one client, ENOMEM: max_chunk_memory, "+
			"EACCES: an identity refused a session or its name, a client without TLS, a client certificate missing, not verified "+
			"or naming none, EPERM: a session name in use, EBUSY: paths connecting, EAGAIN: new_path_rate, ...).", []string{"reason"}, nil),
}

type srvCollector struct{ d *Daemon }

func (c srvCollector) Describe(ch chan<- *prometheus.Desc) {
	x := srvDescs
	for _, d := range []*prometheus.Desc{x.pathReqs, x.pathBytes, x.pathInflight, x.pathUp, x.pathLat, x.sessions, x.sessPaths,
		x.devBytes, x.devReqs, x.devFUA, x.devInflight, x.devProblem, x.shrinks, x.openDevices, x.exports, x.chunkMem, x.chunkMax,
		x.refused} {
		ch <- d
	}
}

func (c srvCollector) Collect(ch chan<- prometheus.Metric) {
	x := srvDescs
	e := metrics.Emit{Ch: ch}
	counter, gauge := e.Counter, e.Gauge
	sessions := c.d.rtrs.Sessions()
	gauge(x.sessions, float64(len(sessions)))
	for _, s := range sessions {
		sess := s.Name()
		if sess == "" {
			continue // still connecting: named by its INFO_REQ
		}
		paths := s.Paths()
		gauge(x.sessPaths, float64(len(paths)), sess)
		seen := map[string]bool{}
		for _, p := range paths {
			name := p.Name()
			if seen[name] {
				// Two paths of one session between the same two
				// addresses (a raw peer can make them): one series.
				continue
			}
			seen[name] = true
			cn := p.Stats().Counters()
			counter(x.pathReqs, float64(cn.ReadCount), sess, name, "read")
			counter(x.pathReqs, float64(cn.WriteCount), sess, name, "write")
			counter(x.pathBytes, float64(cn.ReadBytes), sess, name, "read")
			counter(x.pathBytes, float64(cn.WriteBytes), sess, name, "write")
			gauge(x.pathInflight, float64(cn.Inflight), sess, name)
			up := 0.0
			if p.State() == rtrs.SrvPathConnected {
				up = 1
			}
			gauge(x.pathUp, up, sess, name)
			for _, dir := range []rtrs.Dir{rtrs.Read, rtrs.Write} {
				counts, sum := p.Stats().Latency(dir)
				buckets, n := metrics.Log2Buckets(counts)
				e.Histogram(x.pathLat, n, sum.Seconds(), buckets, sess, name, dir.String())
			}
		}
		// A path that went while the session stayed is down, not
		// gone: a degraded session shows it, until the path connects
		// again or the session ends.
		for _, l := range s.LostPaths() {
			if !seen[l.Name] {
				seen[l.Name] = true
				gauge(x.pathUp, 0, sess, l.Name)
			}
		}
	}
	devs := c.d.rnbd.OpenDevices()
	gauge(x.openDevices, float64(len(devs)))
	for _, o := range devs {
		dev := o.Name
		if o.Export != "" {
			dev = o.Export
		}
		counter(x.devBytes, float64(o.ReadSectors*512), o.Session, dev, "read")
		counter(x.devBytes, float64(o.WrittenSectors*512), o.Session, dev, "write")
		counter(x.devReqs, float64(o.Reads), o.Session, dev, "read")
		counter(x.devReqs, float64(o.Writes), o.Session, dev, "write")
		counter(x.devReqs, float64(o.Flushes), o.Session, dev, "flush")
		counter(x.devReqs, float64(o.Discards), o.Session, dev, "discard")
		counter(x.devReqs, float64(o.WriteZeroes), o.Session, dev, "write_zeroes")
		counter(x.devFUA, float64(o.FUAWrites), o.Session, dev)
		gauge(x.devInflight, float64(o.Inflight), o.Session, dev)
		problem := 0.0
		if o.BackingProblem != "" {
			problem = 1
		}
		gauge(x.devProblem, problem, o.Session, dev)
	}
	for dev, n := range c.d.rnbd.BackingShrinks() {
		counter(x.shrinks, float64(n), dev)
	}
	gauge(x.exports, float64(len(c.d.rnbd.Exports())))
	used, limit := c.d.rtrs.ChunkMemory()
	gauge(x.chunkMem, float64(used))
	gauge(x.chunkMax, float64(limit))
	for errno, n := range c.d.rtrs.Rejected() {
		reason := unix.ErrnoName(errno)
		if reason == "" {
			reason = errno.Error()
		}
		counter(x.refused, float64(n), reason)
	}
}
