package rnbd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/test/kit"
)

// countMsgs is an RNBD server that counts the OPENs it gets, by device
// name, and the CLOSEs.
type countMsgs struct {
	*Server
	mu     sync.Mutex
	opens  map[string]int // +checklocks:mu
	closes atomic.Int32
}

func (h *countMsgs) HandleIO(op *rtrs.SrvOp) error {
	if t, err := MsgType(op.Usr()); err == nil {
		switch t {
		case MsgOpen:
			var m Open
			if m.Decode(op.Usr()) == nil {
				h.mu.Lock()
				if h.opens == nil {
					h.opens = map[string]int{}
				}
				h.opens[m.DevName]++
				h.mu.Unlock()
			}
		case MsgClose:
			h.closes.Add(1)
		}
	}
	return h.Server.sessionIO(op)
}

// opened is how many OPENs of the device name the server got.
func (h *countMsgs) opened(name string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.opens[name]
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

// serverClosedRig maps "a" (1 MiB, a block of 0x3c written at 0), then a
// clock (mapClock), through a session that polls sizes every 20 ms.
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
	r.mapClock(c)
	c.SetSizePoll(20 * time.Millisecond)
	return r, h, c, d, buf
}

// mapClock maps "clock", a file of its own, through c after the devices
// a test watches: a size poll goes through the session's devices in the
// order they were mapped and OPENs each one open, so every OPEN of the
// clock the server gets (h counts them, waitPolls) is a poll that has
// been through those devices.
func (r *srig) mapClock(c *CltSession) {
	r.t.Helper()
	r.file("clock", 1<<20)
	if _, err := c.Map(context.Background(), "clock", AccessRO); err != nil {
		r.t.Fatal(err)
	}
}

// waitPolls waits until the session with the clock (mapClock) has polled
// the sizes of its devices n times after the call: a poll under way then
// may OPEN the clock after the call, so n+1 OPENs of it.
func (h *countMsgs) waitPolls(t *testing.T, n int) {
	t.Helper()
	from := h.opened("clock")
	kit.WaitFor(t, 20*time.Second, fmt.Sprintf("%d size polls", n), func() bool { return h.opened("clock") >= from+n+1 })
}

// openOnServer reports whether a session has the device name open on the
// server.
func (r *srig) openOnServer(name string) bool {
	for _, o := range r.srv.OpenDevices() {
		if o.Name == name {
			return true
		}
	}
	return false
}

// pausePolls stops the session's size polls and waits for one under way
// to end, so that what the test does next does not land in the moment
// between a poll's read and its OPEN (the race docs/client.md owns to).
// SetSizePoll leaves a token in pollQ, which the session's loop takes
// only between polls and after which it starts none (the poll is 0): the
// token taken, no poll is under way or to come.
func pausePolls(t *testing.T, c *CltSession) {
	t.Helper()
	c.SetSizePoll(0)
	kit.WaitFor(t, 10*time.Second, "the size poll under way to end", func() bool { return len(c.pollQ) == 0 })
}

// stillClosed checks that d stays closed by its server over several size
// polls: no OPEN reaches the server, nothing is open there, its IO fails
// with ENOTCONN without reaching the server; then a remap opens it again
// and its data is there.
func stillClosed(t *testing.T, r *srig, h *countMsgs, d *CltDev, buf *rtrs.Buffer) {
	t.Helper()
	kit.WaitFor(t, 20*time.Second, "the device closed by its server", func() bool { return d.State() == DevSrvClosed })
	opens := h.opened("a")
	h.waitPolls(t, 10)
	if n := h.opened("a") - opens; n != 0 || d.State() != DevSrvClosed || r.openOnServer("a") {
		t.Fatalf("after ten size polls: %d OPENs of a, state %v, open on the server: %v", n, d.State(), r.srv.OpenDevices())
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
	pausePolls(t, c)
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
	pausePolls(t, c)
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
	pausePolls(t, c)
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
	// Every path lost and back: b is reopened, a is not. The session
	// reopens its devices in the order they were mapped, a first: once
	// b's OPEN reached the server, a's turn is over.
	aOpens, bOpens := h.opened("a"), h.opened("b")
	for _, x := range r.rs.Sessions() {
		x.Close()
	}
	kit.WaitFor(t, 20*time.Second, "b reopened after the reconnect", func() bool {
		return h.opened("b") > bOpens && b.State() == DevOpen && c.Session().Connected()
	})
	if n := h.opened("a") - aOpens; n != 0 || d.State() != DevSrvClosed {
		t.Fatalf("a after the reconnect: %d OPENs of it, state %v", n, d.State())
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
