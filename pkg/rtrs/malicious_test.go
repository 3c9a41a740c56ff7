package rtrs

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
	"github.com/rnbd/rnbd/test/testca"
)

// hostileRig is a server with a well-behaved session on it; attacks come
// from other clients, and after each the good session must still work.
type hostileRig struct {
	*rig
	fab fabric.Fabric
	dst netip.AddrPort
	src netip.AddrPort
}

func newHostileRig(t *testing.T, inv bool) *hostileRig {
	return newHostileRigOn(t, inv, newMemDisk(4<<20))
}

// newHostileRigOn is newHostileRig with the server serving disk.
func newHostileRigOn(t *testing.T, inv bool, disk *memDisk) *hostileRig {
	return newHostileRigWith(t, inv, disk, tcp.Options{})
}

// newHostileRigWith is newHostileRigOn on a TCP fabric with opts.
func newHostileRigWith(t *testing.T, inv bool, disk *memDisk, opts tcp.Options) *hostileRig {
	opts.HandshakeTimeout = time.Second
	if opts.Log == nil {
		opts.Log = testLog() // the fabric's refusals, like the server's
	}
	fab := tcp.New(opts)
	dst := loopbackListener(t)
	scfg := testServerConfig(fab, disk, dst)
	scfg.QueueDepth = 48 // not a power of two: msg ids past it are encodable
	scfg.AlwaysInvalidate = inv
	r := newRig(t, fab, scfg, testClientConfig(fab, pa("127.0.0.1", dst.String())))
	return &hostileRig{rig: r, fab: fab, dst: dst, src: netip.MustParseAddrPort("127.0.0.3:0")}
}

// newHostileRigCfg is a hostile rig on a plain TCP fabric whose server
// configuration set adjusts.
func newHostileRigCfg(t *testing.T, set func(*SrvConfig)) *hostileRig {
	fab := tcp.New(tcp.Options{HandshakeTimeout: time.Second})
	dst := loopbackListener(t)
	scfg := testServerConfig(fab, newMemDisk(4<<20), dst)
	set(&scfg)
	return &hostileRig{rig: newRig(t, fab, scfg, testClientConfig(fab, pa("127.0.0.1", dst.String()))),
		fab: fab, dst: dst, src: netip.MustParseAddrPort("127.0.0.3:0")}
}

// dialPath asks for the first connection of a new path (and session) of
// two connections from h.src; a refusal is a *fabric.RejectError.
func (h *hostileRig) dialPath() error {
	dev, _ := h.fab.Resolve(context.Background(), h.src, h.dst)
	pd, _ := dev.AllocPD()
	req := rawConnReq(0, 2)
	c, _, err := dialRaw(h.fab, pd, dev, h.src, h.dst, req.Encode(make([]byte, ConnReqSize)))
	if err == nil {
		c.qp.Close()
	}
	return err
}

// stillServes checks the good session and that the server holds no
// session but the good one.
func (h *hostileRig) stillServes() { h.stillServesWith(1) }

// stillServesWith is stillServes with n sessions expected to remain.
func (h *hostileRig) stillServesWith(n int) {
	h.t.Helper()
	d := bytes.Repeat([]byte("good"), 1024)
	if err := h.write(1<<20, d); err != nil {
		h.t.Fatalf("good session after the attack: %v", err)
	}
	got, err := h.read(1<<20, len(d))
	if err != nil || !bytes.Equal(got, d) {
		h.t.Fatalf("good session read after the attack: %v", err)
	}
	kit.WaitFor(h.t, 10*time.Second, "the attacker's session to go", func() bool { return len(h.srv.Sessions()) == n })
	h.assertHealthy()
}

