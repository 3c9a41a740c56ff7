package clientd

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/frontend/nbd"
	"github.com/rnbd/rnbd/pkg/frontend/nbd/nbdnl"
)

// kernelDeadConnTimeout is how long the kernel keeps a device's IO queued
// after its sockets died (the daemon stopped or crashed), waiting for the
// restarted daemon to RECONFIGURE it with new ones.
const kernelDeadConnTimeout = 120 * time.Second

// nbdFE serves a device as the kernel's /dev/nbdN: the daemon's NBD
// server on one socketpair per CPU (the driver's hardware queues).
type nbdFE struct {
	nbdServed
	index uint32
	// backend is the device's backend identifier, which every
	// RECONFIGURE of it must repeat.
	backend string
	ours    []net.Conn
}

func (d *Daemon) attachNBD(dev ioDev, s mapSpec) (frontend, error) {
	n, err := d.serveNBD(dev, s.Device, s.exportName())
	if err != nil {
		return nil, err
	}
	f, err := d.attachKernel(n.be.export(s.Device, s.exportName()), backendID(s.Mapping), parseKernelIndex(s.Kernel))
	if err != nil {
		n.withdraw()
		return nil, err
	}
	f.nbdServed = n
	return f, nil
}

func (f *nbdFE) ioMode() string { return "nbd-kernel" }

// resized sets /dev/nbdN's capacity (netlink RECONFIGURE with the size).
func (f *nbdFE) resized(bytes int64) error {
	nl, err := nbdnl.Dial()
	if err != nil {
		return err
	}
	defer nl.Close()
	return nbdResize(nl, f.index, f.backend, bytes)
}

// nbdResize sets the size of /dev/nbdINDEX, unless it has it, and checks
// that it took: a kernel may refuse a size in RECONFIGURE or ignore it
// (before 5.3), and every kernel refuses the resize ioctl on a device set
// up by netlink.
func nbdResize(nl *nbdnl.Conn, index uint32, backend string, bytes int64) error {
	size := func() (int64, error) {
		b, err := os.ReadFile(fmt.Sprintf("/sys/block/nbd%d/size", index))
		if err != nil {
			return 0, err
		}
		n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		return n * 512, err
	}
	if got, err := size(); err != nil || got == bytes {
		return err
	}
	if err := nl.Resize(index, backend, uint64(bytes)); err != nil {
		return fmt.Errorf("this kernel's nbd driver cannot resize the device (RECONFIGURE with the size: %w)", err)
	}
	got, err := size()
	if err == nil && got != bytes {
		err = fmt.Errorf("this kernel's nbd driver cannot resize the device (RECONFIGURE ignored the size; it has %d bytes): %w", got, syscall.EOPNOTSUPP)
	}
	return err
}

// path is the block device: /dev/nbdN.
func (f *nbdFE) path() string { return fmt.Sprintf("/dev/nbd%d", f.index) }

func (f *nbdFE) busy() string {
	return inUse(f.path())
}

// remove disconnects the kernel device, then withdraws the export.
func (f *nbdFE) remove() {
	if nl, err := nbdnl.Dial(); err == nil {
		if err := nl.Disconnect(f.index); err != nil {
			f.d.log.WithError(err).WithField("nbd", f.index).Warn("kernel nbd disconnect")
		}
		nl.Close()
	}
	f.closeOurs()
	f.withdraw()
}

// detach closes our sockets only: the kernel keeps the device and its
// queued IO for kernelDeadConnTimeout, and the restarted daemon takes it
// back.
func (f *nbdFE) detach() {
	f.closeOurs()
	f.be.close()
}

func (f *nbdFE) closeOurs() {
	for _, c := range f.ours {
		c.Close()
	}
}

