package rtrs

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/log"
	"github.com/rnbd/rnbd/internal/tagpool"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Errors of the client side. Errors from the server arrive as syscall.Errno.
var (
	// ErrClosed is returned after CltSession.Close.
	ErrClosed = errors.New("rtrs: session closed")
	// ErrNoPath fails a request when no path is connected. It matches
	// ECONNABORTED, the kernel's error in that case.
	ErrNoPath = fmt.Errorf("rtrs: no connected path: %w", syscall.ECONNABORTED)
	// ErrMsgSize is returned for a request that does not fit the
	// server's chunk or header limits.
	ErrMsgSize = fmt.Errorf("rtrs: request too large: %w", syscall.EMSGSIZE)
	// ErrQueueDepthChanged is the reason a reconnect is refused when the
	// server's queue depth changed; the path then waits for a manual
	// reconnect, as the kernel does.
	ErrQueueDepthChanged = fmt.Errorf("rtrs: server queue depth changed: %w", syscall.ECONNRESET)

	errPathDown = errors.New("rtrs: path not connected")
	// errInfoUnanswered: the path's connections went down while it
	// waited for INFO_RSP. INFO_REQ has no error answer: a server that
	// refuses the session's name closes the path.
	errInfoUnanswered = fmt.Errorf("rtrs: the path went down before the server answered its INFO_REQ "+
		"(a server closes it so when it refuses a session name in use, or bound to another client's identity; its log says why): %w", syscall.ECONNRESET)
)

// ClientLinkEvent is what a session tells its user about its paths as a
// whole (enum rtrs_clt_link_ev).
type ClientLinkEvent int

const (
	// LinkReconnected: a path came up after all were down.
	LinkReconnected ClientLinkEvent = iota
	// LinkDisconnected: the last connected path went down.
	LinkDisconnected
)

func (e ClientLinkEvent) String() string {
	if e == LinkReconnected {
		return "RECONNECTED"
	}
	return "DISCONNECTED"
}

// ConType selects the connection of a permit: IO connections, or the
// service connection (cid 0) for admin messages.
type ConType uint8

const (
	IOCon ConType = iota
	AdminCon
)

// ClientConfig configures a client session. Start from DefaultClientConfig:
// zero values are taken literally.
type ClientConfig struct {
	// SessName names the session on the server: 1..254 bytes, no '/'
	// or '.'.
	SessName string
	// Paths are connected, in order, by Open.
	Paths []PathAddr
	// Fabric carries the connections.
	Fabric fabric.Fabric
	// ConnsPerPath is the number of IO connections of each path; each
	// path also has a service connection. Default: the number of CPUs.
	ConnsPerPath int
	// MPPolicy picks the path of each IO. Default: min-inflight.
	MPPolicy MPPolicy
	// MaxReconnectAttempts bounds automatic reconnects of a path: -1
	// retries forever (default), 0 never reconnects automatically.
	MaxReconnectAttempts int
	// CtrlLossTmo is NVMe-oF's ctrl_loss_tmo: a path that has been down
	// this long stops reconnecting, whatever attempts are left. 0 (the
	// zero value) or negative: no bound.
	CtrlLossTmo time.Duration
	// ReconnectDelay is the wait before the first reconnect attempt; it
	// doubles after each failed attempt up to ReconnectMaxDelay, and a
	// random ReconnectJitter is added to spread clients out.
	ReconnectDelay    time.Duration
	ReconnectMaxDelay time.Duration
	ReconnectJitter   time.Duration
	// HBInterval and HBMissedMax drive the heartbeat (5 s, 5).
	HBInterval  time.Duration
	HBMissedMax int
	// ConnectTimeout bounds establishing one path (30 s).
	ConnectTimeout time.Duration
	// UUID is the session's paths UUID; zero picks a random one. A
	// client that restarts passes its predecessor's: the server then takes
	// its paths for the same session's (their UUIDs derive from it and
	// the path's addresses), replaces any the predecessor left behind, and
	// the session name is not "taken" by what the dead client left there.
	UUID [16]byte
	// OpenAnyPath makes Open succeed once one path is connected; the
	// others keep trying in the background, as after a failure. Open
	// otherwise needs every path, as the kernel's rtrs_clt_open does.
	OpenAnyPath bool
	// LinkEvent, if set, is told when the last path goes down and when a
	// path comes back. Calls are serialized; it must not call back into
	// the session's path controls.
	LinkEvent func(ClientLinkEvent)
	// Log receives the session's messages.
	Log *log.Entry
}

