// Command fleetbench measures rnbd-server at the scale of a fleet, as an
// orchestrator drives it (issue 33): a benchmark, not a timed test.
//
// Phase A, per pool given with -pool: VOLUMES volumes made one after the
// other (POST /v1/volumes, grants_only), each followed by one grant
// (POST /v1/exports/NAME/grants, identity host-N), then all deleted
// (DELETE /v1/volumes/NAME); the totals and each operation's p50/p99,
// REPS times, best and median. After each repetition the daemon's volume
// and export lists and, for a directory pool, the directory must be
// empty: a benchmark that leaves litter is wrong.
//
// Phase B: the daemon with no export, then with EXPORTS exports mapped
// (POST /v1/exports, sparse files): its memory (VmRSS, VmHWM of
// /proc/PID/status) and its CPU while idle over a window (utime+stime of
// /proc/PID/stat) and its threads' wakeups (context switches); the time
// to map them, and to start again with them in the state file.
//
//	go run ./tools/fleetbench -pool dir                   # make bench-fleet
//	go run ./tools/fleetbench -pool dir:/tmp -pool xfs    # ext4 and an XFS loop mount
//	go run ./tools/fleetbench -pool lvm-thin:VG/TP        # the VM tier
//
// Pools: "dir" (a new directory under $TMPDIR), "dir:PATH" (a new
// directory under PATH), "xfs" (a directory on an XFS file system on a
// loop device it makes and unmounts; root), "lvm-thin:VG/THINPOOL" (an
// existing thin pool, which must have no volume of the daemon's).
//
// It starts rnbd-server from -bin (make build) in a temporary directory
// of its own (configuration, control socket, state file), stops it by
// PID (SIGTERM, SIGKILL after 10 s), removes what it made, and stops by
// itself after -timeout. The Markdown tables go to stdout, the rows to a
// TSV (-out).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/units"
)

type config struct {
	bin        string
	pools      []string
	volumes    int
	size       string
	reps       int
	exports    int
	idle       time.Duration
	settle     time.Duration
	timeout    time.Duration
	out        string
	cpuprofile string
}

type poolList []string

func (p *poolList) String() string     { return strings.Join(*p, ",") }
func (p *poolList) Set(s string) error { *p = append(*p, s); return nil }

func main() {
	var c config
	var pools poolList
	flag.StringVar(&c.bin, "bin", "bin", "directory with rnbd-server (make build)")
	flag.Var(&pools, "pool", "a pool to measure phase A on (repeat): dir, dir:PATH, xfs, lvm-thin:VG/THINPOOL (default dir; none: -volumes 0)")
	flag.IntVar(&c.volumes, "volumes", 100, "volumes made, granted and deleted per repetition (0: no phase A)")
	flag.StringVar(&c.size, "size", "64MiB", "size of each volume and of each export's sparse file")
	flag.IntVar(&c.reps, "reps", 3, "repetitions of phase A per pool (the table shows best and median)")
	flag.IntVar(&c.exports, "exports", 1000, "exports mapped in phase B (0: no phase B)")
	flag.DurationVar(&c.idle, "idle", 30*time.Second, "window over which the idle daemon's CPU is measured")
	flag.DurationVar(&c.settle, "settle", 3*time.Second, "wait before each idle window (the Go runtime's background work after a burst)")
	flag.DurationVar(&c.timeout, "timeout", 20*time.Minute, "the whole run's bound: it stops (and cleans up) after it")
	flag.StringVar(&c.out, "out", "", "TSV file for the rows (default: docs/bench/fleet-DATE.tsv)")
	flag.StringVar(&c.cpuprofile, "cpuprofile", "", "PREFIX: each daemon writes a CPU profile to PREFIX-WHAT.pprof (RNBD_CPUPROFILE)")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "fleetbench: unexpected arguments %q\n", flag.Args())
		os.Exit(2)
	}
	c.pools = pools
	if len(c.pools) == 0 && c.volumes > 0 {
		c.pools = []string{"dir"}
	}
	if c.out == "" {
		c.out = filepath.Join("docs", "bench", "fleet-"+time.Now().UTC().Format("2006-01-02")+".tsv")
	}
	if err := run(c); err != nil {
		fmt.Fprintln(os.Stderr, "fleetbench:", err)
		os.Exit(1)
	}
}

func run(c config) error {
	size, err := units.ParseSize(c.size)
	if err != nil || size <= 0 {
		return fmt.Errorf("-size %q: want a size such as 64MiB", c.size)
	}
	if c.reps < 1 || c.volumes < 0 || c.exports < 0 {
		return errors.New("-reps must be at least 1, -volumes and -exports at least 0")
	}
	specs := make([]poolSpec, 0, len(c.pools))
	for _, s := range c.pools {
		p, err := parsePool(s)
		if err != nil {
			return err
		}
		specs = append(specs, p)
	}
	srv := filepath.Join(c.bin, "rnbd-server")
	if _, err := os.Stat(srv); err != nil {
		return fmt.Errorf("%w (make build)", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	work, err := os.MkdirTemp("", "fleetbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)

	env := describeEnv(c)
	fmt.Fprint(os.Stderr, env)
	var rows []row
	var errs []error
	if c.volumes > 0 {
		for i, p := range specs {
			rs, err := phaseA(ctx, c, srv, filepath.Join(work, fmt.Sprintf("a%d", i)), p, size)
			rows = append(rows, rs...)
			if err != nil {
				errs = append(errs, fmt.Errorf("pool %s: %w", p.spec, err))
				if ctx.Err() != nil {
					break
				}
			}
		}
	}
	if c.exports > 0 && ctx.Err() == nil {
		rs, err := phaseB(ctx, c, srv, filepath.Join(work, "b"), size)
		rows = append(rows, rs...)
		if err != nil {
			errs = append(errs, fmt.Errorf("exports: %w", err))
		}
	}
	if len(rows) > 0 {
		if err := os.MkdirAll(filepath.Dir(c.out), 0o755); err != nil {
			errs = append(errs, err)
		} else if err := writeTSV(c.out, env, rows); err != nil {
			errs = append(errs, err)
		} else {
			fmt.Fprintln(os.Stderr, "fleetbench: wrote", c.out)
		}
		fmt.Print(markdown(rows, c))
	}
	return errors.Join(errs...)
}

// describeEnv is the run's header: when, where, what.
func describeEnv(c config) string {
	out := func(name string, args ...string) string {
		o, _ := exec.Command(name, args...).CombinedOutput()
		line, _, _ := strings.Cut(strings.TrimSpace(string(o)), "\n")
		return line
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# date: %s\n", time.Now().UTC().Format(time.RFC3339))
	fmt.Fprintf(&b, "# host: Linux %s, %d CPUs, %s\n", out("uname", "-r"), numCPU(), cpuModel())
	fmt.Fprintf(&b, "# rnbd %s; %s\n", out("git", "describe", "--always", "--dirty"), out(filepath.Join(c.bin, "rnbd-server"), "--version"))
	b.WriteString("# command: go run ./tools/fleetbench")
	if c.volumes > 0 {
		for _, p := range c.pools {
			b.WriteString(" -pool " + p)
		}
	}
	fmt.Fprintf(&b, " -volumes %d -size %s -reps %d -exports %d -idle %s -settle %s\n", c.volumes, c.size, c.reps, c.exports, c.idle, c.settle)
	return b.String()
}

func cpuModel() string {
	ci, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	for _, l := range strings.Split(string(ci), "\n") {
		if strings.HasPrefix(l, "model name") {
			_, m, _ := strings.Cut(l, ":")
			return strings.TrimSpace(m)
		}
	}
	return ""
}
