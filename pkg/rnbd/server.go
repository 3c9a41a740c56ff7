package rnbd

import (
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/log"
	"github.com/rnbd/rnbd/pkg/blockdev"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// Error is an error of the server side with the errno the client sees;
// it prints only its message.
type Error struct {
	Errno syscall.Errno
	Msg   string
}

func (e *Error) Error() string { return e.Msg }
func (e *Error) Unwrap() error { return e.Errno }

func errorf(errno syscall.Errno, format string, args ...any) error {
	return &Error{Errno: errno, Msg: fmt.Sprintf(format, args...)}
}

// pathMax is PATH_MAX: the kernel refuses longer device paths.
const pathMax = 4096

// Export is a device served under a name chosen by the administrator
// (rnbd-server map NAME PATH).
type Export struct {
	Name     string   `json:"name"`
	Path     string   `json:"path"`
	ReadOnly bool     `json:"read_only,omitempty"`
	Allow    []string `json:"allow,omitempty"` // session names; empty: every session
	// AllowFrom are the networks (CIDR prefixes) an OPEN may come from:
	// the client address of the path it arrives on. Empty: any.
	AllowFrom []netip.Prefix `json:"allow_from,omitempty"`
	// Migration lets a second session open the export read-write with
	// access_mode=migration beside a writer (live migration). Off, such
	// an OPEN is refused while another session writes: any peer could
	// otherwise write to a device another holds. Alone, migration opens
	// as rw does.
	Migration bool `json:"migration,omitempty"`
	// AllowIdentities are the client identities that may open the
	// export, each with the most it may open it for. A client's
	// identities are the names of its TLS certificate on the TCP fabric
	// (rtrs.SrvSession.PeerNames), which the client cannot choose as it
	// chooses its session name. Set, a client without a certificate (TCP
	// without TLS, RDMA) cannot open the export, and access_mode
	// migration needs a grant of migration (which lets the client write
	// beside another writer whatever Migration says). Empty: any client,
	// by the other rules.
	AllowIdentities []Grant `json:"allow_identities,omitempty"`
	// MaxSessions bounds the sessions that have the export open at once;
	// 0: no bound. One more OPEN is refused with EUSERS.
	MaxSessions int `json:"max_sessions,omitempty"`
	// WriteThrough makes every write durable when it completes, and
	// OPEN_RSP then announces no write cache: clients do not flush.
	WriteThrough bool `json:"write_through,omitempty"`

	withdrawing bool // being unmapped: no new opens
}

// allowsFrom reports whether an OPEN from a may open e.
func (e *Export) allowsFrom(a netip.Addr) bool {
	if len(e.AllowFrom) == 0 {
		return true
	}
	a = a.Unmap()
	for _, p := range e.AllowFrom {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// Grant is an entry of Export.AllowIdentities.
type Grant struct {
	Identity string `json:"identity"`
	// Access is the most the identity may open the export for: "ro",
	// "rw" or "migration" (each allows the ones before it).
	Access string `json:"access"`
}

// ParseGrant parses NAME or NAME=ACCESS (access rw by default).
func ParseGrant(s string) (Grant, error) {
	g := Grant{Identity: s, Access: "rw"}
	if i := strings.LastIndexByte(s, '='); i >= 0 {
		if _, err := ParseAccessMode(s[i+1:]); err == nil {
			g.Identity, g.Access = s[:i], s[i+1:]
		}
	}
	if g.Identity == "" {
		return g, fmt.Errorf("identity %q: want NAME or NAME=ro|rw|migration", s)
	}
	return g, nil
}

func (g Grant) String() string { return g.Identity + "=" + g.Access }

// grant returns the most a client of the peer names may open e for, and
// whether it may open it at all (by its identities; the other rules
// apply too). Of several matching grants the widest counts.
func (e *Export) grant(peer []string) (AccessMode, bool) {
	if len(e.AllowIdentities) == 0 {
		return AccessMigration, true
	}
	best, ok := AccessRO, false
	for _, g := range e.AllowIdentities {
		if !slices.Contains(peer, g.Identity) {
			continue
		}
		m, _ := ParseAccessMode(g.Access) // checked by Map
		if !ok || m > best {
			best, ok = m, true
		}
	}
	return best, ok
}

// admit checks an OPEN of e by session x in mode, from a client at
// from, against e's rules: the session name, the client's network, its
// identity's grant, read-only. It reports whether the session may write
// beside another writer (access_mode=migration: Migration, or a grant of
// migration where grants are given).
func (e *Export) admit(x *SrvSession, mode AccessMode, from netip.Addr) (secondWriter bool, err error) {
	if !e.allows(x.name) {
		return false, errorf(syscall.EPERM, "export %s does not allow session %s", e.Name, x.name)
	}
	if !e.allowsFrom(from) {
		return false, errorf(syscall.EPERM, "export %s does not allow clients at %v", e.Name, from)
	}
	peer := x.rtrs.PeerNames()
	most, ok := e.grant(peer)
	switch {
	case !ok && len(peer) == 0:
		return false, errorf(syscall.EACCES, "export %s allows only clients with a certificate it names, and this one has none", e.Name)
	case !ok:
		return false, errorf(syscall.EACCES, "export %s does not allow client %s", e.Name, strings.Join(peer, ", "))
	case mode > most:
		return false, errorf(syscall.EACCES, "export %s allows client %s only %s", e.Name, x.rtrs.Identity(), most)
	}
	if e.ReadOnly && mode != AccessRO {
		return false, errorf(syscall.EPERM, "export %s is read-only", e.Name)
	}
	if len(e.AllowIdentities) > 0 {
		return most == AccessMigration, nil
	}
	return e.Migration, nil
}

func (e *Export) allows(sess string) bool {
	if len(e.Allow) == 0 {
		return true
	}
	for _, a := range e.Allow {
		if a == sess {
			return true
		}
	}
	return false
}

// ServerConfig configures the RNBD server.
type ServerConfig struct {
	// DevSearchPath resolves device names that are not explicit exports,
	// as the kernel's dev_search_path: the name is opened beneath it. It
	// may contain %SESSNAME%, which selects a directory per session (the
	// part of the path after the token is dropped, as in the kernel).
	// Empty: only explicit exports are served.
	DevSearchPath string
	// AllowMigration lets devices found under DevSearchPath be opened
	// with access_mode=migration beside a writer, as the kernel's server
	// does; off (the default) such an OPEN is refused while another
	// session writes.
	AllowMigration bool
	// SearchAllowFrom and SearchAllowIdentities are, for every device
	// found under DevSearchPath, what an explicit export's AllowFrom and
	// AllowIdentities are for it: the networks an OPEN may come from,
	// and the client identities that may open (and for what). Empty:
	// any, as the kernel's server.
	SearchAllowFrom       []netip.Prefix
	SearchAllowIdentities []Grant
	// Direct opens backends with O_DIRECT.
	Direct bool
	// HealthInterval is how often the open backends are checked for
	// what can happen behind the server's back (a file deleted,
	// replaced or shrunk: blockdev.Health); a change is logged. A
	// file's shrink is also seen by the size polls of our clients
	// (blockdev.PollSize), whichever comes first: IO past the file's
	// end fails from then on. Default 10 s; negative: never.
	HealthInterval time.Duration
	// Workers bounds the backend IO running at once (default 128).
	Workers int
	// MaxIOSize is the transport's largest IO (the RTRS chunk minus its
	// header room); OPEN_RSP never announces more.
	MaxIOSize int
	// BindSessionNames binds a session name to the client identity whose
	// session is first admitted with it (an OPEN that succeeded) and
	// refuses it to others (srv_names.go); only meaningful where clients
	// are authenticated (TLS).
	BindSessionNames bool
	// OwnersChanged, if set, is told when a session name is bound to an
	// identity (srv_names.go), to save SessionOwners; it is called on
	// the path of an OPEN and must not block.
	OwnersChanged func()
	// NameHeld, if set, says whether a transport session has a name,
	// once the namings under way are done (rtrs.Server.NameHeld):
	// ForgetSessionName asks it for a session that took the name
	// before it shows among Sessions.
	NameHeld func(name string) bool
	// Stat is how Map and Resize look at an export's path: os.Stat if
	// nil. The daemon bounds it, as a path on a mount that does not
	// answer never returns.
	Stat func(path string) (os.FileInfo, error)
	// Answers, if set, says before an OPEN opens an export's file — and
	// before a size poll of an open device asks its backend — whether
	// the export's path answers: an error wrapping ETIMEDOUT fails the
	// OPEN with it at once, where the open would wait on a mount that
	// does not answer, and the client's map or admin queue with it. The
	// daemon bounds it (longer than Stat: a slow mount still opens) and
	// answers nil where it cannot look.
	Answers func(path string) error
	Log     *log.Entry
}

// Server is the RNBD server: the user of an RTRS server. It is safe for
// concurrent use.
type Server struct {
	cfg ServerConfig
	log *log.Entry
	rl  log.Limiter
	ios chan *rtrs.SrvOp

	// mu guards exports, sessions and devices. Lock order: Session.mu,
	// then Server.mu, then device.mu; never take a Session.mu while
	// holding Server.mu (snapshot the sessions instead).
	mu       sync.Mutex
	exports  map[string]*Export
	sessions map[*rtrs.SrvSession]*SrvSession
	devices  map[string]*device // by backend identity
	// exportOpens counts the sessions that have each explicit export
	// open, or are opening it (Export.MaxSessions).
	exportOpens map[string]int
	// resizes are the resizes of files under way, by backend ID;
	// resizeSeq names the last one's caps.
	resizes   map[string]resizing
	resizeSeq uint64

	// shrinks counts the shrinks of backing files seen behind the
	// server's back, by device name (the export's, or the name under
	// the search path), under shrinkMu.
	shrinkMu sync.Mutex
	shrinks  map[string]uint64

	// ownMu guards owners: session name → the identity it is bound to.
	ownMu  sync.Mutex
	owners map[string]string

	closed atomic.Bool
	done   chan struct{} // closed by Close: stops the health checks
	wg     sync.WaitGroup

	// inline counts IO answered on the receive path (tryInline), lent
	// the reads among them sent from the backend's mapping.
	inline, lent atomic.Uint64

	// beforeIO, if set, runs when an IO holds its device, before the
	// backend sees it (tests hold IO in flight with it).
	beforeIO func()
	// afterOpen, if set, runs when a backend was opened for an OPEN,
	// before the device joins its session (tests).
	afterOpen func()
	// beforeJoin, if set, runs between a backend's open for an OPEN and
	// its join to the server's devices.
	beforeJoin func()
}

// NewServer returns an RNBD server; pass it as the RTRS server's handler.
func NewServer(cfg ServerConfig) *Server {
	if cfg.Workers <= 0 {
		cfg.Workers = 128
	}
	if cfg.MaxIOSize <= 0 {
		cfg.MaxIOSize = rtrs.DefaultMaxChunkSize - rtrs.MaxHdrSize
	}
	if cfg.Log == nil {
		cfg.Log = log.L
	}
	s := &Server{
		cfg:         cfg,
		log:         cfg.Log,
		ios:         make(chan *rtrs.SrvOp, 4096),
		done:        make(chan struct{}),
		exports:     make(map[string]*Export),
		sessions:    make(map[*rtrs.SrvSession]*SrvSession),
		devices:     make(map[string]*device),
		exportOpens: make(map[string]int),
		resizes:     make(map[string]resizing),
		shrinks:     make(map[string]uint64),
		owners:      make(map[string]string),
	}
	for i := 0; i < cfg.Workers; i++ {
		s.wg.Add(1)
		go s.worker()
	}
	if cfg.HealthInterval == 0 {
		cfg.HealthInterval = 10 * time.Second
	}
	if cfg.HealthInterval > 0 {
		s.wg.Add(1)
		go s.healthLoop(cfg.HealthInterval)
	}
	return s
}

// healthLoop checks the open backends every interval until Close.
func (s *Server) healthLoop(interval time.Duration) {
	defer s.wg.Done()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-s.done:
			return
		case <-t.C:
			s.checkHealth()
		}
	}
}

// checkHealth starts, for each open device, a check that logs a problem
// that appeared or went away since the last one. Each check runs in a
// goroutine of its own, on a descriptor of its own (blockdev.HealthCheck):
// a stat on a mount that stopped answering holds neither the checks of
// the other devices nor the close of its own. A device whose check from
// an earlier round has not returned is not checked again; that it hangs
// is the problem reported. Close does not wait for the checks: one may
// wait on a dead mount for ever (it holds a descriptor and a thread, and
// logs when it returns).
func (s *Server) checkHealth() {
	s.mu.Lock()
	devs := make([]*device, 0, len(s.devices))
	for _, d := range s.devices {
		devs = append(devs, d)
	}
	s.mu.Unlock()
	for _, dev := range devs {
		dev.mu.Lock()
		if since := dev.checking; !since.IsZero() {
			dev.mu.Unlock()
			s.noteHealth(dev, fmt.Errorf("blockdev: %s: no answer to its health check since %s (a mount that does not answer?)",
				dev.path, since.Format(time.RFC3339)))
			continue
		}
		var held *SrvSessDev
		for _, d := range dev.sessDevs {
			d.mu.Lock()
			if !d.closing {
				d.refs.Add(1) // as an IO does: the backend stays open
				held = d
			}
			d.mu.Unlock()
			if held != nil {
				break
			}
		}
		if held == nil {
			dev.mu.Unlock()
			continue
		}
		hc, err := held.backend.NewHealthCheck()
		held.refs.Done()
		if err == nil {
			dev.checking = time.Now()
		}
		dev.mu.Unlock()
		if err != nil {
			s.noteHealth(dev, err)
			continue
		}
		go func() {
			err := hc.Run()
			dev.mu.Lock()
			dev.checking = time.Time{}
			shrunk := dev.shrunk
			dev.mu.Unlock()
			var se *blockdev.ShrinkError
			if errors.As(err, &se) || shrunk {
				// The file's backends refuse IO past its end
				// from now on, or serve it again. What they
				// find is the later look: a shrink healed
				// since (a resize --force) is not one.
				if perr, ok := s.pollSizes(dev); ok && se != nil {
					err = perr
				}
			}
			s.noteHealth(dev, err)
		}()
	}
}

// pollSizes polls the size of every backend open on dev (PollSize) and
// returns the first shrink one found, nil if none; ok if one answered.
func (s *Server) pollSizes(dev *device) (shrink error, ok bool) {
	var held []*SrvSessDev
	dev.mu.Lock()
	for _, d := range dev.sessDevs {
		if d.ref() {
			held = append(held, d)
		}
	}
	dev.mu.Unlock()
	for _, d := range held {
		_, _, err := d.backend.PollSize()
		d.refs.Done()
		var se *blockdev.ShrinkError
		switch {
		case err == nil:
			ok = true
		case errors.As(err, &se):
			ok = true
			if shrink == nil {
				shrink = err
			}
		}
	}
	return shrink, ok
}

// noteHealth records a device's health check and logs a change.
func (s *Server) noteHealth(dev *device, err error) { s.note(dev, err, false) }

// noteSize records what a look at a device's size found: a shrink
// behind the server's back (a *blockdev.ShrinkError, as the health check
// finds it), or nil, which ends a shrink recorded and nothing else (it
// looked at the size only).
func (s *Server) noteSize(dev *device, err error) { s.note(dev, err, true) }

// note records a finding about a device's backing store and logs a
// change, once: a shrink is counted. With sizeOnly the finding is about
// its size only, and replaces no other problem.
func (s *Server) note(dev *device, err error, sizeOnly bool) {
	msg := ""
	if err != nil {
		msg = err.Error()
	}
	var se *blockdev.ShrinkError
	shrink := errors.As(err, &se)
	dev.mu.Lock()
	if sizeOnly && dev.problem != "" && !dev.shrunk {
		dev.mu.Unlock() // deleted, replaced, no answer: the health check's to say
		return
	}
	changed := msg != dev.problem
	dev.problem, dev.shrunk = msg, shrink
	var names []string
	if changed && shrink {
		for _, d := range dev.sessDevs {
			if n := d.devName(); !slices.Contains(names, n) {
				names = append(names, n)
			}
		}
	}
	dev.mu.Unlock()
	if len(names) > 0 {
		s.shrinkMu.Lock()
		for _, n := range names {
			s.shrinks[n]++
		}
		s.shrinkMu.Unlock()
	}
	switch {
	case changed && err != nil:
		s.log.WithField("path", dev.path).WithError(err).Error("backing store changed behind the server")
	case changed:
		s.log.WithField("path", dev.path).Info("backing store healthy again")
	}
}

// BackingShrinks counts the shrinks of backing files seen behind the
// server's back since it started, by device name: the export's, or the
// name under the search path.
func (s *Server) BackingShrinks() map[string]uint64 {
	s.shrinkMu.Lock()
	defer s.shrinkMu.Unlock()
	out := make(map[string]uint64, len(s.shrinks))
	for n, c := range s.shrinks {
		out[n] = c
	}
	return out
}

// Close stops the workers. The RTRS server must be closed first, so that
// no request is in flight.
func (s *Server) Close() {
	if s.closed.Swap(true) {
		return
	}
	close(s.done)
	close(s.ios)
	s.wg.Wait()
}

// device is one backing store, whichever names it is opened by: the
// writers of all sessions are counted here (struct rnbd_srv_dev).
type device struct {
	id   string // backend identity
	path string

	mu           sync.Mutex
	openWriteCnt int
	sessDevs     []*SrvSessDev
	problem      string    // the last health check's finding
	shrunk       bool      // problem is a shrink (blockdev.ShrinkError)
	checking     time.Time // when the health check under way began
}

// SrvSession is a client session (struct rnbd_srv_session).
type SrvSession struct {
	srv  *Server
	rtrs *rtrs.SrvSession
	name string
	ver  atomic.Uint32

	// mu guards devs, nextID and opening.
	mu      sync.Mutex
	devs    map[uint32]*SrvSessDev // a nil value is an id kept after force_close
	nextID  uint32
	opening map[string]bool // device names whose open is under way
}

// Name is the session's name.
func (x *SrvSession) Name() string { return x.name }

// SrvSessDev is a device opened by a session (struct rnbd_srv_sess_dev).
type SrvSessDev struct {
	sess     *SrvSession
	dev      *device
	id       uint32
	name     string  // the name the client opened
	export   string  // the export it resolved to, if explicit
	from     *Export // that export, as the server had it at the open
	path     string  // and its path
	access   AccessMode
	readonly bool
	backend  *blockdev.Backend

	// rdSect and wrSect count the sectors read and written; the others
	// count what reached the backend: flushes (explicit or before a
	// write), FUA writes, discards and write-zeroes.
	rdSect, wrSect                  atomic.Uint64
	reads, writes                   atomic.Uint64
	flushes, fuas, discards, wzeros atomic.Uint64
	// inflight counts the requests running on the backend now.
	inflight atomic.Int64

	// refs counts IO in flight plus one for being open; closing waits
	// for it to drain.
	refs    sync.WaitGroup
	mu      sync.Mutex
	closing bool
}

// LinkEvent creates the RNBD session when the first path of an RTRS
// session is up, and closes all of its devices when the last goes down.
func (s *Server) LinkEvent(rs *rtrs.SrvSession, ev rtrs.SrvLinkEvent) error {
	switch ev {
	case rtrs.SrvLinkConnected:
		x := &SrvSession{srv: s, rtrs: rs, name: rs.Name(), devs: make(map[uint32]*SrvSessDev)}
		x.ver.Store(ProtoVerMajor)
		s.mu.Lock()
		s.sessions[rs] = x
		s.mu.Unlock()
		rs.SetPriv(x)
		s.log.WithField("session", x.name).Info("session connected")
	case rtrs.SrvLinkDisconnected:
		s.mu.Lock()
		x := s.sessions[rs]
		delete(s.sessions, rs)
		s.mu.Unlock()
		if x == nil {
			return nil
		}
		x.mu.Lock()
		var devs []*SrvSessDev
		for _, d := range x.devs {
			if d != nil {
				devs = append(devs, d)
			}
		}
		x.devs = nil
		x.mu.Unlock()
		for _, d := range devs {
			d.close()
		}
		s.log.WithFields(log.Fields{"session": x.name, "devices": len(devs)}).Info("session disconnected: devices closed")
	}
	return nil
}

// HandleIO takes a request from RTRS, on the connection's receive path.
// A read or write that cannot block (blockdev's TryReadAt/TryWriteAt) runs
// right here: that costs a memory copy, where a hand-off to a worker costs
// a goroutine switch. Everything else runs on the workers: closing waits
// for IO and backend IO may block.
func (s *Server) HandleIO(op *rtrs.SrvOp) error {
	if s.closed.Load() {
		return syscall.ESHUTDOWN
	}
	typ, err := MsgType(op.Usr()) // serve refuses what is short
	if err == nil && typ == MsgIO && s.tryInline(op) {
		return nil
	}
	if err == nil && typ == MsgOpen {
		// An OPEN opens a file, which on a mount that stopped
		// answering never returns: not on a worker, which the IO of
		// every session needs. (In flight at once: a session's
		// queue depth, as for any request.)
		s.serveApart(op)
		return nil
	}
	select {
	case s.ios <- op:
	default:
		// Every worker busy and the queue full: do not stall the
		// connection's receive path.
		s.serveApart(op)
	}
	return nil
}

// serveApart serves op on a goroutine of its own.
func (s *Server) serveApart(op *rtrs.SrvOp) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.serve(op)
	}()
}

