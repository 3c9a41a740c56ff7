package blockdev

import (
	"runtime/debug"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// IO through a mapping of the file. On a memory backend a read or a write
// is a copy whichever way it is made; made as a system call it also costs
// the call, the file table and a page-cache lookup (xas_load), and a
// write the inode's lock, about 1 µs per 4 KiB on the machine of
// docs/benchmarks.md against a copy from or into a mapping of the same
// file. So the inline IO of a memory backend (TryReadAt, TryWriteAt)
// copies from and into a shared mapping of it where that is the same IO:
//
//   - a file on tmpfs: reads and writes. Reads only while the file has
//     no holes: a read of a hole through read(2) allocates nothing, one
//     through a shared mapping allocates a page for it. A file with holes
//     at open, after a Refresh, or once a discard or write-zeroes may
//     have punched one, is read through system calls from then on;
//   - a RAM disk (brd, zram): reads, through the device's page cache as
//     pread's; its writes go to workers (nowait.go) and stay there.
//
// Anything else — a fault of the mapping (the file was cut under a read,
// its file system is full), a range past what is mapped — is made as a
// system call after all, which reports what went wrong as before. A grow
// (Refresh) maps the file again; the older mappings stay until Close, as
// IO may still be copying through them.
type mapState struct {
	tmpfs    bool // a file on tmpfs (probeNowait)
	writable bool // writes go through the mapping
	// reads: reads go through the mapping.
	reads atomic.Bool
	cur   atomic.Pointer[[]byte]
	mu    sync.Mutex // orders remap and unmap; under it:
	old   [][]byte
	done  bool // unmapped for good (Close)
}

// mapInit maps the backend if its IO can go through a mapping.
func (b *Backend) mapInit(direct bool) {
	switch {
	case direct || !b.nw.mem:
		return
	case b.kind == KindFile && b.mp.tmpfs:
		b.mp.writable = !b.ro && !b.wt
		var st unix.Stat_t
		b.mp.reads.Store(unix.Fstat(b.nw.fd, &st) == nil && dense(&st))
	case b.kind == KindBlockDevice:
		b.mp.reads.Store(true)
	default:
		return
	}
	b.remap(b.size.Load())
}

// dense reports whether a file has every block of its size allocated.
func dense(st *unix.Stat_t) bool { return st.Blocks*512 >= st.Size }

// remap maps size bytes of the backend if the current mapping is
// shorter; if that fails, IO past the old mapping is made by system
// calls.
func (b *Backend) remap(size int64) {
	if !b.mp.writable && !b.mp.reads.Load() && b.mp.cur.Load() == nil {
		return // never mapped: nothing would use it
	}
	b.mp.mu.Lock()
	defer b.mp.mu.Unlock()
	cur := b.mp.cur.Load()
	if size <= 0 || int64(int(size)) != size || (cur != nil && int64(len(*cur)) >= size) {
		return
	}
	if b.mp.done {
		return // closed
	}
	prot := unix.PROT_READ
	if b.mp.writable {
		prot |= unix.PROT_WRITE
	}
	m, err := unix.Mmap(b.nw.fd, 0, int(size), prot, unix.MAP_SHARED)
	if err != nil {
		return
	}
	if cur != nil {
		b.mp.old = append(b.mp.old, *cur)
	}
	b.mp.cur.Store(&m)
}

// unmap ends every mapping; no IO may be under way.
func (b *Backend) unmap() {
	b.mp.mu.Lock()
	defer b.mp.mu.Unlock()
	if cur := b.mp.cur.Swap(nil); cur != nil {
		b.mp.old = append(b.mp.old, *cur)
	}
	for _, m := range b.mp.old {
		unix.Munmap(m)
	}
	b.mp.old, b.mp.done = nil, true
}

// mapped is the mapping's part for n bytes at off, or nil if it has none.
func (b *Backend) mapped(off int64, n int) []byte {
	cur := b.mp.cur.Load()
	if cur == nil || off < 0 || off > int64(len(*cur))-int64(n) {
		return nil
	}
	return (*cur)[off : off+int64(n)]
}

// readMapped copies len(p) bytes at off from the mapping; false: not
// made (or made in part), the caller reads by a system call.
func (b *Backend) readMapped(p []byte, off int64) bool {
	if !b.mp.reads.Load() {
		return false
	}
	m := b.mapped(off, len(p))
	return m != nil && copyFaulting(p, m)
}

// writeMapped copies p into the mapping at off; false as readMapped.
func (b *Backend) writeMapped(p []byte, off int64) bool {
	if !b.mp.writable {
		return false
	}
	m := b.mapped(off, len(p))
	return m != nil && copyFaulting(m, p)
}

// holesMayCome: a hole may be punched in the file (a discard, a
// write-zeroes): reads go through system calls from then on.
func (b *Backend) holesMayCome() {
	if b.mp.reads.Load() && b.kind == KindFile {
		b.mp.reads.Store(false)
	}
}

// copyFaulting copies src to dst, one of them in a mapping, and reports
// false if the mapping faulted (SIGBUS: past the file's end, or no space
// for a page) instead of taking the daemon down.
func copyFaulting(dst, src []byte) (ok bool) {
	was := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(was)
		if recover() != nil {
			ok = false
		}
	}()
	copy(dst, src)
	return true
}
