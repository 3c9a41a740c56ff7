// Package pool keeps the volumes of a storage node by name: made, listed,
// grown, snapshotted, cloned and deleted, each with its metadata kept with
// it, so that the pool and not only the daemon's state file is the truth.
//
// Two kinds of pool implement Pool: Dir (sparse files under a directory,
// clones and snapshots by reflink) and LVMThin (thin volumes of an LVM
// thin pool, driven through lvm2's tools). Every change is idempotent by
// name, as an orchestrator that retries needs: a create of what exists
// with the same parameters answers it, a delete of what is gone succeeds,
// and a crash between the steps of a change leaves what a retry finishes.
// Pools are safe for concurrent use, changes of different names running
// at once (Pool says what is promised).
//
// The files: pool.go the interface, the records and the checks of
// names, sizes and labels; locks.go the lock of a name and the space
// reserved by the changes under way, which both pools use; dir.go the
// directory pool; lvm.go the LVM thin pool, lvm_tags.go its LV names
// and the metadata in LV tags, lvm_lvs.go what lvs reports and running
// lvm2's tools.
package pool

import (
	"fmt"
	"maps"
	"regexp"
	"strings"
	"syscall"
	"time"
)

// Pool is a place volumes are made in.
//
// Implementations are safe for concurrent use by several goroutines, and
// the caller need hold no lock of its own across a call. The changes of
// one name are serialised (Create, Resize and Delete of a volume;
// CreateSnapshot and DeleteSnapshot of a snapshot): two at once run one
// after the other and each answers as it would alone (a second Create
// of a name answers what the first made, created false). Changes of
// different names do not wait for each other in the pool (a create of
// v1 does not wait for the slow create of v2; an LVM thin pool's tools
// still take turns inside lvm2), and never promise together more space
// than they would one after the other. Reads (Get, List, Capacity,
// Snapshots) take no lock: they see a volume or snapshot made or not,
// never half-made (a growth under way shows the old size or the new).
// What spans more than one pool (a name used once across pools) or more
// than the pool (a volume's export) is the caller's to serialise.
type Pool interface {
	// Name is the pool's name in the configuration.
	Name() string
	// Type is "dir" or "lvm-thin".
	Type() string
	// Get returns a volume; ENOENT if there is none.
	Get(name string) (Volume, error)
	// List returns the pool's volumes, by name.
	List() ([]Volume, error)
	// Create makes the volume s asks for, or answers the one of that
	// name already there if it has the same parameters (created
	// false). One with other parameters is EEXIST, saying what differs.
	Create(s Spec) (v Volume, created bool, err error)
	// Resize grows a volume; smaller is EINVAL, the same size succeeds.
	Resize(name string, size int64) (Volume, error)
	// SetLabels replaces a volume's labels, at once (a crash leaves the
	// old or the new).
	SetLabels(name string, labels map[string]string) (Volume, error)
	// Delete removes a volume; one that is not there is success.
	// Whether a session has it open is the caller's to check.
	Delete(name string) error
	// Capacity says the pool's space.
	Capacity() (Capacity, error)
	// CreateSnapshot takes a snapshot of a volume, or answers the one
	// of that name if it is of the same volume (created false); of
	// another volume, EEXIST. Where the pool cannot take one without a
	// full copy, EOPNOTSUPP.
	CreateSnapshot(volume, name string, labels map[string]string) (s Snapshot, created bool, err error)
	// Snapshots returns the pool's snapshots, by name.
	Snapshots() ([]Snapshot, error)
	// DeleteSnapshot removes a snapshot; one that is not there is
	// success.
	DeleteSnapshot(name string) error
}

// Volume is a volume's metadata, as kept on it.
type Volume struct {
	Name string `json:"name"`
	Pool string `json:"pool"`
	// Size in bytes, a multiple of BlockSize.
	Size int64 `json:"size"`
	// Source is the volume this one was cloned from, SourceSnapshot the
	// snapshot ("" both: made empty).
	Source         string    `json:"source,omitempty"`
	SourceSnapshot string    `json:"source_snapshot,omitempty"`
	Created        time.Time `json:"created"`
	// Labels are the caller's, opaque here (an orchestrator's context).
	Labels map[string]string `json:"labels,omitempty"`
	// Path is the volume's file or block device, what an export serves.
	Path string `json:"-"`
}

// Snapshot is a snapshot's metadata: a read-only image of a volume at a
// moment, which volumes can be cloned from.
type Snapshot struct {
	Name string `json:"name"`
	Pool string `json:"pool"`
	// Volume is the volume it was taken of (which may be gone since).
	Volume  string    `json:"volume"`
	Size    int64     `json:"size"`
	Created time.Time `json:"created"`
	// Labels are the caller's, kept with the snapshot (rnbd-csi's
	// member labels of a replicated volume's snapshot).
	Labels map[string]string `json:"labels,omitempty"`
	Path   string            `json:"-"`
}

