// Package fabric states the reliable-connection contract that package rtrs
// is written against, in the terms of RDMA verbs: devices, protection
// domains, memory regions with remote keys, connections (queue pairs) with
// send and receive work requests, and completions.
//
// Implementations: fabric/tcp emulates the contract over TCP (as soft-iWARP
// emulates RDMA), fabric/fabrictest runs the same emulation over an
// in-memory network with fault injection, and fabric/rdma maps it onto verbs
// (pkg/ibverbs).
//
// The contract:
//   - A memory region (MR) is registered in a protection domain (PD) and
//     has an address, a local key and a remote key. A remote write names
//     (address, rkey); it is allowed only if the rkey is currently valid in
//     the PD of the connection it arrives on and the whole range lies inside
//     the region. Anything else is a fatal remote-access error for that
//     connection, as on an HCA.
//   - Work requests on one connection execute in the order posted. A write
//     with immediate (also of zero length) and a send each consume one posted
//     receive at the peer and complete it with the immediate. If no receive
//     is posted the sender waits, as an RC QP with infinite RNR retry does.
//   - Any error kills the connection: Handler.Disconnected is called once,
//     and work requests still outstanding are discarded without completions
//     (the kernel sees them as flush errors and ignores them).
//   - Completions are delivered by the fabric's goroutines: receive
//     completions in order on one goroutine, and send completions in
//     order, never two at once (fabric/tcp delivers them from whichever
//     goroutine wrote the work request: its reader at the end of a burst,
//     or its writer; fabric/rdma uses one goroutine per connection for
//     both, from its completion queue). Handlers must not block.
//   - Every method of a Fabric, Device, PD, MR, Conn, Listener and
//     ConnRequest may be called from any goroutine, also at once
//     (fabric/tcp and fabric/rdma say how in their package docs), with
//     the limits stated where they apply: Conn.Close not from a Handler,
//     and exactly one of ConnRequest's Accept or Reject (a second call
//     answers nothing).
package fabric

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"syscall"
	"time"
)

// ErrNotSupported is returned (wrapped) when a fabric cannot do something on
// this machine, e.g. RDMA without devices or without cgo.
var ErrNotSupported = errors.New("fabric: not supported")

// ErrClosed is returned for operations on a closed connection or listener.
var ErrClosed = errors.New("fabric: closed")

// ErrQueueFull is returned by PostSend and PostRecv when the queue has no
// room: ENOMEM from ibv_post_send.
var ErrQueueFull = errors.New("fabric: work queue full")

// RejectError is returned by Dial when the peer rejected the connection;
// PrivateData is what it attached (an rtrs conn_rsp carrying an errno).
type RejectError struct {
	PrivateData []byte
}

func (e *RejectError) Error() string { return "fabric: connection rejected by peer" }

// Fabric is a transport: it resolves addresses to devices and listens.
type Fabric interface {
	// Name is the transport name: "tcp", "rdma", "mem".
	Name() string
	// Resolve returns the device through which dst is reached from src
	// (src may be the zero value).
	Resolve(ctx context.Context, src, dst netip.AddrPort) (Device, error)
	// Listen accepts connection requests on addr.
	Listen(addr netip.AddrPort) (Listener, error)
	// AllocMemory returns n bytes suitable for registration with this
	// fabric. For RDMA they live outside the Go heap; release with Free.
	AllocMemory(n int) (Memory, error)
}

// Memory is registrable memory. Bytes stays valid until Free.
type Memory interface {
	Bytes() []byte
	Free() error
}

// Mapper is a Fabric that can allocate memory mapped for the caller
// alone, outside the Go heap (a private anonymous mapping): its pages
// are zero and take no room until first touched, and Free gives them
// back to the kernel at once, not at a garbage collection. Touching it
// after Free is a fault, so it is for memory that only connections the
// caller closes before it frees reach: a server's chunks. fabric/rdma's
// AllocMemory is such memory already.
type Mapper interface {
	Fabric
	AllocMapped(n int) (Memory, error)
}

// ConnCoster is a Fabric that knows what one of its connections with
// these queue sizes costs in memory at most: its queues, batches and
// buffers. A server counts that against its memory budget.
type ConnCoster interface {
	Fabric
	ConnMemory(maxSendWR, maxRecvWR int) int64
}