// DefaultClientConfig returns the defaults: the kernel's where it has
// them.
func DefaultClientConfig() ClientConfig {
	return ClientConfig{
		ConnsPerPath:         runtime.NumCPU(),
		MPPolicy:             MPMinInflight,
		MaxReconnectAttempts: -1,
		ReconnectDelay:       time.Second,
		ReconnectMaxDelay:    30 * time.Second,
		ReconnectJitter:      time.Second,
		HBInterval:           DefaultHBInterval,
		HBMissedMax:          DefaultHBMissedMax,
		ConnectTimeout:       DefaultConnectTimeout,
	}
}

func (c *ClientConfig) validate() error {
	if err := ValidSessName(c.SessName); err != nil {
		return err
	}
	if len(c.Paths) == 0 || len(c.Paths) > MaxPathsNum {
		return fmt.Errorf("rtrs: a session needs 1..%d paths, got %d", MaxPathsNum, len(c.Paths))
	}
	if c.Fabric == nil {
		return errors.New("rtrs: no fabric")
	}
	if c.ConnsPerPath < 1 || c.ConnsPerPath >= MaxConnsPerPath {
		return fmt.Errorf("rtrs: %d IO connections per path, want 1..%d", c.ConnsPerPath, MaxConnsPerPath-1)
	}
	if _, err := ParseMPPolicy(fmt.Sprint(int32(c.MPPolicy))); err != nil {
		return err
	}
	if c.MaxReconnectAttempts < -1 {
		return fmt.Errorf("rtrs: max_reconnect_attempts %d, want -1 or more", c.MaxReconnectAttempts)
	}
	if c.HBInterval <= 0 || c.HBMissedMax < 0 {
		return errors.New("rtrs: heartbeat interval must be positive and missed count not negative")
	}
	if c.ReconnectDelay < 0 || c.ReconnectJitter < 0 || c.ConnectTimeout <= 0 {
		return errors.New("rtrs: negative delay or timeout")
	}
	if c.ReconnectMaxDelay < c.ReconnectDelay {
		c.ReconnectMaxDelay = c.ReconnectDelay
	}
	if c.Log == nil {
		c.Log = log.L
	}
	return nil
}

// Confirmer receives the result of a request: nil, a syscall.Errno the
// server answered, or an error of this package. It is called exactly once,
// from a fabric goroutine, and must not block.
type Confirmer interface {
	Confirm(err error)
}

// BurstConfirmer is a Confirmer that is also told the burst its
// completion belongs to: what the outcome leaves to do (a reply to send)
// it may defer to the burst's end. b is nil outside a burst.
type BurstConfirmer interface {
	Confirmer
	ConfirmBurst(err error, b *Burst)
}

// Burst is the run of completions a connection delivers from what it read
// at once (fabric/tcp). What they defer is flushed once at its end, before
// the connection waits for more: e.g. the replies of many requests go out
// in one write. It is used only by the connection's completion goroutine.
type Burst struct {
	deferred []interface{ Flush() }
}

// Defer has f flushed at the end of the burst, once however often it is
// deferred.
func (b *Burst) Defer(f interface{ Flush() }) {
	for _, d := range b.deferred {
		if d == f {
			return
		}
	}
	b.deferred = append(b.deferred, f)
}

