// Package pool keeps the volumes of a storage node by name: made, listed,
// grown, cloned and deleted, each with its metadata kept with it, so that
// the pool and not only the daemon's state file is the truth.
//
// This is the first of issue 33's pools, a directory pool: each volume is
// a sparse file NAME.img in the pool's directory, its metadata a JSON
// extended attribute (user.rnbd.volume) on the file, which moves with it.
// A volume is made under .rnbd-tmp/ and renamed into place only once it
// is whole, so a crash leaves either nothing or a whole volume; what a
// crash left in .rnbd-tmp/ is removed when the pool is opened. The daemon
// (export, grants, the control API) does not use it yet.
//
// A Dir is safe for concurrent use: its mu serialises the changes.
package pool

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Volume is a volume's metadata, as kept on it.
type Volume struct {
	Name string `json:"name"`
	Pool string `json:"pool"`
	// Size in bytes, a multiple of BlockSize.
	Size int64 `json:"size"`
	// Source is the volume this one was cloned from ("": made empty).
	Source  string    `json:"source,omitempty"`
	Created time.Time `json:"created"`
	// Labels are the caller's, opaque here (an orchestrator's context).
	Labels map[string]string `json:"labels,omitempty"`
	// Path is the volume's file, what an export serves.
	Path string `json:"-"`
}

// Spec asks for a volume.
type Spec struct {
	Name string
	Size int64
	// From, if set, is the volume to clone (a reflink: FICLONE).
	From   string
	Labels map[string]string
}

// Capacity is a pool's space in bytes. Allocatable is what new volumes
// may still be promised: the file system's free space less what the
// sparse volumes may still claim of it.
type Capacity struct {
	Total       int64 `json:"total"`
	Used        int64 `json:"used"`
	Promised    int64 `json:"promised"`
	Allocatable int64 `json:"allocatable"`
}

// BlockSize is what sizes are a multiple of.
const BlockSize = 4096

// Error is a refusal with the errno a control API classifies it by:
// EINVAL (bad input), ENOENT (no such volume), EEXIST (a volume of that
// name with other parameters), ENOSPC (over the allocatable space),
// EOPNOTSUPP (a clone where the file system has no reflinks).
type Error struct {
	Errno syscall.Errno
	Msg   string
}

func (e *Error) Error() string { return e.Msg }
func (e *Error) Unwrap() error { return e.Errno }

