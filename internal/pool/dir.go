// The directory pool: each volume is a sparse file NAME.img in the
// pool's directory, its metadata a JSON extended attribute
// (user.rnbd.volume) on the file, which moves with it. A volume is made
// under .rnbd-tmp/ and renamed into place only once it is whole, so a
// crash leaves either nothing or a whole volume; what a crash left in
// .rnbd-tmp/ is removed when the pool is opened.

package pool

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

const (
	suffix = ".img"
	tmpDir = ".rnbd-tmp" // no suffix: never a volume
	xattr  = "user.rnbd.volume"
)

// Dir is a directory pool.
//
// Concurrency: a Dir is safe for concurrent use (the Pool interface
// says what that promises). names locks the name a change is of: the
// volume's for Create, Resize and Delete, the snapshot's for
// CreateSnapshot and DeleteSnapshot (a volume and a snapshot may share
// a name). Changes of different names run at once, each making its
// file under its own name in .rnbd-tmp/. A clone or a snapshot does not
// lock its source: it reflinks the source's file as it is at that
// moment (a source deleted at the same time is ENOENT, or cloned
// whole). space is held while a create or a growth counts the pool
// (statfs, and the metadata of every volume) and reserves what it
// needs. Reads (Get, List, Capacity, Snapshots) take neither: they see
// a volume whole or not at all (it is renamed into place whole), and a
// growth's metadata before its file (the next Resize finishes a growth
// a crash cut). Lock order: a name's lock, then space.
type Dir struct {
	name, dir string
	now       func() time.Time
	// dev is the file system the directory was on when opened: one
	// unmounted since is not written to (mounted).
	dev   uint64
	names nameLocks
	space reservations
	// beforeRename, if set (a test), is called with a made file's path
	// under .rnbd-tmp/ before it is renamed into place.
	beforeRename func(tmp string)
}

// change runs fn holding the lock of a volume's or snapshot's name
// (kind and name), on the file system the pool was opened on. The
// caller has checked the name.
func (p *Dir) change(kind, name string, fn func() error) error {
	return p.names.with(lockKey(kind, name), func() error {
		if err := p.mounted(); err != nil {
			return err
		}
		return fn()
	})
}

// mounted refuses a change when the pool's directory is no longer on
// the file system it was on when opened (unmounted, or another mounted
// over it): nothing is made on the wrong one.
func (p *Dir) mounted() error {
	var st unix.Stat_t
	if err := unix.Stat(p.dir, &st); err != nil {
		return errorf(syscall.ENOTCONN, "pool %s: %s: %v", p.name, p.dir, err)
	}
	if st.Dev != p.dev {
		return errorf(syscall.ENOTCONN, "pool %s: %s is no longer the file system it was when the pool was opened: unmounted? (restart once it is back)", p.name, p.dir)
	}
	return nil
}

// DirOptions are a directory pool's settings.
type DirOptions struct {
	// Mountpoint: the directory must be a mount point (its file system
	// mounted), not the empty directory under it.
	Mountpoint bool
}

// OpenDir opens the directory pool name at dir, which must exist, and
// removes what a crash left half-made. It returns what it removed, for
// the caller to log.
func OpenDir(name, dir string, opts DirOptions) (*Dir, []string, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return nil, nil, errorf(syscall.ENOENT, "pool %s: %s: %v", name, dir, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return nil, nil, errorf(syscall.ENOTDIR, "pool %s: %s is not a directory", name, dir)
	}
	if opts.Mountpoint {
		var up unix.Stat_t
		if err := unix.Stat(filepath.Join(dir, ".."), &up); err != nil {
			return nil, nil, fmt.Errorf("pool %s: %w", name, err)
		}
		if up.Dev == st.Dev && up.Ino != st.Ino {
			return nil, nil, errorf(syscall.ENOTCONN, "pool %s: %s is not a mount point: is its file system mounted? (mountpoint = true)", name, dir)
		}
	}
	p := &Dir{name: name, dir: dir, now: time.Now, dev: st.Dev}
	if err := os.Mkdir(filepath.Join(dir, tmpDir), 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, nil, fmt.Errorf("pool %s: %w", name, err)
	}
	left, err := os.ReadDir(filepath.Join(dir, tmpDir))
	if err != nil {
		return nil, nil, fmt.Errorf("pool %s: %w", name, err)
	}
	var removed []string
	for _, e := range left {
		if err := os.Remove(filepath.Join(dir, tmpDir, e.Name())); err != nil {
			return nil, nil, fmt.Errorf("pool %s: a half-made volume: %w", name, err)
		}
		removed = append(removed, e.Name())
	}
	return p, removed, nil
}

