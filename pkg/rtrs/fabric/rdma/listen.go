// The listener: rdma_listen, the connection requests it takes off its
// event channel, and accepting or rejecting them.

package rdma

import (
	"context"
	"errors"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/rnbd/rnbd/pkg/ibverbs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

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
