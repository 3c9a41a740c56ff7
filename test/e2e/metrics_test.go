package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
)

// scrape is one /metrics: each sample by its name and labels as
// written ("name{a=\"x\"}"), and the raw text.
type scrape struct {
	samples map[string]float64
	text    []byte
}

// fetchMetrics gets http://addr/metrics.
func fetchMetrics(t *testing.T, addr string) scrape {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+addr+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("scrape %s: %v", addr, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("scrape %s: %v %s", addr, err, resp.Status)
	}
	return parseMetrics(t, b)
}

func parseMetrics(t *testing.T, b []byte) scrape {
	t.Helper()
	s := scrape{samples: map[string]float64{}, text: b}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		l := sc.Text()
		if l == "" || l[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(l, ' ')
		v, err := strconv.ParseFloat(l[i+1:], 64)
		if i < 0 || err != nil {
			t.Fatalf("metrics line %q", l)
		}
		s.samples[l[:i]] = v
	}
	return s
}

// sum adds the samples of a metric whose labels contain every one of
// match (`op="write"`).
func (s scrape) sum(name string, match ...string) float64 {
	var n float64
	for k, v := range s.samples {
		rest, ok := strings.CutPrefix(k, name)
		if !ok || (rest != "" && rest[0] != '{') {
			continue
		}
		all := true
		for _, m := range match {
			all = all && strings.Contains(rest, m)
		}
		if all {
			n += v
		}
	}
	return n
}

// lintMetrics checks an exposition as promtool check metrics does
// (client_golang's promlint), and with promtool itself where make deps
// put it.
func lintMetrics(t *testing.T, who string, s scrape) {
	t.Helper()
	problems, err := promlint.New(bytes.NewReader(s.text)).Lint()
	if err != nil {
		t.Fatalf("%s metrics: %v", who, err)
	}
	for _, p := range problems {
		t.Errorf("%s metrics: %s: %s", who, p.Metric, p.Text)
	}
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		promtool, err = filepath.Abs("../../.tools/promtool") // make deps
	}
	if _, serr := os.Stat(promtool); err != nil || serr != nil {
		if os.Getenv("RNBD_REQUIRE_PROMTOOL") != "" {
			t.Fatalf("no promtool (make deps takes it from Debian's prometheus package) to check %s's metrics", who)
		}
		t.Logf("no promtool: only promlint checked %s's metrics", who)
		return
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = bytes.NewReader(s.text)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics on %s's: %v\n%s", who, err, out)
	}
}

