// Command peersplot draws docs/bench/peers.svg from the rows of the
// earlier side-by-side measurements, docs/bench/peers-unix.tsv (one
// tab-separated line per fio run: peer, transport, workload, rep, iops,
// mbps, p50us, ...): for each workload, the candidate's figure as a
// fraction of a reference peer's (IOPS, or MB/s for sequential workloads;
// p50 latency inverted for QD1, so that longer bars are better
// everywhere), with the 1.0 line that issue 4 sets as the target.
//
//	go run ./tools/peersplot -ref nbdkit-file -peer rnbd < docs/bench/peers-unix.tsv > docs/bench/peers.svg
//
// New measurements come from make bench-peers (tools/benchpeers), which
// writes its own rows and plot.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/rnbd/rnbd/tools/internal/svgplot"
)

type sums struct {
	n                int
	iops, mbps, p50u float64
}

func main() {
	ref := flag.String("ref", "nbdkit-file", "the reference peer")
	peer := flag.String("peer", "rnbd", "the candidate")
	transport := flag.String("transport", "unix", "the transport to plot")
	title := flag.String("title", "", "chart title")
	flag.Parse()

	data := map[string]map[string]*sums{} // peer -> workload -> sums
	var order []string
	seen := map[string]bool{}
	sc := bufio.NewScanner(os.Stdin)
	for line := 0; sc.Scan(); line++ {
		f := strings.Split(sc.Text(), "\t")
		if line == 0 || len(f) < 8 || f[1] != *transport || f[2] == "verify" {
			continue
		}
		num := func(i int) float64 { v, _ := strconv.ParseFloat(f[i], 64); return v }
		if data[f[0]] == nil {
			data[f[0]] = map[string]*sums{}
		}
		s := data[f[0]][f[2]]
		if s == nil {
			s = &sums{}
			data[f[0]][f[2]] = s
		}
		s.n++
		s.iops += num(4)
		s.mbps += num(5)
		s.p50u += num(6)
		if !seen[f[2]] {
			seen[f[2]] = true
			order = append(order, f[2])
		}
	}
	if err := sc.Err(); err != nil {
		fmt.Fprintln(os.Stderr, "peersplot:", err)
		os.Exit(1)
	}

	type bar struct {
		label string
		ratio float64
		note  string
	}
	var bars []bar
	for _, w := range order {
		r, c := data[*ref][w], data[*peer][w]
		if r == nil || c == nil {
			continue
		}
		avg := func(s *sums, v float64) float64 { return v / float64(s.n) }
		switch {
		case strings.HasSuffix(w, "_qd1"):
			rl, cl := avg(r, r.p50u), avg(c, c.p50u)
			bars = append(bars, bar{w + " latency", rl / cl, fmt.Sprintf("p50 %.0f vs %.0f µs", cl, rl)})
		case strings.HasPrefix(w, "sr") || strings.HasPrefix(w, "sw"):
			bars = append(bars, bar{w + " MB/s", avg(c, c.mbps) / avg(r, r.mbps), fmt.Sprintf("%.0f vs %.0f MB/s", avg(c, c.mbps), avg(r, r.mbps))})
		default:
			bars = append(bars, bar{w + " IOPS", avg(c, c.iops) / avg(r, r.iops), fmt.Sprintf("%.0fK vs %.0fK", avg(c, c.iops)/1000, avg(r, r.iops)/1000)})
		}
	}
	if len(bars) == 0 {
		fmt.Fprintf(os.Stderr, "peersplot: no workload has both %s and %s on %s\n", *ref, *peer, *transport)
		os.Exit(1)
	}
	if *title == "" {
		*title = fmt.Sprintf("%s as a fraction of %s (%s sockets; 1.0 = the target)", *peer, *ref, *transport)
	}

	const (
		left, barH, gap, width, top = 190, 22, 8, 720, 40
		scaleMax                    = 1.5
	)
	plotW := float64(width - left - 200)
	height := top + len(bars)*(barH+gap) + 30
	w := os.Stdout
	svgplot.Begin(w, width, height, 12)
	svgplot.Text(w, 10, 20, `font-size="14"`, *title)
	for i, b := range bars {
		y := top + i*(barH+gap)
		bw := min(b.ratio, scaleMax) / scaleMax * plotW
		color := "#c0392b"
		if b.ratio >= 1 {
			color = "#27ae60"
		}
		svgplot.Label(w, left-8, y+barH-6, b.label)
		svgplot.Bar(w, left, y, bw, barH, color)
		svgplot.Text(w, float64(left)+bw+6, y+barH-6, "", fmt.Sprintf("%.2f× (%s)", b.ratio, b.note))
	}
	svgplot.Reference(w, float64(left)+plotW/scaleMax, top-6, height-24, "1.0")
	svgplot.End(w)
}
