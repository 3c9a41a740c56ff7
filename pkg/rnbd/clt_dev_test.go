package rnbd

import (
	"bytes"
	"context"
	"errors"
	"github.com/rnbd/rnbd/test/kit"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/fabrictest"
)

// cltSession dials an RNBD client session to the rig's server.
func (r *srig) cltSession(name string, noPath time.Duration) *CltSession {
	r.t.Helper()
	cfg := rtrs.DefaultCltConfig()
	cfg.SessName, cfg.Fabric, cfg.Log = name, r.fab, log.Discard()
	cfg.ConnsPerPath = 2
	cfg.ReconnectDelay, cfg.ReconnectJitter = 20*time.Millisecond, time.Millisecond
	src := netip.AddrFrom4([4]byte{10, 20, 2, byte(r.next.Add(1))})
	cfg.Paths = []rtrs.PathAddr{{Src: netip.AddrPortFrom(src, 0), Dst: srvAddr}}
	s, err := DialSession(context.Background(), cfg, noPath)
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { s.Close() })
	return s
}

// syncIO runs one request on d and waits for it.
func syncIO(d *CltDev, op Op, flags uint32, off int64, n int, buf *rtrs.Buffer) error {
	return d.Do(context.Background(), op, flags, off, n, buf, 0)
}

// A request larger than one transport message is split and reassembled;
// two devices share one session.
func TestCltDevSplitAndShare(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	r.file("a", 8<<20)
	r.file("b", 8<<20)
	s := r.cltSession("cs", 0)
	a, err := s.Map(context.Background(), "a", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.Map(context.Background(), "b", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Map(context.Background(), "a", AccessRW); !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("second map of a: %v, want EEXIST", err)
	}
	buf, _ := s.Session().AllocBuffer(2 << 20)
	data := bytes.Repeat([]byte("0123456789abcdef"), (1<<20+8192)/16)
	copy(buf.Bytes(), data)
	if err := syncIO(a, OpWrite, FFUA, 4096, len(data), buf); err != nil {
		t.Fatal(err)
	}
	clear(buf.Bytes())
	if err := syncIO(a, OpRead, 0, 4096, len(data), buf); err != nil || !bytes.Equal(buf.Bytes()[:len(data)], data) {
		t.Fatalf("read back through the split: %v", err)
	}
	if err := syncIO(b, OpRead, 0, 4096, 4096, buf); err != nil || !bytes.Equal(buf.Bytes()[:4096], make([]byte, 4096)) {
		t.Fatalf("device b sees a's data: %v", err)
	}
	if err := syncIO(a, OpRead, 0, 8<<20, 4096, buf); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("read past the end: %v, want EINVAL", err)
	}
	for _, op := range []Op{OpWrite, OpDiscard, OpWriteZeroes} {
		if err := syncIO(a, op, 0, 8<<20, 4096, buf); !errors.Is(err, syscall.ENOSPC) {
			t.Fatalf("%v past the end: %v, want ENOSPC", op, err)
		}
	}
	if err := a.Resize(4 << 20); err != nil || a.Size() != 4<<20 {
		t.Fatalf("resize: %v, size %d", err, a.Size())
	}
	if err := a.Resize(16 << 20); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("resize beyond the remote size: %v", err)
	}
	if err := a.Unmap(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := syncIO(a, OpRead, 0, 0, 4096, buf); !errors.Is(err, syscall.ENODEV) {
		t.Fatalf("IO after unmap: %v, want ENODEV", err)
	}
	if len(s.Devices()) != 1 || s.Devices()[0] != b {
		t.Fatalf("devices after unmap: %v", s.Devices())
	}
}