// attachKernel connects a kernel nbd device to export e. With index >= 0
// it first tries to take that device back (a restart: RECONFIGURE of its
// dead sockets), else the kernel picks a free one.
func (d *Daemon) attachKernel(e *nbd.Export, backendID string, index int) (*nbdFE, error) {
	nl, err := nbdnl.Dial()
	if errors.Is(err, nbdnl.ErrNoFamily) {
		return nil, ctl.Errorf(ctl.CodeNotSupported, "this kernel has no nbd driver (modprobe nbd); map with --as socket:PATH instead")
	}
	if err != nil {
		return nil, err
	}
	defer nl.Close()
	n := runtime.NumCPU()
	ours := make([]net.Conn, 0, n)
	theirs := make([]*os.File, 0, n)
	defer func() {
		for _, f := range theirs {
			f.Close() // the kernel holds its own references
		}
	}()
	closeOurs := func() {
		for _, c := range ours {
			c.Close()
		}
	}
	for i := 0; i < n; i++ {
		fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
		if err != nil {
			closeOurs()
			return nil, fmt.Errorf("socketpair: %w", err)
		}
		f := os.NewFile(uintptr(fds[0]), "nbd-ours")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			syscall.Close(fds[1])
			closeOurs()
			return nil, err
		}
		ours = append(ours, c)
		theirs = append(theirs, os.NewFile(uintptr(fds[1]), "nbd-kernel"))
	}
	cfg := nbdnl.Config{
		Index:     -1,
		SizeBytes: uint64(e.Size),
		BlockSize: uint64(min(max(e.MinBlock, 512), 4096)),
		// Longer than a request can wait in RNBD (see nbdIOTimeout).
		Timeout:         d.cfg.nbdIOTimeout(),
		DeadConnTimeout: kernelDeadConnTimeout,
		ServerFlags:     uint64(e.TransmissionFlags()),
		BackendID:       backendID,
	}
	// Serve our ends first: the kernel may send IO (partition scan) as
	// soon as CONNECT returns.
	for _, c := range ours {
		d.wg.Add(1)
		go func(c net.Conn) {
			defer d.wg.Done()
			if err := d.nbd.ServeKernel(c, e.ID); err != nil {
				d.log.WithError(err).Warn("kernel nbd socket")
			}
		}(c)
	}
	k := &nbdFE{ours: ours, backend: backendID}
	if index >= 0 {
		err := nl.Reconfigure(uint32(index), cfg, theirs)
		if err == nil {
			k.index = uint32(index)
			d.setQueueLimits(k)
			// The size too, in case the server resized the device
			// meanwhile (the kernel does nothing if it is the same).
			if err := nbdResize(nl, k.index, k.backend, int64(cfg.SizeBytes)); err != nil {
				d.log.WithError(err).WithField("nbd", index).Warn("the device keeps its size: could not apply the new one")
			}
			return k, nil
		}
		// Past dead_conn_timeout, or the device went to someone else.
		d.log.WithError(err).WithField("nbd", index).Warn("could not take the device back; attaching a new one")
	}
	idx, err := nl.Connect(cfg, theirs)
	if err != nil {
		closeOurs()
		return nil, err
	}
	k.index = idx
	d.setQueueLimits(k)
	return k, nil
}

// setQueueLimits lets the block layer send requests as large as one
// buffer of the device's NBD pool (slotSize, 1 MiB), within what the
// driver allows: fewer, larger NBD requests, each split into RTRS
// messages by the RNBD device, instead of the block layer's split at its
// default max_sectors_kb. Best effort: the device works without it.
//
// A device that has the value already (one taken back by RECONFIGURE
// keeps its queue) is not written: the kernel freezes the queue for
// every write of its attributes, waiting for the requests in flight, and
// after a crash of the daemon those include the ones stranded on its
// dead sockets, which wait out the request timeout (nbdIOTimeout) before
// the kernel sends them again — the restart would wait that long in the
// kernel, its mappings with it.
func (d *Daemon) setQueueLimits(k *nbdFE) {
	q := filepath.Join(d.sysBlock, fmt.Sprintf("nbd%d", k.index), "queue") + "/"
	want := slotSize >> 10
	if b, err := os.ReadFile(q + "max_hw_sectors_kb"); err == nil {
		if hw, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && hw > 0 {
			want = min(want, hw)
		}
	}
	if b, err := os.ReadFile(q + "max_sectors_kb"); err == nil && strings.TrimSpace(string(b)) == strconv.Itoa(want) {
		return
	}
	if err := os.WriteFile(q+"max_sectors_kb", []byte(strconv.Itoa(want)), 0); err != nil {
		d.log.WithError(err).WithField("nbd", k.index).Warn("setting max_sectors_kb")
	}
}

// inUse says why the block device at path must not be taken away, or
// "": someone holds it exclusively (a mounted filesystem, LVM, md: an
// exclusive open then fails with EBUSY), or it cannot be checked.
func inUse(path string) string {
	fd, err := syscall.Open(path, syscall.O_RDONLY|syscall.O_EXCL|syscall.O_CLOEXEC, 0)
	switch {
	case err == nil:
		syscall.Close(fd)
		return ""
	case errors.Is(err, syscall.EBUSY):
		return "(" + path + ") is in use (mounted?); unmount it"
	case errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ENXIO):
		return "" // the kernel device is gone already
	}
	// EPERM, EACCES (a device allow list without it): unknown is not free.
	return fmt.Sprintf("(%s) cannot be checked for users (%v); unmap --force if nothing uses it", path, err)
}

// parseKernelIndex reads N of /dev/nbdN (-1 if there is none).
func parseKernelIndex(path string) int { return parseDevIndex(path, "/dev/nbd") }

// parseDevIndex reads N of prefix+N (-1 if path is not that).
func parseDevIndex(path, prefix string) int {
	s, ok := strings.CutPrefix(path, prefix)
	if !ok {
		return -1
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		return -1
	}
	return n
}

// kernelHasNBD reports whether this kernel can attach /dev/nbdN: the nbd
// module is loaded (the machine's modules-load.d loads it at boot).
func kernelHasNBD() bool {
	_, err := os.Stat("/sys/module/nbd")
	return err == nil
}
