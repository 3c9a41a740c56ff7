// Package rdma is the RDMA fabric: the reliable-connection contract of
// package fabric on verbs (pkg/ibverbs), wire-compatible with the kernel's
// RTRS. Connections are RC queue pairs set up through rdma_cm in the TCP
// port space, the RTRS conn_req/conn_rsp travelling as the CM's private
// data; writes, writes with immediate and sends are the verbs operations
// themselves, so what reaches the peer is what the kernel's RTRS sends.
//
// Each connection has its own completion queue, completion channel and
// rdma_cm event channel, waited on in Go's poller by two goroutines: one
// polls the CQ in batches and delivers completions (sends and receives
// alike, each in order), the other turns CM events (disconnect, device
// removal, address change) into Handler.Disconnected at once, without
// waiting for a heartbeat.
//
// Userspace verbs have no fast registration (FRWR): a memory region whose
// remote access is revoked (MR.Invalidate) is deregistered, and
// Reregister registers it again under a new rkey. Local access goes
// through a second, local-only registration that never changes, the way
// the kernel uses its PD's local DMA key.
package rdma

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/rnbd/rnbd/pkg/ibverbs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Options configure a Fabric. The zero value is usable.
type Options struct {
	// ResolveTimeout bounds address and route resolution (the kernel's
	// RTRS_CONNECT_TIMEOUT_MS, 30 s).
	ResolveTimeout time.Duration
	// Backlog is the listen backlog (64, as rtrs-srv).
	Backlog int
}

// Fabric is the RDMA fabric. It is safe for concurrent use.
type Fabric struct {
	opts Options
}

// New returns an RDMA fabric. It fails with an error wrapping
// fabric.ErrNotSupported where this build or machine cannot do RDMA.
func New(opts Options) (*Fabric, error) {
	if !ibverbs.Supported {
		return nil, fmt.Errorf("%w: built without cgo", fabric.ErrNotSupported)
	}
	if opts.ResolveTimeout <= 0 {
		opts.ResolveTimeout = 30 * time.Second
	}
	if opts.Backlog <= 0 {
		opts.Backlog = 64
	}
	return &Fabric{opts: opts}, nil
}

var _ fabric.Fabric = (*Fabric)(nil)

func (f *Fabric) Name() string { return "rdma" }

func notSupported(err error) error {
	if errors.Is(err, ibverbs.ErrNotSupported) && !errors.Is(err, fabric.ErrNotSupported) {
		return fmt.Errorf("%w: %w", fabric.ErrNotSupported, err)
	}
	return err
}

// memory is mmapped: outside the Go heap, as the device keeps its address.
type memory struct{ b []byte }

func (m *memory) Bytes() []byte { return m.b }
func (m *memory) Free() error {
	if m.b == nil {
		return nil
	}
	err := ibverbs.FreeMemory(m.b)
	m.b = nil
	return err
}

// AllocMemory returns page-aligned memory outside the Go heap.
func (f *Fabric) AllocMemory(n int) (fabric.Memory, error) {
	if n <= 0 {
		return nil, errors.New("rdma fabric: memory size must be positive")
	}
	b, err := ibverbs.AllocMemory(n)
	if err != nil {
		return nil, err
	}
	return &memory{b: b}, nil
}

// AllocMapped is AllocMemory, which is a private mapping already
// (fabric.Mapper).
func (f *Fabric) AllocMapped(n int) (fabric.Memory, error) { return f.AllocMemory(n) }

// event waits for ch's next event, or ctx; ctx interrupts the channel.
func event(ctx context.Context, ch *ibverbs.EventChannel) (ibverbs.CMEvent, error) {
	stop := context.AfterFunc(ctx, ch.Interrupt)
	ev, err := ch.Next()
	stop()
	if err != nil && ctx.Err() != nil {
		return ev, ctx.Err()
	}
	return ev, err
}

// expect waits for the event want; any other is the error it means.
func expect(ctx context.Context, ch *ibverbs.EventChannel, want ibverbs.EventType) (ibverbs.CMEvent, error) {
	ev, err := event(ctx, ch)
	if err != nil {
		return ev, err
	}
	if ev.Type != want {
		return ev, fmt.Errorf("rdma fabric: waiting for %v: %v (status %d): %w", want, ev.Type, ev.Status, cmErrno(ev))
	}
	return ev, nil
}

