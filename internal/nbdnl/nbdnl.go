// Package nbdnl attaches the kernel's nbd driver (/dev/nbdN) to sockets
// over generic netlink: CONNECT with one socket per hardware queue,
// RECONFIGURE to replace dead sockets, DISCONNECT, STATUS, and the
// LINK_DEAD multicast the kernel sends when a socket dies while
// dead_conn_timeout holds the device. The numbers are those of the
// kernel's include/uapi/linux/nbd-netlink.h.
//
// Kernels without the "nbd" generic netlink family (before 4.12, or with
// the module not loaded) get ErrNoFamily; ioctl.go is the fallback.
package nbdnl

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/netlink"
)

// Generic netlink family, version and multicast group of the nbd driver.
const (
	FamilyName = "nbd"
	groupName  = "nbd_mc_group"
)

// Commands.
const (
	cmdConnect     = 1
	cmdDisconnect  = 2
	cmdReconfigure = 3
	cmdLinkDead    = 4
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
	attrSockets           = 7  // nested: sockItem{sockFD}
	attrDeadConnTimeout   = 8  // u64, seconds
	attrDeviceList        = 9  // nested: deviceItem{deviceIndex, deviceConnected}
	attrBackendIdentifier = 10 // string

	sockItem = 1
	sockFD   = 1

	deviceItem      = 1
	deviceIndex     = 1 // u32
	deviceConnected = 2 // u8
)

// Client flags (NBD_CFLAG_*).
const (
	// DestroyOnDisconnect deletes the device when it disconnects.
	DestroyOnDisconnect = 1 << 0
	// DisconnectOnClose disconnects when the last opener closes it.
	DisconnectOnClose = 1 << 1
)

// ErrNoFamily means the kernel has no nbd generic netlink family: the nbd
// module is not loaded, or the kernel predates it (use the ioctls).
var ErrNoFamily = errors.New("nbdnl: the kernel has no nbd generic netlink family (is the nbd module loaded?)")

// Config is what CONNECT and RECONFIGURE tell the kernel.
type Config struct {
	// Index is the device minor N of /dev/nbdN; -1 lets the kernel pick
	// a free device (or create one).
	Index int
	// SizeBytes and BlockSize (a power of two, 512..PAGE_SIZE).
	SizeBytes uint64
	BlockSize uint64
	// Timeout is the per-request timeout; DeadConnTimeout is how long
	// IO waits for a RECONFIGURE after a socket died. Whole seconds.
	Timeout         time.Duration
	DeadConnTimeout time.Duration
	// ServerFlags are the NBD transmission flags of the export;
	// ClientFlags the NBD_CFLAG_* bits above.
	ServerFlags uint64
	ClientFlags uint64
	// BackendID names the backend (kernel 5.19+ keeps it in
	// /sys/block/nbdN/backend and refuses a RECONFIGURE naming another).
	BackendID string
}

// Conn talks to the nbd family. It is safe for concurrent use.
type Conn struct {
	mu  sync.Mutex
	c   *genetlink.Conn
	fam genetlink.Family
}

// Dial opens a generic netlink socket and looks up the nbd family.
func Dial() (*Conn, error) {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("nbdnl: %w", err)
	}
	return newConn(c)
}

func newConn(c *genetlink.Conn) (*Conn, error) {
	fam, err := c.GetFamily(FamilyName)
	if err != nil {
		c.Close()
		if errors.Is(err, os.ErrNotExist) {
			return nil, ErrNoFamily
		}
		return nil, fmt.Errorf("nbdnl: family %s: %w", FamilyName, err)
	}
	return &Conn{c: c, fam: fam}, nil
}

// Close closes the netlink socket.
func (c *Conn) Close() error { return c.c.Close() }

func secs(d time.Duration) uint64 {
	if d <= 0 {
		return 0
	}
	return uint64((d + time.Second - 1) / time.Second)
}

