package main

import (
	"strings"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	var ds []time.Duration
	for i := 100; i >= 1; i-- {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	for p, want := range map[int]time.Duration{50: 50 * time.Millisecond, 99: 99 * time.Millisecond, 100: 100 * time.Millisecond, 0: time.Millisecond} {
		if got := percentile(ds, p); got != want {
			t.Errorf("p%d = %v, want %v", p, got, want)
		}
	}
	if ds[0] != 100*time.Millisecond {
		t.Error("percentile sorted its argument")
	}
	if got := median([]float64{3, 1, 2, 4}); got != 2 {
		t.Errorf("median = %v, want 2 (the lower middle)", got)
	}
}

func TestParseProc(t *testing.T) {
	m, err := parseStatus("Name:\trnbd-server\nVmHWM:\t   20480 kB\nVmRSS:\t   10240 kB\nThreads:\t7\n")
	if err != nil || m.rss != 10<<20 || m.hwm != 20<<20 || m.threads != 7 {
		t.Fatalf("parseStatus: %+v, %v", m, err)
	}
	if _, err := parseStatus("Name:\tx\n"); err == nil {
		t.Error("a status with no VmRSS parsed")
	}
	// A command with spaces and a parenthesis: fields count from the last ')'.
	stat := "42 (rnbd (x) y) S 1 42 42 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 7 0 100 1000 200"
	if n, err := parseStat(stat); err != nil || n != 325 {
		t.Fatalf("parseStat = %d, %v; want 325", n, err)
	}
}

func TestParsePool(t *testing.T) {
	for s, kind := range map[string]string{"dir": "dir", "dir:/tmp": "dir", "xfs": "xfs", "lvm-thin:vg/tp": "lvm-thin"} {
		if p, err := parsePool(s); err != nil || p.kind != kind {
			t.Errorf("%s: %+v, %v", s, p, err)
		}
	}
	for _, s := range []string{"", "dir:", "lvm-thin:vg", "lvm-thin:vg/a/b", "zfs:x"} {
		if _, err := parsePool(s); err == nil {
			t.Errorf("%q accepted", s)
		}
	}
}

func TestMarkdown(t *testing.T) {
	rows := []row{
		{"dir on ext4 (/tmp)", 1, "create_grant_total_s", 3}, {"dir on ext4 (/tmp)", 2, "create_grant_total_s", 2},
		{"dir on ext4 (/tmp)", 3, "create_grant_total_s", 4},
		{"exports=0", 1, "rss_mib", 12.5}, {"exports=1000", 1, "rss_mib", 40}, {"exports=1000", 1, "map_total_s", 9},
		{"exports=1000", 1, "map_p50_ms", 8}, {"exports=1000", 1, "map_p99_ms", 20},
	}
	md := markdown(rows, config{volumes: 100, size: "64MiB", idle: 30 * time.Second, settle: 3 * time.Second})
	for _, want := range []string{"| dir on ext4 (/tmp) | 2.00 s / 3.00 s | – |", "| 0 | 12.5 MiB |", "| 1000 | 40.0 MiB |",
		"Mapping 1000 one after the other: 9.00 s (p50 8.0 ms, p99 20.0 ms)."} {
		if !strings.Contains(md, want) {
			t.Errorf("no %q in\n%s", want, md)
		}
	}
}
