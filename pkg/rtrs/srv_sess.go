package rtrs

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

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
	had := x.name
	x.mu.Unlock()
	if had != "" && had != name {
		return fmt.Errorf("session %q cannot take a path named %q", had, name)
	}
	// Every path asks, not only the session's first: a name the
	// operator gave to another identity while this session held it is
	// refused to its next path, even one that joins the old session.
	if nc, ok := s.cfg.Handler.(NameClaimer); ok {
		if err := nc.ClaimSessionName(name, x.Identity()); err != nil {
			return err
		}
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	x.name = name
	x.logp.Store(x.withPeer(s.log.WithField("session", name)))
	return nil
}

// SrvSession is a client session as the server sees it (struct
// rtrs_srv_sess): its paths. It is safe for concurrent use.
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
	ioh        atomic.Pointer[sessIOHandler] // SetIOHandler
	peer       []string                      // what the fabric authenticated of the client
	client     string                        // what it counts against MaxSessionsPerClient (clientKey)

	// mu guards the fields below.
	mu sync.Mutex
	// +checklocks:mu
	name string
	// +checklocks:mu
	paths []*SrvPath
	// +checklocks:mu
	lost []LostPath // LostPaths
	// +checklocks:mu
	// +checklocks:evMu
	pathsUp int
	refs    int // under srv.mu: one per path
	// acceptCond (on mu) wakes a closing path waiting for connections
	// being accepted into it (SrvPath.accepting).
	// +checklocks:mu
	acceptCond sync.Cond

	evMu sync.Mutex // serializes link events
}

// Name is the session name the client sent.
func (x *SrvSession) Name() string {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.name
}

// PeerNames are the names the fabric authenticated for the client (on
// TCP with TLS, its certificate's: fabric.Authenticated), the same for
// every connection of the session; nil if the fabric authenticates no
// one.
func (x *SrvSession) PeerNames() []string { return x.peer }

// Identity is the first of PeerNames, or "".
func (x *SrvSession) Identity() string {
	if len(x.peer) == 0 {
		return ""
	}
	return x.peer[0]
}

func (x *SrvSession) withPeer(e *log.Entry) *log.Entry {
	if id := x.Identity(); id != "" {
		return e.WithField("peer", id)
	}
	return e
}

// UUID is the session's paths UUID.
func (x *SrvSession) UUID() [16]byte { return x.uuid }

// QueueDepth is the number of chunks.
func (x *SrvSession) QueueDepth() int { return x.queueDepth }

// SetIOHandler makes h take the session's requests from now on, in
// place of the server's SrvHandler.HandleIO: what a handler sets at
// SrvLinkConnected, so that each request reaches its session's state
// without a lookup (pkg/rnbd's SrvSession is one).
func (x *SrvSession) SetIOHandler(h IOHandler) { x.ioh.Store(&sessIOHandler{h}) }

// sessIOHandler boxes an IOHandler for an atomic pointer.
type sessIOHandler struct{ h IOHandler }

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

// +checklocks:x.mu
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
// +checklocks:x.mu
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
	if !s.pathRate.allow(fabric.PeerGroup(client), x.Identity()) {
		return nil, syscall.EAGAIN, fmt.Errorf("new paths from %v or its identity come faster than %g a second (after %d at once)",
			client, s.cfg.NewPathRate, s.cfg.NewPathBurst)
	}
	if !s.admitConnecting(client) {
		return nil, syscall.EBUSY, fmt.Errorf("%d paths from %v are connecting already", s.cfg.MaxConnectingPerAddr, client)
	}
	p.state.Store(int32(SrvPathConnecting))
	p.logp.Store(x.logp.Load().WithField("path", p.Name()))
	if err := p.allocResources(); err != nil {
		p.freeResources()
		s.doneConnecting(client)
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

// removePath takes p out of the session; lost says it had connected,
// and it is remembered among LostPaths unless another connected path of
// the session has its name.
func (x *SrvSession) removePath(p *SrvPath, lost bool) {
	name := p.Name()
	x.mu.Lock()
	for i, q := range x.paths {
		if q == p {
			x.paths = append(x.paths[:i:i], x.paths[i+1:]...)
			break
		}
	}
	for _, q := range x.paths {
		if q.Name() == name && q.State() == SrvPathConnected {
			lost = false // replaced already
		}
	}
	if lost {
		x.forgetLostLocked(name)
		if len(x.lost) >= MaxPathsNum {
			x.lost = x.lost[1:] // the oldest goes
		}
		x.lost = append(x.lost, LostPath{Name: name, Since: time.Now()})
	}
	x.mu.Unlock()
	x.srv.putSession(x)
}

// LostPath is a path of the session that had connected and is gone,
// while the session stays (it has other paths): the server's view of a
// degraded session.
type LostPath struct {
	Name  string    // "client@server", as SrvPath.Name
	Since time.Time // when it went
}

// LostPaths are the session's paths that connected and went while the
// session stayed, oldest first: each until a path of its name connects
// again or the session ends (its last path goes). The server cannot tell
// a path its client removed on purpose from one that was lost: both
// stay until then. At most MaxPathsNum are kept.
func (x *SrvSession) LostPaths() []LostPath {
	x.mu.Lock()
	defer x.mu.Unlock()
	return append([]LostPath(nil), x.lost...)
}

// forgetLostLocked drops name from the lost paths. x.mu is held.
// +checklocks:x.mu
func (x *SrvSession) forgetLostLocked(name string) {
	x.lost = slices.DeleteFunc(x.lost, func(l LostPath) bool { return l.Name == name })
}

// pathUp counts an established path and reports CONNECTED for the first
// (rtrs_srv_path_up).
func (x *SrvSession) pathUp(p *SrvPath) error {
	x.evMu.Lock()
	defer x.evMu.Unlock()
	x.mu.Lock()
	x.pathsUp++
	first := x.pathsUp == 1
	x.forgetLostLocked(p.Name()) // back, or replaced
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
