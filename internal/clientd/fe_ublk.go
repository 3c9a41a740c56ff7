package clientd

import (
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/frontend/ublk"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// ublkBackend serves a mapped device to a ublk device. Each ublk queue's
// tag buffers are registered memory of the device's session (it is a
// ublk.BufferProvider), so the kernel copies request data straight into
// the memory RTRS sends from and receives into: no copy of ours, and no
// wait for a buffer on the queue's thread.
type ublkBackend struct {
	dev  ioDev
	reqs sync.Pool // *ublkIO

	mu     sync.Mutex                   // serializes changes of queues
	queues atomic.Pointer[[]*ublkQueue] // index = queue; copied on change
}

// ublkQueue is what one ublk queue's requests use: its registered
// buffers, and the plug that holds the requests of one batch
// (ublk.Batcher) so that they leave in one fabric post. Only the
// queue's goroutine uses the plug (docs/rtrs.md, "Batching").
type ublkQueue struct {
	buf  ioBuf
	plug rtrs.Plug
}

// ublkIO carries one ublk request through the device.
type ublkIO struct {
	devReq
	ur      *ublk.Request
	ublkEnd func(*ublk.Request, error)
	b       *ublkBackend
}

func newUblkBackend(dev ioDev) *ublkBackend {
	b := &ublkBackend{dev: dev}
	b.queues.Store(new([]*ublkQueue))
	b.reqs.New = func() any {
		r := &ublkIO{b: b}
		r.init(r.complete) // a method value allocates: once per ublkIO
		return r
	}
	return b
}

// QueueBuffers implements ublk.BufferProvider: n bytes of registered
// memory for queue q.
func (b *ublkBackend) QueueBuffers(q, n int) ([]byte, error) {
	buf, err := b.dev.AllocBuffer(n)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	old := *b.queues.Load()
	qs := make([]*ublkQueue, max(len(old), q+1))
	copy(qs, old)
	qs[q] = &ublkQueue{buf: buf}
	b.queues.Store(&qs)
	b.mu.Unlock()
	return buf.Bytes()[:n], nil
}

// ReleaseQueueBuffers implements ublk.BufferProvider.
func (b *ublkBackend) ReleaseQueueBuffers(q int, _ []byte) {
	b.mu.Lock()
	qs := append([]*ublkQueue(nil), *b.queues.Load()...)
	uq := qs[q]
	qs[q] = nil
	b.queues.Store(&qs)
	b.mu.Unlock()
	uq.plug.Unplug()
	uq.buf.Free()
}

// BatchEnd implements ublk.Batcher: the batch's requests leave.
func (b *ublkBackend) BatchEnd(q int) {
	if qs := *b.queues.Load(); q < len(qs) && qs[q] != nil {
		qs[q].plug.Unplug()
	}
}

func (r *ublkIO) complete(_ *devReq, err error) {
	ur, done := r.ur, r.ublkEnd
	r.ur, r.ublkEnd = nil, nil
	r.b.reqs.Put(r)
	done(ur, err)
}

// Submit implements ublk.Backend.
func (b *ublkBackend) Submit(ur *ublk.Request, done func(*ublk.Request, error)) {
	r := b.reqs.Get().(*ublkIO)
	r.ur, r.ublkEnd = ur, done
	br := blockReq{off: ur.Offset, n: ur.Len, fua: ur.FUA, noUnmap: ur.NoUnmap}
	switch ur.Op {
	case ublk.OpRead:
		br.op = rnbd.OpRead
	case ublk.OpWrite:
		br.op = rnbd.OpWrite
	case ublk.OpFlush:
		br.op = rnbd.OpFlush
	case ublk.OpDiscard:
		br.op = rnbd.OpDiscard
	case ublk.OpWriteZeroes:
		br.op = rnbd.OpWriteZeroes
	default:
		// The kernel gets the errno of the error (EIO without one):
		// EOPNOTSUPP, an op this device does not do.
		r.complete(&r.devReq, fmt.Errorf("ublk %v: %w", ur.Op, syscall.EOPNOTSUPP))
		return
	}
	uq := (*b.queues.Load())[ur.Queue()]
	br.buf, br.bufOff = uq.buf, ur.BufferOffset()
	r.blockReq = br
	r.plug = &uq.plug
	b.dev.Submit(&r.devReq)
}

// ublkCookie is what a ublk device carries in the kernel to name what it
// serves (the cookie of ublk.Options): a restarted daemon takes a device
// back only for the same session and device, as BACKEND_IDENTIFIER does
// for nbd.
func ublkCookie(backendID string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(backendID))
	return h.Sum64()
}

// ublkFE serves a device as /dev/ublkbN.
type ublkFE struct {
	d *Daemon
	u *ublk.Device
}

func (f *ublkFE) ioMode() string { return "ublk" }

