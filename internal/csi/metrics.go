// The driver's own metrics: each RPC counted by its gRPC code, and
// timed (docs/kubernetes.md, "Metrics").

package csi

import (
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
)

// rpcMetrics counts and times the RPCs the driver answers, and the
// controller's calls to the storage nodes. It is a prometheus.Collector,
// served by internal/metrics; each vector is safe for concurrent use.
type rpcMetrics struct {
	calls   *prometheus.CounterVec
	seconds *prometheus.HistogramVec
	// The controller's: each storage node's queue wait, calls by
	// result, whether it answers, the calls that left it out, and the
	// copies of a name found on two nodes (reclaim.go).
	queueWait  *prometheus.HistogramVec
	nodeCalls  *prometheus.CounterVec
	nodeUp     *prometheus.GaugeVec
	leftOut    *prometheus.CounterVec
	duplicates *prometheus.CounterVec
}

func newRPCMetrics() *rpcMetrics {
	return &rpcMetrics{
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rnbd_csi_calls_total",
			Help: "CSI calls answered, by service, method and gRPC code (OK for success)."}, []string{"service", "method", "code"}),
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "rnbd_csi_call_seconds",
			Help:    "How long CSI calls took to answer, by service and method.",
			Buckets: []float64{.001, .005, .01, .05, .1, .5, 1, 5, 10, 30, 120}}, []string{"service", "method"}),
		queueWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "rnbd_csi_storage_queue_wait_seconds",
			Help:    "How long the controller's calls waited for their turn at a storage node ([controller] max_calls_per_node).",
			Buckets: []float64{.0001, .001, .01, .1, .5, 1, 5, 30}}, []string{"storage_node"}),
		nodeCalls: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rnbd_csi_storage_calls_total",
			Help: "The controller's calls to a storage node, by result: ok, error (the node refused), unanswered (nothing listens, no answer within storage_timeout)."},
			[]string{"storage_node", "result"}),
		nodeUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "rnbd_csi_storage_node_up",
			Help: "1 while the storage node answered the controller's last call, 0 while it did not."}, []string{"storage_node"}),
		leftOut: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rnbd_csi_storage_node_left_out_total",
			Help: "CSI calls answered without a storage node that did not answer (its volumes not listed, its capacity not counted, not placed on), by method."},
			[]string{"storage_node", "method"}),
		duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rnbd_csi_duplicate_volumes_total",
			Help: "Copies of one CSI name found on a second storage node (made while one did not answer), by outcome: reclaimed (deleted), kept (in use: granted or open, left to the operator)."},
			[]string{"storage_node", "outcome"}),
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
	for _, c := range m.collectors() {
		c.Describe(ch)
	}
}

func (m *rpcMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.calls, m.seconds, m.queueWait, m.nodeCalls, m.nodeUp, m.leftOut, m.duplicates}
}

// Collect implements prometheus.Collector.
func (m *rpcMetrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range m.collectors() {
		c.Collect(ch)
	}
}