// Spec asks for a volume.
type Spec struct {
	Name string
	Size int64
	// From, if set, is the volume to clone; FromSnapshot the snapshot
	// (at most one of them).
	From         string
	FromSnapshot string
	Labels       map[string]string
}

// Capacity is a pool's space in bytes. Allocatable is what new volumes
// may still be promised: for a directory, the file system's free space
// less what the sparse volumes may still claim of it; for a thin pool,
// its data space less what its thin volumes may still claim. Metadata
// is a thin pool's metadata space (0 for a directory).
type Capacity struct {
	Total        int64 `json:"total"`
	Used         int64 `json:"used"`
	Promised     int64 `json:"promised"`
	Allocatable  int64 `json:"allocatable"`
	MetadataSize int64 `json:"metadata_size,omitempty"`
	MetadataUsed int64 `json:"metadata_used,omitempty"`
}

// BlockSize is what sizes are a multiple of.
const BlockSize = 4096

// Error is a refusal with the errno a control API classifies it by:
// EINVAL (bad input), ENOENT (no such volume or snapshot), EEXIST (one of
// that name with other parameters), ENOSPC (over the allocatable space, a
// full thin pool), EOPNOTSUPP (a clone or snapshot the pool cannot make
// without a full copy).
type Error struct {
	Errno syscall.Errno
	Msg   string
}

func (e *Error) Error() string { return e.Msg }
func (e *Error) Unwrap() error { return e.Errno }

func errorf(errno syscall.Errno, format string, args ...any) error {
	return &Error{Errno: errno, Msg: fmt.Sprintf(format, args...)}
}

// nameRule is CheckName's rule, as its refusals say it.
const nameRule = "want 1 to 128 of A-Z a-z 0-9 . _ -, not all dots, not beginning with -"

// nameRE is the alphabet and length of the names a pool keeps: each is
// a file name (NAME.img) and maps one to one onto an LV name.
var nameRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,128}$`)

// CheckName refuses a volume, snapshot or pool name that cannot be used
// as one everywhere it goes: a file name, an LV name, a segment of a URL
// path (/v1/volumes/NAME), an argument on a command line. A name is 1 to
// 128 of A-Z a-z 0-9 . _ - (no '/', '%', '?', '#', blank or control
// character, which a URL path would escape, split or end at), and
// neither
//
//   - made of dots only: "." and ".." are the dot-segments that
//     net/http's ServeMux (and every URL resolver) removes, so the API
//     could never address them; longer runs of dots are refused with
//     them, as no one means them for a name;
//   - begins with '-': a command line takes it for an option (a volume
//     named "-h" given to `volume delete` would print help and exit 0).
func CheckName(name string) error {
	if err := checkStored(name); err != nil {
		return err
	}
	switch {
	case strings.Trim(name, ".") == "":
		return errorf(syscall.EINVAL, "name %q: a URL path cannot carry a name of dots only (%s)", name, nameRule)
	case name[0] == '-':
		return errorf(syscall.EINVAL, "name %q: a command line would take a name beginning with - for an option (%s)", name, nameRule)
	}
	return nil
}

// checkStored refuses a name no pool could keep. A name it passes and
// CheckName refuses (of dots only, or beginning with '-') may still be
// on a volume made before CheckName refused it: such a volume is
// listed, so that it is seen, but cannot be changed by name.
func checkStored(name string) error {
	if !nameRE.MatchString(name) {
		return errorf(syscall.EINVAL, "name %q: %s", name, nameRule)
	}
	return nil
}

// CheckSpec refuses a spec with a bad name, size, source or labels.
func CheckSpec(s Spec) error {
	if err := CheckName(s.Name); err != nil {
		return err
	}
	if err := checkSize(s.Size); err != nil {
		return err
	}
	if s.From != "" && s.FromSnapshot != "" {
		return errorf(syscall.EINVAL, "volume %s: a clone of a volume or of a snapshot, not both", s.Name)
	}
	for _, src := range []string{s.From, s.FromSnapshot} {
		if src != "" {
			if err := CheckName(src); err != nil {
				return err
			}
		}
	}
	return checkLabels(s.Labels)
}

func checkSize(size int64) error {
	if size <= 0 || size%BlockSize != 0 {
		return errorf(syscall.EINVAL, "size %d: want a positive multiple of %d bytes", size, BlockSize)
	}
	return nil
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
		d = append(d, fmt.Sprintf("source volume %q (asked %q)", v.Source, s.From))
	}
	if v.SourceSnapshot != s.FromSnapshot {
		d = append(d, fmt.Sprintf("source snapshot %q (asked %q)", v.SourceSnapshot, s.FromSnapshot))
	}
	if !maps.Equal(v.Labels, s.Labels) && (len(v.Labels) > 0 || len(s.Labels) > 0) {
		d = append(d, "other labels")
	}
	return strings.Join(d, ", ")
}
