package rtrs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// SrvLinkEvent is what a server tells its user about a session (enum
// rtrs_srv_link_ev).
type SrvLinkEvent int

const (
	// SrvLinkConnected: the first path of a session is up.
	SrvLinkConnected SrvLinkEvent = iota
	// SrvLinkDisconnected: the last path of a session went down.
	SrvLinkDisconnected
)

func (e SrvLinkEvent) String() string {
	if e == SrvLinkConnected {
		return "CONNECTED"
	}
	return "DISCONNECTED"
}

// ServerHandler is the server's user (rtrs_srv_ops): RNBD.
type ServerHandler interface {
	// LinkEvent reports a session's first path up (an error refuses the
	// path) and its last path down. Calls for a session are serialized.
	LinkEvent(sess *SrvSession, ev SrvLinkEvent) error
	// HandleIO receives one request (rdma_ev). It must not block: it
	// hands the work on and answers later with op.Respond. An error
	// answers at once with that error.
	HandleIO(op *SrvOp) error
}

// ServerConfig configures a Server. Start from DefaultServerConfig.
type ServerConfig struct {
	// Fabric carries the paths accepted on the Listen addresses.
	Fabric fabric.Fabric
	// Listen are the addresses to accept paths on.
	Listen []netip.AddrPort
	// Endpoints are more addresses, each on a fabric of its own (RDMA
	// beside TCP). A path lives on the fabric it was accepted on.
	Endpoints []Endpoint
	// QueueDepth is the number of chunks per session (sess_queue_depth).
	QueueDepth int
	// MaxChunkSize is the size of a chunk, a power of two >= 8 KiB; the
	// largest IO is MaxChunkSize - MaxHdrSize.
	MaxChunkSize int
	// AlwaysInvalidate revokes a chunk's rkey while the server works on
	// it and sends the client a new one with each response.
	AlwaysInvalidate bool
	HBInterval       time.Duration
	HBMissedMax      int
	// ConnectTimeout closes a path that does not finish connecting.
	ConnectTimeout time.Duration
	// MaxSessions bounds the sessions the server keeps.
	MaxSessions int
	// MaxChunkMemory bounds the memory of all paths' chunks together
	// (each path owns QueueDepth × MaxChunkSize bytes): a path that would
	// pass it is refused with ENOMEM. 0 means no bound.
	MaxChunkMemory int64
	Handler        ServerHandler
	Log            *log.Entry
}

// Endpoint is an address to accept paths on, on a fabric.
type Endpoint struct {
	Fabric fabric.Fabric
	Addr   netip.AddrPort
	// Optional: if the fabric cannot work here (fabric.ErrNotSupported:
	// no RDMA device), the server goes on without this endpoint.
	Optional bool
}

// DefaultMaxChunkMemory lets 128 paths of the default 512 × 128 KiB chunks.
const DefaultMaxChunkMemory = 8 << 30

// DefaultServerConfig returns the kernel module's defaults.
func DefaultServerConfig() ServerConfig {
	return ServerConfig{
		QueueDepth:       DefaultQueueDepth,
		MaxChunkSize:     DefaultMaxChunkSize,
		AlwaysInvalidate: true,
		HBInterval:       DefaultHBInterval,
		HBMissedMax:      DefaultHBMissedMax,
		ConnectTimeout:   DefaultConnectTimeout,
		MaxSessions:      1024,
		MaxChunkMemory:   DefaultMaxChunkMemory,
	}
}