// TestMetrics: both daemons serve /metrics. While fio writes through a
// mapping, both are scraped: requests are in flight, the counters only
// grow. After fio wrote 16 MiB in 4 KiB blocks and flushed, then read
// 8 MiB in 64 KiB blocks, the client's device and path counters and the
// server's path and device counters moved by exactly what fio did, both
// latency histograms counted every request, and the expositions pass
// promtool check metrics.
func TestMetrics(t *testing.T) {
	needTools(t, "fio")
	dir := t.TempDir()
	vol := filepath.Join(dir, "vol.img")
	kit.SparseFile(t, vol, 64<<20)
	port := freePort(t)
	srvMetrics, cltMetrics := fmt.Sprintf("127.0.0.1:%d", freePort(t)), fmt.Sprintf("127.0.0.1:%d", freePort(t))
	srv := startServer(t, dir, port, "--metrics-listen", srvMetrics)
	srv.ok("map", "vol", vol)
	// No size polls: each reads a block, and the reads are counted
	// exactly below.
	cl := startClient(t, dir, "--metrics-listen", cltMetrics, "--size-poll", "0")
	out := cl.ok("map", "--sessname", "mx", "--path", "ip:127.0.0.1", "--device-path", "vol", "--dest-port", fmt.Sprint(port))
	uri, ok := strings.CutPrefix(strings.TrimSpace(out), "rnbd0 mapped: ")
	if !ok {
		t.Fatalf("map output %q", out)
	}
	c0, s0 := fetchMetrics(t, cltMetrics), fetchMetrics(t, srvMetrics)
	// During a run, scraped every 50 ms: no counter ever goes back.
	fio := start(t, "fio", "--name=m", "--ioengine=nbd", "--uri="+uri, "--rw=write", "--bs=4k", "--iodepth=8",
		"--size=16m", "--end_fsync=1", "--output-format=json")
	prevC, prevS := c0, s0
	for running := true; running; {
		select {
		case err := <-fio.done:
			fio.done <- err // for wait
			running = false
		case <-time.After(50 * time.Millisecond):
		}
		c, s := fetchMetrics(t, cltMetrics), fetchMetrics(t, srvMetrics)
		for _, m := range []struct {
			a, b scrape
			name string
		}{{prevC, c, "rnbd_client_device_requests_total"}, {prevC, c, "rnbd_client_path_bytes_total"},
			{prevS, s, "rnbd_server_path_requests_total"}, {prevS, s, "rnbd_server_device_bytes_total"}} {
			if m.b.sum(m.name) < m.a.sum(m.name) {
				t.Errorf("%s went back from %v to %v during the run", m.name, m.a.sum(m.name), m.b.sum(m.name))
			}
		}
		prevC, prevS = c, s
	}
	if err := fio.wait(t, 2*time.Minute); err != nil {
		t.Fatalf("fio: %v\n%s", err, fio.out.String())
	}
	run(t, 2*time.Minute, "fio", "--name=r", "--ioengine=nbd", "--uri="+uri, "--rw=read", "--bs=64k", "--iodepth=4",
		"--size=8m", "--output-format=json")
	c1, s1 := fetchMetrics(t, cltMetrics), fetchMetrics(t, srvMetrics)
	const writes, bytes = 4096, 16 << 20
	const reads, readBytes = 128, 8 << 20
	delta := func(a, b scrape, name string, match ...string) float64 {
		return b.sum(name, match...) - a.sum(name, match...)
	}
	for _, c := range []struct {
		what      string
		got, want float64
		atLeast   bool
	}{
		{"client device writes", delta(c0, c1, "rnbd_client_device_requests_total", `op="write"`, `device="rnbd0"`, `session="mx"`), writes, false},
		{"client device bytes written", delta(c0, c1, "rnbd_client_device_bytes_total", `op="write"`), bytes, false},
		{"client device flushes", delta(c0, c1, "rnbd_client_device_requests_total", `op="flush"`), 1, true},
		{"client device reads", delta(c0, c1, "rnbd_client_device_requests_total", `op="read"`), reads, false},
		{"client device bytes read", delta(c0, c1, "rnbd_client_device_bytes_total", `op="read"`), readBytes, false},
		{"client path reads", delta(c0, c1, "rnbd_client_path_requests_total", `direction="read"`), reads, false},
		{"client device in flight after the runs", c1.sum("rnbd_client_device_inflight_requests"), 0, false},
		{"client path writes", delta(c0, c1, "rnbd_client_path_requests_total", `direction="write"`), writes + 1, true},
		{"client latency observations", delta(c0, c1, "rnbd_client_path_request_duration_seconds_count", `direction="write"`), writes + 1, true},
		{"client path failovers", delta(c0, c1, "rnbd_client_path_failovers_total"), 0, false},
		{"client connected paths", c1.sum("rnbd_client_session_connected_paths", `session="mx"`), 1, false},
		{"server path writes", delta(s0, s1, "rnbd_server_path_requests_total", `direction="write"`, `session="mx"`), writes + 1, true},
		{"server device bytes written", delta(s0, s1, "rnbd_server_device_bytes_total", `direction="write"`, `device="vol"`), bytes, false},
		{"server device flushes", delta(s0, s1, "rnbd_server_device_requests_total", `op="flush"`), 1, true},
		{"server device writes", delta(s0, s1, "rnbd_server_device_requests_total", `op="write"`, `device="vol"`), writes, false},
		{"server device reads", delta(s0, s1, "rnbd_server_device_requests_total", `op="read"`, `device="vol"`), reads, false},
		{"server device bytes read", delta(s0, s1, "rnbd_server_device_bytes_total", `direction="read"`, `device="vol"`), readBytes, false},
		{"server path reads", delta(s0, s1, "rnbd_server_path_requests_total", `direction="read"`, `session="mx"`), reads, false},
		{"server latency observations", delta(s0, s1, "rnbd_server_path_request_duration_seconds_count", `session="mx"`),
			writes + reads + 1, true},
		{"server device in flight after the runs", s1.sum("rnbd_server_device_inflight_requests"), 0, false},
		{"server open devices", s1.sum("rnbd_server_open_devices"), 1, false},
		{"server sessions", s1.sum("rnbd_server_sessions"), 1, false},
		{"client path states", c1.sum("rnbd_client_path_state", `session="mx"`), 1, false},
		{"client path state CONNECTED", c1.sum("rnbd_client_path_state", `session="mx"`, `state="CONNECTED"`), 1, false},
	} {
		if c.got != c.want && !(c.atLeast && c.got >= c.want) {
			t.Errorf("%s moved by %v, want %v", c.what, c.got, c.want)
		}
	}
	if used := s1.sum("rnbd_server_chunk_memory_bytes"); used <= 0 || used > s1.sum("rnbd_server_chunk_memory_limit_bytes") {
		t.Errorf("server chunk memory %v of %v", used, s1.sum("rnbd_server_chunk_memory_limit_bytes"))
	}
	lintMetrics(t, "rnbd-client", c1)
	lintMetrics(t, "rnbd-server", s1)

	// Requests in flight show on both sides under load. A server
	// answers a write to a file in memory within microseconds, so the
	// load runs until scrapes saw both (at most 20 s), not for a count.
	load := start(t, "fio", "--name=busy", "--ioengine=nbd", "--uri="+uri, "--rw=randwrite", "--bs=4k", "--iodepth=32",
		"--size=64m", "--time_based", "--runtime=20s", "--output-format=json")
	var cltBusy, srvBusy bool
	for running := true; running && !(cltBusy && srvBusy); {
		select {
		case err := <-load.done:
			load.done <- err
			running = false
		case <-time.After(10 * time.Millisecond):
		}
		cltBusy = cltBusy || fetchMetrics(t, cltMetrics).sum("rnbd_client_device_inflight_requests", `device="rnbd0"`) > 0
		srvBusy = srvBusy || fetchMetrics(t, srvMetrics).sum("rnbd_server_path_inflight_requests", `session="mx"`) > 0
	}
	load.cmd.Process.Signal(syscall.SIGINT) // fio ends its job early, and cleanly
	load.wait(t, 30*time.Second)
	if !cltBusy || !srvBusy {
		t.Errorf("no scrape under load saw requests in flight (client %v, server %v)", cltBusy, srvBusy)
	}

	// The example dashboard shows only what the daemons serve.
	dash, err := os.ReadFile("../../deploy/grafana-rnbd.json")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range regexp.MustCompile(`rnbd_(client|server)_[a-z_]+`).FindAllString(string(dash), -1) {
		if name == "rnbd_server_refused_connections_total" {
			continue // its series come with the first refusal: none here
		}
		if c1.sum(name)+s1.sum(name) == 0 && !strings.Contains(string(c1.text)+string(s1.text), "\n"+name) {
			t.Errorf("deploy/grafana-rnbd.json uses %s, which neither daemon serves", name)
		}
	}
}

