// Dialling: address and route resolution, the QP, and the connection
// request with its answer.

package rdma

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/ibverbs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

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
