package rtrs

import (
	"context"
	crand "crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// CltPath is one src@dst path of a client session (struct rtrs_clt_path):
// a service connection (cid 0) and ConnsPerPath IO connections. Its
// lifecycle (connect, error recovery, reconnect, close) runs in one
// goroutine; IO is posted by the callers' goroutines.
type CltPath struct {
	sess  *CltSession
	uuid  [16]byte
	stats *PathStats
	hb    heartbeat
	logp  atomic.Pointer[log.Entry]
	rl    log.Limiter
	// postRL: posts fail together when a connection dies: one line a
	// path every 10 s, the next saying how many it left out.
	postRL log.Limiter

	state atomic.Int32 // PathState; written under mu
	// mu guards the state changes and the fields below.
	mu                sync.Mutex
	addr              PathAddr
	hcaName           string
	hcaPort           int
	reconnectAttempts int
	nextAttempt       time.Time // when the scheduled reconnect attempt comes; zero: none
	downSince         time.Time // when the path went down (ctrl_loss_tmo); zero while up
	forNewClt         bool
	established       bool
	reconCnt          uint16
	stateCh           chan struct{} // closed and replaced on every state change

	// submitMu fences IO against recovery: posters hold it shared while
	// they check the state and post; recovery takes it exclusively once
	// after leaving CONNECTED, so every post that saw CONNECTED is done
	// (the kernel's synchronize_rcu).
	submitMu sync.RWMutex
	res      *pathRes // the current connection attempt's resources

	cmds      chan pathCmd
	recoverCh chan struct{}
	done      chan struct{}
	// connecting cancels the connection attempt the goroutine is in, so
	// a disconnect or remove need not wait for it to time out.
	connecting atomic.Pointer[context.CancelFunc]
}

// pathRes holds what one connection attempt of a path set up. It is built
// by the path's goroutine before the path is CONNECTED and torn down after
// it left it; IO and completions only read it.
type pathRes struct {
	path       *CltPath
	dev        fabric.Device
	pd         fabric.PD
	conns      []*cltConn
	queueDepth int
	maxHdrSize int
	maxIOSize  int
	chunkSize  int
	flags      uint32
	sigIntv    uint32
	rbufs      []rbuf
	reqs       []pathReq
	mrs        atomic.Pointer[[]fabric.MR] // per session region id
	infoMem    fabric.Memory
	infoMR     fabric.MR
	infoDone   chan error  // cap 1
	infoSent   atomic.Bool // INFO_REQ posted: a path down now is its answer
}

// rbuf is a server chunk: its address and current rkey (struct rtrs_rbuf).
type rbuf struct {
	addr uint64
	rkey atomic.Uint32
}

// pathReq is a request in flight on this path (struct rtrs_clt_io_req):
// the permit of the same index carries the rest.
type pathReq struct {
	inUse atomic.Bool
	wr    fabric.SendWR
}

type pathCmdOp int

const (
	cmdConnect pathCmdOp = iota
	cmdKeepTrying
	cmdReconnect
	cmdDisconnect
	cmdRemove
)

type pathCmd struct {
	op    pathCmdOp
	ctx   context.Context
	reply chan error
}

func (s *CltSession) newPath(pa PathAddr, forNewClt bool) *CltPath {
	p := &CltPath{
		sess:      s,
		addr:      pa,
		stats:     newPathStats(),
		forNewClt: forNewClt,
		stateCh:   make(chan struct{}),
		cmds:      make(chan pathCmd),
		recoverCh: make(chan struct{}, 1),
		done:      make(chan struct{}),
		hcaName:   "",
	}
	p.postRL.Interval, p.postRL.Burst = 10*time.Second, 1
	if s.cfg.UUID != ([16]byte{}) {
		p.uuid = derivePathUUID(s.uuid, pa)
	} else {
		crand.Read(p.uuid[:])
	}
	// recon_cnt starts anywhere: a restarted client then differs from
	// its predecessor's count for the same path, which is how the server
	// tells a new connection from a stale one.
	var rc [2]byte
	crand.Read(rc[:])
	p.reconCnt = uint16(rc[0]) | uint16(rc[1])<<8
	p.state.Store(int32(PathConnecting))
	p.logp.Store(s.log.WithField("path", pa.String()))
	p.hb.init(s.cfg.HBInterval, s.cfg.HBMissedMax, p.sendHB, func() {
		p.lg().Error("heartbeat: peer silent for too long")
		p.errorRecovery(nil)
	})
	p.hb.probeEvery = min(probePeriod, s.cfg.HBInterval)
	p.hb.busy = func() bool { return p.stats.inflight.Load() > 0 }
	return p
}

// probePeriod is how often a path with requests waiting looks for
// silence from its server, and probes it with a heartbeat (heartbeat.go).
const probePeriod = 200 * time.Millisecond

// State returns the path's state.
func (p *CltPath) State() PathState { return PathState(p.state.Load()) }

// Name is the path's "src@dst" name.
func (p *CltPath) Name() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.addr.String()
}

