package clientd

import (
	"fmt"
	"net"
	"os"
	"path/filepath"

	"github.com/rnbd/rnbd/internal/ctl"
)

// socketFE serves a device on an NBD unix socket (--as socket:PATH, or
// socket_dir/rnbdN.sock).
type socketFE struct {
	nbdServed
	l    net.Listener
	sock string
}

func (d *Daemon) attachSocket(dev ioDev, s mapSpec) (frontend, error) {
	n, err := d.serveNBD(dev, s.Device, s.exportName())
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(s.sock), 0o755); err != nil {
		n.withdraw()
		return nil, err
	}
	if err := ctl.ClearStaleSocket(s.sock); err != nil {
		n.withdraw()
		return nil, err
	}
	l, err := net.Listen("unix", s.sock)
	if err != nil {
		n.withdraw()
		return nil, err
	}
	if err := os.Chmod(s.sock, 0o600); err != nil {
		l.Close()
		n.withdraw()
		return nil, err
	}
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		// Only this device: a client of its socket lists and opens no
		// other, whoever the socket is made accessible to.
		if err := d.nbd.ServeExport(l, n.id); err != nil {
			d.log.WithError(err).WithField("socket", s.sock).Error("the device's NBD socket accepts no more connections")
		}
	}()
	return &socketFE{nbdServed: n, l: l, sock: s.sock}, nil
}

func (f *socketFE) ioMode() string { return "nbd-socket" }

// resized: NBD clients that connect from now on are told the new size;
// NBD cannot tell one already connected, which keeps the size it was
// told (IO past the device's end fails).
func (f *socketFE) resized(int64) error { return nil }
func (f *socketFE) path() string        { return f.sock }

func (f *socketFE) busy() string {
	if n := f.d.nbd.Conns(f.id); n > 0 {
		return fmt.Sprintf("has %d NBD connection(s); close them", n)
	}
	return ""
}

func (f *socketFE) close() {
	f.l.Close()
	os.Remove(f.sock)
}

func (f *socketFE) remove() {
	f.close()
	f.withdraw()
}

// detach: the daemon's NBD server is closed already, with the
// connections.
func (f *socketFE) detach() {
	f.close()
	f.be.close()
}
