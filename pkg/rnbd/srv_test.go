package rnbd

import (
	"bytes"
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"

	"go.uber.org/goleak"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/fabrictest"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var srvAddr = netip.MustParseAddrPort("10.20.0.1:1234")

// srig is an RNBD server over RTRS on the in-memory fabric, serving files
// from a search directory and explicit exports.
type srig struct {
	t    *testing.T
	net  *fabrictest.Network
	fab  fabric.Fabric
	dir  string // dev_search_path
	srv  *Server
	rs   *rtrs.Server
	next atomic.Int32
}

func newSrig(t *testing.T, cfg SrvConfig) *srig {
	t.Helper()
	return newSrigWith(t, cfg, nil)
}

// newSrigWith is newSrig with wrap, if not nil, between RTRS and the
// RNBD server.
func newSrigWith(t *testing.T, cfg SrvConfig, wrap func(*Server) rtrs.SrvHandler) *srig {
	t.Helper()
	return newSrigOn(t, cfg, wrap, tcp.Options{})
}

// tapIO makes a test's wrapping server (newSrigWith) take the IO of every
// session: the RNBD session a link event makes would take it otherwise
// (rtrs.SrvSession.SetIOHandler). The wrapper hands on what it does not
// keep with Server.sessionIO.
type tapIO struct{ rtrs.SrvHandler }

func (t tapIO) LinkEvent(rs *rtrs.SrvSession, ev rtrs.SrvLinkEvent) error {
	err := t.SrvHandler.LinkEvent(rs, ev)
	if err == nil && ev == rtrs.SrvLinkConnected {
		rs.SetIOHandler(t.SrvHandler)
	}
	return err
}

// sessionIO is what the RNBD session of op's RTRS session does with op
// (SrvSession.HandleIO), or Server.HandleIO without one.
func (s *Server) sessionIO(op *rtrs.SrvOp) error {
	s.mu.Lock()
	x := s.sessions[op.Session()]
	s.mu.Unlock()
	if x == nil {
		return s.HandleIO(op)
	}
	return x.HandleIO(op)
}

// newSrigOn is newSrigWith on an in-memory fabric with opts (TLS), which
// the server and r.client use.
func newSrigOn(t *testing.T, cfg SrvConfig, wrap func(*Server) rtrs.SrvHandler, opts tcp.Options) *srig {
	t.Helper()
	r := &srig{t: t, net: fabrictest.NewNetwork()}
	r.fab = r.net.FabricWith(opts)
	if cfg.DevSearchPath == "" {
		r.dir = t.TempDir()
		cfg.DevSearchPath = r.dir
	} else {
		r.dir = cfg.DevSearchPath
	}
	if cfg.Log == nil {
		cfg.Log = log.Discard()
	}
	r.srv = NewServer(cfg)
	scfg := rtrs.DefaultSrvConfig()
	scfg.Fabric, scfg.Handler, scfg.Listen, scfg.Log = r.fab, r.srv, []netip.AddrPort{srvAddr}, log.Discard()
	if wrap != nil {
		scfg.Handler = tapIO{wrap(r.srv)}
	}
	scfg.QueueDepth, scfg.MaxChunkSize = 64, 128<<10
	var err error
	if r.rs, err = rtrs.NewServer(scfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		r.rs.Close()
		r.srv.Close()
	})
	return r
}

// file creates a sparse file of size in the search directory.
func (r *srig) file(name string, size int64) string {
	r.t.Helper()
	p := filepath.Join(r.dir, name)
	os.MkdirAll(filepath.Dir(p), 0o755)
	f, err := os.Create(p)
	if err != nil {
		r.t.Fatal(err)
	}
	f.Truncate(size)
	f.Close()
	return p
}

// vol maps the export "vol" of a fresh file "exp/x" of size bytes (also
// reachable through the search path) and returns the file's path.
func (r *srig) vol(size int64) string {
	r.t.Helper()
	p := r.file("exp/x", size)
	if err := r.srv.Map(Export{Name: "vol", Path: p}); err != nil {
		r.t.Fatal(err)
	}
	return p
}

// client dials an RNBD client session named sess to the rig's server.
func (r *srig) client(sess string) *CltSession {
	r.t.Helper()
	return r.clientOn(r.fab, sess)
}

// clientOn is client on the fabric fab (of the rig's network).
func (r *srig) clientOn(fab fabric.Fabric, sess string) *CltSession {
	r.t.Helper()
	cfg := rtrs.DefaultCltConfig()
	cfg.SessName, cfg.Fabric, cfg.Log = sess, fab, log.Discard()
	cfg.ConnsPerPath = 2
	src := netip.AddrFrom4([4]byte{10, 20, 1, byte(r.next.Add(1))})
	cfg.Paths = []rtrs.PathAddr{{Src: netip.AddrPortFrom(src, 0), Dst: srvAddr}}
	s, err := DialSession(context.Background(), cfg, 0)
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { s.Close() })
	return s
}