// Addr returns the path's addresses; Src is the one actually used once
// the path has connected.
func (p *CltPath) Addr() PathAddr {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.addr
}

// HCAName and HCAPort name the device the path runs on.
func (p *CltPath) HCAName() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.hcaName
}

func (p *CltPath) HCAPort() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.hcaPort
}

// UUID is the path's UUID (sess_uuid on the wire).
func (p *CltPath) UUID() [16]byte { return p.uuid }

// Stats returns the path's counters.
func (p *CltPath) Stats() *PathStats { return p.stats }

// CurLatency is the last heartbeat round trip (cur_latency).
func (p *CltPath) CurLatency() time.Duration { return p.hb.latency() }

// changeStateLocked applies the kernel's transition table; every state
// change goes through here.
func (p *CltPath) changeStateLocked(to PathState) bool {
	from := PathState(p.state.Load())
	if !pathTransitionAllowed(from, to) {
		return false
	}
	p.state.Store(int32(to))
	close(p.stateCh)
	p.stateCh = make(chan struct{})
	return true
}

func (p *CltPath) changeStateFromTo(from, to PathState) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if PathState(p.state.Load()) != from {
		return false
	}
	return p.changeStateLocked(to)
}

func (p *CltPath) changeStateGetOld(to PathState) (bool, PathState) {
	p.mu.Lock()
	defer p.mu.Unlock()
	old := PathState(p.state.Load())
	return p.changeStateLocked(to), old
}

// errorRecovery is called on a connection error or a heartbeat timeout
// (rtrs_rdma_error_recovery): a connected path goes RECONNECTING and its
// goroutine recovers; a path being established goes CONNECTING_ERR.
func (p *CltPath) errorRecovery(res *pathRes) {
	if res != nil && p.curRes() != res {
		return // a stale attempt's connection
	}
	if p.changeStateFromTo(PathConnected, PathReconnecting) {
		select {
		case p.recoverCh <- struct{}{}:
		default:
		}
		return
	}
	if p.changeStateFromTo(PathConnecting, PathConnectingErr) && res != nil {
		err := errInfoUnanswered
		if !res.infoSent.Load() {
			err = fmt.Errorf("rtrs: the path went down while it was being established: %w", syscall.ECONNRESET)
		}
		select {
		case res.infoDone <- err:
		default:
		}
	}
}

func (p *CltPath) curRes() *pathRes {
	p.submitMu.RLock()
	defer p.submitMu.RUnlock()
	return p.res
}

