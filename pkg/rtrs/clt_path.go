package rtrs

import (
	"context"
	crand "crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// A client path's state and its goroutine: the transitions, the commands
// (connect, reconnect, disconnect, remove) the goroutine serializes, and
// error recovery handing a failed path to it. How the path reconnects is
// in clt_reconnect.go, how it connects in clt_info.go, how it is torn
// down in clt_teardown.go.

// CltPath is one src@dst path of a client session (struct rtrs_clt_path):
// a service connection (cid 0) and ConnsPerPath IO connections. Its
// lifecycle (connect, error recovery, reconnect, close) runs in one
// goroutine; IO is posted by the callers' goroutines. It is safe for
// concurrent use.
type CltPath struct {
	sess  *CltSession
	uuid  [16]byte
	stats *CltPathStats
	hb    heartbeat
	logp  atomic.Pointer[log.Entry]
	rl    log.Limiter
	// postRL: posts fail together when a connection dies: one line a
	// path every 10 s, the next saying how many it left out.
	postRL log.Limiter

	state atomic.Int32 // CltPathState; written under mu
	// mu guards the state changes and the fields below.
	mu sync.Mutex
	// +checklocks:mu
	addr PathAddr
	// +checklocks:mu
	hcaName string
	// +checklocks:mu
	hcaPort int
	// +checklocks:mu
	reconnectAttempts int
	// +checklocks:mu
	nextAttempt time.Time // when the scheduled reconnect attempt comes; zero: none
	// +checklocks:mu
	downSince time.Time // when the path went down (ctrl_loss_tmo); zero while up
	// +checklocks:mu
	forNewClt bool
	// +checklocks:mu
	established bool
	// +checklocks:mu
	reconCnt uint16
	// +checklocks:mu
	stateCh chan struct{} // closed and replaced on every state change

	// submitMu fences IO against recovery: posters hold it shared while
	// they check the state and post; recovery takes it exclusively once
	// after leaving CONNECTED, so every post that saw CONNECTED is done
	// (the kernel's synchronize_rcu).
	submitMu sync.RWMutex
	// +checklocks:submitMu
	res *pathRes // the current connection attempt's resources

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
	p.reconCnt = uint16(rc[0]) | uint16(rc[1])<<8 // +checklocksignore: p is not shared yet
	p.state.Store(int32(CltPathConnecting))
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
func (p *CltPath) State() CltPathState { return CltPathState(p.state.Load()) }

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
func (p *CltPath) Stats() *CltPathStats { return p.stats }

// CurLatency is the last heartbeat round trip (cur_latency).
func (p *CltPath) CurLatency() time.Duration { return p.hb.latency() }

// changeStateLocked applies the kernel's transition table; every state
// change goes through here.
// +checklocks:p.mu
func (p *CltPath) changeStateLocked(to CltPathState) bool {
	from := CltPathState(p.state.Load())
	if !pathTransitionAllowed(from, to) {
		return false
	}
	p.state.Store(int32(to))
	close(p.stateCh)
	p.stateCh = make(chan struct{})
	return true
}

func (p *CltPath) changeStateFromTo(from, to CltPathState) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if CltPathState(p.state.Load()) != from {
		return false
	}
	return p.changeStateLocked(to)
}

func (p *CltPath) changeStateGetOld(to CltPathState) (bool, CltPathState) {
	p.mu.Lock()
	defer p.mu.Unlock()
	old := CltPathState(p.state.Load())
	return p.changeStateLocked(to), old
}

// errorRecovery is called on a connection error or a heartbeat timeout
// (rtrs_rdma_error_recovery): a connected path goes RECONNECTING and its
// goroutine recovers; a path being established goes CONNECTING_ERR.
func (p *CltPath) errorRecovery(res *pathRes) {
	if res != nil && p.curRes() != res {
		return // a stale attempt's connection
	}
	if p.changeStateFromTo(CltPathConnected, CltPathReconnecting) {
		select {
		case p.recoverCh <- struct{}{}:
		default:
		}
		return
	}
	if p.changeStateFromTo(CltPathConnecting, CltPathConnectingErr) && res != nil {
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
			if p.State() != CltPathReconnecting {
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
				if p.changeStateFromTo(CltPathConnectingErr, CltPathReconnecting) {
					p.wentDown()
					schedule()
				}
				c.reply <- nil
			case cmdReconnect:
				stopTimer()
				err := p.reconnectCmd(c.ctx)
				if p.State() == CltPathReconnecting {
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
					if ok, old := p.changeStateGetOld(CltPathDead); ok || old == CltPathDead {
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

// sendHB posts a HB_MSG on the service connection.
func (p *CltPath) sendHB() error {
	res := p.curRes()
	if res == nil || len(res.conns) == 0 {
		return errPathDown
	}
	return res.conns[0].postHB(ImmHBMsg)
}

func (p *CltPath) lg() *log.Entry { return p.logp.Load() }
