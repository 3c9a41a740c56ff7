package e2e

import (
	"encoding/json"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

type loadReport struct {
	Result struct {
		Reads, Writes    int64
		Errors           int64
		VerifyFailures   int64
		FirstError       string
		LatencyMaxMicros int64
	} `json:"result"`
	Paths []struct {
		Name     string `json:"name"`
		State    string `json:"state"`
		Rdma     string `json:"rdma"`
		Counters struct {
			ReadCount, WriteCount uint64
			Inflight              int64
			FailoverCount         uint64
			ReconnectsSuccessful  int64
			ReconnectsFailed      int64
		} `json:"counters"`
	} `json:"paths"`
	Error string `json:"error"`
}

// twoPaths is a client and a server namespace joined by two veth pairs,
// 10.N.1.0/24 and 10.N.2.0/24, with rtrs-demo serving on both server
// addresses.
type twoPaths struct {
	srvNS, cliNS string
	net          int
	srv          *proc
	srvArgs      []string // how srv was started (newNBDTwoPaths)
	cli          *proc    // the client daemon (newNBDTwoPaths)
}

// newNamespaces makes the client and server namespaces of a twoPaths rig
// and joins them by the two veth pairs.
func newNamespaces(t *testing.T, tag string, net int) *twoPaths {
	requireRoot(t)
	id := os.Getpid()
	r := &twoPaths{net: net,
		srvNS: netns(t, fmt.Sprintf("rnbd-%s-%d-s", tag, id)),
		cliNS: netns(t, fmt.Sprintf("rnbd-%s-%d-c", tag, id))}
	veth(t, r.cliNS, "c1", r.addr(1, 2)+"/24", r.srvNS, "s1", r.addr(1, 1)+"/24")
	veth(t, r.cliNS, "c2", r.addr(2, 2)+"/24", r.srvNS, "s2", r.addr(2, 1)+"/24")
	return r
}

func newTwoPaths(t *testing.T, tag string, net int, srvArgs ...string) *twoPaths {
	if suitePKI != "" {
		t.Skip("rtrs-demo has no TLS: the plain pass runs this")
	}
	r := newNamespaces(t, tag, net)
	ready := filepath.Join(t.TempDir(), "ready")
	args := append([]string{"ip", "netns", "exec", r.srvNS, bin("rtrs-demo"), "server",
		"--listen", "tcp://" + r.addr(1, 1) + ":1234", "--listen", "tcp://" + r.addr(2, 1) + ":1234",
		"--size", "32MiB", "--ready-file", ready, "--log-level", "info"}, srvArgs...)
	r.srv = start(t, args...)
	waitFile(t, ready, 10*time.Second)
	return r
}

// silentLoss takes the server's address on path 1 away for d, and back:
// packets to it are dropped, with no RST and no carrier change. d is the
// fault the test is about (longer than the heartbeats and the TCP user
// timeout take to fail the path, so that its reconnects fail too), not a
// stand-in for an event.
func (r *twoPaths) silentLoss(t *testing.T, d time.Duration) {
	gone := r.addr(1, 1) + "/24"
	sh(t, "ip", "-n", r.srvNS, "addr", "del", gone, "dev", "s1")
	t.Logf("server address %s removed", gone)
	time.Sleep(d)
	sh(t, "ip", "-n", r.srvNS, "addr", "add", gone, "dev", "s1")
	t.Logf("server address %s back", gone)
}

// addr is host h on subnet n (1 or 2).
func (r *twoPaths) addr(n, h int) string { return fmt.Sprintf("10.%d.%d.%d", r.net, n, h) }

// load starts a verified 4 KiB load at QD16, half writes, over both
// paths (round-robin, two connections each) for d.
func (r *twoPaths) load(t *testing.T, d time.Duration, extra ...string) *proc {
	args := append([]string{"ip", "netns", "exec", r.cliNS, bin("rtrs-demo"), "load",
		"--path", "ip:" + r.addr(1, 2) + "@ip:" + r.addr(1, 1), "--path", "ip:" + r.addr(2, 2) + "@ip:" + r.addr(2, 1),
		"--dest-port", "1234", "--conns-per-path", "2", "--mpath-policy", "round-robin",
		"--size", "32MiB", "--bs", "4096", "--qd", "16",
		"--write-pct", "50", "--duration", d.String(), "--json", "--log-level", "info"}, extra...)
	return start(t, args...)
}

// report waits for load and returns its report, failing the test if an
// IO failed or read back wrong data, or a path is not connected at the
// end.
func (r *twoPaths) report(t *testing.T, load *proc, within time.Duration) loadReport {
	t.Helper()
	err := load.wait(t, within)
	out := load.out.String()
	var rep loadReport
	if jerr := json.Unmarshal([]byte(jsonPart(out)), &rep); jerr != nil {
		t.Fatalf("load report: %v (exit: %v)\n%s", jerr, err, out)
	}
	if err != nil || rep.Error != "" {
		t.Fatalf("load failed: %v %s\n%s", err, rep.Error, out)
	}
	if r := rep.Result; r.Errors != 0 || r.VerifyFailures != 0 || r.Reads == 0 || r.Writes == 0 {
		t.Fatalf("result %+v\n%s", r, out)
	}
	if len(rep.Paths) != 2 {
		t.Fatalf("%d paths", len(rep.Paths))
	}
	for _, p := range rep.Paths {
		if p.State != "connected" {
			t.Errorf("path %s is %s at the end", p.Name, p.State)
		}
	}
	return rep
}

// failovers is the paths' failover_cnt together.
func (rep loadReport) failovers() uint64 {
	var n uint64
	for _, p := range rep.Paths {
		n += p.Counters.FailoverCount
	}
	return n
}

// stop ends the server with SIGTERM, which it must obey cleanly.
func (r *twoPaths) stop(t *testing.T) {
	r.srv.cmd.Process.Signal(syscall.SIGTERM)
	if err := r.srv.wait(t, 20*time.Second); err != nil {
		t.Fatalf("server exit: %v\n%s", err, r.srv.out.String())
	}
}

// TestMultipathSilentLoss: the server's address on one path disappears
// for 12 s under a verified load with the default heartbeats: packets to
// it are dropped, with no RST and no carrier change (a dead switch port, a
// frozen host). The IO on that path fails over within 2 s (TCP's user
// timeout), none fails, and the path comes back after the address does.
func TestMultipathSilentLoss(t *testing.T) {
	// Mostly waiting (timeouts, a loss window) at a bounded load: runs
	// beside the suite's other long waiters (docs/testing.md).
	t.Parallel()
	r := newTwoPaths(t, "e2s", 202)
	began := time.Now()
	load := r.load(t, 24*time.Second, "--reconnect-delay", "200ms", "--reconnect-max-delay", "1s")
	// The loss hits a session of two paths under load: the load logs
	// each path as it connects, and starts its IO once both are.
	kit.WaitFor(t, 30*time.Second, "the load's two paths to connect", func() bool {
		return strings.Count(load.out.String(), "path connected") >= 2
	})
	t.Logf("the load's paths connected %v after it started", time.Since(began).Round(time.Millisecond))
	r.silentLoss(t, 12*time.Second)
	rep := r.report(t, load, 90*time.Second)
	if m := rep.Result.LatencyMaxMicros; m > 2e6 {
		t.Errorf("an IO waited %.1f s across the silent loss, want at most 2 s", float64(m)/1e6)
	}
	if rep.failovers() == 0 {
		t.Error("no request failed over")
	}
	t.Logf("across the silent loss: max IO wait %d µs, %d failovers", rep.Result.LatencyMaxMicros, rep.failovers())
	r.stop(t)
}

// jsonPart returns the JSON object in out, which also holds log lines.
func jsonPart(out string) string {
	start, depth := -1, 0
	for i, c := range out {
		switch c {
		case '{':
			if depth == 0 && (i == 0 || out[i-1] == '\n') {
				start = i
			}
			if start >= 0 {
				depth++
			}
		case '}':
			if start >= 0 {
				depth--
				if depth == 0 {
					return out[start : i+1]
				}
			}
		}
	}
	return ""
}

// nbdTwoPaths is a twoPaths rig with the real daemons: rnbd-server in
// the server namespace serving a 256 MiB file on both addresses,
// rnbd-client in the client namespace with the device mapped over both
// paths (map's extra arguments added) as an NBD socket. It returns the
// rig, the client's control socket and the socket's NBD URI.
// fioJob is what the tests read of a fio job's JSON report: its error,
// and its writes with their longest completion latency.
type fioJob struct {
	Error int    `json:"error"`
	Read  fioDir `json:"read"`
	Write fioDir `json:"write"`
}

// fioDir is one direction of a fio job: its IOs and their longest
// completion latency.
type fioDir struct {
	IOs  int64 `json:"total_ios"`
	Clat struct {
		Max float64 `json:"max"`
	} `json:"clat_ns"`
}

// fioWrites parses the JSON report of a fio run of one job.
func fioWrites(t *testing.T, fio *proc) fioJob {
	t.Helper()
	var res struct {
		Jobs []fioJob `json:"jobs"`
	}
	if err := json.Unmarshal([]byte(jsonPart(fio.out.String())), &res); err != nil || len(res.Jobs) != 1 {
		t.Fatalf("fio output: %v\n%s", err, fio.out.String())
	}
	return res.Jobs[0]
}

// nsMetrics is where the client daemon of newNBDTwoPaths serves its
// metrics, inside its namespace.
const nsMetrics = "127.0.0.1:9725"

func newNBDTwoPaths(t *testing.T, tag string, net int, mapArgs ...string) (*twoPaths, string, string) {
	r := newNamespaces(t, tag, net)
	dir := t.TempDir()
	vol := filepath.Join(dir, "vol.img")
	kit.SparseFile(t, vol, 256<<20)
	ssock, csock := filepath.Join(dir, "s.sock"), filepath.Join(dir, "c.sock")
	r.srvArgs = []string{"ip", "netns", "exec", r.srvNS, bin("rnbd-server"), "daemon", "--config", "/dev/null",
		"--listen", "tcp://" + r.addr(1, 1) + ":1234", "--listen", "tcp://" + r.addr(2, 1) + ":1234",
		"--control-socket", ssock, "--state-file", filepath.Join(dir, "s.json")}
	r.srvArgs = append(r.srvArgs, tlsFlags("srv")...)
	r.srv = start(t, r.srvArgs...)
	r.cli = start(t, append([]string{"ip", "netns", "exec", r.cliNS, bin("rnbd-client"), "daemon", "--config", "/dev/null",
		"--control-socket", csock, "--state-file", filepath.Join(dir, "c.json"), "--socket-dir", dir,
		"--metrics-listen", nsMetrics}, tlsFlags("e2e-client")...)...)
	for _, s := range []string{ssock, csock} {
		deadline := time.Now().Add(20 * time.Second)
		for _, err := os.Stat(s); err != nil; _, err = os.Stat(s) {
			if time.Now().After(deadline) {
				t.Fatalf("no control socket %s", s)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	run(t, time.Minute, bin("rnbd-server"), "--socket", ssock, "map", "vol", vol)
	run(t, time.Minute, bin("rnbd-client"), append([]string{"--socket", csock, "map", "--sessname", "sl", "--device-path", "vol",
		"--path", "ip:" + r.addr(1, 2) + "@ip:" + r.addr(1, 1), "--path", "ip:" + r.addr(2, 2) + "@ip:" + r.addr(2, 1)}, mapArgs...)...)
	return r, csock, "nbd+unix:///vol?socket=" + filepath.Join(dir, "rnbd0.sock")
}

// TestMultipathSilentLossNBD is the same fault as TestMultipathSilentLoss
// as a user meets it: the real daemons in the two namespaces, the device
// mapped over both paths as an NBD socket, fio (nbd engine) writing 4 KiB
// random blocks at QD16 with crc32c verification while the server's
// address on one path disappears for 40 s. No IO fails, every block
// verifies, and none waits more than 2 s.
func TestMultipathSilentLossNBD(t *testing.T) {
	// Mostly waiting (timeouts, a loss window) at a bounded load: runs
	// beside the suite's other long waiters (docs/testing.md).
	t.Parallel()
	needTools(t, "fio")
	r, csock, uri := newNBDTwoPaths(t, "e2f", 203, "--set", "mpath_policy=round-robin")
	fio := start(t, "fio", "--name=silent", "--ioengine=nbd", "--uri="+uri, "--rw=randwrite", "--bs=4k",
		"--iodepth=16", "--size=256m", "--time_based", "--runtime=50", "--rate_iops=4000",
		"--verify=crc32c", "--verify_backlog=4096", "--verify_fatal=1", "--verify_state_save=0",
		"--randrepeat=0", "--output-format=json")
	r.waitPathWrites(t, "fio's writes under way on both paths", 1000, 1, 2)
	r.silentLoss(t, 40*time.Second)
	if err := fio.wait(t, 2*time.Minute); err != nil {
		t.Fatalf("fio: %v\n%s", err, fio.out.String())
	}
	j := fioWrites(t, fio)
	if j.Error != 0 || j.Write.IOs == 0 {
		t.Fatalf("fio: error %d after %d writes", j.Error, j.Write.IOs)
	}
	if j.Write.Clat.Max > 2e9 || j.Read.Clat.Max > 2e9 {
		t.Errorf("a write waited %.2f s, a verifying read %.2f s across the silent loss, want at most 2 s; the client said:\n%s",
			j.Write.Clat.Max/1e9, j.Read.Clat.Max/1e9, r.cli.out.String())
	}
	if j.Read.IOs == 0 {
		t.Errorf("fio verified nothing (no reads)")
	}
	// The path whose address came back reconnects by itself.
	kit.WaitFor(t, 30*time.Second, "the lost path to reconnect", func() bool {
		return r.clientMetrics(t).sum("rnbd_client_session_connected_paths", `session="sl"`) == 2
	})
	paths := run(t, time.Minute, bin("rnbd-client"), "--socket", csock, "stats", "--format", "csv", "--fields", "pathname,rdma")
	// The client's metrics say the same: requests failed over, and
	// every write fio made.
	m := r.clientMetrics(t)
	lintMetrics(t, "rnbd-client (after a silent path loss)", m)
	r.failedOverFromPath1(t, m, "the silent loss", true)
	if w := m.sum("rnbd_client_device_requests_total", `op="write"`); w != float64(j.Write.IOs) {
		t.Errorf("rnbd_client_device_requests_total{op=\"write\"} %v, fio wrote %d", w, j.Write.IOs)
	}
	t.Logf("%d writes verified across the silent loss, max wait %.0f ms, %v failed over; paths:\n%s", j.Write.IOs, j.Write.Clat.Max/1e6,
		m.sum("rnbd_client_path_failovers_total"), paths)
}

// fioVerifyNBD starts fio writing 4 KiB random blocks with crc32c at QD16
// through uri for runtime, rate-limited, verifying as it goes.
func fioVerifyNBD(t *testing.T, name, uri string, runtime time.Duration) *proc {
	return fioVerifyNBDAt(t, name, uri, runtime, 4000)
}

// fioVerifyNBDAt is fioVerifyNBD at rate IOPS (0: as fast as it goes,
// its 16 requests always in flight).
func fioVerifyNBDAt(t *testing.T, name, uri string, runtime time.Duration, rate int) *proc {
	args := []string{"fio", "--name=" + name, "--ioengine=nbd", "--uri=" + uri, "--rw=randwrite", "--bs=4k",
		"--iodepth=16", "--size=256m", "--time_based", fmt.Sprintf("--runtime=%d", int(runtime.Seconds())),
		"--verify=crc32c", "--verify_backlog=4096", "--verify_fatal=1", "--verify_state_save=0",
		"--randrepeat=0", "--output-format=json"}
	if rate > 0 {
		args = append(args, fmt.Sprintf("--rate_iops=%d", rate))
	}
	return start(t, args...)
}

// endFio waits for fio and checks that it wrote and verified without an
// error; it returns its report.
func endFio(t *testing.T, fio *proc) fioJob {
	t.Helper()
	if err := fio.wait(t, 3*time.Minute); err != nil {
		t.Fatalf("fio: %v\n%s", err, fio.out.String())
	}
	j := fioWrites(t, fio)
	if j.Error != 0 || j.Write.IOs == 0 {
		t.Fatalf("fio: error %d after %d writes", j.Error, j.Write.IOs)
	}
	return j
}

// failedOverFromPath1 checks the client's failovers after path 1 failed
// (what): rnbd_client_path_failovers_total counted the failed path's
// requests by its labels (some: at least one), and none on path 2,
// which took them.
func (r *twoPaths) failedOverFromPath1(t *testing.T, m scrape, what string, some bool) {
	t.Helper()
	lost, kept := r.pathLabel(1), r.pathLabel(2)
	if f := m.sum("rnbd_client_path_failovers_total", `session="sl"`, lost); some && f < 1 {
		t.Errorf("rnbd_client_path_failovers_total{%s} %v after %s, want the failed path's requests", lost, f, what)
	}
	if f := m.sum("rnbd_client_path_failovers_total", `session="sl"`, kept); f != 0 {
		t.Errorf("rnbd_client_path_failovers_total{%s} %v after %s, want 0: that path did not fail", kept, f, what)
	}
}

// pathLabel is the path label of path n (1 or 2) in the client's
// metrics.
func (r *twoPaths) pathLabel(n int) string {
	return fmt.Sprintf(`path="ip:%s@ip:%s"`, r.addr(n, 2), r.addr(n, 1))
}

// waitMetrics waits up to d for cond to hold of the client's metrics,
// scraped every 200 ms: a scrape is a process in the namespace and the
// daemon's rendering, CPU the IO that a test measures should have, and
// what it waits for does not need to be seen sooner.
func (r *twoPaths) waitMetrics(t *testing.T, d time.Duration, what string, cond func(scrape) bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !cond(r.clientMetrics(t)); time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// waitPathWrites waits until each of paths (1, 2) of session sl has
// carried n more writes than when it was called
// (rnbd_client_path_requests_total).
func (r *twoPaths) waitPathWrites(t *testing.T, what string, n float64, paths ...int) {
	t.Helper()
	writes := func(m scrape, p int) float64 {
		return m.sum("rnbd_client_path_requests_total", `session="sl"`, r.pathLabel(p), `direction="write"`)
	}
	m := r.clientMetrics(t)
	from := map[int]float64{}
	for _, p := range paths {
		from[p] = writes(m, p)
	}
	r.waitMetrics(t, time.Minute, what, func(m scrape) bool {
		for _, p := range paths {
			if writes(m, p) < from[p]+n {
				return false
			}
		}
		return true
	})
}

// clientMetrics scrapes the client daemon of a newNBDTwoPaths rig.
func (r *twoPaths) clientMetrics(t *testing.T) scrape {
	t.Helper()
	return parseMetrics(t, []byte(run(t, time.Minute, "ip", "netns", "exec", r.cliNS, "curl", "-sf", "http://"+nsMetrics+"/metrics")))
}

// TestMultipathLinkDownNBD: the real daemons in the two namespaces, fio
// writing and verifying through the NBD socket while one link is cut
// (the client's end taken down) and comes back, once the client has
// failed the path, tried it again in vain and gone on writing over the
// other: no IO fails, none waits more than a moment — the client fails
// the path as its link goes down — requests fail over at once, and the
// cut path reconnects.
func TestMultipathLinkDownNBD(t *testing.T) {
	needTools(t, "fio", "curl")
	r, csock, uri := newNBDTwoPaths(t, "e2l", 206, "--set", "mpath_policy=round-robin", "--set", "reconnect_delay=200ms")
	// Unthrottled: with 16 requests always in flight, some are on the
	// cut path when it fails (throttled, the path fails before any
	// reaches it as often as not).
	fio := fioVerifyNBDAt(t, "linkdown", uri, 14*time.Second, 0)
	r.waitPathWrites(t, "fio's writes under way on both paths", 1000, 1, 2)
	sh(t, "ip", "-n", r.cliNS, "link", "set", "c1", "down")
	cut := time.Now()
	t.Log("link c1 down")
	r.waitMetrics(t, 30*time.Second, "the client to fail the cut path and try it again in vain", func(m scrape) bool {
		return m.sum("rnbd_client_session_connected_paths", `session="sl"`) == 1 &&
			m.sum("rnbd_client_path_reconnects_total", r.pathLabel(1), `result="failure"`) >= 1
	})
	r.waitPathWrites(t, "fio's writes over the path left", 1000, 2)
	sh(t, "ip", "-n", r.cliNS, "link", "set", "c1", "up")
	t.Logf("link c1 up, %v after it went down", time.Since(cut).Round(time.Millisecond))
	j := endFio(t, fio)
	// The client sees its link go down and fails the path at once
	// (milliseconds); TCP alone would hold its IO for TCP_USER_TIMEOUT
	// (1 s, 1.2-1.4 s measured). Loose for a noisy machine. Reads too:
	// fio verifies in turns (verify_backlog), and the cut may come in
	// one of them.
	if j.Write.Clat.Max > 0.5e9 || j.Read.Clat.Max > 0.5e9 {
		t.Errorf("a write waited %.2f s, a verifying read %.2f s across the link cut, want at most 0.5 s",
			j.Write.Clat.Max/1e9, j.Read.Clat.Max/1e9)
	}
	var m scrape
	deadline := time.Now().Add(30 * time.Second)
	for {
		m = r.clientMetrics(t)
		if m.sum("rnbd_client_session_connected_paths", `session="sl"`) == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the cut path did not come back: %s", run(t, time.Minute, bin("rnbd-client"), "--socket", csock, "path", "list", "--fields", "all"))
		}
		time.Sleep(200 * time.Millisecond)
	}
	// The path fails as its link goes down: the requests on it at that
	// instant, if any, fail over (counted on it, never on the other).
	r.failedOverFromPath1(t, m, "the link cut", false)
	if n := m.sum("rnbd_client_path_reconnects_total", `result="success"`); n < 1 {
		t.Errorf("rnbd_client_path_reconnects_total{result=\"success\"} %v, want the cut path's reconnect", n)
	}
	t.Logf("%d writes verified across the link cut, max wait %.0f ms (reads %.0f ms), %v failed over", j.Write.IOs, j.Write.Clat.Max/1e6,
		j.Read.Clat.Max/1e6, m.sum("rnbd_client_path_failovers_total"))
}

// TestMultipathBusyNoFailoverNBD: the real daemons under fio's verified
// writes for 60 s while busy loops saturate every CPU: a slow but live
// path is not taken for a dead one — no failover, no reconnect, and no
// write waits long.
func TestMultipathBusyNoFailoverNBD(t *testing.T) {
	needTools(t, "fio", "curl")
	r, _, uri := newNBDTwoPaths(t, "e2b", 207, "--set", "mpath_policy=round-robin")
	// A busy loop per CPU in this process, until the test ends.
	stop := make(chan struct{})
	var spun sync.WaitGroup
	for i := 0; i < runtime.NumCPU(); i++ {
		spun.Add(1)
		go func() {
			defer spun.Done()
			for n := 0; ; n++ {
				if n%1024 == 0 {
					select {
					case <-stop:
						return
					default:
					}
				}
			}
		}()
	}
	defer spun.Wait()
	defer close(stop)
	j := endFio(t, fioVerifyNBD(t, "busy", uri, 60*time.Second))
	m := r.clientMetrics(t)
	if f, n := m.sum("rnbd_client_path_failovers_total"), m.sum("rnbd_client_path_reconnects_total"); f != 0 || n != 0 {
		t.Errorf("under CPU load: %v requests failed over, %v reconnects, want none", f, n)
	}
	if up := m.sum("rnbd_client_session_connected_paths", `session="sl"`); up != 2 {
		t.Errorf("%v paths connected after the load, want 2", up)
	}
	t.Logf("under CPU load: %d writes verified, max wait %.0f ms", j.Write.IOs, j.Write.Clat.Max/1e6)
}

// TestFastIOFailNBD: every path of a session dies silently (both server
// addresses gone). With fast_io_fail_tmo 3 s and no_path_timeout 60 s, a
// write waiting for a path fails soon after the loss is noticed — not a
// minute later —, session show says the timer passed, the next write
// fails at once, and when the addresses are back the paths reconnect by
// themselves and writes work again.
func TestFastIOFailNBD(t *testing.T) {
	needTools(t, "qemu-io")
	r, csock, uri := newNBDTwoPaths(t, "e2t", 204, "--set", "fast_io_fail_tmo=3s", "--set", "no_path_timeout=60s")
	write := func(off string) (string, time.Duration) {
		t.Helper()
		start := time.Now()
		out, _ := exec.Command("qemu-io", "-f", "raw", "-c", "write -P 0x3c "+off+" 4k", uri).CombinedOutput()
		return string(out), time.Since(start)
	}
	session := func() map[string]any {
		t.Helper()
		var recs []map[string]any
		out := run(t, time.Minute, bin("rnbd-client"), "--socket", csock, "session", "show", "sl", "--format", "json", "--fields", "all")
		if err := json.Unmarshal([]byte(out), &recs); err != nil || len(recs) != 1 {
			t.Fatalf("session show: %v %s", err, out)
		}
		return recs[0]
	}
	if out, _ := write("0"); strings.Contains(out, "failed") {
		t.Fatalf("write with both paths up: %s", out)
	}
	for _, n := range []int{1, 2} {
		sh(t, "ip", "-n", r.srvNS, "addr", "del", r.addr(n, 1)+"/24", "dev", fmt.Sprintf("s%d", n))
	}
	t.Log("both server addresses removed")
	// While the write waits for a path, session show counts it.
	var sawWaiting map[string]any
	watchDone := make(chan struct{})
	stopWatch := make(chan struct{})
	go func() {
		defer close(watchDone)
		for {
			select {
			case <-stopWatch:
				return
			case <-time.After(100 * time.Millisecond):
			}
			out, err := exec.Command(bin("rnbd-client"), "--socket", csock, "session", "show", "sl", "--format", "json", "--fields", "all").Output()
			var recs []map[string]any
			if err == nil && json.Unmarshal(out, &recs) == nil && len(recs) == 1 && recs[0]["waiting_io"] != float64(0) {
				sawWaiting = recs[0]
				return
			}
		}
	}()
	out, took := write("1M")
	close(stopWatch)
	<-watchDone
	if sawWaiting == nil || sawWaiting["waiting_io_fails_in_sec"] == nil {
		t.Fatalf("session show never counted the write waiting for a path: %v", sawWaiting)
	}
	if !strings.Contains(out, "failed") || !strings.Contains(out, "Input/output error") {
		t.Fatalf("write with every path lost: %s", out)
	}
	// Noticed within a heartbeat and the user timeout (≤ 6 s), then 3 s.
	if took < 3*time.Second || took > 15*time.Second {
		t.Fatalf("the write failed after %v, want fast_io_fail_tmo (3 s) after the loss was noticed", took)
	}
	if s := session(); s["fast_io_fail_in_sec"] != float64(0) || s["fast_io_fail_tmo_sec"] != float64(3) || s["no_path_since"] == nil {
		t.Fatalf("session show: %v", s)
	}
	if out, took := write("2M"); !strings.Contains(out, "failed") || took > 2*time.Second {
		t.Fatalf("a write after fast_io_fail_tmo: %v %s, want a failure at once", took, out)
	}
	for _, n := range []int{1, 2} {
		sh(t, "ip", "-n", r.srvNS, "addr", "add", r.addr(n, 1)+"/24", "dev", fmt.Sprintf("s%d", n))
	}
	t.Logf("addresses back; the write failed after %v", took)
	deadline := time.Now().Add(90 * time.Second)
	for session()["state"] != "connected" {
		if time.Now().After(deadline) {
			t.Fatalf("the session did not come back: %v", session())
		}
		time.Sleep(200 * time.Millisecond)
	}
	if out, _ := write("3M"); strings.Contains(out, "failed") {
		t.Fatalf("write after the paths came back: %s", out)
	}
}

// TestCtrlLossTmoNBD: the server dies (SIGKILL) under a session with
// ctrl_loss_tmo 4 s and unlimited attempts: its paths try to reconnect,
// then give up 4 s after they went down; the server back does not bring
// them back by itself, a session reconnect does, and writes work again.
func TestCtrlLossTmoNBD(t *testing.T) {
	needTools(t, "qemu-io")
	r, csock, uri := newNBDTwoPaths(t, "e2c", 205, "--set", "ctrl_loss_tmo=4s", "--set", "no_path_timeout=1s")
	cli := func(args ...string) string {
		t.Helper()
		return run(t, time.Minute, bin("rnbd-client"), append([]string{"--socket", csock}, args...)...)
	}
	// given up: every path CLOSED (not RECONNECTING or CONNECTING).
	// Until then path list shows the time ctrl_loss_tmo leaves.
	var lossIn []float64
	var longestDelay float64 // the longest next_reconnect_in_sec seen
	givenUp := func() bool {
		var ps []map[string]any
		if err := json.Unmarshal([]byte(cli("path", "list", "--format", "json", "--fields", "all")), &ps); err != nil || len(ps) != 2 {
			t.Fatalf("path list: %v %v", err, ps)
		}
		up := true
		for _, p := range ps {
			if p["ctrl_loss_tmo_sec"] != float64(4) {
				t.Fatalf("path list: ctrl_loss_tmo_sec %v, want 4", p["ctrl_loss_tmo_sec"])
			}
			if in, ok := p["ctrl_loss_in_sec"].(float64); ok {
				lossIn = append(lossIn, in)
			}
			if next, ok := p["next_reconnect_in_sec"].(float64); ok {
				longestDelay = max(longestDelay, next)
			}
			if p["rtrs_state"] != "CLOSED" || p["state"] != "disconnected" || p["next_reconnect_in_sec"] != nil || p["ctrl_loss_in_sec"] != nil {
				up = false
			}
		}
		return up
	}
	r.srv.cmd.Process.Kill()
	r.srv.wait(t, 10*time.Second)
	killed := time.Now()
	for !givenUp() {
		if time.Since(killed) > 30*time.Second {
			t.Fatalf("the paths did not give up: %s", cli("path", "list", "--fields", "all"))
		}
		time.Sleep(100 * time.Millisecond)
	}
	if took := time.Since(killed); took < 4*time.Second {
		t.Fatalf("the paths gave up after %v, before ctrl_loss_tmo", took)
	}
	if len(lossIn) == 0 {
		t.Fatal("path list never showed ctrl_loss_in_sec while the paths reconnected")
	}
	for _, in := range lossIn {
		// 0 is a path sampled between its deadline and its giving
		// up (CtrlLossIn never goes below 0; rounded to the ms).
		if in < 0 || in > 4 {
			t.Fatalf("ctrl_loss_in_sec %v, want a time left of at most ctrl_loss_tmo", in)
		}
	}
	t.Logf("the paths gave up %v after the server died (ctrl_loss_in_sec went %v … %v)", time.Since(killed).Round(100*time.Millisecond),
		lossIn[0], lossIn[len(lossIn)-1])
	restarted := time.Now()
	r.srv = start(t, r.srvArgs...)
	kit.WaitFor(t, 30*time.Second, "the server back", func() bool { return strings.Contains(r.srv.out.String(), "rnbd-server started") })
	// That nothing happens is shown by time passing: longer, with the
	// server listening, than any reconnect delay the paths had (the
	// longest next_reconnect_in_sec path list showed, its jitter
	// included, and half a second for how often it was sampled).
	wait := time.Duration(longestDelay*float64(time.Second)) + 500*time.Millisecond
	t.Logf("the server back in %v; the longest reconnect delay seen %.1f s: %v with the server back",
		time.Since(restarted).Round(time.Millisecond), longestDelay, wait.Round(time.Millisecond))
	time.Sleep(wait)
	if !givenUp() {
		t.Fatalf("a path reconnected by itself after giving up: %s", cli("path", "list", "--fields", "all"))
	}
	cli("session", "reconnect", "sl")
	if out, err := exec.Command("qemu-io", "-f", "raw", "-c", "write -P 0x5c 0 4k", "-c", "read -P 0x5c 0 4k", uri).CombinedOutput(); err != nil || strings.Contains(string(out), "failed") {
		t.Fatalf("IO after the session reconnect: %v %s", err, out)
	}
}
