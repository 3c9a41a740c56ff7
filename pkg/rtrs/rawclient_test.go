package rtrs

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// rawConn is a connection driven by hand in tests: completions and the
// failure are queued for the test to look at.
type rawConn struct {
	qp   fabric.Conn
	wcs  chan fabric.WC
	disc chan error
}

func newRawConn() *rawConn {
	return &rawConn{wcs: make(chan fabric.WC, 4096), disc: make(chan error, 1)}
}

func (h *rawConn) Attached(c fabric.Conn) { h.qp = c }
func (h *rawConn) Completion(wc *fabric.WC) {
	select {
	case h.wcs <- *wc:
	default:
	}
}
func (h *rawConn) Disconnected(err error) {
	select {
	case h.disc <- err:
	default:
	}
}

// rawPath is a path established by hand: a hostile client can send
// anything on it.
type rawPath struct {
	t      testing.TB
	pd     fabric.PD
	dev    fabric.Device
	conns  []*rawConn
	rsp    ConnRsp
	rbufs  []SGDesc // per chunk: address and current rkey
	mem    fabric.Memory
	mr     fabric.MR
	req    ConnReq
	closed bool
}

func rawConnReq(cid, cidNum int) ConnReq {
	r := ConnReq{Magic: Magic, Version: ProtoVer, CID: uint16(cid), CIDNum: uint16(cidNum), ReconCnt: 1, FirstConn: true}
	rand.Read(r.SessUUID[:])
	rand.Read(r.PathsUUID[:])
	return r
}

// dialRaw sends one connection request with raw private data.
func dialRaw(fab fabric.Fabric, pd fabric.PD, dev fabric.Device, src, dst netip.AddrPort, priv []byte) (*rawConn, []byte, error) {
	h := newRawConn()
	_, rsp, err := dev.Dial(context.Background(), fabric.DialParams{
		Src: src, Dst: dst, PD: pd, PrivateData: priv,
		Attr: fabric.ConnAttr{Handler: h, MaxSendWR: 4096, MaxRecvWR: 4096},
	})
	return h, rsp, err
}

// rejectErrno returns the errno of a rejected dial.
func rejectErrno(err error) syscall.Errno {
	var rej *fabric.RejectError
	if !errors.As(err, &rej) {
		return 0
	}
	var rsp ConnRsp
	if rsp.Decode(rej.PrivateData) != nil {
		return 0
	}
	return rsp.Errno
}

func newRawPathConns(t testing.TB, fab fabric.Fabric, src, dst netip.AddrPort, cidNum, connect int) *rawPath {
	t.Helper()
	dev, err := fab.Resolve(context.Background(), src, dst)
	if err != nil {
		t.Fatal(err)
	}
	rp := &rawPath{t: t, dev: dev, req: rawConnReq(0, cidNum)}
	if rp.pd, err = dev.AllocPD(); err != nil {
		t.Fatal(err)
	}
	if rp.mem, err = fab.AllocMemory(1 << 20); err != nil {
		t.Fatal(err)
	}
	if rp.mr, err = rp.pd.RegisterMR(rp.mem.Bytes(), fabric.AccessLocalWrite|fabric.AccessRemoteWrite); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rp.close)
	for cid := 0; cid < connect; cid++ {
		req := rp.req
		req.CID = uint16(cid)
		var b [ConnReqSize]byte
		h, priv, err := dialRaw(fab, rp.pd, dev, src, dst, req.Encode(b[:]))
		if err != nil {
			t.Fatalf("raw dial cid %d: %v", cid, err)
		}
		if cid == 0 {
			if err := rp.rsp.Decode(priv); err != nil {
				t.Fatal(err)
			}
		}
		rp.conns = append(rp.conns, h)
	}
	return rp
}

// newRawPath establishes a whole path by hand, up to the INFO exchange.
func newRawPath(t testing.TB, fab fabric.Fabric, src, dst netip.AddrPort, name string) *rawPath {
	t.Helper()
	rp := newRawPathConns(t, fab, src, dst, 2, 2)
	if err := rp.sendInfoReq(name); err != nil {
		t.Fatal(err)
	}
	wc := rp.wait(0, fabric.WCRecv)
	var rsp InfoRsp
	if err := rsp.Decode(rp.mem.Bytes()[4096 : 4096+wc.ByteLen]); err != nil {
		t.Fatal(err)
	}
	chunk := int(rp.rsp.MaxIOSize + rp.rsp.MaxHdrSize)
	for _, d := range rsp.Desc {
		for off := 0; off < int(d.Len); off += chunk {
			rp.rbufs = append(rp.rbufs, SGDesc{Addr: d.Addr + uint64(off), Key: d.Key, Len: uint32(chunk)})
		}
	}
	if len(rp.rbufs) != int(rp.rsp.QueueDepth) {
		t.Fatalf("%d chunks for queue depth %d", len(rp.rbufs), rp.rsp.QueueDepth)
	}
	for _, c := range rp.conns {
		for i := 0; i < 64; i++ {
			buf := rp.mem.Bytes()[8192+i*8 : 8192+(i+1)*8]
			if err := c.qp.PostRecv(&fabric.RecvWR{ID: uint64(i), Buf: buf}); err != nil {
				t.Fatal(err)
			}
		}
	}
	return rp
}

func (rp *rawPath) sendInfoReq(name string) error {
	c := rp.conns[0]
	if err := c.qp.PostRecv(&fabric.RecvWR{ID: 1000, Buf: rp.mem.Bytes()[4096:8192]}); err != nil {
		return err
	}
	wr := fabric.SendWR{Op: fabric.OpSend, NumSGE: 1}
	wr.SG[0].Buf = (&InfoReq{Pathname: name}).Encode(rp.mem.Bytes()[:InfoReqSize])
	return c.qp.PostSend(&wr)
}

