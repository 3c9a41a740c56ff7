package rnbd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rnbd/rnbd/internal/log"
	"github.com/rnbd/rnbd/internal/testca"
	"github.com/rnbd/rnbd/internal/testfs"
	"github.com/rnbd/rnbd/pkg/blockdev"
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

func newSrig(t *testing.T, cfg ServerConfig) *srig {
	t.Helper()
	return newSrigWith(t, cfg, nil)
}

// newSrigWith is newSrig with wrap, if not nil, between RTRS and the
// RNBD server.
func newSrigWith(t *testing.T, cfg ServerConfig, wrap func(*Server) rtrs.ServerHandler) *srig {
	t.Helper()
	return newSrigOn(t, cfg, wrap, tcp.Options{})
}

// newSrigOn is newSrigWith on an in-memory fabric with opts (TLS), which
// the server and r.client use.
func newSrigOn(t *testing.T, cfg ServerConfig, wrap func(*Server) rtrs.ServerHandler, opts tcp.Options) *srig {
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
	scfg := rtrs.DefaultServerConfig()
	scfg.Fabric, scfg.Handler, scfg.Listen, scfg.Log = r.fab, r.srv, []netip.AddrPort{srvAddr}, log.Discard()
	if wrap != nil {
		scfg.Handler = wrap(r.srv)
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
	cfg := rtrs.DefaultClientConfig()
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
	r := newSrig(t, ServerConfig{})
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

func TestSessInfoVersion(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	c := r.client("v")
	for _, c2 := range []struct{ ask, want uint8 }{{1, 1}, {2, 2}, {9, 2}} {
		var usr [SessInfoSize]byte
		(&SessInfo{Ver: c2.ask}).Encode(usr[:], MsgSessInfo)
		if err := c.sess.Do(context.Background(), rtrs.AdminCon, rtrs.Read, usr[:], c.admin, 0, SessInfoRspSize); err != nil {
			t.Fatal(err)
		}
		var rsp SessInfo
		if err := rsp.Decode(c.admin.Bytes()[:SessInfoRspSize], MsgSessInfoRsp); err != nil || rsp.Ver != c2.want {
			t.Fatalf("asked %d: got %d %v, want %d", c2.ask, rsp.Ver, err, c2.want)
		}
	}
}

func TestAccessModes(t *testing.T) {
	r := newSrig(t, ServerConfig{AllowMigration: true})
	r.file("shared", 1<<20)
	a, b, c := r.client("a"), r.client("b"), r.client("c")
	open := func(cl *CltSession, mode AccessMode) error {
		_, err := cl.open(context.Background(), "shared", mode)
		return err
	}
	if err := open(a, AccessRW); err != nil {
		t.Fatal(err)
	}
	if err := open(b, AccessRW); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("second writer: %v, want EPERM", err)
	}
	if err := open(b, AccessRO); err != nil {
		t.Fatalf("reader beside a writer: %v", err)
	}
	if err := open(c, AccessMigration); err != nil {
		t.Fatalf("migration beside one writer: %v", err)
	}
	d := r.client("d")
	if err := open(d, AccessMigration); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("third writer: %v, want EPERM", err)
	}
	if err := open(d, AccessRO); err != nil {
		t.Fatal(err)
	}
	// A read-only open refuses writes.
	ro := r.dev(d, "shared", AccessRO)
	if err := ro.write(0, make([]byte, 512), 0); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("write on a read-only open: %v", err)
	}
	// Access mode 3 does not exist.
	if _, err := d.open(context.Background(), "other", 3); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("access mode 3: %v", err)
	}
	// When the writer's session goes away its devices close and the
	// device takes a writer again.
	a.Session().Close()
	waitFor(t, "a's device to close", func() bool { return len(r.srv.OpenDevices()) == 3 })
	if err := open(d, AccessRW); !errors.Is(err, syscall.EPERM) {
		// d has "shared" open read-only already: same name, same device.
		if err != nil {
			t.Fatalf("d reopening: %v", err)
		}
	}
	e := r.client("e")
	if err := open(e, AccessMigration); err != nil {
		t.Fatalf("second migration writer after a's exit: %v", err)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestPathTraversal(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "exports")
	os.MkdirAll(dir, 0o755)
	os.WriteFile(filepath.Join(root, "secret"), make([]byte, 4096), 0o600)
	r := newSrig(t, ServerConfig{DevSearchPath: dir})
	os.Symlink(filepath.Join(root, "secret"), filepath.Join(dir, "link-out"))
	os.Symlink("../secret", filepath.Join(dir, "rel-out"))
	r.file("ok", 1<<20)
	c := r.client("t")
	for name, want := range map[string]syscall.Errno{
		"../secret":               syscall.EINVAL,
		"a/../../secret":          syscall.EINVAL,
		"..":                      syscall.EINVAL,
		"/etc/passwd":             syscall.ENOENT, // resolved beneath the search path, as the kernel does
		"link-out":                syscall.EINVAL,
		"rel-out":                 syscall.EINVAL,
		"missing":                 syscall.ENOENT,
		string(make([]byte, 254)): syscall.EINVAL,
	} {
		_, err := c.open(context.Background(), name, AccessRO)
		if !errors.Is(err, want) {
			t.Errorf("open %q: %v, want %v", name, err, want)
		}
	}
	if _, err := c.open(context.Background(), "ok", AccessRO); err != nil {
		t.Fatal(err)
	}
	if _, err := c.open(context.Background(), "/ok", AccessRO); err != nil {
		t.Fatalf("/ok: %v", err)
	}
}

func TestSessnameSearchPath(t *testing.T) {
	root := t.TempDir()
	r := newSrig(t, ServerConfig{DevSearchPath: filepath.Join(root, "%SESSNAME%", "ignored")})
	os.MkdirAll(filepath.Join(root, "alice"), 0o755)
	os.MkdirAll(filepath.Join(root, "bob"), 0o755)
	os.WriteFile(filepath.Join(root, "alice", "disk"), make([]byte, 1<<20), 0o600)
	os.WriteFile(filepath.Join(root, "bob", "disk"), make([]byte, 2<<20), 0o600)
	a := r.dev(r.client("alice"), "disk", AccessRW)
	b := r.dev(r.client("bob"), "disk", AccessRW)
	if a.d.Size() != 1<<20 || b.d.Size() != 2<<20 {
		t.Fatalf("each session sees its own directory: %d %d", a.d.Size(), b.d.Size())
	}
	// Nobody reaches another session's directory.
	if _, err := r.client("carol").open(context.Background(), "../alice/disk", AccessRO); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("carol into alice's directory: %v", err)
	}
	// Session names that would move the directory never get here: RTRS
	// refuses '/' and '.', and the resolver checks again.
	for _, bad := range []string{"..", "a/b", ".", ""} {
		if _, err := r.srv.searchDir(bad, "disk"); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("session %q: %v", bad, err)
		}
	}
}

// TestMapRefusesUnservable: a directory (EISDIR), a FIFO, a socket or a
// character device (EINVAL) is refused at Map, saying what it is; a
// symbolic link is judged by what it leads to.
func TestMapRefusesUnservable(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	dir := t.TempDir()
	fifo, sock, link := filepath.Join(dir, "fifo"), filepath.Join(dir, "sock"), filepath.Join(dir, "link")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		path, is string
		errno    syscall.Errno
	}{
		{dir, "a directory", syscall.EISDIR},
		{link, "a directory", syscall.EISDIR},
		{fifo, "a FIFO", syscall.EINVAL},
		{sock, "a socket", syscall.EINVAL},
		{"/dev/null", "a character device", syscall.EINVAL},
	} {
		err := r.srv.Map(Export{Name: "bad", Path: c.path})
		if want := "export bad: " + c.path + " is " + c.is + ": an export is a regular file or a block device"; !errors.Is(err, c.errno) || fmt.Sprint(err) != want {
			t.Errorf("map of %s: %v, want %q (%v)", c.path, err, want, c.errno)
		}
	}
	if es := r.srv.Exports(); len(es) != 0 {
		t.Fatalf("exports after the refusals: %v", es)
	}
	if err := r.srv.Map(Export{Name: "vol", Path: r.file("vol", 1<<20)}); err != nil {
		t.Fatalf("a regular file: %v", err)
	}
}

