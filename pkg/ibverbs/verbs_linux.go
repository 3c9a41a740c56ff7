//go:build cgo && linux

package ibverbs

// #cgo LDFLAGS: -libverbs -lrdmacm
// #include <stdlib.h>
// #include "verbs_shim.h"
import "C"

import (
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Supported reports whether this build can do RDMA (it has cgo); a
// machine may still have no device.
const Supported = true

// node is the part every object shares: its closed flag, its children
// and its place in the leak tracker.
type node struct {
	mu sync.Mutex
	// +checklocks:mu
	closed bool
	parent *node
	// +checklocks:mu
	children map[closer]struct{}
	h        uint64
}

type closer interface {
	Close() error
}

func (n *node) init(kind string, parent *node, self closer) {
	n.h = track(kind)
	if parent != nil {
		n.parent = parent
		parent.mu.Lock()
		if parent.children == nil {
			parent.children = map[closer]struct{}{}
		}
		parent.children[self] = struct{}{}
		parent.mu.Unlock()
	}
}

// begin marks the object closed and closes its children; it reports
// false if it was closed already.
func (n *node) begin() bool {
	if !n.markClosed() {
		return false
	}
	n.closeChildren()
	return true
}

func (n *node) markClosed() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return false
	}
	n.closed = true
	return true
}

func (n *node) closeChildren() {
	n.mu.Lock()
	kids := make([]closer, 0, len(n.children))
	for c := range n.children {
		kids = append(kids, c)
	}
	n.mu.Unlock()
	for _, c := range kids {
		c.Close()
	}
}

// end forgets the object: the tracker and its parent no longer list it.
func (n *node) end(self closer) {
	untrack(n.h)
	if p := n.parent; p != nil {
		p.mu.Lock()
		delete(p.children, self)
		p.mu.Unlock()
	}
}

func (n *node) isClosed() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.closed
}

// Devices lists the RDMA devices (ibv_get_device_list). An empty list is
// no error.
func Devices() ([]string, error) {
	var n C.int
	list := C.ibv_get_device_list(&n)
	if list == nil {
		if n == 0 {
			return nil, nil
		}
		return nil, errnoErr("ibv_get_device_list", -int(syscall.ENOSYS))
	}
	defer C.ibv_free_device_list(list)
	devs := unsafe.Slice(list, int(n))
	names := make([]string, 0, len(devs))
	for _, d := range devs {
		names = append(names, C.GoString(C.ibv_get_device_name(d)))
	}
	return names, nil
}

// Context is an opened device (struct ibv_context). One opened by
// OpenDevice is ours and Close closes it; one an rdma_cm ID runs on
// belongs to librdmacm, and its Close only closes what was made on it.
// It is safe for concurrent use, but for Close, which must come after
// the calls that make objects on it have returned.
type Context struct {
	n     node
	c     *C.struct_ibv_context
	owned bool
	name  string
}

var cmContexts struct {
	sync.Mutex
	// +checklocks:Mutex
	m map[*C.struct_ibv_context]*Context
}

// cmContext is the Context of a device librdmacm opened: one Go object
// per device, so PDs made through one ID serve the others.
func cmContext(c *C.struct_ibv_context) *Context {
	cmContexts.Lock()
	defer cmContexts.Unlock()
	if cmContexts.m == nil {
		cmContexts.m = map[*C.struct_ibv_context]*Context{}
	}
	if x := cmContexts.m[c]; x != nil {
		return x
	}
	x := &Context{c: c, name: deviceName(c)}
	cmContexts.m[c] = x
	return x
}

// OpenDevice opens the device called name (ibv_open_device).
func OpenDevice(name string) (*Context, error) {
	var n C.int
	list := C.ibv_get_device_list(&n)
	if list == nil {
		return nil, errnoErr("ibv_get_device_list", -int(syscall.ENODEV))
	}
	defer C.ibv_free_device_list(list)
	for _, d := range unsafe.Slice(list, int(n)) {
		if C.GoString(C.ibv_get_device_name(d)) != name {
			continue
		}
		c := C.ibv_open_device(d)
		if c == nil {
			return nil, errnoErr("ibv_open_device", -int(syscall.EIO))
		}
		x := &Context{c: c, owned: true, name: name}
		x.n.init("Context "+name, nil, x)
		return x, nil
	}
	return nil, errnoErr("ibv_open_device "+name, -int(syscall.ENODEV))
}

// Name is the device's name (mlx5_0, rxe0).
func (x *Context) Name() string { return x.name }

