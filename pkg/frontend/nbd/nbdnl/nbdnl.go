// Package nbdnl attaches the kernel's nbd driver (/dev/nbdN) to sockets
// over generic netlink: CONNECT with one socket per hardware queue,
// RECONFIGURE to replace dead sockets, DISCONNECT, STATUS, and the
// LINK_DEAD multicast the kernel sends when a socket dies while
// dead_conn_timeout holds the device. The numbers are those of the
// kernel's include/uapi/linux/nbd-netlink.h and include/uapi/linux/nbd.h.
//
// Kernels without the "nbd" generic netlink family (before 4.12, or with
// the module not loaded) make Dial fail with an error wrapping
// ErrNoFamily; ioctl.go is the fallback for them.
//
// Errors from the kernel wrap its errno, so callers can test them with
// errors.Is(err, unix.EBUSY) and the like.
package nbdnl

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// FamilyName is the generic netlink family of the nbd driver.
const FamilyName = "nbd"

// groupName is the family's multicast group, which carries LINK_DEAD.
const groupName = "nbd_mc_group"

// Commands (NBD_CMD_*).
const (
	cmdConnect     = 1
	cmdDisconnect  = 2
	cmdReconfigure = 3
	cmdLinkDead    = 4 // kernel -> user, multicast
	cmdStatus      = 5
)

// Attributes (NBD_ATTR_*), and those nested in SOCKETS and DEVICE_LIST.
const (
	attrIndex             = 1  // u32
	attrSizeBytes         = 2  // u64
	attrBlockSizeBytes    = 3  // u64
	attrTimeout           = 4  // u64, seconds
	attrServerFlags       = 5  // u64
	attrClientFlags       = 6  // u64
	attrSockets           = 7  // nested: sockItem{sockFD}...
	attrDeadConnTimeout   = 8  // u64, seconds
	attrDeviceList        = 9  // nested: deviceItem{deviceIndex, deviceConnected}...
	attrBackendIdentifier = 10 // NUL-terminated string (kernel 5.19+)

	sockItem = 1 // NBD_SOCK_ITEM
	sockFD   = 1 // NBD_SOCK_FD, u32

	deviceItem      = 1 // NBD_DEVICE_ITEM
	deviceIndex     = 1 // NBD_DEVICE_INDEX, u32
	deviceConnected = 2 // NBD_DEVICE_CONNECTED, u8
)

// Client flags (NBD_CFLAG_*), for Config.ClientFlags.
const (
	// DestroyOnDisconnect deletes the device when it disconnects.
	DestroyOnDisconnect = 1 << 0
	// DisconnectOnClose disconnects the device when its last opener
	// closes it.
	DisconnectOnClose = 1 << 1
)

// Transmission flags of the NBD protocol (NBD_FLAG_*), for
// Config.ServerFlags and AttachIoctl: they tell the kernel which commands
// the server takes.
const (
	FlagHasFlags        = 1 << 0
	FlagReadOnly        = 1 << 1
	FlagSendFlush       = 1 << 2
	FlagSendFUA         = 1 << 3
	FlagRotational      = 1 << 4
	FlagSendTrim        = 1 << 5
	FlagSendWriteZeroes = 1 << 6
	FlagCanMultiConn    = 1 << 8
)

// ErrNoFamily means the kernel has no nbd generic netlink family: the nbd
// module is not loaded, or the kernel predates it (use AttachIoctl).
var ErrNoFamily = errors.New("nbdnl: the kernel has no nbd generic netlink family (is the nbd module loaded?)")

