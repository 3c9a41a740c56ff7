package rtrs

import (
	"errors"
	"runtime"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// SrvOp is one request handed to the server's user (struct rtrs_srv_op).
// It belongs to the handler from HandleIO until its Respond (or
// RespondFrom), which may come from any goroutine, once; it is not to be
// used after.
type SrvOp struct {
	path *SrvPath
	con  *srvConn
	id   uint32
	dir  Dir
	// state is opIdle, opWorking (the user has the request, or its
	// answer waits for send queue room), opAnswering (the answer is being
	// posted: the client may already have it and send the chunk's next
	// request), opClaiming and opPending (such a request came; pend
	// holds it until the answer is out).
	state atomic.Int32
	pend  opReq
	data  []byte
	usr   []byte
	rd    RDMARead
	src   []byte // RespondFrom's data, and what holds it
	hold  Hold
	began time.Time // when the request was handed to the user
	wrs   [3]fabric.SendWR
	nwr   int // work requests of a response parked for send queue room
}

const (
	opIdle int32 = iota
	opWorking
	opAnswering
	opClaiming
	opPending
)

// opReq is a decoded request for a chunk.
type opReq struct {
	c       *srvConn
	dir     Dir
	rd      RDMARead
	dataLen int
	off     uint32
}

// Dir is the request's direction.
func (op *SrvOp) Dir() Dir { return op.dir }

// Hold keeps memory that a response sends from valid until Release.
type Hold interface {
	// Release says the memory is no longer read. It is called once,
	// from any goroutine, and must not block.
	Release()
}

// CanRespondFrom says whether RespondFrom may answer this request: a
// read whose connection can send from memory that is not registered
// (fabric.AnySource: fabric/tcp without TLS).
func (op *SrvOp) CanRespondFrom() bool {
	return op.con.anySource && op.dir == Read && op.rd.SGCnt == 1
}

// RespondFrom answers a read, as Respond(nil) does, with src as its
// data instead of the chunk: data already in memory (a mapping of the
// file) is then sent from there, without a copy into the chunk.
// CanRespondFrom must have said yes, and src must hold the request's
// length. hold is released once src is no longer read: when the answer
// has been sent, or dropped with its connection.
func (op *SrvOp) RespondFrom(src []byte, hold Hold) {
	if len(src) != len(op.data) {
		panic("rtrs: RespondFrom with data of another length")
	}
	op.src, op.hold = src, hold
	op.Respond(nil)
}

// Data is the request's data in the chunk: what the client wrote, or the
// room to put the data of a read, which is sent back on Respond.
func (op *SrvOp) Data() []byte { return op.data }

// Usr is the user header the client sent with the request.
func (op *SrvOp) Usr() []byte { return op.usr }

// Session is the session the request came on.
func (op *SrvOp) Session() *SrvSession { return op.path.sess }

// Path is the path the request came on.
func (op *SrvOp) Path() *SrvPath { return op.path }

// ID is the chunk the request occupies.
func (op *SrvOp) ID() int { return int(op.id) }

// ErrnoOf maps an error to the errno sent to the client: a syscall.Errno
// (wrapped or not) as is, anything else as EIO.
func ErrnoOf(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	var e syscall.Errno
	if errors.As(err, &e) && e != 0 && e <= 0x1ff {
		return e
	}
	return syscall.EIO
}

// Respond answers the request (rtrs_srv_resp_rdma): for a successful
// read the data is written to the client first. The op must not be used
// after it. It may be called from any goroutine.
func (op *SrvOp) Respond(err error) {
	if op.state.Load() != opWorking {
		panic("rtrs: Respond on an op that is not in flight")
	}
	p := op.path
	if p.State() != SrvPathConnected {
		p.rl.Log(p.lg().WithField("msg_id", op.id), log.WarnLevel, "response for a path that is not connected: dropped")
		op.finish()
		return
	}
	errno := ErrnoOf(err)
	cfg := &p.sess.srv.cfg
	chunkMR := p.mrs[0]
	if cfg.AlwaysInvalidate {
		chunkMR = p.mrs[op.id]
	}
	needInval := op.dir == Read && op.rd.SGCnt == 1 && op.rd.Flags&MsgNeedInvalF != 0
	n := 0
	if op.dir == Read && errno == 0 && op.rd.SGCnt == 1 {
		w := &op.wrs[n]
		*w = fabric.SendWR{ID: wrRsp, Op: fabric.OpWrite, NumSGE: 1,
			RemoteAddr: op.rd.Desc.Addr, RKey: op.rd.Desc.Key}
		w.SG[0] = fabric.SGE{Buf: op.data[:op.rd.Desc.Len], LKey: chunkMR.LKey()}
		if op.src != nil {
			w.SG[0].Buf = op.src[:op.rd.Desc.Len]
		}
		n++
	}
	if needInval {
		op.wrs[n] = fabric.SendWR{ID: wrRsp, Op: fabric.OpSendInv, InvRKey: op.rd.Desc.Key}
		n++
	}
	last := &op.wrs[n]
	imm := IORspImm(op.id, errno, needInval)
	if cfg.AlwaysInvalidate {
		var rkey uint32
		var err error
		if p.wins != nil {
			// Posted on the connection the answer goes on, so it
			// is bound before the client learns the key.
			rkey, err = p.wins[op.id].Bind(op.con.qp)
		} else {
			rkey, err = chunkMR.Reregister()
		}
		if err != nil {
			p.close("re-registering a chunk failed")
			op.finish()
			return
		}
		msg := p.rkeyMem.Bytes()[op.id*RkeyRspSize : (op.id+1)*RkeyRspSize]
		(&RkeyRsp{BufID: uint16(op.id), RKey: rkey}).Encode(msg)
		*last = fabric.SendWR{ID: wrRsp, Op: fabric.OpSendImm, Imm: imm, NumSGE: 1}
		last.SG[0] = fabric.SGE{Buf: msg, LKey: p.rkeyMR.LKey()}
	} else {
		*last = fabric.SendWR{ID: wrRsp, Op: fabric.OpWriteImm, Imm: imm}
	}
	n++
	for i := 0; i < n-1; i++ {
		op.wrs[i].Next = &op.wrs[i+1]
	}
	op.nwr = n
	p.stats.observeLatency(op.dir, time.Since(op.began))
	parked, err := op.con.post(&op.wrs[0], n, op)
	if err != nil {
		if !errors.Is(err, ErrClosed) {
			p.rl.Log(p.lg().WithError(err), log.ErrorLevel, "posting a response failed")
		}
		p.close("posting a response failed")
	}
	if !parked {
		if testHookResponsePosted != nil {
			testHookResponsePosted(op)
		}
		op.finish()
	}
}

// testHookResponsePosted, when set by a test, runs between the post of a
// response and the release of its op.
var testHookResponsePosted func(*SrvOp)

// finish releases the op after its response went out or was dropped,
// and starts the chunk's next request if one came meanwhile. It must not
// be called with a connection's sendMu held: the next request may answer
// at once.
func (op *SrvOp) finish() {
	p := op.path
	if op.hold != nil { // not posted
		op.hold.Release()
	}
	op.data, op.usr, op.src, op.hold = nil, nil, nil, nil
	for {
		switch st := op.state.Load(); st {
		case opWorking, opAnswering:
			if op.state.CompareAndSwap(st, opIdle) {
				p.stats.inflight.Add(-1)
				p.inflight.Done()
				return
			}
		case opClaiming:
			runtime.Gosched() // the next request is being recorded
		case opPending:
			// The op stays counted in flight from one request to the
			// next, so closeWork cannot free the chunk between them.
			req := op.pend
			op.pend = opReq{}
			op.state.Store(opWorking)
			if p.State() != SrvPathConnected {
				op.state.Store(opIdle) // the path is closing: dropped
				p.stats.inflight.Add(-1)
				p.inflight.Done()
				return
			}
			op.start(req)
			return
		default:
			panic("rtrs: finish of an op that is not in flight")
		}
	}
}

// start hands a request to the user; op is opWorking and counted in
// flight.
func (op *SrvOp) start(req opReq) {
	p := op.path
	chunk := p.chunk(op.id)
	op.con, op.dir, op.rd = req.c, req.dir, req.rd
	op.data = chunk[:req.dataLen]
	op.usr = chunk[req.dataLen:req.off]
	p.stats.update(op.dir, int(req.off))
	op.began = time.Now()
	var err error
	if b := p.sess.ioh.Load(); b != nil {
		err = b.h.HandleIO(op)
	} else {
		err = p.sess.srv.cfg.Handler.HandleIO(op)
	}
	if err != nil {
		op.Respond(err)
	}
}