func (rp *rawPath) close() {
	if rp.closed {
		return
	}
	rp.closed = true
	for _, c := range rp.conns {
		c.qp.Close()
	}
	rp.mr.Close()
	rp.pd.Close()
}

// wait returns the next completion of the given kind on connection cid.
func (rp *rawPath) wait(cid int, op fabric.WCOpcode) fabric.WC {
	rp.t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case wc := <-rp.conns[cid].wcs:
			if wc.Opcode == op {
				return wc
			}
		case err := <-rp.conns[cid].disc:
			rp.t.Fatalf("connection %d lost while waiting for a completion: %v", cid, err)
		case <-timeout:
			rp.t.Fatalf("no completion %d on connection %d", op, cid)
		}
	}
}

// dead reports whether the server dropped the path within d.
func (rp *rawPath) dead(d time.Duration) bool {
	timeout := time.After(d)
	for {
		for _, c := range rp.conns {
			select {
			case <-c.disc:
				return true
			default:
			}
		}
		select {
		case <-timeout:
			return false
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// chunkImage lays out a request the way the kernel's client does and
// returns it with the offset that goes into the immediate.
func chunkImage(dir Dir, usr, data []byte, readLen int, desc SGDesc) ([]byte, uint32) {
	if dir == Write {
		b := append(append(append([]byte{}, data...), usr...), (&RDMAWrite{UsrLen: uint16(len(usr))}).Encode(make([]byte, 4))...)
		return b, uint32(len(data) + len(usr))
	}
	m := RDMARead{UsrLen: uint16(len(usr)), SGCnt: 1, Desc: desc}
	if readLen == 0 {
		m = RDMARead{UsrLen: uint16(len(usr))} // as rtrs_clt_read_req without data
	}
	b := append(make([]byte, readLen), usr...)
	b = append(b, m.Encode(make([]byte, m.Size()))...)
	return b, uint32(readLen + len(usr))
}

// writeImm writes img into chunk buf at offset 0 with rkey, then sends
// the IO_REQ immediate for msgID and offset.
func (rp *rawPath) writeImm(cid int, buf int, rkey uint32, img []byte, msgID, off uint32) error {
	copy(rp.mem.Bytes()[16384:], img)
	wr := fabric.SendWR{Op: fabric.OpWriteImm, RemoteAddr: rp.rbufs[buf].Addr, RKey: rkey}
	if len(img) > 0 {
		wr.SG[0].Buf, wr.NumSGE = rp.mem.Bytes()[16384:16384+len(img)], 1
	}
	wr.Imm = ToImm(ImmIOReq, msgID<<MemBits(uint32(len(rp.rbufs)))|off)
	return rp.conns[cid].qp.PostSend(&wr)
}

// request sends a well-formed request and returns the server's errno
// (and takes the new rkey if the server sent one).
func (rp *rawPath) request(cid, buf int, dir Dir, usr, data []byte, readLen int) syscall.Errno {
	rp.t.Helper()
	rp.send(cid, buf, dir, usr, data, readLen)
	return rp.await(cid, buf)
}

// send sends a well-formed request on chunk buf; a read's data lands at
// offset 65536 of the client's memory.
func (rp *rawPath) send(cid, buf int, dir Dir, usr, data []byte, readLen int) {
	rp.t.Helper()
	desc := SGDesc{Addr: rp.mr.Addr() + 65536, Key: rp.mr.RKey(), Len: uint32(readLen)}
	img, off := chunkImage(dir, usr, data, readLen, desc)
	if err := rp.writeImm(cid, buf, rp.rbufs[buf].Key, img, uint32(buf), off); err != nil {
		rp.t.Fatal(err)
	}
}

// await returns the errno of the response for chunk buf (and takes the
// new rkey if the server sent one).
func (rp *rawPath) await(cid, buf int) syscall.Errno {
	rp.t.Helper()
	for {
		wc := rp.waitAny(cid)
		if wc.Flags&fabric.WCWithImm == 0 {
			continue
		}
		typ, payload := FromImm(wc.Imm)
		if typ != ImmIORsp && typ != ImmIORspWInv {
			continue
		}
		id, errno := FromIORspImm(payload)
		if int(id) != buf {
			rp.t.Fatalf("response for %d, want %d", id, buf)
		}
		if wc.Opcode == fabric.WCRecv {
			var rk RkeyRsp
			b := rp.mem.Bytes()[8192+int(wc.ID)*8 : 8192+int(wc.ID+1)*8]
			if err := rk.Decode(b); err != nil || int(rk.BufID) != buf {
				rp.t.Fatalf("rkey response %+v %v", rk, err)
			}
			rp.rbufs[buf].Key = rk.RKey
			rp.conns[cid].qp.PostRecv(&fabric.RecvWR{ID: wc.ID, Buf: b})
		} else {
			rp.conns[cid].qp.PostRecv(&fabric.RecvWR{ID: wc.ID, Buf: rp.mem.Bytes()[8192+int(wc.ID)*8 : 8192+int(wc.ID+1)*8]})
		}
		return errno
	}
}

func (rp *rawPath) waitAny(cid int) fabric.WC {
	rp.t.Helper()
	select {
	case wc := <-rp.conns[cid].wcs:
		return wc
	case err := <-rp.conns[cid].disc:
		rp.t.Fatalf("connection lost: %v", err)
	case <-time.After(10 * time.Second):
		rp.t.Fatal("no completion")
	}
	panic("unreachable")
}

func usrOff(off uint64) []byte {
	b := make([]byte, 8)
	binary.LittleEndian.PutUint64(b, off)
	return b
}

var _ = fmt.Sprint