// resized sets /dev/ublkbN's capacity (UPDATE_SIZE, Linux 6.16).
func (f *ublkFE) resized(bytes int64) error { return ublk.UpdateSize(f.u.ID(), bytes) }
func (f *ublkFE) path() string              { return f.u.Path() }

func (f *ublkFE) busy() string {
	return inUse(f.path())
}

// remove stops and deletes the device; its queues' buffers go with it.
func (f *ublkFE) remove() {
	if err := f.u.Stop(); err != nil {
		f.d.log.WithError(err).WithField("ublk", f.path()).Warn("ublk stop")
	}
}

// detach leaves the device for user recovery: the kernel holds its IO
// and the restarted daemon takes it back. Without recovery in the kernel
// it is stopped.
func (f *ublkFE) detach() {
	if err := f.u.Detach(); err != nil {
		f.d.log.WithError(err).WithField("ublk", f.path()).Warn("ublk detach")
	}
}

// attachUblk serves a mapped device as a ublk device (/dev/ublkbN). With
// index >= 0 it first takes that device back from the daemon that served
// it before (user recovery; the IO the kernel held then runs here), else
// or if that fails it makes a new one.
func (d *Daemon) attachUblk(dev ioDev, backendID string, index int) (frontend, error) {
	info := dev.Info()
	ro := dev.ReadOnly()
	lbs := max(int(info.LogicalBlockSize), 512)
	opts := ublk.Options{
		Size:              dev.Size(),
		LogicalBlockSize:  lbs,
		PhysicalBlockSize: max(int(info.PhysicalBlockSize), lbs),
		// Every tag has a buffer of MaxIOBytes, registered with the
		// session: depth × ublk_max_io_kb per queue, one queue per CPU.
		// The block layer splits larger IO at it (max_sectors_kb);
		// /dev/nbdN takes up to slotSize.
		QueueDepth:    d.cfg.UblkQueueDepth,
		MaxIOBytes:    d.cfg.UblkMaxIOKB << 10,
		Discard:       !ro && info.MaxDiscardSectors > 0,
		WriteZeroes:   !ro && info.MaxWriteZeroesSectors > 0,
		VolatileCache: info.CachePolicy&rnbd.CacheWriteback != 0,
		FUA:           info.CachePolicy&rnbd.CacheFUA != 0,
		ReadOnly:      ro,
		Recovery:      true,
		Cookie:        ublkCookie(backendID),
	}
	l := d.log.WithField("device_path", dev.Name())
	if index >= 0 {
		u, err := ublk.Recover(index, opts, newUblkBackend(dev))
		if err == nil {
			l.WithField("ublk", u.Path()).Info("took the ublk device back (user recovery)")
			f := &ublkFE{d: d, u: u}
			if u.Size() != dev.Size() { // resized on the server meanwhile
				if err := f.resized(dev.Size()); err != nil {
					l.WithError(err).WithFields(log.Fields{"ublk": u.Path(), "size": u.Size(), "remote_size": dev.Size()}).
						Warn("the device keeps its size: could not apply the new one")
				}
			}
			return f, nil
		}
		l.WithError(err).WithField("ublk", index).Warn("could not take the ublk device back; making a new one")
		d.removeOrphanUblk(index, opts.Cookie, l)
	}
	u, err := ublk.New(opts, newUblkBackend(dev))
	if errors.Is(err, ublk.ErrNoUblk) {
		return nil, ctl.Errorf(ctl.CodeNotSupported, "this kernel has no ublk driver (modprobe ublk_drv); map with --as nbd or --as socket:PATH instead")
	}
	if err != nil {
		return nil, err
	}
	if !u.Recoverable() {
		l.WithField("ublk", u.Path()).Warn("this kernel has no ublk user recovery: the device will not survive a restart of the daemon")
	}
	return &ublkFE{d: d, u: u}, nil
}

// removeOrphanUblk deletes ublk device index if it is one of ours
// (cookie) that no process serves: nothing will take it back, and its IO
// would otherwise wait for ever. Its IO fails.
func (d *Daemon) removeOrphanUblk(index int, cookie uint64, l *log.Entry) {
	info, err := ublk.GetInfo(index)
	if err != nil || info.Cookie != cookie || info.State == ublk.StateLive {
		return
	}
	if err := ublk.Remove(index); err != nil {
		l.WithError(err).WithField("ublk", index).Warn("removing the orphaned ublk device")
		return
	}
	l.WithField("ublk", index).Warn("removed the orphaned ublk device: the IO it held failed")
}

// parseUblkIndex reads N of /dev/ublkbN (-1 if there is none).
func parseUblkIndex(path string) int { return parseDevIndex(path, "/dev/ublkb") }

// kernelHasUblk reports whether /dev/ublk-control exists.
func kernelHasUblk() bool {
	_, err := os.Stat(ublk.ControlPath)
	return err == nil
}