// Config is what CONNECT and RECONFIGURE tell the kernel. Zero fields are
// left out, so the kernel keeps its default (CONNECT) or the current
// value (RECONFIGURE).
type Config struct {
	// Index is N of /dev/nbdN; -1 lets the kernel pick a free device
	// (creating one if needed). Reconfigure ignores it.
	Index int
	// SizeBytes is the device size; BlockSize the logical block size,
	// a power of two in 512..PAGE_SIZE. Reconfigure ignores both.
	SizeBytes uint64
	BlockSize uint64
	// Timeout is the per-request timeout; DeadConnTimeout how long IO
	// waits for a RECONFIGURE after a socket died instead of failing.
	// Both go to the kernel in whole seconds, rounded up.
	Timeout         time.Duration
	DeadConnTimeout time.Duration
	// ServerFlags are the NBD transmission flags of the export (Flag*).
	ServerFlags uint64
	// ClientFlags are the NBD_CFLAG_* bits (DestroyOnDisconnect,
	// DisconnectOnClose). Reconfigure always sends them, so 0 clears.
	ClientFlags uint64
	// BackendID names the backend: kernel 5.19+ shows it in
	// /sys/block/nbdN/backend and refuses a RECONFIGURE naming another.
	// Older kernels reject the attribute (EINVAL), so leave it empty there.
	BackendID string
}

// watchConn is the part of a genetlink.Conn that WatchLinkDead uses.
type watchConn interface {
	JoinGroup(group uint32) error
	Receive() ([]genetlink.Message, []netlink.Message, error)
	Close() error
}

// Conn talks to the kernel's nbd family. It is safe for concurrent use.
type Conn struct {
	c   *genetlink.Conn
	fam genetlink.Family
	// dialWatch opens the separate socket WatchLinkDead listens on.
	dialWatch func() (watchConn, error)
}

// Dial opens a generic netlink socket and looks up the nbd family. When
// the kernel has none, the error wraps ErrNoFamily (and ENOENT).
func Dial() (*Conn, error) {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("nbdnl: dial generic netlink: %w", err)
	}
	return newConn(c)
}

// newConn looks up the nbd family on c and takes c over: it is closed if
// that fails.
func newConn(c *genetlink.Conn) (*Conn, error) {
	fam, err := c.GetFamily(FamilyName)
	if err != nil {
		c.Close()
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%w: %w", ErrNoFamily, err)
		}
		return nil, fmt.Errorf("nbdnl: family %q: %w", FamilyName, err)
	}
	return &Conn{c: c, fam: fam, dialWatch: dialWatch}, nil
}

func dialWatch() (watchConn, error) {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, err
	}
	return c, nil
}

// Close closes the netlink socket. Watchers started by WatchLinkDead
// have sockets of their own and stop with their context.
func (c *Conn) Close() error { return c.c.Close() }

// secs converts d to whole seconds, rounding up.
func secs(d time.Duration) uint64 {
	if d <= 0 {
		return 0
	}
	return uint64((d + time.Second - 1) / time.Second)
}

// encodeConfig lays out cfg and the sockets' descriptors as attributes.
// With reconfigure, size and block size are left out and the client
// flags are always sent.
func encodeConfig(ae *netlink.AttributeEncoder, index int, cfg Config, fds []int, reconfigure bool) {
	if index >= 0 {
		ae.Uint32(attrIndex, uint32(index))
	}
	if !reconfigure && cfg.SizeBytes != 0 {
		ae.Uint64(attrSizeBytes, cfg.SizeBytes)
	}
	if !reconfigure && cfg.BlockSize != 0 {
		ae.Uint64(attrBlockSizeBytes, cfg.BlockSize)
	}
	if cfg.Timeout > 0 {
		ae.Uint64(attrTimeout, secs(cfg.Timeout))
	}
	if cfg.DeadConnTimeout > 0 {
		ae.Uint64(attrDeadConnTimeout, secs(cfg.DeadConnTimeout))
	}
	if cfg.ServerFlags != 0 {
		ae.Uint64(attrServerFlags, cfg.ServerFlags)
	}
	if reconfigure || cfg.ClientFlags != 0 {
		ae.Uint64(attrClientFlags, cfg.ClientFlags)
	}
	if len(fds) > 0 {
		ae.Nested(attrSockets, func(list *netlink.AttributeEncoder) error {
			for _, fd := range fds {
				list.Nested(sockItem, func(item *netlink.AttributeEncoder) error {
					item.Uint32(sockFD, uint32(fd))
					return nil
				})
			}
			return nil
		})
	}
	if cfg.BackendID != "" {
		ae.String(attrBackendIdentifier, cfg.BackendID)
	}
}

