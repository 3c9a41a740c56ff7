package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
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

// TestMultipathLinkDown runs a verified mixed load over two paths (two
// veth pairs between a client and a server namespace), takes one link
// down and up again under the load, and checks that no request failed, no
// data was lost, requests failed over, and the path reconnected.
func TestMultipathLinkDown(t *testing.T) {
	requireRoot(t)
	id := os.Getpid()
	srvNS := netns(t, fmt.Sprintf("rnbd-e2e-%d-s", id))
	cliNS := netns(t, fmt.Sprintf("rnbd-e2e-%d-c", id))
	veth(t, cliNS, "c1", "10.201.1.2/24", srvNS, "s1", "10.201.1.1/24")
	veth(t, cliNS, "c2", "10.201.2.2/24", srvNS, "s2", "10.201.2.1/24")

	ready := filepath.Join(t.TempDir(), "ready")
	srv := start(t, "ip", "netns", "exec", srvNS, bin("rtrs-demo"), "server",
		"--listen", "tcp://10.201.1.1:1234", "--listen", "tcp://10.201.2.1:1234",
		"--size", "32MiB", "--hb-interval", "200ms", "--hb-missed-max", "3",
		"--ready-file", ready, "--log-level", "info")
	waitFile(t, ready, 10*time.Second)

	load := start(t, "ip", "netns", "exec", cliNS, bin("rtrs-demo"), "load",
		"--path", "ip:10.201.1.2@ip:10.201.1.1", "--path", "ip:10.201.2.2@ip:10.201.2.1",
		"--dest-port", "1234", "--conns-per-path", "2", "--mpath-policy", "round-robin",
		"--hb-interval", "200ms", "--hb-missed-max", "3",
		"--reconnect-delay", "200ms", "--reconnect-max-delay", "1s", "--connect-timeout", "5s",
		"--size", "32MiB", "--bs", "4096", "--qd", "16",
		"--write-pct", "50", "--duration", "12s", "--json", "--log-level", "info")

	time.Sleep(3 * time.Second)
	sh(t, "ip", "-n", cliNS, "link", "set", "c1", "down")
	t.Log("link c1 down")
	time.Sleep(3 * time.Second)
	sh(t, "ip", "-n", cliNS, "link", "set", "c1", "up")
	t.Log("link c1 up")

	err := load.wait(t, 60*time.Second)
	out := load.out.String()
	t.Logf("load output:\n%s", out)
	var rep loadReport
	if jerr := json.Unmarshal([]byte(jsonPart(out)), &rep); jerr != nil {
		t.Fatalf("load report: %v (exit: %v)", jerr, err)
	}
	if err != nil || rep.Error != "" {
		t.Fatalf("load failed: %v %s", err, rep.Error)
	}
	r := rep.Result
	if r.Errors != 0 || r.VerifyFailures != 0 || r.Reads == 0 || r.Writes == 0 {
		t.Fatalf("result %+v", r)
	}
	if len(rep.Paths) != 2 {
		t.Fatalf("%d paths", len(rep.Paths))
	}
	var failovers uint64
	for _, p := range rep.Paths {
		failovers += p.Counters.FailoverCount
		if p.State != "connected" {
			t.Errorf("path %s is %s at the end", p.Name, p.State)
		}
	}
	if failovers == 0 {
		t.Error("no request failed over: the link went down with nothing in flight on it")
	}
	cut := rep.Paths[0]
	if cut.Counters.ReconnectsSuccessful < 1 {
		t.Errorf("the cut path %s did not reconnect: %+v", cut.Name, cut.Counters)
	}
	// The server exits cleanly on SIGTERM.
	srv.cmd.Process.Signal(syscall.SIGTERM)
	if err := srv.wait(t, 20*time.Second); err != nil {
		t.Fatalf("server exit: %v\n%s", err, srv.out.String())
	}
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

// TestMultipathSilentLoss: the server's address on one path disappears
// for 12 s under a verified load with the default heartbeats: packets to
// it are dropped, with no RST and no carrier change (a dead switch port, a
// frozen host). The IO on that path fails over within 2 s (TCP's user
// timeout), none fails, and the path comes back after the address does.
func TestMultipathSilentLoss(t *testing.T) {
	requireRoot(t)
	id := os.Getpid()
	srvNS := netns(t, fmt.Sprintf("rnbd-e2s-%d-s", id))
	cliNS := netns(t, fmt.Sprintf("rnbd-e2s-%d-c", id))
	veth(t, cliNS, "c1", "10.202.1.2/24", srvNS, "s1", "10.202.1.1/24")
	veth(t, cliNS, "c2", "10.202.2.2/24", srvNS, "s2", "10.202.2.1/24")

	ready := filepath.Join(t.TempDir(), "ready")
	srv := start(t, "ip", "netns", "exec", srvNS, bin("rtrs-demo"), "server",
		"--listen", "tcp://10.202.1.1:1234", "--listen", "tcp://10.202.2.1:1234",
		"--size", "32MiB", "--ready-file", ready, "--log-level", "info")
	waitFile(t, ready, 10*time.Second)

	load := start(t, "ip", "netns", "exec", cliNS, bin("rtrs-demo"), "load",
		"--path", "ip:10.202.1.2@ip:10.202.1.1", "--path", "ip:10.202.2.2@ip:10.202.2.1",
		"--dest-port", "1234", "--conns-per-path", "2", "--mpath-policy", "round-robin",
		"--reconnect-delay", "200ms", "--reconnect-max-delay", "1s",
		"--size", "32MiB", "--bs", "4096", "--qd", "16",
		"--write-pct", "50", "--duration", "24s", "--json", "--log-level", "info")

	time.Sleep(3 * time.Second)
	sh(t, "ip", "-n", srvNS, "addr", "del", "10.202.1.1/24", "dev", "s1")
	t.Log("server address 10.202.1.1 removed")
	time.Sleep(12 * time.Second)
	sh(t, "ip", "-n", srvNS, "addr", "add", "10.202.1.1/24", "dev", "s1")
	t.Log("server address 10.202.1.1 back")

	err := load.wait(t, 90*time.Second)
	out := load.out.String()
	t.Logf("load output:\n%s", out)
	var rep loadReport
	if jerr := json.Unmarshal([]byte(jsonPart(out)), &rep); jerr != nil {
		t.Fatalf("load report: %v (exit: %v)", jerr, err)
	}
	if err != nil || rep.Error != "" {
		t.Fatalf("load failed: %v %s", err, rep.Error)
	}
	r := rep.Result
	if r.Errors != 0 || r.VerifyFailures != 0 || r.Reads == 0 || r.Writes == 0 {
		t.Fatalf("result %+v", r)
	}
	if r.LatencyMaxMicros > 2e6 {
		t.Errorf("an IO waited %.1f s across the silent loss, want at most 2 s", float64(r.LatencyMaxMicros)/1e6)
	}
	var failovers uint64
	for _, p := range rep.Paths {
		failovers += p.Counters.FailoverCount
		if p.State != "connected" {
			t.Errorf("path %s is %s at the end", p.Name, p.State)
		}
	}
	if failovers == 0 {
		t.Error("no request failed over")
	}
	srv.cmd.Process.Signal(syscall.SIGTERM)
	if err := srv.wait(t, 20*time.Second); err != nil {
		t.Fatalf("server exit: %v\n%s", err, srv.out.String())
	}
}

// TestMultipathBusyNoFailover: the same two paths under a verified load
// for 60 s while busy loops saturate both CPUs: a slow but live path is
// not taken for a dead one (failover_cnt 0, no reconnect).
func TestMultipathBusyNoFailover(t *testing.T) {
	requireRoot(t)
	id := os.Getpid()
	srvNS := netns(t, fmt.Sprintf("rnbd-e2b-%d-s", id))
	cliNS := netns(t, fmt.Sprintf("rnbd-e2b-%d-c", id))
	veth(t, cliNS, "c1", "10.203.1.2/24", srvNS, "s1", "10.203.1.1/24")
	veth(t, cliNS, "c2", "10.203.2.2/24", srvNS, "s2", "10.203.2.1/24")

	ready := filepath.Join(t.TempDir(), "ready")
	srv := start(t, "ip", "netns", "exec", srvNS, bin("rtrs-demo"), "server",
		"--listen", "tcp://10.203.1.1:1234", "--listen", "tcp://10.203.2.1:1234",
		"--size", "32MiB", "--ready-file", ready, "--log-level", "info")
	waitFile(t, ready, 10*time.Second)
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
	load := start(t, "ip", "netns", "exec", cliNS, bin("rtrs-demo"), "load",
		"--path", "ip:10.203.1.2@ip:10.203.1.1", "--path", "ip:10.203.2.2@ip:10.203.2.1",
		"--dest-port", "1234", "--conns-per-path", "2", "--mpath-policy", "round-robin",
		"--size", "32MiB", "--bs", "4096", "--qd", "16",
		"--write-pct", "50", "--duration", "60s", "--json", "--log-level", "info")
	err := load.wait(t, 120*time.Second)
	out := load.out.String()
	var rep loadReport
	if jerr := json.Unmarshal([]byte(jsonPart(out)), &rep); jerr != nil {
		t.Fatalf("load report: %v (exit: %v)\n%s", jerr, err, out)
	}
	if err != nil || rep.Error != "" {
		t.Fatalf("load failed: %v %s\n%s", err, rep.Error, out)
	}
	if r := rep.Result; r.Errors != 0 || r.VerifyFailures != 0 || r.Reads == 0 || r.Writes == 0 {
		t.Fatalf("result %+v", r)
	}
	for _, p := range rep.Paths {
		c := p.Counters
		if c.FailoverCount != 0 || c.ReconnectsSuccessful != 0 || c.ReconnectsFailed != 0 || p.State != "connected" {
			t.Errorf("path %s under CPU load: %s, failovers %d, reconnects %d/%d", p.Name, p.State,
				c.FailoverCount, c.ReconnectsSuccessful, c.ReconnectsFailed)
		}
	}
	t.Logf("under CPU load: %+v", rep.Result)
	srv.cmd.Process.Signal(syscall.SIGTERM)
	if err := srv.wait(t, 20*time.Second); err != nil {
		t.Fatalf("server exit: %v\n%s", err, srv.out.String())
	}
}