func TestExports(t *testing.T) {
	r := newSrig(t, ServerConfig{DevSearchPath: ""})
	r.srv.cfg.DevSearchPath = "" // explicit exports only
	other := t.TempDir()
	p := filepath.Join(other, "img")
	os.WriteFile(p, make([]byte, 1<<20), 0o600)
	if err := r.srv.Map(Export{Name: "vol", Path: p, Allow: []string{"ok"}}); err != nil {
		t.Fatal(err)
	}
	if err := r.srv.Map(Export{Name: "vol", Path: p}); !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("second map: %v", err)
	}
	if err := r.srv.Map(Export{Name: "ro", Path: p, ReadOnly: true}); err != nil {
		t.Fatal(err)
	}
	if err := r.srv.Map(Export{Name: "x", Path: "relative"}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("relative path: %v", err)
	}
	if err := r.srv.Map(Export{Name: "y", Path: "/nonexistent/img"}); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("missing path: %v", err)
	}
	ok, nope := r.client("ok"), r.client("nope")
	x := r.dev(ok, "vol", AccessRW)
	if _, err := nope.open(context.Background(), "vol", AccessRO); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("session not in the allow list: %v", err)
	}
	if _, err := nope.open(context.Background(), "ro", AccessRW); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("rw open of a read-only export: %v", err)
	}
	if _, err := nope.open(context.Background(), "ro", AccessRO); err != nil {
		t.Fatal(err)
	}
	if _, err := nope.open(context.Background(), "unknown", AccessRO); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("unknown export without a search path: %v", err)
	}
	// Two names of one file share the writer count.
	if _, err := ok.open(context.Background(), "ro", AccessRO); err != nil {
		t.Fatal(err)
	}
	if err := r.srv.Unmap("vol", false); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("unmap of an open export: %v", err)
	}
	if err := x.write(0, bytes.Repeat([]byte("still works!"), 128), 0); err != nil {
		t.Fatalf("IO after a refused unmap: %v", err)
	}
	if err := r.srv.Unmap("vol", true); err != nil {
		t.Fatal(err)
	}
	if err := x.write(0, make([]byte, 512), 0); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("IO after a forced unmap: %v, want ENOTCONN", err)
	}
	if _, err := ok.open(context.Background(), "vol", AccessRW); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("open after unmap: %v", err)
	}
	if err := r.srv.Unmap("vol", false); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("second unmap: %v", err)
	}
	if got := r.srv.Exports(); len(got) != 1 || got[0].Name != "ro" {
		t.Fatalf("exports %+v", got)
	}
}

func TestForceClose(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	r.file("a", 1<<20)
	r.file("b", 1<<20)
	c := r.client("fc")
	x := r.dev(c, "a", AccessRW)
	if err := x.write(0, []byte("x"), 0); err == nil {
		// 1 byte is not a multiple of the block: refused.
		t.Fatal("unaligned write accepted")
	}
	if n, err := r.srv.ForceClose("a", "fc"); n != 1 || err != nil {
		t.Fatalf("force close: %d %v", n, err)
	}
	if err := x.write(0, make([]byte, 512), 0); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("IO after force close: %v, want ENOTCONN", err)
	}
	// The id stays reserved: another device does not get it.
	y := r.dev(c, "b", AccessRW)
	if y.d.Info().DeviceID == x.d.Info().DeviceID {
		t.Fatal("a force-closed device's id was reused")
	}
	if _, err := r.srv.ForceClose("a", "fc"); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("second force close: %v", err)
	}
	// The writer count was released: "a" opens for writing again.
	if _, err := r.client("other").open(context.Background(), "a", AccessRW); err != nil {
		t.Fatalf("rw open after force close: %v", err)
	}
}

// TestCloseWaitsForIO: CLOSE returns only after the device's IO in flight
// has answered, and that IO succeeds.
func TestCloseWaitsForIO(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	r.file("slow", 1<<20)
	hold := make(chan struct{})
	var held atomic.Int32
	r.srv.beforeIO = func() {
		held.Add(1)
		<-hold
	}
	c := r.client("w")
	x := r.dev(c, "slow", AccessRW)
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = x.op(OpFlush, 0, 0, 0)
		}()
	}
	waitFor(t, "IO at the server", func() bool { return held.Load() == 4 })
	closed := make(chan error, 1)
	go func() { closed <- x.d.Unmap(context.Background()) }()
	select {
	case err := <-closed:
		t.Fatalf("close returned with IO in flight: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(hold)
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("IO %d in flight across close: %v", i, err)
		}
	}
}

// TestIOSemantics checks flush, FUA, preflush, discard and write-zeroes
// against the file: holes, allocation and data.
func TestIOSemantics(t *testing.T) {
	for _, dir := range []string{os.TempDir(), "/dev/shm"} {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			sp, _ := os.MkdirTemp(dir, "rnbd-sem-")
			defer os.RemoveAll(sp)
			r := newSrig(t, ServerConfig{DevSearchPath: sp})
			path := r.file("f", 8<<20)
			x := r.dev(r.client("sem"), "f", AccessRW)
			data := bytes.Repeat([]byte{0x5a}, 64<<10)
			for _, flags := range []uint32{0, FFUA, FPreflush, FPreflush | FFUA, FSync} {
				if err := x.write(1<<20, data[:64<<10], flags); err != nil {
					t.Fatalf("write with flags %#x: %v", flags, err)
				}
			}
			for off := int64(2 << 20); off < 2<<20+256<<10; off += 64 << 10 {
				if err := x.write(off, data, FFUA); err != nil {
					t.Fatal(err)
				}
			}
			if err := x.op(OpFlush, 0, 0, 0); err != nil {
				t.Fatal(err)
			}
			// Discard: a hole that reads as zeros.
			if err := x.op(OpDiscard, 0, 2<<20, 64<<10); err != nil {
				t.Fatal(err)
			}
			if !testfs.IsHole(t, path, 2<<20) {
				t.Fatal("discard did not punch a hole")
			}
			got := x.readAll(2<<20, 128<<10)
			if !bytes.Equal(got[:64<<10], make([]byte, 64<<10)) || !bytes.Equal(got[64<<10:], data) {
				t.Fatal("discard changed the wrong bytes")
			}
			// Write zeroes with NOUNMAP keeps the blocks.
			before := testfs.Allocated(t, path)
			if err := x.op(OpWriteZeroes, FNoUnmap, 2<<20+64<<10, 64<<10); err != nil {
				t.Fatal(err)
			}
			if after := testfs.Allocated(t, path); after < before-8<<10 {
				t.Fatalf("write zeroes with NOUNMAP freed blocks: %d -> %d", before, after)
			}
			// Without it, the blocks may go, and here do.
			before = testfs.Allocated(t, path)
			if err := x.op(OpWriteZeroes, 0, 2<<20+128<<10, 64<<10); err != nil {
				t.Fatal(err)
			}
			if after := testfs.Allocated(t, path); after > before-48<<10 { // ext4 counts extent metadata blocks too
				t.Fatalf("write zeroes that may unmap: %d -> %d bytes allocated", before, after)
			}
			got = x.readAll(2<<20, 256<<10)
			if !bytes.Equal(got[:192<<10], make([]byte, 192<<10)) || !bytes.Equal(got[192<<10:], data) {
				t.Fatal("zeroed ranges read wrong")
			}
			if err := x.op(OpSecureErase, 0, 0, 4096); !errors.Is(err, syscall.EOPNOTSUPP) {
				t.Fatalf("secure erase of a file: %v", err)
			}
			// What reached the backend is counted: two preflushes and
			// the flush, six FUA writes, a discard, two write-zeroes.
			o := r.srv.OpenDevices()
			if len(o) != 1 || o[0].Flushes != 3 || o[0].FUAWrites != 6 || o[0].Discards != 1 || o[0].WriteZeroes != 2 {
				t.Fatalf("counters %+v", o)
			}
		})
	}
}