// cmErrno is the errno an unwanted CM event stands for.
func cmErrno(ev ibverbs.CMEvent) error {
	if ev.Status < 0 {
		return syscall.Errno(-ev.Status)
	}
	switch ev.Type {
	case ibverbs.EventAddrError, ibverbs.EventRouteError:
		return syscall.EHOSTUNREACH
	case ibverbs.EventUnreachable:
		return syscall.ENETUNREACH
	case ibverbs.EventRejected:
		return syscall.ECONNREFUSED
	case ibverbs.EventDeviceRemoval:
		return syscall.ENODEV
	}
	return syscall.ECONNRESET
}

// Resolve finds the device through which dst is reached from src: an
// rdma_cm address resolution (ENODEV for an address without an RDMA
// device: rdma_cm does not work over lo).
func (f *Fabric) Resolve(ctx context.Context, src, dst netip.AddrPort) (fabric.Device, error) {
	ch, err := ibverbs.NewEventChannel()
	if err != nil {
		return nil, notSupported(err)
	}
	defer ch.Close()
	id, err := ch.CreateID(ibverbs.PortSpaceTCP)
	if err != nil {
		return nil, err
	}
	if err := id.ResolveAddr(src, dst, int(f.opts.ResolveTimeout/time.Millisecond)); err != nil {
		return nil, notSupported(err)
	}
	if _, err := expect(ctx, ch, ibverbs.EventAddrResolved); err != nil {
		return nil, fmt.Errorf("rdma fabric: resolve %v: %w", dst, err)
	}
	x := id.Context()
	if x == nil {
		return nil, fmt.Errorf("rdma fabric: %v resolves to no RDMA device: %w", dst, fabric.ErrNotSupported)
	}
	return &device{f: f, x: x, port: id.Port()}, nil
}

// device is an HCA port.
type device struct {
	f    *Fabric
	x    *ibverbs.Context
	port int
}

func (d *device) Name() string { return d.x.Name() }
func (d *device) Port() int    { return d.port }

func (d *device) AllocPD() (fabric.PD, error) {
	p, err := d.x.AllocPD()
	if err != nil {
		return nil, err
	}
	return &pd{dev: d, p: p}, nil
}

// pd is a protection domain.
type pd struct {
	dev *device
	p   *ibverbs.PD
}

func verbsAccess(a fabric.Access) ibverbs.Access {
	var v ibverbs.Access
	if a&fabric.AccessLocalWrite != 0 {
		v |= ibverbs.AccessLocalWrite
	}
	if a&fabric.AccessRemoteWrite != 0 {
		v |= ibverbs.AccessRemoteWrite | ibverbs.AccessLocalWrite
	}
	if a&fabric.AccessRemoteRead != 0 {
		v |= ibverbs.AccessRemoteRead
	}
	return v
}

// RegisterMR registers buf, which must come from AllocMemory. With
// fabric.AccessWindow, where the device has memory windows, the remote
// access is a type 1 window (a windowMR).
func (p *pd) RegisterMR(buf []byte, access fabric.Access) (fabric.MR, error) {
	if access&fabric.AccessWindow != 0 {
		if w, err := p.registerWindow(buf, access); err == nil {
			return w, nil
		} else if !errors.Is(err, ibverbs.ErrNotSupported) && !errors.Is(err, syscall.ENOSYS) &&
			!errors.Is(err, syscall.EOPNOTSUPP) {
			return nil, err
		}
		// No windows on this device: registration per rkey.
	}
	m, err := p.p.RegMR(buf, verbsAccess(access))
	if err != nil {
		return nil, err
	}
	r := &mr{pd: p, buf: buf, access: verbsAccess(access), remote: m, rkey: m.RKey(), lkey: m.LKey()}
	return r, nil
}

// Windows says whether the device has type 1 memory windows, which
// RegisterMR with fabric.AccessWindow then uses (fabric.WindowPD): it
// allocates one and frees it.
func (p *pd) Windows() bool {
	w, err := p.p.AllocMW()
	if err != nil {
		return false
	}
	w.Close()
	return true
}

