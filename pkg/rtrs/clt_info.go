package rtrs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Establishing a client path (init_path): dialing its connections, the
// server's limits from cid 0's conn_rsp, a reject's errno, and the
// INFO_REQ / INFO_RSP exchange that maps the server's chunks.

// initPath establishes all connections of the path and exchanges
// INFO_REQ/INFO_RSP (init_path). On failure the path is CONNECTING_ERR
// and nothing of the attempt is left.
func (p *CltPath) initPath(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, p.sess.cfg.ConnectTimeout)
	defer cancel()
	p.connecting.Store(&cancel)
	defer p.connecting.Store(nil)
	p.mu.Lock()
	p.reconCnt++
	p.mu.Unlock()
	res, err := p.initConns(ctx)
	if err == nil {
		err = p.sendPathInfo(ctx, res)
	}
	if err != nil {
		p.changeStateFromTo(CltPathConnecting, CltPathConnectingErr)
		if res != nil {
			p.destroyRes(res)
		}
		return err
	}
	if !p.changeStateFromTo(CltPathConnecting, CltPathConnected) {
		p.destroyRes(res)
		return fmt.Errorf("rtrs: path failed while connecting: %w", syscall.ECONNRESET)
	}
	p.mu.Lock()
	p.established = true
	p.reconnectAttempts = 0
	p.downSince = time.Time{}
	p.forNewClt = true // a later reconnect may recreate a lost server session
	p.mu.Unlock()
	p.stats.reconnSucc.Add(1)
	p.hb.start()
	p.lg().Info("path connected")
	p.sess.pathUp()
	return nil
}

// initConns resolves the device and dials every connection of the path
// (init_conns), learning the server's limits from cid 0's answer.
func (p *CltPath) initConns(ctx context.Context) (*pathRes, error) {
	s := p.sess
	p.mu.Lock()
	pa, reconCnt, first := p.addr, p.reconCnt, p.forNewClt
	p.mu.Unlock()
	dev, err := s.cfg.Fabric.Resolve(ctx, pa.Src, pa.Dst)
	if err != nil {
		return nil, err
	}
	pd, err := dev.AllocPD()
	if err != nil {
		return nil, err
	}
	res := &pathRes{path: p, dev: dev, pd: pd, infoDone: make(chan error, 1)}
	empty := []fabric.MR{}
	res.mrs.Store(&empty)
	p.submitMu.Lock()
	if p.res != nil {
		// Only the path's goroutine creates attempts and it destroys
		// each before the next: a leftover is a bug, not a peer's doing.
		p.submitMu.Unlock()
		pd.Close()
		return nil, fmt.Errorf("rtrs: path still holds a previous connection attempt: %w", syscall.EBUSY)
	}
	p.res = res
	p.submitMu.Unlock()
	cidNum := s.cfg.ConnsPerPath + 1
	for cid := 0; cid < cidNum; cid++ {
		req := ConnReq{
			Magic: Magic, Version: ProtoVer,
			CID: uint16(cid), CIDNum: uint16(cidNum), ReconCnt: reconCnt,
			SessUUID: p.uuid, PathsUUID: s.uuid, FirstConn: first,
		}
		var priv [ConnReqSize]byte
		c := &cltConn{path: p, res: res, cid: cid}
		attr := fabric.ConnAttr{Handler: c}
		if cid == 0 {
			attr.MaxSendWR = ServiceConQueueDepth*2 + 2
			attr.MaxRecvWR = attr.MaxSendWR
		} else {
			attr.MaxSendWR = res.queueDepth*4 + 1
			attr.MaxRecvWR = res.queueDepth*3 + 1
		}
		qp, rsp, err := dev.Dial(ctx, fabric.DialParams{
			Src: pa.Src, Dst: pa.Dst, PD: pd, PrivateData: req.Encode(priv[:]), Attr: attr,
		})
		if err != nil {
			var rej *fabric.RejectError
			if errors.As(err, &rej) {
				err = rejectErr(pa.Dst, rej.PrivateData)
			}
			return res, fmt.Errorf("connect cid %d: %w", cid, err)
		}
		_ = qp // c.qp was set by Attached
		res.conns = append(res.conns, c)
		if err := p.connEstablished(res, c, rsp); err != nil {
			return res, fmt.Errorf("connect cid %d: %w", cid, err)
		}
	}
	return res, nil
}

