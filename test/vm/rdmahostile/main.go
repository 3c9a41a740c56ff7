// Command rdmahostile is a hostile RTRS client on RDMA, for the VM tier. It
// connects a path to an rnbd-server the way the kernel's client does
// (conn_req as rdma_cm private data, INFO_REQ, the chunk descriptors of
// INFO_RSP), sends one request into a chunk with the rkey the server
// gave, learns the chunk's new rkey from the answer (always_invalidate
// rotates it), and then writes the chunk again with the old one. The
// device must refuse that write: the writer's work request fails with a
// remote access error. It prints "RESULT rdma-hostile-<name> PASS|FAIL"
// lines and exits 1 if any check failed; the guest script then checks
// that the server still serves everyone else.
package main

import (
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/ibverbs"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/rdma"
)

var failed int

func result(name string, ok bool, detail string, args ...any) {
	st := "PASS"
	if !ok {
		st = "FAIL"
		failed++
	}
	fmt.Printf("RESULT rdma-hostile-%s %s %s\n", name, st, fmt.Sprintf(detail, args...))
}

// conn is one connection's handler: its completions and its end.
type conn struct {
	c    fabric.Conn
	wcs  chan fabric.WC
	dead chan error
}

func newConn() *conn { return &conn{wcs: make(chan fabric.WC, 64), dead: make(chan error, 1)} }

func (c *conn) Attached(fc fabric.Conn)  { c.c = fc }
func (c *conn) Completion(wc *fabric.WC) { c.wcs <- *wc }
func (c *conn) Disconnected(err error)   { c.dead <- err }
func (c *conn) next(want fabric.WCOpcode) (fabric.WC, error) {
	for {
		select {
		case wc := <-c.wcs:
			if wc.Opcode == want {
				return wc, nil
			}
		case err := <-c.dead:
			return fabric.WC{}, err
		case <-time.After(15 * time.Second):
			return fabric.WC{}, errors.New("timed out")
		}
	}
}

func main() {
	src := flag.String("src", "10.78.0.1", "source address (on the RDMA device)")
	dst := flag.String("dst", "10.78.0.1:1234", "rnbd-server's RDMA address")
	flag.Parse()
	if err := run(netip.MustParseAddr(*src), netip.MustParseAddrPort(*dst)); err != nil {
		result("run", false, "%v", err)
	}
	if failed > 0 {
		os.Exit(1)
	}
}

// Memory layout of the one registered buffer.
const (
	offInfoReq = 0
	offInfoRsp = 4096
	offIU      = 32768 // RKEY_RSP receives, 8 bytes each
	offReq     = 40960
	memSize    = 65536
	nIU        = 8
)

