package rtrs

import (
	"context"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
	"github.com/rnbd/rnbd/test/kit"
	"github.com/rnbd/rnbd/test/testca"
)

// rateRig is a hostile rig whose server takes NewPathRate paths a second
// after a burst of NewPathBurst from an address, with the server's clock
// the test's (advance) if fake; with TLS the attacker (h.fab) has a
// certificate of its own, "mallory", and so has another client (other),
// "trudy".
func rateRig(t *testing.T, withTLS bool, rate float64, burst int, fake bool) (h *hostileRig, other fabric.Fabric, advance func(time.Duration)) {
	opts := tcp.Options{HandshakeTimeout: time.Second, Log: testLog()}
	attacker, another := opts, opts
	if withTLS {
		ca := testca.New(t, "test ca")
		opts.TLS = ca.Config(ca.Issue(t, "good", "127.0.0.1"))
		attacker.TLS = ca.Config(ca.Issue(t, "mallory"))
		another.TLS = ca.Config(ca.Issue(t, "trudy"))
	}
	fab := tcp.New(opts)
	dst := loopbackListener(t)
	scfg := testServerConfig(fab, newMemDisk(4<<20), dst)
	scfg.NewPathRate, scfg.NewPathBurst = rate, burst
	h = &hostileRig{rig: newRig(t, fab, scfg, testClientConfig(fab, pa("127.0.0.1", dst.String()))),
		fab: tcp.New(attacker), dst: dst, src: netip.MustParseAddrPort("127.0.0.3:0")}
	other = tcp.New(another)
	if !fake {
		return h, other, nil
	}
	var mu sync.Mutex
	now := time.Now()
	r := &h.srv.pathRate
	r.mu.Lock()
	r.heldMu.Lock()
	r.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	r.heldMu.Unlock()
	r.mu.Unlock()
	return h, other, func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
}

// An address the new path rate refused is refused as its connections are
// accepted, until its bucket has a token again (issue 40): a connection
// that sends nothing is answered EAGAIN at once — the server used to take
// it into a handshake and wait for its request, then close it at the
// handshake timeout, a second here — and counted as EAGAIN; a dial gets
// EAGAIN; another address is not affected; once the bucket has a token
// the address is served again. Over TLS the answer comes before TLS, and
// our dialer reads it.
func TestNewPathRateRefusedAtAccept(t *testing.T) {
	for _, withTLS := range []bool{false, true} {
		h, otherFab, advance := rateRig(t, withTLS, 1, 2, true)
		for i := 0; i < 2; i++ {
			if err := h.dialPath(); err != nil {
				t.Fatalf("TLS %v: new path %d of a burst of 2: %v", withTLS, i, err)
			}
		}
		if err := h.dialPath(); rejectErrno(err) != syscall.EAGAIN {
			t.Fatalf("TLS %v: a third new path at once: %v, want a reject with EAGAIN", withTLS, err)
		}
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: h.src.Addr().AsSlice()}}
		c, err := d.Dial("tcp", h.dst.String())
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(500 * time.Millisecond)) // half the handshake timeout
		var b [12 + ConnRspSize]byte
		_, err = c.Read(b[:]) // the whole frame comes in one segment
		c.Close()
		var rsp ConnRsp
		if err != nil || string(b[:7]) != "RTRSTCP" || b[8] != 3 || rsp.Decode(b[12:]) != nil || rsp.Errno != syscall.EAGAIN {
			t.Fatalf("TLS %v: a connection from the refused address that sent nothing read %q (%v), want a REJ of EAGAIN at once",
				withTLS, b, err)
		}
		if err := h.dialPath(); rejectErrno(err) != syscall.EAGAIN {
			t.Fatalf("TLS %v: a dial from the refused address: %v, want a reject with EAGAIN", withTLS, err)
		}
		if n := h.srv.Rejected()[syscall.EAGAIN]; n != 3 {
			t.Fatalf("TLS %v: %d refusals counted as EAGAIN, want 3", withTLS, n)
		}
		other := *h
		other.fab, other.src = otherFab, netip.MustParseAddrPort("127.0.0.4:0")
		if err := other.dialPath(); err != nil {
			t.Fatalf("TLS %v: a new path from another address: %v", withTLS, err)
		}
		advance(time.Second)
		if err := h.dialPath(); err != nil {
			t.Fatalf("TLS %v: a new path from the refused address once it has a token again: %v", withTLS, err)
		}
		if withTLS {
			if err := h.dialPath(); rejectErrno(err) != syscall.EAGAIN {
				t.Fatalf("a second one in that second: %v, want EAGAIN", err)
			}
		}
		h.stillServes()
	}
}

// Our client asks again when the server refuses a new path with EAGAIN
// (its new_path_rate), also when the refusal comes at accept, before TLS.
func TestClientRetriesNewPathRateOverTLS(t *testing.T) {
	h, _, _ := rateRig(t, true, 5, 1, false)
	// The rig's own session took the one token of 127.0.0.1: a second
	// session is refused, then held at accept for 200 ms, and asks
	// again until it is let through.
	ccfg := testClientConfig(h.rig.sess.cfg.Fabric, pa("127.0.0.1", h.dst.String()))
	ccfg.SessName = "second"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := DialSession(ctx, ccfg)
	if err != nil {
		t.Fatalf("a session refused EAGAIN at first: %v, want it to retry and connect", err)
	}
	s.Close()
	if n := h.srv.Rejected()[syscall.EAGAIN]; n == 0 {
		t.Fatal("the second session was never refused: the test proves nothing")
	}
}

// Paths that never get through INFO_REQ are what a peer that churns paths
// leaves by the dozen a second: their going ("connection lost", "closing
// path") is logged within one bound for the whole server, not two lines
// each (issue 40).
func TestUnprovenPathsLogBounded(t *testing.T) {
	lg, records := kit.LogRecorder()
	fab := tcp.New(tcp.Options{HandshakeTimeout: time.Second, Log: testLog()})
	dst := loopbackListener(t)
	scfg := testServerConfig(fab, newMemDisk(4<<20), dst)
	scfg.Log = lg
	scfg.NewPathRate, scfg.NewPathBurst = 1e6, 1000 // every path let in
	h := &hostileRig{rig: newRig(t, fab, scfg, testClientConfig(fab, pa("127.0.0.1", dst.String()))),
		fab: fab, dst: dst, src: netip.MustParseAddrPort("127.0.0.3:0")}
	const n = 60
	start := time.Now()
	for i := 0; i < n; i++ {
		if err := h.dialPath(); err != nil {
			t.Fatalf("new path %d: %v", i, err)
		}
	}
	kit.WaitFor(t, 10*time.Second, "the abandoned paths to go", func() bool { return len(h.srv.Sessions()) == 1 })
	took := time.Since(start)
	lines := 0
	for _, e := range records() {
		if e.Message == "closing path" || e.Message == "connection lost" {
			lines++
		}
	}
	// log.Limiter's default: 10 a second.
	if most := 10 * (int(took/time.Second) + 2); lines > most {
		t.Fatalf("%d paths that never sent INFO_REQ logged %d lines of their going in %v, want at most %d", n, lines, took, most)
	}
	h.stillServes()
}