// end flushes what was deferred.
func (b *Burst) end() {
	for i, f := range b.deferred {
		f.Flush()
		b.deferred[i] = nil
	}
	b.deferred = b.deferred[:0]
}

// CltSession is a client session: a name, a paths UUID, and the paths to one
// server. It is safe for concurrent use.
type CltSession struct {
	cfg  ClientConfig
	name string
	uuid [16]byte
	log  *log.Entry

	policy               atomic.Int32
	rrCursor             atomic.Uint32
	maxReconnectAttempts atomic.Int32
	ctrlLossTmo          atomic.Int64 // time.Duration; -1: no bound
	reconnectDelay       atomic.Int64 // time.Duration: the first reconnect's wait

	// mu guards the path list and the link-event bookkeeping.
	mu        sync.Mutex
	paths     []*CltPath
	pathsSnap atomic.Pointer[[]*CltPath] // lock-free copy for the IO path
	pathsUp   int
	opened    bool

	// evMu serializes link events to the user.
	evMu sync.Mutex

	// Set once by the first connection of the first path, then fixed.
	// initMu serializes initResources; a failed one (a path's server
	// with bad limits, memory short) leaves it to the next path.
	initMu     sync.Mutex
	queueDepth atomic.Int32 // set once, by initResources
	hdrSlot    int          // bytes of header memory per permit
	maxIOSize  atomic.Uint32
	permits    []Permit
	// permitTags hands out permits lowest id first (tagpool).
	permitTags tagpool.Pool
	hdrMem     fabric.Memory
	hdrFreed   atomic.Bool  // freeHdrMem ran
	permitsOut atomic.Int64 // permits taken and not put back

	// regMu guards regions and every path's registrations of them.
	regMu   sync.Mutex
	regions []*Buffer // index = region id; 0 is the header memory

	closed    atomic.Bool
	closedCh  chan struct{} // closed by Close: wakes GetPermit
	closeOnce sync.Once
	wg        sync.WaitGroup
}

