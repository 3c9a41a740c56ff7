package rnbd

import (
	"bytes"
	"context"
	"errors"
	"github.com/rnbd/rnbd/test/kit"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs"
)

// countMsgs is an RNBD server that counts the OPENs and CLOSEs it gets.
type countMsgs struct {
	*Server
	opens, closes atomic.Int32
}

func (h *countMsgs) HandleIO(op *rtrs.SrvOp) error {
	if t, err := MsgType(op.Usr()); err == nil {
		switch t {
		case MsgOpen:
			h.opens.Add(1)
		case MsgClose:
			h.closes.Add(1)
		}
	}
	return h.Server.sessionIO(op)
}

// kernelForceClose closes device name for session sess as the kernel's
// rnbd_server (6.12) does on force_close: its "keep the id reserved"
// frees the slot, and the session's next OPEN gets the same id back —
// for that device or for another.
func kernelForceClose(t *testing.T, r *srig, name, sess string) {
	t.Helper()
	if n, err := r.srv.ForceClose(name, sess); n != 1 || err != nil {
		t.Fatalf("force close %s of %s: %d %v", name, sess, n, err)
	}
	r.srv.mu.Lock()
	var xs []*SrvSession
	for _, x := range r.srv.sessions {
		if x.name == sess {
			xs = append(xs, x)
		}
	}
	r.srv.mu.Unlock()
	for _, x := range xs {
		x.mu.Lock()
		for id, d := range x.devs {
			if d == nil {
				delete(x.devs, id)
				x.nextID = id - 1
			}
		}
		x.mu.Unlock()
	}
}

// serverClosedRig maps "a" (1 MiB, a block of 0x3c written at 0) through
// a session that polls sizes every 20 ms.
func serverClosedRig(t *testing.T) (*srig, *countMsgs, *CltSession, *CltDev, *rtrs.Buffer) {
	h := &countMsgs{}
	r := newSrigWith(t, SrvConfig{}, func(s *Server) rtrs.SrvHandler { h.Server = s; return h })
	r.file("a", 1<<20)
	r.file("b", 1<<20)
	c := r.cltSession("s", 30*time.Second)
	d, err := c.Map(context.Background(), "a", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	buf, _ := c.Session().AllocBuffer(4096)
	copy(buf.Bytes(), bytes.Repeat([]byte{0x3c}, 4096))
	if err := syncIO(d, OpWrite, 0, 0, 4096, buf); err != nil {
		t.Fatal(err)
	}
	c.SetSizePoll(20 * time.Millisecond)
	return r, h, c, d, buf
}

// pausePolls stops the session's size polls and waits for one under way
// to end, so that what the test does next does not land in the moment
// between a poll's read and its OPEN (the race docs/client.md owns to).
func pausePolls(c *CltSession, h *countMsgs) {
	c.SetSizePoll(0)
	for n := h.opens.Load(); ; {
		time.Sleep(50 * time.Millisecond)
		m := h.opens.Load()
		if m == n {
			return
		}
		n = m
	}
}

// stillClosed checks that d stays closed by its server over several size
// polls: no OPEN reaches the server, nothing is open there, its IO fails
// with ENOTCONN without reaching the server; then a remap opens it again
// and its data is there.
func stillClosed(t *testing.T, r *srig, h *countMsgs, d *CltDev, buf *rtrs.Buffer) {
	t.Helper()
	kit.WaitFor(t, 20*time.Second, "the device closed by its server", func() bool { return d.State() == DevSrvClosed })
	opens := h.opens.Load()
	time.Sleep(200 * time.Millisecond) // ten size polls
	if n := h.opens.Load() - opens; n != 0 || d.State() != DevSrvClosed || len(r.srv.OpenDevices()) != 0 {
		t.Fatalf("after ten size polls: %d OPENs, state %v, %d devices open on the server", n, d.State(), len(r.srv.OpenDevices()))
	}
	if d.State().String() != "closed by server" {
		t.Fatalf("state shown as %q", d.State())
	}
	for _, op := range []Op{OpWrite, OpRead, OpFlush} {
		if err := syncIO(d, op, 0, 0, 4096, buf); !errors.Is(err, syscall.ENOTCONN) {
			t.Fatalf("%v on a device its server closed: %v, want ENOTCONN", op, err)
		}
	}
	if err := d.Remap(context.Background()); err != nil || d.State() != DevOpen {
		t.Fatalf("remap: %v, state %v", err, d.State())
	}
	clear(buf.Bytes())
	if err := syncIO(d, OpRead, 0, 0, 4096, buf); err != nil || !bytes.Equal(buf.Bytes(), bytes.Repeat([]byte{0x3c}, 4096)) {
		t.Fatalf("read after the remap: %v", err)
	}
}

// A device its server's administrator closed stays closed, against our
// server (which keeps the id reserved, so a reopen gets another).
func TestCltDevServerCloseSticks(t *testing.T) {
	r, h, c, d, buf := serverClosedRig(t)
	pausePolls(c, h)
	if n, err := r.srv.ForceClose("a", "s"); n != 1 || err != nil {
		t.Fatalf("force close: %d %v", n, err)
	}
	c.SetSizePoll(20 * time.Millisecond)
	stillClosed(t, r, h, d, buf)
}

// The same against a server that hands the same id back, as the
// kernel's: the size poll's OPEN used to reopen the device 20 ms later
// under the id it had, and its IO went on as if nothing had happened.
func TestCltDevServerCloseSticksKernelIDs(t *testing.T) {
	r, h, c, d, buf := serverClosedRig(t)
	pausePolls(c, h)
	kernelForceClose(t, r, "a", "s")
	c.SetSizePoll(20 * time.Millisecond)
	stillClosed(t, r, h, d, buf)
}

// Without size polls an IO answered ENOTCONN closes the device the same
// way; a reconnect of the session does not reopen it, a remap does. An
// unmap of it sends no CLOSE: the kernel's server may have given its id
// to another device of the session since.
func TestCltDevServerCloseFoundByIO(t *testing.T) {
	r, h, c, d, buf := serverClosedRig(t)
	pausePolls(c, h)
	kernelForceClose(t, r, "a", "s")
	if err := syncIO(d, OpWrite, 0, 4096, 4096, buf); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("write after the server's close: %v, want ENOTCONN", err)
	}
	kit.WaitFor(t, 20*time.Second, "the device closed by its server", func() bool { return d.State() == DevSrvClosed })
	// Another device of the session gets the freed id.
	b, err := c.Map(context.Background(), "b", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	if b.Info().DeviceID != d.Info().DeviceID {
		t.Fatalf("b got id %d, a had %d: the rig does not reuse ids as the kernel does", b.Info().DeviceID, d.Info().DeviceID)
	}
	// Every path lost and back: b is reopened, a is not.
	for _, x := range r.rs.Sessions() {
		x.Close()
	}
	kit.WaitFor(t, 20*time.Second, "b reopened after the reconnect", func() bool { return b.State() == DevOpen && c.Session().Connected() })
	time.Sleep(50 * time.Millisecond)
	if d.State() != DevSrvClosed {
		t.Fatalf("a after the reconnect: %v", d.State())
	}
	closes := h.closes.Load()
	if err := d.Unmap(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := h.closes.Load() - closes; n != 0 {
		t.Fatalf("unmapping a device its server closed sent %d CLOSEs", n)
	}
	if err := syncIO(b, OpWrite, 0, 0, 4096, buf); err != nil {
		t.Fatalf("b after a was unmapped: %v", err)
	}
}
