// Tests of peers that claim to be someone else: another TLS certificate,
// none, a session name given to another client, a path's UUIDs from
// another address.

package rtrs

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
	"github.com/rnbd/rnbd/test/kit"
	"github.com/rnbd/rnbd/test/testca"
)

// On TCP with TLS a session belongs to the certificate that made it: a
// connection of another certificate cannot join it by its UUID (EACCES),
// while the session itself, inside TLS, serves as before.
func TestSessionPeerOverTLS(t *testing.T) {
	ca := testca.New(t, "test ca")
	h := newHostileRigWith(t, true, newMemDisk(4<<20), tcp.Options{TLS: ca.Config(ca.Issue(t, "good", "127.0.0.1"))})
	h.stillServes() // IO inside TLS
	sess := h.srv.Sessions()
	if len(sess) != 1 || sess[0].Identity() != "good" || !slices.Equal(sess[0].PeerNames(), []string{"good"}) {
		t.Fatalf("the session's peer is %q, want its certificate's name", sess[0].PeerNames())
	}
	join := func(cert tls.Certificate) error {
		fab := tcp.New(tcp.Options{TLS: ca.Config(cert)})
		dev, _ := fab.Resolve(context.Background(), h.src, h.dst)
		pd, _ := dev.AllocPD()
		req := rawConnReq(0, 2)
		req.PathsUUID, req.FirstConn = sess[0].UUID(), false
		c, _, err := dialRaw(fab, pd, dev, h.src, h.dst, req.Encode(make([]byte, ConnReqSize)))
		if err == nil {
			c.qp.Close()
		}
		return err
	}
	if err := join(ca.Issue(t, "mallory")); rejectErrno(err) != syscall.EACCES {
		t.Fatalf("another certificate joining the session: %v, want a reject with EACCES", err)
	}
	if len(sess[0].Paths()) != 1 {
		t.Fatalf("the session has %d paths", len(sess[0].Paths()))
	}
	// The session's own certificate may add a path (that this raw one
	// then abandons).
	if err := join(ca.Issue(t, "good")); err != nil {
		t.Fatalf("the session's certificate adding a path: %v", err)
	}
	// The server drops the abandoned path by itself; until then another
	// path from the same addresses is refused with EEXIST, as the
	// kernel's server refuses it.
	kit.WaitFor(t, 10*time.Second, "the abandoned path dropped", func() bool { return len(sess[0].Paths()) == 1 })
	// A renewed certificate of the same identity, with other alternative
	// names, too.
	if err := join(ca.Issue(t, "good", "good.example")); err != nil {
		t.Fatalf("a renewed certificate of the session's identity adding a path: %v", err)
	}
	h.stillServes()
}

// A TLS client certificate that names no identity never reaches the
// server's sessions (it would be counted by its address and could open
// exports that name no identities): it is refused in the handshake with
// EACCES, not with an RTRS reject, and counted with the server's own
// refusals (Rejected, rnbd_server_refused_connections_total).
func TestNamelessCertificateRefused(t *testing.T) {
	ca := testca.New(t, "test ca")
	h := newHostileRigWith(t, true, newMemDisk(4<<20), tcp.Options{TLS: ca.Config(ca.Issue(t, "good", "127.0.0.1"))})
	before := h.srv.Rejected()[syscall.EACCES]
	fab := tcp.New(tcp.Options{TLS: ca.Config(ca.Issue(t, ""))})
	dev, _ := fab.Resolve(context.Background(), h.src, h.dst)
	pd, _ := dev.AllocPD()
	req := rawConnReq(0, 2)
	_, _, err := dialRaw(fab, pd, dev, h.src, h.dst, req.Encode(make([]byte, ConnReqSize)))
	if !errors.Is(err, syscall.EACCES) || rejectErrno(err) != 0 {
		t.Fatalf("a nameless certificate: %v, want EACCES from the handshake", err)
	}
	// The server counts it once its side of the handshake is over.
	kit.WaitFor(t, 10*time.Second, "the refusal counted", func() bool { return h.srv.Rejected()[syscall.EACCES] == before+1 })
	if n := len(h.srv.Sessions()); n != 1 {
		t.Fatalf("%d sessions", n)
	}
	h.stillServes()
}

// namingDisk is a memDisk whose server asks it for every session name.
type namingDisk struct {
	*memDisk
	refuse atomic.Bool
	claims atomic.Int32
}

func (d *namingDisk) ClaimSessionName(name, identity string) error {
	d.claims.Add(1)
	if d.refuse.Load() {
		return fmt.Errorf("name %q taken from %q: %w", name, identity, syscall.EACCES)
	}
	return nil
}