// fdsOf returns the descriptors of socks. The caller keeps socks alive
// (runtime.KeepAlive) until the kernel took its references.
func fdsOf(socks []*os.File) ([]int, error) {
	fds := make([]int, len(socks))
	for i, f := range socks {
		if f == nil {
			return nil, fmt.Errorf("nbdnl: socket %d is nil: %w", i, unix.EBADF)
		}
		fds[i] = int(f.Fd())
	}
	return fds, nil
}

// execute sends one command. CONNECT and STATUS get a reply message;
// DISCONNECT and RECONFIGURE send none, so they ask for an
// acknowledgement instead (else Execute would wait forever).
func (c *Conn) execute(cmd uint8, data []byte, ack bool) ([]genetlink.Message, error) {
	flags := netlink.Request
	if ack {
		flags |= netlink.Acknowledge
	}
	msgs, err := c.c.Execute(genetlink.Message{
		Header: genetlink.Header{Command: cmd, Version: c.fam.Version},
		Data:   data,
	}, c.fam.ID, flags)
	if err != nil {
		return nil, fmt.Errorf("nbdnl: %s: %w", cmdName(cmd), err)
	}
	return msgs, nil
}

func cmdName(cmd uint8) string {
	switch cmd {
	case cmdConnect:
		return "CONNECT"
	case cmdDisconnect:
		return "DISCONNECT"
	case cmdReconfigure:
		return "RECONFIGURE"
	case cmdLinkDead:
		return "LINK_DEAD"
	case cmdStatus:
		return "STATUS"
	}
	return fmt.Sprintf("command %d", cmd)
}

// Connect attaches a device to socks, one socket per hardware queue,
// already in the NBD transmission phase, and returns the device's index
// N (/dev/nbdN) from the kernel's reply. The kernel takes references of
// its own: the caller may close its descriptors afterwards.
func (c *Conn) Connect(cfg Config, socks []*os.File) (uint32, error) {
	if len(socks) == 0 {
		return 0, fmt.Errorf("nbdnl: CONNECT needs at least one socket: %w", unix.EINVAL)
	}
	if int64(cfg.Index) > math.MaxUint32 || cfg.Index < -1 {
		return 0, fmt.Errorf("nbdnl: device index %d out of range: %w", cfg.Index, unix.EINVAL)
	}
	fds, err := fdsOf(socks)
	if err != nil {
		return 0, err
	}
	ae := netlink.NewAttributeEncoder()
	encodeConfig(ae, cfg.Index, cfg, fds, false)
	b, err := ae.Encode()
	if err != nil {
		return 0, fmt.Errorf("nbdnl: CONNECT: %w", err)
	}
	msgs, err := c.execute(cmdConnect, b, false)
	runtime.KeepAlive(socks)
	if err != nil {
		return 0, err
	}
	return decodeConnectReply(msgs)
}

// decodeConnectReply finds the device index in CONNECT's reply.
func decodeConnectReply(msgs []genetlink.Message) (uint32, error) {
	for _, m := range msgs {
		idx, ok, err := decodeIndex(m.Data)
		if err != nil {
			return 0, fmt.Errorf("nbdnl: CONNECT reply: %w", err)
		}
		if ok {
			return idx, nil
		}
	}
	return 0, fmt.Errorf("nbdnl: CONNECT reply carries no device index: %w", unix.EPROTO)
}

