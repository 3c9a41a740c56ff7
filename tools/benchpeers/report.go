package main

import (
	"bufio"
	"fmt"
	"html"
	"math"
	"os"
	"strconv"
	"strings"

	"github.com/rnbd/rnbd/tools/internal/svgplot"
)

// The rows' file: '#' lines describe the run, then a header and one
// tab-separated line per fio run.
var tsvHeader = []string{"peer", "workload", "rep", "iops", "mbps", "p50_us", "p99_us", "cpu_server_us_per_io", "cpu_client_us_per_io", "err"}

func writeTSV(path, env string, rows []row) error {
	var b strings.Builder
	b.WriteString(env)
	b.WriteString(strings.Join(tsvHeader, "\t") + "\n")
	for _, r := range rows {
		errs := r.err
		if errs == "" {
			errs = "0"
		}
		fmt.Fprintf(&b, "%s\t%s\t%d\t%.1f\t%.1f\t%.1f\t%.1f\t%.2f\t%.2f\t%s\n", r.peer, r.workload, r.rep,
			r.iops, r.mbps, r.p50, r.p99, r.cpu["server"], r.cpu["client"], errs)
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

func readTSV(path string) ([]row, string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, "", err
	}
	defer f.Close()
	var rows []row
	var env strings.Builder
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			env.WriteString(line + "\n")
			continue
		}
		fs := strings.Split(line, "\t")
		if fs[0] == tsvHeader[0] {
			continue
		}
		if len(fs) != len(tsvHeader) {
			return nil, "", fmt.Errorf("%s:%d: %d fields, want %d", path, n, len(fs), len(tsvHeader))
		}
		var v [7]float64
		for i := range v {
			if v[i], err = strconv.ParseFloat(fs[2+i], 64); err != nil {
				return nil, "", fmt.Errorf("%s:%d: %s: %w", path, n, tsvHeader[2+i], err)
			}
		}
		r := row{peer: fs[0], workload: fs[1], rep: int(v[0]), iops: v[1], mbps: v[2], p50: v[3], p99: v[4],
			cpu: map[string]float64{}}
		if v[5] > 0 {
			r.cpu["server"] = v[5]
		}
		if v[6] > 0 {
			r.cpu["client"] = v[6]
		}
		if fs[9] != "0" {
			r.err = fs[9]
		}
		rows = append(rows, r)
	}
	return rows, env.String(), sc.Err()
}

// cell is one peer on one workload: its best repetition and the spread.
type cell struct {
	best   row
	reps   int
	spread float64 // (max − min) / max of the IOPS over the repetitions
	failed string  // an error of any repetition
}

func (c *cell) cpu() float64 { return c.best.cpu["server"] + c.best.cpu["client"] }

type summary struct {
	workloads []string
	peers     []string
	cells     map[string]map[string]*cell // workload → peer → cell
}

// summarize keeps, per peer and workload, the repetition with the most
// IOPS (at QD1 also the lowest mean latency).
func summarize(rows []row) summary {
	s := summary{cells: map[string]map[string]*cell{}}
	lo := map[[2]string]float64{}
	for _, r := range rows {
		if s.cells[r.workload] == nil {
			s.cells[r.workload] = map[string]*cell{}
			s.workloads = append(s.workloads, r.workload)
		}
		if !contains(s.peers, r.peer) {
			s.peers = append(s.peers, r.peer)
		}
		c := s.cells[r.workload][r.peer]
		k := [2]string{r.workload, r.peer}
		if c == nil {
			c = &cell{best: r}
			s.cells[r.workload][r.peer] = c
			lo[k] = r.iops
		}
		c.reps++
		if r.err != "" && c.failed == "" {
			c.failed = r.err
		}
		if r.iops > c.best.iops {
			c.best = r
		}
		lo[k] = math.Min(lo[k], r.iops)
		if c.best.iops > 0 {
			c.spread = (c.best.iops - lo[k]) / c.best.iops
		}
	}
	return s
}