func (p *pd) Close() error { return p.p.Close() }

// mr is a memory region. Its remote registration is dropped by Invalidate
// and made again by Reregister; local access uses a local-only
// registration made on the first Invalidate, which never changes.
type mr struct {
	pd     *pd
	buf    []byte
	access ibverbs.Access

	mu     sync.Mutex
	remote *ibverbs.MR // nil while invalidated
	local  *ibverbs.MR // made by the first Invalidate
	rkey   uint32
	lkey   uint32
}

func (m *mr) Buf() []byte  { return m.buf }
func (m *mr) Addr() uint64 { return uint64(uintptr(unsafe.Pointer(&m.buf[0]))) }

func (m *mr) LKey() uint32 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lkey
}

func (m *mr) RKey() uint32 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.rkey
}

// Invalidate deregisters the remote registration: from when it returns,
// the device refuses a write with its rkey (a remote access error that
// breaks the writer's connection).
func (m *mr) Invalidate() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.local == nil {
		l, err := m.pd.p.RegMR(m.buf, ibverbs.AccessLocalWrite)
		if err != nil {
			return err
		}
		m.local, m.lkey = l, l.LKey()
	}
	if m.remote == nil {
		return nil
	}
	err := m.remote.Close()
	m.remote = nil
	return err
}

// Reregister registers the region for remote access again; the device
// gives it a new rkey.
func (m *mr) Reregister() (uint32, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.remote != nil {
		if err := m.remote.Close(); err != nil {
			return 0, err
		}
		m.remote = nil
	}
	r, err := m.pd.p.RegMR(m.buf, m.access)
	if err != nil {
		return 0, err
	}
	m.remote, m.rkey = r, r.RKey()
	if m.local == nil {
		m.lkey = r.LKey()
	}
	return m.rkey, nil
}

func (m *mr) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var errs []error
	for _, r := range []*ibverbs.MR{m.remote, m.local} {
		if r != nil {
			errs = append(errs, r.Close())
		}
	}
	m.remote, m.local = nil, nil
	return errors.Join(errs...)
}

// connParam is what both sides of RTRS use (rtrs-clt/rtrs-srv): no RDMA
// reads, retries as the kernel's (7: RNR retries for ever).
func connParam(priv []byte) ibverbs.ConnParam {
	return ibverbs.ConnParam{PrivateData: priv, RetryCount: 7, RNRRetryCount: 7}
}

// Dial connects: its own event channel and ID, address and route
// resolution, a QP in p.PD, the connection request with p.PrivateData,
// and the peer's accept (its private data) or reject.
func (d *device) Dial(ctx context.Context, p fabric.DialParams) (fabric.Conn, []byte, error) {
	ppd, ok := p.PD.(*pd)
	if !ok || ppd.dev.x != d.x {
		return nil, nil, errors.New("rdma fabric: the PD is not of this device")
	}
	ch, err := ibverbs.NewEventChannel()
	if err != nil {
		return nil, nil, notSupported(err)
	}
	id, err := ch.CreateID(ibverbs.PortSpaceTCP)
	if err != nil {
		ch.Close()
		return nil, nil, err
	}
	c := &conn{ch: ch, id: id, h: p.Attr.Handler}
	fail := func(err error) (fabric.Conn, []byte, error) {
		c.destroy()
		return nil, nil, err
	}
	tmo := int(d.f.opts.ResolveTimeout / time.Millisecond)
	if err := id.ResolveAddr(p.Src, p.Dst, tmo); err != nil {
		return fail(err)
	}
	if _, err := expect(ctx, ch, ibverbs.EventAddrResolved); err != nil {
		return fail(fmt.Errorf("rdma fabric: resolve %v: %w", p.Dst, err))
	}
	if id.Context() != d.x {
		return fail(fmt.Errorf("rdma fabric: %v is now reached through %s, not %s: %w", p.Dst, id.Context().Name(), d.x.Name(), syscall.EXDEV))
	}
	if err := id.ResolveRoute(tmo); err != nil {
		return fail(err)
	}
	if _, err := expect(ctx, ch, ibverbs.EventRouteResolved); err != nil {
		return fail(fmt.Errorf("rdma fabric: route to %v: %w", p.Dst, err))
	}
	if err := c.setup(ppd, p.Attr); err != nil {
		return fail(err)
	}
	if err := id.Connect(connParam(p.PrivateData)); err != nil {
		return fail(err)
	}
	ev, err := event(ctx, ch)
	if err != nil {
		return fail(err)
	}
	switch ev.Type {
	case ibverbs.EventEstablished:
	case ibverbs.EventRejected:
		if len(ev.PrivateData) > 0 {
			return fail(&fabric.RejectError{PrivateData: ev.PrivateData})
		}
		return fail(fmt.Errorf("rdma fabric: connect to %v: rejected: %w", p.Dst, syscall.ECONNREFUSED))
	default:
		return fail(fmt.Errorf("rdma fabric: connect to %v: %v (status %d): %w", p.Dst, ev.Type, ev.Status, cmErrno(ev)))
	}
	c.local, c.remote = id.LocalAddr(), id.PeerAddr()
	c.start()
	return c, ev.PrivateData, nil
}

