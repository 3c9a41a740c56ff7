package rtrs

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// SrvPath is one path of a session on the server (struct rtrs_srv_path).
// It is safe for concurrent use.
type SrvPath struct {
	sess       *SrvSession
	uuid       [16]byte
	reconCnt   uint16
	clientAddr netip.AddrPort
	serverAddr netip.AddrPort
	fab        fabric.Fabric
	dev        fabric.Device
	logp       atomic.Pointer[log.Entry]
	rl         log.Limiter
	stats      SrvPathStats
	hb         heartbeat
	zombie     *time.Timer

	state   atomic.Int32 // SrvPathState; changed under stateMu
	stateMu sync.Mutex

	conns     []*srvConn // set under sess.mu while connecting
	accepting int        // under sess.mu: connections being accepted
	pd        fabric.PD
	// windows: always_invalidate by memory windows (the PD has them,
	// fabric.WindowPD), known before the chunks are registered.
	windows bool
	// The chunks: allocated and registered once the path has proved
	// itself (allocChunks, at INFO_REQ). chunkBuf is chunks' bytes,
	// mapped says the pool's mapped memory.
	chunks   fabric.Memory
	chunkBuf []byte
	mapped   bool
	// memSize is what the path counts against MaxChunkMemory, memHeap
	// the part of it on the Go heap.
	memSize, memHeap int64
	mrs              []fabric.MR // one per chunk with always_invalidate, else one
	// wins (one per chunk, the same as mrs) is always_invalidate by
	// memory windows: a chunk's window is unbound when a request arrives
	// and the request is processed when that completes (winOff keeps its
	// offset), and bound again in front of the answer: work requests, no
	// registration per IO. nil otherwise.
	wins    []fabric.WindowMR
	winOff  []uint32
	memBits int
	ops     []SrvOp
	rkeyMem fabric.Memory // RKEY_RSP messages, 8 bytes per chunk
	rkeyMR  fabric.MR
	infoMem fabric.Memory // INFO_REQ in, INFO_RSP out
	infoMR  fabric.MR

	established bool
	inflight    sync.WaitGroup // IOs handed to the user
	closed      chan struct{}
}

// Name is "client@server", the kernel's path directory name.
func (p *SrvPath) Name() string {
	return FormatAddr(p.clientAddr.Addr(), false) + "@" + FormatAddr(p.serverAddr.Addr(), false)
}

// State returns the path's state.
func (p *SrvPath) State() SrvPathState { return SrvPathState(p.state.Load()) }

// Session returns the path's session.
func (p *SrvPath) Session() *SrvSession { return p.sess }

// ClientAddr is src_addr of the kernel's server path; ServerAddr is dst_addr.
func (p *SrvPath) ClientAddr() netip.AddrPort { return p.clientAddr }
func (p *SrvPath) ServerAddr() netip.AddrPort { return p.serverAddr }

// HCAName and HCAPort name the device the path runs on.
func (p *SrvPath) HCAName() string { return p.dev.Name() }
func (p *SrvPath) HCAPort() int    { return p.dev.Port() }

// Stats returns the path's counters.
func (p *SrvPath) Stats() *SrvPathStats { return &p.stats }

// Disconnect closes the path without waiting (paths/<p>/disconnect).
func (p *SrvPath) Disconnect() { p.close("disconnected by the administrator") }

func (p *SrvPath) changeState(to SrvPathState) bool {
	p.stateMu.Lock()
	defer p.stateMu.Unlock()
	from := p.State()
	if !srvTransitionAllowed(from, to) {
		return false
	}
	p.state.Store(int32(to))
	if from == SrvPathConnecting {
		p.sess.srv.doneConnecting(p.clientAddr.Addr())
	}
	return true
}

// allocResources is what a path needs from its first connection on: its
// place in the budget (counted for all it may come to hold), its
// protection domain and the buffer of INFO_REQ and INFO_RSP. The
// chunks wait for allocChunks.
func (p *SrvPath) allocResources() error {
	x := p.sess
	cfg := &x.srv.cfg
	qd := x.queueDepth
	size, heap := pathFootprint(cfg, p.fab, qd, x.chunkSize, len(p.conns))
	if err := x.srv.reserveMem(x.client, size, heap); err != nil {
		return fmt.Errorf("a path of %d chunks and %d connections: %w", qd, len(p.conns), err)
	}
	p.memSize, p.memHeap = size, heap
	var err error
	if p.pd, err = p.dev.AllocPD(); err != nil {
		return err
	}
	if cfg.AlwaysInvalidate && !cfg.InvalidateByRegistration {
		wp, ok := p.pd.(fabric.WindowPD)
		p.windows = ok && wp.Windows()
	}
	nmr := 1
	if cfg.AlwaysInvalidate {
		nmr = qd
	}
	if p.infoMem, err = p.fab.AllocMemory(InfoReqSize + InfoRspSize(nmr)); err != nil {
		return err
	}
	if p.infoMR, err = p.pd.RegisterMR(p.infoMem.Bytes(), fabric.AccessLocalWrite); err != nil {
		return err
	}
	return nil
}