func contains(l []string, s string) bool {
	for _, x := range l {
		if x == s {
			return true
		}
	}
	return false
}

const (
	refUnix = "nbdkit-file/unix"
	refTCP  = "nbdkit-file/tcp"
	relay   = "nbdkit-relay/unix"
	ourPeer = "rnbd/unix"
	// mirrorPeer is the mirror of two legs, set against ourPeer: the
	// targets of issue 42 (mirrorTarget).
	mirrorPeer = "rnbd-mirror/unix"
	beginTag   = "<!-- benchpeers:begin (written by tools/benchpeers: make bench-peers) -->"
	endTag     = "<!-- benchpeers:end -->"
)

// figure is what a workload is judged by: p50 latency at QD1 (lower is
// better), MB/s for sequential IO, IOPS otherwise.
func figure(w string, r row) (v float64, lowerBetter bool) {
	switch {
	case strings.HasSuffix(w, "_qd1"):
		return r.p50, true
	case workloads[w].seq:
		return r.mbps, false
	}
	return r.iops, false
}

func formatFigure(w string, c *cell) string {
	if c == nil {
		return "—"
	}
	if w == "verify" {
		if c.failed != "" {
			return "FAIL: " + c.failed
		}
		return fmt.Sprintf("PASS ×%d", c.reps)
	}
	r := c.best
	var s string
	switch {
	case strings.HasSuffix(w, "_qd1"):
		s = fmt.Sprintf("%s IOPS, p50 %.0f µs", kilo(r.iops), r.p50)
	case workloads[w].seq:
		s = fmt.Sprintf("%.0f MB/s", r.mbps)
	default:
		s = kilo(r.iops)
	}
	if c.reps > 1 {
		s += fmt.Sprintf(" (±%.0f %%)", 100*c.spread/2)
	}
	if c.failed != "" {
		s += " **error: " + c.failed + "**"
	}
	return s
}

func kilo(v float64) string {
	if v >= 1000 {
		return fmt.Sprintf("%.1fK", v/1000)
	}
	return fmt.Sprintf("%.0f", v)
}

func formatCPU(m map[string]float64) string {
	if len(m) == 0 {
		return "—"
	}
	if len(m) == 1 {
		return fmt.Sprintf("%.1f", m["server"])
	}
	return fmt.Sprintf("%.1f + %.1f = %.1f", m["server"], m["client"], m["server"]+m["client"])
}

// ratio is ours as a fraction of ref's figure, oriented so that more is
// better (ref / ours for latency).
func (s summary) ratio(w, ours, ref string) (float64, bool) {
	a, b := s.cells[w][ours], s.cells[w][ref]
	if a == nil || b == nil {
		return 0, false
	}
	x, lower := figure(w, a.best)
	y, _ := figure(w, b.best)
	if x <= 0 || y <= 0 {
		return 0, false
	}
	if lower {
		return y / x, true
	}
	return x / y, true
}

// judged is a target's text and whether the run meets it.
func judged(ok bool, text string) string {
	if ok {
		return text + " — met"
	}
	return text + " — **missed**"
}

// target states issue 14's goal for w and whether the run meets it.
func (s summary) target(w string) string {
	ru, okU := s.ratio(w, ourPeer, refUnix)
	rt, okT := s.ratio(w, ourPeer, refTCP)
	cpuRatio := func() float64 {
		a, b := s.cells[w][ourPeer], s.cells[w][refUnix]
		if a == nil || b == nil || b.cpu() == 0 {
			return math.Inf(1)
		}
		return a.cpu() / b.cpu()
	}
	switch w {
	case "rr4k_qd1":
		if !okU {
			return ""
		}
		return judged(1/ru <= 1.6, "p50 ≤ 1.6×") + "; " + judged(cpuRatio() <= 2, "CPU ≤ 2×")
	case "rr4k_qd32", "rw4k_qd32":
		if !okU || !okT {
			return ""
		}
		return judged(ru >= 0.9, "≥ 0.9× unix") + "; " + judged(rt >= 1, "≥ 1× tcp") + "; " + judged(cpuRatio() <= 1.3, "CPU ≤ 1.3×")
	case "sr1m_qd8", "sw1m_qd8":
		if !okU {
			return ""
		}
		return judged(ru >= 1, "≥ 1× unix")
	case "verify":
		c := s.cells[w][ourPeer]
		if c == nil {
			return ""
		}
		return judged(c.failed == "", "data verified")
	}
	return ""
}

