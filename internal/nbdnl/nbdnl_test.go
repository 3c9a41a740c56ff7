package nbdnl

import (
	"context"
	"errors"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/genetlink/genltest"
	"github.com/mdlayher/netlink"
	"github.com/mdlayher/netlink/nlenc"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// family is the fake kernel's nbd family.
var family = genetlink.Family{
	ID: 0x1d, Version: 1, Name: FamilyName,
	Groups: []genetlink.MulticastGroup{{ID: 7, Name: groupName}},
}

// fake dials a Conn whose kernel is fn.
func fake(t *testing.T, fn genltest.Func) *Conn {
	t.Helper()
	c, err := newConn(genltest.Dial(genltest.ServeFamily(family, fn)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// attrs decodes a request's top-level attributes by type.
func attrs(t *testing.T, b []byte) map[uint16][]byte {
	t.Helper()
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		t.Fatal(err)
	}
	out := map[uint16][]byte{}
	for ad.Next() {
		out[ad.Type()] = ad.Bytes()
	}
	if err := ad.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// socketFDs decodes NBD_ATTR_SOCKETS.
func socketFDs(t *testing.T, b []byte) []uint32 {
	t.Helper()
	var fds []uint32
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		t.Fatal(err)
	}
	for ad.Next() {
		if ad.Type() != sockItem {
			t.Fatalf("socket list item of type %d", ad.Type())
		}
		ad.Nested(func(s *netlink.AttributeDecoder) error {
			for s.Next() {
				if s.Type() == sockFD {
					fds = append(fds, s.Uint32())
				}
			}
			return nil
		})
	}
	if err := ad.Err(); err != nil {
		t.Fatal(err)
	}
	return fds
}

func indexReply(idx uint32) []genetlink.Message {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, idx)
	b, _ := ae.Encode()
	return []genetlink.Message{{Header: genetlink.Header{Command: cmdConnect, Version: 1}, Data: b}}
}

func socketpair(t *testing.T) []*os.File {
	t.Helper()
	var out []*os.File
	for i := 0; i < 2; i++ {
		fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
		if err != nil {
			t.Fatal(err)
		}
		a, b := os.NewFile(uintptr(fds[0]), "a"), os.NewFile(uintptr(fds[1]), "b")
		t.Cleanup(func() { a.Close(); b.Close() })
		out = append(out, a)
	}
	return out
}

func TestConnectSendsEverything(t *testing.T) {
	socks := socketpair(t)
	var got map[uint16][]byte
	c := fake(t, genltest.CheckRequest(family.ID, cmdConnect, netlink.Request,
		func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
			got = attrs(t, greq.Data)
			return indexReply(3), nil
		}))
	cfg := Config{Index: -1, SizeBytes: 1 << 30, BlockSize: 4096, Timeout: 30 * time.Second,
		DeadConnTimeout: 1500 * time.Millisecond, ServerFlags: 1 | 4 | 8, ClientFlags: DestroyOnDisconnect,
		BackendID: "rnbd:s1/vol1"}
	idx, err := c.Connect(cfg, socks)
	if err != nil || idx != 3 {
		t.Fatalf("Connect: index %d, %v", idx, err)
	}
	if _, ok := got[attrIndex]; ok {
		t.Fatal("index sent with Index -1: the kernel would not pick a device")
	}
	for _, w := range []struct {
		attr uint16
		want uint64
	}{
		{attrSizeBytes, 1 << 30}, {attrBlockSizeBytes, 4096}, {attrTimeout, 30},
		{attrDeadConnTimeout, 2}, // rounded up to whole seconds
		{attrServerFlags, 13}, {attrClientFlags, DestroyOnDisconnect},
	} {
		if b := got[w.attr]; len(b) != 8 || nlenc.Uint64(b) != w.want {
			t.Errorf("attribute %d = %x, want u64 %d", w.attr, b, w.want)
		}
	}
	if id := got[attrBackendIdentifier]; nlenc.String(id) != "rnbd:s1/vol1" {
		t.Errorf("backend identifier %q", id)
	}
	fds := socketFDs(t, got[attrSockets])
	if len(fds) != 2 || fds[0] != uint32(socks[0].Fd()) || fds[1] != uint32(socks[1].Fd()) {
		t.Fatalf("sockets %v, want the descriptors of both", fds)
	}

	// A chosen index is sent.
	cfg.Index = 5
	c2 := fake(t, func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
		got = attrs(t, greq.Data)
		return indexReply(5), nil
	})
	if idx, err := c2.Connect(cfg, socks[:1]); err != nil || idx != 5 {
		t.Fatalf("Connect(5): %d, %v", idx, err)
	}
	if b := got[attrIndex]; len(b) != 4 || nlenc.Uint32(b) != 5 {
		t.Fatalf("index attribute %x", b)
	}
	if _, err := c2.Connect(cfg, nil); err == nil {
		t.Fatal("CONNECT without sockets accepted")
	}
}

func TestKernelErrorsKeepTheirErrno(t *testing.T) {
	c := fake(t, func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		return nil, genltest.Error(int(syscall.EBUSY))
	})
	if _, err := c.Connect(Config{Index: 0, SizeBytes: 4096}, socketpair(t)); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("Connect: %v, want EBUSY", err)
	}
	if err := c.Disconnect(0); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("Disconnect: %v, want EBUSY", err)
	}
	c2 := fake(t, func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		return []genetlink.Message{{Data: []byte{1, 2}}}, nil // a truncated attribute
	})
	if _, err := c2.Connect(Config{Index: -1}, socketpair(t)); err == nil {
		t.Fatal("a malformed CONNECT reply was accepted")
	}
}

// ack stands for the kernel's acknowledgement in the fake.
var ack = []genetlink.Message{{Header: genetlink.Header{Version: 1}}}