// conn is one RC connection: QP, CQ, completion channel, CM ID and event
// channel, and the two goroutines that serve them.
type conn struct {
	ch *ibverbs.EventChannel
	id *ibverbs.CMID
	cc *ibverbs.CompChannel
	cq *ibverbs.CQ
	qp *ibverbs.QP
	h  fabric.Handler
	bh fabric.BurstHandler // h, if it is one

	local, remote netip.AddrPort

	closing   atomic.Bool
	failed    atomic.Bool // Disconnected was reported
	closeOnce sync.Once
	wg        sync.WaitGroup

	// Work requests held for one ibv_post_send (fabric.Flusher): those
	// posted during a batch of completions, until the batch is
	// delivered, and those posted with More, until Flush. On a device
	// whose doorbell is a system call (rxe), that is one call per batch.
	heldMu  sync.Mutex
	held    [ibverbs.MaxChain]ibverbs.SendWR
	nHeld   int
	inBurst bool // the poll loop is delivering a batch
}

// setup makes the CQ and QP and posts the first receives; the handler
// learns the connection before anything can complete.
func (c *conn) setup(p *pd, attr fabric.ConnAttr) error {
	x := p.dev.x
	var err error
	if c.cc, err = x.NewCompChannel(); err != nil {
		return err
	}
	if c.cq, err = x.NewCQ(attr.MaxSendWR+attr.MaxRecvWR, c.cc); err != nil {
		return err
	}
	if c.qp, err = c.id.CreateQP(p.p, c.cq, ibverbs.QPCaps{MaxSendWR: attr.MaxSendWR, MaxRecvWR: attr.MaxRecvWR}); err != nil {
		return err
	}
	c.bh, _ = c.h.(fabric.BurstHandler)
	attr.Handler.Attached(c)
	for i := range attr.Recvs {
		r := attr.Recvs[i]
		r.Next = nil
		if err := c.PostRecv(&r); err != nil {
			return err
		}
	}
	return nil
}

// start runs the completion and CM event goroutines.
func (c *conn) start() {
	c.wg.Add(2)
	go c.pollLoop()
	go c.eventLoop()
}

// fail reports the connection's failure once, unless it is being closed.
func (c *conn) fail(err error) {
	if c.closing.Load() || !c.failed.CompareAndSwap(false, true) {
		return
	}
	c.h.Disconnected(err)
}

func (c *conn) pollLoop() {
	defer c.wg.Done()
	wcs := make([]ibverbs.WC, ibverbs.MaxPoll)
	var fwc fabric.WC
	for {
		if err := c.cq.ReqNotify(); err != nil {
			c.fail(err)
			return
		}
		// Everything that completed before the notification was armed,
		// and what completes while a batch is delivered: the poll is
		// done in user space, the wait and the re-arm are system calls.
		for {
			n, err := c.cq.Poll(wcs)
			if err != nil {
				c.fail(err)
				return
			}
			if n == 0 {
				break
			}
			c.burst(true)
			for i := 0; i < n; i++ {
				c.deliver(&wcs[i], &fwc)
			}
			c.burst(false)
		}
		if _, err := c.cc.Wait(); err != nil {
			return // interrupted by Close
		}
	}
}