func (c *ServerConfig) validate() error {
	if c.Handler == nil || (c.Fabric == nil && len(c.Listen) > 0) || (len(c.Listen) == 0 && len(c.Endpoints) == 0 && c.Fabric == nil) {
		return errors.New("rtrs: server needs a fabric and a handler")
	}
	for _, e := range c.Endpoints {
		if e.Fabric == nil {
			return errors.New("rtrs: server endpoint without a fabric")
		}
	}
	if c.QueueDepth < 1 || c.QueueDepth > MaxSessQueueDepth {
		return fmt.Errorf("rtrs: queue depth %d, want 1..%d", c.QueueDepth, MaxSessQueueDepth)
	}
	if c.MaxChunkSize < MinChunkSize || c.MaxChunkSize&(c.MaxChunkSize-1) != 0 {
		return fmt.Errorf("rtrs: max chunk size %d, want a power of two >= %d", c.MaxChunkSize, MinChunkSize)
	}
	if err := CheckImmBudget(uint32(c.QueueDepth), uint32(c.MaxChunkSize)); err != nil {
		return err
	}
	if c.HBInterval <= 0 || c.HBMissedMax < 0 || c.ConnectTimeout <= 0 || c.MaxSessions < 1 || c.MaxChunkMemory < 0 {
		return errors.New("rtrs: bad heartbeat, timeout or session limit")
	}
	if c.Log == nil {
		c.Log = log.L
	}
	return nil
}

// Server is the RTRS server (struct rtrs_srv_ctx): it accepts paths,
// groups them into sessions by paths UUID, owns each path's chunks and
// hands every IO to its handler. It is safe for concurrent use.
type Server struct {
	cfg       ServerConfig
	log       *log.Entry
	rl        log.Limiter
	listeners []fabric.Listener
	listening []Listen

	mu       sync.Mutex // guards sessions
	sessions map[[16]byte]*SrvSession
	// nameMu serializes session naming (claimName); taken before mu
	// and any session's mu.
	nameMu sync.Mutex
	// chunkMem is the memory all paths' chunks take (MaxChunkMemory).
	chunkMem atomic.Int64

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	closed atomic.Bool
}

// NewServer listens on every address of cfg and starts accepting.
func NewServer(cfg ServerConfig) (*Server, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, log: cfg.Log, sessions: make(map[[16]byte]*SrvSession)}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	eps := append([]Endpoint(nil), cfg.Endpoints...)
	for _, a := range cfg.Listen {
		eps = append(eps, Endpoint{Fabric: cfg.Fabric, Addr: a})
	}
	for _, e := range eps {
		l, err := e.Fabric.Listen(e.Addr)
		if err != nil && e.Optional && errors.Is(err, fabric.ErrNotSupported) {
			s.log.WithError(err).WithField("listen", e.Fabric.Name()+"://"+e.Addr.String()).Info("not listening: this machine cannot")
			continue
		}
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("rtrs: listen on %s %v: %w", e.Fabric.Name(), e.Addr, err)
		}
		s.listeners = append(s.listeners, l)
		s.listening = append(s.listening, Listen{Transport: e.Fabric.Name(), Addr: l.Addr()})
		s.wg.Add(1)
		go s.acceptLoop(e.Fabric, l)
	}
	return s, nil
}

// Listening returns where the server listens, with the transports.
func (s *Server) Listening() []Listen { return append([]Listen(nil), s.listening...) }

// Addrs returns the addresses the server listens on.
func (s *Server) Addrs() []netip.AddrPort {
	var a []netip.AddrPort
	for _, l := range s.listeners {
		a = append(a, l.Addr())
	}
	return a
}

// Sessions returns the server's sessions.
func (s *Server) Sessions() []*SrvSession {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ss []*SrvSession
	for _, x := range s.sessions {
		ss = append(ss, x)
	}
	return ss
}

// Close stops listening, closes every path and waits until they are gone.
func (s *Server) Close() error {
	// Under mu: a session found or created after this sees it, and so
	// does a path added to one (allocPathLocked runs after the session
	// lookup), so none escapes the snapshot below.
	s.mu.Lock()
	was := s.closed.Swap(true)
	s.mu.Unlock()
	if was {
		return nil
	}
	s.cancel()
	for _, l := range s.listeners {
		l.Close()
	}
	for _, x := range s.Sessions() {
		x.Close()
	}
	s.wg.Wait()
	return nil
}

func (s *Server) acceptLoop(fab fabric.Fabric, l fabric.Listener) {
	defer s.wg.Done()
	for {
		req, err := l.Accept(s.ctx)
		if err != nil {
			return
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.handleConnReq(fab, req)
		}()
	}
}

