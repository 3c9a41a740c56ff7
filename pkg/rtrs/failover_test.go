package rtrs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric/fabrictest"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// inflight issues n writes of distinct data at distinct offsets without
// waiting for them, and returns a function that waits for all results.
func (r *rig) inflight(n, size int) (wait func() []error, data [][]byte) {
	r.t.Helper()
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		d := bytes.Repeat([]byte{byte(i + 1)}, size)
		data = append(data, d)
		p, err := r.sess.GetPermit(context.Background(), IOCon)
		if err != nil {
			r.t.Fatal(err)
		}
		copy(r.ibuf.Bytes()[i*size:], d)
		done := make(chanConfirmer, 1)
		if err := r.sess.Request(Write, p, done, offsetHdr(uint64(i*size)), r.ibuf, i*size, size); err != nil {
			r.t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = <-done
			r.sess.PutPermit(p)
		}()
	}
	return func() []error { wg.Wait(); return errs }, data
}

func (r *rig) verify(data [][]byte) {
	r.t.Helper()
	for i, d := range data {
		got, err := r.read(uint64(i*len(d)), len(d))
		if err != nil {
			r.t.Fatalf("read back %d: %v", i, err)
		}
		if !bytes.Equal(got, d) {
			r.t.Fatalf("block %d: read back other data than written: got %x.. want %x.., disk %x..", i, got[:4], d[:4], r.disk.bytes(i*len(d), 4))
		}
	}
}

func noErrors(t *testing.T, errs []error) {
	t.Helper()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("request %d failed: %v", i, err)
		}
	}
}

// holdIO makes the disk hold every IO until the returned release is
// called.
func (d *memDisk) holdIO() func() {
	h := make(chan struct{})
	d.hold.Store(&h)
	var once sync.Once
	return func() {
		once.Do(func() {
			d.hold.Store(nil)
			close(h)
		})
	}
}

// TestFailoverInFlightMem kills one of two paths while requests are in
// flight on both: the dead path's requests move silently to the other.
func TestFailoverInFlightMem(t *testing.T) {
	net, fab := memNet()
	disk := newMemDisk(1 << 20)
	release := disk.holdIO()
	defer release()
	srvAddr := ap("10.2.0.1:1234")
	scfg := testServerConfig(fab, disk, srvAddr)
	ccfg := testClientConfig(fab, pa("10.2.0.2", "10.2.0.1:1234"), pa("10.2.0.3", "10.2.0.1:1234"))
	ccfg.MPPolicy = MPRoundRobin
	r := newRig(t, fab, scfg, ccfg)
	wait, data := r.inflight(32, 4096)
	kit.WaitFor(t, 10*time.Second, "requests at the server", func() bool {
		return srvInflight(r.srv) == 32
	})
	paths := r.sess.Paths()
	onA := paths[0].Stats().Counters().Inflight
	if onA == 0 || onA == 32 {
		t.Fatalf("%d of 32 requests on the first path: round robin should spread them", onA)
	}
	net.Cut(netip.MustParseAddr("10.2.0.2"), srvAddr.Addr())
	// The dead path's requests reach the server again on the other path.
	kit.WaitFor(t, 10*time.Second, "failed-over requests at the server", func() bool {
		return paths[1].Stats().Counters().FailoverCount == uint64(onA)
	})
	release()
	noErrors(t, wait())
	if c := paths[1].Stats().Counters(); c.Inflight != 0 || c.FailoverCount != uint64(onA) || c.FailedOverCount != 0 {
		t.Fatalf("surviving path: %+v, want failover_cnt %d (the kernel counts on the path that took them), none failed over from it", c, onA)
	}
	// The cut path's own count: its requests that went elsewhere.
	if c := paths[0].Stats().Counters(); c.FailedOverCount != uint64(onA) || c.FailoverCount != 0 {
		t.Fatalf("cut path: %+v, want %d failed over from it, none to it", c, onA)
	}
	kit.WaitFor(t, 10*time.Second, "the cut path to reconnect", func() bool {
		return paths[0].State() == CltPathConnected
	})
	if c := paths[0].Stats().Counters(); c.ReconnectsSuccessful != 1 || c.Inflight != 0 {
		t.Fatalf("reconnected path: %+v", c)
	}
	r.verify(data)
}

func srvInflight(s *Server) int64 {
	var n int64
	for _, x := range s.Sessions() {
		for _, p := range x.Paths() {
			n += p.Stats().Inflight()
		}
	}
	return n
}

// TestFailoverInFlightTCP does the same over TCP sockets: the server drops
// one path while both carry requests.
func TestFailoverInFlightTCP(t *testing.T) {
	fab := tcp.New(tcp.Options{})
	dst := loopbackListener(t)
	disk := newMemDisk(1 << 20)
	release := disk.holdIO()
	defer release()
	scfg := testServerConfig(fab, disk, dst)
	ccfg := testClientConfig(fab, pa("127.0.0.1", dst.String()), pa("127.0.0.2", dst.String()))
	ccfg.MPPolicy = MPRoundRobin
	r := newRig(t, fab, scfg, ccfg)
	wait, data := r.inflight(32, 8192)
	kit.WaitFor(t, 10*time.Second, "requests at the server", func() bool { return srvInflight(r.srv) == 32 })
	paths := r.sess.Paths()
	onA := paths[0].Stats().Counters().Inflight
	var victim *SrvPath
	for _, p := range r.srv.Sessions()[0].Paths() {
		if p.ClientAddr().Addr() == netip.MustParseAddr("127.0.0.1") {
			victim = p
		}
	}
	victim.Disconnect()
	kit.WaitFor(t, 10*time.Second, "failed-over requests", func() bool {
		return paths[1].Stats().Counters().FailoverCount == uint64(onA)
	})
	release()
	noErrors(t, wait())
	kit.WaitFor(t, 10*time.Second, "the path to reconnect", func() bool { return paths[0].State() == CltPathConnected })
	r.verify(data)
}