// Query reports the device's attributes.
func (x *Context) Query() (DeviceAttr, error) {
	var flags C.uint64_t
	var qpwr, cqe, mw C.int
	if err := errnoErr("ibv_query_device", int(C.rnbd_query_device(x.c, &flags, &qpwr, &cqe, &mw))); err != nil {
		return DeviceAttr{}, err
	}
	return DeviceAttr{CapFlags: uint64(flags), MaxQPWR: int(qpwr), MaxCQE: int(cqe), MaxMW: int(mw)}, nil
}

// Close closes what was made on the context, and the device if it was
// opened by OpenDevice. Idempotent.
func (x *Context) Close() error {
	if !x.owned {
		// librdmacm's: close the children only; the context stays.
		x.n.closeChildren()
		return nil
	}
	if !x.n.begin() {
		return nil
	}
	defer x.n.end(x)
	return errnoErr("ibv_close_device", -int(C.ibv_close_device(x.c)))
}

// PD is a protection domain. It is safe for concurrent use, but for
// Close, which must come after the calls that register on it (RegMR,
// AllocMW) have returned.
type PD struct {
	n  node
	pd *C.struct_ibv_pd
	x  *Context
}

// AllocPD allocates a protection domain on the device.
func (x *Context) AllocPD() (*PD, error) {
	pd := C.ibv_alloc_pd(x.c)
	if pd == nil {
		return nil, errnoErr("ibv_alloc_pd", -int(syscall.ENOMEM))
	}
	p := &PD{pd: pd, x: x}
	p.n.init("PD on "+x.name, &x.n, p)
	return p, nil
}

// Context is the device the PD is on.
func (p *PD) Context() *Context { return p.x }

// Close deregisters the PD's memory regions and windows, then frees it;
// queue pairs on it must be gone (EBUSY otherwise). Idempotent.
func (p *PD) Close() error {
	if !p.n.begin() {
		return nil
	}
	defer p.n.end(p)
	return errnoErr("ibv_dealloc_pd", -int(C.ibv_dealloc_pd(p.pd)))
}

// MR is a registered memory region. It is safe for concurrent use: its
// keys and address do not change, and Close is idempotent; it must not be
// used once closed.
type MR struct {
	n   node
	mr  *C.struct_ibv_mr
	buf []byte
}

// RegMR registers buf, which must not be Go heap memory (AllocMemory, or
// mmap): the device keeps its address.
func (p *PD) RegMR(buf []byte, access Access) (*MR, error) {
	if len(buf) == 0 {
		return nil, &Error{Op: "ibv_reg_mr", Err: syscall.EINVAL}
	}
	mr := C.ibv_reg_mr(p.pd, unsafe.Pointer(&buf[0]), C.size_t(len(buf)), C.int(access))
	if mr == nil {
		return nil, errnoErr("ibv_reg_mr", -int(syscall.ENOMEM))
	}
	m := &MR{mr: mr, buf: buf}
	m.n.init("MR", &p.n, m)
	return m, nil
}

func (m *MR) Buf() []byte  { return m.buf }
func (m *MR) Addr() uint64 { return uint64(uintptr(m.mr.addr)) }
func (m *MR) LKey() uint32 { return uint32(m.mr.lkey) }
func (m *MR) RKey() uint32 { return uint32(m.mr.rkey) }

// Close deregisters the region. Idempotent.
func (m *MR) Close() error {
	if !m.n.begin() {
		return nil
	}
	defer m.n.end(m)
	return errnoErr("ibv_dereg_mr", -int(C.ibv_dereg_mr(m.mr)))
}

// MW is a memory window (type 1: bound with QP.BindMW, any QP of the PD
// may use it). RKey reads the key the last QP.BindMW set, so it must
// not be called while a QP.BindMW of the window runs on another
// goroutine; Close may be called from any goroutine.
type MW struct {
	n  node
	mw *C.struct_ibv_mw
}

// AllocMW allocates a type 1 memory window; an error wraps
// ErrNotSupported where the device has none.
func (p *PD) AllocMW() (*MW, error) {
	mw := C.ibv_alloc_mw(p.pd, C.IBV_MW_TYPE_1)
	if mw == nil {
		return nil, errnoErr("ibv_alloc_mw", -int(syscall.ENOSYS))
	}
	w := &MW{mw: mw}
	w.n.init("MW", &p.n, w)
	return w, nil
}

// RKey is the window's current rkey; every bind changes it.
func (w *MW) RKey() uint32 { return uint32(w.mw.rkey) }