// Name implements Pool.
func (p *Dir) Name() string { return p.name }

// Type implements Pool.
func (p *Dir) Type() string { return "dir" }

func (p *Dir) path(name string) string { return filepath.Join(p.dir, name+suffix) }

// Get returns the volume name; ENOENT if there is none.
func (p *Dir) Get(name string) (Volume, error) {
	if err := CheckName(name); err != nil {
		return Volume{}, err
	}
	return p.read(name)
}

func (p *Dir) read(name string) (Volume, error) {
	path := p.path(name)
	var v Volume
	err := getMeta(path, xattr, &v)
	switch {
	case errors.Is(err, unix.ENOENT):
		return Volume{}, errorf(syscall.ENOENT, "pool %s: no volume %s", p.name, name)
	case errors.Is(err, unix.ENODATA):
		return Volume{}, errorf(syscall.ENOENT, "pool %s: %s is not a volume of the pool (no %s attribute)", p.name, path, xattr)
	case err != nil:
		return Volume{}, fmt.Errorf("pool %s: volume %s: its metadata: %w", p.name, name, err)
	}
	if v.Name != name {
		return Volume{}, fmt.Errorf("pool %s: %s carries the metadata of volume %q", p.name, path, v.Name)
	}
	v.Path = path
	return v, nil
}

// List returns the pool's volumes by name. Files without the pool's
// metadata are not volumes and are left out.
func (p *Dir) List() ([]Volume, error) {
	return readAll(p, p.dir, p.read)
}

// readAll reads the metadata of every NAME.img in dir with read (by
// name: ReadDir sorts), leaving out the files that have none.
func readAll[T any](p *Dir, dir string, read func(name string) (T, error)) ([]T, error) {
	es, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("pool %s: %w", p.name, err)
	}
	var out []T
	for _, e := range es {
		name, ok := strings.CutSuffix(e.Name(), suffix)
		if !ok || !e.Type().IsRegular() || checkStored(name) != nil {
			continue
		}
		x, err := read(name)
		if errors.Is(err, syscall.ENOENT) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, x)
	}
	return out, nil
}

// Capacity says the pool's space. Promised counts the space reserved
// by the creates and growths under way.
func (p *Dir) Capacity() (Capacity, error) {
	return p.capacity(p.space.held())
}

// capacity counts the pool's space, reserved bytes promised besides
// what the volumes may still claim.
func (p *Dir) capacity(reserved int64) (Capacity, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(p.dir, &st); err != nil {
		return Capacity{}, fmt.Errorf("pool %s: %w", p.name, err)
	}
	vs, err := p.List()
	if err != nil {
		return Capacity{}, err
	}
	c := Capacity{Total: int64(st.Blocks) * st.Bsize, Promised: reserved}
	free := int64(st.Bavail) * st.Bsize
	c.Used = c.Total - int64(st.Bfree)*st.Bsize
	for _, v := range vs {
		var fs unix.Stat_t
		if unix.Stat(v.Path, &fs) != nil {
			continue
		}
		if left := v.Size - fs.Blocks*512; left > 0 {
			c.Promised += left
		}
	}
	c.Allocatable = max(free-c.Promised, 0)
	return c, nil
}

// Create implements Pool.
func (p *Dir) Create(s Spec) (v Volume, created bool, err error) {
	if err := CheckSpec(s); err != nil {
		return Volume{}, false, err
	}
	err = p.change(kindVolume, s.Name, func() error {
		v, created, err = p.create(s)
		return err
	})
	return v, created, err
}

