package rtrs

import (
	"bytes"
	"context"
	"errors"
	"github.com/rnbd/rnbd/test/kit"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/fabrictest"
)

func counters(p *CltPath) StatsCounters { return p.Stats().Counters() }

// TestReconnectLimit: after max_reconnect_attempts failed attempts the
// path closes and stays closed until a manual reconnect.
func TestReconnectLimit(t *testing.T) {
	net, fab := memNet()
	srvAddr := ap("10.7.0.1:1234")
	cli := netip.MustParseAddr("10.7.0.2")
	ccfg := testClientConfig(fab, pa(cli.String(), srvAddr.String()))
	ccfg.MaxReconnectAttempts = 2
	lg, entries := kit.LogRecorder()
	ccfg.Log = lg
	r := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), srvAddr), ccfg)
	p := r.sess.Paths()[0]
	net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkDown)
	kit.WaitFor(t, 10*time.Second, "the path to give up", func() bool { return p.State() == CltPathClosed })
	if c := counters(p); c.ReconnectsFailed != 2 || c.ReconnectsSuccessful != 0 {
		t.Fatalf("reconnects %d/%d, want 0 successful, 2 failed", c.ReconnectsSuccessful, c.ReconnectsFailed)
	}
	// Each attempt was announced: which, of how many, and when.
	var said []string
	for _, e := range entries() {
		if rest, ok := strings.CutPrefix(e.Message, "path "+p.Name()+": "); ok && strings.HasPrefix(rest, "reconnect attempt ") {
			said = append(said, rest)
			if e.Data["path"] == nil || e.Data["in"] == nil {
				t.Errorf("%q without its path or delay: %v", e.Message, e.Data)
			}
		}
	}
	if len(said) != 2 || !strings.HasPrefix(said[0], "reconnect attempt 1 of 2 in ") || !strings.HasPrefix(said[1], "reconnect attempt 2 of 2 in ") {
		t.Fatalf("announced %q, want attempts 1 and 2 of 2", said)
	}
	net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkUp)
	time.Sleep(300 * time.Millisecond) // longer than the reconnect delays
	if p.State() != CltPathClosed {
		t.Fatalf("path is %v after giving up, want CLOSED", p.State())
	}
	if err := p.Reconnect(context.Background()); err != nil {
		t.Fatalf("manual reconnect: %v", err)
	}
	if p.State() != CltPathConnected || counters(p).ReconnectsSuccessful != 1 {
		t.Fatalf("after manual reconnect: %v %+v", p.State(), counters(p))
	}
	if err := r.write(0, []byte("ok")); err != nil {
		t.Fatal(err)
	}
}

// TestReconnectDisabled: max_reconnect_attempts 0 closes at once.
func TestReconnectDisabled(t *testing.T) {
	net, fab := memNet()
	srvAddr := ap("10.8.0.1:1234")
	cli := netip.MustParseAddr("10.8.0.2")
	ccfg := testClientConfig(fab, pa(cli.String(), srvAddr.String()))
	ccfg.MaxReconnectAttempts = 0
	r := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), srvAddr), ccfg)
	p := r.sess.Paths()[0]
	net.Cut(cli, srvAddr.Addr())
	kit.WaitFor(t, 10*time.Second, "the path to close", func() bool { return p.State() == CltPathClosed })
	if c := counters(p); c.ReconnectsFailed != 0 {
		t.Fatalf("%d reconnect attempts with the limit at 0", c.ReconnectsFailed)
	}
}