func (s *Server) worker() {
	defer s.wg.Done()
	for op := range s.ios {
		s.serve(op)
	}
}

func (s *Server) serve(op *rtrs.SrvOp) {
	x, _ := op.Session().Priv().(*SrvSession)
	if x == nil {
		s.rl.Log(s.log.WithField("session", op.Session().Name()), log.WarnLevel, "request refused: the session is not connected")
		op.Respond(syscall.ENOTCONN)
		return
	}
	typ, err := MsgType(op.Usr())
	if err != nil {
		op.Respond(x.refuse(msgFields(op), refuse(syscall.EINVAL, "message of %d bytes has no RNBD header", len(op.Usr()))))
		return
	}
	switch typ {
	case MsgIO:
		op.Respond(x.processIO(op))
	case MsgOpen:
		op.Respond(x.processOpen(op))
	case MsgSessInfo:
		op.Respond(x.processSessInfo(op))
	case MsgClose:
		op.Respond(x.processClose(op))
	default:
		op.Respond(x.refuse(msgFields(op), refuse(syscall.EINVAL, "message type %d is not one a client sends", typ)))
	}
}

// processSessInfo answers SESS_INFO with min(client, our) version; the
// answer goes into the read buffer of the request.
func (x *SrvSession) processSessInfo(op *rtrs.SrvOp) error {
	var m SessInfo
	if err := m.Decode(op.Usr(), MsgSessInfo); err != nil {
		return x.refuse(msgFields(op), refuse(syscall.EINVAL, "malformed SESS_INFO: %v", err))
	}
	if op.Dir() != rtrs.Read || len(op.Data()) < SessInfoRspSize {
		return x.refuse(msgFields(op), refuse(syscall.EINVAL, "SESS_INFO without a buffer for its answer"))
	}
	v := min(m.Ver, ProtoVerMajor)
	x.ver.Store(uint32(v))
	(&SessInfo{Ver: v}).Encode(op.Data(), MsgSessInfoRsp)
	return nil
}

