package clientd

import (
	"context"

	"github.com/rnbd/rnbd/pkg/mirror"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// ioDev is what a frontend serves: one RNBD device (rnbdDev) or a mirror
// over RNBD devices on several storage nodes (mirrorDev). The frontends
// know nothing else of it.
type ioDev interface {
	// Name is its name for logs: the device_path, or the mirror's name.
	Name() string
	// Size is the device's size in bytes now.
	Size() int64
	// Info is what the device offers: its limits and cache policy.
	Info() rnbd.OpenRsp
	// ReadOnly says whether it takes no writes.
	ReadOnly() bool
	// Describe names it for NBD clients ("rnbd s1/vol1").
	Describe() string
	// AllocBuffer is n bytes of memory its requests carry data in
	// (registered with the sessions IO goes through).
	AllocBuffer(n int) (ioBuf, error)
	// Submit starts r; r.done is called once, errors included.
	Submit(r *devReq)
}

// ioBuf is an ioDev's request memory: *rtrs.Buffer or *mirror.Buffer.
type ioBuf interface {
	Bytes() []byte
	Free() error
}

// devReq is a frontend's request to its ioDev, reused: the request of
// each kind of device is in it, so that none is allocated per IO.
type devReq struct {
	blockReq
	plug *rtrs.Plug
	// done is called once the request ended; set by init.
	done func(r *devReq, err error)
	io   rnbd.IOReq // on an rnbdDev
	mr   mirror.Req // on a mirrorDev
}

// init sets the request's completion once (method values allocate: not
// per IO).
func (r *devReq) init(done func(*devReq, error)) {
	r.done = done
	r.io.Done = r.ioDone
	r.mr.Done = r.mirrorDone
}

func (r *devReq) ioDone(_ *rnbd.IOReq, err error)     { r.done(r, err) }
func (r *devReq) mirrorDone(_ *mirror.Req, err error) { r.done(r, err) }

// burst is, during done, the transport's burst the request completed in
// (nil: none): its own on an rnbdDev, that of its last leg on a
// mirrorDev.
func (r *devReq) burst() *rtrs.Burst {
	if r.io.Burst != nil {
		return r.io.Burst
	}
	return r.mr.Burst
}

// rnbdDev is one RNBD device of a session.
type rnbdDev struct{ *rnbd.CltDev }

func (d rnbdDev) ReadOnly() bool { return d.Mode() == rnbd.AccessRO }

func (d rnbdDev) Describe() string { return "rnbd " + d.Session().Session().Name() + "/" + d.Name() }

func (d rnbdDev) AllocBuffer(n int) (ioBuf, error) {
	b, err := d.Session().Session().AllocBuffer(n)
	if err != nil {
		return nil, err
	}
	return b, nil
}

func (d rnbdDev) Submit(r *devReq) {
	r.blockReq.fill(&r.io) // Burst and the rest cleared, Done kept
	r.io.Plug = r.plug
	if err := d.CltDev.Submit(context.Background(), &r.io); err != nil {
		r.done(r, err)
	}
}