// TestReconnectForever: -1 keeps trying until the link returns.
func TestReconnectForever(t *testing.T) {
	net, fab := memNet()
	srvAddr := ap("10.9.0.1:1234")
	cli := netip.MustParseAddr("10.9.0.2")
	ccfg := testClientConfig(fab, pa(cli.String(), srvAddr.String()))
	ccfg.MaxReconnectAttempts = -1
	ccfg.ReconnectMaxDelay = 20 * time.Millisecond
	r := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), srvAddr), ccfg)
	p := r.sess.Paths()[0]
	net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkDown)
	kit.WaitFor(t, 10*time.Second, "failed attempts", func() bool { return counters(p).ReconnectsFailed >= 5 })
	// What path show prints: the attempts so far, and the time to the
	// next (at most the 20 ms delay and its jitter).
	kit.WaitFor(t, 10*time.Second, "an attempt scheduled", func() bool {
		n, next := p.ReconnectAttempts()
		return n >= 5 && next > 0 && next <= ccfg.ReconnectMaxDelay+ccfg.ReconnectJitter
	})
	net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkUp)
	kit.WaitFor(t, 10*time.Second, "the path to reconnect", func() bool { return p.State() == CltPathConnected })
	if n, next := p.ReconnectAttempts(); n != 0 || next != 0 {
		t.Fatalf("connected again: %d attempts, next in %v; want 0, none", n, next)
	}
	// A manual reconnect while it keeps failing reports ENOTCONN.
	net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkDown)
	kit.WaitFor(t, 10*time.Second, "reconnecting", func() bool { return p.State() == CltPathReconnecting })
	if err := p.Reconnect(context.Background()); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("reconnect over a dead link: %v, want ENOTCONN", err)
	}
}

// TestSetReconnectDelay: reconnect_delay set at run time is the wait the
// path schedules next, doubled after each failed attempt up to itself
// when it is longer than ReconnectMaxDelay; out of range is EINVAL.
func TestSetReconnectDelay(t *testing.T) {
	net, fab := memNet()
	srvAddr := ap("10.9.1.1:1234")
	cli := netip.MustParseAddr("10.9.1.2")
	ccfg := testClientConfig(fab, pa(cli.String(), srvAddr.String()))
	ccfg.ReconnectJitter = 0
	r := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), srvAddr), ccfg)
	for _, d := range []time.Duration{0, 99 * time.Millisecond, 2 * time.Hour} {
		if err := r.sess.SetReconnectDelay(d); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("reconnect_delay %v: %v, want EINVAL", d, err)
		}
	}
	if got := r.sess.ReconnectDelay(); got != ccfg.ReconnectDelay {
		t.Fatalf("reconnect_delay %v after refused changes, want %v", got, ccfg.ReconnectDelay)
	}
	const d = 2 * time.Second // longer than ReconnectMaxDelay (200 ms)
	if err := r.sess.SetReconnectDelay(d); err != nil {
		t.Fatal(err)
	}
	p := r.sess.Paths()[0]
	net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkDown)
	kit.WaitFor(t, 10*time.Second, "an attempt scheduled", func() bool {
		_, next := p.ReconnectAttempts()
		return next > 0
	})
	// Far above ReconnectMaxDelay (200 ms): the setting, not the config.
	if n, next := p.ReconnectAttempts(); n != 0 || next < time.Second || next > d {
		t.Fatalf("first attempt %d in %v, want 0 in about %v", n, next, d)
	}
	// The first attempt fails; the next wait is d again: neither
	// doubled past it nor cut to ReconnectMaxDelay.
	kit.WaitFor(t, 10*time.Second, "a failed attempt", func() bool {
		n, next := p.ReconnectAttempts()
		return n == 1 && next > 0
	})
	if _, next := p.ReconnectAttempts(); next < time.Second || next > d {
		t.Fatalf("second attempt in %v, want about %v", next, d)
	}
}