// WCError is a work request that failed on the device.
type WCError struct {
	Status    ibverbs.WCStatus
	VendorErr uint32
}

func (e *WCError) Error() string {
	return fmt.Sprintf("rdma fabric: work request failed: %v (vendor error %#x)", e.Status, e.VendorErr)
}

func (e *WCError) Unwrap() error {
	switch e.Status {
	case ibverbs.WCRemAccessErr, ibverbs.WCLocProtErr:
		return syscall.EACCES
	case ibverbs.WCLocLenErr:
		return syscall.EMSGSIZE
	case ibverbs.WCRetryExcErr, ibverbs.WCRNRRetryExc:
		return syscall.ETIMEDOUT
	}
	return syscall.EIO
}

// windowMR is a region registered for local access and window binding,
// with a type 1 window over it for the remote access (fabric.WindowMR).
type windowMR struct {
	buf    []byte
	mr     *ibverbs.MR
	mw     *ibverbs.MW
	access ibverbs.Access // the window's
	rkey   atomic.Uint32
}

func (p *pd) registerWindow(buf []byte, access fabric.Access) (*windowMR, error) {
	m, err := p.p.RegMR(buf, ibverbs.AccessLocalWrite|ibverbs.AccessMWBind)
	if err != nil {
		return nil, err
	}
	w, err := p.p.AllocMW()
	if err != nil {
		m.Close()
		return nil, err
	}
	// The window carries the remote rights only (verbsAccess adds local
	// write to remote write, as a registration needs).
	return &windowMR{buf: buf, mr: m, mw: w, access: verbsAccess(access) &^ ibverbs.AccessLocalWrite}, nil
}

func (m *windowMR) Buf() []byte  { return m.buf }
func (m *windowMR) Addr() uint64 { return uint64(uintptr(unsafe.Pointer(&m.buf[0]))) }
func (m *windowMR) LKey() uint32 { return m.mr.LKey() }
func (m *windowMR) RKey() uint32 { return m.rkey.Load() }

var errWindowByWR = errors.New("rdma fabric: a window is bound and unbound by work requests (WindowMR)")

func (m *windowMR) Invalidate() error           { return errWindowByWR }
func (m *windowMR) Reregister() (uint32, error) { return 0, errWindowByWR }

func (m *windowMR) Bind(c fabric.Conn) (uint32, error) {
	cc, ok := c.(*conn)
	if !ok {
		return 0, fmt.Errorf("rdma fabric: bind on a %T", c)
	}
	if err := cc.qp.BindMW(m.mw, m.mr, m.buf, m.access, 0, false); err != nil {
		return 0, postErr(err)
	}
	k := m.mw.RKey()
	m.rkey.Store(k)
	return k, nil
}

func (m *windowMR) Unbind(c fabric.Conn, id uint64) error {
	cc, ok := c.(*conn)
	if !ok {
		return fmt.Errorf("rdma fabric: unbind on a %T", c)
	}
	return postErr(cc.qp.BindMW(m.mw, m.mr, nil, 0, id, true))
}

func (m *windowMR) Close() error {
	return errors.Join(m.mw.Close(), m.mr.Close())
}

func (c *conn) deliver(w *ibverbs.WC, out *fabric.WC) {
	if c.failed.Load() || c.closing.Load() {
		return // what follows an error is flushed
	}
	if w.Status == ibverbs.WCWRFlushErr {
		// Flushed before anything failed: the QP was moved to the error
		// state from outside (the peer's or the CM's disconnect).
		c.fail(fmt.Errorf("rdma fabric: work requests flushed: %w", ErrDisconnected))
		return
	}
	if w.Status != ibverbs.WCSuccess {
		c.fail(&WCError{Status: w.Status, VendorErr: w.VendorErr})
		return
	}
	*out = fabric.WC{ID: w.ID, Status: fabric.WCSuccess, ByteLen: w.ByteLen, Imm: w.Imm, InvRKey: w.InvRKey}
	switch w.Opcode {
	case ibverbs.WCSend:
		out.Opcode = fabric.WCSend
	case ibverbs.WCRDMAWrite:
		out.Opcode = fabric.WCWrite
	case ibverbs.WCRecv:
		out.Opcode = fabric.WCRecv
	case ibverbs.WCRecvRDMAWithImm:
		out.Opcode = fabric.WCRecvRDMAWithImm
	case ibverbs.WCBindMW:
		out.Opcode = fabric.WCBind
	default:
		return // a local invalidate of our own
	}
	if w.Flags&ibverbs.WCFlagWithImm != 0 {
		out.Flags |= fabric.WCWithImm
	}
	if w.Flags&ibverbs.WCFlagWithInv != 0 {
		out.Flags |= fabric.WCWithInv
	}
	c.h.Completion(out)
}