// TestWriteThroughExport: an export made write-through announces no write
// cache (so a kernel client never flushes it) and its writes, FUA or not,
// go through the O_DSYNC descriptor; flushes are still served.
func TestWriteThroughExport(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	p := r.file("wt.img", 1<<20)
	for _, e := range []Export{{Name: "wt", Path: p, WriteThrough: true}, {Name: "wb", Path: p}} {
		if err := r.srv.Map(e); err != nil {
			t.Fatal(err)
		}
	}
	c := r.client("wt")
	wt, wb := r.dev(c, "wt", AccessRO), r.dev(r.client("wb"), "wb", AccessRW)
	if cp := wb.d.Info().CachePolicy; cp != CacheWriteback|CacheFUA {
		t.Fatalf("default export: cache_policy %#x", cp)
	}
	// Read-only opens keep the export's policy too: what matters to a
	// client is whether the device it reads may lose writes.
	if cp := wt.d.Info().CachePolicy; cp != 0 {
		t.Fatalf("write-through export: cache_policy %#x, want 0", cp)
	}
	wb.d.Unmap(context.Background())
	rw := r.dev(r.client("wt-rw"), "wt", AccessRW)
	if cp := rw.d.Info().CachePolicy; cp != 0 {
		t.Fatalf("write-through export opened rw: cache_policy %#x, want 0", cp)
	}
	data := bytes.Repeat([]byte("through!"), 512)
	if err := rw.write(0, data, 0); err != nil {
		t.Fatal(err)
	}
	if err := rw.op(OpFlush, 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	if onDisk, _ := os.ReadFile(p); !bytes.Equal(onDisk[:len(data)], data) {
		t.Fatal("the write did not land")
	}
	for _, o := range r.srv.OpenDevices() {
		if o.Name == "wt" && o.WriteCache {
			t.Fatalf("%+v reports a write cache", o)
		}
	}
}

// TestKernelClientMessages replays what the kernel's rnbd-clt sends
// (testdata/golden/kclt*.hex, from its source) byte for byte, in the RTRS
// direction it sends them, and checks what reaches the file. The kernel
// sends its flushes at sector (u64)-1 as RTRS reads without data; a server
// that refused them left a kernel client without fsync.
func TestKernelClientMessages(t *testing.T) {
	rec, logged := log.Recorder()
	r := newSrig(t, ServerConfig{Log: rec})
	path := r.file("kdisk", 1<<20)
	c := r.client("kclt")
	x := r.dev(c, "kdisk", AccessRW)
	if id := x.d.Info().DeviceID; id != 1 {
		t.Fatalf("device id %d: the golden messages name device 1", id)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s, buf := c.Session(), x.buf
	send := func(usr []byte, dir rtrs.Dir, n int) error {
		return s.Do(context.Background(), rtrs.IOCon, dir, usr, buf, 0, n)
	}
	counters := func() SessDevInfo {
		t.Helper()
		o := r.srv.OpenDevices()
		if len(o) != 1 {
			t.Fatalf("%d devices open", len(o))
		}
		return o[0]
	}
	fill := func(off int64, n int, b byte) []byte {
		t.Helper()
		d := bytes.Repeat([]byte{b}, n)
		if _, err := f.WriteAt(d, off); err != nil {
			t.Fatal(err)
		}
		return d
	}
	fileAt := func(off int64, n int) []byte {
		t.Helper()
		b := make([]byte, n)
		if _, err := f.ReadAt(b, off); err != nil {
			t.Fatal(err)
		}
		return b
	}

	want := fill(16*512, 4096, 0x3c)
	if err := send(golden(t, "kclt_read"), rtrs.Read, 4096); err != nil || !bytes.Equal(buf.Bytes()[:4096], want) {
		t.Fatalf("read: %v", err)
	}
	want = bytes.Repeat([]byte("journal!"), 512)
	copy(buf.Bytes(), want)
	if err := send(golden(t, "kclt_write_fua"), rtrs.Write, 4096); err != nil || !bytes.Equal(fileAt(24*512, 4096), want) {
		t.Fatalf("FUA write: %v", err)
	}
	flushes := []struct {
		name string
		dir  rtrs.Dir
	}{
		{"kclt_flush", rtrs.Read},
		{"kclt21_flush", rtrs.Read},
		{"kclt21_write_preflush_empty", rtrs.Write},
		{"kclt_write_preflush_empty", rtrs.Write},
	}
	for _, fl := range flushes {
		if err := send(golden(t, fl.name), fl.dir, 0); err != nil {
			t.Fatalf("%s: %v", fl.name, err)
		}
	}
	if c := counters(); c.Flushes != uint64(len(flushes)) || c.FUAWrites != 1 {
		t.Fatalf("after the flushes: %d flushes, %d FUA writes; want %d and 1", c.Flushes, c.FUAWrites, len(flushes))
	}
	const end = 1<<20 - 64<<10
	zeros := make([]byte, 64<<10)
	fill(end-64<<10, 128<<10, 0xee)
	if err := send(golden(t, "kclt_discard_end"), rtrs.Write, 0); err != nil {
		t.Fatalf("discard: %v", err)
	}
	if !bytes.Equal(fileAt(end, 64<<10), zeros) || !testfs.IsHole(t, path, end) || fileAt(end-1, 1)[0] != 0xee {
		t.Fatal("the discard did not punch exactly the last 64 KiB")
	}
	fill(end, 64<<10, 0xee)
	if err := send(golden(t, "kclt_write_zeroes_end"), rtrs.Write, 0); err != nil || !bytes.Equal(fileAt(end, 64<<10), zeros) {
		t.Fatalf("write zeroes: %v", err)
	}
	fill(end, 64<<10, 0xee)
	if err := send(golden(t, "kclt22_write_zeroes_nounmap"), rtrs.Write, 0); err != nil || !bytes.Equal(fileAt(end, 64<<10), zeros) {
		t.Fatalf("write zeroes with NOUNMAP: %v", err)
	}
	if testfs.IsHole(t, path, end) {
		t.Fatal("write zeroes with NOUNMAP deallocated")
	}
	if c := counters(); c.Discards != 1 || c.WriteZeroes != 2 {
		t.Fatalf("counters %+v", c)
	}
	for _, e := range logged() {
		if e.Level <= log.WarnLevel {
			t.Errorf("logged at %v: %s %v", e.Level, e.Message, e.Data)
		}
	}

	// What no kernel sends is refused, with the errno and a log line
	// that says why.
	patch := func(name string, rw uint32, sector uint64) []byte {
		b := golden(t, name)
		le.PutUint32(b[16:], rw)
		if sector != 0 {
			le.PutUint64(b[8:], sector)
		}
		return b
	}
	for _, c := range []struct {
		name string
		usr  []byte
		dir  rtrs.Dir
		n    int
		want syscall.Errno
		why  string
	}{
		{"flush with data", golden(t, "kclt_flush"), rtrs.Write, 512, syscall.EINVAL, "carries none"},
		{"flush with an unknown flag", patch("kclt_flush", 0x302|1<<16, 0), rtrs.Read, 0, syscall.EINVAL, "unknown flags 0x10000"},
		{"FUA read", patch("kclt_read", 0x300, 0), rtrs.Read, 4096, syscall.EINVAL, "READ with flags FUA"},
		{"NOUNMAP on a write", patch("kclt_write_fua", 0x801, 0), rtrs.Write, 4096, syscall.EINVAL, "WRITE with flags NOUNMAP"},
		{"read as an RTRS write", golden(t, "kclt_read"), rtrs.Write, 4096, syscall.EINVAL, "READ as an RTRS write"},
		{"discard straddling the end", patch("kclt_discard_end", 3, 1984), rtrs.Write, 0, syscall.ENOSPC, "runs past the end"},
		{"read beyond the device", patch("kclt_read", 0x100, 1<<40), rtrs.Read, 4096, syscall.EINVAL, "beyond the device"},
	} {
		before := len(logged())
		if err := send(c.usr, c.dir, c.n); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
			continue
		}
		var line *log.Entry
		for _, e := range logged()[before:] {
			if e.Level == log.WarnLevel && strings.Contains(e.Message, c.why) {
				line = e
			}
		}
		if line == nil || line.Data["session"] != "kclt" || line.Data["device"] != "kdisk" || line.Data["op"] == nil {
			t.Errorf("%s: no warning saying %q with the session, device and op: %v", c.name, c.why, logged()[before:])
		}
	}

	// A flush on a read-only open is allowed (as the block layer allows
	// it on a read-only disk); a discard is not.
	ro := r.dev(r.client("kclt-ro"), "kdisk", AccessRO)
	if ro.d.Info().DeviceID != 1 {
		t.Fatalf("device id %d", ro.d.Info().DeviceID)
	}
	rs := ro.d.s.Session()
	if err := rs.Do(context.Background(), rtrs.IOCon, rtrs.Read, golden(t, "kclt_flush"), nil, 0, 0); err != nil {
		t.Fatalf("flush on a read-only open: %v", err)
	}
	if err := rs.Do(context.Background(), rtrs.IOCon, rtrs.Write, golden(t, "kclt_discard_end"), nil, 0, 0); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("discard on a read-only open: %v, want EROFS", err)
	}
}

// TestPastTheEnd: IO beyond the device fails whole and the file does not
// grow.
func TestPastTheEnd(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	path := r.file("small", 1<<20)
	x := r.dev(r.client("end"), "small", AccessRW)
	read := func(off int64, n int) error { _, err := x.read(off, n); return err }
	// Whatever writes gets ENOSPC past the end, whether it starts inside
	// the device, at its end or beyond it (a forced shrink, or a kernel
	// client's resize beyond the export, sends those); a read gets
	// EINVAL. docs/server.md and docs/protocol.md say so.
	for _, c := range []struct {
		name string
		err  error
		want syscall.Errno
	}{
		{"write straddling", x.write(1<<20-4096, make([]byte, 8192), 0), syscall.ENOSPC},
		{"write at the end", x.write(1<<20, make([]byte, 4096), 0), syscall.ENOSPC},
		{"write starting past the end", x.write(1<<20+4096, make([]byte, 4096), 0), syscall.ENOSPC},
		{"FUA write starting past the end", x.write(2<<20, make([]byte, 512), FFUA), syscall.ENOSPC},
		{"read straddling", read(1<<20-512, 1024), syscall.EINVAL},
		{"read starting past the end", read(1<<20+4096, 4096), syscall.EINVAL},
		{"discard at the end", x.op(OpDiscard, 0, 1<<20, 4096), syscall.ENOSPC},
		{"discard starting past the end", x.op(OpDiscard, 0, 1<<21, 4096), syscall.ENOSPC},
		{"zeroes straddling", x.op(OpWriteZeroes, 0, 1<<20-512, 4096), syscall.ENOSPC},
		{"zeroes at a sector beyond any size", x.op(OpWriteZeroes, 0, 1<<40, 512), syscall.ENOSPC},
	} {
		if !errors.Is(c.err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, c.err, c.want)
		}
	}
	if st, _ := os.Stat(path); st.Size() != 1<<20 {
		t.Fatalf("file grew to %d", st.Size())
	}
}

