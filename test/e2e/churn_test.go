package e2e

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/conntest"
	"github.com/rnbd/rnbd/test/kit"
)

// churnIdentity is the suite's certificate of the path churner and the
// half-open flood (RNBD_E2E_TLS=1): one identity from every address.
const churnIdentity = "e2e-churn"

// TestHostilePathChurn (issues 30 A and 40): 8 processes, one address
// each, open connections as fast as they go, send each a whole
// connection request of a new path (fresh UUIDs, first_conn, two
// connections asked for) and hang up at once, against a server with the
// kernel's queue depth (512 chunks of 128 KiB) and the default chunk
// budget, while a legitimate client writes and verifies through its
// mapping.
//
// Issue 30: the server used to allocate and register a whole path's
// chunks for each: ~10 GB of resident memory. A path's chunks now wait
// for its proof of life, and new paths from one address or identity are
// rate limited: the server's memory must stay where it was.
//
// Issue 40: the legitimate session kept 3.4 % of its IO under the churn,
// against 18 % beside 8 processes that only burn CPU: each refused
// request cost the server a goroutine, the handshake (and TLS's) and the
// request's decoding, about 45 µs. An address the rate limit refused is
// now refused as its connections are accepted, before any of that, and
// one that keeps coming has its SYNs dropped by the kernel. The
// attackers run on the same two CPUs as the daemons, so what they take
// for themselves is no fault of the server's: the control is 8
// processes that burn CPU and touch no network. Each set runs in a
// session of its own, as another tenant's processes would, so that where
// the kernel shares the CPUs by session first (sched_autogroup, on by
// default) both take the same share however many threads each has, and
// what the churn costs the legitimate session beyond the control is the
// server's work for it.
//
// The machine is shared: what other work takes comes and goes within
// seconds, by far more than the effect measured. So one fio runs
// throughout, and the three conditions — alone, beside the burners,
// beside the churn — take turns in slots of churnSlot (each set stopped,
// SIGSTOP, outside its own), in a rotating order, churnCycles times; the
// IOs the server served the session, and the CPU time it used, are
// counted in each slot but its first half second. The churn must leave
// the session at least 0.8 of the rate the control leaves it: loose, for
// a 2-CPU machine that other work shares. And the server must spend at
// most 1.6 times the CPU a request of the session under the churn that it
// spends alone: its work for the churn, measured where the scheduler's
// shares do not blur it (the old server spent 2 to 3 times as much in
// plain TCP, 4 to 11 times in TLS; ours 1.0 to 1.35). Even so a burst of
// other work can sink one measurement, so a failed one is repeated once
// and the second decides: the old server fails both (docs/server.md has
// the figures). Both shares of the session's rate alone are printed. In
// TLS (RNBD_E2E_TLS=1) the churners have a certificate, one identity
// from every address.
//
// Bounded: a warm-up of 3 s, churnCycles × 3 slots of churnSlot (36 s)
// and the helpers' start and stop, about 45 s; 85 s if the first
// measurement is repeated.
func TestHostilePathChurn(t *testing.T) {
	needTools(t, "fio")
	metricsAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	// The kernel module's queue depth and the default budget, as the
	// attack was measured against (the suite's own are smaller).
	m := mapVol(t, 256<<20, "legit", []string{"--queue-depth", "512", "--max-chunk-memory", fmt.Sprint(rtrs.DefaultMaxChunkMemory()),
		"--metrics-listen", metricsAddr}, nil)
	srv, uri := m.srv, m.uri
	dst := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(m.port))
	// The volume's blocks allocated and the daemons warm.
	fioIOPS(t, uri, "warm", 3*time.Second)

	env := []string{"RNBD_E2E_CHURN_DST=" + dst.String()}
	if suitePKI != "" {
		env = append(env, "RNBD_E2E_CHURN_PKI="+suitePKI)
	}
	groups := []*helperGroup{nil, startHelpers(t, "burn", nil), startHelpers(t, "churn", env)}
	for _, g := range groups[1:] {
		g.signal(syscall.SIGSTOP)
	}
	rss0 := vmRSS(srv.cmd.Process.Pid)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	peak := sampleRSS(ctx, srv.cmd.Process.Pid, &wg)
	served := func() float64 {
		return fetchMetrics(t, metricsAddr).sum("rnbd_server_path_requests_total", `session="legit"`)
	}
	// One measurement: fio throughout, the conditions in turn; the
	// session's rate in each (IOPS), and the server's CPU (s a second).
	type measured struct {
		rate, cpu, perIO [3]float64 // IOPS, CPU s a second, CPU µs a request
		secs             float64
		cycles           string
	}
	measure := func() measured {
		const settle = 500 * time.Millisecond
		fio := start(t, "fio", "--name=churn", "--ioengine=nbd", "--uri="+uri, "--rw=randwrite", "--bs=4k",
			"--iodepth=16", "--size=128m", "--time_based", fmt.Sprintf("--runtime=%d", int((churnCycles*3*churnSlot+4*time.Second).Seconds())),
			"--verify=crc32c", "--verify_backlog=1024", "--verify_fatal=1", "--verify_state_save=0",
			"--randrepeat=0", "--output-format=json")
		n0 := served()
		kit.WaitFor(t, 10*time.Second, "fio's IO", func() bool { return served() > n0 })
		var ios, secs, cpus [3]float64
		var cycles []string
		for c := 0; c < churnCycles; c++ {
			var rate [3]float64
			for k := 0; k < 3; k++ {
				i := (c + k) % 3
				g := groups[i]
				if g != nil {
					g.signal(syscall.SIGCONT)
				}
				time.Sleep(settle)
				n0, t0, cpu0 := served(), time.Now(), cpuTime(srv.cmd.Process.Pid)
				time.Sleep(churnSlot - settle)
				n, d := served()-n0, time.Since(t0).Seconds()
				cpus[i] += cpuTime(srv.cmd.Process.Pid) - cpu0
				if g != nil {
					g.signal(syscall.SIGSTOP)
				}
				ios[i], secs[i], rate[i] = ios[i]+n, secs[i]+d, n/d
			}
			cycles = append(cycles, fmt.Sprintf("%.0f/%.0f/%.0f", rate[0], rate[1], rate[2]))
		}
		endFio(t, fio)
		var m measured
		for i := range m.rate {
			m.rate[i], m.cpu[i], m.perIO[i] = ios[i]/secs[i], cpus[i]/secs[i], 1e6*cpus[i]/max(ios[i], 1)
		}
		m.secs, m.cycles = secs[0], strings.Join(cycles, ", ")
		return m
	}
	// judge says what is wrong with a measurement, if anything.
	judge := func(m measured) (wrong string) {
		controlShare, churnShare := m.rate[1]/m.rate[0], m.rate[2]/m.rate[0]
		cost := m.perIO[2] / m.perIO[0]
		t.Logf("legitimate IOPS, counted over %.1f s each: %.0f alone; %.0f beside %d CPU burners: %.1f %%; %.0f beside the churn: %.1f %%; "+
			"churn/control %.2f; by cycle (alone/control/churn): %s; server CPU %.2f, %.2f, %.2f s a second, %.1f, %.1f, %.1f µs a request "+
			"(churn/alone %.2f) (load %s, sched_autogroup %s)",
			m.secs, m.rate[0], m.rate[1], helpers, 100*controlShare, m.rate[2], 100*churnShare, churnShare/controlShare, m.cycles,
			m.cpu[0], m.cpu[1], m.cpu[2], m.perIO[0], m.perIO[1], m.perIO[2], cost, loadavg(), autogroup())
		switch {
		case churnShare < 0.8*controlShare:
			wrong = fmt.Sprintf("the legitimate session kept %.1f %% of its IOPS under the churn, %.1f %% beside %d CPU burners: "+
				"want at least 0.8 of the control's", 100*churnShare, 100*controlShare, helpers)
		case cost > 1.6:
			wrong = fmt.Sprintf("the server spent %.2f times the CPU a request of the legitimate session under the churn that it spends "+
				"alone: want at most 1.6", cost)
		}
		return wrong
	}
	wrong := judge(measure())
	if wrong != "" {
		// What other work takes of a shared machine can sink one
		// measurement; a server whose refusals cost it and the
		// session sinks every one. Once more, and the second decides.
		t.Logf("%s: measuring again", wrong)
		wrong = judge(measure())
	}
	cancel()
	wg.Wait()
	burnt, churned := stopHelpers(t, groups[1]), stopHelpers(t, groups[2])
	sc := fetchMetrics(t, metricsAddr)
	t.Logf("path churn from %d processes, one address each, as fast as they go: %d connections tried, %d made (%.1f s of their CPU; the burners': %.1f s); "+
		"%.0f refused, %.0f of them EAGAIN; server RSS %d MiB before, peak %d MiB",
		helpers, churned.tried, churned.sent, churned.cpu, burnt.cpu, sc.sum("rnbd_server_refused_connections_total"),
		sc.sum("rnbd_server_refused_connections_total", `reason="EAGAIN"`), rss0>>10, peak.Load()>>10)
	// The attack must have been one: connections made and refused. (A
	// server that drops a refused address's SYNs leaves its connects
	// waiting for retransmissions: fewer are made than tried.)
	if churned.sent < 500 {
		t.Fatalf("the churners made %d connections: too few to prove anything", churned.sent)
	}
	// The old server took gigabytes; the chunks of a path now come
	// only with INFO_REQ, which no churned path sends.
	if p := peak.Load() << 10; p > rss0<<10+128<<20 {
		t.Errorf("server RSS peaked at %d MiB under the churn, from %d MiB: more than 128 MiB more", p>>20, rss0>>10)
	}
	if wrong != "" {
		t.Error(wrong)
	}
}

