// Tests of the commands (CONNECT, RECONFIGURE and resize, DISCONNECT,
// STATUS) against a fake kernel: what they send, the replies and errors
// they take; the fake family and its helpers, which watch_test.go uses too.

package nbdnl

import (
	"errors"
	"math"
	"os"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/genetlink/genltest"
	"github.com/mdlayher/netlink"
	"github.com/mdlayher/netlink/nlenc"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
)

// No test needs the nbd module: the kernel is genltest's fake family.

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

// attrs decodes a request's top-level attributes by type; a type seen
// twice fails the test.
func attrs(t *testing.T, b []byte) map[uint16][]byte {
	t.Helper()
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		t.Fatal(err)
	}
	out := map[uint16][]byte{}
	for ad.Next() {
		if _, dup := out[ad.Type()]; dup {
			t.Errorf("attribute %d sent twice", ad.Type())
		}
		out[ad.Type()] = ad.Bytes()
	}
	if err := ad.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// attrTypes lists the attribute types of m, sorted.
func attrTypes(m map[uint16][]byte) []int {
	var ts []int
	for t := range m {
		ts = append(ts, int(t))
	}
	sort.Ints(ts)
	return ts
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
			n := 0
			for s.Next() {
				if s.Type() != sockFD || len(s.Bytes()) != 4 {
					t.Errorf("socket item attribute %d of %d bytes", s.Type(), len(s.Bytes()))
				}
				fds = append(fds, s.Uint32())
				n++
			}
			if n != 1 {
				t.Errorf("socket item with %d attributes", n)
			}
			return nil
		})
	}
	if err := ad.Err(); err != nil {
		t.Fatal(err)
	}
	return fds
}

func encodeIndex(idx uint32) []byte {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, idx)
	b, _ := ae.Encode()
	return b
}

func indexReply(idx uint32) []genetlink.Message {
	return []genetlink.Message{{Header: genetlink.Header{Command: cmdConnect, Version: 1}, Data: encodeIndex(idx)}}
}

// sockets makes n socketpairs and returns one end of each.
func sockets(t *testing.T, n int) []*os.File {
	t.Helper()
	var out []*os.File
	for i := 0; i < n; i++ {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
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
	socks := sockets(t, 3)
	var got map[uint16][]byte
	var version uint8
	c := fake(t, genltest.CheckRequest(family.ID, cmdConnect, netlink.Request,
		func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
			got, version = attrs(t, greq.Data), greq.Header.Version
			return indexReply(3), nil
		}))
	cfg := Config{Index: -1, SizeBytes: 1 << 30, BlockSize: 4096, Timeout: 30 * time.Second,
		DeadConnTimeout: 1500 * time.Millisecond,
		ServerFlags:     FlagHasFlags | FlagSendFlush | FlagSendFUA | FlagSendTrim | FlagSendWriteZeroes | FlagCanMultiConn,
		ClientFlags:     DestroyOnDisconnect | DisconnectOnClose,
		BackendID:       "rnbd:s1/vol1"}
	idx, err := c.Connect(cfg, socks)
	if err != nil || idx != 3 {
		t.Fatalf("Connect: index %d, %v; want the reply's 3", idx, err)
	}
	if version != 1 {
		t.Errorf("generic netlink version %d, want 1", version)
	}
	want := []int{attrSizeBytes, attrBlockSizeBytes, attrTimeout, attrServerFlags, attrClientFlags,
		attrSockets, attrDeadConnTimeout, attrBackendIdentifier}
	if ts := attrTypes(got); !equalInts(ts, want) {
		t.Fatalf("CONNECT attributes %v, want %v (no index with Index -1)", ts, want)
	}
	for _, w := range []struct {
		attr uint16
		want uint64
	}{
		{attrSizeBytes, 1 << 30}, {attrBlockSizeBytes, 4096}, {attrTimeout, 30},
		{attrDeadConnTimeout, 2}, // rounded up to whole seconds
		{attrServerFlags, 1 | 4 | 8 | 32 | 64 | 256}, {attrClientFlags, 3},
	} {
		if b := got[w.attr]; len(b) != 8 || nlenc.Uint64(b) != w.want {
			t.Errorf("attribute %d = %x, want u64 %d", w.attr, b, w.want)
		}
	}
	if id := got[attrBackendIdentifier]; string(id) != "rnbd:s1/vol1\x00" {
		t.Errorf("backend identifier %q, want NUL-terminated", id)
	}
	fds := socketFDs(t, got[attrSockets])
	if len(fds) != len(socks) {
		t.Fatalf("sockets %v, want %d", fds, len(socks))
	}
	for i, s := range socks {
		if fds[i] != uint32(s.Fd()) {
			t.Errorf("socket %d: fd %d, want %d", i, fds[i], s.Fd())
		}
	}
}