// allocChunks allocates and registers the path's chunks (from the
// server's pool) and their ops, once every connection is open and
// INFO_REQ came: before that a path costs its connections only.
func (p *SrvPath) allocChunks() error {
	x := p.sess
	cfg := &x.srv.cfg
	qd := x.queueDepth
	var err error
	if p.chunks, p.mapped, err = x.srv.pool.get(p.fab, qd*x.chunkSize); err != nil {
		return err
	}
	p.chunkBuf = p.chunks.Bytes()
	if cfg.AlwaysInvalidate {
		access := fabric.AccessLocalWrite | fabric.AccessRemoteWrite
		if p.windows {
			access |= fabric.AccessWindow
		}
		for i := 0; i < qd; i++ {
			mr, err := p.pd.RegisterMR(p.chunk(uint32(i)), access)
			if err != nil {
				return err
			}
			p.mrs = append(p.mrs, mr)
			if w, ok := mr.(fabric.WindowMR); ok && p.windows {
				p.wins = append(p.wins, w)
			} else if p.windows {
				return fmt.Errorf("chunk %d got no memory window on a device that has them: %w", i, syscall.EIO)
			}
		}
		if p.windows {
			p.winOff = make([]uint32, qd)
		}
	} else {
		mr, err := p.pd.RegisterMR(p.chunkBuf, fabric.AccessLocalWrite|fabric.AccessRemoteWrite)
		if err != nil {
			return err
		}
		p.mrs = append(p.mrs, mr)
	}
	p.memBits = MemBits(uint32(qd))
	if p.rkeyMem, err = p.fab.AllocMemory(qd * RkeyRspSize); err != nil {
		return err
	}
	if p.rkeyMR, err = p.pd.RegisterMR(p.rkeyMem.Bytes(), fabric.AccessLocalWrite); err != nil {
		return err
	}
	p.ops = make([]SrvOp, qd)
	for i := range p.ops {
		p.ops[i].path, p.ops[i].id = p, uint32(i)
	}
	return nil
}

// freeResources frees what allocResources and allocChunks made, once no
// connection is left to touch it.
func (p *SrvPath) freeResources() {
	for _, mr := range p.mrs {
		mr.Close()
	}
	p.mrs = nil
	for _, mr := range []fabric.MR{p.rkeyMR, p.infoMR} {
		if mr != nil {
			mr.Close()
		}
	}
	for _, m := range []fabric.Memory{p.rkeyMem, p.infoMem} {
		if m != nil {
			m.Free()
		}
	}
	if p.chunks != nil {
		p.sess.srv.pool.put(p.fab, p.chunks, p.mapped)
		p.chunks, p.chunkBuf = nil, nil
	}
	if p.pd != nil {
		p.pd.Close()
	}
	p.sess.srv.releaseMem(p.sess.client, p.memSize, p.memHeap)
	p.memSize, p.memHeap = 0, 0
}

// newConnLocked reserves connection cid of a path (create_con).
func (p *SrvPath) newConnLocked(cid int) *srvConn {
	qd := p.sess.queueDepth
	c := &srvConn{path: p, cid: cid, sigIntv: min(qd, ServiceConQueueDepth)}
	p.conns[cid] = c
	return c
}

// connQueues sizes connection cid's send and receive queues, and the
// part of the send queue post counts (sqAvail).
func connQueues(cfg *SrvConfig, qd, cid int, windows bool) (maxSend, maxRecv, sqAvail int) {
	if cid == 0 {
		maxSend = ServiceConQueueDepth*2 + 2
		maxRecv = maxSend
	} else {
		if cfg.AlwaysInvalidate {
			maxSend = qd*(1+4) + 1
		} else {
			maxSend = qd*(1+2) + 1
		}
		maxRecv = qd + 1
	}
	sqAvail = maxSend
	if windows {
		// Room for the unbinds and binds, posted outside post's count
		// (the unbinds are signaled, and each completion frees the
		// slots of the unsignaled binds before it): two per request
		// in flight, and on the service connection the first bind of
		// every chunk, before INFO_RSP.
		if cid == 0 {
			maxSend += qd + 2*ServiceConQueueDepth
		} else {
			sqAvail -= 2 * qd
		}
	}
	return maxSend, maxRecv, sqAvail
}