// ErrDisconnected is what Handler.Disconnected gets when the peer (or
// the network) ended the connection.
var ErrDisconnected = fmt.Errorf("rdma fabric: disconnected: %w", syscall.ECONNRESET)

// disconnectGrace is how long a disconnect from the peer waits for a
// work completion that explains it: a peer that tears the connection down
// because of our remote access error sends its DREQ about when the NAK
// reaches our CQ, and the error says more than "disconnected".
const disconnectGrace = 100 * time.Millisecond

// peerGone reports err once the CQ had a moment to report something
// better.
func (c *conn) peerGone(err error) {
	for end := time.Now().Add(disconnectGrace); !c.failed.Load() && time.Now().Before(end); {
		time.Sleep(5 * time.Millisecond)
	}
	c.fail(err)
}

func (c *conn) eventLoop() {
	defer c.wg.Done()
	for {
		ev, err := c.ch.Next()
		if err != nil {
			return // interrupted by Close
		}
		switch ev.Type {
		case ibverbs.EventEstablished, ibverbs.EventTimewaitExit:
		case ibverbs.EventDisconnected:
			c.peerGone(ErrDisconnected)
		case ibverbs.EventRejected, ibverbs.EventConnectError, ibverbs.EventUnreachable:
			// The peer (or the CM on its behalf) ended a connection its
			// side had not seen established yet: a REJ, not a DREQ.
			c.peerGone(fmt.Errorf("rdma fabric: %v: %w", ev.Type, ErrDisconnected))
		case ibverbs.EventDeviceRemoval:
			c.fail(fmt.Errorf("rdma fabric: device removed: %w", syscall.ENODEV))
		case ibverbs.EventAddrChange:
			c.fail(fmt.Errorf("rdma fabric: address changed: %w", syscall.EADDRNOTAVAIL))
		default:
			c.fail(fmt.Errorf("rdma fabric: %v: %w", ev.Type, cmErrno(ev)))
		}
	}
}

func sendOpcode(op fabric.Opcode) (ibverbs.WROpcode, error) {
	switch op {
	case fabric.OpWrite:
		return ibverbs.WRRDMAWrite, nil
	case fabric.OpWriteImm:
		return ibverbs.WRRDMAWriteWithImm, nil
	case fabric.OpSend:
		return ibverbs.WRSend, nil
	case fabric.OpSendImm:
		return ibverbs.WRSendWithImm, nil
	case fabric.OpSendInv:
		return ibverbs.WRSendWithInv, nil
	}
	return 0, fmt.Errorf("rdma fabric: opcode %v: %w", op, syscall.EINVAL)
}

func sge(b []byte, lkey uint32) ibverbs.SGE {
	if len(b) == 0 {
		return ibverbs.SGE{}
	}
	return ibverbs.SGE{Addr: uint64(uintptr(unsafe.Pointer(&b[0]))), Length: uint32(len(b)), LKey: lkey}
}

func postErr(err error) error {
	if errors.Is(err, syscall.ENOMEM) {
		return fmt.Errorf("%w: %w", fabric.ErrQueueFull, err)
	}
	if errors.Is(err, ibverbs.ErrClosed) {
		return fabric.ErrClosed
	}
	return err
}