func TestDisconnectAndReconfigureAsk(t *testing.T) {
	var got map[uint16][]byte
	c := fake(t, genltest.CheckRequest(family.ID, cmdDisconnect, netlink.Request|netlink.Acknowledge,
		func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
			got = attrs(t, greq.Data)
			return ack, nil
		}))
	if err := c.Disconnect(7); err != nil {
		t.Fatal(err)
	}
	if nlenc.Uint32(got[attrIndex]) != 7 {
		t.Fatalf("DISCONNECT of %x", got[attrIndex])
	}

	socks := socketpair(t)
	c2 := fake(t, genltest.CheckRequest(family.ID, cmdReconfigure, netlink.Request|netlink.Acknowledge,
		func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
			got = attrs(t, greq.Data)
			return ack, nil
		}))
	if err := c2.Reconfigure(7, Config{SizeBytes: 1 << 20, DeadConnTimeout: 10 * time.Second, BackendID: "rnbd:s/d"}, socks[:1]); err != nil {
		t.Fatal(err)
	}
	if nlenc.Uint32(got[attrIndex]) != 7 || nlenc.Uint64(got[attrDeadConnTimeout]) != 10 || nlenc.String(got[attrBackendIdentifier]) != "rnbd:s/d" {
		t.Fatalf("RECONFIGURE attributes %v", got)
	}
	if _, ok := got[attrSizeBytes]; ok {
		t.Fatal("RECONFIGURE sent a size")
	}
	if fds := socketFDs(t, got[attrSockets]); len(fds) != 1 || fds[0] != uint32(socks[0].Fd()) {
		t.Fatalf("RECONFIGURE sockets %v", fds)
	}
}

// statusReply builds a STATUS reply listing devices.
func statusReply(devs map[uint32]bool) []byte {
	ae := netlink.NewAttributeEncoder()
	ae.Nested(attrDeviceList, func(l *netlink.AttributeEncoder) error {
		for idx, conn := range devs {
			l.Nested(deviceItem, func(it *netlink.AttributeEncoder) error {
				it.Uint32(deviceIndex, idx)
				v := uint8(0)
				if conn {
					v = 1
				}
				it.Uint8(deviceConnected, v)
				return nil
			})
		}
		return nil
	})
	b, _ := ae.Encode()
	return b
}

func TestStatus(t *testing.T) {
	devs := map[uint32]bool{0: true, 1: false, 15: true}
	c := fake(t, genltest.CheckRequest(family.ID, cmdStatus, netlink.Request,
		func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
			return []genetlink.Message{{Header: genetlink.Header{Command: cmdStatus, Version: 1}, Data: statusReply(devs)}}, nil
		}))
	all, err := c.StatusAll()
	if err != nil || len(all) != 3 || !all[0] || all[1] || !all[15] {
		t.Fatalf("StatusAll: %v, %v", all, err)
	}
	if ok, err := c.Status(1); err != nil || ok {
		t.Fatalf("Status(1): %v, %v", ok, err)
	}
	if _, err := c.Status(2); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Status of a missing device: %v", err)
	}
}

func TestNoFamily(t *testing.T) {
	gc := genltest.Dial(func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
		return nil, genltest.Error(int(syscall.ENOENT)) // what the controller answers
	})
	if _, err := newConn(gc); !errors.Is(err, ErrNoFamily) {
		t.Fatalf("newConn without the family: %v, want ErrNoFamily", err)
	}
}

func TestDecodeLinkDead(t *testing.T) {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, 4)
	b, _ := ae.Encode()
	if idx, ok := decodeLinkDead(genetlink.Message{Header: genetlink.Header{Command: cmdLinkDead}, Data: b}); !ok || idx != 4 {
		t.Fatalf("LINK_DEAD: %d %v", idx, ok)
	}
	if _, ok := decodeLinkDead(genetlink.Message{Header: genetlink.Header{Command: cmdStatus}, Data: b}); ok {
		t.Fatal("another command taken for LINK_DEAD")
	}
	if _, ok := decodeLinkDead(genetlink.Message{Header: genetlink.Header{Command: cmdLinkDead}, Data: []byte{8, 0, 1}}); ok {
		t.Fatal("a truncated LINK_DEAD accepted")
	}
}

// TestWatchLinkDead: notifications arrive on the channel (others are
// skipped), and the channel closes when the context ends, which closes
// the socket under a blocked receive.
func TestWatchLinkDead(t *testing.T) {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, 9)
	b, _ := ae.Encode()
	closed := make(chan struct{})
	first := true
	receive := func() ([]genetlink.Message, []netlink.Message, error) {
		if first {
			first = false
			return []genetlink.Message{
				{Header: genetlink.Header{Command: cmdStatus, Version: 1}, Data: b}, // not for us
				{Header: genetlink.Header{Command: cmdLinkDead, Version: 1}, Data: b},
			}, nil, nil
		}
		<-closed
		return nil, nil, errors.New("use of closed socket")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch := runWatch(ctx, receive, func() error { close(closed); return nil })
	select {
	case idx := <-ch:
		if idx != 9 {
			t.Fatalf("LINK_DEAD of %d, want 9", idx)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no LINK_DEAD delivered")
	}
	cancel()
	for range ch {
	}
}

func FuzzDecodeStatus(f *testing.F) {
	f.Add(statusReply(map[uint32]bool{1: true}))
	f.Add([]byte{})
	f.Add([]byte{8, 0, 9, 0, 4, 0, 1, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		out := map[uint32]bool{}
		_ = decodeStatus(b, out)
		decodeIndex(b)
		decodeLinkDead(genetlink.Message{Header: genetlink.Header{Command: cmdLinkDead}, Data: b})
	})
}