// processClose closes a device the session opened, after its IO drained.
func (x *SrvSession) processClose(op *rtrs.SrvOp) error {
	var m Close
	if err := m.Decode(op.Usr()); err != nil {
		return x.refuse(msgFields(op), refuse(syscall.EINVAL, "malformed CLOSE: %v", err))
	}
	x.mu.Lock()
	d := x.devs[m.DeviceID]
	if d != nil {
		delete(x.devs, m.DeviceID)
	}
	x.mu.Unlock()
	if d == nil {
		return nil // already closed, or force-closed: nothing to do
	}
	d.close()
	return nil
}

// processOpen opens (or finds) a device for the session (process_msg_open).
func (x *SrvSession) processOpen(op *rtrs.SrvOp) error {
	var m Open
	if err := m.Decode(op.Usr()); err != nil {
		return x.refuse(msgFields(op), refuse(syscall.EINVAL, "malformed OPEN: %v", err))
	}
	if op.Dir() != rtrs.Read || len(op.Data()) < OpenRspSize {
		return x.refuse(msgFields(op), refuse(syscall.EINVAL, "OPEN without a buffer for its answer"))
	}
	if m.AccessMode > AccessMigration {
		return x.refuse(msgFields(op), refuse(syscall.EINVAL, "OPEN of %s with access mode %d", m.DevName, m.AccessMode))
	}
	// The backend's open and its size refresh are file system calls,
	// which on a mount that stops answering never return: they run
	// without x.mu, which every IO of the session takes (get).
	x.mu.Lock()
	if x.devs == nil {
		x.mu.Unlock()
		return syscall.ENOTCONN // the session is going
	}
	for _, d := range x.devs {
		if d != nil && d.name == m.DevName {
			// The kernel answers with the open device whatever the
			// mode; a writer must not get a device it cannot write.
			if d.readonly && m.AccessMode != AccessRO {
				x.mu.Unlock()
				err := errorf(syscall.EPERM, "%s is open read-only by this session; close it to reopen it %v", m.DevName, m.AccessMode)
				x.srv.rl.Log(x.log().WithError(err), log.WarnLevel, "open refused")
				return err
			}
			if !d.ref() { // (close takes it out of devs first)
				x.mu.Unlock()
				return errorf(syscall.ENOTCONN, "%s is being closed", m.DevName)
			}
			x.mu.Unlock()
			defer d.refs.Done()
			// A remap, or our client asking after the size (it does
			// every few seconds): answer with the size the backend has
			// now, grown since — if its mount answers (the file
			// renamed or removed is still the device's). A file cut
			// behind the server's back is not a resize: the size
			// stays, the shrink is an error (logged, counted), and IO
			// past the file's end fails.
			if err := x.srv.answers(d.export, d.path); err != nil {
				return err
			}
			was, now, err := d.backend.PollSize()
			if se := (*blockdev.ShrinkError)(nil); err == nil || errors.As(err, &se) {
				x.srv.noteSize(d.dev, err)
			}
			if was != now {
				x.log().WithFields(log.Fields{"device": d.name, "was": was, "now": now}).Info("device size changed")
			}
			x.fillOpenRsp(d, op.Data())
			return nil
		}
	}
	if x.opening[m.DevName] {
		x.mu.Unlock()
		return errorf(syscall.EBUSY, "%s is being opened by this session", m.DevName)
	}
	if x.opening == nil {
		x.opening = map[string]bool{}
	}
	x.opening[m.DevName] = true
	x.mu.Unlock()
	d, err := x.srv.open(x, m.DevName, m.AccessMode, op.Path().ClientAddr().Addr())
	if h := x.srv.afterOpen; h != nil && err == nil {
		h()
	}
	x.mu.Lock()
	delete(x.opening, m.DevName)
	if err != nil {
		x.mu.Unlock()
		x.srv.rl.Log(x.log().WithFields(log.Fields{"device": m.DevName, "access_mode": m.AccessMode}).WithError(err),
			log.WarnLevel, "open refused")
		return err
	}
	if x.devs == nil {
		x.mu.Unlock()
		d.close()
		return errorf(syscall.ENOTCONN, "the session closed while %s was being opened", m.DevName)
	}
	if !x.srv.stillExported(d) {
		// Unmapped (or mapped anew) while it was being opened: Unmap
		// looks for the devices to close among devs, where this one
		// is not yet. Once it is, under x.mu, Unmap finds it.
		x.mu.Unlock()
		d.close()
		return errorf(syscall.ENOENT, "export %s was withdrawn while %s was being opened", d.export, m.DevName)
	}
	// The session is admitted: its name binds to its identity now, not
	// when it connected (srv_names.go).
	if err := x.srv.admitName(x.name, x.rtrs.Identity()); err != nil {
		x.mu.Unlock()
		d.close()
		return err
	}
	for {
		x.nextID++
		if _, used := x.devs[x.nextID]; !used && x.nextID != 0 {
			break
		}
	}
	d.id = x.nextID
	x.devs[d.id] = d
	x.fillOpenRsp(d, op.Data())
	x.mu.Unlock()
	x.log().WithFields(log.Fields{"device": d.name, "path": d.backend.Path(), "device_id": d.id, "access_mode": d.access}).Info("device opened")
	return nil
}