// Open establishes a session with every path of cfg, one after another,
// and returns when all are connected (rtrs_clt_open). If any path fails,
// the session is closed and the error returned.
func Open(ctx context.Context, cfg ClientConfig) (*CltSession, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &CltSession{cfg: cfg, name: cfg.SessName, uuid: cfg.UUID, closedCh: make(chan struct{})}
	if s.uuid == [16]byte{} {
		if _, err := rand.Read(s.uuid[:]); err != nil {
			return nil, err
		}
	}
	s.log = cfg.Log.WithField("session", s.name)
	s.policy.Store(int32(cfg.MPPolicy))
	s.maxReconnectAttempts.Store(int32(cfg.MaxReconnectAttempts))
	s.SetCtrlLossTmo(cfg.CtrlLossTmo)
	s.reconnectDelay.Store(int64(cfg.ReconnectDelay))
	s.pathsSnap.Store(&[]*CltPath{})
	var firstErr error
	up := 0
	for _, pa := range cfg.Paths {
		p, err := s.addPath(pa, cfg.OpenAnyPath)
		if err != nil {
			s.Close()
			return nil, err
		}
		if err := p.connectRetryBusy(ctx); err != nil {
			err = fmt.Errorf("rtrs: open session %s: path %s: %w", s.name, pa, err)
			if !cfg.OpenAnyPath || ctx.Err() != nil {
				s.Close()
				return nil, err
			}
			s.log.WithError(err).Warn("path did not connect; it keeps trying")
			p.keepTrying()
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		up++
	}
	if up == 0 {
		s.Close()
		return nil, firstErr
	}
	s.mu.Lock()
	s.opened = true
	s.mu.Unlock()
	return s, nil
}

// initResources sizes the session from the first connection response:
// permits (one per server chunk) and header memory. Once it succeeded it
// does nothing more; until then each path's response may try.
func (s *CltSession) initResources(qd int, maxHdr, maxIO uint32) error {
	s.initMu.Lock()
	defer s.initMu.Unlock()
	if s.queueDepth.Load() != 0 {
		return nil
	}
	if qd < 1 || qd > MaxSessQueueDepth {
		return fmt.Errorf("rtrs: server queue depth %d: %w", qd, syscall.ECONNRESET)
	}
	if maxHdr < RDMAReadSize+SGDescSize || maxHdr > 1<<20 {
		return fmt.Errorf("rtrs: server max_hdr_size %d: %w", maxHdr, syscall.ECONNRESET)
	}
	// The header room per permit is what the server allows, capped at a
	// page as the kernel's server announces: that is plenty for any user
	// message and keeps qd × slot small whatever it says.
	slot := int(min(maxHdr, MaxHdrSize))
	mem, err := s.cfg.Fabric.AllocMemory(qd * slot)
	if err != nil {
		return err
	}
	s.hdrSlot = slot
	s.maxIOSize.Store(maxIO)
	s.hdrMem = mem
	s.regMu.Lock()
	// The server never writes into the header memory: it is registered
	// for local access only.
	s.regions = append(s.regions, &Buffer{sess: s, idx: 0, mem: mem, b: mem.Bytes(), local: true})
	s.regMu.Unlock()
	memBits := MemBits(uint32(qd))
	s.permits = make([]Permit, qd)
	for i := range s.permits {
		p := &s.permits[i]
		p.sess = s
		p.id = uint16(i)
		p.memOff = uint32(i) << memBits
		p.hdr = s.hdrMem.Bytes()[i*s.hdrSlot : (i+1)*s.hdrSlot]
	}
	s.permitTags.Init(qd)
	s.queueDepth.Store(int32(qd))
	return nil
}

// Name returns the session name.
func (s *CltSession) Name() string { return s.name }

// UUID returns the paths UUID shared by all paths of the session.
func (s *CltSession) UUID() [16]byte { return s.uuid }

// QueueDepth is the number of permits (server chunks).
func (s *CltSession) QueueDepth() int { return int(s.queueDepth.Load()) }

// MaxIOSize is the largest data length of one request: the smallest
// max_io_size any path's server announced.
func (s *CltSession) MaxIOSize() int { return int(s.maxIOSize.Load()) }

// MaxUsrLen is the largest user header a request of either direction
// can carry.
func (s *CltSession) MaxUsrLen() int { return s.hdrSlot - RDMAReadSize - SGDescSize }

// MPPolicy returns the multipath policy.
func (s *CltSession) MPPolicy() MPPolicy { return MPPolicy(s.policy.Load()) }

// SetMPPolicy switches the multipath policy; requests already on a path
// stay there.
func (s *CltSession) SetMPPolicy(p MPPolicy) error {
	if _, err := ParseMPPolicy(fmt.Sprint(int32(p))); err != nil {
		return err
	}
	s.policy.Store(int32(p))
	return nil
}

// CtrlLossTmo is how long a path may be down before it stops
// reconnecting; negative: no bound.
func (s *CltSession) CtrlLossTmo() time.Duration { return time.Duration(s.ctrlLossTmo.Load()) }

// SetCtrlLossTmo sets ctrl_loss_tmo (0 or negative: no bound). It applies
// to the next reconnect a path schedules, counted from when it went down.
func (s *CltSession) SetCtrlLossTmo(d time.Duration) {
	if d <= 0 {
		d = -1
	}
	s.ctrlLossTmo.Store(int64(d))
}

// ReconnectDelay is the wait before a path's first reconnect attempt;
// it doubles after each failed one, up to ReconnectMaxDelay or itself,
// whichever is longer.
func (s *CltSession) ReconnectDelay() time.Duration { return time.Duration(s.reconnectDelay.Load()) }

// The range of SetReconnectDelay: a path that cannot connect must not
// retry in a tight loop.
const (
	MinReconnectDelayLimit = 100 * time.Millisecond
	MaxReconnectDelayLimit = time.Hour
)

// SetReconnectDelay sets reconnect_delay, 100 ms to an hour. It applies
// to the next reconnect a path schedules.
func (s *CltSession) SetReconnectDelay(d time.Duration) error {
	if d < MinReconnectDelayLimit || d > MaxReconnectDelayLimit {
		return fmt.Errorf("rtrs: reconnect_delay %v out of range %v..%v: %w", d, MinReconnectDelayLimit, MaxReconnectDelayLimit, syscall.EINVAL)
	}
	s.reconnectDelay.Store(int64(d))
	return nil
}

// MaxReconnectAttempts returns the reconnect bound (-1: forever).
func (s *CltSession) MaxReconnectAttempts() int { return int(s.maxReconnectAttempts.Load()) }

// SetMaxReconnectAttempts sets the bound, -1..9999 as the kernel's sysfs.
func (s *CltSession) SetMaxReconnectAttempts(n int) error {
	if n < -1 || n > 9999 {
		return fmt.Errorf("rtrs: max_reconnect_attempts %d out of range -1..9999: %w", n, syscall.EINVAL)
	}
	s.maxReconnectAttempts.Store(int32(n))
	return nil
}

// Paths returns the session's paths.
func (s *CltSession) Paths() []*CltPath {
	return append([]*CltPath(nil), *s.pathsSnap.Load()...)
}

// Connected reports whether at least one path is connected.
func (s *CltSession) Connected() bool {
	for _, p := range *s.pathsSnap.Load() {
		if p.State() == PathConnected {
			return true
		}
	}
	return false
}

// addPath creates a path, lists it and starts its goroutine, unless the
// session is closed or full. The path may create the session on the
// server (first_conn) if it is the session's first, or if firstConn: a
// path added to a session with no path left may then create it again (the
// server may have dropped it).
func (s *CltSession) addPath(pa PathAddr, firstConn bool) (*CltPath, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed.Load() {
		return nil, ErrClosed
	}
	if len(s.paths) >= MaxPathsNum {
		return nil, fmt.Errorf("rtrs: session %s has %d paths already: %w", s.name, len(s.paths), syscall.EINVAL)
	}
	p := s.newPath(pa, firstConn || len(s.paths) == 0)
	s.paths = append(s.paths, p)
	snap := append([]*CltPath(nil), s.paths...)
	s.pathsSnap.Store(&snap)
	s.wg.Add(1)
	go p.run()
	return p, nil
}

func (s *CltSession) removePath(p *CltPath) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, q := range s.paths {
		if q == p {
			s.paths = append(s.paths[:i:i], s.paths[i+1:]...)
			break
		}
	}
	snap := append([]*CltPath(nil), s.paths...)
	s.pathsSnap.Store(&snap)
}