// Device is an HCA (or its emulation).
type Device interface {
	// Name is the HCA name, e.g. "mlx5_0", "rxe0", or "tcp".
	Name() string
	// Port is the HCA port number.
	Port() int
	// AllocPD allocates a protection domain.
	AllocPD() (PD, error)
	// Dial connects to a listener, sending PrivateData with the request. It
	// returns the connection and the private data of the peer's accept. A
	// rejection is a *RejectError.
	Dial(ctx context.Context, p DialParams) (Conn, []byte, error)
}

// DialParams are the arguments of Device.Dial.
type DialParams struct {
	Src, Dst    netip.AddrPort
	PD          PD
	PrivateData []byte
	Attr        ConnAttr
}

// Access are memory region access rights.
type Access uint32

const (
	AccessLocalWrite Access = 1 << iota
	AccessRemoteWrite
	AccessRemoteRead
	// AccessWindow asks for the remote access to go through a memory
	// window, where the fabric has them: the MR is then a WindowMR.
	// Elsewhere it is ignored.
	AccessWindow
)

// WindowMR is a region whose remote access is a memory window that work
// requests bind and unbind on a connection of its PD, with no system call
// of their own on hardware (fabric/rdma: a type 1 window, which holds for
// every connection of the PD, as a peer may write a region through any of
// them). It starts unbound, RKey 0. Invalidate and Reregister are not
// its way: they fail.
type WindowMR interface {
	MR
	// Bind posts on c a bind of the window over the whole region under
	// a new rkey, which it returns. Work requests posted on c after it
	// execute after it. It is unsignaled: only a failure completes.
	Bind(c Conn) (uint32, error)
	// Unbind posts on c an unbind of the window, signaled with id: once
	// its completion (WCBind) is delivered, a remote access with the
	// old rkey fails.
	Unbind(c Conn, id uint64) error
}

// PD is a protection domain: memory regions and connections belong to one,
// and a remote access is checked against the regions of the connection's PD.
type PD interface {
	// RegisterMR registers buf (from Fabric.AllocMemory) for access.
	RegisterMR(buf []byte, access Access) (MR, error)
	// Close releases the PD; its regions must be closed first.
	Close() error
}

// WindowPD is a PD that tells beforehand whether a region registered in
// it with AccessWindow will be a WindowMR, so that a server can size its
// connections' send queues (binds and unbinds are work requests) before
// it registers its chunks. A PD that is not one gives no windows.
type WindowPD interface {
	PD
	Windows() bool
}

// MR is a registered memory region.
type MR interface {
	Buf() []byte
	// Addr is the address a peer uses for this region's first byte.
	Addr() uint64
	LKey() uint32
	// RKey is the current remote key; it changes with Reregister.
	RKey() uint32
	// Invalidate revokes remote access (LOCAL_INV): a remote write with
	// the current rkey that starts after it returns fails and breaks its
	// connection. On a verbs device a write already under way is also
	// fenced; the TCP fabric may still land the bytes of a write it is in
	// the middle of receiving, then breaks that connection. Either way
	// the peer can only reach memory it was granted, and only through
	// connections of the region's PD, which the owner closes (and so
	// stops) before it frees the memory.
	Invalidate() error
	// Reregister grants remote access again under a new rkey, which it
	// returns (REG_MR with ib_inc_rkey).
	Reregister() (uint32, error)
	// Close deregisters the region.
	Close() error
}

// ConnAttr describes a connection's queues and its completion handler.
type ConnAttr struct {
	MaxSendWR int
	MaxRecvWR int
	Handler   Handler
	// Recvs are posted before the connection is accepted or dialed, so the
	// peer's first message always finds one.
	Recvs []RecvWR
}

// Handler receives a connection's completions and its failure.
type Handler interface {
	// Attached is called once with the connection, before any other call
	// and before Dial or Accept return, so completions can always find it.
	Attached(c Conn)
	// Completion reports one work completion. wc is valid only during
	// the call. It must not block.
	Completion(wc *WC)
	// Disconnected reports, once, that the connection failed or the peer
	// closed it. It is not called after Conn.Close. It must not block.
	Disconnected(err error)
}