// PostSend posts the chain, held until the end of the batch of
// completions being delivered or, with More, until Flush; held or not,
// at most ibverbs.MaxChain work requests go to the QP in one call.
// Windows' binds and unbinds are posted at once, ahead of what is held:
// a bind need only precede the answer that publishes its key, which is
// posted after it.
func (c *conn) PostSend(wr *fabric.SendWR) error {
	more := true
	for w := wr; w != nil; w = w.Next {
		if _, err := sendOpcode(w.Op); err != nil {
			return err
		}
		more = more && w.More
	}
	c.heldMu.Lock()
	defer c.heldMu.Unlock()
	for ; wr != nil; wr = wr.Next {
		if c.nHeld == len(c.held) {
			if err := c.postHeld(); err != nil {
				return err
			}
		}
		op, _ := sendOpcode(wr.Op)
		b := &c.held[c.nHeld]
		*b = ibverbs.SendWR{ID: wr.ID, Opcode: op, RemoteAddr: wr.RemoteAddr, RKey: wr.RKey,
			Imm: wr.Imm, InvRKey: wr.InvRKey}
		if wr.Signaled {
			b.Flags = ibverbs.SendSignaled
		}
		for i := 0; i < wr.NumSGE && i < fabric.MaxSGE; i++ {
			if len(wr.SG[i].Buf) == 0 {
				continue
			}
			b.SG[b.NumSGE] = sge(wr.SG[i].Buf, wr.SG[i].LKey)
			b.NumSGE++
		}
		c.nHeld++
	}
	if c.inBurst || more {
		return nil
	}
	return c.postHeld()
}

// postHeld posts what is held; c.heldMu is held. On an error nothing
// stays held: the connection has failed or is failing.
func (c *conn) postHeld() error {
	n := c.nHeld
	if n == 0 {
		return nil
	}
	c.nHeld = 0
	return postErr(c.qp.PostSend(c.held[:n]))
}

// Flush posts what was posted with More (fabric.Flusher).
func (c *conn) Flush() {
	c.heldMu.Lock()
	err := c.postHeld()
	c.heldMu.Unlock()
	if err != nil {
		c.fail(err)
	}
}

// burst marks the start (true) or the end of a batch of completions. At
// the end the handler is told (fabric.BurstHandler) and what the batch
// posted goes to the QP in one call.
func (c *conn) burst(start bool) {
	if !start && c.bh != nil {
		c.bh.BurstEnd()
	}
	c.heldMu.Lock()
	c.inBurst = start
	var err error
	if !start {
		err = c.postHeld()
	}
	c.heldMu.Unlock()
	if err != nil {
		c.fail(err)
	}
}

// PostRecv posts the chain in batches of up to ibverbs.MaxChain.
func (c *conn) PostRecv(wr *fabric.RecvWR) error {
	var batch [ibverbs.MaxChain]ibverbs.RecvWR
	for wr != nil {
		n := 0
		for ; wr != nil && n < len(batch); wr = wr.Next {
			batch[n] = ibverbs.RecvWR{ID: wr.ID}
			if len(wr.Buf) > 0 {
				batch[n].SG, batch[n].NumSGE = sge(wr.Buf, wr.LKey), 1
			}
			n++
		}
		if err := c.qp.PostRecv(batch[:n]); err != nil {
			return postErr(err)
		}
	}
	return nil
}

func (c *conn) LocalAddr() netip.AddrPort  { return c.local }
func (c *conn) RemoteAddr() netip.AddrPort { return c.remote }

// Close disconnects, stops both goroutines and destroys the QP, the ID,
// the CQ and the channels. No handler call follows it.
func (c *conn) Close() error {
	c.closeOnce.Do(func() {
		c.closing.Store(true)
		c.id.Disconnect()
		c.destroy()
	})
	return nil
}

// destroy interrupts and waits for the goroutines (if started), then
// frees everything in reverse order of construction.
func (c *conn) destroy() {
	if c.cc != nil {
		c.cc.Interrupt()
	}
	c.ch.Interrupt()
	c.wg.Wait()
	c.ch.Close() // the ID and its QP
	if c.cc != nil {
		c.cc.Close() // the CQ
	}
}

// Listen accepts connection requests on addr (rdma_listen in the TCP port
// space; an unspecified address listens on every RDMA device).
func (f *Fabric) Listen(addr netip.AddrPort) (fabric.Listener, error) {
	ch, err := ibverbs.NewEventChannel()
	if err != nil {
		return nil, notSupported(err)
	}
	id, err := ch.CreateID(ibverbs.PortSpaceTCP)
	if err == nil {
		err = id.Bind(addr)
	}
	if err == nil {
		err = id.Listen(f.opts.Backlog)
	}
	if err != nil {
		ch.Close()
		return nil, notSupported(err)
	}
	a := id.LocalAddr()
	if !a.IsValid() {
		a = addr
	}
	l := &listener{f: f, ch: ch, id: id, addr: a, reqs: make(chan *connRequest, f.opts.Backlog), done: make(chan struct{})}
	l.wg.Add(1)
	go l.run()
	return l, nil
}