// encodeConfig lays out cfg and the sockets' descriptors as attributes.
func encodeConfig(ae *netlink.AttributeEncoder, cfg Config, fds []int) {
	if cfg.Index >= 0 {
		ae.Uint32(attrIndex, uint32(cfg.Index))
	}
	if cfg.SizeBytes != 0 {
		ae.Uint64(attrSizeBytes, cfg.SizeBytes)
	}
	if cfg.BlockSize != 0 {
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
	if cfg.ClientFlags != 0 {
		ae.Uint64(attrClientFlags, cfg.ClientFlags)
	}
	if len(fds) > 0 {
		ae.Nested(attrSockets, func(nae *netlink.AttributeEncoder) error {
			for _, fd := range fds {
				nae.Nested(sockItem, func(s *netlink.AttributeEncoder) error {
					s.Uint32(sockFD, uint32(fd))
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

func fdsOf(socks []*os.File) []int {
	fds := make([]int, len(socks))
	for i, f := range socks {
		fds[i] = int(f.Fd())
	}
	return fds
}

// execute sends one command; CONNECT and STATUS get a reply, DISCONNECT
// and RECONFIGURE only an acknowledgement.
func (c *Conn) execute(cmd uint8, data []byte, ack bool) ([]genetlink.Message, error) {
	flags := netlink.Request
	if ack {
		flags |= netlink.Acknowledge
	}
	c.mu.Lock()
	defer c.mu.Unlock()
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
	case cmdStatus:
		return "STATUS"
	}
	return fmt.Sprintf("command %d", cmd)
}

// Connect attaches a device to socks (one per hardware queue) and returns
// its index: /dev/nbdN. The kernel duplicates the descriptors; the caller
// keeps and may close its own.
func (c *Conn) Connect(cfg Config, socks []*os.File) (uint32, error) {
	if len(socks) == 0 {
		return 0, errors.New("nbdnl: CONNECT needs at least one socket")
	}
	ae := netlink.NewAttributeEncoder()
	encodeConfig(ae, cfg, fdsOf(socks))
	b, err := ae.Encode()
	if err != nil {
		return 0, err
	}
	msgs, err := c.execute(cmdConnect, b, false)
	if err != nil {
		return 0, err
	}
	for _, m := range msgs {
		if idx, ok, err := decodeIndex(m.Data); err != nil {
			return 0, err
		} else if ok {
			return idx, nil
		}
	}
	return 0, errors.New("nbdnl: CONNECT reply carries no device index")
}

// Reconfigure replaces the dead sockets of device index with socks and
// updates its timeouts and flags (the kernel cannot add sockets: it
// answers ENOSPC when none is dead).
func (c *Conn) Reconfigure(index uint32, cfg Config, socks []*os.File) error {
	cfg.Index = int(index)
	cfg.SizeBytes, cfg.BlockSize = 0, 0 // RECONFIGURE does not resize
	ae := netlink.NewAttributeEncoder()
	encodeConfig(ae, cfg, fdsOf(socks))
	b, err := ae.Encode()
	if err != nil {
		return err
	}
	_, err = c.execute(cmdReconfigure, b, true)
	return err
}

// Disconnect detaches device index: queued IO fails, the device stays
// (unless it was connected with DestroyOnDisconnect).
func (c *Conn) Disconnect(index uint32) error {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, index)
	b, err := ae.Encode()
	if err != nil {
		return err
	}
	_, err = c.execute(cmdDisconnect, b, true)
	return err
}

// Status reports whether device index is connected.
func (c *Conn) Status(index uint32) (bool, error) {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, index)
	b, err := ae.Encode()
	if err != nil {
		return false, err
	}
	st, err := c.status(b)
	if err != nil {
		return false, err
	}
	connected, ok := st[index]
	if !ok {
		return false, fmt.Errorf("nbdnl: STATUS: no device nbd%d: %w", index, os.ErrNotExist)
	}
	return connected, nil
}

// StatusAll reports every nbd device and whether it is connected.
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

// decodeIndex finds NBD_ATTR_INDEX in a reply or notification.
func decodeIndex(b []byte) (idx uint32, ok bool, err error) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return 0, false, fmt.Errorf("nbdnl: %w", err)
	}
	for ad.Next() {
		if ad.Type() == attrIndex {
			if len(ad.Bytes()) != 4 {
				return 0, false, fmt.Errorf("nbdnl: index attribute of %d bytes", len(ad.Bytes()))
			}
			idx, ok = ad.Uint32(), true
		}
	}
	if err := ad.Err(); err != nil {
		return 0, false, fmt.Errorf("nbdnl: %w", err)
	}
	return idx, ok, nil
}

// decodeStatus adds the devices of a STATUS reply to out.
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
					var idx uint32
					var haveIdx, connected bool
					for item.Next() {
						switch item.Type() {
						case deviceIndex:
							if len(item.Bytes()) != 4 {
								return fmt.Errorf("device index of %d bytes", len(item.Bytes()))
							}
							idx, haveIdx = item.Uint32(), true
						case deviceConnected:
							if len(item.Bytes()) != 1 {
								return fmt.Errorf("connected flag of %d bytes", len(item.Bytes()))
							}
							connected = item.Uint8() != 0
						}
					}
					if !haveIdx {
						return errors.New("device item without an index")
					}
					out[idx] = connected
					return nil
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

// WatchLinkDead joins the nbd multicast group on a socket of its own and
// sends the index of every device whose socket died (LINK_DEAD) until ctx
// ends; then it closes the channel.
func WatchLinkDead(ctx context.Context) (<-chan uint32, error) {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("nbdnl: %w", err)
	}
	return watchLinkDead(ctx, c)
}

func watchLinkDead(ctx context.Context, c *genetlink.Conn) (<-chan uint32, error) {
	fam, err := c.GetFamily(FamilyName)
	if err != nil {
		c.Close()
		if errors.Is(err, os.ErrNotExist) {
			return nil, ErrNoFamily
		}
		return nil, fmt.Errorf("nbdnl: family %s: %w", FamilyName, err)
	}
	var group uint32
	for _, g := range fam.Groups {
		if g.Name == groupName {
			group = g.ID
		}
	}
	if group == 0 {
		c.Close()
		return nil, fmt.Errorf("nbdnl: family %s has no group %s", FamilyName, groupName)
	}
	if err := c.JoinGroup(group); err != nil {
		c.Close()
		return nil, fmt.Errorf("nbdnl: join %s: %w", groupName, err)
	}
	return runWatch(ctx, c.Receive, c.Close), nil
}

// runWatch delivers LINK_DEAD indices from receive until ctx ends (then
// closeFn unblocks receive) or receive fails.
func runWatch(ctx context.Context, receive func() ([]genetlink.Message, []netlink.Message, error), closeFn func() error) <-chan uint32 {
	ch := make(chan uint32, 16)
	stop := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
		case <-stop:
		}
		closeFn() // unblocks receive
	}()
	go func() {
		defer close(ch)
		defer close(stop)
		for {
			msgs, _, err := receive()
			if err != nil {
				return // closed (ctx done) or the socket failed
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

// decodeLinkDead returns the device index of a LINK_DEAD notification.
func decodeLinkDead(m genetlink.Message) (uint32, bool) {
	if m.Header.Command != cmdLinkDead {
		return 0, false
	}
	idx, ok, err := decodeIndex(m.Data)
	return idx, ok && err == nil
}