// TestHostileMessages: malformed RNBD messages get an errno and never
// crash the server or disturb a well-behaved device.
func TestHostileMessages(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	r.file("good", 1<<20)
	c := r.client("h")
	good := r.dev(c, "good", AccessRW)
	s := c.Session()
	buf, _ := s.AllocBuffer(1 << 16)
	ioMsg := func(m IO, n int) []byte { return m.Encode(make([]byte, IOSize))[:n] }
	open := (&Open{AccessMode: AccessRO, DevName: "good"}).Encode(make([]byte, OpenSize))
	unterminated := append([]byte(nil), open...)
	for i := 6; i < 6+255; i++ {
		unterminated[i] = 'a'
	}
	id := good.d.Info().DeviceID
	for _, c := range []struct {
		name string
		dir  rtrs.Dir
		usr  []byte
		n    int
		want syscall.Errno
	}{
		{"short header", rtrs.Write, []byte{4, 0}, 0, syscall.EINVAL},
		{"unknown type", rtrs.Write, []byte{9, 0, 0, 0}, 0, syscall.EINVAL},
		{"server-to-client type", rtrs.Write, (&SessInfo{Ver: 2}).Encode(make([]byte, 36), MsgSessInfoRsp), 0, syscall.EINVAL},
		{"short sess info", rtrs.Read, []byte{0, 0, 0, 0, 2}, 36, syscall.EINVAL},
		{"sess info without room for the answer", rtrs.Read, (&SessInfo{Ver: 2}).Encode(make([]byte, 36), MsgSessInfo), 8, syscall.EINVAL},
		{"open as a write", rtrs.Write, open, 0, syscall.EINVAL},
		{"open without room for the answer", rtrs.Read, open, 16, syscall.EINVAL},
		{"open with an unterminated name", rtrs.Read, unterminated, 56, syscall.EINVAL},
		{"short open", rtrs.Read, open[:100], 56, syscall.EINVAL},
		{"io with an unknown op", rtrs.Write, ioMsg(IO{DeviceID: id, RW: 9}, 32), 0, syscall.EINVAL},
		{"io with unknown flags", rtrs.Write, ioMsg(IO{DeviceID: id, RW: 2 | 1<<20}, 32), 0, syscall.EINVAL},
		{"io for an unknown device", rtrs.Write, ioMsg(IO{DeviceID: 999, RW: uint32(OpFlush)}, 32), 0, syscall.ENOTCONN},
		{"io too short", rtrs.Write, ioMsg(IO{DeviceID: id, RW: uint32(OpFlush)}, 20), 0, syscall.EINVAL},
		{"read longer than its data", rtrs.Read, ioMsg(IO{DeviceID: id, RW: uint32(OpRead), Size: 8192}, 32), 4096, syscall.EINVAL},
		{"write shorter than its data", rtrs.Write, ioMsg(IO{DeviceID: id, RW: uint32(OpWrite), Size: 512}, 32), 4096, syscall.EINVAL},
		{"read sent as a write", rtrs.Write, ioMsg(IO{DeviceID: id, RW: uint32(OpRead), Size: 4096}, 32), 4096, syscall.EINVAL},
		{"discard with data", rtrs.Write, ioMsg(IO{DeviceID: id, RW: uint32(OpDiscard), Size: 4096}, 32), 4096, syscall.EINVAL},
		{"unaligned read", rtrs.Read, ioMsg(IO{DeviceID: id, RW: uint32(OpRead), Size: 100}, 32), 100, syscall.EINVAL},
		// Past the end, however far: ENOSPC for what writes, EINVAL for a read.
		{"sector that overflows", rtrs.Write, ioMsg(IO{DeviceID: id, RW: uint32(OpDiscard), Sector: 1 << 62, Size: 512}, 32), 0, syscall.ENOSPC},
		{"read at a sector that overflows", rtrs.Read, ioMsg(IO{DeviceID: id, RW: uint32(OpRead), Sector: 1 << 62, Size: 512}, 32), 512, syscall.EINVAL},
	} {
		err := s.Do(context.Background(), rtrs.IOCon, c.dir, c.usr, buf, 0, c.n)
		if !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	// A close of an id that is not open is harmless.
	if err := s.Do(context.Background(), rtrs.AdminCon, rtrs.Write, (&Close{DeviceID: 12345}).Encode(make([]byte, 8)), nil, 0, 0); err != nil {
		t.Fatalf("close of an unknown id: %v", err)
	}
	// The well-behaved device still works, and a 24-byte IO (no prio) too.
	data := bytes.Repeat([]byte("ok"), 2048)
	if err := good.write(0, data, 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Do(context.Background(), rtrs.IOCon, rtrs.Read, ioMsg(IO{DeviceID: id, RW: uint32(OpRead), Size: 4096}, 24), buf, 0, 4096); err != nil {
		t.Fatalf("24-byte io: %v", err)
	}
	if !bytes.Equal(buf.Bytes()[:4096], data) {
		t.Fatal("read back")
	}
}

// TestInlineIO: on tmpfs, plain reads and writes are answered on the
// receive path, with the same data and errors as on the workers; FUA
// writes, flushes and writes to a read-only device still go to them.
func TestInlineIO(t *testing.T) {
	dir, err := os.MkdirTemp("/dev/shm", "rnbd-inline-")
	if err != nil {
		t.Skip(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	r := newSrig(t, ServerConfig{DevSearchPath: dir})
	path := r.file("mem", 1<<20)
	c := r.client("inline")
	x := r.dev(c, "mem", AccessRW)
	data := bytes.Repeat([]byte("inline.."), 8192) // 64 KiB
	if err := x.write(8192, data, 0); err != nil {
		t.Fatal(err)
	}
	if got, err := x.read(8192, len(data)); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back: %v", err)
	}
	if onDisk, _ := os.ReadFile(path); !bytes.Equal(onDisk[8192:8192+len(data)], data) {
		t.Fatal("the file does not hold what was written")
	}
	if n := r.srv.inline.Load(); n != 2 {
		t.Fatalf("%d IOs answered inline, want the write and the read", n)
	}
	if n := r.srv.lent.Load(); n != 1 {
		t.Fatalf("%d reads sent from the file's mapping, want the read of 64 KiB", n)
	}
	if err := x.write(0, data[:4096], FFUA); err != nil {
		t.Fatal(err)
	}
	if err := x.op(OpFlush, 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := x.write(1<<20-4096, make([]byte, 8192), 0); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("write past the end: %v, want ENOSPC", err)
	}
	if n := r.srv.inline.Load(); n != 2 {
		t.Fatalf("%d IOs answered inline, want 2: FUA, flush and the refused write past the end go to the workers", n)
	}
	ro := r.dev(r.client("inline-ro"), "mem", AccessRO)
	if err := ro.write(0, data[:4096], 0); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("write to a read-only device: %v, want EROFS", err)
	}
	if got, err := ro.read(8192, 4096); err != nil || !bytes.Equal(got, data[:4096]) {
		t.Fatalf("read-only read: %v", err)
	}
	if got, err := ro.read(8192, len(data)); err != nil || !bytes.Equal(got, data) || r.srv.lent.Load() != 2 {
		t.Fatalf("read-only read of 64 KiB: %v, %d sent from the mapping", err, r.srv.lent.Load())
	}
	// Closed by both sessions, the file is mapped no more: no answer
	// sent from its mapping kept it.
	for _, d := range []*dio{x, ro} {
		if err := d.d.Unmap(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the file unmapped", func() bool {
		maps, err := os.ReadFile("/proc/self/maps")
		return err == nil && !bytes.Contains(maps, []byte(path))
	})
}

// FuzzAdmit: whatever IO message and RTRS request a peer sends, the
// server either refuses it with an errno and a reason, or admits a range
// that lies inside the device, aligned, with the chunk's data matching.
func FuzzAdmit(f *testing.F) {
	for _, n := range []string{"kclt_read", "kclt_write_fua", "kclt_flush", "kclt21_flush", "kclt_write_preflush_empty",
		"kclt_discard_end", "kclt_write_zeroes_end", "kclt22_write_zeroes_nounmap", "io"} {
		b, err := goldenBytes(n)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, false, 0, false)
		f.Add(b, true, 4096, true)
	}
	p := filepath.Join(f.TempDir(), "d")
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		f.Fatal(err)
	}
	if err := os.Truncate(p, 1<<20); err != nil {
		f.Fatal(err)
	}
	be, err := blockdev.Open(p, blockdev.Options{LogicalBlockSize: 4096})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { be.Close() })
	f.Fuzz(func(t *testing.T, b []byte, read bool, dataLen int, ro bool) {
		var m IO
		if m.Decode(b) != nil {
			return
		}
		dir := rtrs.Write
		if read {
			dir = rtrs.Read
		}
		d := &SrvSessDev{backend: be, readonly: ro}
		off, n, r := d.admit(&m, dir, dataLen)
		if r != nil {
			if r.errno == 0 || r.why == "" {
				t.Fatalf("refusal without errno or reason: %+v", r)
			}
			return
		}
		rule := ioRules[m.Op()]
		if (rule.write && ro) || m.Flags()&^rule.flags != 0 || (rule.data && dataLen != int(m.Size)) || (!rule.data && dataLen != 0) {
			t.Fatalf("admitted %+v dir %v data %d ro %v", m, dir, dataLen, ro)
		}
		if off < 0 || n < 0 || off+n > be.Size() || off%4096 != 0 || n%4096 != 0 || (n > 0 && n != int64(m.Size)) {
			t.Fatalf("admitted range %d+%d of %+v", off, n, m)
		}
	})
}

