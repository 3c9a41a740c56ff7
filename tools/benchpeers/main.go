// Command benchpeers measures the rnbd full path side by side with nbdkit,
// the way a newcomer would compare them: fio's nbd engine (libnbd) against
//
//	nbdkit-file/unix   nbdkit's file plugin on a unix socket
//	nbdkit-file/tcp    the same on 127.0.0.1
//	nbdkit-relay/unix  nbdkit's nbd plugin on a unix socket, relaying over
//	                   TCP on 127.0.0.1 to nbdkit-file: two daemons and one
//	                   network hop, the shape of the rnbd path, built from C
//	rnbd/unix          rnbd-client's NBD socket → RTRS/TCP on 127.0.0.1 →
//	                   rnbd-server
//	gonbd/unix         go-nbd's server (github.com/pojntfx/go-nbd, the
//	                   NBD library the project was asked to use) with its
//	                   file backend, on a unix socket (tools/gonbd serve):
//	                   one request at a time per connection, READ and
//	                   WRITE only (gonbd/tcp: the same on 127.0.0.1)
//
// all on one file of random data in /dev/shm, in one run, each workload
// REPS times (peers interleaved per repetition, so that drift in the
// machine's speed spreads over all of them). For every run it records
// IOPS, MB/s, p50/p99 latency and each daemon's CPU time per IO (from
// /proc/PID/stat), writes the rows to a TSV, and from the best repetition
// of each renders a Markdown table (with the targets of issue 14) into
// docs/benchmarks.md between its markers, and an SVG plot.
//
//	go run ./tools/benchpeers                      # make bench-peers
//	go run ./tools/benchpeers -report FILE.tsv     # re-render from rows
//
// It needs fio, nbdkit and nbdinfo (make deps installs them) and the
// daemons in -bin (make build). Every process it starts it stops by PID.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/tools/internal/logtail"
)

type config struct {
	bin       string
	baseBin   string
	reps      int
	runtime   time.Duration
	ramp      time.Duration
	sizeMB    int
	workloads []string
	peers     []string
	outDir    string
	doc       string
	date      string
	// pin puts the storage side (the servers) on the upper half of the
	// CPUs and the client side (fio, the client daemon, a relay) on the
	// lower: a client host and storage nodes of their own, as far as one
	// machine can (docs/benchmarks.md, "Storage nodes on CPUs of their own").
	pin bool
}