// AddPath adds a path to the session and connects it (add_path). It
// blocks until the path is connected or has failed; a failed path is
// removed again.
func (s *CltSession) AddPath(ctx context.Context, pa PathAddr) (*CltPath, error) {
	p, err := s.addPath(pa, false)
	if err != nil {
		return nil, err
	}
	if err := p.connect(ctx); err != nil {
		p.Remove()
		return nil, fmt.Errorf("rtrs: add path %s: %w", pa, err)
	}
	return p, nil
}

// pathUp counts a path that became connected and reports RECONNECTED when
// it is the first after all were down (rtrs_clt_path_up).
func (s *CltSession) pathUp() {
	s.pathEvent(+1, 1, LinkReconnected)
}

// pathDown reports DISCONNECTED when the last connected path went down.
func (s *CltSession) pathDown() { s.pathEvent(-1, 0, LinkDisconnected) }

// pathEvent counts a path going up or down and reports ev when the count
// reaches at. evMu is held across the count and the report, so the user
// sees DISCONNECTED and RECONNECTED in the order the paths changed.
func (s *CltSession) pathEvent(delta, at int, ev ClientLinkEvent) {
	s.evMu.Lock()
	defer s.evMu.Unlock()
	s.mu.Lock()
	s.pathsUp += delta
	fire := s.opened && s.pathsUp == at
	s.mu.Unlock()
	if !fire {
		return
	}
	s.log.WithField("event", ev).Info("link event")
	if s.cfg.LinkEvent != nil && !s.closed.Load() {
		s.cfg.LinkEvent(ev)
	}
}

