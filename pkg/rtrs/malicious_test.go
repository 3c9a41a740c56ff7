// Tests of peers that break the protocol: hostile connection requests,
// paths and sessions, with the rig the other malicious tests share (a
// server whose good session must survive every attack).

package rtrs

import (
	"bytes"
	"context"
	"encoding/binary"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
	"github.com/rnbd/rnbd/test/kit"
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