func main() {
	var c config
	var workloads, peers, report string
	flag.StringVar(&c.bin, "bin", "bin", "directory with rnbd-server and rnbd-client")
	flag.StringVar(&c.baseBin, "base-bin", "", "directory with the daemons of a baseline build, measured as peer rnbd-base/unix or rnbd-mirror-base/unix (add it to -peers) to compare a change in one run")
	flag.IntVar(&c.reps, "reps", 3, "repetitions of each workload (the table shows the best)")
	flag.DurationVar(&c.runtime, "runtime", 10*time.Second, "measured time of each run")
	flag.DurationVar(&c.ramp, "ramp", 2*time.Second, "unmeasured warm-up before each run")
	flag.IntVar(&c.sizeMB, "size-mb", 1024, "size of the exported file in MiB")
	flag.StringVar(&workloads, "workloads", strings.Join(defaultWorkloads, ","), "comma-separated workloads: "+strings.Join(workloadNames(), ", "))
	flag.StringVar(&peers, "peers", strings.Join(defaultPeers, ","), "comma-separated peer/transport pairs")
	flag.StringVar(&c.outDir, "out", "docs/bench", "directory for the rows (peers-DATE.tsv) and the plot (peers-DATE.svg)")
	flag.StringVar(&c.doc, "doc", "docs/benchmarks.md", "Markdown file whose marked section gets the table (empty: print it)")
	flag.StringVar(&c.date, "date", time.Now().UTC().Format("2006-01-02"), "date in the file names")
	flag.StringVar(&report, "report", "", "render the table and plot from this TSV instead of measuring")
	flag.BoolVar(&c.pin, "pin", false, "run the servers on the upper half of the CPUs and fio and the client daemons on the lower (taskset): storage nodes on CPUs of their own, not taken from the client's")
	resync := flag.String("resync", "", "instead of the peers: measure the mirror's resync (from the bitmap, and a rebuild in full) with fio running this workload during the rebuild, and print the figures")
	flag.Parse()
	if *resync != "" {
		if err := c.checkPin(); err != nil {
			fmt.Fprintln(os.Stderr, "benchpeers:", err)
			os.Exit(2)
		}
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		out, err := measureResync(ctx, c, *resync)
		stop()
		if err != nil {
			fmt.Fprintln(os.Stderr, "benchpeers:", err)
			os.Exit(1)
		}
		fmt.Print(out)
		return
	}
	c.workloads = splitList(workloads)
	c.peers = splitList(peers)
	if err := run(c, report); err != nil {
		fmt.Fprintln(os.Stderr, "benchpeers:", err)
		os.Exit(1)
	}
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func run(c config, report string) error {
	var rows []row
	var env string
	if report != "" {
		var err error
		if rows, env, err = readTSV(report); err != nil {
			return err
		}
	} else {
		for _, w := range c.workloads {
			if _, ok := workloads[w]; !ok {
				return fmt.Errorf("unknown workload %q (have %s)", w, strings.Join(workloadNames(), ", "))
			}
		}
		for _, p := range c.peers {
			if _, err := newPeer(p, c, "", ""); err != nil {
				return err
			}
		}
		if err := c.checkPin(); err != nil {
			return err
		}
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		var err error
		if rows, env, err = measure(ctx, c); err != nil {
			return err
		}
		if err := os.MkdirAll(c.outDir, 0o755); err != nil {
			return err
		}
		tsv := filepath.Join(c.outDir, "peers-"+c.date+".tsv")
		if err := writeTSV(tsv, env, rows); err != nil {
			return err
		}
		report = tsv
		fmt.Fprintln(os.Stderr, "benchpeers: wrote", tsv)
	}
	res := summarize(rows)
	svgPath := strings.TrimSuffix(report, ".tsv") + ".svg"
	if err := os.WriteFile(svgPath, []byte(plot(res)), 0o644); err != nil {
		return err
	}
	md := markdown(res, env, filepath.Base(report), filepath.Base(svgPath))
	if c.doc == "" {
		fmt.Print(md)
		return nil
	}
	if err := replaceSection(c.doc, md); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "benchpeers: wrote %s and the table in %s\n", svgPath, c.doc)
	return nil
}

// measure runs every workload on every peer, reps times.
func measure(ctx context.Context, c config) ([]row, string, error) {
	for _, tool := range []string{"fio", "nbdkit", "nbdinfo"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, "", fmt.Errorf("%s is not installed (make deps installs it)", tool)
		}
	}
	dir, err := os.MkdirTemp("", "benchpeers-")
	if err != nil {
		return nil, "", err
	}
	defer os.RemoveAll(dir)
	img, err := makeImage(c.sizeMB)
	if err != nil {
		return nil, "", err
	}
	defer os.Remove(img)
	for _, leg := range []string{".leg0", ".leg1", ".base-leg0", ".base-leg1"} {
		defer os.Remove(img + leg) // the mirror peers'
	}
	env := describeEnv(c)
	fmt.Fprint(os.Stderr, env)
	var rows []row
	for rep := 1; rep <= c.reps; rep++ {
		for _, name := range c.peers {
			p, err := newPeer(name, c, img, filepath.Join(dir, strings.ReplaceAll(name, "/", "-")))
			if err != nil {
				return rows, env, err
			}
			fmt.Fprintf(os.Stderr, "== rep %d: %s\n", rep, name)
			if err := p.start(ctx, c); err != nil {
				p.stop()
				return rows, env, fmt.Errorf("%s: %w", name, err)
			}
			for _, w := range c.workloads {
				if w == "verify" && rep > 1 {
					continue // once is proof enough
				}
				r, err := runFio(ctx, p, w, c)
				if err != nil {
					p.stop()
					return rows, env, err
				}
				r.rep = rep
				rows = append(rows, r)
				fmt.Fprintf(os.Stderr, "   %-12s %9.0f IOPS %7.0f MB/s p50 %6.1f µs  CPU µs/IO %s  %s\n",
					w, r.iops, r.mbps, r.p50, formatCPU(r.cpu), r.err)
			}
			if err := p.stop(); err != nil {
				return rows, env, fmt.Errorf("%s: %w", name, err)
			}
		}
	}
	return rows, env, nil
}

