package e2e

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/conntest"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// hostileIdentities are the suite's certificates for the hostile peers
// of TestHostileBesideVerify (RNBD_E2E_TLS=1): one identity each, so
// that each is counted on its own, as distinct hosts would be.
var hostileIdentities = []string{"e2e-many", "e2e-stall", "e2e-half"}

// TestHostileBesideVerify: the server under the attacks of issue 15's
// hostile-client set — a flood of idle connections, connections that
// stop inside the handshake, RTRS paths that ask for connections and
// never open them, more sessions than one client may have, and a
// client that stops reading the answers to its reads — each from its
// own loopback address (and, with TLS, its own certificate), while a
// legitimate client's fio writes and verifies through its mapping. Its
// IO neither fails nor waits long, a new legitimate session comes up
// in the middle of it, the server refuses or drops every hostile peer
// by its bounds, and its memory stays within its chunk budget.
func TestHostileBesideVerify(t *testing.T) {
	// Mostly waiting (timeouts, a loss window) at a bounded load: runs
	// beside the suite's other long waiters (docs/testing.md).
	t.Parallel()
	needTools(t, "fio")
	dir := t.TempDir()
	vol := filepath.Join(dir, "vol.img")
	kit.SparseFile(t, vol, 256<<20)
	kit.SparseFile(t, vol+".2", 64<<20)
	port := freePort(t)
	const budget = 384 << 20
	// The budget is small so that the test can fill it; each client's
	// share of it (a quarter) and its sessions are the defaults.
	srv := startServer(t, dir, port, "--max-chunk-memory", fmt.Sprintf("%dMiB", budget>>20))
	srv.ok("map", "vol", vol)
	srv.ok("map", "vol2", vol+".2")
	dst := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port))

	cl := startClient(t, dir)
	mapArgs := func(sess, dev string) []string {
		return []string{"map", "--sessname", sess, "--path", "ip:127.0.0.1", "--device-path", dev,
			"--dest-port", fmt.Sprint(port), "--access-mode", "rw"}
	}
	uri, ok := strings.CutPrefix(strings.TrimSpace(cl.ok(mapArgs("legit", "vol")...)), "rnbd0 mapped: ")
	if !ok {
		t.Fatal("map output")
	}
	fio := start(t, "fio", "--name=beside", "--ioengine=nbd", "--uri="+uri, "--rw=randwrite", "--bs=4k",
		"--iodepth=16", "--size=128m", "--time_based", "--runtime=55", "--rate_iops=2000",
		"--verify=crc32c", "--verify_backlog=4096", "--verify_fatal=1", "--verify_state_save=0",
		"--randrepeat=0", "--output-format=json")

	// The server's resident memory, sampled through the attack.
	var maxRSS atomic.Int64
	stopRSS := make(chan struct{})
	var rssDone sync.WaitGroup
	rssDone.Add(1)
	go func() {
		defer rssDone.Done()
		for {
			if kb := vmRSS(srv.cmd.Process.Pid); kb<<10 > maxRSS.Load() {
				maxRSS.Store(kb << 10)
			}
			select {
			case <-stopRSS:
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	// The attack begins once the legitimate writes are under way.
	srv.waitWritten("vol", "legit", 1000)
	attackStart := time.Now()

	// 1. Idle connections and 2. connections that stop inside the
	// handshake (a byte of the plain handshake, or of a TLS record), 200
	// and 100 of them, each host far past its handshake slots. The
	// server must close every one within its handshake timeout (10 s).
	var hung []string
	var hungMu sync.Mutex
	var held sync.WaitGroup
	hold := func(src string, n int, first []byte) {
		for i := 0; i < n; i++ {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
			c, err := d.Dial("tcp", dst.String())
			if err != nil {
				continue // refused at once: as good as closed
			}
			held.Add(1)
			go func() {
				defer held.Done()
				defer c.Close()
				c.Write(first)
				c.SetReadDeadline(time.Now().Add(20 * time.Second))
				var b [512]byte
				for {
					if _, err := c.Read(b[:]); err != nil {
						var ne net.Error
						if errors.As(err, &ne) && ne.Timeout() {
							hungMu.Lock()
							hung = append(hung, src)
							hungMu.Unlock()
						}
						return
					}
				}
			}()
		}
	}
	hold("127.0.0.66", 200, nil)
	partial := []byte{'R', 0}
	if suitePKI != "" {
		partial = []byte{22, 3, 1} // a TLS record's first bytes
	}
	hold("127.0.0.67", 100, partial)

	// 3. RTRS paths that ask for three connections and open only the
	// first: the server takes at most a few from one host, holds them
	// until its connect timeout (30 s), then drops them.
	halfFab := hostileFabric(t, "e2e-half", nil)
	halfDev, err := halfFab.Resolve(context.Background(), netip.AddrPort{}, dst)
	if err != nil {
		t.Fatal(err)
	}
	halfPD, err := halfDev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	var halfOpen []*conntest.Recorder
	halfRefused := map[syscall.Errno]int{}
	for i := 0; i < 20; i++ {
		req := rtrs.ConnReq{Magic: rtrs.Magic, Version: rtrs.ProtoVer, CIDNum: 3, ReconCnt: 1, FirstConn: true}
		rand.Read(req.SessUUID[:])
		rand.Read(req.PathsUUID[:])
		rec := conntest.NewRecorder()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, _, err := halfDev.Dial(ctx, fabric.DialParams{
			Src: netip.MustParseAddrPort("127.0.0.70:0"), Dst: dst, PD: halfPD,
			PrivateData: req.Encode(make([]byte, rtrs.ConnReqSize)),
			Attr:        fabric.ConnAttr{Handler: rec, MaxSendWR: 16, MaxRecvWR: 16},
		})
		cancel()
		var rej *fabric.RejectError
		switch {
		case err == nil:
			halfOpen = append(halfOpen, rec)
		case errors.As(err, &rej):
			var rsp rtrs.ConnRsp
			rsp.Decode(rej.PrivateData)
			halfRefused[rsp.Errno]++
		default:
			t.Fatalf("half-open path %d: %v", i, err)
		}
	}
	if len(halfOpen) == 0 || len(halfOpen) > rtrs.DefaultMaxConnectingPerAddr {
		t.Fatalf("%d half-open paths accepted from one host (refused: %v), want 1 to %d",
			len(halfOpen), halfRefused, rtrs.DefaultMaxConnectingPerAddr)
	}

	// 4. As many sessions as one client can make: it gets what its
	// share of the chunk memory holds (a quarter of the budget), then
	// ENOMEM, and the budget keeps room for the others.
	var many []*rnbd.CltSession
	for i := 0; ; i++ {
		s, err := hostileSession(t, fmt.Sprintf("many-%d", i), "127.0.0.68", dst, "e2e-many", nil)
		if errors.Is(err, syscall.ENOMEM) {
			break
		}
		if err != nil {
			t.Fatalf("session %d of one client: %v, want a session or ENOMEM", i, err)
		}
		if i == 64 {
			t.Fatalf("one client made %d sessions, holding more than its share of %d MiB", i+1, budget>>20)
		}
		many = append(many, s)
		if _, err := s.Map(context.Background(), "vol", rnbd.AccessRO); err != nil {
			t.Fatalf("session %d: map ro: %v", i, err)
		}
	}
	if len(many) < 2 {
		t.Fatalf("one client got %d sessions before its share ran out, want a few", len(many))
	}
	t.Logf("one client's share of the chunk memory held %d sessions", len(many))

	// 5. A client that fills its queue with 124 KiB reads and stops
	// reading the answers. In this process, on a wrapped connection the
	// fabric writes with net.Buffers.WriteTo, and there the race
	// detector sees a request's buffers reused (after its answer came)
	// while the writer goroutine's write of them has not returned: no
	// happens-before edge runs through the network. So under -race (the
	// first pass of make test) this client is left out; the TLS pass
	// runs it.
	var stall *stallNet
	var stallStart time.Time
	if !raceDetector {
		// The server's writes to it stall, and it must drop the
		// connection without holding up anyone.
		stall = &stallNet{release: make(chan struct{})}
		ss, err := hostileSession(t, "stall", "127.0.0.69", dst, "e2e-stall", stall)
		if err != nil {
			t.Fatal(err)
		}
		sdev, err := ss.Map(context.Background(), "vol", rnbd.AccessRO)
		if err != nil {
			t.Fatal(err)
		}
		stall.stalled.Store(true)
		stallStart = time.Now()
		readCtx, cancelReads := context.WithCancel(context.Background())
		var reads sync.WaitGroup
		// At the end the client reads again: its path fails (if the server
		// has not dropped it) and so do the reads still waiting.
		defer func() {
			close(stall.release)
			cancelReads()
			reads.Wait()
		}()
		for i := 0; i < 128; i++ {
			buf, err := ss.Session().AllocBuffer(124 << 10)
			if err != nil {
				t.Fatal(err)
			}
			reads.Add(1)
			go func() {
				defer reads.Done()
				sdev.Do(readCtx, rnbd.OpRead, 0, int64(i)*(124<<10), 124<<10, buf, 0)
			}()
		}
	}

	// A legitimate client maps through a new session in the middle of
	// it all.
	cl.ok(mapArgs("legit2", "vol2")...)

	// It drops the stalled reader when its writes to it time out.
	var stalledFor time.Duration
	if stall != nil {
		kit.WaitFor(t, 40*time.Second, "the server to drop the stalled reader", func() bool {
			for _, s := range srv.records("session", "list") {
				if s["sessname"] == "stall" {
					return false
				}
			}
			return true
		})
		stalledFor = time.Since(stallStart)
		// By the server's hand: the client never closed its socket.
		// (On Linux, TCP_USER_TIMEOUT, 1 s, ends a connection whose peer
		// keeps its receive window shut that long, sooner than the stall
		// timeout, 30 s, which is for a peer that opens it a crack at a
		// time.)
		if n := stall.closedEarly.Load(); n > 0 {
			t.Errorf("the stalled reader closed %d connections itself: the test proves nothing", n)
		}
	}
	// The server hangs up on the half-open paths after its connect
	// timeout.
	halfDeadline := time.NewTimer(max(0, 45*time.Second-time.Since(attackStart)))
	defer halfDeadline.Stop()
	for i, rec := range halfOpen {
		select {
		case <-rec.Dead:
			continue
		default:
		}
		select {
		case <-rec.Dead:
		case <-halfDeadline.C:
			t.Fatalf("half-open path %d still open %v after the attack began", i, time.Since(attackStart))
		}
	}
	held.Wait()
	if len(hung) > 0 {
		t.Fatalf("%d idle or half-handshaken connections kept open 20 s (from %v)", len(hung), hung[:1])
	}

	if err := fio.wait(t, 2*time.Minute); err != nil {
		t.Fatalf("fio: %v\n%s", err, fio.out.String())
	}
	close(stopRSS)
	rssDone.Wait()
	j := fioWrites(t, fio)
	if j.Error != 0 || j.Write.IOs < 50000 {
		t.Fatalf("fio: error %d after %d writes", j.Error, j.Write.IOs)
	}
	// What the attack can hold it holds for 20 s or more (a half-open
	// path until the server's connect timeout, an idle connection until
	// it is found idle, a stalled reader's answers): a legitimate write
	// caught behind any of it would wait that long. Under 5 s says the
	// attack held none; a stall of a few seconds is the host's (make
	// test runs this under -race beside other packages' tests on two
	// cores, where one write once waited 2.9 s with nothing held).
	if j.Write.Clat.Max > 5e9 {
		t.Errorf("a legitimate write waited %.2f s beside the hostile peers, want at most 5 s (what the attack holds, it holds 20 s or more)", j.Write.Clat.Max/1e9)
	}
	// Chunks and connection buffers are within the budget; the rest of
	// the daemon (Go runtime, goroutines of the flood) gets 128 MiB.
	if m := maxRSS.Load(); m == 0 || m > budget+128<<20 {
		t.Errorf("server RSS peaked at %d MiB, want at most the %d MiB chunk budget + 128 MiB", m>>20, budget>>20)
	}
	for _, s := range many {
		s.Close()
	}
	t.Logf("%d legitimate writes verified beside the hostile peers, max wait %.0f ms; server RSS peak %d MiB; "+
		"half-open paths: %d accepted, refused %v; stalled reader dropped after %.1f s",
		j.Write.IOs, j.Write.Clat.Max/1e6, maxRSS.Load()>>20, len(halfOpen), halfRefused, stalledFor.Seconds())
}

// hostileFabric is a TCP fabric for a hostile peer: with the suite's
// TLS, it presents the certificate of identity. nw, if set, dials.
func hostileFabric(t *testing.T, identity string, nw tcp.Network) *tcp.Fabric {
	t.Helper()
	var tc *tls.Config
	if suitePKI != "" {
		var err error
		tc, err = conf.TLS{Cert: filepath.Join(suitePKI, identity+".crt"), Key: filepath.Join(suitePKI, identity+".key"),
			CA: filepath.Join(suitePKI, "ca.crt")}.Config()
		if err != nil {
			t.Fatal(err)
		}
	}
	return tcp.New(tcp.Options{TLS: tc, Network: nw})
}

// hostileSession dials an RNBD session of one path with one connection
// from src. Its heartbeats are slow, so that the server, not the
// client, notices what goes wrong.
func hostileSession(t *testing.T, sessname, src string, dst netip.AddrPort, identity string, nw tcp.Network) (*rnbd.CltSession, error) {
	t.Helper()
	cfg := rtrs.DefaultCltConfig()
	cfg.SessName = sessname
	cfg.Fabric = hostileFabric(t, identity, nw)
	cfg.ConnsPerPath = 1
	cfg.HBInterval = time.Hour
	cfg.MaxReconnectAttempts = 0
	cfg.Log = log.Discard()
	cfg.Paths = []rtrs.PathAddr{{Src: netip.AddrPortFrom(netip.MustParseAddr(src), 0), Dst: dst}}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := rnbd.DialSession(ctx, cfg, 0)
	if err != nil {
		return nil, err
	}
	s.SetSizePoll(0)
	t.Cleanup(func() { s.Close() })
	return s, nil
}

// stallNet dials TCP; once stalled, its connections' reads block until
// release is closed, as a peer that stops reading its socket.
type stallNet struct {
	stalled     atomic.Bool
	release     chan struct{}
	closedEarly atomic.Int32 // connections closed by the client while stalled
}

func (n *stallNet) Dial(ctx context.Context, src, dst netip.AddrPort) (net.Conn, error) {
	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(src)}
	c, err := d.DialContext(ctx, "tcp", dst.String())
	if err != nil {
		return nil, err
	}
	return &stallConn{Conn: c, n: n}, nil
}

func (n *stallNet) Listen(netip.AddrPort) (net.Listener, error) {
	return nil, errors.New("stallNet only dials")
}

type stallConn struct {
	net.Conn
	n *stallNet
}

func (c *stallConn) Close() error {
	select {
	case <-c.n.release:
	default:
		if c.n.stalled.Load() {
			c.n.closedEarly.Add(1)
		}
	}
	return c.Conn.Close()
}

func (c *stallConn) Read(b []byte) (int, error) {
	if c.n.stalled.Load() {
		<-c.n.release
		return 0, net.ErrClosed
	}
	return c.Conn.Read(b)
}

// vmRSS is a process's resident memory in KiB (0 if unknown).
func vmRSS(pid int) int64 { return procStatusKB(pid, "VmRSS:") }

// procStatusKB is a line of a process's /proc status in KiB (0 if
// unknown): "VmRSS:", "VmHWM:".
func procStatusKB(pid int, key string) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, key); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n
		}
	}
	return 0
}
