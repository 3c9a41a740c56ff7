// Tests of the LINK_DEAD watch: decoding the multicast, the watcher's
// loop over a fake socket and over genltest's, and its errors.

package nbdnl

import (
	"context"
	"errors"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/genetlink/genltest"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

func TestDecodeLinkDead(t *testing.T) {
	b := encodeIndex(4)
	if idx, ok := decodeLinkDead(genetlink.Message{Header: genetlink.Header{Command: cmdLinkDead, Version: 1}, Data: b}); !ok || idx != 4 {
		t.Fatalf("LINK_DEAD: %d %v", idx, ok)
	}
	for name, m := range map[string]genetlink.Message{
		"another command": {Header: genetlink.Header{Command: cmdStatus}, Data: b},
		"truncated":       {Header: genetlink.Header{Command: cmdLinkDead}, Data: []byte{8, 0, 1}},
		"no index":        {Header: genetlink.Header{Command: cmdLinkDead}},
		"short index":     {Header: genetlink.Header{Command: cmdLinkDead}, Data: []byte{6, 0, attrIndex, 0, 4, 0, 0, 0}},
	} {
		if _, ok := decodeLinkDead(m); ok {
			t.Errorf("%s taken for LINK_DEAD", name)
		}
	}
}

// fakeWatch is a watchConn whose Receive calls recv until Close.
type fakeWatch struct {
	recv   func(closed <-chan struct{}) ([]genetlink.Message, []netlink.Message, error)
	closed chan struct{}
	once   sync.Once
	joined []uint32
}

func newFakeWatch(recv func(closed <-chan struct{}) ([]genetlink.Message, []netlink.Message, error)) *fakeWatch {
	return &fakeWatch{recv: recv, closed: make(chan struct{})}
}

func (f *fakeWatch) JoinGroup(g uint32) error { f.joined = append(f.joined, g); return nil }

func (f *fakeWatch) Receive() ([]genetlink.Message, []netlink.Message, error) {
	return f.recv(f.closed)
}

func (f *fakeWatch) Close() error { f.once.Do(func() { close(f.closed) }); return nil }

func linkDead(idx uint32) genetlink.Message {
	return genetlink.Message{Header: genetlink.Header{Command: cmdLinkDead, Version: 1}, Data: encodeIndex(idx)}
}

// TestRunWatch: notifications arrive in order, other messages are
// skipped, ENOBUFS does not end the watch, and cancelling the context
// closes the socket under a blocked Receive and then the channel.
func TestRunWatch(t *testing.T) {
	step := 0
	fw := newFakeWatch(func(closed <-chan struct{}) ([]genetlink.Message, []netlink.Message, error) {
		step++
		switch step {
		case 1:
			return []genetlink.Message{
				{Header: genetlink.Header{Command: cmdStatus, Version: 1}, Data: encodeIndex(1)}, // not for us
				linkDead(9),
			}, nil, nil
		case 2:
			return nil, nil, &netlink.OpError{Op: "receive", Err: os.NewSyscallError("recvmsg", unix.ENOBUFS)}
		case 3:
			return []genetlink.Message{linkDead(10), linkDead(11)}, nil, nil
		}
		<-closed
		return nil, nil, errors.New("use of closed socket")
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch := runWatch(ctx, fw)
	for _, want := range []uint32{9, 10, 11} {
		select {
		case idx := <-ch:
			if idx != want {
				t.Fatalf("LINK_DEAD of %d, want %d", idx, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("LINK_DEAD of %d not delivered", want)
		}
	}
	cancel()
	for range ch {
	}
	select {
	case <-fw.closed:
	default:
		t.Fatal("the socket stayed open")
	}
}

// TestRunWatchSocketFails: a failing socket closes the channel (and the
// socket) without the context ending.
func TestRunWatchSocketFails(t *testing.T) {
	fw := newFakeWatch(func(<-chan struct{}) ([]genetlink.Message, []netlink.Message, error) {
		return nil, nil, unix.EBADF
	})
	for range runWatch(context.Background(), fw) {
		t.Fatal("a notification from nowhere")
	}
	select {
	case <-fw.closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the socket stayed open")
	}
}

// TestRunWatchReceiverGone: the context ends while nobody reads and the
// buffer is full; nothing leaks (goleak checks at the end).
func TestRunWatchReceiverGone(t *testing.T) {
	fw := newFakeWatch(func(closed <-chan struct{}) ([]genetlink.Message, []netlink.Message, error) {
		select {
		case <-closed:
			return nil, nil, errors.New("closed")
		default:
			return []genetlink.Message{linkDead(1)}, nil, nil
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	ch := runWatch(ctx, fw)
	// Wait (bounded) until the watcher is blocked on a full channel.
	for start := time.Now(); len(ch) < cap(ch); time.Sleep(time.Millisecond) {
		if time.Since(start) > 10*time.Second {
			t.Fatal("the watcher never filled its channel")
		}
	}
	cancel()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		case <-deadline:
			t.Fatal("the channel stayed open")
		}
	}
}

// genlWatch is a genltest connection standing in for the multicast
// socket: genltest cannot join groups, so JoinGroup only records.
type genlWatch struct {
	*genetlink.Conn
	joined []uint32
	closed chan struct{}
	once   sync.Once
}

func (g *genlWatch) JoinGroup(id uint32) error { g.joined = append(g.joined, id); return nil }

func (g *genlWatch) Close() error {
	g.once.Do(func() { close(g.closed) })
	return g.Conn.Close()
}

// TestWatchLinkDead drives the method end to end: it joins the family's
// group on a socket of its own, decodes what genetlink receives, and
// stops with its context.
func TestWatchLinkDead(t *testing.T) {
	c := fake(t, func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		t.Error("the watch used the command socket")
		return nil, nil
	})
	gw := &genlWatch{closed: make(chan struct{})}
	sent := false
	gw.Conn = genltest.Dial(func(greq genetlink.Message, nreq netlink.Message) ([]genetlink.Message, error) {
		if nreq.Header.Type != 0 || len(greq.Data) != 0 {
			t.Errorf("the watch sent a request: %+v", nreq.Header)
		}
		if !sent { // a multicast notification
			sent = true
			return []genetlink.Message{linkDead(6)}, nil
		}
		<-gw.closed
		return nil, errors.New("closed")
	})
	dials := 0
	c.dialWatch = func() (watchConn, error) { dials++; return gw, nil }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := c.WatchLinkDead(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if dials != 1 || len(gw.joined) != 1 || gw.joined[0] != 7 {
		t.Fatalf("dials %d, joined %v; want one socket joined to group 7", dials, gw.joined)
	}
	select {
	case idx := <-ch:
		if idx != 6 {
			t.Fatalf("LINK_DEAD of %d, want 6", idx)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no LINK_DEAD delivered")
	}
	cancel()
	for range ch {
	}
}

func TestWatchLinkDeadErrors(t *testing.T) {
	// A family without the group.
	nogroup := family
	nogroup.Groups = nil
	gc := genltest.Dial(genltest.ServeFamily(nogroup, nil))
	c, err := newConn(gc)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.dialWatch = func() (watchConn, error) {
		t.Error("dialled without a group to join")
		return nil, unix.EINVAL
	}
	if _, err := c.WatchLinkDead(context.Background()); !errors.Is(err, unix.ENOENT) {
		t.Errorf("no group: %v, want ENOENT", err)
	}

	// Joining fails: the error comes back and the socket is closed.
	c2 := fake(t, nil)
	fw := newFakeWatch(nil)
	c2.dialWatch = func() (watchConn, error) { return joinFails{fw}, nil }
	if _, err := c2.WatchLinkDead(context.Background()); !errors.Is(err, unix.EPERM) {
		t.Errorf("join: %v, want EPERM", err)
	}
	select {
	case <-fw.closed:
	default:
		t.Error("the socket stayed open after a failed join")
	}

	// Dialling fails.
	c2.dialWatch = func() (watchConn, error) { return nil, unix.EMFILE }
	if _, err := c2.WatchLinkDead(context.Background()); !errors.Is(err, unix.EMFILE) {
		t.Errorf("dial: %v, want EMFILE", err)
	}
}

type joinFails struct{ *fakeWatch }

func (joinFails) JoinGroup(uint32) error { return unix.EPERM }

func FuzzDecodeLinkDead(f *testing.F) {
	f.Add(uint8(cmdLinkDead), encodeIndex(3))
	f.Add(uint8(cmdLinkDead), []byte{})
	f.Add(uint8(cmdStatus), encodeIndex(3))
	f.Add(uint8(cmdLinkDead), []byte{8, 0, attrIndex, 0})
	f.Fuzz(func(t *testing.T, cmd uint8, b []byte) {
		idx, ok := decodeLinkDead(genetlink.Message{Header: genetlink.Header{Command: cmd, Version: 1}, Data: b})
		if !ok {
			return
		}
		if cmd != cmdLinkDead {
			t.Fatalf("command %d taken for LINK_DEAD", cmd)
		}
		if i2, ok2, err := decodeIndex(b); err != nil || !ok2 || i2 != idx {
			t.Fatalf("LINK_DEAD gave %d, decodeIndex %d %v %v", idx, i2, ok2, err)
		}
	})
}