// churnSlot and churnCycles: TestHostilePathChurn's conditions take
// turns in slots of churnSlot, churnCycles times each.
const (
	churnSlot   = 3 * time.Second
	churnCycles = 4
)

// helpers is how many burning or churning processes a helper group runs.
const helpers = 8

// helperEnv names what a run of the test binary is instead of the tests
// (TestMain): "group" (the leader of a session of helpers), or a helper
// of the group, "burn" or "churn".
const helperEnv = "RNBD_E2E_HELPER"

// helperBound is how long a helper runs at most if nobody stops it.
const helperBound = 3 * churnCycles * 3 * churnSlot

// loadavg is the machine's load average over 1, 5 and 15 minutes.
func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:min(3, len(f))], " ")
}

// autogroup is what the kernel says of sched_autogroup: "1" (on), "0", or
// why it cannot say.
func autogroup() string {
	b, err := os.ReadFile("/proc/sys/kernel/sched_autogroup_enabled")
	if err != nil {
		return "unknown: " + err.Error()
	}
	return strings.TrimSpace(string(b))
}

// helperGroup is a session of helpers the test started: its leader.
type helperGroup struct {
	cmd *exec.Cmd
	out lockedBuffer
}

// startHelpers starts a group of helpers of kind: the test binary run
// again as their leader, in a session of its own, which starts them
// (env added to theirs) and ends them. It dies with the test, and they
// with it.
func startHelpers(t *testing.T, kind string, env []string) *helperGroup {
	t.Helper()
	g := &helperGroup{cmd: exec.Command(os.Args[0])}
	g.cmd.Env = append(append(os.Environ(), helperEnv+"=group", "RNBD_E2E_GROUP="+kind), env...)
	g.cmd.Stdout, g.cmd.Stderr = &g.out, &g.out
	g.cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL}
	if err := g.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if g.cmd.ProcessState == nil {
			syscall.Kill(g.cmd.Process.Pid, syscall.SIGKILL)
			g.cmd.Wait()
		}
	})
	// Running once the leader says so: every helper started.
	kit.WaitFor(t, 10*time.Second, "the "+kind+" helpers to start", func() bool {
		return strings.Contains(g.out.String(), "started")
	})
	return g
}

