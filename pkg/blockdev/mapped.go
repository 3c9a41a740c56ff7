// IO through a shared mapping of the file or device, and what it needs:
// the process's table of mappings, the bits of the pages known to be
// there, population of the page tables, remaps at a grow, views lent to
// senders (ReadView) and the mtime of writes made through the mapping.
// It is one concern, long as it is: every part serves the mapping.

package blockdev

import (
	"fmt"
	"math"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

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
//   - a file on tmpfs: reads and writes. Reads only of pages known to be
//     there: a read of a hole through read(2) allocates nothing, one
//     through a shared mapping allocates a page for it. The file's pages
//     are found at open and at every grow (SEEK_DATA, SEEK_HOLE), a
//     write through the backend adds its pages, a discard or
//     write-zeroes takes out those it may punch before it does, a shrink
//     those it cut; the rest is read through system calls.
//     (A hole punched behind the server's back is not seen: a read of it
//     through the mapping allocates its page, the data still zeros.)
//   - a RAM disk (brd, zram): reads, through the device's page cache as
//     pread's; its writes go to workers (nowait.go) and stay there.
//
// Anything else — a fault of the mapping (the file was cut under a read,
// its file system is full), a range past what is mapped — is made as a
// system call after all, which reports what went wrong as before. (Not
// quite for a file cut behind the server's back to a size that is not a
// whole page, until a size poll or the health check sees it (PollSize)
// and IO past the file's end is refused: IO to the rest of its last page
// is made in the page, where the system call would have grown the file
// or failed a read.) Writes through the mapping stamp the file's mtime a
// little late (mtimeStamp). Files past maxMapped, and any in a 32-bit
// process, are not mapped.
//
// A new mapping of a tmpfs file gets the page tables of the file's pages
// built in the background (populate): otherwise the first write to each
// page after an open or a grow takes a page fault, a fifth of the
// server's CPU at 4 KiB random writes until every page has had one (see
// docs/benchmarks.md).
//
// A grow (Refresh) maps the file again; the older mappings stay until the
// last Close, as IO may still be copying through them, and past it until
// the last view lent to a sender is released (ReadView). Every open of
// one file (or device) in the daemon shares its mappings — one
// read-only, one writable — and what is known of its pages, so that
// their page tables are paid once, not per session that has the file
// open, and a discard through one open is seen by all.
type mapState struct {
	tmpfs    bool                    // a file on tmpfs (probeNowait)
	writable bool                    // writes go through the mapping
	m        atomic.Pointer[fileMap] // nil: not mapped
	stamp    mtimeStamp
}

// mtimeStamp moves the mtime of a file written through its mapping. A
// write moves it only when it faults its page in, and on tmpfs a page
// read first, or populated, is mapped writable already: so the backend
// moves the mtime itself, at most mtimeLag after a write, at a Flush
// and at Close. Backups and anything else that goes by mtime then see
// the file change, as with pwrite.
type mtimeStamp struct {
	pending atomic.Bool // a write not yet stamped
	timer   *time.Timer // stamps; armed by the write that sets pending
	mu      sync.Mutex  // orders the stamps with Close; under it:
	// +checklocks:mu
	closed bool
}

// mtimeLag is how late the mtime of a file written through its mapping
// may be.
const mtimeLag = time.Second

// fileMap is the mapping of one file, shared by its backends.
type fileMap struct {
	key  fileKey
	refs int // under maps.mu
	// present is a bit per page of the file known to be allocated,
	// for a file (nil: a device, all of it).
	present atomic.Pointer[pageBits]
	view    [2]atomic.Pointer[[]byte] // read-only, writable
	mu      sync.Mutex                // orders remaps, punches, populate's steps; under it:
	// +checklocks:mu
	old  [][]byte
	done bool           // closed by its last backend
	pop  sync.WaitGroup // populate goroutines
	// holds is 1 while a backend has the file open, plus one per
	// ReadView not yet released; the last release unmaps.
	holds atomic.Int64
}

// fileKey identifies a file: st_dev and st_ino, and its file handle
// (name_to_handle_at), which holds the inode's generation — tmpfs
// numbers its inodes in 32 bits and reuses the numbers after a wrap.
type fileKey struct {
	dev, ino uint64
	handle   string
}

// maxMapped is the largest file mapped (the mapping takes address space
// for all of it).
const maxMapped = 1 << 40

// maps are the files mapped in the process.
var maps struct {
	mu sync.Mutex
	// +checklocks:mu
	m map[fileKey]*fileMap
}

// mapInit maps the backend if its IO can go through a mapping.
func (b *Backend) mapInit(direct bool) {
	k := fileKey{dev: b.dev, ino: b.ino}
	switch {
	case direct || !b.nw.mem || unsafe.Sizeof(uintptr(0)) < 8 || b.size.Load() > maxMapped:
		return
	case b.kind == KindFile && b.mp.tmpfs:
		h, _, err := unix.NameToHandleAt(b.nw.fd, "", unix.AT_EMPTY_PATH)
		if err != nil {
			return
		}
		k.handle = fmt.Sprintf("%d:%x", h.Type(), h.Bytes())
		b.mp.writable = !b.ro && !b.wt
		if b.mp.writable {
			b.mp.stamp.timer = time.AfterFunc(time.Hour, func() { b.stampMtime(false) })
			b.mp.stamp.timer.Stop()
		}
	case b.kind != KindBlockDevice:
		return
	}
	maps.mu.Lock()
	m := maps.m[k]
	if m == nil {
		// The file's pages are walked without the lock: another open
		// of it may register it meanwhile, and is then the one used.
		maps.mu.Unlock()
		n := &fileMap{key: k}
		n.holds.Store(1)
		if b.kind == KindFile {
			n.present.Store(findPages(b.nw.fd, b.size.Load()))
		}
		maps.mu.Lock()
		if m = maps.m[k]; m == nil {
			if maps.m == nil {
				maps.m = make(map[fileKey]*fileMap)
			}
			m = n
			maps.m[k] = m
		}
	}
	m.refs++
	maps.mu.Unlock()
	b.mp.m.Store(m)
	b.remap(b.size.Load())
}

// pageBits has a bit per page of a file.
type pageBits []atomic.Uint64

// pageShift: tmpfs allocates pages of 4 KiB (or huge pages, of whole
// ones).
const pageShift = 12

func newPageBits(size int64) *pageBits {
	bits := make(pageBits, (size>>pageShift+1+63)/64)
	return &bits
}

// maxExtents bounds the walk of a file's pages at open; the pages past
// it are read through system calls until written.
const maxExtents = 1 << 16

// findPages walks the data of the file fd (SEEK_DATA, SEEK_HOLE) for
// its pages.
func findPages(fd int, size int64) *pageBits {
	bits := newPageBits(size)
	for off, n := int64(0), 0; off < size && n < maxExtents; n++ {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if err != nil || data >= size {
			break // ENXIO: no data past off
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil || hole <= data {
			break
		}
		bits.set(data, min(hole, size)-data)
		off = hole
	}
	return bits
}

// words yields, for the pages first to last (those in p), each word of
// p that holds some of them and the mask of theirs.
func (p *pageBits) words(first, last int64) func(yield func(*atomic.Uint64, uint64) bool) {
	return func(yield func(*atomic.Uint64, uint64) bool) {
		last = min(last, int64(len(*p))*64-1)
		for first <= last {
			end := min(last, first|63)
			mask := ^uint64(0) >> uint(63-(end-first)) << uint(first&63)
			if !yield(&(*p)[first>>6], mask) {
				return
			}
			first = end + 1
		}
	}
}

// set marks the pages of n bytes at off allocated: every page they
// touch, as a write of part of a page allocates all of it. (pageShift is
// a lower bound of the page: with larger pages a write allocates more
// than it marks, which only sends more reads to system calls.)
func (p *pageBits) set(off, n int64) {
	if n <= 0 || off < 0 {
		return
	}
	for w, mask := range p.words(off>>pageShift, (off+n-1)>>pageShift) {
		if w.Load()&mask != mask { // no locked write when known
			w.Or(mask)
		}
	}
}

// clear marks the pages that a hole punched in n bytes at off may free
// (those it covers whole) not known to be allocated.
func (p *pageBits) clear(off, n int64) {
	if n <= 0 || off < 0 {
		return
	}
	first, end := (off+1<<pageShift-1)>>pageShift, (off+n)>>pageShift
	if off+n < off {
		end = math.MaxInt64 >> pageShift
	}
	for w, mask := range p.words(first, end-1) {
		w.And(^mask)
	}
}

// all reports whether every page of n bytes at off is known allocated.
func (p *pageBits) all(off, n int64) bool {
	if n <= 0 || off < 0 {
		return n == 0
	}
	first, last := off>>pageShift, (off+n-1)>>pageShift
	if last >= int64(len(*p))*64 {
		return false
	}
	for w, mask := range p.words(first, last) {
		if w.Load()&mask != mask {
			return false
		}
	}
	return true
}

// runs yields the runs of pages of the bytes from off to end known
// allocated, each as its first byte and length, clipped to off and end.
func (p *pageBits) runs(off, end int64) func(yield func(int64, int64) bool) {
	return func(yield func(int64, int64) bool) {
		if off < 0 || end <= off {
			return
		}
		last := min((end-1)>>pageShift, int64(len(*p))*64-1)
		start := int64(-1)
		for pg := off >> pageShift; pg <= last+1; pg++ {
			set := pg <= last && (*p)[pg>>6].Load()&(1<<uint(pg&63)) != 0
			switch {
			case set && start < 0:
				start = pg
			case !set && start >= 0:
				a, b := max(start<<pageShift, off), min(pg<<pageShift, end)
				if !yield(a, b-a) {
					return
				}
				start = -1
			}
		}
	}
}

// grown is p for a file of size bytes (p itself if large enough). A bit
// set in p while it is copied may be lost: that page is then read
// through system calls until written again.
func (p *pageBits) grown(size int64) *pageBits {
	q := newPageBits(size)
	if len(*q) <= len(*p) {
		return p
	}
	for i := range *p {
		(*q)[i].Store((*p)[i].Load())
	}
	return q
}

// viewOf is the index of the backend's mapping in fileMap.view.
func (b *Backend) viewOf() int {
	if b.mp.writable {
		return 1
	}
	return 0
}

// remap maps size bytes of the backend's file if its mapping is
// shorter; if that fails, IO past the old mapping is made by system
// calls.
func (b *Backend) remap(size int64) {
	m := b.mp.m.Load()
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	v := &m.view[b.viewOf()]
	cur := v.Load()
	if m.done || size <= 0 || size > maxMapped || size > math.MaxInt || (cur != nil && int64(len(*cur)) >= size) {
		return
	}
	prot := unix.PROT_READ
	if b.mp.writable {
		prot |= unix.PROT_WRITE
	}
	// Through the descriptor's own reference: a Close meanwhile cannot
	// free its number for another file to take before the mmap.
	rc, err := b.f.SyscallConn()
	if err != nil {
		return
	}
	var mm []byte
	if rc.Control(func(fd uintptr) {
		mm, err = unix.Mmap(int(fd), 0, int(size), prot, unix.MAP_SHARED)
	}) != nil || err != nil {
		return
	}
	// A core dump of the daemon need not hold the export.
	unix.Madvise(mm, unix.MADV_DONTDUMP)
	if p := m.present.Load(); p != nil {
		m.present.Store(p.grown(size))
	}
	if cur != nil {
		m.old = append(m.old, *cur)
	}
	v.Store(&mm)
	if m.present.Load() != nil {
		m.pop.Add(1)
		go m.populate(b.viewOf(), mm)
	}
}

// populateStep is how much of a mapping populate makes at a time, under
// m.mu: a discard waits for at most one step.
const populateStep = 2 << 20

// populating lets one populate step run at a time in the process: a
// daemon that opens many exports at once builds their page tables on
// one CPU, not on all of them. Taken before the file's m.mu.
var populating sync.Mutex

// populate builds the page tables of view, the mapping m.view[idx],
// for the pages of the file known to be there and in memory (a page
// swapped out is left to IO to bring in), a step at a time, until
// it is done, view is no longer the current mapping (a grow's populate
// takes over), the file is unmapped, or the kernel refuses (before
// Linux 5.14, or a file cut behind the server's back). Read faults
// only: they allocate nothing, move no mtime, and on tmpfs a shared
// writable mapping maps a page writable on a read fault as well (it
// tracks no dirty pages), so writes then fault no more than reads. A
// hole is never touched, as a fault would allocate it: the step holds
// m.mu, under which mayPunch clears what it may punch, so no page is
// faulted back after a punch.
func (m *fileMap) populate(idx int, view []byte) {
	defer m.pop.Done()
	for off := int64(0); off < int64(len(view)); off += populateStep {
		end := min(off+populateStep, int64(len(view)))
		populating.Lock() // first: a discard waits for this file's step only
		vec := resident[:]
		m.mu.Lock()
		cur := m.view[idx].Load()
		if m.done || cur == nil || unsafe.SliceData(*cur) != unsafe.SliceData(view) {
			m.mu.Unlock()
			populating.Unlock()
			return
		}
		err := populateStep1(view, off, end, m.present.Load(), vec)
		m.mu.Unlock()
		populating.Unlock()
		if err != nil {
			return
		}
	}
}

var (
	// resident is populate's mincore vector, a byte per page of a step.
	// +checklocks:populating
	resident [populateStep >> pageShift]byte
)

// populateStep1 populates the pages of view from off (a step's start)
// to end that are allocated (bits) and in memory: a tmpfs page swapped
// out stays out until IO wants it.
func populateStep1(view []byte, off, end int64, bits *pageBits, vec []byte) error {
	if err := mincore(uintptr(unsafe.Pointer(&view[off])), uintptr(end-off), vec); err != nil {
		return err
	}
	for a, n := range residentRuns(off, end, bits, vec) {
		if err := unix.Madvise(view[a:a+n], unix.MADV_POPULATE_READ); err != nil {
			return err
		}
	}
	return nil
}

// residentRuns yields the runs of bytes from off (page-aligned) to end
// whose pages are known allocated (bits) and in memory (vec: mincore's
// vector from off), each as its first byte and length.
func residentRuns(off, end int64, bits *pageBits, vec []byte) func(yield func(int64, int64) bool) {
	return func(yield func(int64, int64) bool) {
		in := func(a int64) bool { return vec[(a-off)>>pageShift]&1 != 0 }
		next := func(a, limit int64) int64 { return min((a>>pageShift+1)<<pageShift, limit) }
		for first, n := range bits.runs(off, end) {
			for a, stop := first, first+n; a < stop; {
				b := a
				for b < stop && in(b) {
					b = next(b, stop)
				}
				if b > a && !yield(a, b-a) {
					return
				}
				for b < stop && !in(b) {
					b = next(b, stop)
				}
				a = b
			}
		}
	}
}

// unmap lets go of the backend's mapping, which its last backend's
// Close unmaps; no IO of the backend may be under way.
func (b *Backend) unmap() {
	m := b.mp.m.Swap(nil)
	if m == nil {
		return
	}
	maps.mu.Lock()
	m.refs--
	last := m.refs == 0
	if last {
		delete(maps.m, m.key)
	}
	maps.mu.Unlock()
	if !last {
		return
	}
	m.mu.Lock()
	m.done = true
	m.mu.Unlock()
	m.pop.Wait() // each sees done at its next step
	m.Release()  // the mapping goes once no ReadView holds it
}

// Release drops a hold on the mapping (ReadView's, or the backends'
// together at their last Close); the last one unmaps it.
func (m *fileMap) Release() {
	if m.holds.Add(-1) != 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for i := range m.view {
		if cur := m.view[i].Swap(nil); cur != nil {
			m.old = append(m.old, *cur)
		}
	}
	for _, x := range m.old {
		unix.Munmap(x)
	}
	m.old = nil
}

// viewMin is the smallest read ReadView answers: below it, copying the
// data out costs less than the check that sending it from the mapping
// will not fault.
const viewMin = 64 << 10

// Releaser is what keeps a ReadView's memory valid until Release.
type Releaser interface {
	Release()
}

// ReadView returns the n bytes at off as the backend's mapping holds
// them, for a caller that can send them from there without copying them
// out (a read answered over TCP): nil if the read is not one that the
// mapping can serve (not a memory backend, not mapped, shorter than
// viewMin, a page not known to be allocated or not in memory: see
// readMapped). The view stays mapped until the Releaser's Release —
// called once per view: it is the mapping's count — even past the
// backend's Close, and must only be read: it is the file. A
// write to the range meanwhile may show in it, as in any read that
// overlaps a write in flight; a discard of it meanwhile may find its
// pages faulted back in by the send (zeros, allocated).
//
// The pages are checked to be in memory (mincore) first, so that a send
// from the view does not fault: a fault there — the file cut behind the
// server's back after the check, a discarded page faulted back in on a
// full tmpfs — fails the sender's whole connection (which must be one
// where a fault fails the send, not the process: fabric.AnySource), not
// only the read; and a page swapped out is read back by the copy, not by
// the sender.
func (b *Backend) ReadView(off int64, n int) ([]byte, Releaser) {
	if n < viewMin || !b.nw.mem || b.check(off, int64(n), false) != nil {
		return nil, nil
	}
	m := b.mp.m.Load()
	if m == nil {
		return nil, nil
	}
	if bits := m.present.Load(); bits != nil && !bits.all(off, int64(n)) {
		return nil, nil
	}
	x := b.mapped(m, off, n)
	if x == nil || !inMemory(x) {
		return nil, nil
	}
	// The backend is open (its caller's IO is in flight), so the
	// backends' hold is there to add to.
	m.holds.Add(1)
	return x[:n:n], m
}

// mincore fills vec with a byte per page of the n bytes mapped at addr
// (page-aligned), bit 0 set for a page in memory; it waits for no IO.
func mincore(addr, n uintptr, vec []byte) error {
	if _, _, e := unix.RawSyscall(unix.SYS_MINCORE, addr, n, uintptr(unsafe.Pointer(unsafe.SliceData(vec)))); e != 0 {
		return e
	}
	return nil
}

// inMemory says whether every page of the mapped x is in memory.
func inMemory(x []byte) bool {
	var vec [256]byte
	ps := uintptr(unix.Getpagesize())
	base := uintptr(unsafe.Pointer(unsafe.SliceData(x)))
	start := base &^ (ps - 1)
	end := base + uintptr(len(x))
	for start < end {
		n := min(end-start, uintptr(len(vec))*ps)
		if mincore(start, n, vec[:]) != nil {
			return false
		}
		for i := uintptr(0); i < (n+ps-1)/ps; i++ {
			if vec[i]&1 == 0 {
				return false
			}
		}
		start += n
	}
	return true
}

// mapped is the backend's mapping for n bytes at off, or nil if it has
// none.
func (b *Backend) mapped(m *fileMap, off int64, n int) []byte {
	cur := m.view[b.viewOf()].Load()
	if cur == nil || off < 0 || off > int64(len(*cur))-int64(n) {
		return nil
	}
	return (*cur)[off : off+int64(n)]
}

// readMapped copies len(p) bytes at off from the mapping; false: not
// made (or made in part), the caller reads by a system call.
func (b *Backend) readMapped(p []byte, off int64) bool {
	m := b.mp.m.Load()
	if m == nil {
		return false
	}
	if bits := m.present.Load(); bits != nil && !bits.all(off, int64(len(p))) {
		return false
	}
	x := b.mapped(m, off, len(p))
	return x != nil && copyFaulting(p, x, x)
}

// writeMapped copies p into the mapping at off; false as readMapped.
func (b *Backend) writeMapped(p []byte, off int64) bool {
	m := b.mp.m.Load()
	if m == nil || !b.mp.writable {
		return false
	}
	x := b.mapped(m, off, len(p))
	if x == nil || !copyFaulting(x, p, x) {
		return false
	}
	m.allocated(off, int64(len(p)))
	// One atomic load per write; the write that finds no stamp pending
	// arms the timer, without a lock or an allocation.
	if s := &b.mp.stamp; !s.pending.Load() && s.pending.CompareAndSwap(false, true) {
		s.timer.Reset(mtimeLag)
	}
	return true
}

// stampMtime sets the file's mtime (and with it its ctime) to now if a
// write through the mapping has not been stamped; with last, at Close,
// no write comes after.
func (b *Backend) stampMtime(last bool) {
	s := &b.mp.stamp
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed && s.pending.Swap(false) {
		// futimens: utimensat on the descriptor itself (a NULL path).
		// Best effort, as the kernel's own stamp of a write is: the
		// write is made either way.
		ts := [2]unix.Timespec{{Nsec: unix.UTIME_OMIT}, {Nsec: unix.UTIME_NOW}}
		unix.Syscall6(unix.SYS_UTIMENSAT, uintptr(b.nw.fd), 0, uintptr(unsafe.Pointer(&ts[0])), 0, 0, 0)
	}
	if last {
		s.closed = true
		if s.timer != nil {
			s.timer.Stop()
		}
	}
}

// allocated: n bytes at off were written by a system call, their pages
// are there.
func (b *Backend) allocated(off, n int64) {
	if m := b.mp.m.Load(); m != nil {
		m.allocated(off, n)
	}
}

func (m *fileMap) allocated(off, n int64) {
	if bits := m.present.Load(); bits != nil {
		bits.set(off, n)
	}
}

// mayPunch: a hole may be punched in n bytes at off (a discard, a
// write-zeroes); their pages are read through system calls until
// written again. Before the punch: a read after it must not fault a
// page back in.
func (b *Backend) mayPunch(off, n int64) {
	if m := b.mp.m.Load(); m != nil && m.present.Load() != nil {
		// Under the lock a grow copies the bits under: a bit cleared
		// during the copy must not come back.
		m.mu.Lock()
		m.present.Load().clear(off, n)
		m.mu.Unlock()
	}
}

// resized: where the backend's IO ends goes from was to now (Refresh,
// PollSize, before it serves now). A shrink freed the pages past now:
// forgotten. A grow may
// come after a shrink not seen (behind the server's back, or through
// another open while this file's bits were kept): the file is walked
// again, or, if that fails, the pages past was forgotten.
func (b *Backend) resized(was, now int64) {
	m := b.mp.m.Load()
	if was == now || m == nil || m.present.Load() == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.present.Load().clear(min(was, now)&^(1<<pageShift-1), math.MaxInt64)
	if now < was || now > maxMapped {
		return
	}
	if rc, err := b.f.SyscallConn(); err == nil {
		rc.Control(func(fd uintptr) { m.present.Store(findPages(int(fd), now)) })
	}
}

// copyFaulting copies src to dst, one of them mapped (the part of a
// mapping that is m), and reports false if m faulted (SIGBUS: past the
// file's end, or no space for a page) instead of taking the daemon down.
// Any other fault is not ours to hide.
func copyFaulting(dst, src, m []byte) (ok bool) {
	was := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(was)
		if r := recover(); r != nil {
			f, isFault := r.(interface{ Addr() uintptr })
			start := uintptr(unsafe.Pointer(unsafe.SliceData(m)))
			if !isFault || f.Addr() < start || f.Addr()-start >= uintptr(len(m)) {
				panic(r)
			}
			ok = false
		}
	}()
	copy(dst, src)
	return true
}