// TestNoPathFailFast: a request fails at once when no path is
// connected, as in the kernel: waiting for a path is the user's (pkg/rnbd).
func TestNoPathFailFast(t *testing.T) {
	net, fab := memNet()
	disk := newMemDisk(1 << 20)
	srvAddr := ap("10.3.0.1:1234")
	ccfg := testClientConfig(fab, pa("10.3.0.2", srvAddr.String()))
	r := newRig(t, fab, testServerConfig(fab, disk, srvAddr), ccfg)
	net.SetLink(netip.MustParseAddr("10.3.0.2"), srvAddr.Addr(), fabrictest.LinkDown)
	kit.WaitFor(t, 10*time.Second, "the path to go down", func() bool { return !r.sess.Connected() })
	err := r.write(0, []byte("x"))
	if !errors.Is(err, ErrNoPath) || !errors.Is(err, syscall.ECONNABORTED) {
		t.Fatalf("write without a path: %v, want ECONNABORTED", err)
	}
}

// TestNoPathInflight: requests in flight when the only path dies fail
// with ECONNABORTED (none is lost or left hanging); the session reports
// DISCONNECTED then RECONNECTED, and IO works again once the path is back.
func TestNoPathInflight(t *testing.T) {
	net, fab := memNet()
	disk := newMemDisk(1 << 20)
	release := disk.holdIO()
	srvAddr := ap("10.4.0.1:1234")
	cli := netip.MustParseAddr("10.4.0.2")
	ccfg := testClientConfig(fab, pa(cli.String(), srvAddr.String()))
	var evMu sync.Mutex
	var events []CltLinkEvent
	ccfg.LinkEvent = func(ev CltLinkEvent) {
		evMu.Lock()
		events = append(events, ev)
		evMu.Unlock()
	}
	r := newRig(t, fab, testServerConfig(fab, disk, srvAddr), ccfg)
	wait, _ := r.inflight(8, 4096)
	kit.WaitFor(t, 10*time.Second, "requests at the server", func() bool { return srvInflight(r.srv) == 8 })
	net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkDown)
	for i, err := range wait() {
		if !errors.Is(err, ErrNoPath) {
			t.Errorf("request %d: %v, want ErrNoPath", i, err)
		}
	}
	release() // the server's answers go nowhere: the path is gone
	net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkUp)
	kit.WaitFor(t, 10*time.Second, "the path to come back", func() bool { return r.sess.Connected() })
	data := bytes.Repeat([]byte{9}, 4096)
	if err := r.write(0, data); err != nil {
		t.Fatalf("write after the reconnect: %v", err)
	}
	if got, err := r.read(0, 4096); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read after the reconnect: %v", err)
	}
	// The path is marked connected before the session counts it and
	// reports RECONNECTED, so the event may trail Connected() a little.
	eventsNow := func() string {
		evMu.Lock()
		defer evMu.Unlock()
		return fmt.Sprint(events)
	}
	kit.WaitFor(t, 10*time.Second, "RECONNECTED", func() bool { return len(eventsNow()) > len("[DISCONNECTED]") })
	if got := eventsNow(); got != "[DISCONNECTED RECONNECTED]" {
		t.Fatalf("link events %v", got)
	}
}

// TestServerRestart: the server goes away and a new one comes up on the
// same address; the session reconnects (first_conn creates the new server
// session) and IO works on it.
func TestServerRestart(t *testing.T) {
	_, fab := memNet()
	disk := newMemDisk(1 << 20)
	srvAddr := ap("10.6.0.1:1234")
	ccfg := testClientConfig(fab, pa("10.6.0.2", srvAddr.String()), pa("10.6.0.3", srvAddr.String()))
	scfg := testServerConfig(fab, disk, srvAddr)
	r := newRig(t, fab, scfg, ccfg)
	if err := r.write(0, []byte("before")); err != nil {
		t.Fatal(err)
	}
	r.srv.Close()
	kit.WaitFor(t, 10*time.Second, "both paths to go down", func() bool { return !r.sess.Connected() })
	srv2, err := NewServer(scfg)
	if err != nil {
		t.Fatal(err)
	}
	defer srv2.Close()
	kit.WaitFor(t, 10*time.Second, "a path back", func() bool { return r.sess.Connected() })
	if err := r.write(4096, []byte("during")); err != nil {
		t.Fatalf("write after the restart: %v", err)
	}
	kit.WaitFor(t, 10*time.Second, "both paths back", func() bool {
		for _, p := range r.sess.Paths() {
			if p.State() != CltPathConnected {
				return false
			}
		}
		return true
	})
	if n := len(srv2.Sessions()); n != 1 {
		t.Fatalf("new server has %d sessions", n)
	}
	if got := disk.bytes(0, 6); string(got) != "before" {
		t.Fatalf("disk: %q", got)
	}
	got, err := r.read(4096, 6)
	if err != nil || string(got) != "during" {
		t.Fatalf("read after restart: %q %v", got, err)
	}
}