func describeEnv(c config) string {
	var b strings.Builder
	out := func(name string, args ...string) string {
		o, _ := exec.Command(name, args...).CombinedOutput()
		line, _, _ := strings.Cut(strings.TrimSpace(string(o)), "\n")
		return line
	}
	model := ""
	if ci, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(ci), "\n") {
			if strings.HasPrefix(l, "model name") {
				_, model, _ = strings.Cut(l, ":")
				model = strings.TrimSpace(model)
				break
			}
		}
	}
	fmt.Fprintf(&b, "# date: %s\n", time.Now().UTC().Format(time.RFC3339))
	fmt.Fprintf(&b, "# host: Linux %s, %d CPUs, %s\n", out("uname", "-r"), numCPU(), model)
	fmt.Fprintf(&b, "# %s; nbdkit %s; libnbd %s; rnbd %s\n", out("fio", "--version"),
		strings.TrimPrefix(out("nbdkit", "--version"), "nbdkit "), strings.TrimPrefix(out("nbdinfo", "--version"), "nbdinfo "),
		out("git", "describe", "--always", "--dirty"))
	fmt.Fprintf(&b, "# file: %d MiB of random data in /dev/shm; runtime %s, ramp %s, %d repetitions\n",
		c.sizeMB, c.runtime, c.ramp, c.reps)
	pin := ""
	if c.pin {
		pin = " -pin"
		client, storage := c.cpus("client"), c.cpus("server")
		fmt.Fprintf(&b, "# pinned: fio and the client side on CPUs %s, the servers on CPUs %s\n", client, storage)
	}
	fmt.Fprintf(&b, "# command: go run ./tools/benchpeers%s -reps %d -runtime %s -workloads %s -peers %s\n",
		pin, c.reps, c.runtime, strings.Join(c.workloads, ","), strings.Join(c.peers, ","))
	return b.String()
}

func numCPU() int {
	n := 0
	if b, err := os.ReadFile("/sys/devices/system/cpu/online"); err == nil {
		for _, r := range strings.Split(strings.TrimSpace(string(b)), ",") {
			lo, hi, found := strings.Cut(r, "-")
			a, _ := strconv.Atoi(lo)
			z := a
			if found {
				z, _ = strconv.Atoi(hi)
			}
			n += z - a + 1
		}
	}
	return n
}

// makeImage writes sizeMB MiB of random data to a file in /dev/shm.
func makeImage(sizeMB int) (string, error) {
	f, err := os.CreateTemp("/dev/shm", "benchpeers-*.img")
	if err != nil {
		return "", err
	}
	rng := rand.NewChaCha8([32]byte{1})
	buf := make([]byte, 1<<20)
	for i := 0; i < sizeMB; i++ {
		rng.Read(buf)
		if _, err := f.Write(buf); err != nil {
			f.Close()
			os.Remove(f.Name())
			return "", err
		}
	}
	return f.Name(), f.Close()
}

// daemon is one process a peer consists of.
type daemon struct {
	role string // "server", "client"
	args []string
	cmd  *exec.Cmd
	log  *os.File
}