// run is the path's goroutine: it serializes establishment, error
// recovery, reconnects and the control commands.
func (p *CltPath) run() {
	defer p.sess.wg.Done()
	defer close(p.done)
	var timer *time.Timer
	var timerC <-chan time.Time
	stopTimer := func() {
		if timer != nil {
			timer.Stop()
			timer, timerC = nil, nil
			p.unscheduled()
		}
	}
	schedule := func() {
		stopTimer()
		d := p.reconnectDelay()
		if left, ok := p.lossLeft(); ok && left < d {
			d = left // ctrl_loss_tmo runs out first: give up then
		}
		p.nextAttemptIn(d)
		timer = time.NewTimer(d)
		timerC = timer.C
	}
	defer p.unscheduled()
	for {
		select {
		case <-p.recoverCh:
			if p.State() != PathReconnecting {
				continue
			}
			p.wentDown()
			p.stopAndDestroyConns()
			schedule()
		case <-timerC:
			timer, timerC = nil, nil
			p.unscheduled()
			if retry, _ := p.reconnectWork(context.Background(), false); retry {
				schedule()
			}
		case c := <-p.cmds:
			switch c.op {
			case cmdConnect:
				c.reply <- p.initPath(c.ctx)
			case cmdKeepTrying:
				if p.changeStateFromTo(PathConnectingErr, PathReconnecting) {
					p.wentDown()
					schedule()
				}
				c.reply <- nil
			case cmdReconnect:
				stopTimer()
				err := p.reconnectCmd(c.ctx)
				if p.State() == PathReconnecting {
					schedule()
				}
				c.reply <- err
			case cmdDisconnect:
				stopTimer()
				p.closeConns()
				c.reply <- nil
			case cmdRemove:
				stopTimer()
				for {
					p.closeConns()
					if ok, old := p.changeStateGetOld(PathDead); ok || old == PathDead {
						break
					}
				}
				p.sess.removePath(p)
				c.reply <- nil
				return
			}
		}
	}
}

func (p *CltPath) do(ctx context.Context, op pathCmdOp) error {
	if op == cmdDisconnect || op == cmdRemove {
		if cancel := p.connecting.Load(); cancel != nil {
			(*cancel)()
		}
	}
	// A command whose ctx has ended is not made: the select below
	// would pick the send or the ctx at random.
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("rtrs: path command not made: %w", err)
	}
	c := pathCmd{op: op, ctx: ctx, reply: make(chan error, 1)}
	select {
	case p.cmds <- c:
	case <-p.done:
		return fmt.Errorf("rtrs: path removed: %w", syscall.ENODEV)
	case <-ctx.Done():
		return fmt.Errorf("rtrs: path busy, command not made: %w", ctx.Err())
	}
	return <-c.reply
}

// connect establishes the path for the first time.
func (p *CltPath) connect(ctx context.Context) error { return p.do(ctx, cmdConnect) }

// connectRetryBusy connects, and if the server still held the path (a
// predecessor's: it drops that one and answers EBUSY) tries again. A
// server that takes new paths from this client more slowly than they
// come (EAGAIN: its new_path_rate) is asked again, after 100 ms, then
// twice as long each time up to a second, as long as ctx lasts.
func (p *CltPath) connectRetryBusy(ctx context.Context) error {
	err := p.connect(ctx)
	if errors.Is(err, syscall.EBUSY) && ctx.Err() == nil {
		err = p.Reconnect(ctx)
	}
	wait := 100 * time.Millisecond
	for errors.Is(err, syscall.EAGAIN) {
		t := time.NewTimer(wait + rand.N(wait/4))
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
		wait = min(2*wait, time.Second)
		err = p.Reconnect(ctx)
	}
	return err
}

// keepTrying hands a path that failed to connect to the automatic
// reconnects.
func (p *CltPath) keepTrying() { p.do(context.Background(), cmdKeepTrying) }

// derivePathUUID is a path's UUID when the session's is given: the same
// session and addresses give the same path, across client restarts.
func derivePathUUID(sess [16]byte, pa PathAddr) [16]byte {
	h := sha256.New()
	h.Write(sess[:])
	h.Write([]byte(pa.sysfsName()))
	var u [16]byte
	copy(u[:], h.Sum(nil))
	return u
}

// Reconnect disconnects and reconnects the path now (paths/<p>/reconnect).
// It returns nil if the path is connected afterwards, ENOTCONN if not, and
// EBUSY if the path is in a state that cannot be reconnected (closing,
// or being established). It bypasses max_reconnect_attempts. ctx bounds
// the attempt; if it ends before the path takes the command, the path
// is left as it was and ctx's error returned.
func (p *CltPath) Reconnect(ctx context.Context) error { return p.do(ctx, cmdReconnect) }

// Disconnect closes the path's connections and keeps it CLOSED until a
// Reconnect (paths/<p>/disconnect). Requests in flight fail over.
func (p *CltPath) Disconnect() error { return p.do(context.Background(), cmdDisconnect) }