// mirrorTarget states issue 42's goal for the mirror of two legs against
// one device in w, and whether the run meets it; "" when w has none or
// the run lacks either peer.
func (s summary) mirrorTarget(w string) string {
	r, ok := s.ratio(w, mirrorPeer, ourPeer)
	if !ok {
		return ""
	}
	switch w {
	case "rw4k_qd1":
		return judged(1/r <= 1.3, "p50 ≤ 1.3×")
	case "rw4k_qd32":
		return judged(r >= 0.8, "≥ 0.8×")
	case "rr4k_qd32":
		return judged(r >= 1, "≥ 1.0×")
	}
	return ""
}

// mirrorTable is the mirror against one device, if the run has both:
// the figure of 2 legs as a multiple of 1 (latency: how many times
// longer; throughput: what fraction) and issue 42's targets.
func (s summary) mirrorTable() string {
	var b strings.Builder
	for _, w := range s.workloads {
		r, ok := s.ratio(w, mirrorPeer, ourPeer)
		if !ok || w == "verify" {
			continue
		}
		if b.Len() == 0 {
			fmt.Fprintf(&b, "\nTwo legs against one (docs/replication.md):\n\n| workload | %s | %s | 2 legs ÷ 1 | target (issue 42) |\n|---|---|---|---|---|\n", ourPeer, mirrorPeer)
		}
		ratio := fmt.Sprintf("%.2f×", r)
		if _, lower := figure(w, row{}); lower {
			ratio = fmt.Sprintf("p50 %.2f×", 1/r)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n", w, formatFigure(w, s.cells[w][ourPeer]),
			formatFigure(w, s.cells[w][mirrorPeer]), ratio, s.mirrorTarget(w))
	}
	return b.String()
}

func markdown(s summary, env, tsv, svg string) string {
	var b strings.Builder
	b.WriteString(beginTag + "\n\n")
	b.WriteString("Written by `make bench-peers` (`go run ./tools/benchpeers`): the best of the\n")
	b.WriteString("repetitions of each workload, ± half the spread between them. Rows:\n")
	fmt.Fprintf(&b, "[`bench/%s`](bench/%s); plot: [`bench/%s`](bench/%s).\n\n", tsv, tsv, svg, svg)
	b.WriteString("```\n" + strings.TrimSpace(strings.ReplaceAll(env, "# ", "")) + "\n```\n\n")
	b.WriteString("| workload |")
	for _, p := range s.peers {
		fmt.Fprintf(&b, " %s |", p)
	}
	b.WriteString(" rnbd ÷ nbdkit unix | rnbd ÷ nbdkit tcp | target (issue 14) |\n|---|")
	b.WriteString(strings.Repeat("---|", len(s.peers)+3) + "\n")
	for _, w := range s.workloads {
		fmt.Fprintf(&b, "| %s |", w)
		for _, p := range s.peers {
			fmt.Fprintf(&b, " %s |", formatFigure(w, s.cells[w][p]))
		}
		for _, ref := range []string{refUnix, refTCP} {
			if r, ok := s.ratio(w, ourPeer, ref); ok && w != "verify" {
				fmt.Fprintf(&b, " %.2f× |", r)
			} else {
				b.WriteString(" |")
			}
		}
		fmt.Fprintf(&b, " %s |\n", s.target(w))
	}
	b.WriteString("\nCPU µs per IO of each daemon (server + client where there are two), in the\n")
	b.WriteString("same best repetitions; the ratio is both rnbd daemons to nbdkit-file/unix:\n\n| workload |")
	for _, p := range s.peers {
		fmt.Fprintf(&b, " %s |", p)
	}
	b.WriteString(" rnbd ÷ nbdkit unix |\n|---|" + strings.Repeat("---|", len(s.peers)+1) + "\n")
	for _, w := range s.workloads {
		if w == "verify" {
			continue
		}
		fmt.Fprintf(&b, "| %s |", w)
		for _, p := range s.peers {
			if c := s.cells[w][p]; c != nil {
				fmt.Fprintf(&b, " %s |", formatCPU(c.best.cpu))
			} else {
				b.WriteString(" — |")
			}
		}
		a, r := s.cells[w][ourPeer], s.cells[w][refUnix]
		if a != nil && r != nil && r.cpu() > 0 {
			fmt.Fprintf(&b, " %.2f× |\n", a.cpu()/r.cpu())
		} else {
			b.WriteString(" |\n")
		}
	}
	b.WriteString(s.mirrorTable())
	fmt.Fprintf(&b, "\n![rnbd and the relay against nbdkit](bench/%s)\n\n%s\n", svg, endTag)
	return b.String()
}