// access_mode=migration beside a writer only where it is allowed, and an
// export's allow_from against the address of the path an OPEN arrives
// on.
func TestMigrationAndNetworks(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	r.file("found", 1<<20)
	exp, exp2 := r.file("exp/x", 1<<20), r.file("exp/y", 1<<20)
	open := func(cl *CltSession, name string, mode AccessMode) error {
		_, err := cl.open(context.Background(), name, mode)
		return err
	}
	a, b := r.client("a"), r.client("b") // paths from 10.20.1.x
	if err := open(a, "found", AccessRW); err != nil {
		t.Fatal(err)
	}
	if err := open(b, "found", AccessMigration); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("migration beside a writer without allow_migration: %v, want EPERM", err)
	}
	for _, e := range []Export{
		{Name: "nomig", Path: exp},
		{Name: "mig", Path: exp2, Migration: true},
		{Name: "net", Path: exp, AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.20.1.7/24")}},
	} {
		if err := r.srv.Map(e); err != nil {
			t.Fatal(err)
		}
	}
	// Alone, migration opens as rw does.
	if err := open(a, "nomig", AccessMigration); err != nil {
		t.Fatalf("migration as the only writer: %v", err)
	}
	if err := open(b, "nomig", AccessMigration); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("migration on an export without it: %v, want EPERM", err)
	}
	if err := open(a, "mig", AccessRW); err != nil {
		t.Fatal(err)
	}
	if err := open(b, "mig", AccessMigration); err != nil {
		t.Fatalf("migration on an export with it: %v", err)
	}
	if err := open(b, "net", AccessRO); err != nil {
		t.Fatalf("an OPEN from inside allow_from: %v", err)
	}
	c := r.cltSession("c", 0) // a path from 10.20.2.x
	if err := open(c, "net", AccessRO); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("an OPEN from outside allow_from: %v, want EPERM", err)
	}
	if err := r.srv.Map(Export{Name: "bad", Path: exp, AllowFrom: []netip.Prefix{{}}}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("an invalid network: %v, want EINVAL", err)
	}
}

// An export's allow_identities lets only the clients its grants name open
// it, each for at most its grant; the names are those of the client's TLS
// certificate, whatever session name it chose.
func TestExportIdentities(t *testing.T) {
	ca := testca.New(t, "test ca")
	r := newSrigOn(t, ServerConfig{}, nil, tcp.Options{TLS: ca.Config(ca.Issue(t, "server", srvAddr.Addr().String()))})
	p := r.file("exp/x", 1<<20)
	grants := []Grant{{"alice", "rw"}, {"bob", "ro"}, {"carol.example", "migration"}}
	if err := r.srv.Map(Export{Name: "acl", Path: p, AllowIdentities: grants}); err != nil {
		t.Fatal(err)
	}
	as := func(cn, sess string, sans ...string) *CltSession {
		return r.clientOn(r.net.FabricWith(tcp.Options{TLS: ca.Config(ca.Issue(t, cn, sans...))}), sess)
	}
	open := func(cl *CltSession, mode AccessMode) error {
		_, err := cl.open(context.Background(), "acl", mode)
		return err
	}
	alice, bob, carol := as("alice", "s1"), as("bob", "s2"), as("carol", "s3", "carol.example")
	mallory := as("mallory", "alice") // the session name of another is nothing
	if err := open(mallory, AccessRO); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("an identity without a grant: %v, want EACCES", err)
	}
	if err := open(bob, AccessRW); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("rw by an identity granted ro: %v, want EACCES", err)
	}
	if err := open(bob, AccessRO); err != nil {
		t.Fatalf("ro by an identity granted ro: %v", err)
	}
	if err := open(alice, AccessMigration); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("migration by an identity granted rw: %v, want EACCES", err)
	}
	if err := open(alice, AccessRW); err != nil {
		t.Fatalf("rw by an identity granted rw: %v", err)
	}
	// A grant of migration (to a name among the certificate's
	// alternative names) lets a second writer in although the export has
	// no migration flag.
	if err := open(carol, AccessMigration); err != nil {
		t.Fatalf("migration beside a writer by an identity granted it: %v", err)
	}
	if err := r.srv.Map(Export{Name: "bad", Path: p, AllowIdentities: []Grant{{"x", "rwx"}}}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("a grant of rwx: %v, want EINVAL", err)
	}
	if es := r.srv.Exports(); len(es) != 1 || !slices.Equal(es[0].AllowIdentities, grants) {
		t.Fatalf("exports %+v", es)
	}

	// Without TLS no client has an identity: such an export opens to
	// none.
	plain := newSrig(t, ServerConfig{})
	if err := plain.srv.Map(Export{Name: "acl", Path: plain.file("exp/y", 1<<20), AllowIdentities: grants}); err != nil {
		t.Fatal(err)
	}
	if _, err := plain.client("alice").open(context.Background(), "acl", AccessRO); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("a client without a certificate: %v, want EACCES", err)
	}
}

func TestParseGrant(t *testing.T) {
	for in, want := range map[string]Grant{
		"a":                 {"a", "rw"},
		"a=ro":              {"a", "ro"},
		"a=migration":       {"a", "migration"},
		"spiffe://x/y?z=1":  {"spiffe://x/y?z=1", "rw"},
		"spiffe://x/y?z=ro": {"spiffe://x/y?z", "ro"},
	} {
		if g, err := ParseGrant(in); err != nil || g != want {
			t.Errorf("ParseGrant(%q) = %+v, %v; want %+v", in, g, err, want)
		}
	}
	if _, err := ParseGrant("=ro"); err == nil {
		t.Error("ParseGrant(=ro) took an empty identity")
	}
}

// TestForcedShrinkUnderWrites: a forced shrink while a session writes
// past the new end leaves the file at the new size — a write checked
// against the old size and landing after the cut would grow it again —
// and IO past the end fails from then on. On a disk file system the
// writes go through the workers, on tmpfs they run inline (TryWriteAt).
func TestForcedShrinkUnderWrites(t *testing.T) {
	for _, dir := range []string{os.TempDir(), "/dev/shm"} {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			sp, err := os.MkdirTemp(dir, "rnbd-shrink-")
			if err != nil {
				t.Skip(err)
			}
			t.Cleanup(func() { os.RemoveAll(sp) })
			testForcedShrinkUnderWrites(t, sp)
		})
	}
}

func testForcedShrinkUnderWrites(t *testing.T, dir string) {
	r := newSrig(t, ServerConfig{DevSearchPath: dir})
	p := r.vol(8 << 20)
	c := r.client("s")
	c.SetSizePoll(time.Hour) // the client keeps the old size: its writes reach the server
	x := r.dev(c, "vol", AccessRW)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var landed atomic.Int64
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				// Past 4 MiB, where the shrink cuts; the client still
				// has the old size.
				off := int64(4<<20 + (w*1024+i%1024)*4096%(4<<20))
				if x.d.Do(context.Background(), OpWrite, 0, off, 4096, x.buf, w*4096) == nil {
					landed.Add(1)
				}
			}
		}()
	}
	stopped := false
	halt := func() {
		if !stopped {
			stopped = true
			close(stop)
			wg.Wait()
		}
	}
	defer halt()
	for round := 0; round < 30; round++ {
		deadline := time.Now().Add(10 * time.Second)
		for start := landed.Load(); landed.Load() < start+20; runtime.Gosched() {
			// Writes land past 4 MiB before the cut.
			if time.Now().After(deadline) {
				t.Fatalf("round %d: the writes stopped landing", round)
			}
		}
		if _, err := r.srv.Resize("vol", 4<<20, true); err != nil {
			t.Fatalf("round %d: forced shrink: %v", round, err)
		}
		if n := fileSize(t, p); n != 4<<20 {
			t.Fatalf("round %d: the file has %d bytes after the shrink to %d", round, n, 4<<20)
		}
		if err := x.d.Do(context.Background(), OpWrite, 0, 6<<20, 4096, x.buf, 0); err == nil {
			t.Fatalf("round %d: a write past the new end succeeded", round)
		}
		if round == 29 {
			break
		}
		if _, err := r.srv.Resize("vol", 8<<20, false); err != nil {
			t.Fatalf("round %d: growing: %v", round, err)
		}
	}
	halt() // nothing in flight lands past the end later either
	if n := fileSize(t, p); n != 4<<20 {
		t.Fatalf("the file has %d bytes once the writes stopped, want %d", n, 4<<20)
	}
}

// fileSize is the size of the file at p.
func fileSize(t *testing.T, p string) int64 {
	t.Helper()
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}