// Remove disconnects the path and removes it from the session
// (paths/<p>/remove_path).
func (p *CltPath) Remove() error {
	err := p.do(context.Background(), cmdRemove)
	if errors.Is(err, syscall.ENODEV) {
		return nil
	}
	return err
}

func (p *CltPath) reconnectDelay() time.Duration {
	cfg := &p.sess.cfg
	p.mu.Lock()
	n := p.reconnectAttempts
	p.mu.Unlock()
	d := p.sess.ReconnectDelay()
	limit := max(cfg.ReconnectMaxDelay, d)
	for i := 0; i < n && d < limit; i++ {
		d *= 2
	}
	d = min(d, limit)
	if cfg.ReconnectJitter > 0 {
		d += rand.N(cfg.ReconnectJitter)
	}
	return d
}

// wentDown notes when the path went down, unless it was already.
func (p *CltPath) wentDown() {
	p.mu.Lock()
	if p.downSince.IsZero() {
		p.downSince = time.Now()
	}
	p.mu.Unlock()
}

// lossLeft is the time ctrl_loss_tmo leaves the path to reconnect in
// (never below 0), and whether the session has a ctrl_loss_tmo.
func (p *CltPath) lossLeft() (time.Duration, bool) {
	tmo := p.sess.CtrlLossTmo()
	if tmo < 0 {
		return 0, false
	}
	p.mu.Lock()
	since := p.downSince
	p.mu.Unlock()
	if since.IsZero() {
		return tmo, true
	}
	return max(tmo-time.Since(since), 0), true
}

// CtrlLossIn is how long the path, down, has left to reconnect before it
// gives up (ctrl_loss_tmo after it went down; never below 0); ok is false
// while it is up, once it has given up, or when the session has no
// ctrl_loss_tmo.
func (p *CltPath) CtrlLossIn() (left time.Duration, ok bool) {
	switch p.State() {
	case PathConnected, PathClosed, PathDead:
		return 0, false
	}
	p.mu.Lock()
	down := !p.downSince.IsZero()
	p.mu.Unlock()
	if !down {
		return 0, false
	}
	return p.lossLeft()
}

// unscheduled notes that no reconnect attempt is scheduled.
func (p *CltPath) unscheduled() {
	p.mu.Lock()
	p.nextAttempt = time.Time{}
	p.mu.Unlock()
}

// ReconnectAttempts is how many reconnect attempts the path made since it
// was last connected (or since a manual reconnect), and how long until
// the next one; next is 0 when none is scheduled (connected, connecting
// now, or given up).
func (p *CltPath) ReconnectAttempts() (attempts int, next time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.nextAttempt.IsZero() {
		next = max(time.Until(p.nextAttempt), time.Millisecond)
	}
	return max(p.reconnectAttempts, 0), next
}

// nextAttemptIn notes that the next reconnect attempt comes in d, and
// says so: which of how many it is ("of unlimited" for
// max_reconnect_attempts -1).
func (p *CltPath) nextAttemptIn(in time.Duration) {
	max := p.sess.MaxReconnectAttempts()
	left, bounded := p.lossLeft()
	p.mu.Lock()
	n := p.reconnectAttempts + 1
	// The timer's work gives up, and says so.
	last := (max >= 0 && n > max) || (bounded && left <= in)
	if !last {
		p.nextAttempt = time.Now().Add(in)
	}
	p.mu.Unlock()
	if last {
		return
	}
	of := "unlimited"
	if max >= 0 {
		of = strconv.Itoa(max)
	}
	p.lg().WithFields(log.Fields{"attempt": n, "max_reconnect_attempts": max, "in": in.Round(time.Millisecond).String()}).
		Infof("path %s: reconnect attempt %d of %s in %v", p.Name(), n, of, in.Round(time.Millisecond))
}

