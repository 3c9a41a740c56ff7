package rnbd

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// DefaultNoPathTimeout is how long a block request waits for its device
// by default when the session has no path: long enough for a heartbeat to
// detect a silent peer (about 35 s with the kernel's 5 s x 5) and for
// reconnects to bring a restarted server back. The kernel fails at once.
const DefaultNoPathTimeout = 120 * time.Second

// DefaultSizePoll is how often a session asks the server for the size of
// each device it has open (SetSizePoll): how soon a resize on the server
// reaches the client.
const DefaultSizePoll = 5 * time.Second

// CltSession is an RNBD client session (struct rnbd_clt_session): an RTRS
// session, the protocol version agreed on it, and the devices mapped
// through it, which share its paths and permits. It is the client's one
// API: DialSession, then Map for each device.
//
// Requests that find no path wait here, not in RTRS: a server that lost
// every path of a session forgets its devices, so after a reconnect every
// device is opened again — possibly under another id — before the
// requests that waited go out, re-encoded with the new id.
//
// It is safe for concurrent use: its settings are atomic, its devices
// under mu, and its admin messages (SESS_INFO, OPEN, CLOSE) go one at a
// time under adminMu, whoever sends them.
type CltSession struct {
	sess *rtrs.CltSession
	log  *log.Entry
	rl   log.Limiter // failed IO, which may come in floods

	// adminMu serializes admin messages, which share one buffer.
	adminMu sync.Mutex
	// +checklocks:adminMu
	admin *rtrs.Buffer
	// +checklocks:adminMu
	ver uint8
	// probeBuf takes the size poll's one-block reads (the reopen
	// goroutine's only).
	probeBuf *rtrs.Buffer

	noPathTimeout atomic.Int64
	// fastIOFail is fast_io_fail_tmo (time.Duration): this long after
	// the session lost its last path, IO waiting for one fails, and new
	// IO fails at once; negative: off.
	fastIOFail atomic.Int64
	// noPathSince is when the session lost its last path (unix ns), 0
	// while it has one.
	noPathSince atomic.Int64
	// pieces[i] is the piece of IO that permit i carries.
	pieces []piece

	sizePoll atomic.Int64 // time.Duration; 0: never
	onResize atomic.Pointer[func(*CltDev)]

	mu sync.Mutex
	// +checklocks:mu
	devs []*CltDev
	// +checklocks:mu
	closed  bool
	reopenQ chan struct{} // cap 1: wakes the reopen goroutine
	pollQ   chan struct{} // cap 1: the size poll changed
	done    chan struct{}
	wg      sync.WaitGroup
}

// DialSession opens an RTRS session with cfg and negotiates RNBD on it
// (SESS_INFO). noPathTimeout is how long a block request waits for its
// device when no path is connected (0 fails it at once, as the kernel
// does). cfg.LinkEvent is the session's own.
func DialSession(ctx context.Context, cfg rtrs.CltConfig, noPathTimeout time.Duration) (*CltSession, error) {
	if noPathTimeout < 0 {
		return nil, fmt.Errorf("rnbd: negative no_path_timeout: %w", syscall.EINVAL)
	}
	s := &CltSession{reopenQ: make(chan struct{}, 1), pollQ: make(chan struct{}, 1), done: make(chan struct{})}
	s.noPathTimeout.Store(int64(noPathTimeout))
	s.fastIOFail.Store(-1)
	s.sizePoll.Store(int64(DefaultSizePoll))
	if cfg.Log == nil {
		cfg.Log = log.L
	}
	s.log = cfg.Log.WithField("session", cfg.SessName)
	cfg.LinkEvent = s.linkEvent
	sess, err := rtrs.DialSession(ctx, cfg)
	if err != nil {
		return nil, err
	}
	admin, err := sess.AllocBuffer(4096)
	if err != nil {
		sess.Close()
		return nil, err
	}
	s.sess, s.admin = sess, admin
	if err := s.sessInfo(ctx); err != nil {
		sess.Close()
		return nil, err
	}
	s.pieces = make([]piece, sess.QueueDepth())
	s.wg.Add(1)
	go s.reopenLoop()
	return s, nil
}