func (p *Dir) create(s Spec) (v Volume, created bool, err error) {
	if old, err := p.read(s.Name); err == nil {
		if diff := differs(old, s); diff != "" {
			return old, false, errorf(syscall.EEXIST, "pool %s: volume %s exists with %s", p.name, s.Name, diff)
		}
		return old, false, nil
	} else if !errors.Is(err, syscall.ENOENT) {
		return Volume{}, false, err
	}
	var src string // the file cloned
	switch {
	case s.From != "":
		from, err := p.read(s.From)
		if err != nil {
			return Volume{}, false, err
		}
		if s.Size < from.Size {
			return Volume{}, false, errorf(syscall.EINVAL, "pool %s: a clone of %s (%d bytes) cannot be smaller (%d)", p.name, s.From, from.Size, s.Size)
		}
		src = from.Path
	case s.FromSnapshot != "":
		from, err := p.readSnapshot(s.FromSnapshot)
		if err != nil {
			return Volume{}, false, err
		}
		if s.Size < from.Size {
			return Volume{}, false, errorf(syscall.EINVAL, "pool %s: a clone of snapshot %s (%d bytes) cannot be smaller (%d)", p.name, s.FromSnapshot, from.Size, s.Size)
		}
		src = from.Path
	}
	release, err := p.space.take(func(reserved int64) (int64, error) {
		c, err := p.capacity(reserved)
		if err != nil {
			return 0, err
		}
		if s.Size > c.Allocatable {
			return 0, errorf(syscall.ENOSPC, "pool %s: %d bytes asked, %d allocatable", p.name, s.Size, c.Allocatable)
		}
		return s.Size, nil
	})
	if err != nil {
		return Volume{}, false, err
	}
	defer release()
	v = Volume{Name: s.Name, Pool: p.name, Size: s.Size, Source: s.From, SourceSnapshot: s.FromSnapshot,
		Created: p.now().UTC().Truncate(time.Second), Labels: maps.Clone(s.Labels)}
	if err := p.make(kindVolume, p.path(v.Name), v.Size, xattr, v, src, 0o600); err != nil {
		return Volume{}, false, err
	}
	v.Path = p.path(v.Name)
	return v, true, nil
}

// make writes a file of size bytes with meta as its metadata under
// tmpDir — the clone of the file src if set — then renames it to path:
// whole, or not there at all. Its name there is its kind's and its
// own: a volume and a snapshot of one name may be made at once.
func (p *Dir) make(kind, path string, size int64, attr string, meta any, src string, mode os.FileMode) (err error) {
	tmp := filepath.Join(p.dir, tmpDir, kind+"."+filepath.Base(path))
	os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return fmt.Errorf("pool %s: %w", p.name, err)
	}
	defer func() {
		f.Close()
		if err != nil {
			os.Remove(tmp)
		}
	}()
	if src != "" {
		if err := clone(f, src); err != nil {
			return fmt.Errorf("pool %s: %w", p.name, err)
		}
	}
	if err := f.Truncate(size); err != nil {
		return fmt.Errorf("pool %s: %w", p.name, err)
	}
	if err := setMeta(f, attr, meta); err != nil {
		return fmt.Errorf("pool %s: %w", p.name, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("pool %s: %w", p.name, err)
	}
	if p.beforeRename != nil {
		p.beforeRename(tmp)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("pool %s: %w", p.name, err)
	}
	return syncDir(filepath.Dir(path))
}

// clone makes f share src's blocks (FICLONE); a file system without
// reflinks is EOPNOTSUPP: no full copy is made behind the caller's back.
func clone(f *os.File, src string) error {
	s, err := os.Open(src)
	if err != nil {
		return err
	}
	defer s.Close()
	err = unix.IoctlFileClone(int(f.Fd()), int(s.Fd()))
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EXDEV) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTTY) {
		return errorf(syscall.EOPNOTSUPP, "cloning %s needs a file system with reflinks (FICLONE: %v); no full copy is made", filepath.Base(src), err)
	}
	if err != nil {
		return fmt.Errorf("cloning %s: %w", filepath.Base(src), err)
	}
	return nil
}

