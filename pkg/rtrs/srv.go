package rtrs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// The server (struct rtrs_srv_ctx): its listeners, the table of sessions
// by paths UUID, and the connection requests that make and join them
// (rtrs_rdma_connect), with the admission bounds checked there.

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

// SrvHandler is the server's user (rtrs_srv_ops): RNBD.
type SrvHandler interface {
	// LinkEvent reports a session's first path up (an error refuses the
	// path) and its last path down. Calls for a session are serialized.
	LinkEvent(sess *SrvSession, ev SrvLinkEvent) error
	// HandleIO receives one request (rdma_ev). It must not block: it
	// hands the work on and answers later with op.Respond. An error
	// answers at once with that error.
	HandleIO(op *SrvOp) error
}

// IOHandler takes requests: a SrvHandler for every session, or one
// session's own (SrvSession.SetIOHandler). HandleIO is as
// SrvHandler.HandleIO.
type IOHandler interface {
	HandleIO(op *SrvOp) error
}

// NameClaimer is an optional part of a SrvHandler: which client may
// take a session name. ClaimSessionName is called for every path that
// brings the name (a session's first, and each that joins it), with the
// identity the fabric authenticated for the session ("" without one),
// under the server's naming lock, so it must be idempotent; an error
// refuses the path (the session name arrives in INFO_REQ, which has no
// answer for an error: the client sees its path closed).
type NameClaimer interface {
	ClaimSessionName(name, identity string) error
}

// Server is the RTRS server (struct rtrs_srv_ctx): it accepts paths,
// groups them into sessions by paths UUID, owns each path's chunks and
// hands every IO to its handler. It is safe for concurrent use.
type Server struct {
	cfg SrvConfig
	log *log.Entry
	rl  log.Limiter // the refusals'
	// unprovenRL bounds what the paths that never got through INFO_REQ
	// log as they go, together.
	unprovenRL log.Limiter
	listeners  []fabric.Listener
	listening  []Listen

	mu sync.Mutex // guards sessions
	// +checklocks:mu
	sessions map[[16]byte]*SrvSession

	// connecting counts the paths in SrvPathConnecting per client
	// address (MaxConnectingPerAddr).
	connectingMu sync.Mutex
	// +checklocks:connectingMu
	connecting map[netip.Prefix]int
	// nameMu serializes session naming (claimName); taken before mu
	// and any session's mu.
	nameMu sync.Mutex
	// chunkMem is the memory all paths are counted for (MaxChunkMemory);
	// clientMem that of each client's paths (MaxChunkMemoryPerClient),
	// heapMem the part of chunkMem on the Go heap (GoMemoryLimit). They
	// change under memMu.
	memMu    sync.Mutex
	chunkMem atomic.Int64
	// +checklocks:memMu
	clientMem map[string]int64
	// +checklocks:memMu
	heapMem int64
	// goLimit is the runtime's memory limit before the server set its
	// own (GoMemoryLimit), put back by Close.
	// +checklocks:memMu
	goLimit int64
	// pool keeps closed paths' chunk areas for new paths.
	pool chunkPool
	// pathRate bounds how fast each client makes paths (NewPathRate).
	pathRate rateLimiter
	// rejected counts refused connection requests, and paths refused
	// their session name at INFO_REQ, by errno (low byte).
	rejected [256]atomic.Uint64

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	closed atomic.Bool
}