// When the session loses every path the server forgets its devices; IO
// issued meanwhile waits, the devices are reopened after the reconnect and
// the IO completes against the right device.
func TestCltDevReopenAfterReconnect(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	r.file("a", 8<<20)
	s := r.cltSession("cs", 30*time.Second)
	a, err := s.Map(context.Background(), "a", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	buf, _ := s.Session().AllocBuffer(1 << 20)
	copy(buf.Bytes(), bytes.Repeat([]byte{0xA5}, 4096))
	if err := syncIO(a, OpWrite, 0, 0, 4096, buf); err != nil {
		t.Fatal(err)
	}
	// Drop every path from the server side: the server session and its
	// devices go.
	for _, x := range r.rs.Sessions() {
		x.Close()
	}
	kit.WaitFor(t, 20*time.Second, "device closed", func() bool { return a.State() == DevClosed })
	wbuf, _ := s.Session().AllocBuffer(4096)
	copy(wbuf.Bytes(), bytes.Repeat([]byte{0x5A}, 4096))
	done := make(chan error, 1)
	if err := a.Submit(context.Background(), &IOReq{Op: OpWrite, Off: 4096, Len: 4096, Buf: wbuf,
		Done: func(_ *IOReq, err error) { done <- err }}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("IO across the reconnect: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("IO across the reconnect never completed")
	}
	if a.State() != DevOpen {
		t.Fatalf("state after reconnect %v", a.State())
	}
	clear(buf.Bytes()[:8192])
	if err := syncIO(a, OpRead, 0, 0, 8192, buf); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(buf.Bytes()[:4096], bytes.Repeat([]byte{0xA5}, 4096)) || !bytes.Equal(buf.Bytes()[4096:8192], bytes.Repeat([]byte{0x5A}, 4096)) {
		t.Fatal("data across the reconnect differs")
	}
}

// IO in flight when the session's only path dies silently waits (it is
// not lost and does not fail), and completes once the path is back and the
// device reopened; what it wrote is there.
func TestCltDevInflightWaitsForPath(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	path := r.file("a", 1<<20)
	hold := make(chan struct{})
	var held atomic.Int32
	r.srv.beforeIO = func() {
		if held.Add(1) == 1 {
			<-hold // the first attempt never answers in time
		}
	}
	s := r.cltSession("cs", 30*time.Second)
	a, err := s.Map(context.Background(), "a", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	buf, _ := s.Session().AllocBuffer(4096)
	copy(buf.Bytes(), bytes.Repeat([]byte{0x77}, 4096))
	done := make(chan error, 1)
	if err := a.Submit(context.Background(), &IOReq{Op: OpWrite, Off: 8192, Len: 4096, Buf: buf,
		Done: func(_ *IOReq, err error) { done <- err }}); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 20*time.Second, "the write at the server", func() bool { return held.Load() == 1 })
	cli := s.Session().Paths()[0].Addr().Src.Addr()
	r.net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkDown)
	kit.WaitFor(t, 20*time.Second, "device closed", func() bool { return a.State() == DevClosed })
	select {
	case err := <-done:
		t.Fatalf("the write ended without a path: %v", err)
	default:
	}
	if since := s.NoPathSince(); since.IsZero() || time.Since(since) > time.Minute {
		t.Fatalf("no path since %v", since)
	}
	close(hold)
	r.net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkUp)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the write across the path loss: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the write across the path loss never completed")
	}
	if held.Load() < 2 {
		t.Fatalf("%d attempts reached the server, want the resent one too", held.Load())
	}
	if since := s.NoPathSince(); !since.IsZero() {
		t.Fatalf("no path since %v after the path came back", since)
	}
	if b, _ := os.ReadFile(path); !bytes.Equal(b[8192:8192+4096], bytes.Repeat([]byte{0x77}, 4096)) {
		t.Fatal("the file does not hold the write")
	}
}

// lostDevice maps a device through a session with noPath, then takes
// every path away for good (no reconnects).
func lostDevice(t *testing.T, noPath time.Duration) (*CltSession, *CltDev, *rtrs.Buffer) {
	r := newSrig(t, SrvConfig{})
	r.file("a", 1<<20)
	s := r.cltSession("cs", noPath)
	a, err := s.Map(context.Background(), "a", AccessRO)
	if err != nil {
		t.Fatal(err)
	}
	s.Session().SetMaxReconnectAttempts(0)
	for _, x := range r.rs.Sessions() {
		x.Close()
	}
	kit.WaitFor(t, 20*time.Second, "device closed", func() bool { return a.State() == DevClosed })
	buf, err := s.Session().AllocBuffer(4096)
	if err != nil {
		t.Fatal(err)
	}
	return s, a, buf
}

// With no_path_timeout 0 IO without a path fails at once.
func TestCltDevNoPathFailsAtOnce(t *testing.T) {
	_, a, buf := lostDevice(t, 0)
	if err := syncIO(a, OpRead, 0, 0, 4096, buf); !errors.Is(err, rtrs.ErrNoPath) {
		t.Fatalf("IO without a path: %v, want ErrNoPath", err)
	}
}

