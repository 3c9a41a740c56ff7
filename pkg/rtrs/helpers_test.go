package rtrs

import (
	"context"
	"encoding/binary"
	"errors"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/fabrictest"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// memDisk is a server user that keeps a byte array: the first 8 bytes of
// the user header are the offset of the IO.
type memDisk struct {
	mu    sync.Mutex
	b     []byte
	async bool                          // answer from another goroutine
	hold  atomic.Pointer[chan struct{}] // if set, IO waits for it to be closed
	ios   atomic.Int64
	lend  *lender // if set, reads are answered with RespondFrom where they may be

	evMu sync.Mutex
	// +checklocks:evMu
	events []SrvLinkEvent
}

func newMemDisk(size int) *memDisk { return &memDisk{b: make([]byte, size)} }

func (d *memDisk) LinkEvent(sess *SrvSession, ev SrvLinkEvent) error {
	d.evMu.Lock()
	defer d.evMu.Unlock()
	d.events = append(d.events, ev)
	return nil
}

func (d *memDisk) linkEvents() []SrvLinkEvent {
	d.evMu.Lock()
	defer d.evMu.Unlock()
	return append([]SrvLinkEvent(nil), d.events...)
}

func (d *memDisk) HandleIO(op *SrvOp) error {
	if len(op.Usr()) < 8 {
		return syscall.EINVAL
	}
	off := binary.LittleEndian.Uint64(op.Usr())
	if off > uint64(len(d.b)) || uint64(len(op.Data())) > uint64(len(d.b))-off {
		return syscall.ERANGE
	}
	if h := d.hold.Load(); h != nil {
		go d.do(op, off, *h)
		return nil
	}
	if d.async {
		go d.do(op, off, nil)
		return nil
	}
	d.do(op, off, nil)
	return nil
}

func (d *memDisk) do(op *SrvOp, off uint64, hold chan struct{}) {
	if hold != nil {
		<-hold
	}
	d.mu.Lock()
	if d.lend != nil && op.CanRespondFrom() {
		src := append([]byte(nil), d.b[off:][:len(op.Data())]...)
		d.mu.Unlock()
		d.ios.Add(1)
		d.lend.respond(op, src)
		return
	}
	if op.Dir() == Write {
		copy(d.b[off:], op.Data())
	} else {
		copy(op.Data(), d.b[off:])
	}
	d.mu.Unlock()
	d.ios.Add(1)
	op.Respond(nil)
}

func (d *memDisk) bytes(off, n int) []byte {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]byte(nil), d.b[off:off+n]...)
}

func testServerConfig(fab fabric.Fabric, h SrvHandler, addrs ...netip.AddrPort) SrvConfig {
	cfg := DefaultSrvConfig()
	cfg.Fabric = fab
	cfg.Handler = h
	cfg.Listen = addrs
	cfg.QueueDepth = 64
	cfg.MaxChunkSize = 64 << 10
	cfg.Log = testLog()
	return cfg
}

func testClientConfig(fab fabric.Fabric, paths ...PathAddr) CltConfig {
	cfg := DefaultCltConfig()
	cfg.SessName = "testsess"
	cfg.Fabric = fab
	cfg.Paths = paths
	cfg.ConnsPerPath = 2
	cfg.ReconnectDelay = 50 * time.Millisecond
	cfg.ReconnectMaxDelay = 200 * time.Millisecond
	cfg.ReconnectJitter = 10 * time.Millisecond
	cfg.Log = testLog()
	return cfg
}

var verbose = false

func testLog() *log.Entry {
	if verbose {
		return log.L
	}
	return log.Discard()
}

func ap(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

func pa(src, dst string) PathAddr {
	p := PathAddr{Dst: ap(dst)}
	if src != "" {
		p.Src = netip.AddrPortFrom(netip.MustParseAddr(src), 0)
	}
	return p
}

// rig is a server and a client session on one fabric.
type rig struct {
	t    testing.TB
	disk *memDisk
	srv  *Server
	sess *CltSession
	buf  *Buffer // for write and read
	ibuf *Buffer // for inflight
}

func newRig(t testing.TB, fab fabric.Fabric, scfg SrvConfig, ccfg CltConfig) *rig {
	t.Helper()
	r := &rig{t: t, disk: scfg.Handler.(*memDisk)}
	var err error
	r.srv, err = NewServer(scfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.srv.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	r.sess, err = DialSession(ctx, ccfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.sess.Close() })
	if r.buf, err = r.sess.AllocBuffer(1 << 20); err != nil {
		t.Fatal(err)
	}
	if r.ibuf, err = r.sess.AllocBuffer(1 << 20); err != nil {
		t.Fatal(err)
	}
	return r
}

func offsetHdr(off uint64) []byte {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], off)
	return b[:]
}

// write writes data at off through the session.
func (r *rig) write(off uint64, data []byte) error {
	copy(r.buf.Bytes(), data)
	return r.sess.Do(context.Background(), IOCon, Write, offsetHdr(off), r.buf, 0, len(data))
}

// read reads n bytes at off through the session.
func (r *rig) read(off uint64, n int) ([]byte, error) {
	clear(r.buf.Bytes()[:n])
	if err := r.sess.Do(context.Background(), IOCon, Read, offsetHdr(off), r.buf, 0, n); err != nil {
		return nil, err
	}
	return append([]byte(nil), r.buf.Bytes()[:n]...), nil
}

// assertHealthy checks that nothing failed over or reconnected: a
// failover would hide a bug from a test that only compares data.
func (r *rig) assertHealthy() {
	r.t.Helper()
	for _, p := range r.sess.Paths() {
		c := p.Stats().Counters()
		if c.FailoverCount != 0 || c.ReconnectsSuccessful != 0 || c.ReconnectsFailed != 0 || c.Inflight != 0 {
			r.t.Fatalf("path %s: failover %d, reconnects %d/%d, inflight %d; want all 0",
				p.Name(), c.FailoverCount, c.ReconnectsSuccessful, c.ReconnectsFailed, c.Inflight)
		}
		if p.State() != CltPathConnected {
			r.t.Fatalf("path %s is %v", p.Name(), p.State())
		}
	}
}

func memNet() (*fabrictest.Network, *tcp.Fabric) {
	n := fabrictest.NewNetwork()
	return n, n.Fabric()
}

var errTest = errors.New("test")