func (s *Server) reject(req fabric.ConnRequest, errno syscall.Errno, why string, f log.Fields) {
	f["client"] = req.RemoteAddr()
	f["errno"] = errno.Error()
	s.rl.Log(s.log.WithFields(f), log.WarnLevel, "rejecting connection: "+why)
	var b [ConnRspSize]byte
	rsp := ConnRsp{Magic: Magic, Version: ProtoVer, Errno: errno}
	req.Reject(rsp.Encode(b[:]))
}

// handleConnReq is rtrs_rdma_connect: validate the request, find or make
// the session and path, and accept the connection into it.
func (s *Server) handleConnReq(fab fabric.Fabric, req fabric.ConnRequest) {
	var msg ConnReq
	if err := msg.Decode(req.PrivateData()); err != nil {
		s.reject(req, syscall.ECONNRESET, "invalid RTRS connection request", log.Fields{"len": len(req.PrivateData())})
		return
	}
	if msg.Magic != Magic {
		s.reject(req, syscall.ECONNRESET, "invalid RTRS magic", log.Fields{"magic": msg.Magic})
		return
	}
	if msg.Version>>8 != ProtoVerMajor {
		s.reject(req, syscall.ECONNRESET, "unsupported major RTRS version", log.Fields{"version": msg.Version})
		return
	}
	if msg.CIDNum > MaxConnsPerPath || msg.CIDNum == 0 {
		s.reject(req, syscall.ECONNRESET, "too many connections requested", log.Fields{"cid_num": msg.CIDNum})
		return
	}
	if msg.CID >= msg.CIDNum {
		s.reject(req, syscall.ECONNRESET, "incorrect cid", log.Fields{"cid": msg.CID, "cid_num": msg.CIDNum})
		return
	}
	if s.closed.Load() {
		s.reject(req, syscall.ECONNRESET, "server closing", log.Fields{})
		return
	}
	sess, errno := s.getOrCreateSession(msg.PathsUUID, msg.FirstConn)
	if errno != 0 {
		s.reject(req, errno, "no session for this connection", log.Fields{"first_conn": msg.FirstConn})
		return
	}
	sess.mu.Lock()
	path := sess.findPathLocked(msg.SessUUID)
	if path != nil {
		s.putSession(sess) // the path holds the session's reference
		if path.reconCnt != msg.ReconCnt {
			// The client tore this path down and is reconnecting while
			// we still hold the old one (its heartbeat has not noticed
			// yet, or the attempt died half way): drop the old path now
			// and let the client retry shortly, instead of refusing it
			// until the old path times out.
			sess.mu.Unlock()
			path.close("superseded by a reconnect of the client")
			s.reject(req, syscall.EBUSY, "previous path still exists", log.Fields{"path": path.Name()})
			return
		}
		if st := path.State(); st != SrvPathConnecting {
			sess.mu.Unlock()
			s.reject(req, syscall.ECONNRESET, "path in wrong state", log.Fields{"path": path.Name(), "state": st})
			return
		}
		if path.fab != fab || path.dev.Name() != req.Device().Name() {
			sess.mu.Unlock()
			s.reject(req, syscall.ECONNRESET, "connection on another fabric or device than its path's",
				log.Fields{"path": path.Name(), "fabric": fab.Name(), "device": req.Device().Name()})
			return
		}
		if int(msg.CIDNum) != len(path.conns) || path.conns[msg.CID] != nil {
			sess.mu.Unlock()
			s.reject(req, syscall.ECONNRESET, "incorrect request for an existing path",
				log.Fields{"path": path.Name(), "cid": msg.CID, "cid_num": msg.CIDNum})
			return
		}
	} else {
		var err error
		path, errno, err = sess.allocPathLocked(fab, req, &msg)
		if errno != 0 {
			sess.mu.Unlock()
			s.putSession(sess)
			s.reject(req, errno, "cannot create path: "+fmt.Sprint(err), log.Fields{})
			return
		}
	}
	// Reserve the slot and accept without the session lock: the answer
	// goes over the network. A closing path waits for us (accepting).
	c := path.newConnLocked(int(msg.CID))
	path.accepting++
	sess.mu.Unlock()
	err := path.acceptCon(req, c)
	sess.mu.Lock()
	if err != nil {
		path.conns[c.cid] = nil
	}
	path.accepting--
	sess.acceptCond.Broadcast()
	sess.mu.Unlock()
	if err != nil {
		s.rl.Log(path.lg().WithError(err), log.WarnLevel, "accepting connection failed")
		path.close("accepting a connection failed")
	}
}