// Close frees the window. Idempotent.
func (w *MW) Close() error {
	if !w.n.begin() {
		return nil
	}
	defer w.n.end(w)
	return errnoErr("ibv_dealloc_mw", -int(C.ibv_dealloc_mw(w.mw)))
}

// pollable wraps a non-blocking channel fd in Go's network poller: a
// dup, so closing it wakes a waiter without closing the channel's own.
type pollable struct {
	f  *os.File
	rc syscall.RawConn
	// tryFn is the current waiter's; readFn wraps it for RawConn.Read
	// (made once: one waiter at a time, no allocation per wait).
	tryFn  func() bool
	readFn func(uintptr) bool

	mu sync.Mutex
	// +checklocks:mu
	closed  bool
	waiters sync.WaitGroup
}

func newPollable(fd C.int, name string) (*pollable, error) {
	if err := errnoErr("fcntl O_NONBLOCK", int(C.rnbd_set_nonblock(fd))); err != nil {
		return nil, err
	}
	d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, &Error{Op: "dup " + name, Err: err.(syscall.Errno)}
	}
	f := os.NewFile(uintptr(d), name)
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	p := &pollable{f: f, rc: rc}
	p.readFn = func(uintptr) bool { return p.tryFn() }
	return p, nil
}

// wait calls try whenever the fd is readable until it reports done; it
// returns ErrClosed once the pollable is closed.
func (p *pollable) wait(try func() bool) error {
	p.tryFn = try
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return ErrClosed
	}
	p.waiters.Add(1)
	p.mu.Unlock()
	defer p.waiters.Done()
	if err := p.rc.Read(p.readFn); err != nil {
		return ErrClosed
	}
	return nil
}

// close wakes the waiters and waits until they are out of C. Idempotent.
func (p *pollable) close() {
	p.mu.Lock()
	was := p.closed
	p.closed = true
	p.mu.Unlock()
	if !was {
		p.f.Close()
	}
	p.waiters.Wait()
}

// CompChannel is a completion channel: its CQs' events, waited on in
// Go's poller. One goroutine calls Wait (the waiter's state is the
// channel's); Interrupt and Close may be called from any other, and wake
// it.
type CompChannel struct {
	n  node
	ch *C.struct_ibv_comp_channel
	p  *pollable

	// The waiter's state: one closure for the channel's life, so that a
	// Wait allocates nothing.
	res C.int
	cq  *C.struct_ibv_cq
	try func() bool

	mu sync.Mutex
	// +checklocks:mu
	cqs map[*C.struct_ibv_cq]*CQ
}

// NewCompChannel creates a completion channel on the device.
func (x *Context) NewCompChannel() (*CompChannel, error) {
	ch := C.ibv_create_comp_channel(x.c)
	if ch == nil {
		return nil, errnoErr("ibv_create_comp_channel", -int(syscall.ENOMEM))
	}
	p, err := newPollable(ch.fd, "ibv_comp_channel")
	if err != nil {
		C.ibv_destroy_comp_channel(ch)
		return nil, err
	}
	c := &CompChannel{ch: ch, p: p, cqs: map[*C.struct_ibv_cq]*CQ{}}
	c.try = func() bool {
		c.res = C.rnbd_get_cq_event(c.ch, &c.cq)
		return c.res != -C.EAGAIN
	}
	c.n.init("CompChannel on "+x.name, &x.n, c)
	return c, nil
}

