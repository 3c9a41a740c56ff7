//go:build cgo && linux

// librdmacm: event channels, rdma_cm IDs (address and route resolution,
// listening, connecting, accepting), their addresses and connection
// parameters. verbs_linux.go has libibverbs.

package ibverbs

// #include <stdlib.h>
// #include "verbs_shim.h"
import "C"

import (
	"net/netip"
	"sync"
	"syscall"
	"unsafe"
)

// EventChannel is an rdma_cm event channel: the events of its IDs,
// waited on in Go's poller. One goroutine calls Next; CreateID may be
// called beside it (the IDs are under mu), and Interrupt from any
// goroutine wakes Next. Close must come after the other calls have
// returned, but for a Next, which it interrupts.
type EventChannel struct {
	n  node
	ch *C.struct_rdma_event_channel
	p  *pollable

	mu sync.Mutex
	// +checklocks:mu
	ids map[*C.struct_rdma_cm_id]*CMID
}

// NewEventChannel creates an event channel; an error wraps
// ErrNotSupported where there is no rdma_cm (/dev/infiniband/rdma_cm).
func NewEventChannel() (*EventChannel, error) {
	ch, err := C.rdma_create_event_channel()
	if ch == nil {
		e, _ := err.(syscall.Errno)
		if e == 0 || e == syscall.ENOENT {
			e = syscall.ENODEV
		}
		return nil, errnoErr("rdma_create_event_channel", -int(e))
	}
	p, perr := newPollable(ch.fd, "rdma_event_channel")
	if perr != nil {
		C.rdma_destroy_event_channel(ch)
		return nil, perr
	}
	c := &EventChannel{ch: ch, p: p, ids: map[*C.struct_rdma_cm_id]*CMID{}}
	c.n.init("EventChannel", nil, c)
	return c, nil
}