// Session is the RTRS session under it: its paths, their controls and
// statistics.
func (s *CltSession) Session() *rtrs.CltSession { return s.sess }

// Version is the protocol major version agreed with the server.
func (s *CltSession) Version() int {
	s.adminMu.Lock()
	defer s.adminMu.Unlock()
	return int(s.ver)
}

// NoPathSince is when the session lost its last path; zero while it has
// one. IO that arrives without a path waits up to NoPathTimeout from its
// own arrival.
func (s *CltSession) NoPathSince() time.Time {
	if ns := s.noPathSince.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// NoPathTimeout is how long a block request waits for its device when
// no path is connected.
func (s *CltSession) NoPathTimeout() time.Duration { return time.Duration(s.noPathTimeout.Load()) }

// SetNoPathTimeout changes it for IO that starts waiting from now on.
func (s *CltSession) SetNoPathTimeout(d time.Duration) error {
	if d < 0 {
		return fmt.Errorf("rnbd: negative no_path_timeout: %w", syscall.EINVAL)
	}
	s.noPathTimeout.Store(int64(d))
	return nil
}

// FastIOFailTmo is fast_io_fail_tmo, negative when off.
func (s *CltSession) FastIOFailTmo() time.Duration { return time.Duration(s.fastIOFail.Load()) }

// SetFastIOFailTmo sets fast_io_fail_tmo, as NVMe-oF's: once the session
// has had no path for d, IO waiting for one fails and new IO fails at
// once, however long no_path_timeout would let it wait; negative turns
// it off (IO waits no_path_timeout from its own arrival). It applies to
// IO that starts waiting from now on.
func (s *CltSession) SetFastIOFailTmo(d time.Duration) {
	if d < 0 {
		d = -1
	}
	s.fastIOFail.Store(int64(d))
}

// Waiting is how many pieces of block requests of the session's devices
// wait for a path, and how long until the first of them fails
// (no_path_timeout or fast_io_fail_tmo after it began to wait; 0 when
// none waits).
func (s *CltSession) Waiting() (n int, failIn time.Duration) {
	var first time.Time
	for _, d := range s.Devices() {
		dn, df := d.wait.pending()
		n += dn
		if dn > 0 && (first.IsZero() || df.Before(first)) {
			first = df
		}
	}
	if n > 0 {
		failIn = max(time.Until(first), time.Millisecond)
	}
	return n, failIn
}

// FastIOFailIn is how long until fast_io_fail_tmo fails IO: 0 while the
// session has a path or the timer is off, negative once it has passed.
func (s *CltSession) FastIOFailIn() time.Duration {
	since, f := s.NoPathSince(), s.FastIOFailTmo()
	if since.IsZero() || f < 0 {
		return 0
	}
	if left := time.Until(since.Add(f)); left > 0 {
		return left
	}
	return -1
}

// ioDeadline is when IO that starts waiting for a path now fails: after
// no_path_timeout, or sooner when fast_io_fail_tmo runs out first.
func (s *CltSession) ioDeadline(now time.Time) time.Time {
	deadline := now.Add(s.NoPathTimeout())
	if f := s.FastIOFailTmo(); f >= 0 {
		if since := s.NoPathSince(); !since.IsZero() && since.Add(f).Before(deadline) {
			deadline = since.Add(f)
		}
	}
	return deadline
}

// SetSizePoll sets how often the session asks the server for the size of
// its open devices (DefaultSizePoll; 0: never, a remap still does). It
// asks with an OPEN of the device it has open, which the kernel's server
// and ours both answer with the device's current size, changing nothing
// else: the kernel's wire needs no extension for it.
func (s *CltSession) SetSizePoll(d time.Duration) {
	s.sizePoll.Store(int64(max(d, 0)))
	select {
	case s.pollQ <- struct{}{}: // the timer starts again with it
	default:
	}
}

// OnResize sets what is called, from the session's own goroutine, after
// the server reported a new size for one of the devices (d.Size() is the
// new one): the frontends apply it.
func (s *CltSession) OnResize(fn func(d *CltDev)) { s.onResize.Store(&fn) }

func (s *CltSession) kick() {
	select {
	case s.reopenQ <- struct{}{}:
	default:
	}
}

// Devices returns the session's mapped devices.
func (s *CltSession) Devices() []*CltDev {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*CltDev(nil), s.devs...)
}

