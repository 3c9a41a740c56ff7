package main

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"time"
)

// row is one figure: of a pool (phase A, per repetition) or of the
// daemon with a number of exports (phase B).
type row struct {
	subject string // "dir on ext4 (/tmp)", "exports=1000"
	rep     int
	metric  string // with its unit: create_p50_ms, rss_mib
	value   float64
}

var tsvHeader = []string{"subject", "rep", "metric", "value"}

// writeTSV writes the run's '#' lines, a header and one line per row.
func writeTSV(path, env string, rows []row) error {
	var b strings.Builder
	b.WriteString(env)
	b.WriteString(strings.Join(tsvHeader, "\t") + "\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "%s\t%d\t%s\t%.4g\n", r.subject, r.rep, r.metric, r.value)
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

// percentile is the p-th percentile of ds (nearest rank).
func percentile(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := (p*len(s) + 99) / 100 // ceil(p/100 · n), 1-based
	return s[max(i, 1)-1]
}

// median of vs (the lower middle of an even count: a value measured).
func median(vs []float64) float64 {
	if len(vs) == 0 {
		return 0
	}
	s := slices.Clone(vs)
	slices.Sort(s)
	return s[(len(s)-1)/2]
}

// values are the figures of metric for subject, one per repetition.
func values(rows []row, subject, metric string) []float64 {
	var vs []float64
	for _, r := range rows {
		if r.subject == subject && r.metric == metric {
			vs = append(vs, r.value)
		}
	}
	return vs
}

func subjects(rows []row, phaseB bool) []string {
	var out []string
	for _, r := range rows {
		if strings.HasPrefix(r.subject, "exports=") == phaseB && !slices.Contains(out, r.subject) {
			out = append(out, r.subject)
		}
	}
	return out
}

// markdown renders the rows as the tables of docs/benchmarks.md.
func markdown(rows []row, c config) string {
	var b strings.Builder
	if pools := subjects(rows, false); len(pools) > 0 {
		fmt.Fprintf(&b, "| pool | %d × create + grant, best / median | create p50 / p99 | grant p50 / p99 | %d × delete, best / median | delete p50 / p99 |\n",
			c.volumes, c.volumes)
		b.WriteString("|---|---|---|---|---|---|\n")
		for _, p := range pools {
			total := func(m string) string {
				vs := values(rows, p, m)
				if len(vs) == 0 {
					return "–"
				}
				return fmt.Sprintf("%.2f s / %.2f s", slices.Min(vs), median(vs))
			}
			lat := func(op string) string {
				p50, p99 := values(rows, p, op+"_p50_ms"), values(rows, p, op+"_p99_ms")
				if len(p50) == 0 {
					return "–"
				}
				return fmt.Sprintf("%.1f / %.1f ms", median(p50), median(p99))
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s |\n", p, total("create_grant_total_s"), lat("create"), lat("grant"),
				total("delete_total_s"), lat("delete"))
		}
		fmt.Fprintf(&b, "\n%s per volume, grants_only, one grant each; %d repetitions; p50/p99: the median over the repetitions.\n",
			c.size, len(values(rows, pools[0], "create_grant_total_s")))
	}
	if ns := subjects(rows, true); len(ns) > 0 {
		if b.Len() > 0 {
			b.WriteString("\n")
		}
		b.WriteString("| exports | VmRSS | VmHWM | threads | idle CPU, % of one CPU | idle CPU, ms/s | on CPU, µs/s | wakeups/s |\n")
		b.WriteString("|---|---|---|---|---|---|---|---|\n")
		for _, n := range ns {
			v := func(m, format string) string {
				vs := values(rows, n, m)
				if len(vs) == 0 {
					return "–"
				}
				return fmt.Sprintf(format, vs[0])
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s |\n", strings.TrimPrefix(n, "exports="),
				v("rss_mib", "%.1f MiB"), v("hwm_mib", "%.1f MiB"), v("threads", "%.0f"),
				v("idle_cpu_pct", "%.3f %%"), v("idle_cpu_ms_per_s", "%.2f"), v("idle_oncpu_us_per_s", "%.1f"), v("idle_wakeups_per_s", "%.1f"))
		}
		last := ns[len(ns)-1]
		if m := values(rows, last, "map_total_s"); len(m) > 0 {
			fmt.Fprintf(&b, "\nMapping %s one after the other: %.2f s (p50 %.1f ms, p99 %.1f ms).",
				strings.TrimPrefix(last, "exports="), m[0], values(rows, last, "map_p50_ms")[0], values(rows, last, "map_p99_ms")[0])
		}
		if f := values(rows, last, "restart_served_first"); len(f) > 0 {
			fmt.Fprintf(&b, " A start with them in the state file: the control API answers in %.2f s with %.0f served",
				values(rows, last, "restart_answer_s")[0], f[0])
			if r := values(rows, last, "restart_s"); len(r) > 0 {
				fmt.Fprintf(&b, ", all %.2f s after the start; VmRSS then %.1f MiB.", r[0], values(rows, last, "rss_restarted_mib")[0])
			} else {
				fmt.Fprintf(&b, ", not all within %s.", restoreWait)
			}
		}
		fmt.Fprintf(&b, "\nIdle: over %s, %s after the last change; CPU from utime+stime (/proc/PID/stat, 10 ms ticks), "+
			"on CPU from the threads' schedstat (ns), wakeups the threads' context switches.\n", c.idle, c.settle)
	}
	return b.String()
}
