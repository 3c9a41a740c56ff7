// Package metrics serves a daemon's Prometheus metrics: the HTTP
// endpoint, and the conversions the daemons' collectors share. The
// collectors themselves read the daemons' own counters at scrape time
// (internal/clientd, internal/serverd), so the IO path counts nothing
// twice.
package metrics

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/rnbd/rnbd/internal/version"
	"github.com/rnbd/rnbd/pkg/log"
)

// Server is a metrics endpoint: GET /metrics.
//
// Concurrency: a Server has no lock: its fields are set by Listen and
// never change, and Addr and Close may be called from any goroutine
// (Close more than once). Scrapes run on net/http's goroutines, at most
// 4 at once (a fifth is answered 503), and each calls the collector's
// Collect: the collector given to Listen must be safe for concurrent
// use, as the daemons' are (they read their counters atomically or
// under their own locks, taken one at a time).
type Server struct {
	srv  *http.Server
	ln   net.Listener
	done chan struct{}
}

// Listen serves c, with the Go runtime's and the process's collectors,
// at http://addr/metrics. addr is HOST:PORT; it should be a loopback or
// management address: the metrics name sessions, paths and devices.
func Listen(addr string, c prometheus.Collector, lg *log.Entry) (*Server, error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(c); err != nil {
		return nil, err
	}
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), BuildInfo())
	ln, err := net.Listen(listenNetwork(addr), addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog: httpLog{lg}, ErrorHandling: promhttp.ContinueOnError, MaxRequestsInFlight: 4,
	}))
	s := &Server{ln: ln, done: make(chan struct{}),
		srv: &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, WriteTimeout: 30 * time.Second}}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			lg.WithError(err).Error("metrics endpoint stopped")
		}
	}()
	lg.WithField("metrics", "http://"+ln.Addr().String()+"/metrics").Info("serving metrics")
	return s, nil
}

// BuildInfo is rnbd_build_info: 1, labelled with the daemon's version,
// revision (-dirty for a tree with changes) and Go version, as
// `version` says them.
func BuildInfo() prometheus.Collector {
	v := version.Get()
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name:        "rnbd_build_info",
		Help:        "The daemon's build: 1, labelled with its version, the commit it was built from and its Go version.",
		ConstLabels: prometheus.Labels{"version": Label(v.Version), "revision": Label(v.RevisionLabel()), "goversion": v.GoVersion},
	}, func() float64 { return 1 })
}

// listenNetwork is "tcp4" for an IPv4 address (0.0.0.0:PORT is every
// IPv4 address and no IPv6 one, where Go's "tcp" would listen on [::]),
// "tcp" for the rest ([::]:PORT both families, a name what it resolves
// to).
func listenNetwork(addr string) string {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return "tcp" // net.Listen says what is wrong with it
	}
	if a, err := netip.ParseAddr(host); err == nil && a.Unmap().Is4() {
		return "tcp4"
	}
	return "tcp"
}

// Addr is the address the endpoint listens on.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the endpoint.
func (s *Server) Close() error {
	err := s.srv.Close()
	<-s.done
	return err
}

type httpLog struct{ lg *log.Entry }

func (l httpLog) Println(v ...any) { l.lg.Warn(fmt.Sprint(v...)) }

// Emit sends a collector's metrics to its channel. Label values come
// from peers and operators (session names, paths): invalid UTF-8 is
// replaced, and a metric that cannot be made is left out rather than
// failing the scrape.
type Emit struct {
	Ch chan<- prometheus.Metric
}

// Label makes s a valid label value.
func Label(s string) string { return strings.ToValidUTF8(s, "\uFFFD") }

func (e Emit) send(d *prometheus.Desc, t prometheus.ValueType, v float64, labels []string) {
	for i, l := range labels {
		labels[i] = Label(l)
	}
	if m, err := prometheus.NewConstMetric(d, t, v, labels...); err == nil {
		e.Ch <- m
	}
}

// Counter sends a counter's value with its labels.
func (e Emit) Counter(d *prometheus.Desc, v float64, labels ...string) {
	e.send(d, prometheus.CounterValue, v, labels)
}

// Gauge sends a gauge's value with its labels.
func (e Emit) Gauge(d *prometheus.Desc, v float64, labels ...string) {
	e.send(d, prometheus.GaugeValue, v, labels)
}

// Histogram sends a histogram with its labels.
func (e Emit) Histogram(d *prometheus.Desc, n uint64, sum float64, buckets map[float64]uint64, labels ...string) {
	for i, l := range labels {
		labels[i] = Label(l)
	}
	if m, err := prometheus.NewConstHistogram(d, n, sum, buckets, labels...); err == nil {
		e.Ch <- m
	}
}

// Log2Buckets turns stats/rdma_lat's buckets (counts[i], i < len-1:
// requests under 2^i µs; the last: the rest) into a Prometheus
// histogram's cumulative buckets, upper bounds in seconds, and the total.
func Log2Buckets(counts []uint64) (buckets map[float64]uint64, total uint64) {
	buckets = make(map[float64]uint64, len(counts))
	for i, n := range counts {
		total += n
		if i < len(counts)-1 {
			buckets[math.Ldexp(1e-6, i)] = total
		}
	}
	return buckets, total
}
