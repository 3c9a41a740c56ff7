// Package ibverbs is the project's binding of libibverbs and librdmacm,
// and the only package that imports "C". Every verbs object is a Go type
// that owns it and has an idempotent Close; a parent closes its children
// first (a PD its memory regions and windows, an event channel its
// rdma_cm IDs, an ID its queue pair). Registered memory lives outside the
// Go heap (AllocMemory), so C may keep pointers into it.
//
// The hot path crosses into C once per batch: QP.PostSend and
// QP.PostRecv take a chain of work requests, CQ.Poll returns many
// completions. No call blocks an OS thread: completion channels and
// rdma_cm event channels are non-blocking file descriptors waited on in
// Go's network poller (CompChannel.Wait, EventChannel.Next).
//
// Errors carry the errno of the failed call and match it with errors.Is.
// A build without cgo, or on a machine without RDMA devices, returns
// errors wrapping ErrNotSupported.
//
// Each type says whether it is safe for concurrent use. Common to all:
// Close is idempotent, and the Close of a parent must not race with
// making a child on it (a child made after its parent closed its
// children is left open).
//
// Lock order (outermost first; nothing else is taken under a lock not
// listed as outer here):
//
//	EventChannel.mu (Next registering an accepted ID)
//	  live (the leak tracker, ibverbs.go)
//	  node.mu (the channel's own: the ID joins its children)
//	QP.sendMu (QP.Close)
//	  QP.recvMu
//
// node.mu, live, cmContexts, pollable.mu and CompChannel.mu are each
// taken alone otherwise: closing an object's children (node.begin,
// closeChildren) lets go of its node.mu first, and node.init and
// node.end take live and the parent's node.mu one after the other.
package ibverbs

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"sort"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// ErrNotSupported means this build (no cgo) or this machine (no RDMA
// device, no rdma_cm) cannot do RDMA.
var ErrNotSupported = errors.New("ibverbs: RDMA not supported")

// ErrClosed is returned by operations on a closed object.
var ErrClosed = errors.New("ibverbs: closed")

// Error is a failed verbs or rdma_cm call: Op names it, Err is the errno.
type Error struct {
	Op  string
	Err syscall.Errno
}

func (e *Error) Error() string { return fmt.Sprintf("ibverbs: %s: %v", e.Op, e.Err) }
func (e *Error) Unwrap() error { return e.Err }

// errnoErr turns a -errno result into an *Error (nil for res >= 0).
func errnoErr(op string, res int) error {
	if res >= 0 {
		return nil
	}
	e := syscall.Errno(-res)
	if e == syscall.ENODEV || e == syscall.ENOSYS {
		return fmt.Errorf("%w: %w", ErrNotSupported, &Error{Op: op, Err: e})
	}
	return &Error{Op: op, Err: e}
}

// Access are memory access rights (enum ibv_access_flags).
type Access uint32

const (
	AccessLocalWrite  Access = 1 << 0
	AccessRemoteWrite Access = 1 << 1
	AccessRemoteRead  Access = 1 << 2
	AccessMWBind      Access = 1 << 4
)

// WROpcode is a send work request's operation (enum ibv_wr_opcode).
type WROpcode uint32

const (
	WRRDMAWrite        WROpcode = 0
	WRRDMAWriteWithImm WROpcode = 1
	WRSend             WROpcode = 2
	WRSendWithImm      WROpcode = 3
	WRLocalInv         WROpcode = 7
	WRSendWithInv      WROpcode = 9
)

// SendFlags (enum ibv_send_flags).
const (
	SendFence     = 1 << 0
	SendSignaled  = 1 << 1
	SendSolicited = 1 << 2
	SendInline    = 1 << 3
)

// SGE is one buffer of a work request: registered memory.
type SGE struct {
	Addr   uint64
	Length uint32
	LKey   uint32
}

// MaxSGE is the most buffers a send work request names.
const MaxSGE = 2

// MaxChain is the most work requests one PostSend or PostRecv takes.
const MaxChain = 16