// Reconfigure hands device index new sockets in place of its dead ones
// and updates its timeouts and client flags; cfg.Index, SizeBytes and
// BlockSize are ignored. The kernel cannot add sockets: it answers
// ENOSPC when none is dead, and EINVAL when cfg.BackendID differs from
// the device's.
func (c *Conn) Reconfigure(index uint32, cfg Config, socks []*os.File) error {
	fds, err := fdsOf(socks)
	if err != nil {
		return err
	}
	ae := netlink.NewAttributeEncoder()
	encodeConfig(ae, int(index), cfg, fds, true)
	b, err := ae.Encode()
	if err != nil {
		return fmt.Errorf("nbdnl: RECONFIGURE: %w", err)
	}
	_, err = c.execute(cmdReconfigure, b, true)
	runtime.KeepAlive(socks)
	return err
}

// Resize sets the size of device index (a RECONFIGURE with only the size:
// the kernel applies it as at CONNECT and tells the block layer, which
// sends a change uevent). backendID must be the device's backend
// identifier, if it was connected with one: the kernel refuses (EINVAL,
// "must specify backend") a RECONFIGURE of such a device without it.
func (c *Conn) Resize(index uint32, backendID string, sizeBytes uint64) error {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, index)
	ae.Uint64(attrSizeBytes, sizeBytes)
	if backendID != "" {
		ae.String(attrBackendIdentifier, backendID)
	}
	b, err := ae.Encode()
	if err != nil {
		return fmt.Errorf("nbdnl: RECONFIGURE: %w", err)
	}
	_, err = c.execute(cmdReconfigure, b, true)
	return err
}

// Disconnect detaches device index: the kernel sends NBD_CMD_DISC on its
// sockets, and IO still queued fails. The device itself stays unless it
// was connected with DestroyOnDisconnect.
func (c *Conn) Disconnect(index uint32) error {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, index)
	b, err := ae.Encode()
	if err != nil {
		return fmt.Errorf("nbdnl: DISCONNECT: %w", err)
	}
	_, err = c.execute(cmdDisconnect, b, true)
	return err
}

// Status reports whether device index is connected. A device the kernel
// does not have gives an error wrapping ENOENT.
func (c *Conn) Status(index uint32) (connected bool, err error) {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, index)
	b, err := ae.Encode()
	if err != nil {
		return false, fmt.Errorf("nbdnl: STATUS: %w", err)
	}
	st, err := c.status(b)
	if err != nil {
		return false, err
	}
	connected, ok := st[index]
	if !ok {
		return false, fmt.Errorf("nbdnl: STATUS: no device nbd%d: %w", index, unix.ENOENT)
	}
	return connected, nil
}

// StatusAll reports every nbd device the kernel has, and whether it is
// connected.
func (c *Conn) StatusAll() (map[uint32]bool, error) { return c.status(nil) }

func (c *Conn) status(req []byte) (map[uint32]bool, error) {
	msgs, err := c.execute(cmdStatus, req, false)
	if err != nil {
		return nil, err
	}
	out := make(map[uint32]bool)
	for _, m := range msgs {
		if err := decodeStatus(m.Data, out); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// decodeIndex finds NBD_ATTR_INDEX among the attributes b.
func decodeIndex(b []byte) (idx uint32, ok bool, err error) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return 0, false, err
	}
	for ad.Next() {
		if ad.Type() == attrIndex {
			if n := len(ad.Bytes()); n != 4 {
				return 0, false, fmt.Errorf("index attribute of %d bytes: %w", n, unix.EPROTO)
			}
			idx, ok = ad.Uint32(), true
		}
	}
	if err := ad.Err(); err != nil {
		return 0, false, err
	}
	return idx, ok, nil
}

