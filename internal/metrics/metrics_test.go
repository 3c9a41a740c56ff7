package metrics

import (
	"errors"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rnbd/rnbd/pkg/log"
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
	if !strings.Contains(string(b), "rnbd_test_value 42") || !strings.Contains(string(b), "go_goroutines") ||
		!strings.Contains(string(b), `rnbd_build_info{goversion="`+runtime.Version()+`",revision="unknown",version="devel"} 1`) {
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

// TestListenIPv4Wildcard: metrics_listen = "0.0.0.0:PORT" serves IPv4
// only (a dial to ::1 on its port is refused) and says 0.0.0.0;
// "[::]:PORT" serves both.
func TestListenIPv4Wildcard(t *testing.T) {
	if l, err := net.Listen("tcp6", "[::1]:0"); err != nil {
		t.Skip("no IPv6 loopback on this host")
	} else {
		l.Close()
	}
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "rnbd_test_value", Help: "A test value."})
	s, err := Listen("0.0.0.0:0", g, log.Discard())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	host, port, _ := net.SplitHostPort(s.Addr())
	if host != "0.0.0.0" {
		t.Errorf("listening on 0.0.0.0 reports %s", s.Addr())
	}
	get := func(addr string) error {
		c := http.Client{Timeout: 5 * time.Second}
		resp, err := c.Get("http://" + addr + "/metrics")
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	if err := get(net.JoinHostPort("127.0.0.1", port)); err != nil {
		t.Errorf("IPv4 loopback: %v", err)
	}
	if err := get(net.JoinHostPort("::1", port)); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("IPv6 loopback to metrics on 0.0.0.0: %v, want ECONNREFUSED", err)
	}
	both, err := Listen("[::]:0", g, log.Discard())
	if err != nil {
		t.Fatal(err)
	}
	defer both.Close()
	_, port, _ = net.SplitHostPort(both.Addr())
	for _, a := range []string{"127.0.0.1", "::1"} {
		if err := get(net.JoinHostPort(a, port)); err != nil {
			t.Errorf("%s to metrics on [::]: %v", a, err)
		}
	}
}
