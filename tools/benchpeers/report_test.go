package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseFio(t *testing.T) {
	raw := []byte(`note: both iodepth >= 1 and synchronous I/O engine are selected
{"jobs": [{"error": 0,
  "read": {"iops": 1234.5, "bw_bytes": 5056512, "io_bytes": 4096,
           "lat_ns": {"percentile": {"50.000000": 150528, "99.000000": 309248}}},
  "write": {"iops": 99, "bw_bytes": 1, "io_bytes": 0, "lat_ns": {}}}]}`)
	var r row
	if err := parseFio(raw, "read", true, &r); err != nil {
		t.Fatal(err)
	}
	if r.iops != 1234.5 || r.mbps != 5.056512 || r.p50 != 150.528 || r.p99 != 309.248 {
		t.Fatalf("parsed %+v", r)
	}
	if err := parseFio(raw, "write", false, &r); err != nil || r.iops != 99 {
		t.Fatalf("write side: %+v, %v", r, err)
	}
	bad := []byte(`{"jobs": [{"error": 5, "read": {"iops": 1}}]}`)
	if err := parseFio(bad, "read", false, &r); err == nil {
		t.Fatal("fio's job error was not reported")
	}
	unverified := []byte(`{"jobs": [{"error": 0, "read": {"iops": 0, "io_bytes": 0}}]}`)
	if err := parseFio(unverified, "read", true, &r); err == nil {
		t.Fatal("a verify run that read nothing back passed")
	}
	if err := parseFio([]byte("fio: engine nbd not loadable"), "read", false, &r); err == nil {
		t.Fatal("no JSON, no error")
	}
}

func testRows() []row {
	cpu := func(s, c float64) map[string]float64 {
		m := map[string]float64{"server": s}
		if c > 0 {
			m["client"] = c
		}
		return m
	}
	return []row{
		{peer: refUnix, workload: "rr4k_qd1", rep: 1, iops: 20000, p50: 50, cpu: cpu(30, 0)},
		{peer: refUnix, workload: "rr4k_qd32", rep: 1, iops: 100000, cpu: cpu(8, 0)},
		{peer: refUnix, workload: "rr4k_qd32", rep: 2, iops: 120000, cpu: cpu(7, 0)},
		{peer: refTCP, workload: "rr4k_qd32", rep: 1, iops: 90000, cpu: cpu(9, 0)},
		{peer: ourPeer, workload: "rr4k_qd1", rep: 1, iops: 7000, p50: 140, cpu: cpu(50, 60)},
		{peer: ourPeer, workload: "rr4k_qd32", rep: 1, iops: 110000, cpu: cpu(4, 5)},
		{peer: ourPeer, workload: "rr4k_qd32", rep: 2, iops: 80000, cpu: cpu(6, 7)},
		{peer: ourPeer, workload: "verify", rep: 1, iops: 5000, cpu: cpu(1, 1), err: "fio: error 84"},
	}
}

func TestSummarizeBestOfAndTargets(t *testing.T) {
	s := summarize(testRows())
	c := s.cells["rr4k_qd32"][ourPeer]
	if c.best.rep != 1 || c.reps != 2 || c.cpu() != 9 {
		t.Fatalf("best of rnbd qd32: %+v", c)
	}
	if got := c.spread; got < 0.27 || got > 0.28 {
		t.Fatalf("spread %.3f, want (110−80)/110", got)
	}
	if r, _ := s.ratio("rr4k_qd32", ourPeer, refUnix); r < 0.916 || r > 0.917 {
		t.Fatalf("ratio to the best nbdkit rep: %.3f", r)
	}
	// 110K ≥ 0.9 × 120K, ≥ 90K over TCP, 9 µs ≤ 1.3 × 7 µs.
	if got := s.target("rr4k_qd32"); strings.Contains(got, "missed") {
		t.Fatalf("qd32 target: %s", got)
	}
	// p50 140 vs 50 µs is 2.8×, CPU 110 vs 30 µs is 3.7×: both missed.
	if got := s.target("rr4k_qd1"); strings.Count(got, "missed") != 2 {
		t.Fatalf("qd1 target: %s", got)
	}
	if got := s.target("verify"); !strings.Contains(got, "missed") {
		t.Fatalf("a failed verify met its target: %s", got)
	}
	md := markdown(s, "# date: x\n", "p.tsv", "p.svg")
	for _, want := range []string{beginTag, endTag, "| rr4k_qd32 |", "110.0K (±14 %)", "0.92×", "FAIL: fio: error 84", "4.0 + 5.0 = 9.0"} {
		if !strings.Contains(md, want) {
			t.Errorf("table lacks %q:\n%s", want, md)
		}
	}
	if svg := plot(s); !strings.Contains(svg, "0.92×") || !strings.HasSuffix(svg, "</svg>\n") {
		t.Errorf("plot: %s", svg)
	}
}