// IO without a path waits no_path_timeout, not less, then fails with
// ECONNABORTED; a new timeout applies to IO that starts waiting after it.
func TestCltDevNoPathTimeout(t *testing.T) {
	s, a, buf := lostDevice(t, 300*time.Millisecond)
	start := time.Now()
	err := syncIO(a, OpRead, 0, 0, 4096, buf)
	if el := time.Since(start); el < 300*time.Millisecond || el > 10*time.Second {
		t.Fatalf("failed after %v, want about 300ms", el)
	}
	if !errors.Is(err, rtrs.ErrNoPath) || !errors.Is(err, syscall.ECONNABORTED) {
		t.Fatalf("IO without a path: %v, want ECONNABORTED", err)
	}
	if err := s.SetNoPathTimeout(-time.Second); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("negative no_path_timeout: %v", err)
	}
	if err := s.SetNoPathTimeout(0); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	if err := syncIO(a, OpRead, 0, 0, 4096, buf); !errors.Is(err, rtrs.ErrNoPath) || time.Since(start) > time.Second {
		t.Fatalf("IO with no_path_timeout 0: %v after %v", err, time.Since(start))
	}
}

// fast_io_fail_tmo counts from the loss of the last path: IO waiting
// then fails when it runs out although no_path_timeout would let it wait
// longer, and IO after that fails at once.
func TestCltDevFastIOFail(t *testing.T) {
	s, a, buf := lostDevice(t, time.Minute)
	since := s.NoPathSince()
	if since.IsZero() || s.FastIOFailTmo() >= 0 || s.FastIOFailIn() != 0 {
		t.Fatalf("no path since %v, fast_io_fail_tmo %v (off by default), in %v", since, s.FastIOFailTmo(), s.FastIOFailIn())
	}
	s.SetFastIOFailTmo(time.Since(since) + 300*time.Millisecond)
	if in := s.FastIOFailIn(); in <= 0 || in > 300*time.Millisecond {
		t.Fatalf("fast_io_fail in %v", in)
	}
	start := time.Now()
	err := syncIO(a, OpRead, 0, 0, 4096, buf)
	if el := time.Since(start); !errors.Is(err, rtrs.ErrNoPath) || el < 250*time.Millisecond || el > 10*time.Second {
		t.Fatalf("IO waiting for a path: %v after %v, want ErrNoPath after about 300ms", err, el)
	}
	if s.FastIOFailIn() >= 0 {
		t.Fatalf("fast_io_fail in %v after it passed", s.FastIOFailIn())
	}
	start = time.Now()
	if err := syncIO(a, OpRead, 0, 0, 4096, buf); !errors.Is(err, rtrs.ErrNoPath) || time.Since(start) > time.Second {
		t.Fatalf("IO after fast_io_fail_tmo: %v after %v, want ErrNoPath at once", err, time.Since(start))
	}
}

