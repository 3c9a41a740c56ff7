package rnbd

import (
	"context"
	"fmt"
	"sync"
	"syscall"

	"github.com/rnbd/rnbd/pkg/rtrs"
)

// Client speaks RNBD over an RTRS session: devices opened through it share
// the session's paths and permits. It is safe for concurrent use.
type Client struct {
	sess *rtrs.CltSession

	// adminMu serializes admin messages, which share one buffer.
	adminMu sync.Mutex
	admin   *rtrs.Buffer
	ver     uint8
}

// NewClient negotiates the protocol version on sess (SESS_INFO).
func NewClient(ctx context.Context, sess *rtrs.CltSession) (*Client, error) {
	buf, err := sess.AllocBuffer(4096)
	if err != nil {
		return nil, err
	}
	c := &Client{sess: sess, admin: buf}
	if err := c.SessInfo(ctx); err != nil {
		buf.Free()
		return nil, err
	}
	return c, nil
}

// Session is the client's RTRS session.
func (c *Client) Session() *rtrs.CltSession { return c.sess }

// Version is the protocol major version agreed with the server.
func (c *Client) Version() int {
	c.adminMu.Lock()
	defer c.adminMu.Unlock()
	return int(c.ver)
}

// SessInfo (re)negotiates the version; done again after a reconnect.
func (c *Client) SessInfo(ctx context.Context) error {
	c.adminMu.Lock()
	defer c.adminMu.Unlock()
	var usr [SessInfoSize]byte
	(&SessInfo{Ver: ProtoVerMajor}).Encode(usr[:], MsgSessInfo)
	if err := c.sess.Do(ctx, rtrs.AdminCon, rtrs.Read, usr[:], c.admin, 0, SessInfoRspSize); err != nil {
		return fmt.Errorf("rnbd: session info: %w", err)
	}
	var rsp SessInfo
	if err := rsp.Decode(c.admin.Bytes()[:SessInfoRspSize], MsgSessInfoRsp); err != nil {
		return fmt.Errorf("rnbd: session info response: %w", err)
	}
	if rsp.Ver == 0 || rsp.Ver > ProtoVerMajor {
		return fmt.Errorf("rnbd: server answered protocol version %d: %w", rsp.Ver, syscall.EPROTO)
	}
	c.ver = rsp.Ver
	return nil
}

// Device is a remote device opened through a client.
type Device struct {
	c    *Client
	Name string
	Mode AccessMode
	Info OpenRsp
}

// ErrBadOpenRsp is returned for an OPEN_RSP that describes no usable device.
var ErrBadOpenRsp = fmt.Errorf("rnbd: server answered with an unusable device: %w", syscall.EPROTO)

// Open opens the remote device name (OPEN). Opening a name the session
// has open already returns the same device id.
func (c *Client) Open(ctx context.Context, name string, mode AccessMode) (*Device, error) {
	if len(name) == 0 || len(name) >= nameMax {
		return nil, ErrBadDevName
	}
	for i := 0; i < len(name); i++ {
		if name[i] == 0 {
			return nil, ErrBadDevName
		}
	}
	rsp, err := c.open(ctx, name, mode)
	if err != nil {
		return nil, err
	}
	return &Device{c: c, Name: name, Mode: mode, Info: rsp}, nil
}

func (c *Client) open(ctx context.Context, name string, mode AccessMode) (OpenRsp, error) {
	c.adminMu.Lock()
	defer c.adminMu.Unlock()
	var usr [OpenSize]byte
	(&Open{AccessMode: mode, DevName: name}).Encode(usr[:])
	if err := c.sess.Do(ctx, rtrs.AdminCon, rtrs.Read, usr[:], c.admin, 0, OpenRspSize); err != nil {
		return OpenRsp{}, fmt.Errorf("rnbd: open %s: %w", name, err)
	}
	var rsp OpenRsp
	if err := rsp.Decode(c.admin.Bytes()[:OpenRspSize]); err != nil {
		return OpenRsp{}, fmt.Errorf("rnbd: open %s: %w", name, err)
	}
	if !validBlockSize(rsp.LogicalBlockSize) || !validBlockSize(rsp.PhysicalBlockSize) {
		return OpenRsp{}, fmt.Errorf("%w: block sizes %d/%d", ErrBadOpenRsp, rsp.LogicalBlockSize, rsp.PhysicalBlockSize)
	}
	return rsp, nil
}

func validBlockSize(n uint16) bool { return n >= 512 && n&(n-1) == 0 }

// Close closes the device on the server (CLOSE).
func (d *Device) Close(ctx context.Context) error {
	var usr [CloseSize]byte
	(&Close{DeviceID: d.Info.DeviceID}).Encode(usr[:])
	if err := d.c.sess.Do(ctx, rtrs.AdminCon, rtrs.Write, usr[:], nil, 0, 0); err != nil {
		return fmt.Errorf("rnbd: close %s: %w", d.Name, err)
	}
	return nil
}

// Size is the device size in bytes.
func (d *Device) Size() int64 { return int64(d.Info.NSectors) * 512 }

// Submit sends one IO on permit p and reports its end to conf. For reads
// and writes the data is buf[bufOff:bufOff+n]; the other operations carry
// no data, n is their length. off and n are in bytes; off must be a
// multiple of 512.
func (d *Device) Submit(p *rtrs.Permit, op Op, flags uint32, off int64, n int, buf *rtrs.Buffer, bufOff int, conf rtrs.Confirmer) error {
	if off < 0 || off%512 != 0 || n < 0 || int64(n) > 1<<32-1 {
		return syscall.EINVAL
	}
	var usr [IOSize]byte
	(&IO{DeviceID: d.Info.DeviceID, Sector: uint64(off) / 512, RW: uint32(op) | flags, Size: uint32(n)}).Encode(usr[:])
	switch op {
	case OpRead:
		return d.c.sess.Request(rtrs.Read, p, conf, usr[:], buf, bufOff, n)
	case OpWrite:
		return d.c.sess.Request(rtrs.Write, p, conf, usr[:], buf, bufOff, n)
	default:
		return d.c.sess.Request(rtrs.Write, p, conf, usr[:], nil, 0, 0)
	}
}

// Do runs one IO and waits for it: for tools and tests, not the IO path.
func (d *Device) Do(ctx context.Context, op Op, flags uint32, off int64, n int, buf *rtrs.Buffer, bufOff int) error {
	p, err := d.c.sess.GetPermit(ctx, rtrs.IOCon)
	if err != nil {
		return err
	}
	done := make(chanConfirmer, 1)
	if err := d.Submit(p, op, flags, off, n, buf, bufOff, done); err != nil {
		d.c.sess.PutPermit(p)
		return err
	}
	err = <-done
	d.c.sess.PutPermit(p)
	return err
}

type chanConfirmer chan error

func (c chanConfirmer) Confirm(err error) { c <- err }