func TestTSVRoundTripAndSection(t *testing.T) {
	dir := t.TempDir()
	tsv := filepath.Join(dir, "p.tsv")
	if err := writeTSV(tsv, "# date: today\n", testRows()); err != nil {
		t.Fatal(err)
	}
	rows, env, err := readTSV(tsv)
	if err != nil {
		t.Fatal(err)
	}
	if env != "# date: today\n" || len(rows) != len(testRows()) {
		t.Fatalf("read back %d rows, env %q", len(rows), env)
	}
	for i, r := range testRows() {
		g := rows[i]
		if g.peer != r.peer || g.workload != r.workload || g.rep != r.rep || g.iops != r.iops || g.err != r.err ||
			g.cpu["server"] != r.cpu["server"] || g.cpu["client"] != r.cpu["client"] {
			t.Fatalf("row %d: %+v, want %+v", i, g, r)
		}
	}
	doc := filepath.Join(dir, "b.md")
	os.WriteFile(doc, []byte("before\n"+beginTag+"\nold\n"+endTag+"\nafter\n"), 0o644)
	if err := replaceSection(doc, beginTag+"\nnew\n"+endTag+"\n"); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(doc); string(b) != "before\n"+beginTag+"\nnew\n"+endTag+"\nafter\n" {
		t.Fatalf("section replaced as %q", b)
	}
	if err := replaceSection(filepath.Join(dir, "p.tsv"), "x"); err == nil {
		t.Fatal("a file without markers was accepted")
	}
}

func TestCPUTicksOfSelf(t *testing.T) {
	if _, err := cpuTicks(os.Getpid()); err != nil {
		t.Fatal(err)
	}
	if _, err := cpuTicks(-1); err == nil {
		t.Fatal("no error for a process that does not exist")
	}
}

func TestMirrorTable(t *testing.T) {
	rows := []row{
		{peer: ourPeer, workload: "rw4k_qd1", rep: 1, p50: 70},
		{peer: mirrorPeer, workload: "rw4k_qd1", rep: 1, p50: 84},
		{peer: ourPeer, workload: "rw4k_qd32", rep: 1, iops: 100000},
		{peer: mirrorPeer, workload: "rw4k_qd32", rep: 1, iops: 79000},
		{peer: ourPeer, workload: "rr4k_qd32", rep: 1, iops: 100000},
		{peer: mirrorPeer, workload: "rr4k_qd32", rep: 1, iops: 110000},
	}
	s := summarize(rows)
	for w, want := range map[string]string{
		"rw4k_qd1":  "p50 ≤ 1.3× — met",
		"rw4k_qd32": "≥ 0.8× — **missed**",
		"rr4k_qd32": "≥ 1.0× — met",
	} {
		if got := s.mirrorTarget(w); got != want {
			t.Errorf("%s: %q, want %q", w, got, want)
		}
	}
	tab := s.mirrorTable()
	for _, want := range []string{"| rw4k_qd1 |", "p50 1.20×", "| 0.79× |", "| 1.10× |"} {
		if !strings.Contains(tab, want) {
			t.Errorf("the mirror table lacks %q:\n%s", want, tab)
		}
	}
	if got := summarize(rows[:2]).mirrorTarget("rw4k_qd32"); got != "" {
		t.Errorf("a run without both peers judged rw4k_qd32: %q", got)
	}
	if tab := summarize(testRows()).mirrorTable(); tab != "" {
		t.Errorf("a run without the mirror has a mirror table:\n%s", tab)
	}
}