// series are the samples of a metric whose labels contain every one of
// match, by their labels.
func (s scrape) series(name string, match ...string) map[string]float64 {
	out := map[string]float64{}
	for k, v := range s.samples {
		rest, ok := strings.CutPrefix(k, name)
		if !ok || (rest != "" && rest[0] != '{') {
			continue
		}
		all := true
		for _, m := range match {
			all = all && strings.Contains(rest, m)
		}
		if all {
			out[rest] = v
		}
	}
	return out
}

// TestServerLostPathMetrics: a session of two paths loses one (its
// client disconnects it). The server's scrape keeps the path that went:
// rnbd_server_path_up 0 for it beside 1 for the other, for as long as
// the session stays degraded; when the path connects again it is 1
// again; when the session ends, its series go.
func TestServerLostPathMetrics(t *testing.T) {
	dir := t.TempDir()
	port := freePort(t)
	maddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	srv := startServer(t, dir, port, "--metrics-listen", maddr)
	c := srv.client("deg", 2) // paths from 127.0.0.2 and 127.0.0.3
	first, second := `path="ip:127.0.0.2@ip:127.0.0.1"`, `path="ip:127.0.0.3@ip:127.0.0.1"`
	up := func() (map[string]float64, scrape) {
		m := fetchMetrics(t, maddr)
		return m.series("rnbd_server_path_up", `session="deg"`), m
	}
	is := func(ups map[string]float64, path string, want float64) bool {
		for labels, v := range ups {
			if strings.Contains(labels, path) {
				return v == want
			}
		}
		return false
	}
	if ups, _ := up(); len(ups) != 2 || !is(ups, first, 1) || !is(ups, second, 1) {
		t.Fatalf("rnbd_server_path_up of a session of two paths: %v", ups)
	}
	lose := c.Session().Paths()[1]
	if err := lose.Disconnect(); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the server to see the path go", func() bool {
		return fetchMetrics(t, maddr).sum("rnbd_server_session_paths", `session="deg"`) == 1
	})
	// Scraped again: the lost path stays at 0 while the session is
	// degraded, not only in the moment it goes. That it stays is shown
	// by time passing between the scrapes: no event marks it.
	for range 2 {
		ups, m := up()
		if len(ups) != 2 || !is(ups, first, 1) || !is(ups, second, 0) {
			t.Fatalf("rnbd_server_path_up of a degraded session: %v, want the lost path at 0 beside the other at 1", ups)
		}
		lintMetrics(t, "rnbd-server (a degraded session)", m)
		time.Sleep(100 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := lose.Reconnect(ctx); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the path back at 1", func() bool {
		ups, _ := up()
		return len(ups) == 2 && is(ups, first, 1) && is(ups, second, 1)
	})
	c.Close()
	kit.WaitFor(t, 10*time.Second, "the ended session's series to go", func() bool {
		ups, _ := up()
		return len(ups) == 0
	})
}
