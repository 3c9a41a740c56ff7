package rtrs

import (
	"context"
	"crypto/rand"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/tagpool"
)

// CltSession is a client session: a name, a paths UUID, and the paths to one
// server. It is safe for concurrent use.
type CltSession struct {
	cfg  CltConfig
	name string
	uuid [16]byte
	log  *log.Entry

	policy               atomic.Int32
	rrCursor             atomic.Uint32
	maxReconnectAttempts atomic.Int32
	ctrlLossTmo          atomic.Int64 // time.Duration; -1: no bound
	reconnectDelay       atomic.Int64 // time.Duration: the first reconnect's wait

	// mu guards the path list and the link-event bookkeeping.
	mu sync.Mutex
	// +checklocks:mu
	paths     []*CltPath
	pathsSnap atomic.Pointer[[]*CltPath] // lock-free copy for the IO path
	// +checklocks:mu
	pathsUp int
	// +checklocks:mu
	opened bool // +checklocksignore: mu alone guards it; evMu happens to be held where it is read

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
	regMu sync.Mutex
	// +checklocks:regMu
	regions []*Buffer // index = region id; 0 is the header memory

	closed    atomic.Bool
	closedCh  chan struct{} // closed by Close: wakes GetPermit
	closeOnce sync.Once
	wg        sync.WaitGroup
}

// DialSession establishes a session with every path of cfg, one after another,
// and returns when all are connected (rtrs_clt_open). If any path fails,
// the session is closed and the error returned.
func DialSession(ctx context.Context, cfg CltConfig) (*CltSession, error) {
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

// Paths returns the session's paths.
func (s *CltSession) Paths() []*CltPath {
	return append([]*CltPath(nil), *s.pathsSnap.Load()...)
}

// Connected reports whether at least one path is connected.
func (s *CltSession) Connected() bool {
	for _, p := range *s.pathsSnap.Load() {
		if p.State() == CltPathConnected {
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