func TestHostileConnectionRequests(t *testing.T) {
	h := newHostileRig(t, true)
	dev, _ := h.fab.Resolve(nil, h.src, h.dst)
	pd, _ := dev.AllocPD()
	for _, c := range []struct {
		name  string
		priv  func() []byte
		errno syscall.Errno
	}{
		{"wrong magic", func() []byte { r := rawConnReq(0, 2); r.Magic = 0x1234; return r.Encode(make([]byte, 56)) }, syscall.ECONNRESET},
		{"major version 3", func() []byte { r := rawConnReq(0, 2); r.Version = 0x0300; return r.Encode(make([]byte, 56)) }, syscall.ECONNRESET},
		{"huge cid_num", func() []byte { r := rawConnReq(0, 5000); return r.Encode(make([]byte, 56)) }, syscall.ECONNRESET},
		{"zero cid_num", func() []byte { r := rawConnReq(0, 0); return r.Encode(make([]byte, 56)) }, syscall.ECONNRESET},
		{"cid past cid_num", func() []byte { r := rawConnReq(4, 4); return r.Encode(make([]byte, 56)) }, syscall.ECONNRESET},
		{"short private data", func() []byte { return make([]byte, 40) }, syscall.ECONNRESET},
		{"no private data", func() []byte { return nil }, syscall.ECONNRESET},
		{"unknown session without first_conn", func() []byte {
			r := rawConnReq(0, 2)
			r.FirstConn = false
			return r.Encode(make([]byte, 56))
		}, syscall.ENXIO},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, _, err := dialRaw(h.fab, pd, dev, h.src, h.dst, c.priv())
			if e := rejectErrno(err); e != c.errno {
				t.Fatalf("dial: %v (errno %v), want a reject with %v", err, e, c.errno)
			}
			h.stillServes()
		})
	}
}