// reconnectWork is rtrs_clt_reconnect_work: give up once the attempts are
// spent, else try to establish the path again. It reports whether another
// attempt should be scheduled, and why the attempt failed.
func (p *CltPath) reconnectWork(ctx context.Context, manual bool) (bool, error) {
	if p.State() != PathReconnecting {
		return false, nil
	}
	max := p.sess.MaxReconnectAttempts()
	p.mu.Lock()
	giveUp := !manual && (p.reconnectAttempts < 0 || (max >= 0 && p.reconnectAttempts >= max))
	tmo := p.sess.CtrlLossTmo()
	lost := !manual && !giveUp && tmo >= 0 && !p.downSince.IsZero() && time.Since(p.downSince) >= tmo
	if !giveUp && !lost {
		p.reconnectAttempts++
	}
	p.mu.Unlock()
	if giveUp || lost {
		l := p.lg().WithField("max_reconnect_attempts", max)
		if lost {
			l = l.WithField("ctrl_loss_tmo", tmo.String())
		}
		l.Warn("giving up reconnecting; trigger a manual reconnect")
		p.closeConns()
		return false, nil
	}
	// The path may have failed again between the recovery that scheduled
	// this attempt and now (an error on a connection of the previous
	// attempt): whatever is left of it goes before a new one starts.
	p.stopAndDestroyConns()
	if !p.changeStateFromTo(PathReconnecting, PathConnecting) {
		return false, nil
	}
	err := p.initPath(ctx)
	if err == nil {
		return false, nil
	}
	if p.changeStateFromTo(PathConnectingErr, PathReconnecting) {
		p.stats.reconnFail.Add(1)
		p.lg().WithError(err).Warn("reconnect failed")
		return true, err
	}
	return false, err
}

// manualBusyRetries bounds how often a manual reconnect retries while the
// server still holds the path's previous connection: the server drops
// that one when it sees the new attempt, so the next try normally works.
const manualBusyRetries = 5

// reconnectCmd is rtrs_clt_reconnect_from_sysfs. ctx bounds the
// attempt (the connect timeout still applies within it); a path whose
// attempt it ended goes on reconnecting by itself.
func (p *CltPath) reconnectCmd(ctx context.Context) error {
	if err := ctx.Err(); err != nil { // it ended while the command waited
		return fmt.Errorf("rtrs: path reconnect not made: %w", err)
	}
	changed, old := p.changeStateGetOld(PathReconnecting)
	if !changed && old != PathReconnecting {
		return fmt.Errorf("rtrs: path is %v: %w", old, syscall.EBUSY)
	}
	if changed {
		p.mu.Lock()
		p.reconnectAttempts = 0
		p.downSince = time.Now() // a manual reconnect starts the clock again
		p.mu.Unlock()
		p.stopAndDestroyConns()
	}
	var last error
	for i := 0; ; i++ {
		retry, err := p.reconnectWork(ctx, true)
		last = err
		// EBUSY: the server still held the path's previous connection;
		// EAGAIN: it takes new paths from us no faster than its rate.
		if !retry || !(errors.Is(err, syscall.EBUSY) || errors.Is(err, syscall.EAGAIN)) || i == manualBusyRetries {
			break
		}
		t := time.NewTimer(min(p.sess.cfg.ReconnectDelay, 100*time.Millisecond) << i)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		if ctx.Err() != nil {
			break
		}
	}
	if p.State() != PathConnected {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("rtrs: path did not reconnect (%v): %w", err, syscall.ENOTCONN)
		}
		if errors.Is(last, syscall.EAGAIN) {
			// Still refused for the server's rate: the caller may
			// ask again later (connectRetryBusy does).
			return fmt.Errorf("rtrs: path did not reconnect: %w: %w", last, syscall.ENOTCONN)
		}
		return fmt.Errorf("rtrs: path did not reconnect: %w", syscall.ENOTCONN)
	}
	return nil
}