func (x *SrvSession) log() *log.Entry { return x.srv.log.WithField("session", x.name) }

func (x *SrvSession) fillOpenRsp(d *SrvSessDev, b []byte) {
	be := d.backend
	c := be.Caps()
	maxIO := uint32(min(int(c.MaxIOBytes), x.srv.cfg.MaxIOSize))
	rsp := OpenRsp{
		DeviceID:          d.id,
		NSectors:          uint64(be.Size()) / 512,
		MaxHWSectors:      maxIO / 512,
		PhysicalBlockSize: uint16(be.PhysicalBlockSize()),
		LogicalBlockSize:  uint16(be.LogicalBlockSize()),
		MaxSegments:       c.MaxSegments,
	}
	if !d.readonly {
		rsp.MaxWriteZeroesSectors = uint32(min(c.MaxWriteZeroesBytes/512, 1<<31))
		if c.Discard {
			rsp.MaxDiscardSectors = uint32(min(c.MaxDiscardBytes/512, 1<<31))
			rsp.DiscardGranularity = c.DiscardGranularity
			rsp.DiscardAlignment = c.DiscardAlignment
		}
		if c.SecureErase {
			rsp.SecureDiscard = 1
		}
	}
	if c.WriteCache {
		rsp.CachePolicy |= CacheWriteback
	}
	if c.FUA {
		rsp.CachePolicy |= CacheFUA
	}
	rsp.Encode(b)
}