// TestPathControls: disconnect, reconnect, remove and add_path with the
// kernel's blocking behaviour and return values, under IO.
func TestPathControls(t *testing.T) {
	_, fab := memNet()
	srvAddr := ap("10.10.0.1:1234")
	ccfg := testClientConfig(fab, pa("10.10.0.2", srvAddr.String()), pa("10.10.0.3", srvAddr.String()))
	ccfg.MPPolicy = MPRoundRobin
	r := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), srvAddr), ccfg)
	a, b := r.sess.Paths()[0], r.sess.Paths()[1]
	io := func(n int) {
		t.Helper()
		for i := 0; i < n; i++ {
			d := bytes.Repeat([]byte{byte(i)}, 1024)
			if err := r.write(uint64(i*1024), d); err != nil {
				t.Fatal(err)
			}
			if got, err := r.read(uint64(i*1024), 1024); err != nil || !bytes.Equal(got, d) {
				t.Fatalf("read back: %v", err)
			}
		}
	}
	if err := a.Disconnect(); err != nil || a.State() != CltPathClosed {
		t.Fatalf("disconnect: %v, state %v", err, a.State())
	}
	if err := a.Disconnect(); err != nil {
		t.Fatalf("second disconnect: %v", err)
	}
	before := counters(a).WriteCount
	io(10)
	if counters(a).WriteCount != before {
		t.Fatal("IO went to a disconnected path")
	}
	time.Sleep(200 * time.Millisecond)
	if a.State() != CltPathClosed {
		t.Fatalf("a disconnected path reconnected by itself: %v", a.State())
	}
	if err := a.Reconnect(context.Background()); err != nil || a.State() != CltPathConnected {
		t.Fatalf("reconnect: %v, state %v", err, a.State())
	}
	// Reconnecting a connected path tears it down and connects again.
	if err := b.Reconnect(context.Background()); err != nil || b.State() != CltPathConnected {
		t.Fatalf("reconnect of a connected path: %v, state %v", err, b.State())
	}
	io(10)
	if err := a.Remove(); err != nil {
		t.Fatalf("remove: %v", err)
	}
	if ps := r.sess.Paths(); len(ps) != 1 || ps[0] != b {
		t.Fatalf("paths after remove: %v", ps)
	}
	if a.State() != CltPathDead {
		t.Fatalf("removed path is %v, want DEAD", a.State())
	}
	if err := a.Reconnect(context.Background()); !errors.Is(err, syscall.ENODEV) {
		t.Fatalf("reconnect of a removed path: %v, want ENODEV", err)
	}
	io(10)
	c, err := r.sess.AddPath(context.Background(), pa("10.10.0.4", srvAddr.String()))
	if err != nil || c.State() != CltPathConnected || len(r.sess.Paths()) != 2 {
		t.Fatalf("add_path: %v", err)
	}
	// add_path to an address nobody listens on fails and leaves no path.
	if _, err := r.sess.AddPath(context.Background(), pa("10.10.0.5", "10.10.0.99:1234")); err == nil {
		t.Fatal("add_path to nowhere succeeded")
	}
	if n := len(r.sess.Paths()); n != 2 {
		t.Fatalf("%d paths after a failed add_path", n)
	}
	// The server refuses a second path with the same addresses (EEXIST).
	if _, err := r.sess.AddPath(context.Background(), pa("10.10.0.4", srvAddr.String())); !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("duplicate add_path: %v, want EEXIST", err)
	}
	io(10)
	for _, p := range r.sess.Paths() {
		if counters(p).FailoverCount != 0 {
			t.Fatalf("path %s failed over IO during clean controls", p.Name())
		}
	}
}

// TestRemoveLastPathThenAdd: with every path removed the server drops the
// session; a new path must be allowed to create it again (first_conn).
func TestRemoveLastPathThenAdd(t *testing.T) {
	_, fab := memNet()
	srvAddr := ap("10.11.0.1:1234")
	ccfg := testClientConfig(fab, pa("10.11.0.2", srvAddr.String()))
	r := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), srvAddr), ccfg)
	if err := r.sess.Paths()[0].Remove(); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the server to drop the session", func() bool { return len(r.srv.Sessions()) == 0 })
	if _, err := r.sess.AddPath(context.Background(), pa("10.11.0.2", srvAddr.String())); err != nil {
		t.Fatalf("add_path after removing all: %v", err)
	}
	if err := r.write(0, []byte("again")); err != nil {
		t.Fatal(err)
	}
}