func setMeta(f *os.File, attr string, meta any) error {
	b, err := json.Marshal(meta)
	if err != nil {
		return err
	}
	return unix.Fsetxattr(int(f.Fd()), attr, b, 0)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// Resize grows volume name to size; a smaller size is refused (EINVAL).
// The same size succeeds.
func (p *Dir) Resize(name string, size int64) (v Volume, err error) {
	if err := CheckName(name); err != nil {
		return Volume{}, err
	}
	if err := checkSize(size); err != nil {
		return Volume{}, err
	}
	err = p.change(kindVolume, name, func() error {
		v, err = p.resize(name, size)
		return err
	})
	return v, err
}

func (p *Dir) resize(name string, size int64) (Volume, error) {
	v, err := p.read(name)
	if err != nil {
		return Volume{}, err
	}
	if err := p.finishGrow(v); err != nil {
		return v, err
	}
	switch {
	case size == v.Size:
		return v, nil
	case size < v.Size:
		return v, errorf(syscall.EINVAL, "pool %s: volume %s is %d bytes: a volume grows only (asked %d)", p.name, name, v.Size, size)
	}
	release, err := p.space.take(func(reserved int64) (int64, error) {
		c, err := p.capacity(reserved)
		if err != nil {
			return 0, err
		}
		if size-v.Size > c.Allocatable {
			return 0, errorf(syscall.ENOSPC, "pool %s: %d more bytes asked, %d allocatable", p.name, size-v.Size, c.Allocatable)
		}
		return size - v.Size, nil
	})
	if err != nil {
		return v, err
	}
	defer release()
	f, err := os.OpenFile(v.Path, os.O_RDWR, 0)
	if err != nil {
		return v, fmt.Errorf("pool %s: %w", p.name, err)
	}
	defer f.Close()
	// The size in the metadata first: a crash between the two leaves a
	// volume its metadata calls larger, which a retry grows to it.
	grown := v
	grown.Size = size
	if err := setMeta(f, xattr, grown); err != nil {
		return v, fmt.Errorf("pool %s: %w", p.name, err)
	}
	if err := f.Truncate(size); err != nil {
		return v, fmt.Errorf("pool %s: %w", p.name, err)
	}
	return grown, f.Sync()
}

// finishGrow grows v's file to the size its metadata says, if a crash
// came between the two steps of a Resize.
func (p *Dir) finishGrow(v Volume) error {
	fi, err := os.Stat(v.Path)
	if err != nil {
		return fmt.Errorf("pool %s: %w", p.name, err)
	}
	if fi.Size() >= v.Size {
		return nil
	}
	if err := os.Truncate(v.Path, v.Size); err != nil {
		return fmt.Errorf("pool %s: finishing the growth of %s: %w", p.name, v.Name, err)
	}
	return nil
}

// Delete removes volume name; one that is not there is success (a retry
// of a delete). Whether a session has it open is the caller's to check.
func (p *Dir) Delete(name string) error {
	if err := CheckName(name); err != nil {
		return err
	}
	return p.change(kindVolume, name, func() error { return p.delete(name) })
}

func (p *Dir) delete(name string) error {
	if _, err := p.read(name); errors.Is(err, syscall.ENOENT) {
		if _, serr := os.Stat(p.path(name)); serr == nil {
			// A file of the name that is not the pool's: not ours to
			// remove.
			return err
		}
		return nil
	} else if err != nil {
		return err
	}
	if err := os.Remove(p.path(name)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("pool %s: %w", p.name, err)
	}
	return syncDir(p.dir)
}

// snapDir holds a directory pool's snapshots, each a read-only reflink
// of its volume with the metadata in snapXattr.
const (
	snapDir   = ".rnbd-snap"
	snapXattr = "user.rnbd.snapshot"
)

func (p *Dir) snapPath(name string) string { return filepath.Join(p.dir, snapDir, name+suffix) }

func (p *Dir) readSnapshot(name string) (Snapshot, error) {
	var s Snapshot
	path := p.snapPath(name)
	if err := getMeta(path, snapXattr, &s); errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ENODATA) {
		return Snapshot{}, errorf(syscall.ENOENT, "pool %s: no snapshot %s", p.name, name)
	} else if err != nil {
		return Snapshot{}, fmt.Errorf("pool %s: snapshot %s: %w", p.name, name, err)
	}
	if s.Name != name {
		return Snapshot{}, fmt.Errorf("pool %s: %s carries the metadata of snapshot %q", p.name, path, s.Name)
	}
	s.Path = path
	return s, nil
}

