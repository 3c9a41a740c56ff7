package metrics

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rnbd/rnbd/internal/log"
)

// TestLog2Buckets: stats/rdma_lat's buckets (counts under 2^i µs, the
// last the rest) become cumulative buckets with bounds in seconds.
func TestLog2Buckets(t *testing.T) {
	b, n := Log2Buckets([]uint64{1, 0, 2, 5})
	if n != 8 || len(b) != 3 || b[1e-6] != 1 || b[2e-6] != 1 || b[4e-6] != 3 {
		t.Fatalf("buckets %v, total %d", b, n)
	}
}

// TestListen serves a collector's metrics at /metrics, GET only, and
// stops.
func TestListen(t *testing.T) {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "rnbd_test_value", Help: "A test value."})
	g.Set(42)
	s, err := Listen("127.0.0.1:0", g, log.Discard())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	resp, err := http.Get("http://" + s.Addr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), "rnbd_test_value 42") || !strings.Contains(string(b), "go_goroutines") {
		t.Fatalf("metrics:\n%s", b)
	}
	resp, err = http.Post("http://"+s.Addr()+"/metrics", "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Fatalf("POST /metrics: %s", resp.Status)
	}
}

// TestEmit: label values a peer chose are made valid UTF-8, and a
// metric that cannot be made (wrong label count) is left out, not a
// panic that would cut the scrape short.
func TestEmit(t *testing.T) {
	d := prometheus.NewDesc("rnbd_test_total", "A test counter.", []string{"session"}, nil)
	ch := make(chan prometheus.Metric, 4)
	e := Emit{Ch: ch}
	e.Counter(d, 1, "bad\xffname")
	e.Counter(d, 2, "a", "b")
	e.Gauge(d, 3)
	close(ch)
	var got []prometheus.Metric
	for m := range ch {
		got = append(got, m)
	}
	if len(got) != 1 {
		t.Fatalf("%d metrics, want the one with a valid label count", len(got))
	}
	if Label("bad\xffname") != "bad\uFFFDname" {
		t.Fatalf("label %q", Label("bad\xffname"))
	}
}