// TestQueueDepthChanged: a server that comes back with another queue
// depth is refused and auto-reconnect stops, as in the kernel; a manual
// reconnect works once the server is right again.
func TestQueueDepthChanged(t *testing.T) {
	_, fab := memNet()
	srvAddr := ap("10.12.0.1:1234")
	disk := newMemDisk(1 << 20)
	scfg := testServerConfig(fab, disk, srvAddr)
	ccfg := testClientConfig(fab, pa("10.12.0.2", srvAddr.String()))
	r := newRig(t, fab, scfg, ccfg)
	p := r.sess.Paths()[0]
	r.srv.Close()
	scfg2 := scfg
	scfg2.QueueDepth = 32
	srv2, err := NewServer(scfg2)
	if err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the path to give up", func() bool { return p.State() == CltPathClosed })
	if err := p.Reconnect(context.Background()); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("manual reconnect to the wrong queue depth: %v", err)
	}
	srv2.Close()
	srv3, err := NewServer(scfg)
	if err != nil {
		t.Fatal(err)
	}
	defer srv3.Close()
	if err := p.Reconnect(context.Background()); err != nil {
		t.Fatalf("manual reconnect to the right queue depth: %v", err)
	}
	if err := r.write(0, []byte("x")); err != nil {
		t.Fatal(err)
	}
}

// TestConfigLimits: the runtime knobs refuse what sysfs refuses.
func TestConfigLimits(t *testing.T) {
	s := &CltSession{}
	for _, n := range []int{-2, 10000} {
		if err := s.SetMaxReconnectAttempts(n); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("max_reconnect_attempts %d: %v", n, err)
		}
	}
	for _, n := range []int{-1, 0, 9999} {
		if err := s.SetMaxReconnectAttempts(n); err != nil || s.MaxReconnectAttempts() != n {
			t.Errorf("max_reconnect_attempts %d: %v", n, err)
		}
	}
	cfg := DefaultCltConfig()
	cfg.SessName, cfg.Paths = "x", []PathAddr{{Dst: ap("1.2.3.4:1")}}
	cfg.Fabric = fabrictest.NewNetwork().Fabric()
	for name, mut := range map[string]func(*CltConfig){
		"bad name":      func(c *CltConfig) { c.SessName = "a.b" },
		"no paths":      func(c *CltConfig) { c.Paths = nil },
		"no fabric":     func(c *CltConfig) { c.Fabric = nil },
		"zero conns":    func(c *CltConfig) { c.ConnsPerPath = 0 },
		"bad policy":    func(c *CltConfig) { c.MPPolicy = 9 },
		"bad attempts":  func(c *CltConfig) { c.MaxReconnectAttempts = -3 },
		"zero hb":       func(c *CltConfig) { c.HBInterval = 0 },
		"negative wait": func(c *CltConfig) { c.ReconnectDelay = -1 },
	} {
		c := cfg
		mut(&c)
		if _, err := DialSession(context.Background(), c); err == nil {
			t.Errorf("%s: DialSession succeeded", name)
		}
	}
}

// openSlowDial opens a session of one path from cli to srvAddr, whose
// connect timeout (a minute) a dial on a silent link would wait out;
// server and session close with the test.
func openSlowDial(t *testing.T) (net *fabrictest.Network, cli netip.Addr, srvAddr netip.AddrPort, p *CltPath) {
	t.Helper()
	net = fabrictest.NewNetwork()
	fab := net.Fabric()
	srvAddr = ap("10.14.0.1:1234")
	cli = netip.MustParseAddr("10.14.0.2")
	srv, err := NewServer(testServerConfig(fab, newMemDisk(1<<20), srvAddr))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	ccfg := testClientConfig(fab, pa(cli.String(), srvAddr.String()))
	ccfg.ConnectTimeout = time.Minute
	sess, err := DialSession(context.Background(), ccfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	return net, cli, srvAddr, sess.Paths()[0]
}

// TestRemoveWhileReconnecting: removing a path whose reconnect hangs on
// a silent link does not wait for the connect timeout.
func TestRemoveWhileReconnecting(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		net, cli, srvAddr, p := openSlowDial(t)
		net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkBlackhole)
		net.Cut(cli, srvAddr.Addr())
		time.Sleep(time.Second) // the reconnect attempt now hangs in its dial
		synctest.Wait()
		if p.State() != CltPathConnecting {
			t.Fatalf("path is %v, want CONNECTING (a reconnect in progress)", p.State())
		}
		start := time.Now()
		if err := p.Remove(); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(start); d > time.Second {
			t.Fatalf("remove waited %v for the connect timeout", d)
		}
	})
}