// Next waits for the next event of one of the channel's IDs. It returns
// ErrClosed once the channel is closed. One goroutine calls it.
func (c *EventChannel) Next() (CMEvent, error) {
	ev := (*C.struct_rnbd_cm_event)(C.malloc(C.sizeof_struct_rnbd_cm_event))
	defer C.free(unsafe.Pointer(ev))
	var res C.int
	err := c.p.wait(func() bool {
		res = C.rnbd_get_cm_event(c.ch, ev)
		return res != -C.EAGAIN
	})
	if err != nil {
		return CMEvent{}, err
	}
	if res < 0 {
		return CMEvent{}, errnoErr("rdma_get_cm_event", int(res))
	}
	out := CMEvent{Type: EventType(ev.event), Status: int(ev.status)}
	if n := int(ev.private_data_len); n > 0 {
		out.PrivateData = C.GoBytes(unsafe.Pointer(&ev.private_data[0]), C.int(n))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if out.Type == EventConnectRequest {
		out.Listener = c.ids[ev.listen_id]
		id := &CMID{id: ev.id, ch: c}
		c.ids[ev.id] = id
		id.n.init("CMID (accepted)", &c.n, id)
		out.ID = id
		return out, nil
	}
	out.ID = c.ids[ev.id]
	return out, nil
}

// Interrupt wakes a Next, which returns ErrClosed, as do all later ones;
// it returns once the caller of Next is out of C. Idempotent.
func (c *EventChannel) Interrupt() { c.p.close() }

// Close interrupts, destroys the channel's IDs (and their QPs) and the
// channel. Idempotent.
func (c *EventChannel) Close() error {
	if !c.n.markClosed() {
		return nil
	}
	defer c.n.end(c)
	c.p.close()
	c.n.closeChildren()
	C.rdma_destroy_event_channel(c.ch)
	return nil
}

// CMID is an rdma_cm ID: one connection or a listener. This package does
// not serialize the calls on one ID: the caller makes them in sequence
// (resolve, route, connect or accept, disconnect, as rdma_cm wants
// them), and Migrate and Close must not race with any other, as they
// change the ID's channel. Close is idempotent.
type CMID struct {
	n  node
	id *C.struct_rdma_cm_id
	ch *EventChannel
}

// CreateID makes an ID whose events come to the channel.
func (c *EventChannel) CreateID(ps PortSpace) (*CMID, error) {
	var id *C.struct_rdma_cm_id
	if r, err := C.rdma_create_id(c.ch, &id, nil, C.enum_rdma_port_space(ps)); r != 0 {
		return nil, errnoErr("rdma_create_id", -errnoOf(err))
	}
	x := &CMID{id: id, ch: c}
	c.mu.Lock()
	c.ids[id] = x
	c.mu.Unlock()
	x.n.init("CMID", &c.n, x)
	return x, nil
}

func errnoOf(err error) int {
	if e, ok := err.(syscall.Errno); ok && e != 0 {
		return int(e)
	}
	return int(syscall.EIO)
}

func toAddr(a netip.AddrPort) C.struct_rnbd_addr {
	var out C.struct_rnbd_addr
	if !a.IsValid() {
		return out
	}
	ip := a.Addr()
	out.family = C.int(family(ip))
	out.port = C.uint16_t(a.Port())
	if ip.Is4() || ip.Is4In6() {
		b := ip.Unmap().As4()
		for i := range b {
			out.ip[i] = C.uint8_t(b[i])
		}
	} else {
		b := ip.As16()
		for i := range b {
			out.ip[i] = C.uint8_t(b[i])
		}
		if z := ip.Zone(); z != "" {
			if ifi, err := netInterfaceIndex(z); err == nil {
				out.scope_id = C.uint32_t(ifi)
			}
		}
	}
	return out
}

func fromAddr(a *C.struct_rnbd_addr) netip.AddrPort {
	switch a.family {
	case syscall.AF_INET:
		var b [4]byte
		for i := range b {
			b[i] = byte(a.ip[i])
		}
		return netip.AddrPortFrom(netip.AddrFrom4(b), uint16(a.port))
	case syscall.AF_INET6:
		var b [16]byte
		for i := range b {
			b[i] = byte(a.ip[i])
		}
		return netip.AddrPortFrom(netip.AddrFrom16(b), uint16(a.port))
	}
	return netip.AddrPort{}
}

// ResolveAddr starts resolving dst (from src, if valid) to a device:
// EventAddrResolved or EventAddrError follows.
func (x *CMID) ResolveAddr(src, dst netip.AddrPort, timeoutMS int) error {
	s, d := toAddr(src), toAddr(dst)
	return errnoErr("rdma_resolve_addr", int(C.rnbd_resolve_addr(x.id, &s, &d, C.int(timeoutMS))))
}

// ResolveRoute starts resolving the route: EventRouteResolved or
// EventRouteError follows.
func (x *CMID) ResolveRoute(timeoutMS int) error {
	if r, err := C.rdma_resolve_route(x.id, C.int(timeoutMS)); r != 0 {
		return errnoErr("rdma_resolve_route", -errnoOf(err))
	}
	return nil
}

// Bind binds the ID to a local address (for Listen).
func (x *CMID) Bind(a netip.AddrPort) error {
	s := toAddr(a)
	return errnoErr("rdma_bind_addr", int(C.rnbd_bind_addr(x.id, &s)))
}

// Listen listens for connection requests (EventConnectRequest).
func (x *CMID) Listen(backlog int) error {
	if r, err := C.rdma_listen(x.id, C.int(backlog)); r != 0 {
		return errnoErr("rdma_listen", -errnoOf(err))
	}
	return nil
}

// Context is the device the ID is bound to (after address resolution, or
// for a connection request), nil before.
func (x *CMID) Context() *Context {
	c := C.rnbd_id_verbs(x.id)
	if c == nil {
		return nil
	}
	return cmContext(c)
}

// Port is the device port the ID is bound to.
func (x *CMID) Port() int { return int(C.rnbd_id_port(x.id)) }

// LocalAddr and PeerAddr are the ID's addresses.
func (x *CMID) LocalAddr() netip.AddrPort {
	var a C.struct_rnbd_addr
	C.rnbd_local_addr(x.id, &a)
	return fromAddr(&a)
}

func (x *CMID) PeerAddr() netip.AddrPort {
	var a C.struct_rnbd_addr
	C.rnbd_peer_addr(x.id, &a)
	return fromAddr(&a)
}

// CreateQP makes the ID's RC queue pair in pd, both queues completing
// on cq.
func (x *CMID) CreateQP(pd *PD, cq *CQ, caps QPCaps) (*QP, error) {
	if err := errnoErr("rdma_create_qp", int(C.rnbd_create_qp(x.id, pd.pd, cq.cq,
		C.uint32_t(caps.MaxSendWR), C.uint32_t(caps.MaxRecvWR), C.uint32_t(caps.MaxInline)))); err != nil {
		return nil, err
	}
	qp := &QP{qp: C.rnbd_id_qp(x.id), id: x,
		swr: (*C.struct_rnbd_send_wr)(C.calloc(MaxChain, C.sizeof_struct_rnbd_send_wr)),
		rwr: (*C.struct_rnbd_recv_wr)(C.calloc(MaxChain, C.sizeof_struct_rnbd_recv_wr))}
	qp.n.init("QP", &x.n, qp)
	return qp, nil
}

func connParam(p ConnParam) (*C.struct_rnbd_conn_param, error) {
	if len(p.PrivateData) > 255 {
		return nil, &Error{Op: "private data", Err: syscall.EINVAL}
	}
	cp := (*C.struct_rnbd_conn_param)(C.calloc(1, C.sizeof_struct_rnbd_conn_param))
	for i, b := range p.PrivateData {
		cp.private_data[i] = C.uint8_t(b)
	}
	cp.private_data_len = C.uint8_t(len(p.PrivateData))
	cp.responder_resources = C.uint8_t(p.ResponderResources)
	cp.initiator_depth = C.uint8_t(p.InitiatorDepth)
	cp.retry_count = C.uint8_t(p.RetryCount)
	cp.rnr_retry_count = C.uint8_t(p.RNRRetryCount)
	return cp, nil
}

// Connect sends the connection request: EventEstablished (with the
// peer's private data), EventRejected, EventUnreachable or
// EventConnectError follows.
func (x *CMID) Connect(p ConnParam) error {
	cp, err := connParam(p)
	if err != nil {
		return err
	}
	defer C.free(unsafe.Pointer(cp))
	return errnoErr("rdma_connect", int(C.rnbd_connect(x.id, cp)))
}

// Accept answers a connection request with private data; the QP is
// ready to send when it returns, EventEstablished follows.
func (x *CMID) Accept(p ConnParam) error {
	cp, err := connParam(p)
	if err != nil {
		return err
	}
	defer C.free(unsafe.Pointer(cp))
	return errnoErr("rdma_accept", int(C.rnbd_accept(x.id, cp)))
}

// Reject refuses a connection request, with private data for the peer.
func (x *CMID) Reject(priv []byte) error {
	if len(priv) > 255 {
		return &Error{Op: "rdma_reject", Err: syscall.EINVAL}
	}
	var p unsafe.Pointer
	if len(priv) > 0 {
		p = C.CBytes(priv)
		defer C.free(p)
	}
	if r, err := C.rdma_reject(x.id, p, C.uint8_t(len(priv))); r != 0 {
		return errnoErr("rdma_reject", -errnoOf(err))
	}
	return nil
}

// Disconnect tears the connection down: the QP goes to error (its work
// requests flush) and the peer gets EventDisconnected.
func (x *CMID) Disconnect() error {
	if r, err := C.rdma_disconnect(x.id); r != 0 {
		return errnoErr("rdma_disconnect", -errnoOf(err))
	}
	return nil
}

// Migrate moves the ID's events to another channel.
func (x *CMID) Migrate(to *EventChannel) error {
	if r, err := C.rdma_migrate_id(x.id, to.ch); r != 0 {
		return errnoErr("rdma_migrate_id", -errnoOf(err))
	}
	from := x.ch
	from.mu.Lock()
	delete(from.ids, x.id)
	from.mu.Unlock()
	from.n.mu.Lock()
	delete(from.n.children, x)
	from.n.mu.Unlock()
	to.mu.Lock()
	to.ids[x.id] = x
	to.mu.Unlock()
	to.n.mu.Lock()
	if to.n.children == nil {
		to.n.children = map[closer]struct{}{}
	}
	to.n.children[x] = struct{}{}
	to.n.mu.Unlock()
	x.ch = to
	x.n.parent = &to.n
	return nil
}

// Close destroys the ID's QP, then the ID. Idempotent.
func (x *CMID) Close() error {
	if !x.n.begin() {
		return nil
	}
	defer x.n.end(x)
	ch := x.ch
	ch.mu.Lock()
	delete(ch.ids, x.id)
	ch.mu.Unlock()
	if r, err := C.rdma_destroy_id(x.id); r != 0 {
		return errnoErr("rdma_destroy_id", -errnoOf(err))
	}
	return nil
}
