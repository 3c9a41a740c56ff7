// Health: what happened to a file behind the server's back, checked on
// the backend's descriptor or on one of its own (HealthCheck).

package blockdev

import (
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// Health reports what happened to a file backend behind the server's
// back: deleted (IO then goes to an unlinked inode nobody else sees),
// replaced (its path now names another file), or shrunk below the size
// clients were told (a *ShrinkError: reads past the file's end fail with
// EIO, and writes there too once PollSize has seen it). nil if none; a
// block device is always healthy here. It waits as long as the file's
// file system takes to answer: see NewHealthCheck.
func (b *Backend) Health() error {
	h, err := b.NewHealthCheck()
	if err != nil {
		return err
	}
	return h.Run()
}

// HealthCheck is Health on a descriptor of its own: once made, it needs
// the backend no more, so it can be left waiting on a mount that does not
// answer while the backend is closed. It is for one Run, by one
// goroutine: Run closes its descriptor.
type HealthCheck struct {
	f    *os.File // nil: nothing to check (a block device)
	path string
	size int64 // served
	lbs  int64
}

// NewHealthCheck prepares a Health check; the backend must stay open
// until it returns, not while the check runs.
func (b *Backend) NewHealthCheck() (*HealthCheck, error) {
	h := &HealthCheck{path: b.path, size: b.size.Load(), lbs: int64(b.lbs)}
	if b.kind != KindFile {
		return h, nil
	}
	fd, err := unix.FcntlInt(b.f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	runtime.KeepAlive(b.f)
	if err != nil {
		return nil, fmt.Errorf("blockdev: %s: %w", b.path, err)
	}
	h.f = os.NewFile(uintptr(fd), b.path)
	return h, nil
}

// Run does the check once and releases the descriptor.
func (h *HealthCheck) Run() error {
	if h.f == nil {
		return nil
	}
	defer h.f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(h.f.Fd()), &st); err != nil {
		return fmt.Errorf("blockdev: %s: %w", h.path, err)
	}
	if st.Nlink == 0 {
		return fmt.Errorf("blockdev: %s was deleted: IO goes to a file nobody else sees", h.path)
	}
	var pst unix.Stat_t
	if err := unix.Stat(h.path, &pst); err == nil && (pst.Dev != st.Dev || pst.Ino != st.Ino) {
		return fmt.Errorf("blockdev: %s was replaced by another file: IO goes to the old one", h.path)
	}
	if st.Size < h.size {
		return &ShrinkError{Path: h.path, Served: h.size, Size: st.Size &^ (h.lbs - 1)}
	}
	return nil
}