// TestGetPermitWakesOnClose: a caller waiting for a permit learns that
// the session closed.
func TestGetPermitWakesOnClose(t *testing.T) {
	_, fab := memNet()
	srvAddr := ap("10.15.0.1:1234")
	r := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), srvAddr), testClientConfig(fab, pa("10.15.0.2", srvAddr.String())))
	for r.sess.TryGetPermit(IOCon) != nil {
	}
	got := make(chan error, 1)
	go func() {
		_, err := r.sess.GetPermit(context.Background(), IOCon)
		got <- err
	}()
	kit.WaitBlocked(t, 10*time.Second, "rtrs.(*CltSession).GetPermit", "select")
	r.sess.Close()
	select {
	case err := <-got:
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("GetPermit: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("GetPermit still waiting after Close")
	}
}

// A client that dies silently leaves its session on the server (the
// server has not noticed one of its paths is gone). A restarted client
// with the same UUID takes that session over: the server drops the stale
// path when the same path comes back, and the data is there. With a new
// UUID the name is still taken by the leftovers, as in the kernel.
func TestRestartedClientReclaimsSession(t *testing.T) {
	n, fab := memNet()
	disk := newMemDisk(1 << 20)
	srvAddr := ap("10.7.0.1:1234")
	scfg := testServerConfig(fab, disk, srvAddr)
	paths := []PathAddr{pa("10.7.0.2", srvAddr.String()), pa("10.7.0.3", srvAddr.String())}
	ccfg := testClientConfig(fab, paths...)
	ccfg.UUID = [16]byte{1, 2, 3}
	// The dying client must not reconnect the path it lost: that would
	// replace the stale path on the server before the test looks.
	dying := ccfg
	dying.MaxReconnectAttempts = 0
	r := newRig(t, fab, scfg, dying)
	if err := r.write(0, []byte("before")); err != nil {
		t.Fatal(err)
	}
	oldPaths := map[[16]byte]bool{}
	for _, p := range r.sess.Paths() {
		oldPaths[p.UUID()] = true
	}
	// The second path's host end dies without a word; then the client
	// closes what it still can: the server keeps the session by that path.
	n.Crash(netip.MustParseAddr("10.7.0.3"))
	r.sess.Close()
	kit.WaitFor(t, 10*time.Second, "the server to see the first path go", func() bool {
		ss := r.srv.Sessions()
		return len(ss) == 1 && len(ss[0].Paths()) == 1
	})

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	fresh := ccfg
	fresh.UUID = [16]byte{}
	if s, err := DialSession(ctx, fresh); err == nil {
		s.Close()
		t.Fatal("a new session took the name of one that lingers on the server")
	}

	s2, err := DialSession(ctx, ccfg)
	if err != nil {
		t.Fatalf("restarted client with the same UUID: %v", err)
	}
	defer s2.Close()
	for _, p := range s2.Paths() {
		if !oldPaths[p.UUID()] {
			t.Errorf("path %s has a new UUID", p.Name())
		}
		if p.State() != CltPathConnected {
			t.Errorf("path %s is %v", p.Name(), p.State())
		}
	}
	// The refused fresh session goes when its path's close work is
	// done, which may still be running.
	kit.WaitFor(t, 10*time.Second, "the old session alone, with two paths", func() bool {
		ss := r.srv.Sessions()
		return len(ss) == 1 && ss[0].UUID() == ccfg.UUID && len(ss[0].Paths()) == 2
	})
	buf, err := s2.AllocBuffer(4096)
	if err != nil {
		t.Fatal(err)
	}
	if err := s2.Do(ctx, IOCon, Read, offsetHdr(0), buf, 0, 6); err != nil || string(buf.Bytes()[:6]) != "before" {
		t.Fatalf("read through the reclaimed session: %q %v", buf.Bytes()[:6], err)
	}
}