// sessInfo (re)negotiates the version (SESS_INFO); done again after a
// reconnect.
func (s *CltSession) sessInfo(ctx context.Context) error {
	s.adminMu.Lock()
	defer s.adminMu.Unlock()
	var usr [SessInfoSize]byte
	(&SessInfo{Ver: ProtoVerMajor}).Encode(usr[:], MsgSessInfo)
	if err := s.adminDo(ctx, usr[:], SessInfoRspSize); err != nil {
		return fmt.Errorf("rnbd: session info: %w", err)
	}
	var rsp SessInfo
	if err := rsp.Decode(s.admin.Bytes()[:SessInfoRspSize], MsgSessInfoRsp); err != nil {
		return fmt.Errorf("rnbd: session info response: %w", err)
	}
	if rsp.Ver == 0 || rsp.Ver > ProtoVerMajor {
		return fmt.Errorf("rnbd: server answered protocol version %d: %w", rsp.Ver, syscall.EPROTO)
	}
	s.ver = rsp.Ver
	return nil
}

// AdminTimeout bounds the wait for the answer to an admin message
// (SESS_INFO, OPEN, CLOSE): a server that does not answer one in that
// time is stuck, and the map or unmap fails instead of hanging.
const AdminTimeout = 30 * time.Second

// adminDo sends an admin message whose answer of n bytes lands in
// s.admin; adminMu is held. A message abandoned because ctx ended (a
// server that does not answer) keeps its buffer, which the answer may
// still reach: the next message gets a new one, and the old one is freed
// with the session.
// +checklocks:s.adminMu
func (s *CltSession) adminDo(ctx context.Context, usr []byte, n int) error {
	if s.admin == nil {
		b, err := s.sess.AllocBuffer(4096)
		if err != nil {
			return err
		}
		s.admin = b
	}
	ctx, cancel := context.WithTimeout(ctx, AdminTimeout)
	defer cancel()
	err := s.sess.Do(ctx, rtrs.AdminCon, rtrs.Read, usr, s.admin, 0, n)
	if errors.Is(err, rtrs.ErrAbandoned) {
		s.admin = nil
	}
	return err
}

// ErrBadOpenRsp is returned for an OPEN_RSP that describes no usable device.
var ErrBadOpenRsp = fmt.Errorf("rnbd: server answered with an unusable device: %w", syscall.EPROTO)

// open opens the remote device name on the server (OPEN). The server
// answers the same device id for a name the session has open already.
func (s *CltSession) open(ctx context.Context, name string, mode AccessMode) (OpenRsp, error) {
	return s.openIf(ctx, name, mode, nil)
}

// errNotNow is openIf's answer when its condition did not hold.
var errNotNow = errors.New("rnbd: not sent")