// Conn is a reliable connection (an RC queue pair).
type Conn interface {
	// PostSend posts a chain of work requests (linked by Next). The
	// structures may be reused when it returns; the buffers they name
	// must stay untouched until the work request has completed (or, for
	// unsignaled ones, until the peer has answered).
	PostSend(wr *SendWR) error
	// PostRecv posts a chain of receive work requests.
	PostRecv(wr *RecvWR) error
	LocalAddr() netip.AddrPort
	RemoteAddr() netip.AddrPort
	// Close disconnects and drains: when it returns, no further
	// completions or Disconnected calls are made. It must not be called
	// from a Handler.
	Close() error
}

// Flusher is a Conn that batches: it can hold work requests posted with
// More, so that a burst of them goes out in one system call (fabric/tcp:
// one writev; fabric/rdma: one ibv_post_send, whose doorbell is a system
// call on soft-RoCE and an MMIO write on hardware), and it tells a
// Handler that is a BurstHandler where each burst of completions it
// delivers ends.
type Flusher interface {
	// Flush sends what is held, from the calling goroutine as far as
	// the network takes it without waiting, the rest from the
	// connection's own. Send completions of what it wrote may be
	// delivered during the call.
	Flush()
}

// AnySource is a Conn that may say its sends can name any memory of the
// process as their local buffers, registered or not, with any LKey, and
// that a fault of that memory (a file mapping cut short) fails the send,
// not the process: the kernel copies it (fabric/tcp without TLS: a send
// is a writev of its buffers). A server can then answer a read from
// where its data already is (a mapping of the file) instead of copying
// it into a registered chunk first. As for every send, the buffers must
// stay valid until the work request has completed — a send that names
// such memory should be signaled — or, if the connection fails first,
// until Close has returned and no Flush of the user's is running.
type AnySource interface {
	Conn
	AnySource() bool
}

// BurstHandler is a Handler that a Flusher tells where each burst of
// completions ends: after the completions of what it read at once, before
// it waits for more. What the completions left to do (replies to write)
// the handler may do once there. BurstEnd must not block.
type BurstHandler interface {
	Handler
	BurstEnd()
}

// Listener accepts connection requests.
type Listener interface {
	// Accept returns the next connection request.
	Accept(ctx context.Context) (ConnRequest, error)
	Addr() netip.AddrPort
	Close() error
}

// Screener is an optional part of a Listener: it asks refuse about every
// connection it accepts, with the peer's address, before it spends
// anything more on it — a goroutine, a handshake (TLS's), a read of the
// request —, and answers one refused with priv, as Reject would, and
// closes it; such a connection never reaches Accept. refuse says for how
// much longer the address is refused (0: it is not), so that a listener
// whose kernel can may refuse it sooner still meanwhile (fabric/tcp: its
// SYNs dropped, once it keeps coming). refuse is called from the
// listener's accept loop, so it must not block or allocate: the listener
// keeps taking the connections of other peers meanwhile. A server calls
// Screen once, as it starts listening (fabric/tcp is a Screener;
// fabric/rdma is not: its requests come from the kernel's CM, handshake
// done, and the server refuses them in Accept's order).
type Screener interface {
	Screen(refuse func(netip.Addr) time.Duration, priv []byte)
}

// ConnRequest is an incoming connection request (RDMA_CM_EVENT_CONNECT_REQUEST).
// Exactly one of Accept or Reject must be called.
type ConnRequest interface {
	PrivateData() []byte
	// LocalAddr is the address the request arrived at; RemoteAddr is the
	// peer's.
	LocalAddr() netip.AddrPort
	RemoteAddr() netip.AddrPort
	// Device is the device the request arrived on.
	Device() Device
	// Accept creates the connection in pd, posts attr.Recvs and answers
	// with priv.
	Accept(pd PD, attr ConnAttr, priv []byte) (Conn, error)
	// Reject refuses the request, sending priv to the peer.
	Reject(priv []byte) error
}

// Authenticated is a ConnRequest whose fabric authenticated the peer:
// on the TCP fabric with TLS, by its certificate. RDMA authenticates no
// one (its addresses and GIDs are what the peer claims).
type Authenticated interface {
	// PeerNames are the names the peer's credential vouches for, the
	// one to show first: a certificate's subject common name, then its
	// DNS, URI and e-mail subject alternative names.
	PeerNames() []string
}

