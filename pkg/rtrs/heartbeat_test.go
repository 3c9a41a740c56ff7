package rtrs

import (
	"context"
	"github.com/rnbd/rnbd/test/kit"
	"net/netip"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric/fabrictest"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// TestHeartbeatAlgorithm checks hb_work's arithmetic on the bubble's fake
// clock: a heartbeat per tick while answered, none while waiting for the
// answer, and the error after missedMax+2 ticks of silence.
func TestHeartbeatAlgorithm(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var sent, errs atomic.Int32
		var h heartbeat
		h.init(time.Second, 3, func() error { sent.Add(1); return nil }, func() { errs.Add(1) })
		h.start()
		// The peer answers every heartbeat at once: one per tick.
		for i := 0; i < 10; i++ {
			time.Sleep(time.Second)
			synctest.Wait()
			h.ack()
		}
		if n := sent.Load(); n != 10 || errs.Load() != 0 {
			t.Fatalf("answered: %d heartbeats, %d errors; want 10, 0", n, errs.Load())
		}
		// Silence: tick 1 sends, ticks 2..4 count, tick 5 gives up.
		time.Sleep(4900 * time.Millisecond)
		synctest.Wait()
		if errs.Load() != 0 {
			t.Fatal("silent peer declared dead before (missed+2) ticks")
		}
		time.Sleep(100 * time.Millisecond)
		synctest.Wait()
		if errs.Load() != 1 {
			t.Fatal("silent peer not declared dead after (missed+2) ticks")
		}
		if n := sent.Load(); n != 11 {
			t.Fatalf("%d heartbeats sent, want 11 (one unanswered)", n)
		}
		h.stop()
	})
}

// TestHeartbeatAnyTraffic: traffic other than acks keeps a path alive.
func TestHeartbeatAnyTraffic(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var errs atomic.Int32
		var h heartbeat
		h.init(time.Second, 1, func() error { return nil }, func() { errs.Add(1) })
		h.start()
		for i := 0; i < 20; i++ {
			time.Sleep(500 * time.Millisecond)
			h.alive() // an IO response, not a heartbeat ack
		}
		if errs.Load() != 0 {
			t.Fatal("a path with traffic was declared dead")
		}
		time.Sleep(10 * time.Second)
		if errs.Load() != 1 {
			t.Fatalf("%d errors after silence, want 1", errs.Load())
		}
		h.stop()
	})
}

// TestHeartbeatDetectsBlackhole: a link that silently stops passing data
// is detected by both sides' heartbeats; the client path reconnects when
// the link comes back. It runs on the fake clock: a minute of heartbeats
// takes no time.
func TestHeartbeatDetectsBlackhole(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		net, cli, srvAddr, srv, sess := openFakeLink(t, newMemDisk(1<<20))
		p := sess.Paths()[0]
		time.Sleep(30 * time.Second) // heartbeats flow; nothing happens
		if p.State() != CltPathConnected {
			t.Fatalf("idle path is %v", p.State())
		}
		net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkBlackhole)
		start := time.Now()
		for p.State() == CltPathConnected {
			time.Sleep(100 * time.Millisecond)
		}
		if d := time.Since(start); d < 4*time.Second || d > 6*time.Second {
			t.Fatalf("client detected the silent link after %v, want 4..6s", d)
		}
		for len(srv.Sessions()) != 0 {
			time.Sleep(100 * time.Millisecond)
		}
		if d := time.Since(start); d > 7*time.Second {
			t.Fatalf("server dropped the silent path after %v", d)
		}
		time.Sleep(20 * time.Second) // reconnects hang and time out
		if c := counters(p); c.ReconnectsFailed == 0 {
			t.Fatal("no failed reconnect while blackholed")
		}
		net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkUp)
		for p.State() != CltPathConnected {
			time.Sleep(100 * time.Millisecond)
		}
		sess.Close()
		srv.Close()
	})
}

// TestHeartbeatLatency: over real TCP the heartbeat measures a round trip
// (cur_latency), which min-latency uses.
func TestHeartbeatLatency(t *testing.T) {
	fab := tcp.New(tcp.Options{})
	dst := loopbackListener(t)
	scfg := testServerConfig(fab, newMemDisk(1<<20), dst)
	scfg.HBInterval = 20 * time.Millisecond
	ccfg := testClientConfig(fab, PathAddr{Dst: dst})
	ccfg.HBInterval = 20 * time.Millisecond
	r := newRig(t, fab, scfg, ccfg)
	p := r.sess.Paths()[0]
	kit.WaitFor(t, 10*time.Second, "a heartbeat round trip", func() bool { return p.CurLatency() > 0 })
	if l := p.CurLatency(); l > time.Second {
		t.Fatalf("cur_latency %v on loopback", l)
	}
}