// openIf is open, sent only if cond (when not nil) holds once the admin
// messages are serialized: nothing else (a CLOSE, an OPEN) can come
// between the check and the OPEN.
func (s *CltSession) openIf(ctx context.Context, name string, mode AccessMode, cond func() bool) (OpenRsp, error) {
	s.adminMu.Lock()
	defer s.adminMu.Unlock()
	if cond != nil && !cond() {
		return OpenRsp{}, errNotNow
	}
	var usr [OpenSize]byte
	(&Open{AccessMode: mode, DevName: name}).Encode(usr[:])
	if err := s.adminDo(ctx, usr[:], OpenRspSize); err != nil {
		if why := openRefused(err); why != "" {
			return OpenRsp{}, fmt.Errorf("rnbd: open %s: %w: %s", name, err, why)
		}
		return OpenRsp{}, fmt.Errorf("rnbd: open %s: %w", name, err)
	}
	var rsp OpenRsp
	if err := rsp.Decode(s.admin.Bytes()[:OpenRspSize]); err != nil {
		return OpenRsp{}, fmt.Errorf("rnbd: open %s: %w", name, err)
	}
	if err := rsp.Check(s.sess.MaxIOSize()); err != nil {
		return OpenRsp{}, fmt.Errorf("rnbd: open %s: %w", name, err)
	}
	return rsp, nil
}

// Check refuses an OPEN_RSP that describes a device the client cannot
// serve, with ErrBadOpenRsp and the field and value at fault: it is
// checked at every OPEN (map, remap, reopen, size poll), so a device is
// never set up, nor resized, from it. maxIO is the session's max_io_size,
// the most one request carries. What the client uses of it, field by
// field:
//
//   - logical_block_size, physical_block_size: a power of two from 512;
//   - nsectors: the device's size; nsectors*512 must fit an int64 and be
//     a multiple of the logical block (0 is an empty device);
//   - max_hw_sectors: with max_io_size, the most one read or write
//     carries: at least one logical block;
//   - max_discard_sectors, max_write_zeroes_sectors: 0 (not supported),
//     or at least one logical block; secure_discard only with discards;
//   - cache_policy: its two bits (write back, FUA); others are ignored.
//
// max_segments, discard_granularity and discard_alignment are not used:
// a request's data is one registered buffer, and discards are split only
// at max_discard_sectors.
func (m *OpenRsp) Check(maxIO int) error {
	bad := func(field string, v uint64, why string) error {
		return fmt.Errorf("%w: %s %d: %s", ErrBadOpenRsp, field, v, why)
	}
	lbs := uint64(m.LogicalBlockSize)
	if !validBlockSize(m.LogicalBlockSize) {
		return bad("logical_block_size", lbs, "not a power of two from 512")
	}
	if !validBlockSize(m.PhysicalBlockSize) {
		return bad("physical_block_size", uint64(m.PhysicalBlockSize), "not a power of two from 512")
	}
	if m.NSectors > math.MaxInt64/512 {
		return bad("nsectors", m.NSectors, "the size in bytes does not fit in 63 bits")
	}
	if m.NSectors*512%lbs != 0 {
		return bad("nsectors", m.NSectors, fmt.Sprintf("not a multiple of the logical block size %d", lbs))
	}
	if uint64(m.MaxHWSectors)*512 < lbs {
		return bad("max_hw_sectors", uint64(m.MaxHWSectors), fmt.Sprintf("less than one logical block of %d bytes: no read or write could be sent", lbs))
	}
	if uint64(maxIO) < lbs {
		return bad("logical_block_size", lbs, fmt.Sprintf("larger than the session's max_io_size %d: no read or write could be sent", maxIO))
	}
	if n := uint64(m.MaxDiscardSectors); n != 0 && n*512 < lbs {
		return bad("max_discard_sectors", n, fmt.Sprintf("less than one logical block of %d bytes", lbs))
	}
	if n := uint64(m.MaxWriteZeroesSectors); n != 0 && n*512 < lbs {
		return bad("max_write_zeroes_sectors", n, fmt.Sprintf("less than one logical block of %d bytes", lbs))
	}
	if m.SecureDiscard != 0 && m.MaxDiscardSectors == 0 {
		return bad("secure_discard", uint64(m.SecureDiscard), "set with max_discard_sectors 0")
	}
	return nil
}