// Close disconnects every path; the requests they carried fail.
func (s *CltSession) Close() error {
	s.closeOnce.Do(func() {
		// Under mu, so no path is added after the snapshot below.
		s.mu.Lock()
		s.closed.Store(true)
		s.mu.Unlock()
		close(s.closedCh)
		for _, p := range s.Paths() {
			p.Remove()
		}
		s.wg.Wait()
		if s.permitsOut.Load() == 0 {
			s.freeHdrMem()
		}
	})
	return nil
}

// Permit is one server chunk, held by one request at a time, and the
// header memory that goes with it (struct rtrs_permit).
type Permit struct {
	sess    *CltSession
	id      uint16
	memOff  uint32
	conType ConType
	held    atomic.Bool
	hdr     []byte // registered header memory: usr message, then RTRS message
	req     request
}

// ID is the permit's chunk number (buf_id, msg_id on the wire).
func (p *Permit) ID() int { return int(p.id) }

// request is the state of the one request a permit carries.
type request struct {
	dir    Dir
	conf   Confirmer
	usrLen int
	buf    *Buffer
	off, n int
	start  time.Time
}

// GetPermit takes a permit, waiting for one if all are in use.
func (s *CltSession) GetPermit(ctx context.Context, t ConType) (*Permit, error) {
	if s.closed.Load() {
		return nil, ErrClosed
	}
	id, err := s.permitTags.Get(ctx, s.closedCh)
	if errors.Is(err, tagpool.ErrStopped) {
		return nil, ErrClosed
	}
	if err != nil {
		return nil, err
	}
	if !s.permitTaken() {
		s.permitTags.Put(id)
		s.permitPut()
		return nil, ErrClosed
	}
	p := &s.permits[id]
	p.held.Store(true)
	p.conType = t
	return p, nil
}

// permitTaken counts a permit out; false if the session is closed, when
// the permit must go back (permitPut) unused: the header memory it names
// may be freed.
func (s *CltSession) permitTaken() bool {
	s.permitsOut.Add(1)
	return !s.closed.Load()
}

// permitPut counts a permit back in; the last one back after Close frees
// the header memory.
func (s *CltSession) permitPut() {
	if s.permitsOut.Add(-1) == 0 && s.closed.Load() {
		s.freeHdrMem()
	}
}

// freeHdrMem frees the permits' header memory once the session is closed
// and no permit is out (the memory is mmapped on RDMA: the garbage
// collector never takes it).
func (s *CltSession) freeHdrMem() {
	if s.hdrMem == nil || !s.hdrFreed.CompareAndSwap(false, true) {
		return
	}
	s.regMu.Lock()
	if len(s.regions) > 0 && s.regions[0] != nil {
		s.regions[0] = nil
	}
	s.regMu.Unlock()
	s.hdrMem.Free()
}

// TryGetPermit takes a permit if one is free.
func (s *CltSession) TryGetPermit(t ConType) *Permit {
	id := s.permitTags.TryGet()
	if id < 0 {
		return nil
	}
	if !s.permitTaken() {
		s.permitTags.Put(id)
		s.permitPut()
		return nil
	}
	p := &s.permits[id]
	p.held.Store(true)
	p.conType = t
	return p
}

// PutPermit returns a permit. Its request, if any, must have completed.
func (s *CltSession) PutPermit(p *Permit) {
	if p.sess != s || !p.held.Swap(false) {
		panic("rtrs: PutPermit of a permit not held")
	}
	p.req.conf, p.req.buf = nil, nil
	s.permitTags.Put(int(p.id))
	s.permitPut()
}