// OpenAnyPath: a path that cannot connect does not fail the session; it
// keeps trying and comes up when it can.
func TestOpenAnyPath(t *testing.T) {
	n, fab := memNet()
	disk := newMemDisk(1 << 20)
	srvAddr := ap("10.8.0.1:1234")
	srv, err := NewServer(testServerConfig(fab, disk, srvAddr))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	down := netip.MustParseAddr("10.8.0.2")
	n.SetLink(down, srvAddr.Addr(), fabrictest.LinkDown)
	ccfg := testClientConfig(fab, pa("10.8.0.2", srvAddr.String()), pa("10.8.0.3", srvAddr.String()))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if s, err := DialSession(ctx, ccfg); err == nil {
		s.Close()
		t.Fatal("Open with a path down succeeded without OpenAnyPath")
	}
	ccfg.OpenAnyPath = true
	s, err := DialSession(ctx, ccfg)
	if err != nil {
		t.Fatalf("OpenAnyPath with one path down: %v", err)
	}
	defer s.Close()
	if st := s.Paths()[0].State(); st == CltPathConnected {
		t.Fatalf("the path whose link is down is %v", st)
	}
	n.SetLink(down, srvAddr.Addr(), fabrictest.LinkUp)
	kit.WaitFor(t, 10*time.Second, "the first path to come up", func() bool { return s.Paths()[0].State() == CltPathConnected })
	// Both links down at DialSession: nothing to open.
	n.SetLink(down, srvAddr.Addr(), fabrictest.LinkDown)
	n.SetLink(netip.MustParseAddr("10.8.0.3"), srvAddr.Addr(), fabrictest.LinkDown)
	if s3, err := DialSession(ctx, ccfg); err == nil {
		s3.Close()
		t.Fatal("OpenAnyPath with every path down succeeded")
	}
}

// TestCloseIsNotAnError: when the client closes a session, the server
// closes each path as soon as one of its connections goes (so does the
// kernel's), and the client's other connections see the peer hang up
// while it is still closing them. A normal close logs no warning or
// error.
func TestCloseIsNotAnError(t *testing.T) {
	_, fab := memNet()
	srvAddr := ap("10.9.0.1:1234")
	ccfg := testClientConfig(fab, pa("10.9.0.2", srvAddr.String()))
	ccfg.ConnsPerPath = 3
	rec, logged := kit.LogRecorder()
	ccfg.Log = rec
	r := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), srvAddr), ccfg)
	if err := r.write(0, []byte("data")); err != nil {
		t.Fatal(err)
	}
	lost := func() bool {
		for _, e := range logged() {
			if strings.HasPrefix(e.Message, "connection lost") {
				return true
			}
		}
		return false
	}
	// Between the close of the first connection and the next, wait for
	// the server to hang up on the others.
	testHookConnClosed = func(i int) {
		if i == 0 {
			kit.WaitFor(t, 10*time.Second, "the server to close the other connections", lost)
		}
	}
	t.Cleanup(func() { testHookConnClosed = nil })
	if err := r.sess.Close(); err != nil {
		t.Fatal(err)
	}
	for _, e := range logged() {
		if e.Level <= log.WarnLevel {
			t.Errorf("a normal close logged at %v: %s %v", e.Level, e.Message, e.Data)
		}
	}
}