// open resolves name for session x, opens the backend and takes the
// access mode on its device. x.mu is not held: the open may take long.
func (s *Server) open(x *SrvSession, name string, mode AccessMode, from netip.Addr) (*SrvSessDev, error) {
	readonly := mode == AccessRO
	opts := blockdev.Options{ReadOnly: readonly, Direct: s.cfg.Direct}
	s.mu.Lock()
	var exp, orig *Export
	if e := s.exports[name]; e != nil && !e.withdrawing {
		c := *e
		exp, orig = &c, e
		opts.WriteThrough = exp.WriteThrough
		if exp.MaxSessions > 0 && s.exportOpens[name] >= exp.MaxSessions {
			s.mu.Unlock()
			return nil, errorf(syscall.EUSERS, "export %s is open by %d sessions, its max_sessions", name, exp.MaxSessions)
		}
		s.exportOpens[name]++ // until the open fails or the device closes
	}
	s.mu.Unlock()
	opened := false
	defer func() {
		if exp != nil && !opened {
			s.exportClosed(exp.Name)
		}
	}()
	var be *blockdev.Backend
	var err error
	var secondWriter bool
	switch {
	case exp != nil:
		if secondWriter, err = exp.admit(x, mode, from); err != nil {
			return nil, err
		}
		if err = s.answers(exp.Name, exp.Path); err == nil {
			be, err = blockdev.Open(exp.Path, opts)
		}
	case s.cfg.DevSearchPath != "":
		// Every device there has the same rules.
		rules := Export{Name: name, AllowFrom: s.cfg.SearchAllowFrom, AllowIdentities: s.cfg.SearchAllowIdentities,
			Migration: s.cfg.AllowMigration}
		if secondWriter, err = rules.admit(x, mode, from); err != nil {
			return nil, err
		}
		var dir string
		if dir, err = s.searchDir(x.name, name); err == nil {
			be, err = blockdev.OpenBeneath(dir, name, opts)
		}
	default:
		return nil, errorf(syscall.ENOENT, "no export %s", name)
	}
	if err != nil {
		if errors.Is(err, blockdev.ErrEscapes) {
			s.log.WithFields(log.Fields{"session": x.name, "device": name}).Warn("device name leads out of the search path: refused")
		}
		return nil, err
	}
	d := &SrvSessDev{sess: x, name: name, access: mode, readonly: readonly, backend: be}
	if exp != nil {
		d.export, d.from, d.path = exp.Name, orig, exp.Path
	}
	d.refs.Add(1) // open
	if h := s.beforeJoin; h != nil {
		h()
	}
	if err := s.takeDevice(d, secondWriter); err != nil {
		be.Close()
		return nil, err
	}
	// The size again, now that the device is joined: a resize that cut
	// the file after the backend read its size, and ended before the
	// join (which would have capped it), is seen here, before any IO.
	opened = true // from here d.close uncounts the export
	if _, _, err := be.Refresh(); err != nil {
		// Its size from the open may be from before a cut.
		d.close()
		return nil, fmt.Errorf("reading the size of %s: %w", name, err)
	}
	return d, nil
}

// searchDir is rnbd_srv_get_full_path: the directory a name is resolved
// beneath. Names with ".." are refused outright, as the kernel does, and
// OpenBeneath refuses every other way out (symlinks, absolute jumps).
func (s *Server) searchDir(sess, name string) (string, error) {
	if strings.Contains(name, "..") {
		return "", errorf(syscall.EINVAL, "device name %q contains ..", name)
	}
	sp := s.cfg.DevSearchPath
	dir := sp
	if i := strings.Index(sp, "%SESSNAME%"); i >= 0 {
		if strings.ContainsAny(sess, "/.") || sess == "" {
			return "", errorf(syscall.EINVAL, "session name %q cannot select a directory", sess)
		}
		dir = filepath.Join(sp[:i], sess)
	}
	if len(dir)+1+len(name) >= pathMax {
		return "", errorf(syscall.EINVAL, "device path of %q is longer than PATH_MAX", name)
	}
	return dir, nil
}