// TestHeartbeatProbe: with requests waiting and nothing from the peer for
// a probe period, a heartbeat goes out at once, long before the regular
// one; traffic from the peer, or no request waiting, sends none. On the
// bubble's clock: a scheduling gap cannot pass for silence.
func TestHeartbeatProbe(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var sent atomic.Int32
		var busy atomic.Bool
		h := &heartbeat{}
		h.init(time.Hour, 3, func() error { sent.Add(1); return nil }, func() { t.Error("onErr") })
		h.probeEvery = 100 * time.Millisecond
		h.busy = busy.Load
		h.start()
		defer h.stop()
		time.Sleep(300 * time.Millisecond)
		if n := sent.Load(); n != 0 {
			t.Fatalf("%d probes with nothing waiting", n)
		}
		busy.Store(true)
		for range 300 { // the peer talks every millisecond
			h.alive()
			time.Sleep(time.Millisecond)
		}
		synctest.Wait()
		if n := sent.Load(); n != 0 {
			t.Fatalf("%d probes while the peer talks", n)
		}
		// The first tick of the silence still saw the peer's last
		// words; the next probes, and so does every one after it.
		time.Sleep(150 * time.Millisecond)
		synctest.Wait()
		if n := sent.Load(); n != 1 {
			t.Fatalf("%d probes 150ms into the silence with a request waiting, want 1", n)
		}
		time.Sleep(100 * time.Millisecond)
		synctest.Wait()
		if n := sent.Load(); n != 2 {
			t.Fatalf("%d probes 250ms into the silence, want 2", n)
		}
	})
}

// TestHeartbeatLatencyFromOldest: each HB_ACK is measured from the
// HB_MSG it answers (acks come back in order): a probe sent after a
// regular heartbeat does not make a slow path look fast, nor does one
// sent between two acks.
func TestHeartbeatLatencyFromOldest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var h heartbeat
		h.init(time.Hour, 3, func() error { return nil }, func() {})
		lat := func() time.Duration { return time.Duration(h.curLatency.Load()) }
		h.noteSent() // HB1 at 0
		time.Sleep(300 * time.Millisecond)
		h.noteSent() // HB2 at 300
		time.Sleep(100 * time.Millisecond)
		h.ack() // HB1's, at 400
		if l := lat(); l != 400*time.Millisecond {
			t.Fatalf("cur_latency %v, want 400ms (from HB1)", l)
		}
		time.Sleep(50 * time.Millisecond)
		h.noteSent() // HB3 at 450
		time.Sleep(50 * time.Millisecond)
		h.ack() // HB2's, at 500
		if l := lat(); l != 200*time.Millisecond {
			t.Fatalf("cur_latency %v, want 200ms (from HB2, not HB3)", l)
		}
		time.Sleep(50 * time.Millisecond)
		h.ack() // HB3's, at 550
		if l := lat(); l != 100*time.Millisecond {
			t.Fatalf("cur_latency %v, want 100ms", l)
		}
		h.ack() // nothing unanswered: no sample
		if l := lat(); l != 100*time.Millisecond {
			t.Fatalf("cur_latency %v after a stray ack, want 100ms kept", l)
		}
	})
}

// openFakeLink opens a server on disk and a client session of one path
// to it over a fake link of their own, with heartbeats every second (a
// silent peer is found in 5 s) and a reconnect a second after a failure.
// Inside a synctest bubble it runs on the fake clock.
func openFakeLink(t *testing.T, disk *memDisk) (net *fabrictest.Network, cli netip.Addr, srvAddr netip.AddrPort, srv *Server, sess *CltSession) {
	t.Helper()
	net = fabrictest.NewNetwork()
	fab := net.Fabric()
	srvAddr = ap("10.13.0.1:1234")
	cli = netip.MustParseAddr("10.13.0.2")
	scfg := testServerConfig(fab, disk, srvAddr)
	scfg.HBInterval, scfg.HBMissedMax = time.Second, 3
	srv, err := NewServer(scfg)
	if err != nil {
		t.Fatal(err)
	}
	ccfg := testClientConfig(fab, pa(cli.String(), srvAddr.String()))
	ccfg.HBInterval, ccfg.HBMissedMax = time.Second, 3
	ccfg.ReconnectDelay, ccfg.ReconnectJitter = time.Second, 0
	ccfg.ConnectTimeout = 3 * time.Second
	if sess, err = DialSession(context.Background(), ccfg); err != nil {
		t.Fatal(err)
	}
	return net, cli, srvAddr, srv, sess
}