func equalInts(a, b []int) bool {
	slices.Sort(b)
	return slices.Equal(a, b)
}

func TestConnectChosenIndexAndMinimalConfig(t *testing.T) {
	socks := sockets(t, 1)
	var got map[uint16][]byte
	c := fake(t, func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
		got = attrs(t, greq.Data)
		return indexReply(5), nil
	})
	idx, err := c.Connect(Config{Index: 5, SizeBytes: 1 << 20}, socks)
	if err != nil || idx != 5 {
		t.Fatalf("Connect(5): %d, %v", idx, err)
	}
	if b := got[attrIndex]; len(b) != 4 || nlenc.Uint32(b) != 5 {
		t.Fatalf("index attribute %x", b)
	}
	// Zero fields stay out: the kernel keeps its defaults.
	if ts := attrTypes(got); !equalInts(ts, []int{attrIndex, attrSizeBytes, attrSockets}) {
		t.Fatalf("attributes %v", ts)
	}
}

// Resize is a RECONFIGURE with the index, the size and the backend
// identifier only: no client flags (which RECONFIGURE would reset), no
// sockets. A device connected with an identifier cannot be reconfigured
// without it.
func TestResize(t *testing.T) {
	var got map[uint16][]byte
	var cmd uint8
	c := fake(t, func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
		if greq.Header.Command != 0 { // 0: the fake's own traffic
			got, cmd = attrs(t, greq.Data), greq.Header.Command
		}
		return nil, nil
	})
	if err := c.Resize(3, "rnbd:s/d", 8<<30); err != nil {
		t.Fatal(err)
	}
	if cmd != cmdReconfigure || !equalInts(attrTypes(got), []int{attrIndex, attrSizeBytes, attrBackendIdentifier}) ||
		nlenc.Uint32(got[attrIndex]) != 3 || nlenc.Uint64(got[attrSizeBytes]) != 8<<30 ||
		string(got[attrBackendIdentifier]) != "rnbd:s/d\x00" {
		t.Fatalf("command %d, attributes %v", cmd, got)
	}
	if err := c.Resize(4, "", 1<<20); err != nil {
		t.Fatal(err)
	}
	if !equalInts(attrTypes(got), []int{attrIndex, attrSizeBytes}) {
		t.Fatalf("without an identifier: attributes %v", got)
	}
}

func TestConnectRejectsBadArguments(t *testing.T) {
	c := fake(t, func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		t.Error("a bad CONNECT reached the kernel")
		return indexReply(0), nil
	})
	if _, err := c.Connect(Config{Index: -1}, nil); !errors.Is(err, unix.EINVAL) {
		t.Errorf("no sockets: %v", err)
	}
	if _, err := c.Connect(Config{Index: -1}, []*os.File{nil}); !errors.Is(err, unix.EBADF) {
		t.Errorf("nil socket: %v", err)
	}
	if _, err := c.Connect(Config{Index: -2}, sockets(t, 1)); !errors.Is(err, unix.EINVAL) {
		t.Errorf("index -2: %v", err)
	}
	if int64(math.MaxInt) > math.MaxUint32 {
		big := int(int64(math.MaxUint32) + 1)
		if _, err := c.Connect(Config{Index: big}, sockets(t, 1)); !errors.Is(err, unix.EINVAL) {
			t.Errorf("index 2^32: %v", err)
		}
	}
}

func TestKernelErrorsKeepTheirErrno(t *testing.T) {
	c := fake(t, func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		return nil, genltest.Error(int(unix.EBUSY))
	})
	if _, err := c.Connect(Config{Index: 0, SizeBytes: 4096}, sockets(t, 1)); !errors.Is(err, unix.EBUSY) {
		t.Errorf("Connect: %v, want EBUSY", err)
	}
	if err := c.Disconnect(0); !errors.Is(err, unix.EBUSY) {
		t.Errorf("Disconnect: %v, want EBUSY", err)
	}
	if err := c.Reconfigure(0, Config{}, sockets(t, 1)); !errors.Is(err, unix.EBUSY) {
		t.Errorf("Reconfigure: %v, want EBUSY", err)
	}
	if _, err := c.Status(0); !errors.Is(err, unix.EBUSY) {
		t.Errorf("Status: %v, want EBUSY", err)
	}
	if _, err := c.StatusAll(); !errors.Is(err, unix.EBUSY) {
		t.Errorf("StatusAll: %v, want EBUSY", err)
	}

	c2 := fake(t, func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		return nil, genltest.Error(int(unix.ENOSPC)) // RECONFIGURE with no dead socket
	})
	if err := c2.Reconfigure(1, Config{}, sockets(t, 1)); !errors.Is(err, unix.ENOSPC) {
		t.Errorf("Reconfigure: %v, want ENOSPC", err)
	}
}