func run(src netip.Addr, dst netip.AddrPort) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	f, err := rdma.New(rdma.Options{})
	if err != nil {
		return err
	}
	dev, err := f.Resolve(ctx, netip.AddrPortFrom(src, 0), dst)
	if err != nil {
		return err
	}
	pd, err := dev.AllocPD()
	if err != nil {
		return err
	}
	defer pd.Close()
	mem, err := f.AllocMemory(memSize)
	if err != nil {
		return err
	}
	defer mem.Free()
	mr, err := pd.RegisterMR(mem.Bytes(), fabric.AccessLocalWrite)
	if err != nil {
		return err
	}
	defer mr.Close()
	b := mem.Bytes()

	var sessUUID, pathsUUID [16]byte
	rand.Read(sessUUID[:])
	rand.Read(pathsUUID[:])
	dial := func(cid int, h *conn, recvs []fabric.RecvWR) (rtrs.ConnRsp, error) {
		var rsp rtrs.ConnRsp
		req := rtrs.ConnReq{Magic: rtrs.Magic, Version: rtrs.ProtoVer, CID: uint16(cid), CIDNum: 2, ReconCnt: 1,
			SessUUID: sessUUID, PathsUUID: pathsUUID, FirstConn: true}
		var priv [rtrs.ConnReqSize]byte
		_, p, err := dev.Dial(ctx, fabric.DialParams{Src: netip.AddrPortFrom(src, 0), Dst: dst, PD: pd,
			PrivateData: req.Encode(priv[:]), Attr: fabric.ConnAttr{Handler: h, MaxSendWR: 16, MaxRecvWR: 16, Recvs: recvs}})
		if err != nil {
			return rsp, fmt.Errorf("connect cid %d: %w", cid, err)
		}
		return rsp, rsp.Decode(p)
	}
	c0, c1 := newConn(), newConn()
	rsp, err := dial(0, c0, nil)
	if err != nil {
		return err
	}
	defer c0.c.Close()
	var ius []fabric.RecvWR
	for i := 0; i < nIU; i++ {
		ius = append(ius, fabric.RecvWR{ID: uint64(i), Buf: b[offIU+8*i : offIU+8*i+8], LKey: mr.LKey()})
	}
	if _, err := dial(1, c1, ius); err != nil {
		return err
	}
	defer c1.c.Close()
	result("connect", rsp.Errno == 0, "queue_depth %d max_io_size %d max_hdr_size %d flags %#x",
		rsp.QueueDepth, rsp.MaxIOSize, rsp.MaxHdrSize, rsp.Flags)
	if rsp.Flags&rtrs.MsgNewRkeyF == 0 {
		result("always-invalidate", false, "the server does not rotate rkeys (always_invalidate off)")
		return nil
	}

	// INFO_REQ / INFO_RSP: the chunks.
	qd := int(rsp.QueueDepth)
	rx := b[offInfoRsp : offInfoRsp+rtrs.InfoRspSize(qd)]
	if err := c0.c.PostRecv(&fabric.RecvWR{ID: 100, Buf: rx, LKey: mr.LKey()}); err != nil {
		return err
	}
	info := rtrs.InfoReq{Pathname: "hostile"}
	info.Encode(b[offInfoReq:])
	if err := c0.c.PostSend(&fabric.SendWR{Op: fabric.OpSend, NumSGE: 1, Signaled: true,
		SG: [fabric.MaxSGE]fabric.SGE{{Buf: b[offInfoReq : offInfoReq+rtrs.InfoReqSize], LKey: mr.LKey()}}}); err != nil {
		return err
	}
	wc, err := c0.next(fabric.WCRecv)
	if err != nil {
		return fmt.Errorf("INFO_RSP: %w", err)
	}
	var ir rtrs.InfoRsp
	if err := ir.Decode(rx[:wc.ByteLen]); err != nil || len(ir.Desc) == 0 {
		return fmt.Errorf("INFO_RSP: %v (%d descriptors)", err, len(ir.Desc))
	}
	chunk := ir.Desc[0]

	// One request into chunk 0: an RNBD IO for a device this session never
	// opened; the server answers with an errno and the chunk's new rkey.
	usr := b[offReq : offReq+32]
	clear(usr)
	usr[0] = 4                                     // RNBD_MSG_IO
	copy(usr[4:8], []byte{0xef, 0xbe, 0xad, 0xde}) // device_id 0xdeadbeef
	(&rtrs.RDMAWrite{UsrLen: 32}).Encode(b[offReq+32:])
	memBits := rtrs.MemBits(uint32(qd))
	imm := rtrs.ToImm(rtrs.ImmIOReq, 0<<memBits|32)
	write := func(rkey uint32) error {
		return c1.c.PostSend(&fabric.SendWR{Op: fabric.OpWriteImm, NumSGE: 1, Signaled: true, RemoteAddr: chunk.Addr,
			RKey: rkey, Imm: imm, SG: [fabric.MaxSGE]fabric.SGE{{Buf: b[offReq : offReq+32+rtrs.RDMAWriteSize], LKey: mr.LKey()}}})
	}
	if err := write(chunk.Key); err != nil {
		return err
	}
	wc, err = c1.next(fabric.WCRecv)
	if err != nil {
		return fmt.Errorf("answer to the request: %w", err)
	}
	typ, payload := rtrs.FromImm(wc.Imm)
	msgID, errno := rtrs.FromIORspImm(payload)
	var rk rtrs.RkeyRsp
	rkErr := rk.Decode(b[offIU+8*int(wc.ID) : offIU+8*int(wc.ID)+8])
	result("answer", typ == rtrs.ImmIORsp && msgID == 0 && errno != 0 && rkErr == nil && rk.BufID == 0,
		"imm type %d msg %d errno %v; rkey %#x -> %#x (%v)", typ, msgID, errno, chunk.Key, rk.RKey, rkErr)
	result("rkey-rotated", rk.RKey != chunk.Key, "old %#x new %#x", chunk.Key, rk.RKey)

	// The same write with the old rkey: the device must refuse it.
	if err := write(chunk.Key); err != nil {
		return err
	}
	_, err = c1.next(fabric.WCRecv)
	var wcErr *rdma.WCError
	result("stale-rkey-refused", errors.As(err, &wcErr) && wcErr.Status == ibverbs.WCRemAccessErr && errors.Is(err, syscall.EACCES),
		"the write with the old rkey: %v", err)
	return nil
}