func errorf(errno syscall.Errno, format string, args ...any) error {
	return &Error{Errno: errno, Msg: fmt.Sprintf(format, args...)}
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,128}$`)

// CheckName refuses a volume name outside [A-Za-z0-9._-]{1,128}.
func CheckName(name string) error {
	if !nameRE.MatchString(name) {
		return errorf(syscall.EINVAL, "volume name %q: want 1 to 128 of A-Z a-z 0-9 . _ -", name)
	}
	return nil
}

const (
	suffix = ".img"
	tmpDir = ".rnbd-tmp" // no suffix: never a volume
	xattr  = "user.rnbd.volume"
)

// Dir is a directory pool.
type Dir struct {
	name, dir string
	now       func() time.Time
	mu        sync.Mutex // serialises Create, Resize, Delete
}

// OpenDir opens the directory pool name at dir, which must exist, and
// removes what a crash left half-made. It returns what it removed, for
// the caller to log.
func OpenDir(name, dir string) (*Dir, []string, error) {
	fi, err := os.Stat(dir)
	if err != nil {
		return nil, nil, errorf(syscall.ENOENT, "pool %s: %v", name, err)
	}
	if !fi.IsDir() {
		return nil, nil, errorf(syscall.ENOTDIR, "pool %s: %s is not a directory", name, dir)
	}
	p := &Dir{name: name, dir: dir, now: time.Now}
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

// Name is the pool's name.
func (p *Dir) Name() string { return p.name }

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
	buf := make([]byte, 64<<10)
	n, err := unix.Getxattr(path, xattr, buf)
	switch {
	case errors.Is(err, unix.ENOENT):
		return Volume{}, errorf(syscall.ENOENT, "pool %s: no volume %s", p.name, name)
	case errors.Is(err, unix.ENODATA):
		return Volume{}, errorf(syscall.ENOENT, "pool %s: %s is not a volume of the pool (no %s attribute)", p.name, path, xattr)
	case err != nil:
		return Volume{}, fmt.Errorf("pool %s: volume %s: %w", p.name, name, err)
	}
	var v Volume
	if err := json.Unmarshal(buf[:n], &v); err != nil {
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
	es, err := os.ReadDir(p.dir)
	if err != nil {
		return nil, fmt.Errorf("pool %s: %w", p.name, err)
	}
	var vs []Volume
	for _, e := range es {
		name, ok := strings.CutSuffix(e.Name(), suffix)
		if !ok || !e.Type().IsRegular() || CheckName(name) != nil {
			continue
		}
		v, err := p.read(name)
		if errors.Is(err, syscall.ENOENT) {
			continue
		}
		if err != nil {
			return nil, err
		}
		vs = append(vs, v)
	}
	sort.Slice(vs, func(i, j int) bool { return vs[i].Name < vs[j].Name })
	return vs, nil
}

// Capacity says the pool's space.
func (p *Dir) Capacity() (Capacity, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(p.dir, &st); err != nil {
		return Capacity{}, fmt.Errorf("pool %s: %w", p.name, err)
	}
	vs, err := p.List()
	if err != nil {
		return Capacity{}, err
	}
	c := Capacity{Total: int64(st.Blocks) * st.Bsize}
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

func checkSize(size int64) error {
	if size <= 0 || size%BlockSize != 0 {
		return errorf(syscall.EINVAL, "size %d: want a positive multiple of %d bytes", size, BlockSize)
	}
	return nil
}

// Create makes the volume s asks for, or answers the one of that name
// already there if it has the same size, source and labels (created
// false): a retry of a create succeeds. One with other parameters is
// EEXIST, saying what differs.
func (p *Dir) Create(s Spec) (v Volume, created bool, err error) {
	if err := CheckName(s.Name); err != nil {
		return Volume{}, false, err
	}
	if err := checkSize(s.Size); err != nil {
		return Volume{}, false, err
	}
	if s.From != "" {
		if err := CheckName(s.From); err != nil {
			return Volume{}, false, err
		}
	}
	if err := checkLabels(s.Labels); err != nil {
		return Volume{}, false, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if old, err := p.read(s.Name); err == nil {
		if diff := differs(old, s); diff != "" {
			return old, false, errorf(syscall.EEXIST, "pool %s: volume %s exists with %s", p.name, s.Name, diff)
		}
		return old, false, nil
	} else if !errors.Is(err, syscall.ENOENT) {
		return Volume{}, false, err
	}
	var src Volume
	if s.From != "" {
		if src, err = p.read(s.From); err != nil {
			return Volume{}, false, err
		}
		if s.Size < src.Size {
			return Volume{}, false, errorf(syscall.EINVAL, "pool %s: a clone of %s (%d bytes) cannot be smaller (%d)", p.name, s.From, src.Size, s.Size)
		}
	}
	c, err := p.Capacity()
	if err != nil {
		return Volume{}, false, err
	}
	if s.Size > c.Allocatable {
		return Volume{}, false, errorf(syscall.ENOSPC, "pool %s: %d bytes asked, %d allocatable", p.name, s.Size, c.Allocatable)
	}
	v = Volume{Name: s.Name, Pool: p.name, Size: s.Size, Source: s.From, Created: p.now().UTC().Truncate(time.Second),
		Labels: maps.Clone(s.Labels)}
	if err := p.make(v, src); err != nil {
		return Volume{}, false, err
	}
	v.Path = p.path(v.Name)
	return v, true, nil
}

// MaxLabelBytes bounds a volume's labels, keys and values together: the
// metadata is one extended attribute, and ext4 holds at most a block of
// them on a file.
const MaxLabelBytes = 2048

func checkLabels(l map[string]string) error {
	n := 0
	for k, v := range l {
		if k == "" {
			return errorf(syscall.EINVAL, "a label with an empty key")
		}
		n += len(k) + len(v)
	}
	if n > MaxLabelBytes {
		return errorf(syscall.EINVAL, "labels of %d bytes: at most %d (keys and values together)", n, MaxLabelBytes)
	}
	return nil
}

// differs says how an existing volume differs from a spec ("" if not).
func differs(v Volume, s Spec) string {
	var d []string
	if v.Size != s.Size {
		d = append(d, fmt.Sprintf("size %d (asked %d)", v.Size, s.Size))
	}
	if v.Source != s.From {
		d = append(d, fmt.Sprintf("source %q (asked %q)", v.Source, s.From))
	}
	if !maps.Equal(v.Labels, s.Labels) && (len(v.Labels) > 0 || len(s.Labels) > 0) {
		d = append(d, "other labels")
	}
	return strings.Join(d, ", ")
}

// make writes v under tmpDir — the clone of src's file if src is set —
// then renames it into place: whole, or not there at all.
func (p *Dir) make(v Volume, src Volume) (err error) {
	tmp := filepath.Join(p.dir, tmpDir, v.Name+suffix)
	os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("pool %s: %w", p.name, err)
	}
	defer func() {
		f.Close()
		if err != nil {
			os.Remove(tmp)
		}
	}()
	if src.Path != "" {
		s, err := os.Open(src.Path)
		if err != nil {
			return fmt.Errorf("pool %s: %w", p.name, err)
		}
		err = unix.IoctlFileClone(int(f.Fd()), int(s.Fd()))
		s.Close()
		if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EXDEV) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTTY) {
			return errorf(syscall.EOPNOTSUPP, "pool %s: cloning %s needs a file system with reflinks (FICLONE: %v); no full copy is made", p.name, src.Name, err)
		}
		if err != nil {
			return fmt.Errorf("pool %s: cloning %s: %w", p.name, src.Name, err)
		}
	}
	if err := f.Truncate(v.Size); err != nil {
		return fmt.Errorf("pool %s: %w", p.name, err)
	}
	if err := setMeta(f, v); err != nil {
		return fmt.Errorf("pool %s: %w", p.name, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("pool %s: %w", p.name, err)
	}
	if err := os.Rename(tmp, p.path(v.Name)); err != nil {
		return fmt.Errorf("pool %s: %w", p.name, err)
	}
	return syncDir(p.dir)
}

func setMeta(f *os.File, v Volume) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return unix.Fsetxattr(int(f.Fd()), xattr, b, 0)
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
func (p *Dir) Resize(name string, size int64) (Volume, error) {
	if err := CheckName(name); err != nil {
		return Volume{}, err
	}
	if err := checkSize(size); err != nil {
		return Volume{}, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
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
	c, err := p.Capacity()
	if err != nil {
		return v, err
	}
	if size-v.Size > c.Allocatable {
		return v, errorf(syscall.ENOSPC, "pool %s: %d more bytes asked, %d allocatable", p.name, size-v.Size, c.Allocatable)
	}
	f, err := os.OpenFile(v.Path, os.O_RDWR, 0)
	if err != nil {
		return v, fmt.Errorf("pool %s: %w", p.name, err)
	}
	defer f.Close()
	// The size in the metadata first: a crash between the two leaves a
	// volume its metadata calls larger, which a retry grows to it.
	grown := v
	grown.Size = size
	if err := setMeta(f, grown); err != nil {
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
	p.mu.Lock()
	defer p.mu.Unlock()
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