// TestResizeSeesEveryOpen: a shrink counts the sessions that have the
// file open through another name (the search path) as well; a device
// opened while a shrink is under way is served the new size, and a
// second resize of the file then is refused (EBUSY).
func TestResizeSeesEveryOpen(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	p := r.vol(4 << 20)
	c := r.client("s")
	x := r.dev(c, "exp/x", AccessRO) // by the search path, not the export
	if _, err := r.srv.Resize("vol", 1<<20, false); !errors.Is(err, syscall.EBUSY) || !strings.Contains(err.Error(), "by session s:") {
		t.Fatalf("shrinking a file open through the search path: %v, want EBUSY naming the session", err)
	}
	if n := fileSize(t, p); n != 4<<20 {
		t.Fatalf("the refused shrink cut the file to %d", n)
	}
	fi, _ := os.Stat(p)
	id, ok := blockdev.FileID(fi)
	r.srv.mu.Lock()
	dev := r.srv.devices[id]
	shrinking := resizing{shrink: true, size: 1 << 20, owner: 99} // a shrink waiting for writes
	r.srv.resizes[id] = shrinking
	r.srv.mu.Unlock()
	if !ok || dev == nil || x.d.Size() != 4<<20 {
		t.Fatalf("FileID %q (%v) names no open device", id, ok)
	}
	ct := r.client("t")
	y := r.dev(ct, "vol", AccessRO)
	if y.d.Size() != 1<<20 {
		t.Fatalf("a device opened during a shrink to 1 MiB has %d bytes", y.d.Size())
	}
	if _, err := r.srv.Resize("vol", 2<<20, true); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("a resize during another: %v, want EBUSY", err)
	}
	r.srv.endResize(id, shrinking, false) // the shrink gave up: nothing was cut
	ct.SetSizePoll(20 * time.Millisecond)
	for deadline := time.Now().Add(10 * time.Second); y.d.Size() != 4<<20; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the device did not learn the size back: %d", y.d.Size())
		}
	}
	if err := y.d.Do(context.Background(), OpRead, 0, 3<<20, 4096, y.buf, 0); err != nil {
		t.Fatalf("a read past 1 MiB once the shrink ended: %v", err)
	}
	// Open by two sessions (one of them twice): the refusal names both.
	r.dev(ct, "exp/x", AccessRO)
	if _, err := r.srv.Resize("vol", 1<<20, false); !errors.Is(err, syscall.EBUSY) || !strings.Contains(err.Error(), "is open 3 time(s), by sessions s, t:") {
		t.Fatalf("shrinking a file two sessions have open: %v, want EBUSY naming both", err)
	}
}

// TestShrinkWhileClosing: a device closing still waits for a write it
// admitted; a shrink it does not count as open (no --force needed) still
// caps it, so that write cannot land past the cut.
func TestShrinkWhileClosing(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	p := r.vol(8 << 20)
	hold := make(chan struct{})
	release := sync.OnceFunc(func() { close(hold) })
	t.Cleanup(release) // before the server closes, should the test fail
	var held atomic.Int32
	r.srv.beforeIO = func() {
		held.Add(1)
		<-hold
	}
	x := r.dev(r.client("s"), "vol", AccessRW)
	wrote := make(chan error, 1)
	go func() { wrote <- x.d.Do(context.Background(), OpWrite, 0, 6<<20, 4096, x.buf, 0) }()
	waitFor(t, "the write at the server", func() bool { return held.Load() == 1 })
	closed := make(chan error, 1)
	go func() { _, err := r.srv.ForceClose("vol", ""); closed <- err }() // rnbd-server device close
	fi, _ := os.Stat(p)
	id, _ := blockdev.FileID(fi)
	waitFor(t, "the device closing", func() bool {
		r.srv.mu.Lock()
		defer r.srv.mu.Unlock()
		_, closing := r.srv.openOn(id)
		return len(closing) == 1
	})
	if _, err := r.srv.Resize("vol", 4<<20, false); err != nil {
		t.Fatalf("shrinking a file whose only device is closing: %v", err)
	}
	release()
	if err := <-wrote; err == nil {
		t.Fatal("the write past the cut succeeded")
	}
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if n := fileSize(t, p); n != 4<<20 {
		t.Fatalf("the file has %d bytes after a shrink to %d", n, 4<<20)
	}
}

// TestOpenAfterCut: a file cut behind the server's back between a
// device's backend open and its join is served at its new size: the
// open reads the size again once joined, where a shrink's end would no
// longer reach it.
func TestOpenAfterCut(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	p := r.vol(4 << 20)
	r.srv.beforeJoin = func() { os.Truncate(p, 1<<20) }
	x := r.dev(r.client("s"), "vol", AccessRW)
	if x.d.Size() != 1<<20 {
		t.Fatalf("the device is served %d bytes of a file cut to %d", x.d.Size(), 1<<20)
	}
}

// rnbd-server resize reaches a client that has the device open through
// its size poll, without a remap; so does a file grown behind the
// server's back. Shrinking what a session has open needs force; IO
// follows the size both ways.
func TestServerResize(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	p := r.vol(1 << 20)
	c := r.client("s")
	resized := make(chan int64, 4)
	c.OnResize(func(d *CltDev) { resized <- d.Size() })
	x := r.dev(c, "vol", AccessRW)
	c.SetSizePoll(20 * time.Millisecond)
	next := func(want int64) {
		t.Helper()
		select {
		case got := <-resized:
			if got != want || x.d.Size() != want {
				t.Fatalf("resized to %d (device %d), want %d", got, x.d.Size(), want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("the client did not learn the size %d", want)
		}
	}
	if _, err := r.srv.Resize("vol", 4<<20, false); err != nil {
		t.Fatal(err)
	}
	next(4 << 20)
	if err := x.d.Do(context.Background(), OpWrite, 0, 4<<20-4096, 4096, x.buf, 0); err != nil {
		t.Fatalf("write in the grown part: %v", err)
	}
	os.Truncate(p, 6<<20) // behind the server's back: the poll's OPEN refreshes it
	next(6 << 20)
	if _, err := r.srv.Resize("vol", 1<<20, false); !errors.Is(err, syscall.EBUSY) || !strings.Contains(err.Error(), "export vol is open 1 time(s), by session s:") {
		t.Fatalf("shrinking an open export: %v, want EBUSY naming the session", err)
	}
	if was, err := r.srv.Resize("vol", 2<<20, true); err != nil || was != 6<<20 {
		t.Fatalf("forced shrink: %d %v", was, err)
	}
	next(2 << 20)
	if err := x.d.Do(context.Background(), OpRead, 0, 4<<20-4096, 4096, x.buf, 0); err == nil {
		t.Fatal("read past the new end succeeded")
	}
	for _, c := range []struct {
		name string
		size int64
		want syscall.Errno
	}{{"vol", 1000, syscall.EINVAL}, {"vol", 0, syscall.EINVAL}, {"none", 1 << 20, syscall.ENOENT}} {
		if _, err := r.srv.Resize(c.name, c.size, false); !errors.Is(err, c.want) {
			t.Errorf("resize %s to %d: %v, want %v", c.name, c.size, err, c.want)
		}
	}
	select {
	case n := <-resized:
		t.Fatalf("a size change %d nobody made", n)
	default:
	}
	// Closed by the server's administrator: the size poll must not
	// open it again (its read before the OPEN finds it closed).
	if n, err := r.srv.ForceClose("vol", "s"); err != nil || n != 1 {
		t.Fatalf("force close: %d %v", n, err)
	}
	waitFor(t, "a poll to find it closed", func() bool { return x.d.State() == DevSrvClosed })
	time.Sleep(100 * time.Millisecond) // five more polls
	if n := len(r.srv.OpenDevices()); n != 0 {
		t.Fatalf("%d devices open after the polls", n)
	}
}

// An export's max_sessions bounds the sessions that have it open at
// once; a session that closes it makes room, and a refused OPEN leaves
// nothing counted.
func TestExportMaxSessions(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	p := r.file("exp/x", 1<<20)
	if err := r.srv.Map(Export{Name: "two", Path: p, MaxSessions: 2}); err != nil {
		t.Fatal(err)
	}
	if err := r.srv.Map(Export{Name: "bad", Path: p, MaxSessions: -1}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("max_sessions -1: %v, want EINVAL", err)
	}
	open := func(cl *CltSession) (OpenRsp, error) { return cl.open(context.Background(), "two", AccessRO) }
	a, b, c := r.client("a"), r.client("b"), r.client("c")
	if _, err := open(a); err != nil {
		t.Fatal(err)
	}
	rb, err := open(b)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := open(a); err != nil {
		t.Fatalf("the same session again: %v", err)
	}
	for i := 0; i < 3; i++ {
		if _, err := open(c); !errors.Is(err, syscall.EUSERS) {
			t.Fatalf("a third session: %v, want EUSERS", err)
		}
	}
	if err := b.close(context.Background(), "two", rb.DeviceID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "b's open to close", func() bool {
		_, err := open(c)
		return err == nil
	})
}

// A backing file deleted, replaced or shrunk behind the server's back is
// logged once, and its recovery too.
func TestBackingStoreHealth(t *testing.T) {
	lg, entries := log.Recorder()
	r := newSrig(t, ServerConfig{Log: lg, HealthInterval: 5 * time.Millisecond})
	p := r.file("a", 1<<20)
	c := r.client("h")
	if _, err := c.open(context.Background(), "a", AccessRW); err != nil {
		t.Fatal(err)
	}
	said := func(msg, part string) bool {
		for _, e := range entries() {
			if e.Message == msg {
				if err, _ := e.Data["error"].(error); part == "" || err != nil && strings.Contains(err.Error(), part) {
					return true
				}
			}
		}
		return false
	}
	if err := os.Truncate(p, 1<<19); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the shrink to be logged", func() bool { return said("backing store changed behind the server", "shrank from 1048576 to 524288") })
	if err := os.Truncate(p, 1<<20); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the recovery to be logged", func() bool { return said("backing store healthy again", "") })
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the deletion to be logged", func() bool { return said("backing store changed behind the server", "was deleted") })
	n := 0
	for _, e := range entries() {
		if e.Message == "backing store changed behind the server" {
			n++
		}
	}
	if n != 2 {
		t.Fatalf("%d problem entries for two problems: each is logged once", n)
	}
}

// The devices under dev_search_path have the rules an export can have:
// the networks an OPEN may come from and the identities that may open
// them, for what.
func TestSearchPathRules(t *testing.T) {
	open := func(cl *CltSession, name string, mode AccessMode) error {
		_, err := cl.open(context.Background(), name, mode)
		return err
	}
	r := newSrig(t, ServerConfig{SearchAllowFrom: []netip.Prefix{netip.MustParsePrefix("10.20.1.0/24")}})
	r.file("found", 1<<20)
	if err := open(r.client("a"), "found", AccessRW); err != nil { // a path from 10.20.1.x
		t.Fatalf("an OPEN from inside dev_search_path_allow_from: %v", err)
	}
	if err := open(r.cltSession("c", 0), "found", AccessRO); !errors.Is(err, syscall.EPERM) { // from 10.20.2.x
		t.Fatalf("an OPEN from outside dev_search_path_allow_from: %v, want EPERM", err)
	}

	ca := testca.New(t, "test ca")
	r = newSrigOn(t, ServerConfig{SearchAllowIdentities: []Grant{{"alice", "rw"}, {"bob", "ro"}}}, nil,
		tcp.Options{TLS: ca.Config(ca.Issue(t, "server", srvAddr.Addr().String()))})
	r.file("found", 1<<20)
	as := func(cn, sess string) *CltSession {
		return r.clientOn(r.net.FabricWith(tcp.Options{TLS: ca.Config(ca.Issue(t, cn))}), sess)
	}
	if err := open(as("mallory", "s0"), "found", AccessRO); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("an identity without a grant: %v, want EACCES", err)
	}
	bob := as("bob", "s1")
	if err := open(bob, "found", AccessRW); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("rw by an identity granted ro: %v, want EACCES", err)
	}
	if err := open(bob, "found", AccessRO); err != nil {
		t.Fatalf("ro by an identity granted ro: %v", err)
	}
	if err := open(as("alice", "s2"), "found", AccessRW); err != nil {
		t.Fatalf("rw by an identity granted rw: %v", err)
	}
}