func TestMalformedConnectReplies(t *testing.T) {
	for name, reply := range map[string][]genetlink.Message{
		"truncated attribute": {{Data: []byte{1, 2}}},
		"index of 2 bytes":    {{Data: []byte{6, 0, attrIndex, 0, 9, 0, 0, 0}}},
		"no index":            {{Data: nil}},
	} {
		c := fake(t, func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
			return reply, nil
		})
		if idx, err := c.Connect(Config{Index: -1}, sockets(t, 1)); err == nil {
			t.Errorf("%s: accepted, index %d", name, idx)
		}
	}
}

// ack stands for the kernel's acknowledgement in the fake.
var ack = []genetlink.Message{{Header: genetlink.Header{Version: 1}}}

func TestDisconnectAsksForAnAck(t *testing.T) {
	var got map[uint16][]byte
	c := fake(t, genltest.CheckRequest(family.ID, cmdDisconnect, netlink.Request|netlink.Acknowledge,
		func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
			got = attrs(t, greq.Data)
			return ack, nil
		}))
	if err := c.Disconnect(7); err != nil {
		t.Fatal(err)
	}
	if ts := attrTypes(got); !equalInts(ts, []int{attrIndex}) || nlenc.Uint32(got[attrIndex]) != 7 {
		t.Fatalf("DISCONNECT attributes %v (%x)", ts, got[attrIndex])
	}
}

func TestReconfigureAsksForAnAck(t *testing.T) {
	var got map[uint16][]byte
	socks := sockets(t, 2)
	c := fake(t, genltest.CheckRequest(family.ID, cmdReconfigure, netlink.Request|netlink.Acknowledge,
		func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
			got = attrs(t, greq.Data)
			return ack, nil
		}))
	cfg := Config{Index: 99, SizeBytes: 1 << 20, BlockSize: 512, DeadConnTimeout: 10 * time.Second, BackendID: "rnbd:s/d"}
	if err := c.Reconfigure(7, cfg, socks); err != nil {
		t.Fatal(err)
	}
	// The index argument wins over cfg.Index; no size; client flags
	// always (0 clears them).
	want := []int{attrIndex, attrDeadConnTimeout, attrClientFlags, attrSockets, attrBackendIdentifier}
	if ts := attrTypes(got); !equalInts(ts, want) {
		t.Fatalf("RECONFIGURE attributes %v, want %v", ts, want)
	}
	if nlenc.Uint32(got[attrIndex]) != 7 || nlenc.Uint64(got[attrDeadConnTimeout]) != 10 ||
		nlenc.Uint64(got[attrClientFlags]) != 0 || nlenc.String(got[attrBackendIdentifier]) != "rnbd:s/d" {
		t.Fatalf("RECONFIGURE attributes %v", got)
	}
	fds := socketFDs(t, got[attrSockets])
	if len(fds) != 2 || fds[0] != uint32(socks[0].Fd()) || fds[1] != uint32(socks[1].Fd()) {
		t.Fatalf("RECONFIGURE sockets %v", fds)
	}
}

// statusReply builds a STATUS reply listing devs.
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
	var asked map[uint16][]byte
	c := fake(t, genltest.CheckRequest(family.ID, cmdStatus, netlink.Request,
		func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
			asked = attrs(t, greq.Data)
			reply := devs
			if b, ok := asked[attrIndex]; ok { // the kernel lists that device only, if it has it
				i := nlenc.Uint32(b)
				reply = map[uint32]bool{}
				if v, ok := devs[i]; ok {
					reply[i] = v
				}
			}
			return []genetlink.Message{{Header: genetlink.Header{Command: cmdStatus, Version: 1}, Data: statusReply(reply)}}, nil
		}))
	all, err := c.StatusAll()
	if err != nil || len(all) != 3 || !all[0] || all[1] || !all[15] {
		t.Fatalf("StatusAll: %v, %v", all, err)
	}
	if len(asked) != 0 {
		t.Errorf("StatusAll sent attributes %v", attrTypes(asked))
	}
	if ok, err := c.Status(15); err != nil || !ok {
		t.Fatalf("Status(15): %v, %v", ok, err)
	}
	if nlenc.Uint32(asked[attrIndex]) != 15 {
		t.Errorf("Status(15) asked for %x", asked[attrIndex])
	}
	if ok, err := c.Status(1); err != nil || ok {
		t.Fatalf("Status(1): %v, %v", ok, err)
	}
	if _, err := c.Status(2); !errors.Is(err, unix.ENOENT) || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Status of a missing device: %v, want ENOENT", err)
	}
}

