// Opening a backend and probing it: what the file or device is, its
// sizes and alignment, and what it can do (Caps), found by trying where
// no attribute says.

package blockdev

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// maxZeroBytes bounds one discard or write-zeroes request on a file.
const maxZeroBytes = 1 << 30

// Open opens path, a regular file or a block device.
func Open(path string, opts Options) (*Backend, error) {
	return openWith(path, opts, func(flags int) (*os.File, error) {
		return os.OpenFile(path, flags, 0)
	})
}

// ErrEscapes is returned by OpenBeneath for a name that leads out of its
// directory: through "..", an absolute symlink, or a symlink to outside.
var ErrEscapes = fmt.Errorf("blockdev: path leads out of its directory: %w", syscall.EINVAL)

// OpenBeneath opens name inside dir and refuses, atomically, any name
// that resolves to something outside dir (openat2 with RESOLVE_BENEATH):
// no "..", no symlink that leaves dir, no /proc magic links. Leading
// slashes of name are dropped: "/dev/x" means dir/dev/x, as the kernel's
// dev_search_path concatenation does.
func OpenBeneath(dir, name string, opts Options) (*Backend, error) {
	name = strings.TrimLeft(name, "/")
	if name == "" {
		return nil, fmt.Errorf("blockdev: empty name: %w", syscall.EINVAL)
	}
	d, err := os.OpenFile(dir, os.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	full := filepath.Join(dir, name)
	return openWith(full, opts, func(flags int) (*os.File, error) {
		how := unix.OpenHow{Flags: uint64(flags), Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS}
		fd, err := unix.Openat2(int(d.Fd()), name, &how)
		if err == unix.EXDEV {
			return nil, fmt.Errorf("%s: %w", full, ErrEscapes)
		}
		if err != nil {
			return nil, &os.PathError{Op: "open", Path: full, Err: err}
		}
		return os.NewFile(uintptr(fd), full), nil
	})
}

func openWith(path string, opts Options, open func(flags int) (*os.File, error)) (*Backend, error) {
	flags := os.O_RDWR
	if opts.ReadOnly {
		flags = os.O_RDONLY
	}
	if opts.Direct {
		flags |= syscall.O_DIRECT
	}
	f, err := openChecked(path, flags|syscall.O_CLOEXEC, open)
	if err != nil {
		return nil, err
	}
	b := &Backend{path: path, f: f, ro: opts.ReadOnly}
	if err := b.probe(opts); err != nil {
		f.Close()
		return nil, fmt.Errorf("blockdev: %s: %w", path, err)
	}
	if !opts.Direct {
		// Without O_DIRECT the page cache is a volatile write cache,
		// whatever the device's own (a brd, a RAID controller with a
		// battery report "write through").
		b.caps.WriteCache = true
	}
	b.caps.FUA = b.caps.WriteCache
	if opts.WriteThrough {
		// Read-only, it still reports no cache: what a reader is told
		// of the device should not depend on its own access mode.
		b.wt = !b.ro
		b.caps.WriteCache, b.caps.FUA = false, false
	}
	b.probeNowait(opts.Direct)
	if !b.ro {
		// A second descriptor of the same file with O_DSYNC serves
		// FUA writes. Reopened through the first, never by path, so
		// it is the very same file; named by the path, so that its
		// errors name the export's file, not /proc/self/fd/N.
		fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", f.Fd()), flags|syscall.O_DSYNC|syscall.O_CLOEXEC, 0)
		runtime.KeepAlive(f)
		if err != nil {
			f.Close()
			return nil, &os.PathError{Op: "open", Path: path, Err: err}
		}
		b.fsync = os.NewFile(uintptr(fd), path)
	}
	b.mapInit(opts.Direct)
	return b, nil
}

// ErrNotBlockLike is returned for a path that is neither a regular file
// nor a block device.
var ErrNotBlockLike = fmt.Errorf("blockdev: not a regular file or block device: %w", syscall.EINVAL)

// openChecked opens what open finds with flags only once it is known to
// be a regular file or a block device: first as a bare path (O_PATH: no
// open of the object itself, so a FIFO cannot block and a character
// device's open has no effect), then, the type checked on that very
// inode, for IO through the descriptor's /proc link.
func openChecked(path string, flags int, open func(flags int) (*os.File, error)) (*os.File, error) {
	p, err := open(unix.O_PATH | unix.O_CLOEXEC)
	if err != nil {
		return nil, err
	}
	defer p.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(p.Fd()), &st); err != nil {
		return nil, &os.PathError{Op: "fstat", Path: path, Err: err}
	}
	if t := st.Mode & unix.S_IFMT; t != unix.S_IFREG && t != unix.S_IFBLK {
		return nil, fmt.Errorf("%s: %w", path, ErrNotBlockLike)
	}
	fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", p.Fd()), flags, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), path), nil
}