// openRefused says what a server's refusal of an OPEN means: the answer
// carries an errno only, and rnbd-server logs the detail (which grant,
// address or mode). Each errno is one cause on rnbd-server; the kernel's
// rnbd_server answers EPERM for a writer too many and a read-only device
// as well (docs/server.md, "What a client sees"). "" for other errors.
func openRefused(err error) string {
	var e syscall.Errno
	if !errors.As(err, &e) {
		return ""
	}
	switch e {
	case syscall.EACCES:
		return "the export grants this client's identity (its TLS certificate) no access, or less than this access mode, or the client presented none (allow_identities), or the session name belongs to another identity (rnbd-server session names)"
	case syscall.EBUSY:
		return "another session has the device open for writing: a second writer needs access_mode=migration, and the export must allow it (map --migration, a migration grant, or allow_migration for the search path)"
	case syscall.EROFS:
		return "the export is read-only: map it with access_mode=ro"
	case syscall.EPERM:
		return "the export does not allow this session name or client address (its allow and allow_from), or this session has the device open read-only already (unmap it first); a kernel rnbd_server says EPERM also for a read-only export or a device with a writer already"
	case syscall.EUSERS:
		return "the export is open by as many sessions as its max_sessions allows"
	case syscall.ENOENT:
		return "the server has no such device"
	}
	return ""
}

func validBlockSize(n uint16) bool { return n >= 512 && n&(n-1) == 0 }

// close closes device id on the server (CLOSE), in turn with the other
// admin messages (a size poll's OPEN cannot overtake it).
func (s *CltSession) close(ctx context.Context, name string, id uint32) error {
	s.adminMu.Lock()
	defer s.adminMu.Unlock()
	var usr [CloseSize]byte
	(&Close{DeviceID: id}).Encode(usr[:])
	ctx, cancel := context.WithTimeout(ctx, AdminTimeout)
	defer cancel()
	if err := s.sess.Do(ctx, rtrs.AdminCon, rtrs.Write, usr[:], nil, 0, 0); err != nil {
		return fmt.Errorf("rnbd: close %s on the server: %w", name, err)
	}
	return nil
}

// Map opens the remote device name with mode and adds it to the session
// (rnbd_clt_map_device).
func (s *CltSession) Map(ctx context.Context, name string, mode AccessMode) (*CltDev, error) {
	if len(name) == 0 || len(name) >= nameMax {
		return nil, ErrBadDevName
	}
	for i := 0; i < len(name); i++ {
		if name[i] == 0 {
			return nil, ErrBadDevName
		}
	}
	s.mu.Lock()
	for _, d := range s.devs {
		if d.name == name {
			s.mu.Unlock()
			return nil, fmt.Errorf("rnbd: %s is already mapped through session %s: %w", name, s.sess.Name(), syscall.EEXIST)
		}
	}
	s.mu.Unlock()
	info, err := s.open(ctx, name, mode)
	if err != nil {
		return nil, err
	}
	d := &CltDev{s: s, name: name, mode: mode, info: info}
	d.remoteSectors.Store(info.NSectors)
	d.wait.expired = d.expired
	d.failRL.Interval, d.failRL.Burst = 10*time.Second, 3
	d.state.Store(int32(DevOpen))
	s.mu.Lock()
	s.devs = append(s.devs, d)
	s.mu.Unlock()
	return d, nil
}

// linkEvent runs inside RTRS's path bookkeeping: it must not wait for
// the network. On DISCONNECTED every device stops sending (after the
// submissions under way, which only post); on RECONNECTED the reopen
// goroutine takes over.
func (s *CltSession) linkEvent(ev rtrs.CltLinkEvent) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	devs := append([]*CltDev(nil), s.devs...)
	s.mu.Unlock()
	if ev == rtrs.CltLinkDisconnected {
		s.noPathSince.CompareAndSwap(0, time.Now().UnixNano())
		for _, d := range devs {
			d.disconnected()
		}
		return
	}
	s.noPathSince.Store(0)
	s.kick()
}