func (s *Server) getOrCreateSession(uuid [16]byte, firstConn bool) (*SrvSession, syscall.Errno) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed.Load() {
		return nil, syscall.ECONNRESET
	}
	if x := s.sessions[uuid]; x != nil {
		x.refs++
		return x, 0
	}
	if !firstConn {
		return nil, syscall.ENXIO
	}
	if len(s.sessions) >= s.cfg.MaxSessions {
		return nil, syscall.ENOSPC
	}
	x := &SrvSession{srv: s, uuid: uuid, queueDepth: s.cfg.QueueDepth, chunkSize: s.cfg.MaxChunkSize, refs: 1}
	x.acceptCond.L = &x.mu
	x.logp.Store(s.log.WithField("session_uuid", fmt.Sprintf("%x", uuid[:4])))
	s.sessions[uuid] = x
	return x, 0
}

func (s *Server) putSession(x *SrvSession) {
	s.mu.Lock()
	x.refs--
	free := x.refs == 0
	if free {
		delete(s.sessions, x.uuid)
	}
	s.mu.Unlock()
}

// claimName gives the session its name, unless another session uses it
// (exist_pathname) or the session already has a different one. The check
// and the claim are one step under the server's nameMu, so two sessions
// connecting at once cannot both take a name.
func (x *SrvSession) claimName(name string) error {
	s := x.srv
	s.nameMu.Lock()
	defer s.nameMu.Unlock()
	for _, o := range s.Sessions() {
		if o != x && o.Name() == name {
			return fmt.Errorf("session name %q is taken by another session: %w", name, syscall.EPERM)
		}
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.name != "" && x.name != name {
		return fmt.Errorf("session %q cannot take a path named %q", x.name, name)
	}
	x.name = name
	x.logp.Store(s.log.WithField("session", name))
	return nil
}

// SrvSession is a client session as the server sees it (struct
// rtrs_srv_sess): its paths.
//
// Unlike the kernel, each path has chunks of its own rather than sharing
// the session's. The protocol allows it (a client keeps the chunk
// descriptors per path), and it means a request failed over from a dead
// path never lands in memory that the dead path's unfinished IO may still
// be reading: with shared chunks that IO could write another request's
// data to its own, stale, offset.
type SrvSession struct {
	srv        *Server
	uuid       [16]byte
	queueDepth int
	chunkSize  int
	logp       atomic.Pointer[log.Entry]
	priv       atomic.Value

	// mu guards the fields below.
	mu      sync.Mutex
	name    string
	paths   []*SrvPath
	pathsUp int
	refs    int // under srv.mu: one per path
	// acceptCond (on mu) wakes a closing path waiting for connections
	// being accepted into it (SrvPath.accepting).
	acceptCond sync.Cond

	evMu sync.Mutex // serializes link events
}

// Name is the session name the client sent.
func (x *SrvSession) Name() string {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.name
}

// UUID is the session's paths UUID.
func (x *SrvSession) UUID() [16]byte { return x.uuid }

// QueueDepth is the number of chunks.
func (x *SrvSession) QueueDepth() int { return x.queueDepth }

// SetPriv and Priv attach the user's state to the session.
func (x *SrvSession) SetPriv(v any) { x.priv.Store(&v) }

func (x *SrvSession) Priv() any {
	if v, ok := x.priv.Load().(*any); ok {
		return *v
	}
	return nil
}

// Paths returns the session's paths.
func (x *SrvSession) Paths() []*SrvPath {
	x.mu.Lock()
	defer x.mu.Unlock()
	return append([]*SrvPath(nil), x.paths...)
}

// Close disconnects every path of the session and waits for them.
func (x *SrvSession) Close() {
	for _, p := range x.Paths() {
		p.close("session closed")
		<-p.closed
	}
}

func (p *SrvPath) chunk(id uint32) []byte {
	b := p.chunks.Bytes()
	cs := p.sess.chunkSize
	return b[int(id)*cs : (int(id)+1)*cs]
}

func (x *SrvSession) findPathLocked(uuid [16]byte) *SrvPath {
	for _, p := range x.paths {
		if p.uuid == uuid {
			return p
		}
	}
	return nil
}

// allocPathLocked is __alloc_path: a new path in CONNECTING with its own
// protection domain and registrations of the session's chunks.
func (x *SrvSession) allocPathLocked(fab fabric.Fabric, req fabric.ConnRequest, msg *ConnReq) (*SrvPath, syscall.Errno, error) {
	s := x.srv
	if s.closed.Load() {
		return nil, syscall.ECONNRESET, errors.New("server closing")
	}
	if len(x.paths) >= MaxPathsNum {
		return nil, syscall.ECONNRESET, errors.New("too many paths")
	}
	client, server := req.RemoteAddr().Addr(), req.LocalAddr().Addr()
	for _, p := range x.paths {
		if p.clientAddr.Addr() == client && p.serverAddr.Addr() == server {
			return nil, syscall.EEXIST, fmt.Errorf("path %s with the same addresses exists", p.Name())
		}
	}
	p := &SrvPath{
		sess:       x,
		uuid:       msg.SessUUID,
		reconCnt:   msg.ReconCnt,
		clientAddr: req.RemoteAddr(),
		serverAddr: req.LocalAddr(),
		conns:      make([]*srvConn, msg.CIDNum),
		fab:        fab,
		dev:        req.Device(),
		closed:     make(chan struct{}),
	}
	p.state.Store(int32(SrvPathConnecting))
	p.logp.Store(x.logp.Load().WithField("path", p.Name()))
	if err := p.allocResources(); err != nil {
		p.freeResources()
		return nil, syscall.ENOMEM, err
	}
	p.hb.init(s.cfg.HBInterval, s.cfg.HBMissedMax, p.sendHB, func() {
		p.lg().Error("heartbeat: client silent for too long")
		p.close("heartbeat timeout")
	})
	p.zombie = time.AfterFunc(s.cfg.ConnectTimeout, func() {
		if p.State() == SrvPathConnecting {
			p.close("path did not finish connecting in time")
		}
	})
	x.paths = append(x.paths, p)
	s.wg.Add(1) // released by the close work
	return p, 0, nil
}

func (x *SrvSession) removePath(p *SrvPath) {
	x.mu.Lock()
	for i, q := range x.paths {
		if q == p {
			x.paths = append(x.paths[:i:i], x.paths[i+1:]...)
			break
		}
	}
	x.mu.Unlock()
	x.srv.putSession(x)
}

// pathUp counts an established path and reports CONNECTED for the first
// (rtrs_srv_path_up).
func (x *SrvSession) pathUp(p *SrvPath) error {
	x.evMu.Lock()
	defer x.evMu.Unlock()
	x.mu.Lock()
	x.pathsUp++
	first := x.pathsUp == 1
	x.mu.Unlock()
	if first {
		if err := x.srv.cfg.Handler.LinkEvent(x, SrvLinkConnected); err != nil {
			x.mu.Lock()
			x.pathsUp--
			x.mu.Unlock()
			return err
		}
	}
	p.established = true
	return nil
}

func (x *SrvSession) pathDown() {
	x.evMu.Lock()
	defer x.evMu.Unlock()
	x.mu.Lock()
	x.pathsUp--
	last := x.pathsUp == 0
	x.mu.Unlock()
	if last {
		x.srv.cfg.Handler.LinkEvent(x, SrvLinkDisconnected)
	}
}

// SrvPath is one path of a session on the server (struct rtrs_srv_path).
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
	chunks    fabric.Memory
	// chunkMemSize is what the path counts against MaxChunkMemory.
	chunkMemSize int64
	mrs          []fabric.MR // one per chunk with always_invalidate, else one
	memBits      int
	ops          []SrvOp
	rkeyMem      fabric.Memory // RKEY_RSP messages, 8 bytes per chunk
	rkeyMR       fabric.MR
	infoMem      fabric.Memory // INFO_REQ in, INFO_RSP out
	infoMR       fabric.MR

	established bool
	inflight    sync.WaitGroup // IOs handed to the user
	closeOnce   sync.Once
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
	if !srvTransitionAllowed(p.State(), to) {
		return false
	}
	p.state.Store(int32(to))
	return true
}