// acceptCon accepts c's connection; the service connection gets a
// receive for INFO_REQ before it is accepted.
// +checklocksignore: c.sqAvail is set before c is the fabric's handler and
// before anything posts on c (the path's heartbeat starts at INFO_REQ).
func (p *SrvPath) acceptCon(req fabric.ConnRequest, c *srvConn) error {
	x := p.sess
	cfg := &x.srv.cfg
	qd := x.queueDepth
	attr := fabric.ConnAttr{Handler: c}
	attr.MaxSendWR, attr.MaxRecvWR, c.sqAvail = connQueues(cfg, qd, c.cid, p.windows)
	if c.cid == 0 {
		attr.Recvs = []fabric.RecvWR{{ID: wrInfoReq, Buf: p.infoMem.Bytes()[:InfoReqSize], LKey: p.infoMR.LKey()}}
	}
	var b [ConnRspSize]byte
	rsp := ConnRsp{
		Magic: Magic, Version: ProtoVer,
		QueueDepth: uint16(qd),
		MaxIOSize:  uint32(x.chunkSize - MaxHdrSize),
		MaxHdrSize: MaxHdrSize,
	}
	if cfg.AlwaysInvalidate {
		rsp.Flags = MsgNewRkeyF
	}
	_, err := req.Accept(p.pd, attr, rsp.Encode(b[:]))
	return err
}

// close starts closing the path once (close_path).
func (p *SrvPath) close(why string) {
	was := p.State()
	if p.changeState(SrvPathClosing) {
		e := p.lg().WithField("reason", why)
		if was == SrvPathConnecting {
			// A path that never got through INFO_REQ: what a peer
			// that churns paths leaves by the dozen a second, so
			// bounded for the whole server.
			p.sess.srv.unprovenRL.Log(e, log.InfoLevel, "closing path")
		} else {
			e.Info("closing path")
		}
		go p.closeWork()
	}
}

// closeWork is rtrs_srv_close_work: stop the heartbeat, close the
// connections, wait for the IO the user still holds, tell the user if this
// was the session's last path, and free everything.
func (p *SrvPath) closeWork() {
	x := p.sess
	defer x.srv.wg.Done()
	p.zombie.Stop()
	x.mu.Lock()
	for p.accepting > 0 {
		x.acceptCond.Wait()
	}
	conns := append([]*srvConn(nil), p.conns...)
	x.mu.Unlock()
	for _, c := range conns {
		if c != nil && c.qp != nil {
			c.qp.Close()
		}
	}
	// Only now: a completion still running could have started it.
	p.hb.stop()
	for _, c := range conns {
		if c != nil {
			for _, op := range c.takeWaiting() {
				op.finish()
			}
			c.releaseHolds()
		}
	}
	p.inflight.Wait()
	lost := p.established
	if p.established {
		p.established = false
		x.pathDown()
	}
	p.freeResources()
	x.removePath(p, lost)
	p.changeState(SrvPathClosed)
	close(p.closed)
}

// processInfoReq answers INFO_REQ (process_info_req): the path becomes
// CONNECTED and the client learns the chunks' addresses and keys.
func (p *SrvPath) processInfoReq(c *srvConn, wc *fabric.WC) error {
	x := p.sess
	if c.cid != 0 || p.State() != SrvPathConnecting {
		return errors.New("unexpected INFO_REQ")
	}
	var msg InfoReq
	if err := msg.Decode(p.infoMem.Bytes()[:min(int(wc.ByteLen), InfoReqSize)]); err != nil {
		return fmt.Errorf("path info request is malformed: %w", err)
	}
	if err := ValidSessName(msg.Pathname); err != nil {
		return err
	}
	x.mu.Lock()
	conns := append([]*srvConn(nil), p.conns...)
	x.mu.Unlock()
	for i, cc := range conns {
		if cc == nil || !cc.attached.Load() {
			return fmt.Errorf("INFO_REQ before connection %d was established", i)
		}
	}
	if err := x.claimName(msg.Pathname); err != nil {
		// A refusal of the path, counted with the connection
		// requests refused (Rejected): EPERM for a name another
		// session has, the NameClaimer's errno (EACCES: a name bound
		// to another identity).
		errno := syscall.EINVAL
		errors.As(err, &errno)
		x.srv.rejected[errno&0xff].Add(1)
		return err
	}
	p.logp.Store(x.logp.Load().WithField("path", p.Name()))
	// The path has proved itself: now its chunks.
	if err := p.allocChunks(); err != nil {
		return fmt.Errorf("allocating the chunks: %w", err)
	}
	for _, cc := range conns {
		if err := cc.postRecvs(); err != nil {
			return err
		}
	}
	if !p.changeState(SrvPathConnected) {
		return errors.New("path left CONNECTING")
	}
	p.zombie.Stop()
	p.hb.start()
	if err := x.pathUp(p); err != nil {
		return fmt.Errorf("the server's user refused the session: %w", err)
	}
	rsp := InfoRsp{Desc: make([]SGDesc, len(p.mrs))}
	for i, mr := range p.mrs {
		if p.wins != nil {
			// Bound on this connection before the answer that names
			// the keys is sent on it.
			if _, err := p.wins[i].Bind(c.qp); err != nil {
				return fmt.Errorf("binding the window of chunk %d: %w", i, err)
			}
		}
		rsp.Desc[i] = SGDesc{Addr: mr.Addr(), Key: mr.RKey(), Len: uint32(len(mr.Buf()))}
	}
	out := rsp.Encode(p.infoMem.Bytes()[InfoReqSize:])
	c.infoWR = fabric.SendWR{ID: wrInfoRsp, Op: fabric.OpSend, NumSGE: 1}
	c.infoWR.SG[0] = fabric.SGE{Buf: out, LKey: p.infoMR.LKey()}
	p.lg().Info("path connected")
	_, err := c.post(&c.infoWR, 1, nil)
	return err
}