// peer is a server under test: its daemons, the NBD URI fio uses, and what
// to do once they run.
type peer struct {
	name    string // e.g. "rnbd/unix"
	dir     string
	uri     string
	daemons []*daemon
	setup   func(ctx context.Context) error
}

const export = "bench"

var defaultPeers = []string{"nbdkit-file/unix", "nbdkit-file/tcp", "nbdkit-relay/unix", "rnbd/unix", "gonbd/unix"}

// newPeer describes the peer named name ("kind/transport"); img and dir
// may be empty to only check the name.
func newPeer(name string, c config, img, dir string) (*peer, error) {
	p := &peer{name: name, dir: dir}
	sock := filepath.Join(dir, "nbd.sock")
	unixURI := "nbd+unix:///" + export + "?socket=" + sock
	switch name {
	case "nbdkit-file/unix":
		p.uri = unixURI
		p.daemons = []*daemon{{role: "server", args: []string{"nbdkit", "-f", "-e", export, "-U", sock, "file", "file=" + img}}}
	case "nbdkit-file/tcp":
		port := freePort()
		p.uri = fmt.Sprintf("nbd://127.0.0.1:%d/%s", port, export)
		p.daemons = []*daemon{{role: "server", args: []string{"nbdkit", "-f", "-e", export, "-i", "127.0.0.1", "-p", strconv.Itoa(port), "file", "file=" + img}}}
	case "nbdkit-relay/unix":
		port := strconv.Itoa(freePort())
		p.uri = unixURI
		p.daemons = []*daemon{
			{role: "server", args: []string{"nbdkit", "-f", "-e", export, "-i", "127.0.0.1", "-p", port, "file", "file=" + img}},
			{role: "client", args: []string{"nbdkit", "-f", "-e", export, "-U", sock, "nbd", "hostname=127.0.0.1", "port=" + port, "export=" + export}},
		}
	case "gonbd/unix", "gonbd/tcp":
		// Built once per run, beside the peers' directories.
		bin := filepath.Join(filepath.Dir(dir), "gonbd")
		if img != "" {
			if _, err := os.Stat(bin); err != nil {
				cmd := exec.Command("go", "build", "-o", bin, "./tools/gonbd")
				cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
				if out, err := cmd.CombinedOutput(); err != nil {
					return nil, fmt.Errorf("go build ./tools/gonbd: %v\n%s", err, out)
				}
			}
		}
		listen := "unix:" + sock
		p.uri = unixURI
		if name == "gonbd/tcp" {
			port := freePort()
			listen = fmt.Sprintf("tcp:127.0.0.1:%d", port)
			p.uri = fmt.Sprintf("nbd://127.0.0.1:%d/%s", port, export)
		}
		p.daemons = []*daemon{{role: "server", args: []string{bin, "serve", "-file", img, "-listen", listen, "-name", export}}}
	case "rnbd/unix", "rnbd-base/unix", "rnbd-tls/unix":
		port := strconv.Itoa(freePort())
		p.uri = unixURI
		bin := c.bin
		if name == "rnbd-base/unix" {
			if bin = c.baseBin; bin == "" {
				return nil, fmt.Errorf("peer %s needs -base-bin", name)
			}
		}
		srv, clt := filepath.Join(bin, "rnbd-server"), filepath.Join(bin, "rnbd-client")
		if img != "" {
			for _, b := range []string{srv, clt} {
				if _, err := os.Stat(b); err != nil {
					return nil, fmt.Errorf("%s: %w (make build)", b, err)
				}
			}
		}
		ss, cs := filepath.Join(dir, "s.sock"), filepath.Join(dir, "c.sock")
		p.daemons = []*daemon{
			{role: "server", args: []string{srv, "daemon", "--config", "/dev/null", "--listen", "tcp://127.0.0.1:" + port,
				"--control-socket", ss, "--state-file", filepath.Join(dir, "s.json"), "--log-level", "warn"}},
			{role: "client", args: []string{clt, "daemon", "--config", "/dev/null", "--control-socket", cs,
				"--state-file", filepath.Join(dir, "c.json"), "--socket-dir", dir, "--log-level", "warn"}},
		}
		if name == "rnbd-tls/unix" && img != "" {
			// TLS on the fabric, certificates of scripts/test-ca.sh.
			pki := dir + "-pki" // beside dir, which each start empties
			for _, args := range [][]string{{"ca"}, {"server", "srv", "127.0.0.1"}, {"client", "clt"}} {
				cmd := exec.Command("bash", append([]string{"scripts/test-ca.sh", pki}, args...)...)
				if out, err := cmd.CombinedOutput(); err != nil {
					return nil, fmt.Errorf("scripts/test-ca.sh %v: %v\n%s", args, err, out)
				}
			}
			for i, who := range []string{"srv", "clt"} {
				p.daemons[i].args = append(p.daemons[i].args, "--tls-cert", filepath.Join(pki, who+".crt"),
					"--tls-key", filepath.Join(pki, who+".key"), "--tls-ca", filepath.Join(pki, "ca.crt"))
			}
		}
		p.setup = func(ctx context.Context) error {
			for _, s := range []string{ss, cs} {
				if err := waitFor(ctx, func() bool { _, err := os.Stat(s); return err == nil }); err != nil {
					return fmt.Errorf("control socket %s: %w", s, err)
				}
			}
			if err := command(ctx, srv, "--socket", ss, "map", export, img); err != nil {
				return err
			}
			return command(ctx, clt, "--socket", cs, "map", "--sessname", "bench", "--path", "ip:127.0.0.1",
				"--dest-port", port, "--device-path", export, "--as", "socket:"+sock)
		}
	case "rnbd-mirror/unix", "rnbd-mirror-base/unix":
		// A mirror over two storage nodes (two rnbd-servers on their own
		// ports), each leg a copy of the image: writes go to both,
		// reads to one. The baseline's legs are its own: each build
		// creates its mirror with its own layout.
		bin, legs := c.bin, img+".leg"
		if name == "rnbd-mirror-base/unix" {
			if bin, legs = c.baseBin, img+".base-leg"; bin == "" {
				return nil, fmt.Errorf("peer %s needs -base-bin", name)
			}
		}
		srv, clt := filepath.Join(bin, "rnbd-server"), filepath.Join(bin, "rnbd-client")
		p.uri = unixURI
		cs := filepath.Join(dir, "c.sock")
		var ports, socks []string
		for i := range 2 {
			ports = append(ports, strconv.Itoa(freePort()))
			socks = append(socks, filepath.Join(dir, fmt.Sprintf("s%d.sock", i)))
			p.daemons = append(p.daemons, &daemon{role: "server", args: []string{srv, "daemon", "--config", "/dev/null",
				"--listen", "tcp://127.0.0.1:" + ports[i], "--control-socket", socks[i],
				"--state-file", filepath.Join(dir, fmt.Sprintf("s%d.json", i)), "--log-level", "warn"}})
		}
		p.daemons = append(p.daemons, &daemon{role: "client", args: []string{clt, "daemon", "--config", "/dev/null", "--control-socket", cs,
			"--state-file", filepath.Join(dir, "c.json"), "--socket-dir", dir, "--log-level", "warn"}})
		p.setup = func(ctx context.Context) error {
			for _, s := range append(slices.Clone(socks), cs) {
				if err := waitFor(ctx, func() bool { _, err := os.Stat(s); return err == nil }); err != nil {
					return fmt.Errorf("control socket %s: %w", s, err)
				}
			}
			args := []string{"--socket", cs, "map", "--mirror", export, "--as", "socket:" + sock}
			for i := range 2 {
				leg := fmt.Sprintf("%s%d", legs, i)
				if _, err := os.Stat(leg); err != nil {
					if err := command(ctx, "cp", "--sparse=never", img, leg); err != nil {
						return err
					}
				}
				if err := command(ctx, srv, "--socket", socks[i], "map", export, leg); err != nil {
					return err
				}
				args = append(args, "--leg", fmt.Sprintf("sessname=bench-%d path=ip:127.0.0.1 dest_port=%s device_path=%s", i, ports[i], export))
			}
			// The legs hold the mirror from the first repetition on.
			if err := command(ctx, clt, args...); err == nil {
				return nil
			}
			return command(ctx, clt, append(args, "--create")...)
		}
	default:
		return nil, fmt.Errorf("unknown peer %q (have %s, gonbd/tcp, rnbd-base/unix, rnbd-tls/unix, rnbd-mirror/unix, rnbd-mirror-base/unix)", name, strings.Join(defaultPeers, ", "))
	}
	return p, nil
}

