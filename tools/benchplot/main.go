// Command benchplot turns `go test -bench` output into an SVG bar chart:
// one bar per benchmark, its length the chosen metric (default ops/s).
//
//	go test -bench . ./pkg/rtrs | go run ./tools/benchplot -title "RTRS over TCP" > docs/bench/rtrs.svg
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

type row struct {
	name  string
	value float64
}

func main() {
	metric := flag.String("metric", "ops/s", "the benchmark metric to plot")
	title := flag.String("title", "", "chart title")
	flag.Parse()
	var rows []row
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 3 || !strings.HasPrefix(f[0], "Benchmark") {
			continue
		}
		for i := 2; i+1 < len(f); i++ {
			if f[i+1] == *metric {
				v, err := strconv.ParseFloat(f[i], 64)
				if err == nil {
					name := strings.TrimPrefix(f[0], "Benchmark")
					if j := strings.LastIndexByte(name, '-'); j > 0 {
						name = name[:j] // the GOMAXPROCS suffix
					}
					rows = append(rows, row{name, v})
				}
			}
		}
	}
	if len(rows) == 0 {
		fmt.Fprintf(os.Stderr, "benchplot: no %q values in the input\n", *metric)
		os.Exit(1)
	}
	max := 0.0
	for _, r := range rows {
		max = maxf(max, r.value)
	}
	const left, barMax, barH, gap, top = 380, 460, 22, 8, 50
	width := left + barMax + 120
	height := top + len(rows)*(barH+gap) + 30
	w := bufio.NewWriter(os.Stdout)
	defer w.Flush()
	svgplot.Begin(w, width, height, 13)
	svgplot.Background(w)
	svgplot.Text(w, 10, 28, `font-size="16" font-weight="bold"`, *title)
	for i, r := range rows {
		y := top + i*(barH+gap)
		l := int(r.value / max * barMax)
		svgplot.Label(w, left-8, y+barH-6, r.name)
		svgplot.Bar(w, left, y, l, barH, "#3b6ea8")
		svgplot.Text(w, left+l+6, y+barH-6, "", human(r.value)+" "+*metric)
	}
	svgplot.End(w)
}

func maxf(a, b float64) float64 {
	if a > b {
		return a
	}
	return b
}

func human(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%.2fM", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%.1fk", v/1e3)
	}
	return fmt.Sprintf("%.0f", v)
}