func (p *SrvPath) allocResources() error {
	x := p.sess
	cfg := &x.srv.cfg
	qd := x.queueDepth
	var err error
	size := int64(qd) * int64(x.chunkSize)
	if total := x.srv.chunkMem.Add(size); cfg.MaxChunkMemory > 0 && total > cfg.MaxChunkMemory {
		x.srv.chunkMem.Add(-size)
		return fmt.Errorf("chunks of %d bytes would pass max_chunk_memory %d: %w", size, cfg.MaxChunkMemory, syscall.ENOMEM)
	}
	p.chunkMemSize = size
	if p.pd, err = p.dev.AllocPD(); err != nil {
		return err
	}
	if p.chunks, err = p.fab.AllocMemory(qd * x.chunkSize); err != nil {
		return err
	}
	chunks := p.chunks.Bytes()
	if cfg.AlwaysInvalidate {
		for i := 0; i < qd; i++ {
			mr, err := p.pd.RegisterMR(p.chunk(uint32(i)), fabric.AccessLocalWrite|fabric.AccessRemoteWrite)
			if err != nil {
				return err
			}
			p.mrs = append(p.mrs, mr)
		}
	} else {
		mr, err := p.pd.RegisterMR(chunks, fabric.AccessLocalWrite|fabric.AccessRemoteWrite)
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
	if p.infoMem, err = p.fab.AllocMemory(InfoReqSize + InfoRspSize(len(p.mrs))); err != nil {
		return err
	}
	if p.infoMR, err = p.pd.RegisterMR(p.infoMem.Bytes(), fabric.AccessLocalWrite); err != nil {
		return err
	}
	p.ops = make([]SrvOp, qd)
	for i := range p.ops {
		p.ops[i].path, p.ops[i].id = p, uint32(i)
	}
	return nil
}

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
	for _, m := range []fabric.Memory{p.rkeyMem, p.infoMem, p.chunks} {
		if m != nil {
			m.Free()
		}
	}
	if p.pd != nil {
		p.pd.Close()
	}
	p.sess.srv.chunkMem.Add(-p.chunkMemSize)
	p.chunkMemSize = 0
}