// processIOReq validates a request the client wrote into chunk msgID and
// hands it to the user (process_io_req, process_read, process_write).
// Every field is checked: a violation closes the path.
func (p *SrvPath) processIOReq(c *srvConn, msgID, off uint32) error {
	if p.State() != SrvPathConnected {
		p.rl.Log(p.lg(), log.WarnLevel, "request on a path that is not connected: dropped")
		return nil
	}
	chunk := p.chunk(msgID)
	if int(off)+2 > len(chunk) {
		return fmt.Errorf("message at offset %d past the chunk", off)
	}
	// Decode into locals: the op may still belong to a request in flight
	// until the chunk is claimed below.
	var (
		usrLen int
		dir    Dir
		rd     RDMARead
	)
	switch typ := le.Uint16(chunk[off:]); typ {
	case MsgWrite:
		var m RDMAWrite
		if err := m.Decode(chunk[off:]); err != nil {
			return err
		}
		usrLen, dir = int(m.UsrLen), Write
	case MsgRead:
		if err := rd.Decode(chunk[off:]); err != nil {
			return err
		}
		usrLen, dir = int(rd.UsrLen), Read
	default:
		return fmt.Errorf("unknown message type %d", typ)
	}
	if usrLen > int(off) {
		return fmt.Errorf("usr_len %d > offset %d", usrLen, off)
	}
	dataLen := int(off) - usrLen
	if dir == Read && rd.SGCnt == 1 && (rd.Desc.Len == 0 || int(rd.Desc.Len) > dataLen) {
		return fmt.Errorf("read descriptor of %d bytes for %d bytes of data", rd.Desc.Len, dataLen)
	}
	if dir == Read && rd.SGCnt == 0 && dataLen != 0 {
		// The data of a read could go nowhere. A read without data
		// (the kernel's flush) has its message right after the user's.
		return fmt.Errorf("read without a descriptor for %d bytes of data", dataLen)
	}
	op := &p.ops[msgID]
	req := opReq{c: c, dir: dir, rd: rd, dataLen: dataLen, off: off}
	for {
		switch op.state.Load() {
		case opIdle:
			if op.state.CompareAndSwap(opIdle, opWorking) {
				p.stats.inflight.Add(1)
				p.inflight.Add(1)
				op.start(req)
				return nil
			}
		case opAnswering:
			// The client has the answer and reuses the chunk before
			// the post of that answer returned here: legitimate. The
			// request waits for it (finish).
			if op.state.CompareAndSwap(opAnswering, opClaiming) {
				op.pend = req
				op.state.Store(opPending)
				return nil
			}
		default:
			return fmt.Errorf("request for chunk %d, which is still in use", msgID)
		}
	}
}

// sendHB posts a HB_MSG on the service connection.
func (p *SrvPath) sendHB() error {
	p.sess.mu.Lock()
	c := p.conns[0]
	p.sess.mu.Unlock()
	if c == nil {
		return errPathDown
	}
	return c.postHB(ImmHBMsg)
}

func (p *SrvPath) chunk(id uint32) []byte {
	cs := p.sess.chunkSize
	return p.chunkBuf[int(id)*cs : (int(id)+1)*cs]
}

func (p *SrvPath) lg() *log.Entry { return p.logp.Load() }