// SendWR is a send work request (struct ibv_send_wr, flattened). Imm is
// in host byte order; it goes on the wire big-endian, as the kernel's
// cpu_to_be32 does.
type SendWR struct {
	ID         uint64
	Opcode     WROpcode
	Flags      uint32
	SG         [MaxSGE]SGE
	NumSGE     int
	RemoteAddr uint64
	RKey       uint32
	Imm        uint32
	InvRKey    uint32
}

// RecvWR is a receive work request with at most one buffer; none makes an
// empty receive (enough for an RDMA write with immediate).
type RecvWR struct {
	ID     uint64
	SG     SGE
	NumSGE int
}

// WCStatus is a completion's status (enum ibv_wc_status).
type WCStatus uint32

const (
	WCSuccess       WCStatus = 0
	WCLocLenErr     WCStatus = 1
	WCLocQPOpErr    WCStatus = 2
	WCLocProtErr    WCStatus = 4
	WCWRFlushErr    WCStatus = 5
	WCRemInvReqErr  WCStatus = 9
	WCRemAccessErr  WCStatus = 10
	WCRemOpErr      WCStatus = 11
	WCRetryExcErr   WCStatus = 12
	WCRNRRetryExc   WCStatus = 13
	WCGeneralErr    WCStatus = 21
	wcStatusUnknown WCStatus = 1 << 31
)

var wcStatusNames = map[WCStatus]string{
	WCSuccess: "success", WCLocLenErr: "local length error", WCLocQPOpErr: "local QP operation error",
	WCLocProtErr: "local protection error", WCWRFlushErr: "work request flushed", WCRemInvReqErr: "remote invalid request",
	WCRemAccessErr: "remote access error", WCRemOpErr: "remote operation error", WCRetryExcErr: "transport retry exceeded",
	WCRNRRetryExc: "RNR retry exceeded", WCGeneralErr: "general error",
}

func (s WCStatus) String() string {
	if n, ok := wcStatusNames[s]; ok {
		return n
	}
	return fmt.Sprintf("status %d", uint32(s))
}

// WCOpcode says what completed (enum ibv_wc_opcode).
type WCOpcode uint32

const (
	WCSend            WCOpcode = 0
	WCRDMAWrite       WCOpcode = 1
	WCRDMARead        WCOpcode = 2
	WCBindMW          WCOpcode = 5
	WCLocalInv        WCOpcode = 6
	WCRecv            WCOpcode = 1 << 7
	WCRecvRDMAWithImm WCOpcode = WCRecv + 1
	WCFlagWithImm              = 1 << 1 // IBV_WC_WITH_IMM
	WCFlagWithInv              = 1 << 3 // IBV_WC_WITH_INV
)

// WC is a work completion. Imm is in host byte order.
type WC struct {
	ID        uint64
	Status    WCStatus
	Opcode    WCOpcode
	ByteLen   uint32
	Imm       uint32
	InvRKey   uint32
	Flags     uint32
	QPNum     uint32
	VendorErr uint32
}

// Device capability flags (enum ibv_device_cap_flags) that matter here.
const (
	DeviceMemWindow   = 1 << 17
	DeviceMemMgtExt   = 1 << 21
	DeviceMemWindow2B = 1 << 24
)

// DeviceAttr is what ibv_query_device reports that we use.
type DeviceAttr struct {
	CapFlags uint64
	MaxQPWR  int
	MaxCQE   int
	MaxMW    int
}

// EventType is an rdma_cm event (enum rdma_cm_event_type).
type EventType int

const (
	EventAddrResolved    EventType = 0
	EventAddrError       EventType = 1
	EventRouteResolved   EventType = 2
	EventRouteError      EventType = 3
	EventConnectRequest  EventType = 4
	EventConnectResponse EventType = 5
	EventConnectError    EventType = 6
	EventUnreachable     EventType = 7
	EventRejected        EventType = 8
	EventEstablished     EventType = 9
	EventDisconnected    EventType = 10
	EventDeviceRemoval   EventType = 11
	EventMulticastJoin   EventType = 12
	EventMulticastError  EventType = 13
	EventAddrChange      EventType = 14
	EventTimewaitExit    EventType = 15
)