// takeDevice finds the device behind d's backend, applies the access mode
// rules (rnbd_srv_check_update_open_perm: ro always, rw only with no
// writer, migration with at most one) and adds d to its sessions.
func (s *Server) takeDevice(d *SrvSessDev, secondWriter bool) error {
	be, mode := d.backend, d.access
	s.mu.Lock()
	defer s.mu.Unlock()
	dev := s.devices[be.ID()]
	if dev == nil {
		dev = &device{id: be.ID(), path: be.Path()}
		s.devices[dev.id] = dev
	}
	dev.mu.Lock()
	defer dev.mu.Unlock()
	switch mode {
	case AccessRO:
	case AccessRW:
		if dev.openWriteCnt != 0 {
			return errorf(syscall.EPERM, "%s is open for writing by another session", be.Path())
		}
		dev.openWriteCnt++
	case AccessMigration:
		if dev.openWriteCnt >= 2 {
			return errorf(syscall.EPERM, "%s is open for writing by %d sessions already", be.Path(), dev.openWriteCnt)
		}
		if dev.openWriteCnt == 1 && !secondWriter {
			// The kernel's server lets it: then anyone who reaches
			// the port could write beside the device's writer.
			return errorf(syscall.EPERM, "%s is open for writing by another session, and a second writer "+
				"(access_mode=migration) is not allowed here", be.Path())
		}
		dev.openWriteCnt++
	}
	if r, ok := s.resizes[dev.id]; ok && r.shrink {
		// A shrink of the file is under way: this backend, opened
		// before or after the cut, serves no more than the new size
		// until endResize. It has no writes to wait for (and nobody
		// else has it: its locks are free).
		be.Cap(r.size, 0, r.owner)
	}
	// Joined under s.mu: a close of the device's last other session
	// must not take it out of s.devices while this one is on its way.
	d.dev = dev
	dev.sessDevs = append(dev.sessDevs, d)
	return nil
}

// close waits for the device's IO, then releases it (rnbd_destroy_sess_dev).
// The caller has already taken it out of its session's table.
func (d *SrvSessDev) close() {
	d.mu.Lock()
	if d.closing {
		d.mu.Unlock()
		return
	}
	d.closing = true
	d.mu.Unlock()
	d.refs.Done() // the open reference
	d.refs.Wait() // every IO has answered
	d.backend.Close()
	s := d.sess.srv
	s.mu.Lock()
	dev := d.dev
	dev.mu.Lock()
	if !d.readonly {
		dev.openWriteCnt--
	}
	for i, x := range dev.sessDevs {
		if x == d {
			dev.sessDevs = append(dev.sessDevs[:i:i], dev.sessDevs[i+1:]...)
			break
		}
	}
	if len(dev.sessDevs) == 0 {
		delete(s.devices, dev.id)
	}
	dev.mu.Unlock()
	s.mu.Unlock()
	if d.export != "" {
		s.exportClosed(d.export)
	}
	d.sess.log().WithFields(log.Fields{"device": d.name, "device_id": d.id}).Info("device closed")
}

// exportClosed uncounts a session of export name.
func (s *Server) exportClosed(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n := s.exportOpens[name]; n > 1 {
		s.exportOpens[name] = n - 1
	} else {
		delete(s.exportOpens, name)
	}
}

// get returns the open device id with an IO reference, or nil.
func (x *SrvSession) get(id uint32) *SrvSessDev {
	x.mu.Lock()
	defer x.mu.Unlock()
	d := x.devs[id]
	if d == nil || !d.ref() {
		return nil
	}
	return d
}

// stillExported says whether the export d was opened from is still
// served as it was (not withdrawn, nor replaced); true for a device of
// the search path. The caller holds d.sess.mu (lock order).
func (s *Server) stillExported(d *SrvSessDev) bool {
	if d.from == nil {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.exports[d.export]
	return e == d.from && !e.withdrawing
}

// ref takes an IO reference on d, unless it is closing.
func (d *SrvSessDev) ref() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closing {
		return false
	}
	d.refs.Add(1)
	return true
}

// Map adds an explicit export. Paths are checked when a session opens them.
func (s *Server) Map(e Export) error {
	if e.Name == "" || len(e.Name) >= nameMax || strings.IndexByte(e.Name, 0) >= 0 {
		return errorf(syscall.EINVAL, "export name %q: want 1..254 bytes without NUL", e.Name)
	}
	if !filepath.IsAbs(e.Path) {
		return errorf(syscall.EINVAL, "export path %q must be absolute", e.Path)
	}
	if e.MaxSessions < 0 {
		return errorf(syscall.EINVAL, "export %s: max_sessions %d", e.Name, e.MaxSessions)
	}
	e.AllowIdentities = slices.Clone(e.AllowIdentities)
	for _, g := range e.AllowIdentities {
		if _, err := ParseAccessMode(g.Access); err != nil || g.Identity == "" {
			return errorf(syscall.EINVAL, "export %s: allow_identities entry %q: want an identity and ro, rw or migration", e.Name, g.String())
		}
	}
	if err := s.lookAt(e.Name, e.Path); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.exports[e.Name]; ok {
		return errorf(syscall.EEXIST, "export %s already exists", e.Name)
	}
	e.Allow = append([]string(nil), e.Allow...)
	e.AllowFrom = append([]netip.Prefix(nil), e.AllowFrom...)
	for i, p := range e.AllowFrom {
		if !p.IsValid() {
			return errorf(syscall.EINVAL, "export %s: invalid network in allow_from", e.Name)
		}
		e.AllowFrom[i] = p.Masked()
	}
	s.exports[e.Name] = &e
	return nil
}

// Unmap withdraws an export. Without force it refuses while a session has
// it open; with force it closes it for every session, keeping their device
// ids reserved so their later IO fails with ENOTCONN.
func (s *Server) Unmap(name string, force bool) error {
	s.mu.Lock()
	e := s.exports[name]
	if e == nil || e.withdrawing {
		s.mu.Unlock()
		return errorf(syscall.ENOENT, "no export %s", name)
	}
	e.withdrawing = true // opens from now on fail; those under way finish
	s.mu.Unlock()
	open := s.collect(func(d *SrvSessDev) bool { return d.export == name })
	s.mu.Lock()
	if len(open) > 0 && !force {
		e.withdrawing = false
		s.mu.Unlock()
		return errorf(syscall.EBUSY, "export %s is open by %d session(s); --force closes it for them", name, len(open))
	}
	delete(s.exports, name)
	s.mu.Unlock()
	for _, d := range open {
		d.forceClose()
	}
	return nil
}