// decodeStatus adds the devices listed in a STATUS reply's attributes b
// to out.
func decodeStatus(b []byte, out map[uint32]bool) error {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return fmt.Errorf("nbdnl: STATUS reply: %w", err)
	}
	for ad.Next() {
		if ad.Type() != attrDeviceList {
			continue
		}
		ad.Nested(func(list *netlink.AttributeDecoder) error {
			for list.Next() {
				if list.Type() != deviceItem {
					continue
				}
				list.Nested(func(item *netlink.AttributeDecoder) error {
					return decodeDevice(item, out)
				})
			}
			return nil
		})
	}
	if err := ad.Err(); err != nil {
		return fmt.Errorf("nbdnl: STATUS reply: %w", err)
	}
	return nil
}

// decodeDevice decodes one NBD_DEVICE_ITEM into out.
func decodeDevice(item *netlink.AttributeDecoder, out map[uint32]bool) error {
	var idx uint32
	var haveIdx, connected bool
	for item.Next() {
		switch item.Type() {
		case deviceIndex:
			if n := len(item.Bytes()); n != 4 {
				return fmt.Errorf("device index of %d bytes: %w", n, unix.EPROTO)
			}
			idx, haveIdx = item.Uint32(), true
		case deviceConnected:
			if n := len(item.Bytes()); n != 1 {
				return fmt.Errorf("connected flag of %d bytes: %w", n, unix.EPROTO)
			}
			connected = item.Uint8() != 0
		}
	}
	if !haveIdx {
		return fmt.Errorf("device item without an index: %w", unix.EPROTO)
	}
	out[idx] = connected
	return nil
}

// decodeLinkDead returns the device index a LINK_DEAD notification
// carries; ok is false for any other message and for a malformed one.
func decodeLinkDead(m genetlink.Message) (index uint32, ok bool) {
	if m.Header.Command != cmdLinkDead {
		return 0, false
	}
	idx, ok, err := decodeIndex(m.Data)
	return idx, ok && err == nil
}

// WatchLinkDead joins the nbd multicast group on a netlink socket of its
// own and delivers the index of every device one of whose sockets died
// (LINK_DEAD): the kernel then holds the device's IO for its
// DeadConnTimeout, waiting for a Reconfigure with new sockets.
//
// The channel is closed when ctx is done (which also closes the socket)
// or when the socket fails; ctx.Err() tells the two apart. If the
// receiver lags so far behind that the kernel drops notifications
// (ENOBUFS), the watch goes on without them: callers that must not miss
// a device should reconcile with StatusAll.
func (c *Conn) WatchLinkDead(ctx context.Context) (<-chan uint32, error) {
	var group uint32
	for _, g := range c.fam.Groups {
		if g.Name == groupName {
			group = g.ID
		}
	}
	if group == 0 {
		return nil, fmt.Errorf("nbdnl: family %q has no multicast group %q: %w", FamilyName, groupName, unix.ENOENT)
	}
	wc, err := c.dialWatch()
	if err != nil {
		return nil, fmt.Errorf("nbdnl: dial generic netlink: %w", err)
	}
	if err := wc.JoinGroup(group); err != nil {
		wc.Close()
		return nil, fmt.Errorf("nbdnl: join %s: %w", groupName, err)
	}
	return runWatch(ctx, wc), nil
}

// runWatch delivers LINK_DEAD indices received on wc until ctx ends or
// wc fails, then closes the channel. It owns wc and closes it: that
// unblocks a pending Receive when ctx ends.
func runWatch(ctx context.Context, wc watchConn) <-chan uint32 {
	ch := make(chan uint32, 16)
	stopped := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
		case <-stopped:
		}
		wc.Close()
	}()
	go func() {
		defer close(ch)
		defer close(stopped)
		for {
			msgs, _, err := wc.Receive()
			if err != nil {
				if errors.Is(err, unix.ENOBUFS) && ctx.Err() == nil {
					continue // notifications were dropped; keep listening
				}
				return // closed because ctx ended, or the socket failed
			}
			for _, m := range msgs {
				idx, ok := decodeLinkDead(m)
				if !ok {
					continue
				}
				select {
				case ch <- idx:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return ch
}