// newConnLocked reserves connection cid of a path (create_con).
func (p *SrvPath) newConnLocked(cid int) *srvConn {
	qd := p.sess.queueDepth
	c := &srvConn{path: p, cid: cid, sigIntv: min(qd, ServiceConQueueDepth)}
	p.conns[cid] = c
	return c
}

// acceptCon accepts c's connection; the service connection gets a
// receive for INFO_REQ before it is accepted.
func (p *SrvPath) acceptCon(req fabric.ConnRequest, c *srvConn) error {
	x := p.sess
	cfg := &x.srv.cfg
	qd := x.queueDepth
	attr := fabric.ConnAttr{Handler: c}
	if c.cid == 0 {
		attr.MaxSendWR = ServiceConQueueDepth*2 + 2
		attr.MaxRecvWR = attr.MaxSendWR
		attr.Recvs = []fabric.RecvWR{{ID: wrInfoReq, Buf: p.infoMem.Bytes()[:InfoReqSize], LKey: p.infoMR.LKey()}}
	} else {
		if cfg.AlwaysInvalidate {
			attr.MaxSendWR = qd*(1+4) + 1
		} else {
			attr.MaxSendWR = qd*(1+2) + 1
		}
		attr.MaxRecvWR = qd + 1
	}
	c.sqAvail = attr.MaxSendWR
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
	if p.changeState(SrvPathClosing) {
		p.lg().WithField("reason", why).Info("closing path")
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
		}
	}
	p.inflight.Wait()
	if p.established {
		p.established = false
		x.pathDown()
	}
	p.freeResources()
	x.removePath(p)
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
		return err
	}
	p.logp.Store(x.logp.Load().WithField("path", p.Name()))
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