func TestHostilePaths(t *testing.T) {
	for _, inv := range []bool{true, false} {
		h := newHostileRig(t, inv)
		chunk := DefaultSrvConfig().MaxChunkSize
		chunk = 64 << 10
		for _, c := range []struct {
			name   string
			attack func(rp *rawPath) error
		}{
			{"msg id past the queue depth", func(rp *rawPath) error {
				img, off := chunkImage(Write, usrOff(0), []byte("x"), 0, SGDesc{})
				return rp.writeImm(1, 0, rp.rbufs[0].Key, img, 50, off)
			}},
			{"offset past the chunk", func(rp *rawPath) error {
				return rp.writeImm(1, 0, rp.rbufs[0].Key, nil, 0, uint32(chunk))
			}},
			{"message straddling the chunk end", func(rp *rawPath) error {
				return rp.writeImm(1, 0, rp.rbufs[0].Key, nil, 0, uint32(chunk-1))
			}},
			{"usr_len larger than the offset", func(rp *rawPath) error {
				b := make([]byte, 104)
				(&RDMAWrite{UsrLen: 200}).Encode(b[100:])
				return rp.writeImm(1, 0, rp.rbufs[0].Key, b, 0, 100)
			}},
			{"unknown message type", func(rp *rawPath) error {
				b := make([]byte, 64)
				binary.LittleEndian.PutUint16(b[32:], 7)
				return rp.writeImm(1, 0, rp.rbufs[0].Key, b, 0, 32)
			}},
			{"read with two descriptors", func(rp *rawPath) error {
				b := make([]byte, 8+8+32)
				copy(b[8:], usrOff(0))
				binary.LittleEndian.PutUint16(b[16:], MsgRead)
				binary.LittleEndian.PutUint16(b[18:], 8)
				binary.LittleEndian.PutUint16(b[22:], 2)
				return rp.writeImm(1, 0, rp.rbufs[0].Key, b, 0, 16)
			}},
			{"read descriptor longer than the data", func(rp *rawPath) error {
				img, off := chunkImage(Read, usrOff(0), nil, 512, SGDesc{Addr: rp.mr.Addr(), Key: rp.mr.RKey(), Len: 4096})
				return rp.writeImm(1, 0, rp.rbufs[0].Key, img, 0, off)
			}},
			{"read with data but no descriptor for it", func(rp *rawPath) error {
				usr := usrOff(0)
				img := append(append(make([]byte, 512), usr...), (&RDMARead{UsrLen: uint16(len(usr))}).Encode(make([]byte, RDMAReadSize))...)
				return rp.writeImm(1, 0, rp.rbufs[0].Key, img, 0, uint32(512+len(usr)))
			}},
			{"read descriptor of length zero", func(rp *rawPath) error {
				img, off := chunkImage(Read, usrOff(0), nil, 512, SGDesc{Addr: rp.mr.Addr(), Key: rp.mr.RKey(), Len: 0})
				return rp.writeImm(1, 0, rp.rbufs[0].Key, img, 0, off)
			}},
			{"write outside the chunks", func(rp *rawPath) error {
				wr := fabric.SendWR{Op: fabric.OpWrite, RemoteAddr: rp.rbufs[len(rp.rbufs)-1].Addr + uint64(chunk), RKey: rp.rbufs[0].Key, NumSGE: 1}
				wr.SG[0].Buf = rp.mem.Bytes()[:64]
				if inv {
					wr.RemoteAddr = rp.rbufs[0].Addr + uint64(chunk) - 10 // past chunk 0's own region
				}
				return rp.conns[1].qp.PostSend(&wr)
			}},
			{"write with a made-up rkey", func(rp *rawPath) error {
				wr := fabric.SendWR{Op: fabric.OpWrite, RemoteAddr: rp.rbufs[0].Addr, RKey: rp.rbufs[0].Key ^ 0x5500, NumSGE: 1}
				wr.SG[0].Buf = rp.mem.Bytes()[:64]
				return rp.conns[1].qp.PostSend(&wr)
			}},
			{"send with a payload into an empty receive", func(rp *rawPath) error {
				wr := fabric.SendWR{Op: fabric.OpSend, NumSGE: 1}
				wr.SG[0].Buf = rp.mem.Bytes()[:64]
				return rp.conns[1].qp.PostSend(&wr)
			}},
			{"empty send", func(rp *rawPath) error {
				return rp.conns[1].qp.PostSend(&fabric.SendWR{Op: fabric.OpSend})
			}},
			{"second info request", func(rp *rawPath) error {
				wr := fabric.SendWR{Op: fabric.OpSend, NumSGE: 1}
				wr.SG[0].Buf = (&InfoReq{Pathname: "attacker"}).Encode(rp.mem.Bytes()[:InfoReqSize])
				return rp.conns[0].qp.PostSend(&wr)
			}},
			{"invalidating a key of the server", func(rp *rawPath) error {
				return rp.conns[1].qp.PostSend(&fabric.SendWR{Op: fabric.OpSendInv, InvRKey: rp.rbufs[0].Key})
			}},
		} {
			t.Run(c.name, func(t *testing.T) {
				rp := newRawPath(t, h.fab, h.src, h.dst, "attacker")
				// The path works before the attack.
				if e := rp.request(1, 3, Write, usrOff(8192), []byte("fine"), 0); e != 0 {
					t.Fatalf("well-formed request: errno %v", e)
				}
				if err := c.attack(rp); err != nil {
					t.Fatal(err)
				}
				if !rp.dead(10 * time.Second) {
					t.Fatal("the server kept the path after the attack")
				}
				h.stillServes()
			})
		}
	}
}

