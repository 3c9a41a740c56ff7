package clientd

import (
	"fmt"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// frontend is what a mapped device is offered through: an NBD unix socket
// (fe_socket.go), the kernel's /dev/nbdN (fe_nbd.go) or /dev/ublkbN
// (fe_ublk.go). A mapping is a session, an RNBD device, and one frontend.
type frontend interface {
	// ioMode is the device record's io_mode: nbd-socket, nbd-kernel or
	// ublk.
	ioMode() string
	// path is where the device is: the socket, or the kernel device.
	path() string
	// busy says why an unmap without --force is refused ("has 2 NBD
	// connection(s); close them"), or "" when nothing holds the device.
	busy() string
	// remove takes the device away for good (unmap). The RNBD device is
	// closed after it: no request of the frontend is left by then.
	remove()
	// detach lets go of the device when the daemon stops, leaving a
	// kernel device for the next daemon to take back (nbd's RECONFIGURE
	// within dead_conn_timeout, ublk's user recovery).
	detach()
	// resized shows the device's new size (rnbd.CltDev.Size) to those
	// who use it: a kernel device's capacity. An error says it could
	// not (the device keeps its size until mapped again).
	resized(bytes int64) error
}

// resized is the session's OnResize: the size the server reported, or
// `resize`, goes to the frontend of the device's mapping. The error says
// what could not apply it (also logged).
func (d *Daemon) resized(dev *rnbd.CltDev) error {
	return d.showSize(func(x *mapped) bool { return x.dev == dev }, dev)
}

// showSize gives the frontend of the mapping that is (a mirror grown by
// `resize`) dev's size now.
func (d *Daemon) showSize(is func(*mapped) bool, dev interface{ Size() int64 }) error {
	// In turn with map and unmap: the frontend found is the device's,
	// not one a later map got in its place.
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	d.mu.Lock()
	var m *mapped
	for _, x := range d.maps {
		if is(x) {
			m = x
		}
	}
	d.mu.Unlock()
	if m == nil {
		return nil // mapping or unmapping: it is attached, or gone, with the size it has then
	}
	l := d.log.WithFields(log.Fields{"device": m.Device, "size": dev.Size(), "io_mode": m.fe.ioMode(), "path": m.fe.path()})
	if err := m.fe.resized(dev.Size()); err != nil {
		l.WithError(err).Warn("the device keeps its size: could not apply the new one")
		return fmt.Errorf("%s keeps its size: %w", m.fe.path(), err)
	}
	l.Info("device resized")
	return nil
}

// attach offers dev through the frontend s names.
func (d *Daemon) attach(s mapSpec, dev ioDev) (frontend, error) {
	switch s.fe {
	case feUblk:
		return d.attachUblk(dev, backendID(s.Mapping), parseUblkIndex(s.Kernel))
	case feNBD:
		return d.attachNBD(dev, s)
	}
	return d.attachSocket(dev, s)
}

// nbdServed is a device the daemon's NBD server serves (named by its
// device_path, filed under its device name): what the socket and kernel
// nbd frontends share.
type nbdServed struct {
	d  *Daemon
	be *nbdBackend
	id string
}

// serveNBD adds dev to the daemon's NBD server under id (the mapping's
// device name, unique in the daemon), named name (its device_path, which
// mappings through other sessions may share).
func (d *Daemon) serveNBD(dev ioDev, id, name string) (nbdServed, error) {
	be, err := newNBDBackend(dev, d.cfg.NBDBuffers)
	if err != nil {
		return nbdServed{}, err
	}
	if err := d.nbd.AddExport(be.export(id, name)); err != nil {
		be.close()
		return nbdServed{}, err
	}
	return nbdServed{d: d, be: be, id: id}, nil
}

// withdraw removes the export: its connections close after their IO, then
// its memory goes.
func (n nbdServed) withdraw() {
	n.d.nbd.RemoveExport(n.id)
	n.be.close()
}

// blockReq is a frontend's block request as both frontends have it: what
// newIOReq makes an RNBD request of.
type blockReq struct {
	op           rnbd.Op
	off          int64
	n            int
	fua, noUnmap bool
	buf          ioBuf // reads and writes
	bufOff       int
}

// fill makes r the RNBD request for b (r's Done kept).
func (b blockReq) fill(r *rnbd.IOReq) {
	*r = rnbd.IOReq{Op: b.op, Done: r.Done}
	r.Flags, r.Off, r.Len = b.wire()
	if b.op == rnbd.OpRead || b.op == rnbd.OpWrite {
		r.Buf, _ = b.buf.(*rtrs.Buffer)
		r.BufOff = b.bufOff
	}
}

// wire is the request's flags and range as a device takes them: a flush
// carries no range, FUA and NO_UNMAP become flags (NO_UNMAP only for
// write-zeroes, where it means something).
func (b blockReq) wire() (flags uint32, off int64, n int) {
	off, n = b.off, b.n
	switch b.op {
	case rnbd.OpFlush:
		off, n = 0, 0
	case rnbd.OpWriteZeroes:
		if b.noUnmap {
			flags |= rnbd.FNoUnmap
		}
	}
	if b.fua {
		flags |= rnbd.FFUA
	}
	return flags, off, n
}