// NewServer listens on every address of cfg and starts accepting.
func NewServer(cfg SrvConfig) (*Server, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, log: cfg.Log, sessions: make(map[[16]byte]*SrvSession)}
	s.pathRate.init(cfg.NewPathRate, cfg.NewPathBurst)
	s.startMemoryLimit()
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
		if sc, ok := l.(fabric.Screener); ok && cfg.NewPathRate > 0 {
			var b [ConnRspSize]byte
			rsp := ConnRsp{Magic: Magic, Version: ProtoVer, Errno: syscall.EAGAIN}
			sc.Screen(s.refuseAtAccept, rsp.Encode(b[:]))
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

// Rejected counts the connection requests the server refused, by the
// errno it answered with (EUSERS: too many sessions of the client,
// ENOMEM: past the chunk memory, EACCES: identity, EBUSY: paths
// connecting, EAGAIN: NewPathRate, with the connections its listeners
// refused as they accepted them from an address that rate holds), and
// the paths refused their session name at
// INFO_REQ (EPERM: another session has it; the NameClaimer's errno,
// EACCES for a name bound to another identity), since it started, with
// those its fabrics refused before handing them on (fabric.Refuser:
// EACCES for a client without TLS at a TLS listener, or a certificate
// that is missing, does not verify or names no identity). A fabric
// shared by several endpoints counts once.
func (s *Server) Rejected() map[syscall.Errno]uint64 {
	m := map[syscall.Errno]uint64{}
	for i := range s.rejected {
		if n := s.rejected[i].Load(); n > 0 {
			m[syscall.Errno(i)] = n
		}
	}
	var seen []fabric.Refuser
	fabs := []fabric.Fabric{s.cfg.Fabric}
	for _, e := range s.cfg.Endpoints {
		fabs = append(fabs, e.Fabric)
	}
	for _, f := range fabs {
		r, ok := f.(fabric.Refuser)
		if !ok || slices.Contains(seen, r) {
			continue
		}
		seen = append(seen, r)
		for errno, n := range r.Refused() {
			m[errno] += n
		}
	}
	return m
}

// ChunkMemory is the memory all paths hold against MaxChunkMemory, and
// that bound (0: none).
func (s *Server) ChunkMemory() (used, limit int64) {
	return s.chunkMem.Load(), s.cfg.MaxChunkMemory
}

// NameHeld says whether a session has name, once the namings under way
// (claimName) are done: a path that took it before this call is seen.
func (s *Server) NameHeld(name string) bool {
	s.nameMu.Lock()
	defer s.nameMu.Unlock()
	for _, x := range s.Sessions() {
		if x.Name() == name {
			return true
		}
	}
	return false
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
	s.pool.close()
	s.stopMemoryLimit()
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

// refuseAtAccept is what the listeners that are fabric.Screeners refuse
// as they accept it: a connection from an address the new path rate
// holds, refused a path and with its bucket not refilled yet
// (rateLimiter), for as long as it is held. It is answered EAGAIN, as the
// path it might bring would be, and counted so, but not logged: the
// refusal that held the address was. The accept loops call it for every
// connection; it neither blocks nor allocates.
func (s *Server) refuseAtAccept(addr netip.Addr) time.Duration {
	d := s.pathRate.holding(fabric.PeerGroup(addr))
	if d > 0 {
		s.rejected[syscall.EAGAIN].Add(1)
	}
	return d
}

func (s *Server) reject(req fabric.ConnRequest, errno syscall.Errno, why string, f log.Fields) {
	f["client"] = req.RemoteAddr()
	f["errno"] = errno.Error()
	s.rejected[errno&0xff].Add(1)
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
	peer := fabric.PeerNames(req)
	sess, errno := s.getOrCreateSession(msg.PathsUUID, msg.FirstConn, peer, clientKey(peer, req))
	switch errno {
	case syscall.EACCES:
		s.reject(req, errno, "peer is not the session's: its certificate differs", log.Fields{"peer": strings.Join(peer, ",")})
		return
	case syscall.EUSERS:
		s.reject(req, errno, "too many sessions of this client", log.Fields{"client_key": clientKey(peer, req), "max_sessions_per_client": s.cfg.MaxSessionsPerClient})
		return
	}
	if errno != 0 {
		s.reject(req, errno, "no session for this connection", log.Fields{"first_conn": msg.FirstConn})
		return
	}
	sess.mu.Lock()
	path := sess.findPathLocked(msg.SessUUID)
	if path != nil {
		s.putSession(sess) // the path holds the session's reference
		if path.reconCnt != msg.ReconCnt {
			if len(peer) == 0 && req.RemoteAddr().Addr() != path.clientAddr.Addr() {
				// Without authentication the UUIDs are no secret
				// (they travel in clear): a reconnect may replace a
				// path only from the path's own client address.
				// Anyone else waits, as the client itself would if
				// its address had changed, until the old path dies.
				sess.mu.Unlock()
				s.reject(req, syscall.EBUSY, "a reconnect of a path from another address than the path's: not superseding it",
					log.Fields{"path": path.Name()})
				return
			}
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

// admitConnecting counts a new connecting path from a (its
// fabric.PeerGroup), or refuses it.
func (s *Server) admitConnecting(addr netip.Addr) bool {
	a := fabric.PeerGroup(addr)
	s.connectingMu.Lock()
	defer s.connectingMu.Unlock()
	if s.cfg.MaxConnectingPerAddr > 0 && s.connecting[a] >= s.cfg.MaxConnectingPerAddr {
		return false
	}
	if s.connecting == nil {
		s.connecting = make(map[netip.Prefix]int)
	}
	s.connecting[a]++
	return true
}

// doneConnecting uncounts a path from a that is no longer connecting.
func (s *Server) doneConnecting(addr netip.Addr) {
	a := fabric.PeerGroup(addr)
	s.connectingMu.Lock()
	defer s.connectingMu.Unlock()
	if n := s.connecting[a]; n > 1 {
		s.connecting[a] = n - 1
	} else {
		delete(s.connecting, a)
	}
}

// first is the first of names, or "".
func first(names []string) string {
	if len(names) == 0 {
		return ""
	}
	return names[0]
}

// clientKey is what sessions and their memory are counted by for
// MaxSessionsPerClient and MaxChunkMemoryPerClient: the peer's identity
// where the fabric authenticated one, else its address (fabric.PeerGroup).
func clientKey(peer []string, req fabric.ConnRequest) string {
	if len(peer) > 0 {
		return "identity:" + peer[0]
	}
	g := fabric.PeerGroup(req.RemoteAddr().Addr())
	if g.IsSingleIP() {
		return "address:" + g.Addr().String()
	}
	return "address:" + g.String()
}

// getOrCreateSession finds the session of uuid, or makes it for the first
// connection of a path. A connection joins a session only if its fabric
// authenticated the same peer identity as the session's first (EACCES
// otherwise): knowing a session's UUID is no credential.
func (s *Server) getOrCreateSession(uuid [16]byte, firstConn bool, peer []string, client string) (*SrvSession, syscall.Errno) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed.Load() {
		return nil, syscall.ECONNRESET
	}
	if x := s.sessions[uuid]; x != nil {
		// The identity (the first name) must be the session's; the
		// rest may differ (a renewed certificate with other
		// alternative names). The session keeps its first names.
		if first(x.peer) != first(peer) || (len(x.peer) == 0) != (len(peer) == 0) {
			return nil, syscall.EACCES
		}
		x.refs++
		return x, 0
	}
	if !firstConn {
		return nil, syscall.ENXIO
	}
	if len(s.sessions) >= s.cfg.MaxSessions {
		return nil, syscall.ENOSPC
	}
	if most := s.cfg.MaxSessionsPerClient; most > 0 {
		n := 0
		for _, x := range s.sessions {
			if x.client == client {
				n++
			}
		}
		if n >= most {
			return nil, syscall.EUSERS
		}
	}
	x := &SrvSession{srv: s, uuid: uuid, queueDepth: s.cfg.QueueDepth, chunkSize: s.cfg.MaxChunkSize, refs: 1, peer: peer, client: client}
	x.acceptCond.L = &x.mu
	x.logp.Store(x.withPeer(s.log.WithField("session_uuid", fmt.Sprintf("%x", uuid[:4]))))
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