// replaceSection puts md in place of the marked section of the file.
func replaceSection(path, md string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	s := string(b)
	i := strings.Index(s, beginTag)
	j := strings.Index(s, endTag)
	if i < 0 || j < i {
		return fmt.Errorf("%s has no section between %q and %q", path, beginTag, endTag)
	}
	s = s[:i] + md + s[j+len(endTag)+1:]
	return os.WriteFile(path, []byte(s), 0o644)
}

// plot draws, per workload, rnbd's and the relay's figure as a fraction
// of nbdkit-file's (longer is better everywhere; 1.0 is nbdkit).
func plot(s summary) string {
	type series struct {
		peer, ref, label, color string
	}
	all := []series{
		{ourPeer, refUnix, "rnbd ÷ nbdkit-file unix", "#2c7fb8"},
		{ourPeer, refTCP, "rnbd ÷ nbdkit-file tcp", "#7fcdbb"},
		{relay, refUnix, "nbdkit-relay ÷ nbdkit-file unix", "#bbbbbb"},
	}
	var ws []string
	for _, w := range s.workloads {
		if w != "verify" {
			ws = append(ws, w)
		}
	}
	const left, barH, gap, groupGap, top, width, scaleMax = 200, 14, 2, 14, 70, 760, 1.5
	plotW := float64(width - left - 140)
	height := top + len(ws)*(len(all)*(barH+gap)+groupGap) + 30
	var b strings.Builder
	svgplot.Begin(&b, width, height, 12)
	svgplot.Background(&b)
	svgplot.Text(&b, 10, 20, `font-size="14"`, "Full path against nbdkit-file (QD1: p50 latency, inverted; sequential: MB/s; else IOPS)")
	for i, se := range all {
		x := 10 + i*250
		fmt.Fprintf(&b, `<rect x="%d" y="34" width="12" height="12" fill="%s"/><text x="%d" y="45">%s</text>`+"\n", x, se.color, x+16, html.EscapeString(se.label))
	}
	y := top
	for _, w := range ws {
		svgplot.Label(&b, left-8, y+len(all)*(barH+gap)/2+4, w)
		for _, se := range all {
			if r, ok := s.ratio(w, se.peer, se.ref); ok {
				bw := math.Min(r, scaleMax) / scaleMax * plotW
				svgplot.Bar(&b, left, y, bw, barH, se.color)
				svgplot.Text(&b, float64(left)+bw+4, y+barH-3, `font-size="11"`, fmt.Sprintf("%.2f×", r))
			}
			y += barH + gap
		}
		y += groupGap
	}
	svgplot.Reference(&b, float64(left)+plotW/scaleMax, top-6, height-24, "1.0 = nbdkit-file")
	svgplot.End(&b)
	return b.String()
}