// Buffer is registered memory a request's data must live in: reads land
// in it, writes are sent from it. Bytes stays valid until Free.
type Buffer struct {
	sess  *CltSession
	idx   int
	mem   fabric.Memory
	b     []byte
	local bool // no remote access: request headers
}

// Bytes returns the buffer's memory.
func (b *Buffer) Bytes() []byte { return b.b }

// AllocBuffer allocates n bytes of memory registered with every path.
func (s *CltSession) AllocBuffer(n int) (*Buffer, error) {
	if s.closed.Load() {
		return nil, ErrClosed
	}
	mem, err := s.cfg.Fabric.AllocMemory(n)
	if err != nil {
		return nil, err
	}
	s.regMu.Lock()
	defer s.regMu.Unlock()
	// The lowest id a freed buffer left, else a new one: the tables of
	// every path are as long as the most buffers alive at once, not as
	// the buffers ever allocated.
	idx := len(s.regions)
	for i := 1; i < len(s.regions); i++ {
		if s.regions[i] == nil {
			idx = i
			break
		}
	}
	b := &Buffer{sess: s, idx: idx, mem: mem, b: mem.Bytes()}
	for _, p := range s.Paths() {
		if err := p.registerLocked(b); err != nil {
			for _, q := range s.Paths() {
				q.deregisterLocked(b)
			}
			mem.Free()
			return nil, err
		}
	}
	if idx == len(s.regions) {
		s.regions = append(s.regions, b)
	} else {
		s.regions[idx] = b
	}
	return b, nil
}

// Free deregisters the buffer and releases its memory. No request may be
// using it.
func (b *Buffer) Free() error {
	s := b.sess
	s.regMu.Lock()
	defer s.regMu.Unlock()
	if b.idx == 0 || b.idx >= len(s.regions) || s.regions[b.idx] != b {
		return errors.New("rtrs: buffer already freed")
	}
	for _, p := range s.Paths() {
		p.deregisterLocked(b)
	}
	s.regions[b.idx] = nil
	for len(s.regions) > 1 && s.regions[len(s.regions)-1] == nil {
		s.regions = s.regions[:len(s.regions)-1]
	}
	return b.mem.Free()
}

// Request sends one request on permit p (rtrs_clt_request). For Write, the
// n bytes at buf[off:] and the user header usr are written into the
// permit's chunk on the server; for Read, the server writes n bytes of
// answer into buf[off:]. conf is told the outcome. A request that finds no
// connected path fails at once with ErrNoPath, as in the kernel: waiting
// for a path is the user's (pkg/rnbd holds block requests until their
// device is open again). The error returned here means conf is not told.
func (s *CltSession) Request(dir Dir, p *Permit, conf Confirmer, usr []byte, buf *Buffer, off, n int) error {
	return s.RequestPlugged(nil, dir, p, conf, usr, buf, off, n)
}

// Plug holds the requests one goroutine sends in a burst until it calls
// Unplug, so that the burst goes out in as few system calls as the
// fabric allows (blk_start_plug / blk_finish_plug). Its owner must Unplug
// before it waits for anything, the completion of its own requests
// included (a permit, request memory, more requests to read). A Plug is
// not safe for concurrent use; the zero value is ready.
type Plug struct {
	held []fabric.Flusher // connections holding this plug's requests
}

// Unplug sends the requests held.
func (pl *Plug) Unplug() {
	for i, f := range pl.held {
		f.Flush()
		pl.held[i] = nil
	}
	pl.held = pl.held[:0]
}

// hold marks wr as held in pl if con can hold it.
func (pl *Plug) hold(con fabric.Conn, wr *fabric.SendWR) {
	f, ok := con.(fabric.Flusher)
	if !ok {
		return
	}
	wr.More = true
	for _, h := range pl.held {
		if h == f {
			return
		}
	}
	pl.held = append(pl.held, f)
}