type listener struct {
	f    *Fabric
	ch   *ibverbs.EventChannel
	id   *ibverbs.CMID
	addr netip.AddrPort
	reqs chan *connRequest
	done chan struct{}
	once sync.Once
	wg   sync.WaitGroup
}

// run takes connection requests off the listener's channel. A request the
// backlog has no room for is rejected at once.
func (l *listener) run() {
	defer l.wg.Done()
	for {
		ev, err := l.ch.Next()
		if err != nil {
			return
		}
		if ev.Type != ibverbs.EventConnectRequest || ev.ID == nil {
			continue
		}
		r := &connRequest{l: l, id: ev.ID, priv: ev.PrivateData}
		select {
		case l.reqs <- r:
		default:
			r.Reject(nil)
		}
	}
}

func (l *listener) Accept(ctx context.Context) (fabric.ConnRequest, error) {
	select {
	case r := <-l.reqs:
		return r, nil
	case <-l.done:
		return nil, fabric.ErrClosed
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (l *listener) Addr() netip.AddrPort { return l.addr }

// Close stops listening; requests not yet accepted are rejected.
func (l *listener) Close() error {
	l.once.Do(func() {
		close(l.done)
		l.ch.Interrupt()
		l.wg.Wait()
		for {
			select {
			case r := <-l.reqs:
				r.Reject(nil)
				continue
			default:
			}
			break
		}
		l.ch.Close()
	})
	return nil
}

// connRequest is an RDMA_CM_EVENT_CONNECT_REQUEST: its ID belongs to the
// listener's channel until Accept moves it to a channel of its own.
type connRequest struct {
	l    *listener
	id   *ibverbs.CMID
	priv []byte
	done atomic.Bool
}

func (r *connRequest) PrivateData() []byte        { return r.priv }
func (r *connRequest) LocalAddr() netip.AddrPort  { return r.id.LocalAddr() }
func (r *connRequest) RemoteAddr() netip.AddrPort { return r.id.PeerAddr() }

func (r *connRequest) Device() fabric.Device {
	return &device{f: r.l.f, x: r.id.Context(), port: r.id.Port()}
}

// Accept creates the connection in p: its ID moves to an event channel of
// its own, the QP is made and attr.Recvs posted, then rdma_accept answers
// with priv.
func (r *connRequest) Accept(p fabric.PD, attr fabric.ConnAttr, priv []byte) (fabric.Conn, error) {
	if !r.done.CompareAndSwap(false, true) {
		return nil, errors.New("rdma fabric: connection request already answered")
	}
	ppd, ok := p.(*pd)
	if !ok || ppd.dev.x != r.id.Context() {
		r.id.Reject(nil)
		r.id.Close()
		return nil, errors.New("rdma fabric: the PD is not of the request's device")
	}
	ch, err := ibverbs.NewEventChannel()
	if err != nil {
		r.id.Reject(nil)
		r.id.Close()
		return nil, err
	}
	if err := r.id.Migrate(ch); err != nil {
		ch.Close()
		r.id.Reject(nil)
		r.id.Close()
		return nil, err
	}
	c := &conn{ch: ch, id: r.id, h: attr.Handler}
	if err := c.setup(ppd, attr); err != nil {
		r.id.Reject(nil)
		c.destroy()
		return nil, err
	}
	c.local, c.remote = r.id.LocalAddr(), r.id.PeerAddr()
	if err := r.id.Accept(connParam(priv)); err != nil {
		c.destroy()
		return nil, err
	}
	c.start()
	return c, nil
}

// Reject refuses the request with priv (an rtrs conn_rsp with an errno)
// and frees its ID.
func (r *connRequest) Reject(priv []byte) error {
	if !r.done.CompareAndSwap(false, true) {
		return nil
	}
	err := r.id.Reject(priv)
	r.id.Close()
	return err
}