func (b *Backend) probe(opts Options) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(b.f.Fd()), &st); err != nil {
		return err
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		b.kind = KindFile
		b.size.Store(st.Size)
		b.dev, b.ino = st.Dev, st.Ino
		b.lbs, b.pbs = opts.LogicalBlockSize, opts.PhysicalBlockSize
		if opts.Direct {
			// O_DIRECT IO must be aligned as the file's storage
			// wants: 4 KiB on a 4Kn disk, where 512 fails EINVAL.
			if a := dioAlign(b.f, st.Dev); a > max(b.lbs, 512) {
				switch {
				case b.lbs == 0:
					b.lbs = a
				default:
					return fmt.Errorf("logical block size %d: O_DIRECT IO on this file must be aligned to %d bytes: %w", b.lbs, a, syscall.EINVAL)
				}
			}
		}
		if b.lbs == 0 {
			b.lbs = 512
		}
		if b.pbs == 0 {
			b.pbs = max(4096, b.lbs)
		}
		if !validBlockSize(b.lbs) || !validBlockSize(b.pbs) || b.pbs < b.lbs {
			return fmt.Errorf("block sizes %d/%d: want powers of two from 512 to 65536, physical >= logical: %w", b.lbs, b.pbs, syscall.EINVAL)
		}
		var fs unix.Statfs_t
		if unix.Fstatfs(int(b.f.Fd()), &fs) == nil {
			b.fs = uint32(fs.Type)
		}
		b.probeFile()
	case unix.S_IFBLK:
		b.kind = KindBlockDevice
		b.dev, b.ino = st.Rdev, 0
		if err := b.probeDevice(); err != nil {
			return err
		}
	default:
		return fmt.Errorf("not a regular file or block device: %w", syscall.EINVAL)
	}
	// The tail that is not a whole block cannot be addressed.
	b.size.Store(b.size.Load() &^ int64(b.lbs-1))
	b.end.Store(b.size.Load())
	b.want = b.size.Load()
	return nil
}

// dioAlign is the offset and length alignment O_DIRECT IO on f needs, as
// far as the disk its file system lies on (fsdev, st_dev) makes it: the
// smaller of statx's STATX_DIOALIGN (Linux 6.1) and that disk's logical
// block size, either where the other is unknown, 0 where both are. A file
// system's own larger alignment is left out: f2fs says its block size and
// serves smaller O_DIRECT IO through the page cache, and an export that
// served 512-byte blocks must keep serving them (a client's partition
// table and file system are laid out in them).
func dioAlign(f *os.File, fsdev uint64) int {
	stx := 0
	var x unix.Statx_t
	if unix.Statx(int(f.Fd()), "", unix.AT_EMPTY_PATH, unix.STATX_DIOALIGN, &x) == nil &&
		x.Mask&unix.STATX_DIOALIGN != 0 {
		stx = int(x.Dio_offset_align)
	}
	disk := 0
	_, d := sysfsDirs("/sys/dev/block", fsdev)
	if s, err := os.ReadFile(filepath.Join(d, "queue", "logical_block_size")); err == nil {
		disk, _ = strconv.Atoi(strings.TrimSpace(string(s)))
	}
	switch {
	case stx > 0 && disk > 0:
		return min(stx, disk)
	case stx > 0:
		return stx
	}
	return disk
}

func validBlockSize(n int) bool { return n >= 512 && n <= 65536 && n&(n-1) == 0 }