// Resize sets the size of an exported file (rnbd-server resize) and
// serves it at once to the sessions that have it open; our clients learn
// it within their size poll (rnbd.DefaultSizePoll), the kernel's on their
// next remap. Shrinking a file that a session has open, by any name, is
// refused (EBUSY) unless force: the part cut off may hold what they
// wrote. A forced shrink refuses writes past the new size at once and
// waits for those in flight before it cuts (EBUSY, nothing cut, if they
// do not end in shrinkWait), so none grows the file again. One resize of
// a file runs at a time (EBUSY for another). A block device cannot be
// resized here (EOPNOTSUPP): resize it
// (lvextend, …) and clients learn its new size the same way.
func (s *Server) Resize(name string, size int64, force bool) (was int64, err error) {
	s.mu.Lock()
	e := s.exports[name]
	var path string
	if e != nil && !e.withdrawing {
		path = e.Path
	}
	s.mu.Unlock()
	if path == "" {
		return 0, errorf(syscall.ENOENT, "no export %s", name)
	}
	if size <= 0 || size%512 != 0 {
		return 0, errorf(syscall.EINVAL, "size %d: want a positive multiple of 512", size)
	}
	st, err := s.statExport(name, path) // bounded in the daemon: the mount may not answer
	if err != nil {
		return 0, err
	}
	if !st.Mode().IsRegular() {
		return 0, errorf(syscall.EOPNOTSUPP, "export %s is not a regular file: resize a block device with its own tools (lvextend, …), and its clients learn the new size", name)
	}
	// The file itself from here: a path renamed over meanwhile must not
	// be cut under the sessions of the file counted below.
	f, err := os.OpenFile(path, os.O_WRONLY|syscall.O_NONBLOCK, 0) // a FIFO put there: ENXIO, not a wait
	if err != nil {
		return 0, fmt.Errorf("export %s: %w", name, err)
	}
	defer f.Close()
	if st, err = f.Stat(); err != nil {
		return 0, fmt.Errorf("export %s: %w", name, err)
	}
	if !st.Mode().IsRegular() {
		return 0, errorf(syscall.EOPNOTSUPP, "export %s is not a regular file", name)
	}
	// Who has the file open: through this export, or through any other
	// name of it (the search path).
	id, ok := blockdev.FileID(st)
	if !ok {
		return st.Size(), fmt.Errorf("export %s: no identity from its stat", name)
	}
	s.mu.Lock()
	if _, busy := s.resizes[id]; busy {
		s.mu.Unlock()
		return st.Size(), errorf(syscall.EBUSY, "export %s: another resize of its file is under way", name)
	}
	s.resizeSeq++
	r := resizing{size: size, owner: s.resizeSeq}
	s.resizes[id] = r // the file's only resize from here
	s.mu.Unlock()
	// Its size now, with no other resize of it under way: the one
	// before may have changed it since the stat above.
	if st, err = f.Stat(); err != nil {
		s.endResize(id, r, false)
		return 0, fmt.Errorf("export %s: %w", name, err)
	}
	was = st.Size()
	s.mu.Lock()
	open, closing := s.openOn(id)
	// Devices closing too: they wait for IO they admitted.
	all := append(slices.Clip(open), closing...)
	// A shrink from what the sessions are served, too: the file may
	// have shrunk behind the server's back.
	r.shrink = size < was
	for _, d := range all {
		r.shrink = r.shrink || d.backend.Size() > size
	}
	if r.shrink && len(open) > 0 && !force {
		s.mu.Unlock()
		s.endResize(id, r, false)
		return was, errorf(syscall.EBUSY, "export %s is open %d time(s), by %s: shrinking it from %d to %d bytes cuts off what they may have written; --force does it anyway", name, len(open), sessionNames(open), was, size)
	}
	// From here a device opened on the file joins capped (takeDevice),
	// and endResize sets it right.
	s.resizes[id] = r
	s.mu.Unlock()
	if r.shrink {
		// Writes the sessions have in flight, checked against the old
		// size, would land past the cut and grow the file again: cap
		// every backend at the new size and let them end first.
		deadline := time.Now().Add(shrinkWait)
		for _, d := range all {
			if err := d.backend.Cap(size, time.Until(deadline), r.owner); err != nil {
				s.endResize(id, r, false)
				return was, errorf(syscall.EBUSY, "export %s: %v; nothing was cut", name, err)
			}
		}
	}
	if err := f.Truncate(size); err != nil {
		s.endResize(id, r, false)
		return was, fmt.Errorf("export %s: %w", name, err)
	}
	n := s.endResize(id, r, true)
	s.log.WithFields(log.Fields{"export": name, "path": path, "was": was, "now": size, "devices": n}).Info("export resized")
	return was, nil
}

// resizing is a resize of a file under way (Server.resizes); owner names
// its caps.
type resizing struct {
	shrink bool
	size   int64
	owner  uint64
}

// shrinkWait bounds how long a shrink waits, in all, for the writes in
// flight on the file's backends to end.
const shrinkWait = 10 * time.Second

// openOn returns the session devices on the backend id: those open, and
// those closing (which wait for the IO they admitted). s.mu is held.
// sessionNames names the sessions of devs for a message: "session a",
// "sessions a, b", each once, sorted.
func sessionNames(devs []*SrvSessDev) string {
	var names []string
	for _, d := range devs {
		if !slices.Contains(names, d.sess.name) {
			names = append(names, d.sess.name)
		}
	}
	slices.Sort(names)
	if len(names) == 1 {
		return "session " + names[0]
	}
	return "sessions " + strings.Join(names, ", ")
}

func (s *Server) openOn(id string) (open, closing []*SrvSessDev) {
	dev := s.devices[id]
	if dev == nil {
		return nil, nil
	}
	dev.mu.Lock()
	defer dev.mu.Unlock()
	for _, d := range dev.sessDevs {
		d.mu.Lock()
		if d.closing {
			closing = append(closing, d)
		} else {
			open = append(open, d)
		}
		d.mu.Unlock()
	}
	return open, closing
}

// endResize ends the resize r of file id: devices opened on it from now
// on are not capped, and every one open now (those that joined during it
// too) drops r's cap and serves the file's size — if the file was resized
// (done): else the size it served before, a shrink behind the server's
// back still an error, not made a resize by a resize refused. It returns
// how many there are.
func (s *Server) endResize(id string, r resizing, done bool) int {
	s.mu.Lock()
	delete(s.resizes, id)
	open, closing := s.openOn(id)
	dev := s.devices[id]
	s.mu.Unlock()
	for _, d := range closing {
		d.backend.Uncap(r.owner)
	}
	for _, d := range open {
		if r.shrink {
			d.backend.Uncap(r.owner) // nothing, if a later shrink took over
		}
		if !d.ref() {
			continue // closing since: its backend is, or is about to be
		}
		refresh := d.backend.Refresh
		if !done {
			refresh = d.backend.PollSize
		}
		var se *blockdev.ShrinkError
		if _, _, err := refresh(); err != nil && !errors.As(err, &se) {
			s.log.WithError(err).WithFields(log.Fields{"device": d.name, "session": d.sess.name}).Warn("refreshing the size")
		}
		d.refs.Done()
	}
	if done && dev != nil {
		// The size the file has is served: no shrink is left.
		s.noteSize(dev, nil)
	}
	return len(open)
}

// lookAt stats an export's path through cfg.Stat: an error if the path
// is gone or, with the daemon's bounded Stat, does not answer in time,
// and for what can never be served (unservable).
func (s *Server) lookAt(name, path string) error {
	fi, err := s.statExport(name, path)
	if err != nil || fi == nil { // (a test's Stat may say nothing)
		return err
	}
	return unservable(name, path, fi.Mode())
}