// Wait blocks (in the poller, not on a thread) until one of the
// channel's CQs has an event, acknowledges it and returns the CQ. It
// returns ErrClosed once the channel is closed. One goroutine waits.
func (c *CompChannel) Wait() (*CQ, error) {
	if err := c.p.wait(c.try); err != nil {
		return nil, err
	}
	if c.res < 0 {
		return nil, errnoErr("ibv_get_cq_event", int(c.res))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cqs[c.cq], nil
}

// Interrupt wakes a Wait, which returns ErrClosed, as do all later
// ones; it returns once the waiter is out of C. Idempotent.
func (c *CompChannel) Interrupt() { c.p.close() }

// Close interrupts, closes the channel's CQs (their QPs must be gone:
// EBUSY otherwise) and destroys it. Idempotent.
func (c *CompChannel) Close() error {
	if !c.n.markClosed() {
		return nil
	}
	defer c.n.end(c)
	c.p.close()
	c.n.closeChildren()
	return errnoErr("ibv_destroy_comp_channel", -int(C.ibv_destroy_comp_channel(c.ch)))
}

// CQ is a completion queue. One goroutine polls it (Poll, ReqNotify;
// Poll's buffer is the CQ's): it is not safe for concurrent use, and
// Close must come after that goroutine has stopped polling.
type CQ struct {
	n      node
	cq     *C.struct_ibv_cq
	ch     *CompChannel
	wcs    *C.struct_rnbd_wc // RNBD_MAX_POLL, C memory
	closed atomic.Bool
}

// NewCQ creates a completion queue of at least cqe entries whose events
// go to ch (nil: none; poll only).
func (x *Context) NewCQ(cqe int, ch *CompChannel) (*CQ, error) {
	var cch *C.struct_ibv_comp_channel
	if ch != nil {
		cch = ch.ch
	}
	cq := C.ibv_create_cq(x.c, C.int(cqe), nil, cch, 0)
	if cq == nil {
		return nil, errnoErr("ibv_create_cq", -int(syscall.ENOMEM))
	}
	q := &CQ{cq: cq, ch: ch, wcs: (*C.struct_rnbd_wc)(C.calloc(C.RNBD_MAX_POLL, C.sizeof_struct_rnbd_wc))}
	parent := &x.n
	if ch != nil {
		ch.mu.Lock()
		ch.cqs[cq] = q
		ch.mu.Unlock()
		parent = &ch.n
	}
	q.n.init("CQ on "+x.name, parent, q)
	return q, nil
}

// ReqNotify asks for an event on the channel at the next completion.
func (q *CQ) ReqNotify() error { return errnoErr("ibv_req_notify_cq", int(C.rnbd_req_notify(q.cq))) }

// MaxPoll is the most completions one Poll returns.
const MaxPoll = C.RNBD_MAX_POLL

// Poll takes up to len(out) (at most MaxPoll) completions in one call.
func (q *CQ) Poll(out []WC) (int, error) {
	if q.closed.Load() {
		return 0, ErrClosed
	}
	n := int(C.rnbd_poll_cq(q.cq, q.wcs, C.int(min(len(out), MaxPoll))))
	if n < 0 {
		return 0, errnoErr("ibv_poll_cq", n)
	}
	for i, w := range unsafe.Slice(q.wcs, n) {
		out[i] = WC{ID: uint64(w.wr_id), Status: WCStatus(w.status), Opcode: WCOpcode(w.opcode),
			ByteLen: uint32(w.byte_len), Imm: uint32(w.imm), InvRKey: uint32(w.inv_rkey),
			Flags: uint32(w.wc_flags), QPNum: uint32(w.qp_num), VendorErr: uint32(w.vendor_err)}
	}
	return n, nil
}

// Close destroys the CQ; its QPs must be gone. Idempotent.
func (q *CQ) Close() error {
	if !q.n.begin() {
		return nil
	}
	defer q.n.end(q)
	q.closed.Store(true)
	if q.ch != nil {
		q.ch.mu.Lock()
		delete(q.ch.cqs, q.cq)
		q.ch.mu.Unlock()
	}
	err := errnoErr("ibv_destroy_cq", -int(C.ibv_destroy_cq(q.cq)))
	C.free(unsafe.Pointer(q.wcs))
	return err
}

// QP is a reliable-connection queue pair, made on an rdma_cm ID.
// PostSend, BindMW (under sendMu) and PostRecv (under recvMu) are safe
// for concurrent use, also with Close, after which they return ErrClosed.
type QP struct {
	n  node
	qp *C.struct_ibv_qp
	id *CMID

	sendMu sync.Mutex
	// +checklocks:sendMu
	swr    *C.struct_rnbd_send_wr // MaxChain, C memory
	recvMu sync.Mutex
	// +checklocks:recvMu
	rwr    *C.struct_rnbd_recv_wr // MaxChain, C memory
	closed atomic.Bool
}

// Num is the QP number.
func (qp *QP) Num() uint32 { return uint32(C.rnbd_qp_num(qp.qp)) }

// PostSend posts a chain of up to MaxChain work requests in one call.
// Their buffers must be registered memory and stay put until the
// requests complete. An error wraps the errno (ENOMEM: the send queue is
// full) and none of the requests from the failed one on were posted.
func (qp *QP) PostSend(wrs []SendWR) error {
	if len(wrs) == 0 || len(wrs) > MaxChain {
		return &Error{Op: "ibv_post_send", Err: syscall.EINVAL}
	}
	qp.sendMu.Lock()
	defer qp.sendMu.Unlock()
	if qp.closed.Load() {
		return ErrClosed
	}
	out := unsafe.Slice(qp.swr, len(wrs))
	for i := range wrs {
		w, o := &wrs[i], &out[i]
		o.wr_id = C.uint64_t(w.ID)
		o.remote_addr = C.uint64_t(w.RemoteAddr)
		o.opcode = C.uint32_t(w.Opcode)
		o.send_flags = C.uint32_t(w.Flags)
		o.rkey = C.uint32_t(w.RKey)
		o.imm = C.uint32_t(w.Imm)
		o.invalidate_rkey = C.uint32_t(w.InvRKey)
		o.num_sge = C.uint32_t(w.NumSGE)
		for j := 0; j < w.NumSGE && j < MaxSGE; j++ {
			o.sg[j] = C.struct_rnbd_sge{addr: C.uint64_t(w.SG[j].Addr), length: C.uint32_t(w.SG[j].Length), lkey: C.uint32_t(w.SG[j].LKey)}
		}
	}
	return errnoErr("ibv_post_send", postSend(qp.qp, qp.swr, len(wrs)))
}

// PostRecv posts a chain of up to MaxChain receive work requests.
func (qp *QP) PostRecv(wrs []RecvWR) error {
	if len(wrs) == 0 || len(wrs) > MaxChain {
		return &Error{Op: "ibv_post_recv", Err: syscall.EINVAL}
	}
	qp.recvMu.Lock()
	defer qp.recvMu.Unlock()
	if qp.closed.Load() {
		return ErrClosed
	}
	out := unsafe.Slice(qp.rwr, len(wrs))
	for i := range wrs {
		w, o := &wrs[i], &out[i]
		o.wr_id = C.uint64_t(w.ID)
		o.num_sge = C.uint32_t(w.NumSGE)
		o.sg = C.struct_rnbd_sge{addr: C.uint64_t(w.SG.Addr), length: C.uint32_t(w.SG.Length), lkey: C.uint32_t(w.SG.LKey)}
	}
	return errnoErr("ibv_post_recv", postRecv(qp.qp, qp.rwr, len(wrs)))
}

// BindMW binds a type 1 window over buf in mr (len(buf) > 0), or unbinds
// it (buf empty: the window then grants nothing); the window's rkey
// changes. The bind is a send work request with id wrID. An unbind still
// names mr, with a zero length: providers (rxe) read the MR of every
// bind.
func (qp *QP) BindMW(mw *MW, mr *MR, buf []byte, access Access, wrID uint64, signaled bool) error {
	addr := uint64(uintptr(unsafe.Pointer(&mr.buf[0])))
	var n uint64
	if len(buf) > 0 {
		addr, n = uint64(uintptr(unsafe.Pointer(&buf[0]))), uint64(len(buf))
	}
	sig := C.int(0)
	if signaled {
		sig = 1
	}
	qp.sendMu.Lock()
	defer qp.sendMu.Unlock()
	if qp.closed.Load() {
		return ErrClosed
	}
	return errnoErr("ibv_bind_mw", bindMW(qp.qp, mw.mw, mr.mr, addr, n, access, wrID, sig))
}

// The C calls made with a lock held are made in these functions, which
// hold none: cgo wraps a call that passes a pointer in a closure, which
// checklocks (make vet) takes for a function returning with its
// caller's lock held.

func deviceName(c *C.struct_ibv_context) string { return C.GoString(C.rnbd_device_name(c)) }

func postSend(qp *C.struct_ibv_qp, w *C.struct_rnbd_send_wr, n int) int {
	return int(C.rnbd_post_send(qp, w, C.int(n), nil))
}

func postRecv(qp *C.struct_ibv_qp, w *C.struct_rnbd_recv_wr, n int) int {
	return int(C.rnbd_post_recv(qp, w, C.int(n), nil))
}

func bindMW(qp *C.struct_ibv_qp, mw *C.struct_ibv_mw, mr *C.struct_ibv_mr, addr, n uint64, access Access, wrID uint64, sig C.int) int {
	return int(C.rnbd_bind_mw(qp, mw, mr, C.uint64_t(addr), C.uint64_t(n), C.uint32_t(access), C.uint64_t(wrID), sig))
}

// Close destroys the QP (rdma_destroy_qp): outstanding work requests are
// flushed. Idempotent.
func (qp *QP) Close() error {
	if !qp.n.begin() {
		return nil
	}
	defer qp.n.end(qp)
	qp.sendMu.Lock()
	qp.recvMu.Lock()
	qp.closed.Store(true)
	swr, rwr := qp.swr, qp.rwr // no post touches them once closed
	qp.recvMu.Unlock()
	qp.sendMu.Unlock()
	C.rdma_destroy_qp(qp.id.id)
	C.free(unsafe.Pointer(swr))
	C.free(unsafe.Pointer(rwr))
	return nil
}
