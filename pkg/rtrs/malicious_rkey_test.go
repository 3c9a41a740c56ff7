// Tests of keys a peer must not use any more: with always_invalidate a
// chunk's old rkey is refused, without it the keys stay.

package rtrs

import (
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
	"github.com/rnbd/rnbd/test/kit"
)

// TestAlwaysInvalidate: with always_invalidate the server revokes a
// chunk's rkey while it works on a request and hands out a new one with
// the response; the old key is rejected by the fabric like an HCA would.
// Both ways: by re-registration, and by memory windows (the fabric's
// emulation of them).
func TestAlwaysInvalidate(t *testing.T) {
	t.Run("registration", func(t *testing.T) { testAlwaysInvalidate(t, tcp.Options{}) })
	t.Run("window", func(t *testing.T) { testAlwaysInvalidate(t, tcp.Options{Windows: true}) })
}

func testAlwaysInvalidate(t *testing.T, opts tcp.Options) {
	h := newHostileRigWith(t, true, newMemDisk(4<<20), opts)
	for _, x := range h.srv.Sessions() {
		x.mu.Lock()
		for _, p := range x.paths {
			if (p.wins != nil) != opts.Windows {
				t.Errorf("path %s: windows %v, want %v", p.Name(), p.wins != nil, opts.Windows)
			}
		}
		x.mu.Unlock()
	}
	rp := newRawPath(t, h.fab, h.src, h.dst, "rotator")
	if rp.rsp.Flags&MsgNewRkeyF == 0 {
		t.Fatal("server did not announce RTRS_MSG_NEW_RKEY_F")
	}
	k0 := rp.rbufs[0].Key
	if e := rp.request(1, 0, Write, usrOff(0), []byte("one"), 0); e != 0 {
		t.Fatalf("errno %v", e)
	}
	k1 := rp.rbufs[0].Key
	if k1 == k0 {
		t.Fatal("rkey not rotated")
	}
	if e := rp.request(1, 0, Read, usrOff(0), nil, 3); e != 0 || string(rp.mem.Bytes()[65536:65539]) != "one" {
		t.Fatalf("read with the new key: errno %v, %q", e, rp.mem.Bytes()[65536:65539])
	}
	if rp.rbufs[0].Key == k1 {
		t.Fatal("rkey not rotated by the read")
	}
	// A read without data (sg_cnt 0: the kernel's rnbd-clt sends its
	// flushes so) is served and rotates the key too.
	k2 := rp.rbufs[0].Key
	if e := rp.request(1, 0, Read, usrOff(0), nil, 0); e != 0 {
		t.Fatalf("read without data: errno %v", e)
	}
	if rp.rbufs[0].Key == k2 {
		t.Fatal("rkey not rotated by the read without data")
	}
	// While the server works on a request, the chunk's key is revoked.
	release := h.disk.holdIO()
	img, off := chunkImage(Write, usrOff(0), []byte("two"), 0, SGDesc{})
	if err := rp.writeImm(1, 1, rp.rbufs[1].Key, img, 1, off); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the request at the server", func() bool { return srvInflight(h.srv) == 1 })
	wr := fabric.SendWR{Op: fabric.OpWrite, RemoteAddr: rp.rbufs[1].Addr, RKey: rp.rbufs[1].Key, NumSGE: 1}
	wr.SG[0].Buf = []byte("scribble")
	rp.conns[1].qp.PostSend(&wr)
	if !rp.dead(10 * time.Second) {
		t.Fatal("a write to a chunk in use went through")
	}
	release()
	kit.WaitFor(t, 10*time.Second, "the held request to finish", func() bool { return string(h.disk.bytes(0, 3)) != "one" })
	if got := h.disk.bytes(0, 3); string(got) != "two" {
		t.Fatalf("the request saw %q: the scribble reached the chunk", got)
	}
	h.stillServes()

	// And while it works on a read: a scribble there would reach the
	// data the client gets back.
	rp = newRawPath(t, h.fab, h.src, h.dst, "rotator")
	release = h.disk.holdIO()
	rp.send(1, 3, Read, usrOff(0), nil, 3)
	kit.WaitFor(t, 10*time.Second, "the read at the server", func() bool { return srvInflight(h.srv) == 1 })
	wr = fabric.SendWR{Op: fabric.OpWrite, RemoteAddr: rp.rbufs[3].Addr, RKey: rp.rbufs[3].Key, NumSGE: 1}
	wr.SG[0].Buf = []byte("scribble")
	rp.conns[1].qp.PostSend(&wr)
	if !rp.dead(10 * time.Second) {
		t.Fatal("a write to a chunk a read uses went through")
	}
	release()
	kit.WaitFor(t, 10*time.Second, "the held read to finish", func() bool { return srvInflight(h.srv) == 0 })
	h.stillServes()

	// A stale key after the rotation is rejected.
	rp = newRawPath(t, h.fab, h.src, h.dst, "rotator")
	k0 = rp.rbufs[2].Key
	if e := rp.request(1, 2, Write, usrOff(0), []byte("three"), 0); e != 0 {
		t.Fatal(e)
	}
	img, off = chunkImage(Write, usrOff(0), []byte("stale"), 0, SGDesc{})
	if err := rp.writeImm(1, 2, k0, img, 2, off); err != nil {
		t.Fatal(err)
	}
	if !rp.dead(10 * time.Second) {
		t.Fatal("a write with a stale rkey went through")
	}
	h.stillServes()
	if got := h.disk.bytes(0, 5); string(got) != "three" {
		t.Fatalf("disk has %q", got)
	}
}

// TestNoInvalidate: without always_invalidate the keys stay.
func TestNoInvalidate(t *testing.T) {
	h := newHostileRig(t, false)
	rp := newRawPath(t, h.fab, h.src, h.dst, "steady")
	if rp.rsp.Flags&MsgNewRkeyF != 0 {
		t.Fatal("server announced new rkeys without always_invalidate")
	}
	k := rp.rbufs[0].Key
	for i := 0; i < 3; i++ {
		if e := rp.request(1, 0, Write, usrOff(0), []byte("same key"), 0); e != 0 {
			t.Fatal(e)
		}
	}
	if rp.rbufs[0].Key != k {
		t.Fatal("rkey changed")
	}
	if e := rp.request(1, 0, Read, usrOff(0), nil, 8); e != 0 || string(rp.mem.Bytes()[65536:65544]) != "same key" {
		t.Fatalf("read: %v", e)
	}
	h.stillServesWith(2)
}