// signal sends sig to every process of the group: its leader's process
// group (SIGSTOP and SIGCONT take turns).
func (g *helperGroup) signal(sig syscall.Signal) { syscall.Kill(-g.cmd.Process.Pid, sig) }

// helperReport is what a group of helpers did: the connections its
// churners tried and made, and the CPU time they all used (s).
type helperReport struct {
	tried, sent int64
	cpu         float64
}

// stopHelpers ends a group by its leader's PID (SIGTERM; SIGKILL after
// 10 s), which ends its helpers by theirs, and returns its report.
func stopHelpers(t *testing.T, g *helperGroup) helperReport {
	t.Helper()
	g.signal(syscall.SIGCONT) // a stopped process takes SIGTERM only then
	syscall.Kill(g.cmd.Process.Pid, syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- g.cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("helper group %d: %v\n%s", g.cmd.Process.Pid, err, g.out.String())
		}
	case <-time.After(10 * time.Second):
		syscall.Kill(g.cmd.Process.Pid, syscall.SIGKILL)
		<-done
		t.Fatalf("helper group %d did not stop within 10 s of SIGTERM\n%s", g.cmd.Process.Pid, g.out.String())
	}
	var r helperReport
	out := g.out.String()
	i := strings.LastIndex(out, "tried ")
	if i < 0 {
		t.Fatalf("helper group's report missing:\n%s", out)
	}
	if _, err := fmt.Sscanf(out[i:], "tried %d sent %d cpu %g", &r.tried, &r.sent, &r.cpu); err != nil {
		t.Fatalf("helper group's report: %v\n%s", err, out)
	}
	return r
}