// TestOpenOnHungMount: an OPEN whose backing file is on a mount that
// does not answer holds only itself: the session's IO on its other
// devices goes on — on the one worker too (a flush runs there) — and a
// second OPEN of the same name is refused (EBUSY) rather than stacked
// behind it.
func TestOpenOnHungMount(t *testing.T) {
	var mnt string
	r := newSrig(t, ServerConfig{Workers: 1, Stat: func(p string) (os.FileInfo, error) {
		if mnt != "" && strings.HasPrefix(p, mnt) {
			return nil, nil // exported while the mount answered
		}
		return os.Stat(p)
	}})
	r.file("vol1", 1<<20)
	c := r.client("c1")
	x := r.dev(c, "vol1", AccessRW)
	mnt = testfs.HungMount(t) // its cleanup, first, lets the open fail
	if err := r.srv.Map(Export{Name: "hung", Path: filepath.Join(mnt, "disk.img")}); err != nil {
		t.Fatal(err)
	}
	go c.open(context.Background(), "hung", AccessRW) // hangs until the cleanup
	opening := func() bool {
		for _, s := range r.srv.Sessions() {
			if !s.mu.TryLock() {
				continue // (held through the open, it would never be free)
			}
			o := s.opening["hung"]
			s.mu.Unlock()
			if o {
				return true
			}
		}
		return false
	}
	for deadline := time.Now().Add(10 * time.Second); !opening(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the open of the hung export never started")
		}
	}
	done := make(chan error, 1)
	go func() {
		want := bytes.Repeat([]byte("still served"), 4096/12+1)[:4096]
		err := x.write(0, want, 0)
		if err == nil {
			var got []byte
			if got, err = x.read(0, len(want)); err == nil && !bytes.Equal(got, want) {
				err = fmt.Errorf("read back %q", got[:12])
			}
		}
		if err == nil {
			err = x.op(OpFlush, 0, 0, 0)
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("IO on another device of the session waits for the hung open")
	}
	// Our client sends one admin message at a time; another client
	// need not.
	var usr [OpenSize]byte
	(&Open{AccessMode: AccessRW, DevName: "hung"}).Encode(usr[:])
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Session().Do(ctx, rtrs.IOCon, rtrs.Read, usr[:], x.buf, 0, OpenRspSize); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("a second open of the name being opened: %v, want EBUSY", err)
	}
}

// TestUnmapDuringOpen: an export withdrawn while a session's OPEN of it
// is under way (its backend opened, the device not yet the session's) is
// not left open behind the unmap: the OPEN fails with ENOENT, nothing
// stays open, and the export's max_sessions count is released.
func TestUnmapDuringOpen(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	p := r.file("exp/x", 1<<20)
	if err := r.srv.Map(Export{Name: "vol", Path: p, MaxSessions: 1}); err != nil {
		t.Fatal(err)
	}
	opened, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	r.srv.afterOpen = func() {
		once.Do(func() {
			close(opened)
			<-release
		})
	}
	c := r.client("s")
	res := make(chan error, 1)
	go func() {
		_, err := c.open(context.Background(), "vol", AccessRW)
		res <- err
	}()
	<-opened
	if err := r.srv.Unmap("vol", false); err != nil {
		t.Fatalf("unmap while an open is under way: %v", err)
	}
	close(release)
	if err := <-res; !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("the open of a withdrawn export: %v, want ENOENT", err)
	}
	if open := r.srv.OpenDevices(); len(open) != 0 {
		t.Fatalf("open after the unmap: %+v", open)
	}
	if err := r.srv.Map(Export{Name: "vol", Path: p, MaxSessions: 1}); err != nil {
		t.Fatal(err)
	}
	r.dev(c, "vol", AccessRW) // its one session's room was given back
}

// TestReopenLooksAtPath: an OPEN of a device the session has open (a
// remap, our client's size poll) asks the backend for its size only if
// the export's path answers (ServerConfig.Answers): where it does not
// (the daemon's bounded look gives ETIMEDOUT), the OPEN fails with that
// at once instead of waiting on the mount. A path that is gone is no reason
// to fail: the file renamed or removed is still the device's.
func TestReopenLooksAtPath(t *testing.T) {
	var hung atomic.Bool
	r := newSrig(t, ServerConfig{Answers: func(p string) error {
		if hung.Load() {
			return &os.PathError{Op: "stat", Path: p, Err: syscall.ETIMEDOUT}
		}
		_, err := os.Stat(p)
		return err
	}})
	p := r.file("exp/vol", 1<<20)
	for name, path := range map[string]string{"vol": p, "vol2": r.file("exp/vol2", 1<<20)} {
		if err := r.srv.Map(Export{Name: name, Path: path}); err != nil {
			t.Fatal(err)
		}
	}
	c := r.client("c1")
	r.dev(c, "vol", AccessRW)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := os.Truncate(p, 2<<20); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(p, p+".moved"); err != nil {
		t.Fatal(err)
	}
	rsp, err := c.open(ctx, "vol", AccessRW)
	if err != nil || rsp.NSectors != (2<<20)/512 {
		t.Fatalf("reopen with the file moved away: %v, %d sectors, want the grown size %d", err, rsp.NSectors, (2<<20)/512)
	}
	hung.Store(true)
	if _, err := c.open(ctx, "vol", AccessRW); !errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("reopen with the path not answering: %v, want ETIMEDOUT", err)
	}
	// A first OPEN is refused the same way, and leaves nothing behind.
	if _, err := c.open(ctx, "vol2", AccessRW); !errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("open with the path not answering: %v, want ETIMEDOUT", err)
	}
	hung.Store(false)
	if _, err := c.open(ctx, "vol", AccessRW); err != nil {
		t.Fatalf("reopen once the path answers: %v", err)
	}
	if _, err := c.open(ctx, "vol2", AccessRW); err != nil {
		t.Fatalf("open once the path answers: %v", err)
	}
}