// TestCtrlLossTmo: with unlimited attempts, a path that has been down for
// ctrl_loss_tmo stops reconnecting (and says why), not before; a manual
// reconnect brings it back.
func TestCtrlLossTmo(t *testing.T) {
	net, fab := memNet()
	srvAddr := ap("10.7.0.1:1234")
	cli := netip.MustParseAddr("10.7.0.2")
	ccfg := testClientConfig(fab, pa(cli.String(), srvAddr.String()))
	ccfg.MaxReconnectAttempts = -1
	ccfg.CtrlLossTmo = 700 * time.Millisecond
	lg, entries := kit.LogRecorder()
	ccfg.Log = lg
	r := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), srvAddr), ccfg)
	if r.sess.CtrlLossTmo() != 700*time.Millisecond {
		t.Fatalf("ctrl_loss_tmo %v", r.sess.CtrlLossTmo())
	}
	p := r.sess.Paths()[0]
	start := time.Now()
	net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkDown)
	kit.WaitFor(t, 10*time.Second, "the path to give up", func() bool { return p.State() == CltPathClosed })
	if took := time.Since(start); took < 700*time.Millisecond {
		t.Fatalf("gave up after %v, before ctrl_loss_tmo", took)
	}
	if c := counters(p); c.ReconnectsFailed == 0 {
		t.Fatalf("no reconnect attempt before giving up: %+v", c)
	}
	said := false
	for _, e := range entries() {
		if strings.HasPrefix(e.Message, "giving up reconnecting") && e.Data["ctrl_loss_tmo"] == "700ms" {
			said = true
		}
	}
	if !said {
		t.Fatal("the give-up does not name ctrl_loss_tmo")
	}
	// A manual reconnect that fails starts the clock again: the path
	// keeps trying for ctrl_loss_tmo, then gives up again.
	start = time.Now()
	if err := p.Reconnect(context.Background()); err == nil {
		t.Fatal("manual reconnect over a link that is down succeeded")
	}
	if left, ok := p.CtrlLossIn(); !ok || left <= 0 || left > 700*time.Millisecond {
		t.Fatalf("after a failed manual reconnect: ctrl_loss_tmo left %v %v", left, ok)
	}
	kit.WaitFor(t, 10*time.Second, "the path to give up again", func() bool { return p.State() == CltPathClosed })
	if took := time.Since(start); took < 700*time.Millisecond {
		t.Fatalf("gave up again after %v, before ctrl_loss_tmo", took)
	}
	net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkUp)
	if err := p.Reconnect(context.Background()); err != nil {
		t.Fatalf("manual reconnect: %v", err)
	}
	r.sess.SetCtrlLossTmo(0)
	if r.sess.CtrlLossTmo() >= 0 {
		t.Fatalf("ctrl_loss_tmo 0 is no bound, got %v", r.sess.CtrlLossTmo())
	}
}

// TestReconnectHonoursCtx: a manual reconnect whose ctx has ended is
// not made; one whose dial hangs on a silent link ends with its ctx,
// not the connect timeout, and leaves the path to the automatic
// reconnects, which connect once the link is back.
func TestReconnectHonoursCtx(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		net, cli, srvAddr, p := openSlowDial(t)
		// A ctx that has ended leaves a connected path alone.
		done, stop := context.WithCancel(context.Background())
		stop()
		for range 20 {
			if err := p.Reconnect(done); !errors.Is(err, context.Canceled) {
				t.Fatalf("Reconnect with an ended ctx = %v, want context.Canceled", err)
			}
			if s := p.State(); s != CltPathConnected {
				t.Fatalf("path is %v after a Reconnect with an ended ctx, want CONNECTED", s)
			}
		}
		if err := p.Disconnect(); err != nil {
			t.Fatal(err)
		}
		net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkBlackhole)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		start := time.Now()
		err := p.Reconnect(ctx)
		if !errors.Is(err, syscall.ENOTCONN) {
			t.Fatalf("Reconnect on a silent link = %v, want ENOTCONN", err)
		}
		if d := time.Since(start); d != 2*time.Second {
			t.Fatalf("Reconnect returned after %v, want its ctx's 2s", d)
		}
		if s := p.State(); s != CltPathReconnecting && s != CltPathConnecting {
			t.Fatalf("path is %v after the ended attempt, want RECONNECTING", s)
		}
		net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkUp)
		for i := 0; p.State() != CltPathConnected; i++ {
			if i == 600 {
				t.Fatalf("path is %v a minute after the link came back", p.State())
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
}