func TestDecodeStatusRejectsBadItems(t *testing.T) {
	item := func(fill func(*netlink.AttributeEncoder)) []byte {
		ae := netlink.NewAttributeEncoder()
		ae.Nested(attrDeviceList, func(l *netlink.AttributeEncoder) error {
			l.Nested(deviceItem, func(it *netlink.AttributeEncoder) error { fill(it); return nil })
			return nil
		})
		b, _ := ae.Encode()
		return b
	}
	for name, b := range map[string][]byte{
		"no index":         item(func(it *netlink.AttributeEncoder) { it.Uint8(deviceConnected, 1) }),
		"short index":      item(func(it *netlink.AttributeEncoder) { it.Uint16(deviceIndex, 1) }),
		"wide connected":   item(func(it *netlink.AttributeEncoder) { it.Uint32(deviceIndex, 1); it.Uint32(deviceConnected, 1) }),
		"truncated header": {8, 0, attrDeviceList, 0, 4},
	} {
		if err := decodeStatus(b, map[uint32]bool{}); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	// Unknown attributes are skipped, at every level.
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(42, 1)
	ae.Nested(attrDeviceList, func(l *netlink.AttributeEncoder) error {
		l.Uint32(9, 9)
		l.Nested(deviceItem, func(it *netlink.AttributeEncoder) error {
			it.Uint32(deviceIndex, 4)
			it.Uint64(77, 0)
			return nil
		})
		return nil
	})
	b, _ := ae.Encode()
	out := map[uint32]bool{}
	if err := decodeStatus(b, out); err != nil || len(out) != 1 || out[4] {
		t.Fatalf("unknown attributes: %v, %v", out, err)
	}
}

func TestNoFamily(t *testing.T) {
	gc := genltest.Dial(func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
		return nil, genltest.Error(int(unix.ENOENT)) // what the controller answers
	})
	_, err := newConn(gc)
	if !errors.Is(err, ErrNoFamily) || !errors.Is(err, unix.ENOENT) {
		t.Fatalf("newConn without the family: %v, want ErrNoFamily wrapping ENOENT", err)
	}
	gc2 := genltest.Dial(func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
		return nil, genltest.Error(int(unix.EPERM))
	})
	if _, err := newConn(gc2); errors.Is(err, ErrNoFamily) || !errors.Is(err, unix.EPERM) {
		t.Fatalf("newConn refused: %v, want EPERM and not ErrNoFamily", err)
	}
}

// Fuzz targets: every decoder of what the kernel sends must survive any
// bytes, and what it accepts must be consistent.

func FuzzDecodeStatus(f *testing.F) {
	f.Add(statusReply(map[uint32]bool{1: true}))
	f.Add(statusReply(map[uint32]bool{0: false, 7: true, 1 << 31: true}))
	f.Add(statusReply(nil))
	f.Add([]byte{})
	f.Add([]byte{8, 0, attrDeviceList, 0, 4, 0, 1, 0})
	f.Add([]byte{4, 0, attrDeviceList, 0x80}) // NLA_F_NESTED set, empty
	f.Fuzz(func(t *testing.T, b []byte) {
		out := map[uint32]bool{}
		if err := decodeStatus(b, out); err != nil {
			return
		}
		// Whatever was accepted decodes the same the second time.
		again := map[uint32]bool{}
		if err := decodeStatus(b, again); err != nil || len(again) != len(out) {
			t.Fatalf("decoding is not deterministic: %v vs %v (%v)", out, again, err)
		}
	})
}

func FuzzDecodeConnectReply(f *testing.F) {
	f.Add(encodeIndex(0))
	f.Add(encodeIndex(12345))
	f.Add([]byte{})
	f.Add([]byte{6, 0, attrIndex, 0, 1, 0, 0, 0})
	f.Add([]byte{8, 0, attrIndex, 0, 1})
	f.Fuzz(func(t *testing.T, b []byte) {
		idx, err := decodeConnectReply([]genetlink.Message{{Data: b}})
		if err != nil {
			return
		}
		i2, ok, err := decodeIndex(b)
		if err != nil || !ok || i2 != idx {
			t.Fatalf("CONNECT reply gave %d, decodeIndex %d %v %v", idx, i2, ok, err)
		}
	})
}

// TestDialThisKernel runs Dial against the real kernel: it must either
// find the family or fail with ErrNoFamily (no nbd module), never
// anything else. Sandboxes without netlink skip.
func TestDialThisKernel(t *testing.T) {
	c, err := Dial()
	switch {
	case err == nil:
		t.Log("the nbd family is there")
		c.Close()
	case errors.Is(err, ErrNoFamily):
		t.Logf("no nbd family: %v", err)
		if !errors.Is(err, unix.ENOENT) {
			t.Errorf("ErrNoFamily without ENOENT: %v", err)
		}
	case errors.Is(err, unix.EAFNOSUPPORT), errors.Is(err, unix.EPERM), errors.Is(err, unix.EACCES):
		t.Skipf("no generic netlink here: %v", err)
	default:
		t.Fatalf("Dial: %v", err)
	}
}