// unservable refuses a path that is no regular file or block device: a
// directory (EISDIR), a FIFO, a socket or a character device (EINVAL).
// Such an export would be accepted and every OPEN of it fail; the
// operator learns it at map, with the reason.
func unservable(name, path string, mode fs.FileMode) error {
	var what string
	switch {
	case mode.IsRegular(), mode&fs.ModeDevice != 0 && mode&fs.ModeCharDevice == 0:
		return nil
	case mode.IsDir():
		return errorf(syscall.EISDIR, "export %s: %s is a directory: an export is a regular file or a block device", name, path)
	case mode&fs.ModeNamedPipe != 0:
		what = "a FIFO"
	case mode&fs.ModeSocket != 0:
		what = "a socket"
	case mode&fs.ModeCharDevice != 0:
		what = "a character device"
	default:
		what = "not a regular file (" + mode.Type().String() + ")"
	}
	return errorf(syscall.EINVAL, "export %s: %s is %s: an export is a regular file or a block device", name, path, what)
}

// answers is cfg.Answers of an explicit export's path (path not empty):
// an error only for a path that does not answer (ETIMEDOUT). Any other
// finding — the file renamed or removed — is left to the open, or to the
// backend an open device already has.
func (s *Server) answers(name, path string) error {
	if s.cfg.Answers == nil || path == "" {
		return nil
	}
	if err := s.cfg.Answers(path); errors.Is(err, syscall.ETIMEDOUT) {
		return fmt.Errorf("export %s: %w", name, err)
	}
	return nil
}

func (s *Server) statExport(name, path string) (os.FileInfo, error) {
	stat := s.cfg.Stat
	if stat == nil {
		stat = os.Stat
	}
	fi, err := stat(path)
	if err != nil {
		return nil, fmt.Errorf("export %s: %w", name, err)
	}
	return fi, nil
}

// collect returns the open devices of every session that match; it takes
// each session's lock without holding the server's.
func (s *Server) collect(match func(*SrvSessDev) bool) []*SrvSessDev {
	var out []*SrvSessDev
	for _, x := range s.Sessions() {
		x.mu.Lock()
		for _, d := range x.devs {
			if d != nil && match(d) {
				out = append(out, d)
			}
		}
		x.mu.Unlock()
	}
	return out
}

// Exports lists the explicit exports, by name.
func (s *Server) Exports() []Export {
	s.mu.Lock()
	defer s.mu.Unlock()
	var es []Export
	for _, e := range s.exports {
		c := *e
		c.Allow = append([]string(nil), e.Allow...)
		c.AllowFrom = slices.Clone(e.AllowFrom)
		c.AllowIdentities = slices.Clone(e.AllowIdentities)
		es = append(es, c)
	}
	sort.Slice(es, func(i, j int) bool { return es[i].Name < es[j].Name })
	return es
}

// forceClose closes a session's device and keeps its id reserved
// (rnbd_srv_sess_dev_force_close).
func (d *SrvSessDev) forceClose() {
	x := d.sess
	x.mu.Lock()
	if x.devs != nil && x.devs[d.id] == d {
		x.devs[d.id] = nil
	}
	x.mu.Unlock()
	d.close()
}

// ForceClose closes device name for the named session, or for every
// session that has it open when session is empty. It returns how many
// were closed.
func (s *Server) ForceClose(name, session string) (int, error) {
	victims := s.collect(func(d *SrvSessDev) bool {
		return (session == "" || d.sess.name == session) && (d.name == name || d.export == name)
	})
	if len(victims) == 0 {
		return 0, errorf(syscall.ENOENT, "%s is not open by %s", name, orAll(session))
	}
	for _, d := range victims {
		d.forceClose()
	}
	return len(victims), nil
}

func orAll(session string) string {
	if session == "" {
		return "any session"
	}
	return "session " + session
}

// SessDevInfo describes a device a session has open.
type SessDevInfo struct {
	Session    string
	Name       string // as the client opened it
	Export     string // the explicit export, if any
	Path       string
	DeviceID   uint32
	AccessMode AccessMode
	ReadOnly   bool
	// ReadSectors and WrittenSectors count the device's IO, in 512-byte
	// sectors, since it was opened; Reads and Writes the requests that
	// carried data (a write without data is a flush).
	ReadSectors, WrittenSectors uint64
	Reads, Writes               uint64
	// Inflight is the requests running on the backend now.
	Inflight int64
	// Flushes, FUAWrites, Discards and WriteZeroes count those requests
	// since it was opened (a write with preflush counts as a flush too).
	Flushes, FUAWrites, Discards, WriteZeroes uint64
	// WriteCache is what OPEN_RSP announced: the backend has a volatile
	// write cache that clients flush.
	WriteCache bool
	// BackingProblem is what the health check or a size poll last found
	// wrong with the backing store (deleted, replaced, shrunk, no
	// answer); empty if nothing.
	BackingProblem string
}

// OpenDevices lists every device every session has open, by session and
// name.
func (s *Server) OpenDevices() []SessDevInfo {
	var out []SessDevInfo
	for _, d := range s.collect(func(*SrvSessDev) bool { return true }) {
		out = append(out, SessDevInfo{
			Session: d.sess.name, Name: d.name, Export: d.export, Path: d.backend.Path(),
			DeviceID: d.id, AccessMode: d.access, ReadOnly: d.readonly,
			ReadSectors: d.rdSect.Load(), WrittenSectors: d.wrSect.Load(), Reads: d.reads.Load(), Writes: d.writes.Load(),
			Inflight: d.inflight.Load(),
			Flushes:  d.flushes.Load(), FUAWrites: d.fuas.Load(), Discards: d.discards.Load(), WriteZeroes: d.wzeros.Load(),
			WriteCache: d.backend.Caps().WriteCache, BackingProblem: d.backingProblem(),
		})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Session != out[j].Session {
			return out[i].Session < out[j].Session
		}
		return out[i].Name < out[j].Name
	})
	return out
}

// backingProblem is what was last found wrong with the device's backing
// store, "" if nothing.
func (d *SrvSessDev) backingProblem() string {
	if d.dev == nil {
		return ""
	}
	d.dev.mu.Lock()
	defer d.dev.mu.Unlock()
	return d.dev.problem
}

// devName is the name of the device in metrics: its export's, or the name
// it was opened by under the search path.
func (d *SrvSessDev) devName() string {
	if d.export != "" {
		return d.export
	}
	return d.name
}

// Sessions lists the RNBD sessions.
func (s *Server) Sessions() []*SrvSession {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*SrvSession
	for _, x := range s.sessions {
		out = append(out, x)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}

// RTRS is the session's transport session.
func (x *SrvSession) RTRS() *rtrs.SrvSession { return x.rtrs }

// Version is the protocol major version agreed with the client.
func (x *SrvSession) Version() int { return int(x.ver.Load()) }