// rejectErr turns a reject's conn_rsp into the errno it carries. An RTRS
// server, ours or the kernel's, rejects with a conn_rsp that starts with
// the RTRS magic; a reject without it comes from something else: over
// RDMA the CM's own when nothing listens on dst's port (its private data
// is zeros), or a peer that is not an RTRS server.
func rejectErr(dst netip.AddrPort, priv []byte) error {
	var rsp ConnRsp
	if rsp.Decode(priv) != nil || rsp.Magic != Magic {
		return fmt.Errorf("rtrs: %v refused the connection: nothing listens there, or it is not an RTRS server: %w", dst, syscall.ECONNREFUSED)
	}
	if rsp.Errno == 0 {
		return fmt.Errorf("rtrs: %v rejected the connection with a malformed RTRS answer (no errno): %w", dst, syscall.ECONNRESET)
	}
	switch rsp.Errno {
	case syscall.EBUSY:
		return fmt.Errorf("rtrs: previous session still exists on the server, retry later: %w", rsp.Errno)
	case syscall.EAGAIN:
		return fmt.Errorf("rtrs: the server takes new paths from this client no faster than its new_path_rate, retry later: %w", rsp.Errno)
	}
	return fmt.Errorf("rtrs: rejected by server: %w", rsp.Errno)
}

// connEstablished checks a conn_rsp (rtrs_rdma_conn_established); cid 0's
// sets the path's and, the first time, the session's limits.
func (p *CltPath) connEstablished(res *pathRes, c *cltConn, priv []byte) error {
	var rsp ConnRsp
	if err := rsp.Decode(priv); err != nil {
		return fmt.Errorf("invalid RTRS connection response: %w", syscall.ECONNRESET)
	}
	if rsp.Magic != Magic {
		return fmt.Errorf("invalid RTRS magic %#x: %w", rsp.Magic, syscall.ECONNRESET)
	}
	if rsp.Version>>8 != ProtoVerMajor {
		return fmt.Errorf("unsupported RTRS version %d.%d: %w", rsp.Version>>8, rsp.Version&0xff, syscall.ECONNRESET)
	}
	if rsp.Errno != 0 {
		return fmt.Errorf("server answered with errno %w: %w", rsp.Errno, syscall.ECONNRESET)
	}
	if c.cid != 0 {
		return nil
	}
	s := p.sess
	qd := int(rsp.QueueDepth)
	if was := int(s.queueDepth.Load()); was != 0 && qd != was {
		p.mu.Lock()
		p.reconnectAttempts = -1 // stop automatic reconnects
		p.mu.Unlock()
		p.lg().WithFields(log.Fields{"was": was, "now": qd}).
			Error("queue depth changed: disabling auto-reconnect; trigger a manual reconnect after the issue is resolved")
		return ErrQueueDepthChanged
	}
	if rsp.MaxHdrSize < RDMAReadSize+SGDescSize || rsp.MaxIOSize == 0 ||
		uint64(rsp.MaxIOSize)+uint64(rsp.MaxHdrSize) > 1<<immPayloadBits {
		return fmt.Errorf("server limits max_io_size %d max_hdr_size %d: %w", rsp.MaxIOSize, rsp.MaxHdrSize, syscall.ECONNRESET)
	}
	if err := s.initResources(qd, rsp.MaxHdrSize, rsp.MaxIOSize); err != nil {
		return err
	}
	if qd != int(s.queueDepth.Load()) {
		return ErrQueueDepthChanged
	}
	res.queueDepth = qd
	res.maxHdrSize = int(rsp.MaxHdrSize)
	res.maxIOSize = int(rsp.MaxIOSize)
	res.chunkSize = res.maxIOSize + res.maxHdrSize
	res.flags = rsp.Flags
	res.sigIntv = uint32(min(qd, ServiceConQueueDepth))
	res.rbufs = make([]rbuf, qd)
	res.reqs = make([]pathReq, qd)
	for {
		m := s.maxIOSize.Load()
		if rsp.MaxIOSize >= m || s.maxIOSize.CompareAndSwap(m, rsp.MaxIOSize) {
			break
		}
	}
	p.mu.Lock()
	if la := c.qp.LocalAddr(); la.IsValid() {
		p.addr.Src = netip.AddrPortFrom(la.Addr().Unmap(), 0)
	}
	p.hcaName, p.hcaPort = res.dev.Name(), res.dev.Port()
	p.logp.Store(s.log.WithField("path", p.addr.String()))
	p.mu.Unlock()
	return nil
}