// closeConns is rtrs_clt_close_conns with wait: CLOSING, tear down, CLOSED.
func (p *CltPath) closeConns() {
	if ok, _ := p.changeStateGetOld(PathClosing); ok {
		p.stopAndDestroyConns()
		p.changeStateFromTo(PathClosing, PathClosed)
	}
}

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
		p.changeStateFromTo(PathConnecting, PathConnectingErr)
		if res != nil {
			p.destroyRes(res)
		}
		return err
	}
	if !p.changeStateFromTo(PathConnecting, PathConnected) {
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

// stopAndDestroyConns is rtrs_clt_stop_and_destroy_conns: fence IO, stop
// the heartbeat, close every connection (no completion can arrive after),
// fail over the requests that were in flight, and release the attempt.
func (p *CltPath) stopAndDestroyConns() {
	p.submitMu.Lock()
	res := p.res
	p.submitMu.Unlock()
	p.hb.stop()
	if res == nil {
		return
	}
	for i, c := range res.conns {
		c.qp.Close()
		if testHookConnClosed != nil {
			testHookConnClosed(i)
		}
	}
	var failed []*Permit
	for i := range res.reqs {
		if res.reqs[i].inUse.CompareAndSwap(true, false) {
			p.stats.inflight.Add(-1)
			failed = append(failed, &p.sess.permits[i])
		}
	}
	p.mu.Lock()
	wasUp := p.established
	p.established = false
	p.mu.Unlock()
	if wasUp {
		p.sess.pathDown()
	}
	if len(failed) > 0 {
		p.lg().WithField("requests", len(failed)).Info("failing over requests in flight")
	}
	for _, pm := range failed {
		p.sess.failover(p, pm)
	}
	p.destroyRes(res)
}

// testHookConnClosed, when set by a test, runs after stopAndDestroyConns
// closed connection i of a path.
var testHookConnClosed func(i int)

// destroyRes releases what an attempt set up; its connections must be
// closed or never started.
func (p *CltPath) destroyRes(res *pathRes) {
	for _, c := range res.conns {
		c.qp.Close()
	}
	p.sess.regMu.Lock()
	// Unpublish the attempt before its registrations go, so a region
	// registered or deregistered concurrently no longer finds it.
	p.submitMu.Lock()
	if p.res == res {
		p.res = nil
	}
	p.submitMu.Unlock()
	for _, mr := range *res.mrs.Load() {
		if mr != nil {
			mr.Close()
		}
	}
	empty := []fabric.MR{}
	res.mrs.Store(&empty)
	p.sess.regMu.Unlock()
	for _, c := range res.conns {
		c.freeIUs()
	}
	if res.infoMR != nil {
		res.infoMR.Close()
	}
	if res.infoMem != nil {
		res.infoMem.Free()
	}
	res.pd.Close()
}

// registerLocked registers session region b with the path's current
// attempt, if any. s.regMu must be held.
func (p *CltPath) registerLocked(b *Buffer) error {
	res := p.curRes()
	if res == nil {
		return nil
	}
	return p.registerResLocked(res, b)
}

func (p *CltPath) registerResLocked(res *pathRes, b *Buffer) error {
	old := *res.mrs.Load()
	if b.idx < len(old) && old[b.idx] != nil {
		return nil
	}
	access := fabric.AccessLocalWrite | fabric.AccessRemoteWrite
	if b.local {
		access = fabric.AccessLocalWrite
	}
	mr, err := res.pd.RegisterMR(b.b, access)
	if err != nil {
		return err
	}
	mrs := make([]fabric.MR, max(len(old), b.idx+1))
	copy(mrs, old)
	mrs[b.idx] = mr
	res.mrs.Store(&mrs)
	return nil
}

func (p *CltPath) deregisterLocked(b *Buffer) {
	res := p.curRes()
	if res == nil {
		return
	}
	old := *res.mrs.Load()
	if b.idx >= len(old) || old[b.idx] == nil {
		return
	}
	mrs := append([]fabric.MR(nil), old...)
	mr := mrs[b.idx]
	mrs[b.idx] = nil
	res.mrs.Store(&mrs)
	mr.Close()
}

// post sends request pm on this path if it is connected
// (rtrs_clt_write_req / rtrs_clt_read_req), held in pl if not nil.
func (p *CltPath) post(pm *Permit, pl *Plug) error {
	p.submitMu.RLock()
	defer p.submitMu.RUnlock()
	if p.State() != PathConnected {
		return errPathDown
	}
	res := p.res
	r := &pm.req
	hdrLen := RDMAWriteSize
	if r.dir == Read {
		hdrLen = RDMAReadSize
		if r.n > 0 {
			hdrLen += SGDescSize
		}
	}
	if r.usrLen+hdrLen > res.maxHdrSize || hdrLen+r.n+r.usrLen > res.chunkSize {
		return ErrMsgSize
	}
	mrs := *res.mrs.Load()
	hdrMR := mrs[0]
	var dataMR fabric.MR
	if r.n > 0 {
		if r.buf.idx >= len(mrs) || mrs[r.buf.idx] == nil {
			return errors.New("rtrs: buffer not registered")
		}
		dataMR = mrs[r.buf.idx]
	}
	con := res.conns[0]
	if pm.conType == IOCon && len(res.conns) > 1 {
		con = res.conns[1+int(pm.id)%(len(res.conns)-1)]
	}
	rb := &res.rbufs[pm.id]
	pr := &res.reqs[pm.id]
	wr := &pr.wr
	*wr = fabric.SendWR{ID: wrIO | uint64(pm.id), Op: fabric.OpWriteImm, RKey: rb.rkey.Load()}
	if r.dir == Write {
		(&RDMAWrite{UsrLen: uint16(r.usrLen)}).Encode(pm.hdr[r.usrLen:])
		hdr := fabric.SGE{Buf: pm.hdr[:r.usrLen+RDMAWriteSize], LKey: hdrMR.LKey()}
		if r.n > 0 {
			wr.SG[0] = fabric.SGE{Buf: r.buf.b[r.off : r.off+r.n], LKey: dataMR.LKey()}
			wr.SG[1] = hdr
			wr.NumSGE = 2
		} else {
			wr.SG[0], wr.NumSGE = hdr, 1
		}
		wr.RemoteAddr = rb.addr
	} else {
		msg := RDMARead{UsrLen: uint16(r.usrLen)}
		if r.n > 0 {
			msg.SGCnt = 1
			msg.Desc = SGDesc{Addr: dataMR.Addr() + uint64(r.off), Key: dataMR.RKey(), Len: uint32(r.n)}
		}
		msg.Encode(pm.hdr[r.usrLen:])
		wr.SG[0] = fabric.SGE{Buf: pm.hdr[:r.usrLen+msg.Size()], LKey: hdrMR.LKey()}
		wr.NumSGE = 1
		// The message goes after the room for the data, so the server
		// finds it where a write's would be.
		wr.RemoteAddr = rb.addr + uint64(r.n)
	}
	wr.Imm = ToImm(ImmIOReq, pm.memOff+uint32(r.n+r.usrLen))
	wr.Signaled = con.wrCnt.Add(1)%res.sigIntv == 0
	if pl != nil {
		pl.hold(con.qp, wr)
	}
	pr.inUse.Store(true)
	p.stats.update(r.dir, r.usrLen+r.n)
	if err := con.qp.PostSend(wr); err != nil {
		if !pr.inUse.CompareAndSwap(true, false) {
			// The connection failed after taking the request and its
			// completion (or the failover of it) already ran.
			return nil
		}
		p.stats.inflight.Add(-1)
		p.postRL.Log(p.lg().WithError(err), log.WarnLevel, "posting a request failed")
		return err
	}
	return nil
}

// processIORsp completes the request msgID (process_io_rsp) in burst b
// (nil: none).
func (res *pathRes) processIORsp(msgID uint32, errno syscall.Errno, b *Burst) error {
	if int(msgID) >= res.queueDepth {
		return fmt.Errorf("response for msg_id %d >= queue depth %d: %w", msgID, res.queueDepth, syscall.EPROTO)
	}
	p := res.path
	if !res.reqs[msgID].inUse.CompareAndSwap(true, false) {
		p.rl.Log(p.lg().WithField("msg_id", msgID), log.WarnLevel, "response for a request not in flight: ignored")
		return nil
	}
	p.stats.inflight.Add(-1)
	pm := &p.sess.permits[msgID]
	p.stats.observeLatency(pm.req.dir, time.Since(pm.req.start))
	var err error
	if errno != 0 {
		err = errno
	}
	if bc, ok := pm.req.conf.(BurstConfirmer); ok {
		bc.ConfirmBurst(err, b)
	} else {
		pm.req.conf.Confirm(err)
	}
	return nil
}

// sendHB posts a HB_MSG on the service connection.
func (p *CltPath) sendHB() error {
	res := p.curRes()
	if res == nil || len(res.conns) == 0 {
		return errPathDown
	}
	return res.conns[0].postHB(ImmHBMsg)
}

func (p *CltPath) lg() *log.Entry { return p.logp.Load() }
