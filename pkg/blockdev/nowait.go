package blockdev

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/internal/rawio"
)

// Non-blocking IO. A server that receives requests on a connection wants
// to run an IO right there when it cannot block — the data is in memory —
// and hand it to a worker otherwise: a hand-off to another goroutine costs
// more than a page-cache copy. TryReadAt and TryWriteAt do the IO only
// when that holds, and say so.
//
// What cannot block:
//   - everything on a memory filesystem (tmpfs, ramfs, hugetlbfs): IO
//     there is a memory copy;
//   - reads of a RAM block device (brd, zram);
//   - on other filesystems, buffered reads the page cache can serve, as
//     preadv2(RWF_NOWAIT) finds out (EAGAIN when it would have to wait).
//
// Writes elsewhere, and any O_DIRECT IO, always go to a worker: RWF_NOWAIT
// on an O_DIRECT read still waits for the device, and buffered writes may
// wait for writeback throttling — a RAM block device's too, whose writes
// go through its page cache and its dirty page limits.
//
// What cannot block is also made as a raw system call (pkg/internal/rawio):
// the runtime then does not treat the connection's goroutine as blocked
// in the kernel and hand its P to another thread.

// Filesystem magic numbers (statfs f_type) of memory filesystems.
const (
	tmpfsMagic     = 0x01021994
	ramfsMagic     = 0x858458f6
	hugetlbfsMagic = 0x958458f6
	ramdiskMajor   = 1 // brd: /dev/ramN
)

type nowaitState struct {
	// mem: the backend lives in memory; every read is a copy.
	mem bool
	// memWrites: every write is a copy too (a memory file system, not a
	// RAM disk's page cache, whose dirty pages are throttled).
	memWrites bool
	// reads: try RWF_NOWAIT reads (cleared on the first EOPNOTSUPP).
	reads atomic.Bool
	fd    int
}

// probeNowait finds out which IO of the backend cannot block.
func (b *Backend) probeNowait(direct bool) {
	b.nw.fd = int(b.f.Fd())
	if direct {
		return
	}
	switch b.kind {
	case KindFile:
		switch b.fs {
		case tmpfsMagic, ramfsMagic, hugetlbfsMagic:
			b.nw.mem, b.nw.memWrites = true, true
		}
		b.mp.tmpfs = b.fs == tmpfsMagic
	case KindBlockDevice:
		b.nw.mem = unix.Major(b.dev) == ramdiskMajor || isZram(b.dev)
	}
	b.nw.reads.Store(!b.nw.mem)
}

func isZram(dev uint64) bool {
	s, err := os.ReadFile(fmt.Sprintf("/sys/dev/block/%d:%d/uevent", unix.Major(dev), unix.Minor(dev)))
	return err == nil && strings.Contains(string(s), "DEVNAME=zram")
}

// InMemory reports whether all IO of the backend is a memory copy.
func (b *Backend) InMemory() bool { return b.nw.mem }

// TryReadAt reads exactly len(p) bytes at off if that cannot block, and
// reports whether it did; if not, p may hold part of the data and the
// caller does the read with ReadAt where blocking is fine.
func (b *Backend) TryReadAt(p []byte, off int64) (bool, error) {
	if !b.nw.mem && !b.nw.reads.Load() {
		return false, nil
	}
	if err := b.check(off, int64(len(p)), false); err != nil {
		return true, err
	}
	if b.nw.mem {
		if b.readMapped(p, off) {
			return true, nil
		}
		if n, err := rawio.Pread(b.nw.fd, p, off); err == nil && n == len(p) {
			return true, nil
		}
		return true, b.ReadAt(p, off) // short or failed: say why
	}
	n, err := rawio.PreadNowait(b.nw.fd, p, off)
	switch {
	case err == nil && n == len(p):
		return true, nil
	case errors.Is(err, unix.EOPNOTSUPP):
		b.nw.reads.Store(false)
	}
	// Would block, partly cached, or failed: ReadAt does it properly
	// and reports the error, if there still is one.
	return false, nil
}

// TryWriteAt writes all of p at off if that cannot block (a file on a
// memory file system), and reports whether it did. It never makes a FUA
// write.
func (b *Backend) TryWriteAt(p []byte, off int64) (bool, error) {
	if !b.nw.memWrites {
		return false, nil
	}
	if b.wt {
		return true, b.WriteAt(p, off, false) // through the O_DSYNC descriptor
	}
	g := b.beginWrite()
	defer b.endWrite(g)
	if err := b.check(off, int64(len(p)), true); err != nil {
		return true, err
	}
	if b.writeMapped(p, off) {
		return true, nil
	}
	if n, err := rawio.Pwrite(b.nw.fd, p, off); err == nil && n == len(p) {
		b.allocated(off, int64(len(p)))
		return true, nil
	}
	return true, b.WriteAt(p, off, false)
}