// start hands a request to the user; op is opWorking and counted in
// flight.
func (op *SrvOp) start(req opReq) {
	p := op.path
	chunk := p.chunk(op.id)
	op.con, op.dir, op.rd = req.c, req.dir, req.rd
	op.data = chunk[:req.dataLen]
	op.usr = chunk[req.dataLen:req.off]
	p.stats.update(op.dir, int(req.off))
	if err := p.sess.srv.cfg.Handler.HandleIO(op); err != nil {
		op.Respond(err)
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

// SrvOp is one request handed to the server's user (struct rtrs_srv_op).
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
		n++
	}
	if needInval {
		op.wrs[n] = fabric.SendWR{ID: wrRsp, Op: fabric.OpSendInv, InvRKey: op.rd.Desc.Key}
		n++
	}
	last := &op.wrs[n]
	imm := IORspImm(op.id, errno, needInval)
	if cfg.AlwaysInvalidate {
		rkey, err := chunkMR.Reregister()
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
	op.data, op.usr = nil, nil
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

// srvConn is one connection of a server path and its completion handler.
type srvConn struct {
	path     *SrvPath
	cid      int
	qp       fabric.Conn
	attached atomic.Bool

	// sendMu guards the send queue accounting: work requests are
	// credited back when a signaled one completes, which retires every
	// request posted before it (sq_wr_avail, rsp_wr_wait_list).
	sendMu  sync.Mutex
	sqAvail int
	unsig   int
	sigIntv int
	waiting []*SrvOp
	closed  bool // set by takeWaiting: nothing is parked after it

	rwr    fabric.RecvWR // scratch for reposting (receive goroutine only)
	hbWR   [2]fabric.SendWR
	infoWR fabric.SendWR
}

// Attached learns the connection. It runs on the accepting goroutine; the
// flag publishes qp to the other connections' goroutines.
func (c *srvConn) Attached(qp fabric.Conn) {
	c.qp = qp
	c.attached.Store(true)
}

func (c *srvConn) postRecvs() error {
	n := c.path.sess.queueDepth
	if c.cid == 0 {
		n = ServiceConQueueDepth
	}
	// Not the scratch rwr: this runs on cid 0's receive goroutine while
	// c's own may already be reposting.
	r := &fabric.RecvWR{ID: wrEmpty}
	for i := 0; i < n; i++ {
		if err := c.qp.PostRecv(r); err != nil {
			return err
		}
	}
	return nil
}

// post posts a chain of n work requests, or parks op until the send queue
// has room and reports that (op nil: the caller does not retry and gets
// ErrQueueFull). An op posted is opAnswering: the client may have its
// answer before post returns. The caller finishes an op not parked.
func (c *srvConn) post(wr *fabric.SendWR, n int, op *SrvOp) (parked bool, err error) {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	if c.closed {
		return false, ErrClosed
	}
	if c.sqAvail < n {
		if op == nil {
			return false, fabric.ErrQueueFull
		}
		c.waiting = append(c.waiting, op)
		return true, nil
	}
	last := wr
	for last.Next != nil {
		last = last.Next
	}
	c.unsig += n
	if c.unsig >= c.sigIntv {
		last.Signaled = true
		last.ID = wrRsp | uint64(c.unsig)
		c.unsig = 0
	}
	if op != nil {
		op.state.Store(opAnswering)
	}
	if err := c.qp.PostSend(wr); err != nil {
		return false, err
	}
	c.sqAvail -= n
	return false, nil
}

// takeWaiting closes the connection for posting and returns the ops that
// were parked on it: the closing path finishes them, and a response
// arriving after this fails at once instead of being parked for ever.
func (c *srvConn) takeWaiting() []*SrvOp {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	c.closed = true
	w := c.waiting
	c.waiting = nil
	return w
}

func (c *srvConn) postHB(imm uint32) error {
	wr := &c.hbWR[0]
	if imm == ImmHBAck {
		wr = &c.hbWR[1]
	}
	*wr = fabric.SendWR{ID: wrHB, Op: fabric.OpWriteImm, Imm: ToImm(imm, 0)}
	_, err := c.post(wr, 1, nil)
	return err
}

func (c *srvConn) violation(msg string, err error) {
	p := c.path
	e := p.lg().WithField("cid", c.cid)
	if err != nil {
		e = e.WithError(err)
	}
	p.rl.Log(e, log.ErrorLevel, msg)
	p.close(msg)
}

func (c *srvConn) Disconnected(err error) {
	// A peer hanging up is routine; anything else (a remote access
	// violation, a protocol error) is worth a warning.
	level := log.WarnLevel
	if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || errors.Is(err, syscall.ECONNRESET) {
		level = log.InfoLevel
	}
	c.path.rl.Log(c.path.lg().WithField("cid", c.cid).WithError(err), level, "connection lost")
	c.path.close("connection lost")
}

// Completion is rtrs_srv_rdma_done.
func (c *srvConn) Completion(wc *fabric.WC) {
	p := c.path
	if wc.Status != fabric.WCSuccess {
		c.violation("work request failed", fmt.Errorf("status %d", wc.Status))
		return
	}
	switch wc.Opcode {
	case fabric.WCRecv:
		if wrKind(wc.ID) != wrInfoReq {
			c.violation("unexpected send from the client", nil)
			return
		}
		if err := p.processInfoReq(c, wc); err != nil {
			c.violation("path info request refused", err)
		}
	case fabric.WCRecvRDMAWithImm:
		p.hb.alive()
		c.rwr = fabric.RecvWR{ID: wrEmpty}
		if err := c.qp.PostRecv(&c.rwr); err != nil {
			c.violation("posting a receive failed", err)
			return
		}
		typ, payload := FromImm(wc.Imm)
		switch typ {
		case ImmIOReq:
			x := p.sess
			msgID, off := payload>>p.memBits, payload&(1<<p.memBits-1)
			if int(msgID) >= x.queueDepth || int(off) >= x.chunkSize {
				c.violation("request with a wrong msg_id or offset", fmt.Errorf("msg_id %d off %d", msgID, off))
				return
			}
			if p.sess.srv.cfg.AlwaysInvalidate {
				if err := p.mrs[msgID].Invalidate(); err != nil {
					c.violation("invalidating a chunk failed", err)
					return
				}
			}
			if err := p.processIOReq(c, msgID, off); err != nil {
				c.violation("malformed request", err)
			}
		case ImmHBMsg:
			if err := c.postHB(ImmHBAck); err != nil {
				c.violation("sending heartbeat ack failed", err)
			}
		case ImmHBAck:
		default:
			p.rl.Log(p.lg().WithField("imm_type", typ), log.WarnLevel, "unknown immediate type")
		}
	case fabric.WCSend, fabric.WCWrite:
		if wrKind(wc.ID) != wrRsp {
			return
		}
		c.sendMu.Lock()
		c.sqAvail += int(wc.ID & wrIndexMask)
		waiting := c.waiting
		c.waiting = nil
		c.sendMu.Unlock()
		for i, op := range waiting {
			parked, err := c.post(&op.wrs[0], op.nwr, op)
			if err != nil {
				c.violation("posting a response failed", err)
				for _, op := range waiting[i:] {
					op.finish()
				}
				return
			}
			if !parked {
				op.finish()
			}
		}
	}
}

func (p *SrvPath) lg() *log.Entry { return p.logp.Load() }