// reopenLoop re-negotiates the session and reopens its devices after a
// reconnect (rnbd_clt_reconnect), then lets the waiting IO go; between
// reconnects it asks after the devices' sizes every size poll.
func (s *CltSession) reopenLoop() {
	defer s.wg.Done()
	poll := time.NewTimer(time.Hour)
	defer poll.Stop()
	infoDone := true // the session info since the last reconnect
	for {
		poll.Stop()
		if d := time.Duration(s.sizePoll.Load()); d > 0 {
			poll.Reset(d)
		}
		select {
		case <-s.done:
			return
		case <-poll.C:
			s.reopenClosed(&infoDone)
			s.pollSizes()
			continue
		case <-s.pollQ:
			continue
		case <-s.reopenQ:
		}
		infoDone = false
		if !s.sess.Connected() {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if err := s.sessInfo(ctx); err != nil {
			cancel()
			s.log.WithError(err).Warn("session info after reconnect failed; tried again at the next size poll")
			continue
		}
		infoDone = true
		for _, d := range s.Devices() {
			if d.State() == DevSrvClosed {
				continue // closed by the server's administrator: a remap reopens it
			}
			if err := d.reopen(ctx); err != nil {
				d.log().WithError(err).Warn("reopening the device after reconnect failed; tried again at each size poll")
			}
		}
		cancel()
	}
}

// reopenClosed tries again, at a size poll, what the last reconnect
// failed to do (a server whose export's mount did not answer then, say):
// the session info unless *infoDone, then the reopen of each device still
// closed. The kernel's client leaves such a device closed until the next
// reconnect. A reconnect whose turn has come (reopenQ) goes first.
func (s *CltSession) reopenClosed(infoDone *bool) {
	if len(s.reopenQ) > 0 {
		return
	}
	var closed []*CltDev
	for _, d := range s.Devices() {
		if d.State() == DevClosed {
			closed = append(closed, d)
		}
	}
	if !s.sess.Connected() || (*infoDone && len(closed) == 0) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if !*infoDone {
		if err := s.sessInfo(ctx); err != nil {
			s.rl.Log(s.log.WithError(err), log.WarnLevel, "session info after reconnect failed again")
			return
		}
		*infoDone = true
	}
	for _, d := range closed {
		if err := d.reopen(ctx); err != nil {
			s.rl.Log(d.log().WithError(err), log.WarnLevel, "reopening the device after reconnect failed again")
		}
	}
}

// probe reads one logical block at sector 0 of device id: harmless on a
// device that is open, answered ENOTCONN by a server that does not have
// it open. Only the reopen goroutine calls it.
func (s *CltSession) probe(ctx context.Context, id uint32, lbs int) error {
	if s.probeBuf == nil || len(s.probeBuf.Bytes()) < lbs {
		b, err := s.sess.AllocBuffer(max(lbs, 4096))
		if err != nil {
			return err
		}
		s.probeBuf = b
	}
	var usr [IOSize]byte
	(&IO{DeviceID: id, Sector: 0, RW: uint32(OpRead), Size: uint32(lbs)}).Encode(usr[:])
	ctx, cancel := context.WithTimeout(ctx, AdminTimeout)
	defer cancel()
	err := s.sess.Do(ctx, rtrs.IOCon, rtrs.Read, usr[:], s.probeBuf, 0, lbs)
	if errors.Is(err, rtrs.ErrAbandoned) {
		s.probeBuf = nil // the answer may still land in it
	}
	return err
}

// pollSizes asks the server for the size of every open device.
func (s *CltSession) pollSizes() {
	if !s.sess.Connected() {
		return
	}
	for _, d := range s.Devices() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		d.pollSize(ctx)
		cancel()
	}
}

// Close unmaps nothing on the server beyond what closing the session
// does (the server closes the session's devices when its last path goes):
// it fails the waiting IO and closes the RTRS session.
func (s *CltSession) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	devs := append([]*CltDev(nil), s.devs...)
	s.mu.Unlock()
	close(s.done)
	for _, d := range devs {
		d.setState(DevUnmapped)
		d.wait.fail(rtrs.ErrClosed)
	}
	err := s.sess.Close()
	s.wg.Wait()
	return err
}