// dio sends one IO of a device as the message it is, through a buffer of
// its own: what the server does with it, without the client's checks.
type dio struct {
	t   *testing.T
	d   *CltDev
	buf *rtrs.Buffer
}

func (r *srig) dev(c *CltSession, name string, mode AccessMode) *dio {
	r.t.Helper()
	d, err := c.Map(context.Background(), name, mode)
	if err != nil {
		r.t.Fatalf("open %s %v: %v", name, mode, err)
	}
	buf, err := c.Session().AllocBuffer(1 << 20)
	if err != nil {
		r.t.Fatal(err)
	}
	return &dio{t: r.t, d: d, buf: buf}
}

// do sends op as one RNBD_MSG_IO (rnbd_client_xfer_request): reads and
// writes carry buf[:n], the other operations no data.
func (x *dio) do(op Op, flags uint32, off int64, n int) error {
	var usr [IOSize]byte
	(&IO{DeviceID: x.d.Info().DeviceID, Sector: uint64(off) / 512, RW: uint32(op) | flags, Size: uint32(n)}).Encode(usr[:])
	s := x.d.Session().Session()
	switch op {
	case OpRead:
		return s.Do(context.Background(), rtrs.IOCon, rtrs.Read, usr[:], x.buf, 0, n)
	case OpWrite:
		return s.Do(context.Background(), rtrs.IOCon, rtrs.Write, usr[:], x.buf, 0, n)
	}
	return s.Do(context.Background(), rtrs.IOCon, rtrs.Write, usr[:], nil, 0, 0)
}

func (x *dio) write(off int64, data []byte, flags uint32) error {
	copy(x.buf.Bytes(), data)
	return x.do(OpWrite, flags, off, len(data))
}

func (x *dio) read(off int64, n int) ([]byte, error) {
	if err := x.do(OpRead, 0, off, n); err != nil {
		return nil, err
	}
	return append([]byte(nil), x.buf.Bytes()[:n]...), nil
}

// readAll reads n bytes at off in pieces the transport carries.
func (x *dio) readAll(off int64, n int) []byte {
	x.t.Helper()
	var out []byte
	for n > 0 {
		c := min(n, 64<<10)
		b, err := x.read(off, c)
		if err != nil {
			x.t.Fatalf("read %d at %d: %v", c, off, err)
		}
		out = append(out, b...)
		off += int64(c)
		n -= c
	}
	return out
}

func (x *dio) op(op Op, flags uint32, off int64, n int) error {
	return x.do(op, flags, off, n)
}

func TestOpenIOClose(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	path := r.file("vol1", 4<<20)
	c := r.client("client1")
	if c.Version() != ProtoVerMajor {
		t.Fatalf("version %d", c.Version())
	}
	x := r.dev(c, "vol1", AccessRW)
	info := x.d.Info()
	if info.NSectors != 4<<20/512 || info.LogicalBlockSize != 512 || info.PhysicalBlockSize != 4096 ||
		info.CachePolicy != CacheWriteback|CacheFUA || info.MaxDiscardSectors == 0 || info.MaxWriteZeroesSectors == 0 ||
		info.MaxHWSectors != (128<<10-4096)/512 {
		t.Fatalf("open_rsp %+v", info)
	}
	data := bytes.Repeat([]byte("rnbd"), 16384)
	if err := x.write(4096, data, 0); err != nil {
		t.Fatal(err)
	}
	got, err := x.read(4096, len(data))
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back: %v", err)
	}
	onDisk, _ := os.ReadFile(path)
	if !bytes.Equal(onDisk[4096:4096+len(data)], data) {
		t.Fatal("the file does not hold what was written")
	}
	// Opening the same name again returns the same device; mapping it
	// twice through one session is refused on the client.
	again, err := c.open(context.Background(), "vol1", AccessRW)
	if err != nil || again.DeviceID != info.DeviceID {
		t.Fatalf("second open: %v, id %d want %d", err, again.DeviceID, info.DeviceID)
	}
	if _, err := c.Map(context.Background(), "vol1", AccessRW); !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("second map: %v, want EEXIST", err)
	}
	if err := x.d.Unmap(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := x.op(OpFlush, 0, 0, 0); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("IO after close: %v, want ENOTCONN", err)
	}
	if n := len(r.srv.OpenDevices()); n != 0 {
		t.Fatalf("%d devices open after close", n)
	}
}
