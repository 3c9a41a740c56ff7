package rnbd

import (
	"fmt"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/blockdev"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// The server side of RNBD (the kernel's rnbd-srv.c): Server, the user
// of an RTRS server, with its configuration; the sessions and the
// devices they open; and the link events that make and end a session.
// The rest of the server is split by concern, as the kernel splits it:
// exports and their rules (srv_export.go), OPEN, CLOSE and SESS_INFO
// (srv_open.go), IO (srv_io.go), resize (srv_resize.go), the health
// checks of the backing stores (srv_health.go), what the control socket
// shows (srv_info.go) and the session names bound to identities
// (srv_names.go).

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

// SrvConfig configures the RNBD server.
type SrvConfig struct {
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
	// Stat is how Resize and Map look at an export's path: os.Stat if
	// nil. The daemon bounds it, as a path on a mount that does not
	// answer never returns (and maps with MapStat, which takes the look
	// it made).
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
// concurrent use: RTRS calls HandleIO and LinkEvent from its connections'
// goroutines, the administrator's calls (Map, Resize, ForceClose, ...)
// come from others; its state is under the locks doc.go lists.
type Server struct {
	cfg SrvConfig
	log *log.Entry
	rl  log.Limiter
	ios chan srvReq

	// mu guards exports, sessions and devices. Lock order (doc.go):
	// SrvSession.mu, then Server.mu, then device.mu; never take a
	// SrvSession.mu while holding Server.mu (snapshot the sessions
	// instead).
	mu sync.Mutex
	// +checklocks:mu
	exports map[string]*Export
	// +checklocks:mu
	sessions map[*rtrs.SrvSession]*SrvSession
	// +checklocks:mu
	devices map[string]*device // by backend identity
	// exportOpens counts the sessions that have each explicit export
	// open, or are opening it (Export.MaxSessions).
	// +checklocks:mu
	exportOpens map[string]int
	// resizes are the resizes of files under way, by backend ID;
	// resizeSeq names the last one's caps.
	// +checklocks:mu
	resizes map[string]resizing
	// +checklocks:mu
	resizeSeq uint64
	// holds are the holds of backing stores' writes, on or expired and
	// not yet released, by backend ID; holdSeq is the last one's token.
	// +checklocks:mu
	holds map[string]*hold
	// +checklocks:mu
	holdSeq uint64
	// +checklocks:mu
	noHolds bool // EndHolds was called

	// shrinks counts the shrinks of backing files seen behind the
	// server's back, by device name (the export's, or the name under
	// the search path), under shrinkMu.
	shrinkMu sync.Mutex
	// +checklocks:shrinkMu
	shrinks map[string]uint64

	// ownMu guards owners: session name → the identity it is bound to.
	ownMu sync.Mutex
	// +checklocks:ownMu
	owners map[string]string

	closed atomic.Bool
	done   chan struct{} // closed by Close: stops the health checks
	wg     sync.WaitGroup

	// inline counts IO answered on the receive path (tryInline), lent
	// the reads among them sent from the backend's mapping.
	inline atomic.Uint64
	lent   atomic.Uint64

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
func NewServer(cfg SrvConfig) *Server {
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
		ios:         make(chan srvReq, 4096),
		done:        make(chan struct{}),
		exports:     make(map[string]*Export),
		sessions:    make(map[*rtrs.SrvSession]*SrvSession),
		devices:     make(map[string]*device),
		exportOpens: make(map[string]int),
		resizes:     make(map[string]resizing),
		holds:       make(map[string]*hold),
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

// Close stops the workers. The RTRS server must be closed first, so that
// no request is in flight.
func (s *Server) Close() {
	if s.closed.Swap(true) {
		return
	}
	close(s.done)
	s.EndHolds()
	close(s.ios)
	s.wg.Wait()
}

// device is one backing store, whichever names it is opened by: the
// writers of all sessions are counted here (struct rnbd_srv_dev).
type device struct {
	id   string // +checklocksignore: backend identity, fixed (read where some mu is held)
	path string

	mu sync.Mutex
	// +checklocks:mu
	openWriteCnt int
	// +checklocks:mu
	sessDevs []*SrvSessDev
	// +checklocks:mu
	problem string // the last health check's finding
	// +checklocks:mu
	shrunk bool // problem is a shrink (blockdev.ShrinkError)
	// +checklocks:mu
	checking time.Time // when the health check under way began

	// held is the hold of its writes on now (srv_hold.go), nil for
	// none; set and cleared under Server.mu.
	held atomic.Pointer[hold]
}

// SrvSession is a client session (struct rnbd_srv_session). It is safe
// for concurrent use: its name and transport session are fixed, its
// version is atomic, and its devices are under mu.
type SrvSession struct {
	srv  *Server
	rtrs *rtrs.SrvSession
	name string
	ver  atomic.Uint32

	// mu guards devs, nextID and opening.
	mu sync.Mutex
	// +checklocks:mu
	devs map[uint32]*SrvSessDev // a nil value is an id kept after force_close
	// +checklocks:mu
	nextID uint32
	// +checklocks:mu
	opening map[string]bool // device names whose open is under way
}

// Name is the session's name.
func (x *SrvSession) Name() string { return x.name }

// SrvSessDev is a device opened by a session (struct rnbd_srv_sess_dev).
// It is safe for concurrent use: what it holds is fixed before it joins
// its session, but for its counters (atomic), its references and its
// closing (under mu). Its IO runs concurrently, each holding a reference.
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
	rdSect   atomic.Uint64
	wrSect   atomic.Uint64
	reads    atomic.Uint64
	writes   atomic.Uint64
	flushes  atomic.Uint64
	fuas     atomic.Uint64
	discards atomic.Uint64
	wzeros   atomic.Uint64
	// inflight and writing count the requests running on the backend
	// now: the writes (what a hold waits for, srv_hold.go) in writing,
	// the others in inflight; each request in one counter only.
	inflight atomic.Int64
	writing  atomic.Int64

	// refs counts IO in flight plus one for being open; closing waits
	// for it to drain.
	refs sync.WaitGroup
	mu   sync.Mutex
	// +checklocks:mu
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
		rs.SetIOHandler(x)
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

func (x *SrvSession) log() *log.Entry { return x.srv.log.WithField("session", x.name) }

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

// RTRS is the session's transport session.
func (x *SrvSession) RTRS() *rtrs.SrvSession { return x.rtrs }

// Version is the protocol major version agreed with the client.
func (x *SrvSession) Version() int { return int(x.ver.Load()) }
