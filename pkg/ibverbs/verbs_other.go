//go:build !cgo || !linux

package ibverbs

import "net/netip"

// Supported reports whether this build can do RDMA: without cgo it
// cannot, and every constructor returns an error wrapping
// ErrNotSupported.
const Supported = false

// The objects exist so that code using them builds; none can be made.
type (
	Context      struct{}
	PD           struct{}
	MR           struct{}
	MW           struct{}
	CompChannel  struct{}
	CQ           struct{}
	QP           struct{}
	EventChannel struct{}
	CMID         struct{}
)

// MaxPoll is the most completions one Poll returns.
const MaxPoll = 64

func Devices() ([]string, error)                                    { return nil, ErrNotSupported }
func OpenDevice(string) (*Context, error)                           { return nil, ErrNotSupported }
func NewEventChannel() (*EventChannel, error)                       { return nil, ErrNotSupported }
func (*Context) Name() string                                       { return "" }
func (*Context) Query() (DeviceAttr, error)                         { return DeviceAttr{}, ErrNotSupported }
func (*Context) Close() error                                       { return nil }
func (*Context) AllocPD() (*PD, error)                              { return nil, ErrNotSupported }
func (*Context) NewCompChannel() (*CompChannel, error)              { return nil, ErrNotSupported }
func (*Context) NewCQ(int, *CompChannel) (*CQ, error)               { return nil, ErrNotSupported }
func (*PD) Context() *Context                                       { return nil }
func (*PD) Close() error                                            { return nil }
func (*PD) RegMR([]byte, Access) (*MR, error)                       { return nil, ErrNotSupported }
func (*PD) AllocMW() (*MW, error)                                   { return nil, ErrNotSupported }
func (*MR) Buf() []byte                                             { return nil }
func (*MR) Addr() uint64                                            { return 0 }
func (*MR) LKey() uint32                                            { return 0 }
func (*MR) RKey() uint32                                            { return 0 }
func (*MR) Close() error                                            { return nil }
func (*MW) RKey() uint32                                            { return 0 }
func (*MW) Close() error                                            { return nil }
func (*CompChannel) Wait() (*CQ, error)                             { return nil, ErrNotSupported }
func (*CompChannel) Close() error                                   { return nil }
func (*CompChannel) Interrupt()                                     {}
func (*EventChannel) Interrupt()                                    {}
func (*CQ) ReqNotify() error                                        { return ErrNotSupported }
func (*CQ) Poll([]WC) (int, error)                                  { return 0, ErrNotSupported }
func (*CQ) Close() error                                            { return nil }
func (*QP) Num() uint32                                             { return 0 }
func (*QP) PostSend([]SendWR) error                                 { return ErrNotSupported }
func (*QP) PostRecv([]RecvWR) error                                 { return ErrNotSupported }
func (*QP) BindMW(*MW, *MR, []byte, Access, uint64, bool) error     { return ErrNotSupported }
func (*QP) Close() error                                            { return nil }
func (*EventChannel) Next() (CMEvent, error)                        { return CMEvent{}, ErrNotSupported }
func (*EventChannel) CreateID(PortSpace) (*CMID, error)             { return nil, ErrNotSupported }
func (*EventChannel) Close() error                                  { return nil }
func (*CMID) ResolveAddr(netip.AddrPort, netip.AddrPort, int) error { return ErrNotSupported }
func (*CMID) ResolveRoute(int) error                                { return ErrNotSupported }
func (*CMID) Bind(netip.AddrPort) error                             { return ErrNotSupported }
func (*CMID) Listen(int) error                                      { return ErrNotSupported }
func (*CMID) Context() *Context                                     { return nil }
func (*CMID) Port() int                                             { return 0 }
func (*CMID) LocalAddr() netip.AddrPort                             { return netip.AddrPort{} }
func (*CMID) PeerAddr() netip.AddrPort                              { return netip.AddrPort{} }
func (*CMID) CreateQP(*PD, *CQ, QPCaps) (*QP, error)                { return nil, ErrNotSupported }
func (*CMID) Connect(ConnParam) error                               { return ErrNotSupported }
func (*CMID) Accept(ConnParam) error                                { return ErrNotSupported }
func (*CMID) Reject([]byte) error                                   { return ErrNotSupported }
func (*CMID) Disconnect() error                                     { return ErrNotSupported }
func (*CMID) Migrate(*EventChannel) error                           { return ErrNotSupported }
func (*CMID) Close() error                                          { return nil }