// runHelper is the test binary run as a helper (helperEnv). A helper
// works until SIGTERM or helperBound, then exits; a leader starts its
// helpers, and on SIGTERM ends them by their PIDs and reports.
func runHelper(kind string) int {
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer cancel()
	ctx, cancelBound := context.WithTimeout(ctx, helperBound)
	defer cancelBound()
	switch kind {
	case "group":
		return runHelperGroup(ctx, os.Getenv("RNBD_E2E_GROUP"))
	case "burn":
		// No network, no system calls: CPU only.
		for n := 0; ; n++ {
			if n%(1<<20) == 0 && ctx.Err() != nil {
				fmt.Println("tried 0 sent 0")
				return 0
			}
		}
	case "churn":
		var tc *tls.Config
		if pki := os.Getenv("RNBD_E2E_CHURN_PKI"); pki != "" {
			var err error
			tc, err = conf.TLS{Cert: filepath.Join(pki, churnIdentity+".crt"), Key: filepath.Join(pki, churnIdentity+".key"),
				CA: filepath.Join(pki, "ca.crt")}.Config()
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			tc.ServerName = "127.0.0.1"
		}
		dst, err := netip.ParseAddrPort(os.Getenv("RNBD_E2E_CHURN_DST"))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		var tried, sent atomic.Int64
		var wg sync.WaitGroup
		// Several at once, so that one waiting for the server's answer
		// leaves the CPU to another.
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				churnPaths(ctx, os.Getenv("RNBD_E2E_CHURN_SRC"), dst, tc, &tried, &sent)
			}()
		}
		wg.Wait()
		fmt.Printf("tried %d sent %d\n", tried.Load(), sent.Load())
		return 0
	}
	fmt.Fprintf(os.Stderr, "%s=%q: no such helper\n", helperEnv, kind)
	return 2
}

// runHelperGroup starts the helpers of kind, one thread each (GOMAXPROCS
// 1, as a process that burns CPU has), churners from 127.0.0.80 on; they
// die with it. When ctx ends it ends them by their PIDs and prints the
// connections they made and the CPU time they used.
func runHelperGroup(ctx context.Context, kind string) int {
	var cmds []*exec.Cmd
	var outs []*lockedBuffer
	for i := 0; i < helpers; i++ {
		c := exec.Command(os.Args[0])
		c.Env = append(os.Environ(), helperEnv+"="+kind, "GOMAXPROCS=1", fmt.Sprintf("RNBD_E2E_CHURN_SRC=127.0.0.%d", 80+i))
		out := &lockedBuffer{}
		c.Stdout, c.Stderr = out, os.Stderr
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := c.Start(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			for _, c := range cmds {
				syscall.Kill(c.Process.Pid, syscall.SIGKILL)
				c.Wait()
			}
			return 1
		}
		cmds, outs = append(cmds, c), append(outs, out)
	}
	fmt.Println("started")
	<-ctx.Done()
	for _, c := range cmds {
		syscall.Kill(c.Process.Pid, syscall.SIGTERM)
	}
	kill := time.AfterFunc(5*time.Second, func() {
		for _, c := range cmds {
			syscall.Kill(c.Process.Pid, syscall.SIGKILL)
		}
	})
	defer kill.Stop()
	var tried, sent int64
	var cpu time.Duration
	code := 0
	for i, c := range cmds {
		if err := c.Wait(); err != nil {
			fmt.Fprintf(os.Stderr, "helper %d: %v\n", c.Process.Pid, err)
			code = 1
		}
		cpu += c.ProcessState.UserTime() + c.ProcessState.SystemTime()
		var t, n int64
		fmt.Sscanf(outs[i].String(), "tried %d sent %d", &t, &n)
		tried, sent = tried+t, sent+n
	}
	fmt.Printf("tried %d sent %d cpu %.2f\n", tried, sent, cpu.Seconds())
	return code
}