// RequestPlugged is Request, the request held in pl (if not nil) until
// pl.Unplug.
func (s *CltSession) RequestPlugged(pl *Plug, dir Dir, p *Permit, conf Confirmer, usr []byte, buf *Buffer, off, n int) error {
	if s.closed.Load() {
		return ErrClosed
	}
	if p == nil || p.sess != s || !p.held.Load() {
		return errors.New("rtrs: request on a permit not held")
	}
	if conf == nil {
		return errors.New("rtrs: request without a confirmer")
	}
	hdrLen := RDMAWriteSize
	if dir == Read {
		hdrLen = RDMAReadSize + SGDescSize
	}
	if len(usr)+hdrLen > s.hdrSlot || len(usr) > 0xffff {
		return ErrMsgSize
	}
	if n < 0 || n > s.MaxIOSize() {
		return ErrMsgSize
	}
	if n > 0 {
		if buf == nil || buf.sess != s || off < 0 || off > len(buf.b) || n > len(buf.b)-off {
			return errors.New("rtrs: data outside the registered buffer")
		}
	}
	r := &p.req
	r.dir, r.conf, r.buf, r.off, r.n = dir, conf, buf, off, n
	r.usrLen = copy(p.hdr, usr)
	r.start = time.Now()
	_, err := s.submit(p, pl)
	return err
}

// submit tries the paths in the policy's order and posts p on the first
// connected one that takes it, held in pl if not nil.
func (s *CltSession) submit(p *Permit, pl *Plug) (*CltPath, error) {
	var it pathIter
	it.init(s, *s.pathsSnap.Load())
	tooBig := false
	for path := it.next(); path != nil; path = it.next() {
		err := path.post(p, pl)
		if err == nil {
			return path, nil
		}
		// Paths may run to servers of different limits: one too
		// small is no reason not to try the next.
		tooBig = tooBig || errors.Is(err, ErrMsgSize)
	}
	if tooBig {
		return nil, ErrMsgSize
	}
	return nil, ErrNoPath
}

// failover re-issues a request whose path, from, failed on another
// connected path (rtrs_clt_failover_req); without one it fails with
// ErrNoPath. It is counted on both: the path that took it (failover_cnt,
// as the kernel counts) and the one it left (FailedOverCount).
func (s *CltSession) failover(from *CltPath, p *Permit) {
	if s.closed.Load() {
		p.req.conf.Confirm(ErrClosed)
		return
	}
	path, err := s.submit(p, nil)
	if err == nil {
		path.stats.failoverCnt.Add(1)
		from.stats.failedOver.Add(1)
		return
	}
	p.req.conf.Confirm(err)
}

// chanConfirmer delivers a result on a channel.
type chanConfirmer chan error

func (c chanConfirmer) Confirm(err error) { c <- err }

// ErrAbandoned is returned by Do when its context ended before the
// answer came: the request is still in flight.
var ErrAbandoned = errors.New("rtrs: request abandoned before its answer")

// Do runs one request synchronously: it takes a permit, sends, waits and
// returns the permit. It is for admin messages and tools; the IO path
// should use Request with its own Confirmer. If ctx ends first, Do
// returns ErrAbandoned with ctx's error at once; the request stays in
// flight, its permit is returned when it completes or fails (a path
// failure, the session's close), and until then the server may still
// write into buf: the caller must not reuse buf's range.
func (s *CltSession) Do(ctx context.Context, t ConType, dir Dir, usr []byte, buf *Buffer, off, n int) error {
	p, err := s.GetPermit(ctx, t)
	if err != nil {
		return err
	}
	done := make(chanConfirmer, 1)
	if err := s.Request(dir, p, done, usr, buf, off, n); err != nil {
		s.PutPermit(p)
		return err
	}
	select {
	case err = <-done:
		s.PutPermit(p)
		return err
	case <-ctx.Done():
		go func() {
			<-done
			s.PutPermit(p)
		}()
		return fmt.Errorf("%w: %w", ErrAbandoned, ctx.Err())
	}
}