// TestNameClaimedPerPath: a name is claimed by every path, not only the
// session's first: when the operator gives the name to another client
// while a session holds it, a path that would join the old session is
// refused too, and counted among the server's refusals (Rejected).
func TestNameClaimedPerPath(t *testing.T) {
	fab := tcp.New(tcp.Options{})
	a := loopbackListener(t)
	// Another address: a path between the addresses of one it has
	// already is refused with EEXIST.
	b := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.2"), a.Port())
	d := &namingDisk{memDisk: newMemDisk(1 << 20)}
	srv, err := NewServer(testServerConfig(fab, d, a, b))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	sess, err := DialSession(ctx, testClientConfig(fab, PathAddr{Dst: a}))
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	if n := d.claims.Load(); n != 1 {
		t.Fatalf("%d claims for the first path, want 1", n)
	}
	d.refuse.Store(true)
	if _, err := sess.AddPath(ctx, PathAddr{Dst: b}); err == nil {
		t.Fatal("a second path joined the session after its name was taken away")
	} else if !errors.Is(err, errInfoUnanswered) {
		t.Fatalf("second path: %v, want the INFO_REQ unanswered", err)
	}
	if n := d.claims.Load(); n < 2 {
		t.Fatalf("%d claims, want one per path", n)
	}
	// The refusal is counted with the server's refusals, by the
	// claimer's errno.
	kit.WaitFor(t, 10*time.Second, "the name's refusal counted", func() bool { return srv.Rejected()[syscall.EACCES] >= 1 })
}

// gatedNaming holds the first claim of a name until released.
type gatedNaming struct {
	*memDisk
	claiming chan struct{} // closed when the claim began
	release  chan struct{}
	once     sync.Once
}

func (d *gatedNaming) ClaimSessionName(name, identity string) error {
	d.once.Do(func() {
		close(d.claiming)
		<-d.release
	})
	return nil
}

// TestNameHeldWaitsForClaims: NameHeld answers once the naming under way
// is done, so a session that took a name just before is seen (the
// operator's forget relies on it), not missed because it was not named
// yet.
func TestNameHeldWaitsForClaims(t *testing.T) {
	fab := tcp.New(tcp.Options{})
	a := loopbackListener(t)
	d := &gatedNaming{memDisk: newMemDisk(1 << 20), claiming: make(chan struct{}), release: make(chan struct{})}
	srv, err := NewServer(testServerConfig(fab, d, a))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	opened := make(chan error, 1)
	var sess *CltSession
	go func() {
		var err error
		sess, err = DialSession(ctx, testClientConfig(fab, PathAddr{Dst: a}))
		opened <- err
	}()
	<-d.claiming
	held := make(chan bool, 1)
	go func() { held <- srv.NameHeld("testsess") }()
	// NameHeld would answer now if it did not wait for the claim.
	kit.WaitBlocked(t, 10*time.Second, "rtrs.(*Server).NameHeld", "sync.Mutex.Lock")
	close(d.release)
	if !<-held {
		t.Fatal("NameHeld missed the session whose path was taking the name")
	}
	if err := <-opened; err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	if srv.NameHeld("other") {
		t.Fatal("NameHeld of a name no session has")
	}
}

// Without authentication a reconnect (another recon_cnt) replaces a
// path only when it comes from the path's own client address: a peer
// that learnt the UUIDs (they travel in clear) from elsewhere is refused
// with EBUSY and the path stays (issue 30 D). From the path's address
// the reconnect still supersedes it at once.
func TestReconnectFromAnotherAddress(t *testing.T) {
	h := newHostileRig(t, true)
	x := h.srv.Sessions()[0]
	p := x.Paths()[0]
	reconnect := func(src netip.AddrPort) error {
		dev, _ := h.fab.Resolve(context.Background(), src, h.dst)
		pd, _ := dev.AllocPD()
		req := ConnReq{Magic: Magic, Version: ProtoVer, CIDNum: uint16(len(p.conns)), ReconCnt: p.reconCnt + 1,
			SessUUID: p.uuid, PathsUUID: x.UUID()}
		c, _, err := dialRaw(h.fab, pd, dev, src, h.dst, req.Encode(make([]byte, ConnReqSize)))
		if err == nil {
			c.qp.Close()
		}
		return err
	}
	for i := 0; i < 5; i++ {
		if err := reconnect(h.src); rejectErrno(err) != syscall.EBUSY {
			t.Fatalf("a reconnect of the path from another address: %v, want a reject with EBUSY", err)
		}
	}
	if st := p.State(); st != SrvPathConnected {
		t.Fatalf("the path is %v after reconnects from another address, want it left CONNECTED", st)
	}
	h.stillServes()
	// From the path's own address it is the client's reconnect: the
	// old path goes at once (and this raw attempt is refused EBUSY to
	// come back, as the kernel's server does).
	if err := reconnect(netip.AddrPortFrom(p.ClientAddr().Addr(), 0)); rejectErrno(err) != syscall.EBUSY {
		t.Fatalf("a reconnect from the path's address: %v, want EBUSY", err)
	}
	select {
	case <-p.closed:
	case <-time.After(10 * time.Second):
		t.Fatal("a reconnect from the path's own address did not supersede it")
	}
}