func TestHostileSessions(t *testing.T) {
	h := newHostileRig(t, true)
	t.Run("bad session name", func(t *testing.T) {
		rp := newRawPathConns(t, h.fab, h.src, h.dst, 2, 2)
		if err := rp.sendInfoReq("a/b"); err != nil {
			t.Fatal(err)
		}
		if !rp.dead(10 * time.Second) {
			t.Fatal("path with a bad name kept")
		}
		h.stillServes()
	})
	t.Run("info before every connection", func(t *testing.T) {
		rp := newRawPathConns(t, h.fab, h.src, h.dst, 3, 1)
		if err := rp.sendInfoReq("early"); err != nil {
			t.Fatal(err)
		}
		if !rp.dead(10 * time.Second) {
			t.Fatal("path kept after a premature INFO_REQ")
		}
		h.stillServes()
	})
	t.Run("name of another session", func(t *testing.T) {
		rp := newRawPathConns(t, h.fab, h.src, h.dst, 2, 2)
		if err := rp.sendInfoReq(h.sess.Name()); err != nil {
			t.Fatal(err)
		}
		if !rp.dead(10 * time.Second) {
			t.Fatal("a second session took the good session's name")
		}
		h.stillServes()
	})
	t.Run("connect and go silent", func(t *testing.T) {
		// A path that never sends INFO_REQ is dropped after the
		// connect timeout; this server's is the default 30 s, so check
		// only that the good session is unaffected meanwhile.
		rp := newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
		_ = rp
		d := []byte("meanwhile")
		if err := h.write(0, d); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("garbage instead of a handshake", func(t *testing.T) {
		c, err := net.Dial("tcp", h.dst.String())
		if err != nil {
			t.Fatal(err)
		}
		c.Write(bytes.Repeat([]byte{0xff}, 100))
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Read(make([]byte, 1)); err == nil {
			t.Fatal("server answered garbage")
		}
		c.Close()
		h.stillServes()
	})
	t.Run("busy chunk", func(t *testing.T) {
		release := h.disk.holdIO()
		defer release()
		rp := newRawPath(t, h.fab, h.src, h.dst, "attacker")
		img, off := chunkImage(Write, usrOff(0), []byte("first"), 0, SGDesc{})
		if err := rp.writeImm(1, 5, rp.rbufs[5].Key, img, 5, off); err != nil {
			t.Fatal(err)
		}
		kit.WaitFor(t, 10*time.Second, "the request at the server", func() bool { return srvInflight(h.srv) == 1 })
		// Asking again for a chunk the server still works on.
		if err := rp.writeImm(1, 6, rp.rbufs[6].Key, nil, 5, off); err != nil {
			t.Fatal(err)
		}
		if !rp.dead(10 * time.Second) {
			t.Fatal("path kept after a request for a busy chunk")
		}
		release()
		h.stillServes()
	})
}

// TestChunkReusedBeforePostReturns: a client that has a chunk's answer
// may send the chunk's next request at once, before the server's post of
// that answer has even returned (the kernel's client does when it is
// fast). The server serves it once the answer is out, and keeps the path.
func TestChunkReusedBeforePostReturns(t *testing.T) {
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	testHookResponsePosted = func(op *SrvOp) {
		if op.id == 5 && op.path.sess.Name() == "reuser" {
			once.Do(func() { close(held); <-release })
		}
	}
	t.Cleanup(func() { testHookResponsePosted = nil })
	unblock := sync.OnceFunc(func() { close(release) })
	defer unblock() // a failing test must not leave the hook blocking
	disk := newMemDisk(4 << 20)
	disk.async = true // as rnbd's server: answers come from other goroutines
	h := newHostileRigOn(t, true, disk)
	rp := newRawPath(t, h.fab, h.src, h.dst, "reuser")
	if e := rp.request(1, 5, Write, usrOff(0), []byte("first"), 0); e != 0 {
		t.Fatalf("write: errno %v", e)
	}
	<-held // the answer arrived; the server's post has not returned
	rp.send(1, 5, Read, usrOff(0), nil, 5)
	var op *SrvOp
	for _, x := range h.srv.Sessions() {
		if x.Name() == "reuser" {
			op = &x.Paths()[0].ops[5]
		}
	}
	kit.WaitFor(t, 10*time.Second, "the reuse to be held back", func() bool { return op.state.Load() == opPending })
	unblock()
	if e := rp.await(1, 5); e != 0 {
		t.Fatalf("read on the reused chunk: errno %v", e)
	}
	if got := string(rp.mem.Bytes()[65536 : 65536+5]); got != "first" {
		t.Fatalf("read %q, want %q", got, "first")
	}
	if rp.dead(100 * time.Millisecond) {
		t.Fatal("the server closed the path of a client that reused an answered chunk")
	}
	if e := rp.request(1, 5, Write, usrOff(4096), []byte("again"), 0); e != 0 {
		t.Fatalf("the chunk after the reuse: errno %v", e)
	}
	rp.close()
	h.stillServes()
}

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

// The buffers of the connections a path asks for count against
// MaxChunkMemory with its chunks: a peer that asks for 4096 connections
// per path is refused (ENOMEM) instead of making the server size 4096
// connections, the budget is whole again afterwards, and the good
// session goes on.
func TestHostileConnectionMemory(t *testing.T) {
	fab := tcp.New(tcp.Options{HandshakeTimeout: time.Second})
	dst := loopbackListener(t)
	scfg := testServerConfig(fab, newMemDisk(4<<20), dst)
	ccfg := testClientConfig(fab, pa("127.0.0.1", dst.String()))
	good, _ := pathFootprint(&scfg, nil, scfg.QueueDepth, scfg.MaxChunkSize, ccfg.ConnsPerPath+1)
	if chunks := int64(scfg.QueueDepth * scfg.MaxChunkSize); good <= chunks {
		t.Fatalf("a path of %d connections counts %d bytes, no more than its chunks alone", ccfg.ConnsPerPath+1, good)
	}
	scfg.MaxChunkMemory = 4 * good
	h := &hostileRig{rig: newRig(t, fab, scfg, ccfg), fab: fab, dst: dst, src: netip.MustParseAddrPort("127.0.0.3:0")}
	if got := h.srv.chunkMem.Load(); got != good {
		t.Fatalf("the good path counts %d bytes, want %d", got, good)
	}
	dev, _ := h.fab.Resolve(nil, h.src, h.dst)
	pd, _ := dev.AllocPD()
	req := rawConnReq(0, MaxConnsPerPath)
	_, _, err := dialRaw(h.fab, pd, dev, h.src, h.dst, req.Encode(make([]byte, ConnReqSize)))
	if e := rejectErrno(err); e != syscall.ENOMEM {
		t.Fatalf("a path of %d connections: %v (errno %v), want a reject with ENOMEM", MaxConnsPerPath, err, e)
	}
	// A path of a few connections still fits.
	rp := newRawPathConns(t, h.fab, h.src, h.dst, 3, 3)
	if err := rp.sendInfoReq("second"); err != nil {
		t.Fatal(err)
	}
	rp.wait(0, fabric.WCRecv)
	rp.close()
	h.stillServes()
	kit.WaitFor(t, 10*time.Second, "the budget to be whole again", func() bool { return h.srv.chunkMem.Load() == good })
}

// A client address may have DefaultMaxConnectingPerAddr paths connecting
// (accepted, no INFO_REQ yet: each holds its chunks) at once; the next
// one is refused with EBUSY, another address is not affected, and a slot
// comes back when one of them goes.
func TestHostileHalfOpenPaths(t *testing.T) {
	h := newHostileRig(t, true)
	var half []*rawPath
	for i := 0; i < DefaultMaxConnectingPerAddr; i++ {
		half = append(half, newRawPathConns(t, h.fab, h.src, h.dst, 2, 1))
	}
	dev, _ := h.fab.Resolve(nil, h.src, h.dst)
	pd, _ := dev.AllocPD()
	req := rawConnReq(0, 2)
	if _, _, err := dialRaw(h.fab, pd, dev, h.src, h.dst, req.Encode(make([]byte, ConnReqSize))); rejectErrno(err) != syscall.EBUSY {
		t.Fatalf("path %d connecting from one address: %v, want a reject with EBUSY", DefaultMaxConnectingPerAddr+1, err)
	}
	// Another address, a whole path.
	rp := newRawPathConns(t, h.fab, netip.MustParseAddrPort("127.0.0.4:0"), h.dst, 2, 2)
	if err := rp.sendInfoReq("other"); err != nil {
		t.Fatal(err)
	}
	rp.wait(0, fabric.WCRecv)
	half[0].close()
	kit.WaitFor(t, 10*time.Second, "a slot to come back", func() bool {
		h.srv.connectingMu.Lock()
		defer h.srv.connectingMu.Unlock()
		return h.srv.connecting[fabric.PeerGroup(h.src.Addr())] < DefaultMaxConnectingPerAddr
	})
	half[0] = newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	for _, p := range half {
		p.close()
	}
	rp.close()
	h.stillServes()
}

// On TCP with TLS a session belongs to the certificate that made it: a
// connection of another certificate cannot join it by its UUID (EACCES),
// while the session itself, inside TLS, serves as before.
func TestSessionPeerOverTLS(t *testing.T) {
	ca := testca.New(t, "test ca")
	h := newHostileRigWith(t, true, newMemDisk(4<<20), tcp.Options{TLS: ca.Config(ca.Issue(t, "good", "127.0.0.1"))})
	h.stillServes() // IO inside TLS
	sess := h.srv.Sessions()
	if len(sess) != 1 || sess[0].Identity() != "good" || !slices.Equal(sess[0].PeerNames(), []string{"good"}) {
		t.Fatalf("the session's peer is %q, want its certificate's name", sess[0].PeerNames())
	}
	join := func(cert tls.Certificate) error {
		fab := tcp.New(tcp.Options{TLS: ca.Config(cert)})
		dev, _ := fab.Resolve(context.Background(), h.src, h.dst)
		pd, _ := dev.AllocPD()
		req := rawConnReq(0, 2)
		req.PathsUUID, req.FirstConn = sess[0].UUID(), false
		c, _, err := dialRaw(fab, pd, dev, h.src, h.dst, req.Encode(make([]byte, ConnReqSize)))
		if err == nil {
			c.qp.Close()
		}
		return err
	}
	if err := join(ca.Issue(t, "mallory")); rejectErrno(err) != syscall.EACCES {
		t.Fatalf("another certificate joining the session: %v, want a reject with EACCES", err)
	}
	if len(sess[0].Paths()) != 1 {
		t.Fatalf("the session has %d paths", len(sess[0].Paths()))
	}
	// The session's own certificate may add a path (that this raw one
	// then abandons).
	if err := join(ca.Issue(t, "good")); err != nil {
		t.Fatalf("the session's certificate adding a path: %v", err)
	}
	// The server drops the abandoned path by itself; until then another
	// path from the same addresses is refused with EEXIST, as the
	// kernel's server refuses it.
	kit.WaitFor(t, 10*time.Second, "the abandoned path dropped", func() bool { return len(sess[0].Paths()) == 1 })
	// A renewed certificate of the same identity, with other alternative
	// names, too.
	if err := join(ca.Issue(t, "good", "good.example")); err != nil {
		t.Fatalf("a renewed certificate of the session's identity adding a path: %v", err)
	}
	h.stillServes()
}

// A TLS client certificate that names no identity never reaches the
// server's sessions (it would be counted by its address and could open
// exports that name no identities): it is refused in the handshake with
// EACCES, not with an RTRS reject, and counted with the server's own
// refusals (Rejected, rnbd_server_refused_connections_total).
func TestNamelessCertificateRefused(t *testing.T) {
	ca := testca.New(t, "test ca")
	h := newHostileRigWith(t, true, newMemDisk(4<<20), tcp.Options{TLS: ca.Config(ca.Issue(t, "good", "127.0.0.1"))})
	before := h.srv.Rejected()[syscall.EACCES]
	fab := tcp.New(tcp.Options{TLS: ca.Config(ca.Issue(t, ""))})
	dev, _ := fab.Resolve(context.Background(), h.src, h.dst)
	pd, _ := dev.AllocPD()
	req := rawConnReq(0, 2)
	_, _, err := dialRaw(fab, pd, dev, h.src, h.dst, req.Encode(make([]byte, ConnReqSize)))
	if !errors.Is(err, syscall.EACCES) || rejectErrno(err) != 0 {
		t.Fatalf("a nameless certificate: %v, want EACCES from the handshake", err)
	}
	// The server counts it once its side of the handshake is over.
	kit.WaitFor(t, 10*time.Second, "the refusal counted", func() bool { return h.srv.Rejected()[syscall.EACCES] == before+1 })
	if n := len(h.srv.Sessions()); n != 1 {
		t.Fatalf("%d sessions", n)
	}
	h.stillServes()
}

// One client address (or identity) may have MaxSessionsPerClient
// sessions; one more is refused with EUSERS while other addresses are
// not affected, and a slot comes back when a session goes.
func TestHostileSessionsPerClient(t *testing.T) {
	h := newHostileRigCfg(t, func(c *SrvConfig) { c.MaxSessionsPerClient = 2 })
	first := newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	if err := h.dialPath(); rejectErrno(err) != syscall.EUSERS {
		t.Fatalf("a third session from one address: %v, want a reject with EUSERS", err)
	}
	other := netip.MustParseAddrPort("127.0.0.4:0")
	newRawPathConns(t, h.fab, other, h.dst, 2, 1) // another address has its own
	first.close()
	kit.WaitFor(t, 10*time.Second, "the closed session to go", func() bool { return len(h.srv.Sessions()) == 3 })
	newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	h.stillServesWith(4)
}

// One client's paths may hold MaxChunkMemoryPerClient of the budget
// together: past it a path of that client is refused with ENOMEM while
// another address gets a path from what is left, and the share comes
// back when a path goes.
func TestHostileClientMemoryShare(t *testing.T) {
	var small, budget int64
	h := newHostileRigCfg(t, func(c *SrvConfig) {
		small, _ = pathFootprint(c, nil, c.QueueDepth, c.MaxChunkSize, 2) // a raw path of two connections
		budget = 16 * small
		c.MaxChunkMemory, c.MaxChunkMemoryPerClient = budget, 2*small
	})
	first := newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	if err := h.dialPath(); rejectErrno(err) != syscall.ENOMEM {
		t.Fatalf("a third path of one client past its share: %v, want a reject with ENOMEM", err)
	}
	if used, _ := h.srv.ChunkMemory(); used >= budget-small {
		t.Fatalf("%d bytes of %d used: the refusal was the budget's, not the share's", used, budget)
	}
	newRawPathConns(t, h.fab, netip.MustParseAddrPort("127.0.0.4:0"), h.dst, 2, 1) // another client has its own share
	first.close()
	kit.WaitFor(t, 10*time.Second, "the closed path's share to come back", func() bool {
		h.srv.memMu.Lock()
		defer h.srv.memMu.Unlock()
		return h.srv.clientMem["address:127.0.0.3"] == small
	})
	newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	h.stillServesWith(4)
}

// namingDisk is a memDisk whose server asks it for every session name.
type namingDisk struct {
	*memDisk
	refuse atomic.Bool
	claims atomic.Int32
}

func (d *namingDisk) ClaimSessionName(name, identity string) error {
	d.claims.Add(1)
	if d.refuse.Load() {
		return fmt.Errorf("name %q taken from %q: %w", name, identity, syscall.EACCES)
	}
	return nil
}

// TestNameClaimedPerPath: a name is claimed by every path, not only the
// session's first: when the operator gives the name to another client
// while a session holds it, a path that would join the old session is
// refused too, and counted among the server's refusals (Rejected).
func TestNameClaimedPerPath(t *testing.T) {
	fab := tcp.New(tcp.Options{})
	a := loopbackListener(t)
	// Another address: a path between the addresses of one it has
	// already is refused with EEXIST.
	b := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.2"), a.Port())
	d := &namingDisk{memDisk: newMemDisk(1 << 20)}
	srv, err := NewServer(testServerConfig(fab, d, a, b))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	sess, err := DialSession(ctx, testClientConfig(fab, PathAddr{Dst: a}))
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	if n := d.claims.Load(); n != 1 {
		t.Fatalf("%d claims for the first path, want 1", n)
	}
	d.refuse.Store(true)
	if _, err := sess.AddPath(ctx, PathAddr{Dst: b}); err == nil {
		t.Fatal("a second path joined the session after its name was taken away")
	} else if !errors.Is(err, errInfoUnanswered) {
		t.Fatalf("second path: %v, want the INFO_REQ unanswered", err)
	}
	if n := d.claims.Load(); n < 2 {
		t.Fatalf("%d claims, want one per path", n)
	}
	// The refusal is counted with the server's refusals, by the
	// claimer's errno.
	kit.WaitFor(t, 10*time.Second, "the name's refusal counted", func() bool { return srv.Rejected()[syscall.EACCES] >= 1 })
}

// gatedNaming holds the first claim of a name until released.
type gatedNaming struct {
	*memDisk
	claiming chan struct{} // closed when the claim began
	release  chan struct{}
	once     sync.Once
}

func (d *gatedNaming) ClaimSessionName(name, identity string) error {
	d.once.Do(func() {
		close(d.claiming)
		<-d.release
	})
	return nil
}

// TestNameHeldWaitsForClaims: NameHeld answers once the naming under way
// is done, so a session that took a name just before is seen (the
// operator's forget relies on it), not missed because it was not named
// yet.
func TestNameHeldWaitsForClaims(t *testing.T) {
	fab := tcp.New(tcp.Options{})
	a := loopbackListener(t)
	d := &gatedNaming{memDisk: newMemDisk(1 << 20), claiming: make(chan struct{}), release: make(chan struct{})}
	srv, err := NewServer(testServerConfig(fab, d, a))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	opened := make(chan error, 1)
	var sess *CltSession
	go func() {
		var err error
		sess, err = DialSession(ctx, testClientConfig(fab, PathAddr{Dst: a}))
		opened <- err
	}()
	<-d.claiming
	held := make(chan bool, 1)
	go func() { held <- srv.NameHeld("testsess") }()
	// NameHeld would answer now if it did not wait for the claim.
	kit.WaitBlocked(t, 10*time.Second, "rtrs.(*Server).NameHeld", "sync.Mutex.Lock")
	close(d.release)
	if !<-held {
		t.Fatal("NameHeld missed the session whose path was taking the name")
	}
	if err := <-opened; err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	if srv.NameHeld("other") {
		t.Fatal("NameHeld of a name no session has")
	}
}

// Without authentication a reconnect (another recon_cnt) replaces a
// path only when it comes from the path's own client address: a peer
// that learnt the UUIDs (they travel in clear) from elsewhere is refused
// with EBUSY and the path stays (issue 30 D). From the path's address
// the reconnect still supersedes it at once.
func TestReconnectFromAnotherAddress(t *testing.T) {
	h := newHostileRig(t, true)
	x := h.srv.Sessions()[0]
	p := x.Paths()[0]
	reconnect := func(src netip.AddrPort) error {
		dev, _ := h.fab.Resolve(context.Background(), src, h.dst)
		pd, _ := dev.AllocPD()
		req := ConnReq{Magic: Magic, Version: ProtoVer, CIDNum: uint16(len(p.conns)), ReconCnt: p.reconCnt + 1,
			SessUUID: p.uuid, PathsUUID: x.UUID()}
		c, _, err := dialRaw(h.fab, pd, dev, src, h.dst, req.Encode(make([]byte, ConnReqSize)))
		if err == nil {
			c.qp.Close()
		}
		return err
	}
	for i := 0; i < 5; i++ {
		if err := reconnect(h.src); rejectErrno(err) != syscall.EBUSY {
			t.Fatalf("a reconnect of the path from another address: %v, want a reject with EBUSY", err)
		}
	}
	if st := p.State(); st != SrvPathConnected {
		t.Fatalf("the path is %v after reconnects from another address, want it left CONNECTED", st)
	}
	h.stillServes()
	// From the path's own address it is the client's reconnect: the
	// old path goes at once (and this raw attempt is refused EBUSY to
	// come back, as the kernel's server does).
	if err := reconnect(netip.AddrPortFrom(p.ClientAddr().Addr(), 0)); rejectErrno(err) != syscall.EBUSY {
		t.Fatalf("a reconnect from the path's address: %v, want EBUSY", err)
	}
	select {
	case <-p.closed:
	case <-time.After(10 * time.Second):
		t.Fatal("a reconnect from the path's own address did not supersede it")
	}
}