// sampleRSS samples pid's resident memory every 100 ms until ctx ends,
// into the peak it returns (KiB).
func sampleRSS(ctx context.Context, pid int, wg *sync.WaitGroup) *atomic.Int64 {
	var peak atomic.Int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			if kb := vmRSS(pid); kb > peak.Load() {
				peak.Store(kb)
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	return &peak
}

// churnPaths, until ctx ends, connects from src to dst as fast as it
// can, sends the connection request of a new path (as the TCP fabric
// frames it, in TLS with tc) and hangs up at once; it counts the
// connections tried and made.
func churnPaths(ctx context.Context, src string, dst netip.AddrPort, tc *tls.Config, tried, sent *atomic.Int64) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: time.Second}
	req := rtrs.ConnReq{Magic: rtrs.Magic, Version: rtrs.ProtoVer, CIDNum: 2, ReconCnt: 1, FirstConn: true}
	for ctx.Err() == nil {
		tried.Add(1)
		c, err := d.DialContext(ctx, "tcp", dst.String())
		if err != nil {
			continue
		}
		sent.Add(1)
		var w net.Conn = c
		if tc != nil {
			s := tls.Client(c, tc)
			s.SetDeadline(time.Now().Add(time.Second))
			if s.HandshakeContext(ctx) != nil {
				c.Close()
				continue
			}
			w = s
		}
		rand.Read(req.SessUUID[:])
		rand.Read(req.PathsUUID[:])
		w.Write(tcpConnReqFrame(&req))
		c.Close()
	}
}

// tcpConnReqFrame is a connection request as the TCP fabric's handshake
// carries it (docs/protocol.md): "RTRSTCP", version 1, REQ, a reserved
// byte, the private data's length, then the private data.
func tcpConnReqFrame(req *rtrs.ConnReq) []byte {
	b := make([]byte, 12+rtrs.ConnReqSize)
	copy(b, "RTRSTCP")
	b[7], b[8] = 1, 1
	binary.LittleEndian.PutUint16(b[10:], rtrs.ConnReqSize)
	req.Encode(b[12:])
	return b
}

// fioIOPS runs fio's nbd engine against uri for d, writing 4 KiB random
// blocks at depth 16 with crc32c and verifying them as it goes, as fast
// as it can, and returns its IOs per second (writes and verifying
// reads). A verify error fails the test.
func fioIOPS(t *testing.T, uri, name string, d time.Duration) float64 {
	t.Helper()
	fio := start(t, "fio", "--name="+name, "--ioengine=nbd", "--uri="+uri, "--rw=randwrite", "--bs=4k",
		"--iodepth=16", "--size=128m", "--time_based", fmt.Sprintf("--runtime=%d", int(d.Seconds())),
		"--verify=crc32c", "--verify_backlog=1024", "--verify_fatal=1", "--verify_state_save=0",
		"--randrepeat=0", "--output-format=json")
	j := endFio(t, fio)
	return float64(j.Read.IOs+j.Write.IOs) / d.Seconds()
}

// cpuTime is the CPU time a process has used, in seconds.
func cpuTime(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	u, _ := strconv.ParseFloat(f[11], 64)
	k, _ := strconv.ParseFloat(f[12], 64)
	return (u + k) / 100
}

// vmHWM is a process's peak resident memory in KiB (0 if unknown).
func vmHWM(pid int) int64 { return procStatusKB(pid, "VmHWM:") }