var eventNames = [...]string{"ADDR_RESOLVED", "ADDR_ERROR", "ROUTE_RESOLVED", "ROUTE_ERROR", "CONNECT_REQUEST",
	"CONNECT_RESPONSE", "CONNECT_ERROR", "UNREACHABLE", "REJECTED", "ESTABLISHED", "DISCONNECTED",
	"DEVICE_REMOVAL", "MULTICAST_JOIN", "MULTICAST_ERROR", "ADDR_CHANGE", "TIMEWAIT_EXIT"}

func (e EventType) String() string {
	if e >= 0 && int(e) < len(eventNames) {
		return "RDMA_CM_EVENT_" + eventNames[e]
	}
	return fmt.Sprintf("RDMA_CM_EVENT(%d)", int(e))
}

// CMEvent is one rdma_cm event, copied out of librdmacm and already
// acknowledged. For EventConnectRequest, ID is the new connection's ID
// (owned by the receiver, who must Accept, Reject or Close it) and
// Listener the listening one.
type CMEvent struct {
	Type        EventType
	Status      int
	ID          *CMID
	Listener    *CMID
	PrivateData []byte
}

// ConnParam is struct rdma_conn_param: at most 255 bytes of private data
// (an IB CM REQ carries 56 for IP), RDMA read resources, retry counts
// (7 means infinite for RNR).
type ConnParam struct {
	PrivateData        []byte
	ResponderResources uint8
	InitiatorDepth     uint8
	RetryCount         uint8
	RNRRetryCount      uint8
}

// QPCaps sizes a queue pair.
type QPCaps struct {
	MaxSendWR, MaxRecvWR int
	MaxInline            int
}

// PortSpace is an rdma_cm port space (enum rdma_port_space).
type PortSpace int

const PortSpaceTCP PortSpace = 0x0106 // RDMA_PS_TCP

// object is what the leak tracker knows of a live verbs object.
type object struct {
	kind  string
	stack string
}

var live struct {
	sync.Mutex
	// +checklocks:Mutex
	next uint64
	// +checklocks:Mutex
	objs map[uint64]object
}

// track records a new object and returns its handle for untrack.
func track(kind string) uint64 {
	var pcs [16]uintptr
	n := runtime.Callers(3, pcs[:])
	frames := runtime.CallersFrames(pcs[:n])
	stack := ""
	for {
		f, more := frames.Next()
		stack += fmt.Sprintf("\n\t%s (%s:%d)", f.Function, f.File, f.Line)
		if !more {
			break
		}
	}
	live.Lock()
	defer live.Unlock()
	if live.objs == nil {
		live.objs = map[uint64]object{}
	}
	live.next++
	live.objs[live.next] = object{kind: kind, stack: stack}
	return live.next
}

func untrack(h uint64) {
	live.Lock()
	delete(live.objs, h)
	live.Unlock()
}

// Live lists the verbs objects not yet closed, each with where it was
// made: a test's TestMain fails when it is not empty at the end.
func Live() []string {
	live.Lock()
	defer live.Unlock()
	var out []string
	for _, o := range live.objs {
		out = append(out, o.kind+" made at"+o.stack)
	}
	sort.Strings(out)
	return out
}

// AllocMemory returns n bytes of page-aligned memory outside the Go heap,
// for registration. FreeMemory releases it.
func AllocMemory(n int) ([]byte, error) {
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("ibverbs: mmap %d bytes: %w", n, err)
	}
	return b, nil
}

// FreeMemory releases memory from AllocMemory; nothing may use it.
func FreeMemory(b []byte) error { return unix.Munmap(b) }

func netInterfaceIndex(name string) (int, error) {
	ifi, err := net.InterfaceByName(name)
	if err != nil {
		return 0, err
	}
	return ifi.Index, nil
}

// LeakError lists the verbs objects still open, with where each was made,
// or returns nil: for a test's TestMain, after m.Run.
func LeakError() error {
	l := Live()
	if len(l) == 0 {
		return nil
	}
	return fmt.Errorf("ibverbs: %d objects not closed:\n%s", len(l), strings.Join(l, "\n"))
}

// family returns the address family constant of a (AF_INET or AF_INET6).
func family(a netip.Addr) int {
	if a.Is4() || a.Is4In6() {
		return syscall.AF_INET
	}
	return syscall.AF_INET6
}