// sendPathInfo registers the session's memory in the path's PD, sends
// INFO_REQ and waits for INFO_RSP (rtrs_send_path_info).
func (p *CltPath) sendPathInfo(ctx context.Context, res *pathRes) error {
	s := p.sess
	s.regMu.Lock()
	for _, b := range s.regions {
		if b == nil {
			continue
		}
		if err := p.registerResLocked(res, b); err != nil {
			s.regMu.Unlock()
			return err
		}
	}
	s.regMu.Unlock()
	for _, c := range res.conns {
		if err := c.allocIUs(); err != nil {
			return err
		}
	}
	rxSize := InfoRspSize(res.queueDepth)
	mem, err := s.cfg.Fabric.AllocMemory(InfoReqSize + rxSize)
	if err != nil {
		return err
	}
	res.infoMem = mem
	if res.infoMR, err = res.pd.RegisterMR(mem.Bytes(), fabric.AccessLocalWrite); err != nil {
		return err
	}
	tx, rx := mem.Bytes()[:InfoReqSize], mem.Bytes()[InfoReqSize:]
	con0 := res.conns[0]
	if err := con0.qp.PostRecv(&fabric.RecvWR{ID: wrInfoRsp, Buf: rx, LKey: res.infoMR.LKey()}); err != nil {
		return err
	}
	req := InfoReq{Pathname: s.name}
	req.Encode(tx)
	wr := fabric.SendWR{ID: wrInfoReq, Op: fabric.OpSend, NumSGE: 1, Signaled: true}
	wr.SG[0] = fabric.SGE{Buf: tx, LKey: res.infoMR.LKey()}
	res.infoSent.Store(true)
	if err := con0.qp.PostSend(&wr); err != nil {
		return err
	}
	select {
	case err := <-res.infoDone:
		return err
	case <-ctx.Done():
		return fmt.Errorf("waiting for the path info response: %w", syscall.ETIMEDOUT)
	}
}

// processInfoRsp checks the server's chunk descriptors and posts the
// receives of every connection (process_info_rsp).
func (res *pathRes) processInfoRsp(wc *fabric.WC) error {
	if wc.Status != fabric.WCSuccess {
		return fmt.Errorf("path info response receive failed: %w", syscall.ECONNRESET)
	}
	buf := res.infoMem.Bytes()[InfoReqSize:]
	var msg InfoRsp
	if err := msg.Decode(buf[:min(int(wc.ByteLen), len(buf))]); err != nil {
		return fmt.Errorf("path info response is malformed: %v: %w", err, syscall.EINVAL)
	}
	n := len(msg.Desc)
	qd, chunk := res.queueDepth, res.chunkSize
	if n == 0 || qd%n != 0 {
		return fmt.Errorf("incorrect sg_cnt %d for queue depth %d: %w", n, qd, syscall.EINVAL)
	}
	if err := CheckImmBudget(uint32(qd), uint32(chunk)); err != nil {
		return fmt.Errorf("%v: %w", err, syscall.EINVAL)
	}
	if err := CheckImmBudget(uint32(n), uint32(chunk)); err != nil {
		return fmt.Errorf("%v: %w", err, syscall.EINVAL)
	}
	total, i := uint64(0), 0
	for _, d := range msg.Desc {
		if d.Len == 0 || int(d.Len)%chunk != 0 {
			return fmt.Errorf("incorrect descriptor length %d: %w", d.Len, syscall.EINVAL)
		}
		total += uint64(d.Len)
		for l, a := int(d.Len), d.Addr; l > 0 && i < qd; i++ {
			res.rbufs[i].addr = a
			res.rbufs[i].rkey.Store(d.Key)
			l -= chunk
			a += uint64(chunk)
		}
	}
	if i != qd || total != uint64(chunk)*uint64(qd) {
		return fmt.Errorf("incorrect sg vector, not fully mapped: %w", syscall.EINVAL)
	}
	for _, c := range res.conns {
		if err := c.postRecvs(); err != nil {
			return err
		}
	}
	return nil
}