// TestHostileHalfOpenBudget (issue 30 B): four addresses each open a
// path asking for as many connections as its share of the chunk budget
// holds, open every one of them, never send INFO_REQ, hang up and start
// again, five times. The server used to count a connection for less
// than it allocates and to leave what a path held to the garbage
// collector: its resident memory reached 1.8 times max_chunk_memory.
// Now a connection counts what its fabric allocates for it, the chunks
// wait for INFO_REQ, and the Go runtime's memory limit follows the
// budget: the server's peak resident memory stays within
// max_chunk_memory plus rtrs.GoHeapMargin.
func TestHostileHalfOpenBudget(t *testing.T) {
	dir := t.TempDir()
	port := freePort(t)
	metricsAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	const budget = 1 << 30
	srv := startServer(t, dir, port, "--queue-depth", "512", "--max-chunk-memory", fmt.Sprint(budget),
		"--metrics-listen", metricsAddr)
	dst := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port))
	// Four clients: four addresses and, with TLS, four identities (one
	// identity's paths share one client's part of the budget).
	const addrs, cycles = 4, 5
	ids := append([]string{churnIdentity}, hostileIdentities...)[:addrs]
	devs, pds := make([]fabric.Device, addrs), make([]fabric.PD, addrs)
	for a := range devs {
		dev, err := hostileFabric(t, ids[a], nil).Resolve(context.Background(), netip.AddrPort{}, dst)
		if err != nil {
			t.Fatal(err)
		}
		devs[a] = dev
		if pds[a], err = dev.AllocPD(); err != nil {
			t.Fatal(err)
		}
	}
	// Far more connections than a share holds: the server takes what
	// the budget allows (the first connection is refused with ENOMEM
	// otherwise, and the attacker asks for fewer).
	cidNum := uint16(1401)
	var opened, refusedENOMEM atomic.Int64
	for cycle := 0; cycle < cycles; cycle++ {
		var wg sync.WaitGroup
		held := make([][]fabric.Conn, addrs)
		for a := 0; a < addrs; a++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				src := netip.AddrPortFrom(netip.MustParseAddr(fmt.Sprintf("127.0.0.%d", 90+a)), 0)
				for n := cidNum; n >= 2; n /= 2 {
					conns, err := halfOpenPath(devs[a], pds[a], src, dst, n)
					held[a] = conns
					opened.Add(int64(len(conns)))
					if errors.Is(err, syscall.ENOMEM) && len(conns) == 0 {
						refusedENOMEM.Add(1)
						continue // ask for fewer connections
					}
					return
				}
			}()
		}
		wg.Wait()
		// Every path is half open now: all of its connections (or
		// as many as the server took), no INFO_REQ.
		m := fetchMetrics(t, metricsAddr)
		if used := m.sum("rnbd_server_chunk_memory_bytes"); used > budget {
			t.Fatalf("cycle %d: %v bytes counted, past the budget of %d", cycle, used, budget)
		}
		for _, conns := range held {
			for _, c := range conns {
				c.Close()
			}
		}
		kit.WaitFor(t, 30*time.Second, "the server to drop the half-open paths", func() bool {
			return fetchMetrics(t, metricsAddr).sum("rnbd_server_chunk_memory_bytes") == 0
		})
	}
	hwm := vmHWM(srv.cmd.Process.Pid) << 10
	t.Logf("%d cycles of %d half-open paths: %d connections opened, %d paths refused ENOMEM first; server peak RSS %d MiB, budget %d MiB + margin %d MiB",
		cycles, addrs, opened.Load(), refusedENOMEM.Load(), hwm>>20, budget>>20, rtrs.GoHeapMargin>>20)
	if opened.Load() < 1000 {
		t.Fatalf("%d connections opened in all: the flood was too small to prove anything", opened.Load())
	}
	if hwm > budget+rtrs.GoHeapMargin {
		t.Errorf("server peak RSS %d MiB, want at most max_chunk_memory %d MiB + %d MiB", hwm>>20, budget>>20, rtrs.GoHeapMargin>>20)
	}
}

// halfOpenPath opens the connections of a new path of cidNum
// connections from src, one after another, until the server refuses
// one, and returns those it accepted (and the refusal's errno). It
// never sends INFO_REQ.
func halfOpenPath(dev fabric.Device, pd fabric.PD, src, dst netip.AddrPort, cidNum uint16) ([]fabric.Conn, error) {
	req := rtrs.ConnReq{Magic: rtrs.Magic, Version: rtrs.ProtoVer, CIDNum: cidNum, ReconCnt: 1, FirstConn: true}
	rand.Read(req.SessUUID[:])
	rand.Read(req.PathsUUID[:])
	var conns []fabric.Conn
	for cid := uint16(0); cid < cidNum; cid++ {
		req.CID = cid
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		c, _, err := dev.Dial(ctx, fabric.DialParams{
			Src: src, Dst: dst, PD: pd, PrivateData: req.Encode(make([]byte, rtrs.ConnReqSize)),
			Attr: fabric.ConnAttr{Handler: conntest.NewRecorder(), MaxSendWR: 4, MaxRecvWR: 4},
		})
		cancel()
		var rej *fabric.RejectError
		if errors.As(err, &rej) {
			var rsp rtrs.ConnRsp
			rsp.Decode(rej.PrivateData)
			return conns, rsp.Errno
		}
		if err != nil {
			return conns, err
		}
		conns = append(conns, c)
	}
	return conns, nil
}