// FUA goes on the wire with writes only (the kernel's server would fail a
// FUA discard with EIO, and warn): a FUA discard or write-zeroes is sent
// without it and followed by a flush, before the request completes.
func TestCltDevFUAOnlyOnWrites(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	r.file("f", 1<<20)
	s := r.cltSession("fua", 0)
	d, err := s.Map(context.Background(), "f", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	buf, _ := s.Session().AllocBuffer(4096)
	for _, c := range []struct {
		op    Op
		flags uint32
	}{{OpWrite, FFUA}, {OpDiscard, FFUA}, {OpWriteZeroes, FFUA | FNoUnmap}, {OpDiscard, 0}} {
		if err := syncIO(d, c.op, c.flags, 8192, 4096, buf); err != nil {
			t.Fatalf("%v %s: %v", c.op, FlagString(c.flags), err)
		}
	}
	o := r.srv.OpenDevices()
	if len(o) != 1 || o[0].FUAWrites != 1 || o[0].Flushes != 2 || o[0].Discards != 2 || o[0].WriteZeroes != 1 {
		t.Fatalf("the server saw %+v; want 1 FUA write, 2 flushes, 2 discards, 1 write-zeroes", o)
	}
}

// TestCltDevPlugged submits more requests under one plug than there are
// permits, never unplugging between them: Submit must unplug before it
// waits for a permit, or the held requests would never free one. Then
// the data reads back.
func TestCltDevPlugged(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	path := r.file("a", 4<<20)
	s := r.cltSession("cs", 0)
	a, err := s.Map(context.Background(), "a", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	n := 3 * s.Session().QueueDepth()
	buf, _ := s.Session().AllocBuffer(n * 4096)
	for i := range n {
		copy(buf.Bytes()[i*4096:(i+1)*4096], bytes.Repeat([]byte{byte(i), byte(i >> 8)}, 2048))
	}
	var pl rtrs.Plug
	done := make(chan error, n)
	reqs := make([]IOReq, n)
	for i := range reqs {
		reqs[i] = IOReq{Op: OpWrite, Off: int64(i) * 4096, Len: 4096, Buf: buf, BufOff: i * 4096, Plug: &pl,
			Done: func(_ *IOReq, err error) { done <- err }}
		if err := a.Submit(context.Background(), &reqs[i]); err != nil {
			t.Fatal(err)
		}
	}
	pl.Unplug()
	timeout := time.After(30 * time.Second)
	for range n {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-timeout:
			t.Fatal("plugged writes did not complete")
		}
	}
	b, _ := os.ReadFile(path)
	if !bytes.Equal(b[:n*4096], buf.Bytes()[:n*4096]) {
		t.Fatal("the file does not hold the plugged writes")
	}
}

// holdFirstOpen is an RNBD server that leaves the first OPEN unanswered
// until release is closed: a server stuck in an open (as one opening a
// FIFO was).
type holdFirstOpen struct {
	*Server
	held     atomic.Bool
	release  chan struct{}
	answered chan struct{}
}

func (h *holdFirstOpen) HandleIO(op *rtrs.SrvOp) error {
	if t, err := MsgType(op.Usr()); err == nil && t == MsgOpen && h.held.CompareAndSwap(false, true) {
		go func() {
			<-h.release
			h.Server.sessionIO(op)
			close(h.answered)
		}()
		return nil
	}
	return h.Server.sessionIO(op)
}

// A map whose OPEN the server does not answer returns when its context
// ends, and the answer that comes later corrupts nothing: the next map
// of the session gets its own device.
func TestCltMapAbandoned(t *testing.T) {
	h := &holdFirstOpen{release: make(chan struct{}), answered: make(chan struct{})}
	r := newSrigWith(t, SrvConfig{}, func(s *Server) rtrs.SrvHandler { h.Server = s; return h })
	r.file("a", 1<<20)
	r.file("b", 2<<20)
	c := r.cltSession("s", 0)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	mapped := make(chan error, 1)
	go func() {
		_, err := c.Map(ctx, "a", AccessRW)
		mapped <- err
	}()
	select {
	case err := <-mapped:
		if !errors.Is(err, rtrs.ErrAbandoned) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("map of a held OPEN: %v, want ErrAbandoned and the deadline", err)
		}
	case <-time.After(10 * time.Second):
		close(h.release)
		t.Fatal("map waited for the OPEN past its context")
	}
	close(h.release)
	<-h.answered
	kit.WaitFor(t, 20*time.Second, "the late answer", func() bool {
		return c.Session().Paths()[0].Stats().Counters().Inflight == 0
	})
	d, err := c.Map(context.Background(), "b", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	if d.Size() != 2<<20 {
		t.Fatalf("the second map has size %d, want %d: the late answer of the first got in", d.Size(), 2<<20)
	}
}

// failIO is an RNBD server whose backend fails every IO with EIO.
type failIO struct{ *Server }

func (h failIO) HandleIO(op *rtrs.SrvOp) error {
	if t, err := MsgType(op.Usr()); err == nil && t == MsgIO {
		return syscall.EIO
	}
	return h.Server.sessionIO(op)
}

// An IO the server fails reaches the caller with the server's errno and
// is logged by the client, once per IO and rate-limited.
func TestCltDevLogsFailedIO(t *testing.T) {
	r := newSrigWith(t, SrvConfig{}, func(s *Server) rtrs.SrvHandler { return failIO{s} })
	r.file("a", 1<<20)
	lg, entries := kit.LogRecorder()
	cfg := rtrs.DefaultCltConfig()
	cfg.SessName, cfg.Fabric, cfg.Log = "s", r.fab, lg
	cfg.Paths = []rtrs.PathAddr{{Src: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 20, 3, 1}), 0), Dst: srvAddr}}
	c, err := DialSession(context.Background(), cfg, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	d, err := c.Map(context.Background(), "a", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	buf, err := c.Session().AllocBuffer(4096)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 30; i++ {
		if err := syncIO(d, OpWrite, 0, 8192, 4096, buf); !errors.Is(err, syscall.EIO) {
			t.Fatalf("write: %v, want EIO", err)
		}
	}
	n := 0
	for _, e := range entries() {
		if e.Message == "IO failed" {
			n++
			if e.Data["offset"] != int64(8192) || e.Data["length"] != 4096 || !errors.Is(e.Data["error"].(error), syscall.EIO) {
				t.Errorf("logged %v", e.Data)
			}
		}
	}
	if n < 1 || n > 20 {
		t.Fatalf("%d 'IO failed' entries for 30 failed writes, want 1 to the limiter's burst", n)
	}
}

// TestCltDevReopenRetried: a device whose reopen after a reconnect failed
// (its export's mount did not answer the server then) is reopened at a
// later size poll, and the IO that waited for it goes; it used to stay
// closed until the next reconnect.
func TestCltDevReopenRetried(t *testing.T) {
	var hung atomic.Bool
	var refused atomic.Int32
	r := newSrig(t, SrvConfig{Answers: func(p string) error {
		if hung.Load() {
			refused.Add(1)
			return &os.PathError{Op: "stat", Path: p, Err: syscall.ETIMEDOUT}
		}
		return nil
	}})
	p := r.file("exp/vol", 1<<20)
	if err := r.srv.Map(Export{Name: "vol", Path: p}); err != nil {
		t.Fatal(err)
	}
	s := r.cltSession("cs", 30*time.Second)
	s.SetSizePoll(20 * time.Millisecond)
	a, err := s.Map(context.Background(), "vol", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	hung.Store(true)
	for _, x := range r.rs.Sessions() {
		x.Close()
	}
	kit.WaitFor(t, 20*time.Second, "the device closed", func() bool { return a.State() == DevClosed })
	kit.WaitFor(t, 20*time.Second, "the session back", func() bool { return s.Session().Connected() })
	buf, _ := s.Session().AllocBuffer(4096)
	copy(buf.Bytes(), bytes.Repeat([]byte{0x3c}, 4096))
	done := make(chan error, 1)
	if err := a.Submit(context.Background(), &IOReq{Op: OpWrite, Off: 0, Len: 4096, Buf: buf,
		Done: func(_ *IOReq, err error) { done <- err }}); err != nil {
		t.Fatal(err)
	}
	// The reopen after the reconnect and two at size polls refused.
	kit.WaitFor(t, 20*time.Second, "reopens refused", func() bool { return refused.Load() >= 3 })
	if st := a.State(); st != DevClosed {
		t.Fatalf("state %v while the server's mount does not answer", st)
	}
	hung.Store(false)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the write that waited: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the device was not reopened once its mount answered")
	}
	if b, _ := os.ReadFile(p); !bytes.Equal(b[:4096], bytes.Repeat([]byte{0x3c}, 4096)) {
		t.Fatal("the file does not hold the write")
	}
}

// When the server goes with requests in flight, the client logs each
// event once per device — the requests that wait, then those that fail
// at no_path_timeout — not once per request or retry (issue 31: 8
// requests in flight when the server stopped gave 418 lines of
// "resubmitting requests that waited for the device", 10 of "posting a
// request failed" in one second; here an "IO failed" line per request
// followed the one that failed them all).
func TestCltDevNoLogFloodWhenServerGoes(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	r.file("a", 1<<20)
	lg, entries := kit.LogRecorder()
	cfg := rtrs.DefaultCltConfig()
	cfg.SessName, cfg.Fabric, cfg.Log = "cs", r.fab, lg
	cfg.ConnsPerPath = 2
	cfg.ReconnectDelay, cfg.ReconnectJitter = 20*time.Millisecond, time.Millisecond
	cli := netip.AddrFrom4([4]byte{10, 20, 2, 99})
	cfg.Paths = []rtrs.PathAddr{{Src: netip.AddrPortFrom(cli, 0), Dst: srvAddr}}
	s, err := DialSession(context.Background(), cfg, 1500*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	a, err := s.Map(context.Background(), "a", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	s.SetSizePoll(0)
	hold := make(chan struct{})
	var held atomic.Int32
	r.srv.beforeIO = func() {
		if held.Add(1) <= 8 {
			<-hold // the first 8 are in flight when the server goes
		}
	}
	done := make(chan error, 8)
	for i := 0; i < 8; i++ {
		buf, _ := s.Session().AllocBuffer(4096)
		if err := a.Submit(context.Background(), &IOReq{Op: OpWrite, Off: int64(i) * 4096, Len: 4096, Buf: buf,
			Done: func(_ *IOReq, err error) { done <- err }}); err != nil {
			t.Fatal(err)
		}
	}
	kit.WaitFor(t, 20*time.Second, "8 writes at the server", func() bool { return held.Load() == 8 })
	// The server stops: no new paths, its sessions closed (their IO is
	// answered once the backend returns it).
	stopped := make(chan struct{})
	go func() {
		r.rs.Close()
		close(stopped)
	}()
	time.AfterFunc(200*time.Millisecond, func() { close(hold) })
	for i := 0; i < 8; i++ {
		select {
		case err := <-done:
			if !errors.Is(err, rtrs.ErrNoPath) {
				t.Fatalf("a write with the server gone: %v, want ErrNoPath after no_path_timeout", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the writes never ended")
		}
	}
	<-stopped
	count := map[string]int{}
	for _, e := range entries() {
		count[e.Message]++
	}
	for _, msg := range []string{"resubmitting requests that waited for the device", "posting a request failed",
		"no path within no_path_timeout (or fast_io_fail_tmo): failing requests"} {
		if n := count[msg]; n > 2 {
			t.Errorf("%q logged %d times for one loss of the server", msg, n)
		}
	}
	// The requests' failure is that event's, said once for them all.
	if n := count["IO failed"]; n != 0 {
		t.Errorf(`"IO failed" logged %d times beside the no_path_timeout line that failed them`, n)
	}
	t.Logf("logged: %v", count)
}

// Requests that find no path while the device is still open — the
// session's last path is being torn down and the device has not been
// told — wait and are sent again every parkedRetry, not at once in a
// loop: that loop wrote "resubmitting requests that waited for the
// device" hundreds of times a second (issue 31), and spun a CPU. Once
// the path is back and the device reopened they go, logged once.
func TestCltDevNoResubmitLoop(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	r.file("a", 1<<20)
	lg, entries := kit.LogRecorder()
	cfg := rtrs.DefaultCltConfig()
	cfg.SessName, cfg.Fabric, cfg.Log = "cs", r.fab, lg
	cfg.ConnsPerPath = 2
	cfg.ReconnectDelay, cfg.ReconnectJitter = 20*time.Millisecond, time.Millisecond
	cli := netip.AddrFrom4([4]byte{10, 20, 2, 98})
	cfg.Paths = []rtrs.PathAddr{{Src: netip.AddrPortFrom(cli, 0), Dst: srvAddr}}
	s, err := DialSession(context.Background(), cfg, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	a, err := s.Map(context.Background(), "a", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	s.SetSizePoll(0)
	r.net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkDown)
	kit.WaitFor(t, 20*time.Second, "device closed", func() bool { return a.State() == DevClosed })
	// The moment before the session tells the device: open, no path.
	a.ioMu.Lock()
	a.state.Store(int32(DevOpen))
	a.ioMu.Unlock()
	resubmits := func(level log.Level) (n int) {
		for _, e := range entries() {
			if e.Message == "resubmitting requests that waited for the device" && e.Level == level {
				n++
			}
		}
		return n
	}
	began := time.Now()
	done := make(chan error, 8)
	for i := 0; i < 8; i++ {
		buf, _ := s.Session().AllocBuffer(4096)
		if err := a.Submit(context.Background(), &IOReq{Op: OpWrite, Off: int64(i) * 4096, Len: 4096, Buf: buf,
			Done: func(_ *IOReq, err error) { done <- err }}); err != nil {
			t.Fatal(err)
		}
	}
	// Five retries, timed: every parkedRetry they take half a second; a
	// loop makes them in a moment, and hundreds more.
	kit.WaitFor(t, 20*time.Second, "five resubmissions", func() bool {
		return resubmits(log.InfoLevel)+resubmits(log.DebugLevel) >= 5
	})
	if n := resubmits(log.InfoLevel); n > 0 {
		t.Errorf("%d resubmissions logged at info without a path, want none", n)
	}
	if n, took := resubmits(log.DebugLevel), time.Since(began); n > int(took/parkedRetry)+2 {
		t.Errorf("%d retries in %v, want one every %v", n, took, parkedRetry)
	}
	// Now the session tells it (DISCONNECTED), as it does before any
	// path comes back; then the path comes back and the device reopens.
	a.disconnected()
	r.net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkUp)
	for i := 0; i < 8; i++ {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("a write across the loss: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the writes across the loss never completed")
		}
	}
}
