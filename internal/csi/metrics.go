// The driver's own metrics: each RPC counted by its gRPC code, and
// timed (docs/kubernetes.md, "Metrics").

package csi

import (
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
)

// rpcMetrics counts and times the RPCs the driver answers. It is a
// prometheus.Collector, served by internal/metrics.
type rpcMetrics struct {
	calls   *prometheus.CounterVec
	seconds *prometheus.HistogramVec
}

func newRPCMetrics() *rpcMetrics {
	return &rpcMetrics{
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rnbd_csi_calls_total",
			Help: "CSI calls answered, by service, method and gRPC code (OK for success)."}, []string{"service", "method", "code"}),
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "rnbd_csi_call_seconds",
			Help:    "How long CSI calls took to answer, by service and method.",
			Buckets: []float64{.001, .005, .01, .05, .1, .5, 1, 5, 10, 30, 120}}, []string{"service", "method"}),
	}
}

// observe records a call of fullMethod ("/csi.v1.Node/NodeStageVolume").
func (m *rpcMetrics) observe(fullMethod string, code codes.Code, took time.Duration) {
	svc, method := splitMethod(fullMethod)
	m.calls.WithLabelValues(svc, method, code.String()).Inc()
	m.seconds.WithLabelValues(svc, method).Observe(took.Seconds())
}

// splitMethod splits "/csi.v1.Node/NodeStageVolume" into "Node" and
// "NodeStageVolume".
func splitMethod(full string) (service, method string) {
	s, m, ok := strings.Cut(strings.TrimPrefix(full, "/"), "/")
	if !ok {
		return "", full
	}
	if i := strings.LastIndexByte(s, '.'); i >= 0 {
		s = s[i+1:]
	}
	return s, m
}

// Describe implements prometheus.Collector.
func (m *rpcMetrics) Describe(ch chan<- *prometheus.Desc) {
	m.calls.Describe(ch)
	m.seconds.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *rpcMetrics) Collect(ch chan<- prometheus.Metric) {
	m.calls.Collect(ch)
	m.seconds.Collect(ch)
}