// probeFile learns what the file's filesystem can do, without changing
// its data: a hole punched past the end with KEEP_SIZE frees nothing,
// and fails with EOPNOTSUPP where holes cannot be punched. It does move
// the file's mtime (ext4, tmpfs), which is left so: putting the old
// one back could hide a write made meanwhile from a backup. tmpfs
// punches holes (since Linux 3.5), so it is not asked.
func (b *Backend) probeFile() {
	b.caps = Caps{
		MaxIOBytes:          8 << 20,
		MaxSegments:         256,
		WriteCache:          true, // block allocation is metadata until fdatasync, even with O_DIRECT
		MaxWriteZeroesBytes: maxZeroBytes,
	}
	if b.ro {
		return
	}
	// Zero range is not probed: past the end it allocates an unwritten
	// extent (ext4, XFS) that stays; the first write-zeroes finds out.
	b.caps.ZeroRange = true
	if b.fs == tmpfsMagic || unix.Fallocate(int(b.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, b.size.Load()+1<<20, 4096) == nil {
		b.caps.Discard = true
		b.caps.MaxDiscardBytes = maxZeroBytes
		b.caps.DiscardGranularity = uint32(b.pbs)
	}
}

func (b *Backend) probeDevice() error {
	fd := int(b.f.Fd())
	size, err := ioctlUint64(b.f, unix.BLKGETSIZE64)
	if err != nil {
		return fmt.Errorf("BLKGETSIZE64: %w", err)
	}
	b.size.Store(int64(size))
	if b.lbs, err = unix.IoctlGetInt(fd, unix.BLKSSZGET); err != nil {
		return fmt.Errorf("BLKSSZGET: %w", err)
	}
	if b.pbs, err = unix.IoctlGetInt(fd, unix.BLKPBSZGET); err != nil {
		return fmt.Errorf("BLKPBSZGET: %w", err)
	}
	ro, err := unix.IoctlGetInt(fd, unix.BLKROGET)
	if err != nil {
		return fmt.Errorf("BLKROGET: %w", err)
	}
	if ro != 0 && !b.ro {
		return fmt.Errorf("device is read-only: %w", syscall.EROFS)
	}
	dir, disk := sysfsDirs("/sys/dev/block", b.dev)
	num := func(path string) uint64 {
		s, err := os.ReadFile(path)
		if err != nil {
			return 0
		}
		n, _ := strconv.ParseUint(strings.TrimSpace(string(s)), 10, 64)
		return n
	}
	q := filepath.Join(disk, "queue")
	wc, _ := os.ReadFile(filepath.Join(q, "write_cache"))
	b.caps = Caps{
		MaxDiscardBytes:     num(filepath.Join(q, "discard_max_bytes")),
		DiscardGranularity:  uint32(num(filepath.Join(q, "discard_granularity"))),
		DiscardAlignment:    uint32(num(filepath.Join(dir, "discard_alignment"))),
		MaxWriteZeroesBytes: num(filepath.Join(q, "write_zeroes_max_bytes")),
		WriteCache:          strings.TrimSpace(string(wc)) == "write back",
		MaxIOBytes:          uint32(min(num(filepath.Join(q, "max_hw_sectors_kb"))<<10, 1<<31)),
		MaxSegments:         uint16(min(num(filepath.Join(q, "max_segments")), 65535)),
	}
	b.caps.Discard = b.caps.MaxDiscardBytes > 0 && !b.ro
	b.caps.ZeroRange = b.caps.MaxWriteZeroesBytes > 0
	if b.caps.MaxWriteZeroesBytes == 0 {
		b.caps.MaxWriteZeroesBytes = maxZeroBytes // emulated
	}
	if b.caps.MaxIOBytes == 0 {
		b.caps.MaxIOBytes = 128 << 10
	}
	if b.caps.MaxSegments == 0 {
		b.caps.MaxSegments = 128
	}
	return nil
}

// sysfsDirs returns the sysfs directory of block device dev (under root,
// /sys/dev/block) and that of the disk whose request queue serves it: a
// partition has no queue of its own — its disk's limits and write cache
// are its own — and is a subdirectory of its disk's.
func sysfsDirs(root string, dev uint64) (dir, disk string) {
	dir = filepath.Join(root, fmt.Sprintf("%d:%d", unix.Major(dev), unix.Minor(dev)))
	if _, err := os.Stat(filepath.Join(dir, "partition")); err != nil {
		return dir, dir
	}
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return dir, dir
	}
	return dir, filepath.Dir(real)
}