// freePort asks the kernel for a free port on 127.0.0.1.
func freePort() int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 10809
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func command(ctx context.Context, name string, args ...string) error {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", filepath.Base(name), strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func waitFor(ctx context.Context, ok func() bool) error {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for !ok() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}

func (p *peer) start(ctx context.Context, c config) error {
	os.RemoveAll(p.dir) // sockets and state of an earlier repetition
	if err := os.MkdirAll(p.dir, 0o700); err != nil {
		return err
	}
	for i, d := range p.daemons {
		lf, err := os.Create(filepath.Join(p.dir, fmt.Sprintf("%s-%d.log", d.role, i)))
		if err != nil {
			return err
		}
		d.log = lf
		d.cmd = c.command(d.role, d.args...)
		d.cmd.Stdout, d.cmd.Stderr = lf, lf
		if err := d.cmd.Start(); err != nil {
			return err
		}
		if d.role == "server" && len(p.daemons) > 1 && p.setup == nil {
			// A relay's backend listens before its front connects.
			time.Sleep(300 * time.Millisecond)
		}
	}
	if p.setup != nil {
		if err := p.setup(ctx); err != nil {
			return err
		}
	}
	err := waitFor(ctx, func() bool {
		return exec.CommandContext(ctx, "nbdinfo", "--size", p.uri).Run() == nil
	})
	if err != nil {
		for _, d := range p.daemons {
			err = fmt.Errorf("%w; %s log: %s", err, d.role, logtail.Tail(d.log.Name()))
		}
	}
	return err
}

// stop ends the peer's daemons (SIGTERM, then SIGKILL after 10 s); an
// error reports a daemon that had died before.
func (p *peer) stop() error {
	var errs []error
	for i := len(p.daemons) - 1; i >= 0; i-- {
		d := p.daemons[i]
		if d.cmd == nil || d.cmd.Process == nil {
			continue
		}
		died := d.cmd.Process.Signal(syscall.SIGTERM) != nil
		done := make(chan struct{})
		go func() { d.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			d.cmd.Process.Kill()
			<-done
		}
		if died {
			errs = append(errs, fmt.Errorf("%s had exited: %s", d.role, logtail.Tail(d.log.Name())))
		}
		d.log.Close()
		d.cmd = nil
	}
	return errors.Join(errs...)
}

// cpuTicks is the CPU time of pid and its reaped children, in clock ticks
// (USER_HZ, 100 on Linux): utime, stime, cutime, cstime of /proc/PID/stat.
func cpuTicks(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no command field", pid)
	}
	f := strings.Fields(s[i+1:])
	// After the command: state is field 3 of stat(5), utime is field 14.
	if len(f) < 15 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	var t int64
	for _, k := range []int{11, 12, 13, 14} {
		v, err := strconv.ParseInt(f[k], 10, 64)
		if err != nil {
			return 0, err
		}
		t += v
	}
	return t, nil
}

const userHZ = 100