// PeerNames returns what req's fabric authenticated of its peer (nil:
// nothing, the fabric does not authenticate).
func PeerNames(req ConnRequest) []string {
	if a, ok := req.(Authenticated); ok {
		return a.PeerNames()
	}
	return nil
}

// Refuser is an optional part of a Fabric: the connections its listeners
// refused before a connection request reached Accept (the TCP fabric's
// TLS client certificates that name no identity), by the errno the peer
// was answered with. The server counts them with its own refusals.
type Refuser interface {
	Refused() map[syscall.Errno]uint64
}

// Opcode is the operation of a send work request.
type Opcode uint8

const (
	// OpWrite writes the local buffers to (RemoteAddr, RKey).
	OpWrite Opcode = iota + 1
	// OpWriteImm writes like OpWrite, then consumes a receive at the peer
	// completing it with Imm. Zero length is allowed.
	OpWriteImm
	// OpSend sends the local buffers into the peer's next receive.
	OpSend
	// OpSendImm sends like OpSend and delivers Imm.
	OpSendImm
	// OpSendInv sends like OpSend and invalidates InvRKey at the peer.
	OpSendInv
)

func (o Opcode) String() string {
	switch o {
	case OpWrite:
		return "RDMA_WRITE"
	case OpWriteImm:
		return "RDMA_WRITE_WITH_IMM"
	case OpSend:
		return "SEND"
	case OpSendImm:
		return "SEND_WITH_IMM"
	case OpSendInv:
		return "SEND_WITH_INV"
	}
	return fmt.Sprintf("Opcode(%d)", uint8(o))
}

// MaxSGE is the largest scatter-gather list of a send work request (the
// kernel's RTRS uses at most 2 SGEs).
const MaxSGE = 2

// SGE is one local buffer of a work request.
type SGE struct {
	Buf  []byte
	LKey uint32
}

// SendWR is a send work request (struct ib_send_wr).
type SendWR struct {
	ID         uint64
	Op         Opcode
	SG         [MaxSGE]SGE
	NumSGE     int
	RemoteAddr uint64
	RKey       uint32
	Imm        uint32
	InvRKey    uint32
	Signaled   bool
	// More says the poster will post again or call Flush soon: a
	// connection that is a Flusher may hold the work request until then
	// (MSG_MORE; the block layer's plug). Others ignore it.
	More bool
	Next *SendWR
}

// Len is the total length of the work request's local buffers.
func (wr *SendWR) Len() int {
	n := 0
	for i := 0; i < wr.NumSGE; i++ {
		n += len(wr.SG[i].Buf)
	}
	return n
}

// RecvWR is a receive work request. A nil Buf is an empty receive, enough
// for a write with immediate but not for a send with payload.
type RecvWR struct {
	ID   uint64
	Buf  []byte
	LKey uint32
	Next *RecvWR
}

// WCOpcode tells what completed.
type WCOpcode uint8

const (
	WCSend WCOpcode = iota + 1
	WCWrite
	WCRecv
	WCRecvRDMAWithImm
	// WCBind: a signaled bind or unbind of a window (WindowMR).
	WCBind
)

// WCStatus is the status of a completion.
type WCStatus uint8

const (
	WCSuccess WCStatus = iota
	WCLocLenErr
	WCRemAccessErr
	WCGeneralErr
)

// WCFlags qualify a receive completion.
type WCFlags uint8

const (
	WCWithImm WCFlags = 1 << iota
	WCWithInv
)

// WC is a work completion (struct ib_wc).
type WC struct {
	ID      uint64
	Status  WCStatus
	Opcode  WCOpcode
	Flags   WCFlags
	ByteLen uint32
	Imm     uint32
	InvRKey uint32
}

// PeerGroup is the unit in which peers are counted against per-peer
// limits: one address (an IPv4-mapped IPv6 address as its IPv4 one, the
// zone dropped). Not an IPv6 host's /64: on a storage network every
// client shares the link's /64, and counting them as one client would
// refuse legitimate sessions. A host that takes many addresses counts as
// many clients; TLS counts by identity instead (see docs/server.md).
func PeerGroup(a netip.Addr) netip.Prefix {
	a = a.Unmap().WithZone("")
	return netip.PrefixFrom(a, a.BitLen())
}
