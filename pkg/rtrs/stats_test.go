package rtrs

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestStatsFormats pins the kernel's sysfs formats, which tools parse.
func TestStatsFormats(t *testing.T) {
	s := newPathStats()
	if got := s.Reconnects(); got != "-1 0\n" {
		t.Fatalf("reconnects before the first connection: %q", got)
	}
	s.update(Read, 4096+32)
	s.update(Read, 512+32)
	s.update(Write, 8192+32)
	s.inflight.Add(-2)
	s.failoverCnt.Add(3)
	s.reconnSucc.Add(2)
	s.reconnFail.Add(5)
	if got, want := s.RDMA(), "2 4672 1 8224 1 3\n"; got != want {
		t.Fatalf("stats/rdma %q, want %q", got, want)
	}
	// The rnbd tool reads "%*u %lu %*u %lu %d %*d".
	var rx, tx uint64
	var inflight int
	if n, err := fmt.Sscanf(s.RDMA(), "%d %d %d %d %d %d", new(uint64), &rx, new(uint64), &tx, &inflight, new(int)); n != 6 || err != nil {
		t.Fatalf("stats/rdma does not parse: %v", err)
	}
	if got := s.Reconnects(); got != "1 5\n" {
		t.Fatalf("stats/reconnects %q", got)
	}
	s.ResetAll()
	if got := s.RDMA(); got != "0 0 0 0 1 0\n" {
		t.Fatalf("after reset_all %q: inflight must survive", got)
	}
	if got := s.Reconnects(); got != "0 0\n" {
		t.Fatalf("reconnects after reset %q", got)
	}

	s.observeLatency(Read, 3*time.Microsecond)  // bucket < 4 us
	s.observeLatency(Write, 3*time.Millisecond) // bucket < 4096 us
	s.observeLatency(Write, 2*time.Minute)      // the last bucket
	lines := strings.Split(strings.TrimSpace(s.LatencyHist()), "\n")
	if len(lines) != latBuckets+1 {
		t.Fatalf("%d histogram lines", len(lines))
	}
	for _, want := range []string{"4 us: 1 0", "4096 us: 0 1", ">= 67108864 us: 0 1", "maximum us: 3 120000000"} {
		found := false
		for _, l := range lines {
			found = found || l == want
		}
		if !found {
			t.Errorf("histogram lacks %q:\n%s", want, s.LatencyHist())
		}
	}
	var ss SrvPathStats
	ss.update(Write, 100)
	if ss.RDMA() != "0 0 1 100\n" {
		t.Fatalf("server stats/rdma %q", ss.RDMA())
	}
}

func TestPathName(t *testing.T) {
	p, err := ParsePathAddr("ip:10.0.0.1@ip:10.0.0.2", 1234)
	if err != nil || p.String() != "ip:10.0.0.1@ip:10.0.0.2" || p.Dst.Port() != 1234 {
		t.Fatalf("%v %v", p, err)
	}
	p, err = ParsePathAddr("ip:fe80::1%eth0,ip:fe80::2", 9)
	if err != nil || p.String() != "ip:fe80::1@ip:fe80::2" {
		t.Fatalf("%v %v", p, err)
	}
	// Without a source, the name is the destination alone (the kernel
	// prints "<invalid address family>@..."; a log line should not).
	p, err = ParsePathAddr("gid:fe80::2", 1)
	if err != nil || !p.GID || !strings.HasPrefix(p.String(), "gid:fe80:0000") {
		t.Fatalf("%q %v", p, err)
	}
	if p, _ = ParsePathAddr("ip:10.0.0.2", 1); p.String() != "ip:10.0.0.2" {
		t.Fatalf("a path without a source is named %q, want ip:10.0.0.2", p)
	}
	for _, bad := range []string{"10.0.0.1", "ip:10.0.0.1@10.0.0.2", "ip:x", "gid:1.2.3.4", "ip:1.2.3.4@gid:fe80::1"} {
		if _, err := ParsePathAddr(bad, 1); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	for s, want := range map[string]string{
		"tcp://0.0.0.0:1234": "0.0.0.0:1234", "tcp://[::]:99": "[::]:99", "tcp://127.0.0.1": "127.0.0.1:1234", "tcp://[::1]": "[::1]:1234",
	} {
		a, err := ParseListenAddr(s)
		if err != nil || a.String() != want {
			t.Errorf("ParseListenAddr(%q) = %v, %v", s, a, err)
		}
	}
	if _, err := ParseListenAddr("udp://1.2.3.4:5"); err == nil {
		t.Error("udp accepted")
	}
	if _, err := ParseListenAddr("rdma://1.2.3.4:5"); err == nil {
		t.Error("ParseListenAddr took an RDMA address")
	}
	for s, want := range map[string]string{
		"rdma://10.0.0.1": "rdma://10.0.0.1:1234", "rdma://[fe80::1]:7": "rdma://[fe80::1]:7", "tcp://[::]": "tcp://[::]:1234",
	} {
		l, err := ParseListen(s)
		if err != nil || l.String() != want {
			t.Errorf("ParseListen(%q) = %v, %v", s, l, err)
		}
	}
	for _, bad := range []string{"rdma:/1.2.3.4", "RDMA://1.2.3.4", "rdma://host.example", "ib://1.2.3.4"} {
		if _, err := ParseListen(bad); err == nil {
			t.Errorf("ParseListen(%q) accepted", bad)
		}
	}
	// A bad port says so, not that the address has an unexpected
	// character.
	for s, want := range map[string]string{
		"tcp://127.0.0.1:99999":                 `port 99999 is out of range: want 1 to 65535`,
		"tcp://[::1]:65536":                     `port 65536 is out of range`,
		"rdma://10.0.0.1:123456789012345678901": `port 123456789012345678901 is out of range`,
		"tcp://127.0.0.1:http":                  `port "http" is not a number`,
		"tcp://127.0.0.1:-1":                    `port "-1" is not a number`,
	} {
		if _, err := ParseListen(s); err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "unexpected character") {
			t.Errorf("ParseListen(%q): %v, want it to say %q", s, err, want)
		}
	}
}