// CreateSnapshot implements Pool: a reflink of the volume's file
// (FICLONE), EOPNOTSUPP where the file system has none.
func (p *Dir) CreateSnapshot(volume, name string, labels map[string]string) (s Snapshot, created bool, err error) {
	if err := checkLabels(labels); err != nil {
		return Snapshot{}, false, err
	}
	for _, n := range []string{volume, name} {
		if err := CheckName(n); err != nil {
			return Snapshot{}, false, err
		}
	}
	err = p.change(kindSnapshot, name, func() error {
		s, created, err = p.createSnapshot(volume, name, labels)
		return err
	})
	return s, created, err
}

func (p *Dir) createSnapshot(volume, name string, labels map[string]string) (Snapshot, bool, error) {
	if old, err := p.readSnapshot(name); err == nil {
		if old.Volume != volume {
			return old, false, errorf(syscall.EEXIST, "pool %s: snapshot %s exists, of volume %s (asked %s)", p.name, name, old.Volume, volume)
		}
		return old, false, nil
	} else if !errors.Is(err, syscall.ENOENT) {
		return Snapshot{}, false, err
	}
	v, err := p.read(volume)
	if err != nil {
		return Snapshot{}, false, err
	}
	if err := os.MkdirAll(filepath.Join(p.dir, snapDir), 0o700); err != nil {
		return Snapshot{}, false, fmt.Errorf("pool %s: %w", p.name, err)
	}
	s := Snapshot{Name: name, Pool: p.name, Volume: volume, Size: v.Size, Created: p.now().UTC().Truncate(time.Second), Labels: maps.Clone(labels)}
	if err := p.make(kindSnapshot, p.snapPath(name), v.Size, snapXattr, s, v.Path, 0o400); err != nil {
		return Snapshot{}, false, err
	}
	s.Path = p.snapPath(name)
	return s, true, nil
}

// Snapshots implements Pool.
func (p *Dir) Snapshots() ([]Snapshot, error) {
	ss, err := readAll(p, filepath.Join(p.dir, snapDir), p.readSnapshot)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil // none taken yet
	}
	return ss, err
}

// DeleteSnapshot implements Pool.
func (p *Dir) DeleteSnapshot(name string) error {
	if err := CheckName(name); err != nil {
		return err
	}
	return p.change(kindSnapshot, name, func() error { return p.deleteSnapshot(name) })
}

func (p *Dir) deleteSnapshot(name string) error {
	if _, err := p.readSnapshot(name); errors.Is(err, syscall.ENOENT) {
		return nil
	} else if err != nil {
		return err
	}
	if err := os.Remove(p.snapPath(name)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("pool %s: %w", p.name, err)
	}
	return syncDir(filepath.Join(p.dir, snapDir))
}

// getMeta reads the JSON metadata in attribute attr of path into v.
func getMeta(path, attr string, v any) error {
	buf := make([]byte, 64<<10)
	n, err := unix.Getxattr(path, attr, buf)
	if err != nil {
		return err
	}
	return json.Unmarshal(buf[:n], v)
}

// SetLabels replaces volume name's labels, in one write of its
// metadata attribute.
func (p *Dir) SetLabels(name string, labels map[string]string) (v Volume, err error) {
	if err := CheckName(name); err != nil {
		return Volume{}, err
	}
	if err := checkLabels(labels); err != nil {
		return Volume{}, err
	}
	err = p.change(kindVolume, name, func() error {
		if v, err = p.read(name); err != nil {
			return err
		}
		f, err := os.OpenFile(v.Path, os.O_RDWR, 0)
		if err != nil {
			return fmt.Errorf("pool %s: %w", p.name, err)
		}
		defer f.Close()
		v.Labels = maps.Clone(labels)
		if err := setMeta(f, xattr, v); err != nil {
			return fmt.Errorf("pool %s: %w", p.name, err)
		}
		return f.Sync()
	})
	return v, err
}