// TestWriterWhileReaderCloses: a writer's OPEN racing the close of the
// device's only other session (a reader) never leaves the device without
// its writer: a second writer is refused every time. The writer used to
// join the device only after the server's lock was released, and the
// reader's close could drop the device in between, so that the next
// writer found none and was let in.
func TestWriterWhileReaderCloses(t *testing.T) {
	r := newSrig(t, ServerConfig{})
	r.file("vol", 1<<20)
	ra, w, w2 := r.client("reader"), r.client("writer"), r.client("second")
	ctx := context.Background()
	for i := 0; i < 200; i++ {
		rd, err := ra.Map(ctx, "vol", AccessRO)
		if err != nil {
			t.Fatal(err)
		}
		closed := make(chan error, 1)
		go func() { closed <- rd.Unmap(ctx) }()
		wd, err := w.Map(ctx, "vol", AccessRW)
		if err != nil {
			t.Fatal(err)
		}
		if err := <-closed; err != nil {
			t.Fatal(err)
		}
		if d, err := w2.Map(ctx, "vol", AccessRW); !errors.Is(err, syscall.EPERM) {
			if d != nil {
				d.Unmap(ctx)
			}
			t.Fatalf("round %d: a second writer beside the first: %v, want EPERM", i, err)
		}
		if err := wd.Unmap(ctx); err != nil {
			t.Fatal(err)
		}
	}
	r.srv.mu.Lock()
	left := len(r.srv.devices)
	r.srv.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d devices left open", left)
	}
}

// TestHealthOnHungMount: the health check of a file whose mount stopped
// answering holds neither the checks of the other devices nor the close
// of its own device, and says that it hangs. The check used to stat the
// path on the health loop itself, holding an IO reference: the loop
// stopped for every device, and the device's close waited for ever.
func TestHealthOnHungMount(t *testing.T) {
	lg, entries := log.Recorder()
	r := newSrig(t, ServerConfig{Log: lg, HealthInterval: 10 * time.Millisecond})
	under := filepath.Join(r.dir, "mnt")
	r.file("mnt/vol", 1<<20)
	other := r.file("other", 1<<20)
	c := r.client("h")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	vol, err := c.Map(ctx, "mnt/vol", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Map(ctx, "other", AccessRW); err != nil {
		t.Fatal(err)
	}
	testfs.HungMountAt(t, under) // the open file stays; its path now hangs
	said := func(part string) bool {
		for _, e := range entries() {
			if err, _ := e.Data["error"].(error); e.Message == "backing store changed behind the server" &&
				err != nil && strings.Contains(err.Error(), part) {
				return true
			}
		}
		return false
	}
	waitFor(t, "the hung check to be reported", func() bool { return said("no answer to its health check") })
	if err := os.Remove(other); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the other device's deletion to be logged", func() bool { return said("other was deleted") })
	done := make(chan error, 1)
	go func() { done <- vol.Unmap(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("unmap of the device on the hung mount: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the close of the device on the hung mount waits for its health check")
	}
}

// TestShrinkBehindServer: a backing file cut behind the server's back
// while a session has it open is an error, not a resize — found by the
// client's size poll or by the health loop, whichever comes first: the
// size served stays (the client's device keeps its size), the shrink is
// logged at error level once and counted, IO past the file's end fails
// with EIO and does not grow the file back, what lies below it reads
// back intact; a grow back heals it, a resize refused leaves it, and a
// forced resize to the new size makes it the size served. On tmpfs the
// IO runs inline, through the file's mapping.
func TestShrinkBehindServer(t *testing.T) {
	for _, c := range []struct {
		name   string
		dir    string
		poll   time.Duration // the client's size poll
		health time.Duration // the server's health loop
	}{
		{"size poll", os.TempDir(), 20 * time.Millisecond, -1},
		{"health loop", os.TempDir(), time.Hour, 5 * time.Millisecond},
		{"size poll on tmpfs", "/dev/shm", 20 * time.Millisecond, -1},
	} {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			dir, err := os.MkdirTemp(c.dir, "rnbd-shrink-")
			if err != nil {
				t.Skip(err)
			}
			t.Cleanup(func() { os.RemoveAll(dir) })
			testShrinkBehindServer(t, dir, c.poll, c.health)
		})
	}
}

func testShrinkBehindServer(t *testing.T, dir string, poll, health time.Duration) {
	lg, entries := log.Recorder()
	r := newSrig(t, ServerConfig{Log: lg, HealthInterval: health, DevSearchPath: dir})
	p := r.vol(8 << 20)
	c := r.client("s")
	resized := make(chan int64, 8)
	c.OnResize(func(d *CltDev) { resized <- d.Size() })
	x := r.dev(c, "vol", AccessRW)
	c.SetSizePoll(poll)
	low, high := bytes.Repeat([]byte("low!"), 16<<10), bytes.Repeat([]byte("high"), 1024)
	if err := x.write(0, low, 0); err != nil {
		t.Fatal(err)
	}
	if err := x.write(6<<20, high, 0); err != nil {
		t.Fatal(err)
	}
	logged := func(msg string) (n int) {
		for _, e := range entries() {
			if e.Message == msg {
				n++
			}
		}
		return n
	}
	shrinkLogged := func(part string) bool {
		for _, e := range entries() {
			if err, _ := e.Data["error"].(error); e.Message == "backing store changed behind the server" && e.Level == log.ErrorLevel &&
				err != nil && strings.Contains(err.Error(), part) {
				return true
			}
		}
		return false
	}
	if err := os.Truncate(p, 2<<20); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the shrink to be logged", func() bool { return shrinkLogged("shrank from 8388608 to 2097152") })
	if n := r.srv.BackingShrinks()["vol"]; n != 1 {
		t.Fatalf("%d shrinks counted for vol, want 1", n)
	}
	if o := r.srv.OpenDevices(); len(o) != 1 || !strings.Contains(o[0].BackingProblem, "shrank") {
		t.Fatalf("open devices: %+v", o)
	}
	for _, w := range []struct {
		what string
		err  error
	}{
		{"write", x.write(6<<20, high, 0)},
		{"FUA write", x.write(6<<20, high, FFUA)},
		{"write across the end", x.write(2<<20-4096, low[:8192], 0)},
		{"write-zeroes", x.op(OpWriteZeroes, FNoUnmap, 4<<20, 1<<20)},
		{"read", x.do(OpRead, 0, 6<<20, 4096)},
	} {
		if !errors.Is(w.err, syscall.EIO) {
			t.Errorf("%s past the file's end: %v, want EIO", w.what, w.err)
		}
	}
	if n := fileSize(t, p); n != 2<<20 {
		t.Fatalf("the file is %d bytes after IO past its end, want it left at %d", n, 2<<20)
	}
	if got, err := x.read(0, len(low)); err != nil || !bytes.Equal(got, low) {
		t.Fatalf("read below the end: %v", err)
	}
	refusedLogged := false
	for _, e := range entries() {
		err, _ := e.Data["error"].(error)
		refusedLogged = refusedLogged || e.Message == "IO failed on the backend" && e.Level == log.ErrorLevel &&
			errors.Is(err, blockdev.ErrPastFileEnd) && strings.Contains(err.Error(), p)
	}
	if !refusedLogged {
		t.Fatal("IO refused past the file's end was not logged at error level, naming the file")
	}
	if rsp, err := c.open(context.Background(), "vol", AccessRW); err != nil || rsp.NSectors != (8<<20)/512 {
		t.Fatalf("a size poll after the shrink: %v, %d sectors, want the %d served", err, rsp.NSectors, (8<<20)/512)
	}
	if x.d.Size() != 8<<20 {
		t.Fatalf("the client's device went to %d bytes", x.d.Size())
	}
	// Grown back: healthy, IO there works again.
	if err := os.Truncate(p, 8<<20); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the recovery to be logged", func() bool { return logged("backing store healthy again") == 1 })
	waitFor(t, "a write past the old cut", func() bool { return x.write(6<<20, high, 0) == nil })
	if got, err := x.read(6<<20, len(high)); err != nil || !bytes.Equal(got, high) {
		t.Fatalf("read back past the old cut: %v", err)
	}
	if n := logged("backing store changed behind the server"); n != 1 {
		t.Fatalf("the shrink was logged %d times: once per change", n)
	}
	// Cut again: a shrink refused (no --force) leaves it an error; a
	// forced one to the file's size makes that the size served.
	if err := os.Truncate(p, 2<<20); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the second shrink to be counted", func() bool { return r.srv.BackingShrinks()["vol"] == 2 })
	if _, err := r.srv.Resize("vol", 2<<20, false); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("resize to the size cut, without force: %v, want EBUSY", err)
	}
	if err := x.write(6<<20, high, 0); !errors.Is(err, syscall.EIO) {
		t.Fatalf("write past the end after a resize refused: %v, want EIO", err)
	}
	if rsp, err := c.open(context.Background(), "vol", AccessRW); err != nil || rsp.NSectors != (8<<20)/512 {
		t.Fatalf("a size poll after a resize refused: %v, %d sectors", err, rsp.NSectors)
	}
	select {
	case n := <-resized:
		t.Fatalf("the client followed a shrink nobody made to %d bytes", n)
	default:
	}
	if _, err := r.srv.Resize("vol", 2<<20, true); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "healthy again after the forced resize", func() bool { return logged("backing store healthy again") == 2 })
	if rsp, err := c.open(context.Background(), "vol", AccessRW); err != nil || rsp.NSectors != (2<<20)/512 {
		t.Fatalf("a size poll after the forced resize: %v, %d sectors, want %d", err, rsp.NSectors, (2<<20)/512)
	}
	if err := x.write(1<<20, high, 0); err != nil {
		t.Fatalf("write below the new end: %v", err)
	}
	if n := r.srv.BackingShrinks()["vol"]; n != 2 {
		t.Fatalf("%d shrinks counted, want 2", n)
	}
}
