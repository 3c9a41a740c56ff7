// The LVM thin pool: each volume is a thin logical volume of an existing
// thin pool in a volume group, each snapshot a read-only thin snapshot,
// made and changed through lvm2's own tools (lvs, lvcreate, lvextend,
// lvchange, lvremove), never by writing LVM's metadata here.
//
// LV names and the metadata in LV tags are lvm_tags.go's; lvs's report
// and running lvm2's tools, lvm_lvs.go's.
//
// Capacity. Total is the thin pool's data size and Used its data in use
// (lvs data_percent, to 0.01%). Promised is what the writable thin LVs of
// the thin pool (ours and any other) may still claim: each one's size
// less what it maps (an inactive LV, whose mapping lvs cannot report,
// counts whole); read-only snapshots promise nothing. Blocks a clone
// shares with its source count as mapped, so after snapshots and clones
// Promised is a lower bound: that is the over-commit thin provisioning
// is for, and the high-water mark guards what is left. Allocatable is
// Total less Used and Promised. A thin pool whose data or metadata is at
// or over highWater percent refuses Create, Resize and CreateSnapshot
// (ENOSPC naming which is full), so LVM never reaches the point where a
// full pool stops writes to every volume in it.

package pool

import (
	"errors"
	"fmt"
	"maps"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// highWater is the percentage of a thin pool's data or metadata at
// which it counts as full.
const highWater = 95.0

// LVMThin is a pool of thin volumes in an LVM thin pool.
//
// Concurrency: an LVMThin is safe for concurrent use (the Pool
// interface says what that promises). names locks the name a change is
// of: the volume's for Create, Resize and Delete, the snapshot's for
// CreateSnapshot and DeleteSnapshot. The pool lets changes of different
// names run at once; lvm2 then runs them one after the other: each of
// its tools that changes a volume group holds the group's lock (a file
// lock under /run/lock/lvm) while it runs, and lvs waits for it, so a
// create of v1 waits in lvm2 for the lvcreate of v2 under way, and so
// does a Get or a List. space is held while a create or a growth runs
// lvs to count the thin pool and reserves what it needs (a clone or a
// snapshot does not lock its source: lvm2 finds it or not). Reads (Get,
// List, Capacity, Snapshots) take neither lock. Lock order: a name's
// lock, then space.
type LVMThin struct {
	name, vg, thin string
	now            func() time.Time
	names          nameLocks
	space          reservations
	// run runs one of lvm2's tools: runLVM, or a test's stand-in.
	run func(tool string, args ...string) ([]byte, error)
}

// OpenLVMThin opens the pool name on the thin pool thinPool of volume
// group vg, both of which must exist (ENOENT otherwise), activates the
// thin pool if it is not active (its usage is read from it), and removes
// what a crash left half-made. It returns what it removed, for the
// caller to log.
func OpenLVMThin(name, vg, thinPool string) (*LVMThin, []string, error) {
	return openLVMThin(name, vg, thinPool, runLVM)
}

func openLVMThin(name, vg, thinPool string, run func(tool string, args ...string) ([]byte, error)) (*LVMThin, []string, error) {
	if err := CheckName(name); err != nil {
		return nil, nil, err
	}
	p := &LVMThin{name: name, vg: vg, thin: thinPool, now: time.Now, run: run}
	for _, n := range []string{vg, thinPool} {
		if n == "" || validLVMName(n) != nil {
			return nil, nil, errorf(syscall.EINVAL, "pool %s: %q is not an LVM name", name, n)
		}
	}
	if n := dmNameLen(vg, lvName(vg, kindVolume, strings.Repeat("-", 128))); n > dmNameMax {
		return nil, nil, errorf(syscall.EINVAL, "pool %s: volume group name %q is too long to name the pool's LVs within LVM's %d bytes", name, vg, dmNameMax)
	}
	rows, err := p.scan()
	if err != nil {
		return nil, nil, err
	}
	tp, err := p.thinPoolRow(rows)
	if err != nil {
		return nil, nil, err
	}
	if !tp.active() {
		if _, err := p.lvm("lvchange", "-ay", p.vg+"/"+p.thin); err != nil {
			return nil, nil, fmt.Errorf("pool %s: activating thin pool %s/%s: %w", name, vg, thinPool, err)
		}
	}
	var removed []string
	for _, r := range rows {
		m, ok, err := p.ours(r)
		if err != nil || !ok || !r.incomplete() {
			continue
		}
		if _, err := p.lvm("lvremove", "-y", p.vg+"/"+r.Name); err != nil {
			return nil, nil, fmt.Errorf("pool %s: removing the half-made %s %s: %w", name, m.Kind, m.Name, err)
		}
		removed = append(removed, fmt.Sprintf("%s/%s (%s %s, half-made)", vg, r.Name, m.Kind, m.Name))
	}
	return p, removed, nil
}

// Name implements Pool.
func (p *LVMThin) Name() string { return p.name }

// Type implements Pool.
func (p *LVMThin) Type() string { return "lvm-thin" }

// ours reads an LV's metadata if it is a volume or snapshot of this
// pool: a thin LV of its thin pool with its tags naming it.
func (p *LVMThin) ours(r lvRow) (lvmMeta, bool, error) {
	if r.Segtype != "thin" || r.Pool != p.thin {
		return lvmMeta{}, false, nil
	}
	m, ok, err := decodeTags(r.Tags)
	if err != nil {
		return m, ok, fmt.Errorf("pool %s: LV %s/%s: its tags: %w", p.name, p.vg, r.Name, err)
	}
	if !ok || m.Pool != p.name || lvName(p.vg, m.Kind, m.Name) != r.Name {
		return m, false, nil
	}
	return m, true, nil
}

// find looks up the LV of a volume or snapshot: the LV's row (ok false
// if no LV has its name) and its metadata (mine false if the LV is not
// it).
type found struct {
	row  lvRow
	meta lvmMeta
	ok   bool // an LV of that name
	mine bool // and it is the volume or snapshot
}

func (p *LVMThin) find(rows []lvRow, kind, name string) (found, error) {
	lv := lvName(p.vg, kind, name)
	for _, r := range rows {
		if r.Name != lv {
			continue
		}
		m, mine, err := p.ours(r)
		if err != nil {
			return found{row: r, ok: true}, err
		}
		return found{row: r, meta: m, ok: true, mine: mine && m.Kind == kind && m.Name == name}, nil
	}
	return found{}, nil
}

func (p *LVMThin) devPath(lv string) string { return "/dev/" + p.vg + "/" + lv }

func (p *LVMThin) volume(m lvmMeta, lv string) Volume {
	return Volume{Name: m.Name, Pool: p.name, Size: m.Size, Source: m.Source, SourceSnapshot: m.SourceSnapshot,
		Created: m.Created, Labels: m.Labels, Path: p.devPath(lv)}
}

func (p *LVMThin) snapshot(m lvmMeta, lv string) Snapshot {
	return Snapshot{Name: m.Name, Pool: p.name, Volume: m.Volume, Size: m.Size, Created: m.Created, Labels: m.Labels, Path: p.devPath(lv)}
}

// get finds a whole volume or snapshot (ENOENT if there is none, or
// only a half-made one).
func (p *LVMThin) get(kind, name string) (found, error) {
	rows, err := p.scan()
	if err != nil {
		return found{}, err
	}
	f, err := p.find(rows, kind, name)
	if err != nil {
		return f, err
	}
	switch {
	case !f.ok || (f.mine && f.row.incomplete()):
		return f, errorf(syscall.ENOENT, "pool %s: no %s %s", p.name, kind, name)
	case !f.mine:
		return f, errorf(syscall.ENOENT, "pool %s: LV %s/%s is not %s %s of the pool (its tags do not say so)", p.name, p.vg, f.row.Name, kind, name)
	}
	return f, nil
}

// activate makes an LV's block device there (a restart of the node
// leaves LVs inactive unless the system activates them).
func (p *LVMThin) activate(r lvRow) error {
	if r.active() {
		return nil
	}
	if _, err := p.lvm("lvchange", "-ay", "-K", p.vg+"/"+r.Name); err != nil {
		return fmt.Errorf("pool %s: activating %s/%s: %w", p.name, p.vg, r.Name, err)
	}
	return nil
}

// Get returns the volume name, its block device active; ENOENT if there
// is none.
func (p *LVMThin) Get(name string) (Volume, error) {
	if err := CheckName(name); err != nil {
		return Volume{}, err
	}
	f, err := p.get(kindVolume, name)
	if err != nil {
		return Volume{}, err
	}
	if err := p.activate(f.row); err != nil {
		return Volume{}, err
	}
	return p.volume(f.meta, f.row.Name), nil
}

// List implements Pool. LVs that are not the pool's are left out; one
// whose tags are the pool's but damaged is an error naming it.
func (p *LVMThin) List() ([]Volume, error) {
	rows, err := p.scan()
	if err != nil {
		return nil, err
	}
	var vs []Volume
	for _, r := range rows {
		m, ok, err := p.ours(r)
		if err != nil {
			return nil, err
		}
		if ok && m.Kind == kindVolume && !r.incomplete() {
			vs = append(vs, p.volume(m, r.Name))
		}
	}
	sort.Slice(vs, func(i, j int) bool { return vs[i].Name < vs[j].Name })
	return vs, nil
}

// Capacity implements Pool (the file's comment says how it counts).
// Promised counts the space reserved by the creates and growths under
// way.
func (p *LVMThin) Capacity() (Capacity, error) {
	rows, err := p.scan()
	if err != nil {
		return Capacity{}, err
	}
	c, _, err := p.capacity(rows, p.space.held())
	return c, err
}

// capacity counts the space of the thin pool, reserved bytes promised
// besides what its LVs may still claim; full says which of its data or
// metadata is at the high-water mark ("" if neither).
func (p *LVMThin) capacity(rows []lvRow, reserved int64) (c Capacity, full string, err error) {
	tp, err := p.thinPoolRow(rows)
	if err != nil {
		return c, "", err
	}
	c.Total = tp.Size
	c.MetadataSize = tp.MetaSize
	c.Promised = reserved
	if tp.Data >= 0 {
		c.Used = int64(tp.Data * float64(tp.Size) / 100)
	}
	if tp.Meta >= 0 {
		c.MetadataUsed = int64(tp.Meta * float64(tp.MetaSize) / 100)
	}
	for _, r := range rows {
		if r.Segtype == "thin" && r.Pool == p.thin && r.writable() {
			c.Promised += max(r.Size-r.mapped(), 0)
		}
	}
	c.Allocatable = max(c.Total-c.Used-c.Promised, 0)
	switch {
	case tp.Data >= highWater:
		full = fmt.Sprintf("thin pool %s/%s is full: data %.2f%% used (at most %.0f%% before new volumes are refused)", p.vg, p.thin, tp.Data, highWater)
	case tp.Meta >= highWater:
		full = fmt.Sprintf("thin pool %s/%s is full: metadata %.2f%% used (at most %.0f%% before new volumes are refused)", p.vg, p.thin, tp.Meta, highWater)
	}
	return c, full, nil
}

// roundUp is size rounded up to the volume group's extents, as LVM
// makes it.
func roundUp(size, extent int64) int64 {
	if extent <= 0 {
		return size
	}
	return (size + extent - 1) / extent * extent
}

// Create implements Pool. A clone (Spec.From, Spec.FromSnapshot) is a
// writable thin snapshot of its source, grown to the size asked.
func (p *LVMThin) Create(s Spec) (v Volume, created bool, err error) {
	if err := CheckSpec(s); err != nil {
		return Volume{}, false, err
	}
	err = p.names.with(lockKey(kindVolume, s.Name), func() error {
		v, created, err = p.create(s)
		return err
	})
	return v, created, err
}

// createPlan is what a Create found in the thin pool: the volume there
// already (have), or the source of the clone to make (src; none for an
// empty volume).
type createPlan struct {
	have found
	src  lvRow
}

func (p *LVMThin) create(s Spec) (Volume, bool, error) {
	lv := lvName(p.vg, kindVolume, s.Name)
	var plan createPlan
	release, err := p.space.take(func(reserved int64) (int64, error) {
		var need int64
		var err error
		plan, need, err = p.planCreate(s, reserved)
		return need, err
	})
	if plan.have.ok {
		v := p.volume(plan.have.meta, lv)
		if err != nil {
			return v, false, err
		}
		release()
		return v, false, p.activate(plan.have.row)
	}
	if err != nil {
		return Volume{}, false, err
	}
	defer release()
	m := lvmMeta{Kind: kindVolume, Name: s.Name, Pool: p.name, Size: s.Size, Source: s.From, SourceSnapshot: s.FromSnapshot,
		Created: p.now().UTC().Truncate(time.Second), Labels: maps.Clone(s.Labels)}
	tags, err := encodeTags(m)
	if err != nil {
		return Volume{}, false, err
	}
	src := plan.src
	if src.Name == "" {
		args := []string{"-y", "--type", "thin", "--thinpool", p.thin, "-V", strconv.FormatInt(s.Size, 10) + "b", "-n", lv}
		args = append(append(args, tagArgs("--addtag", tags)...), p.vg)
		if _, err := p.lvm("lvcreate", args...); err != nil {
			return Volume{}, false, p.createError(s.Name, err)
		}
		return p.volume(m, lv), true, nil
	}
	grow := s.Size > src.Size
	if grow {
		tags = append(tags, tagIncomplete)
	}
	args := []string{"-y", "-s", "-kn", "-ay", "-prw", "-n", lv}
	args = append(append(args, tagArgs("--addtag", tags)...), p.vg+"/"+src.Name)
	if _, err := p.lvm("lvcreate", args...); err != nil {
		return Volume{}, false, p.createError(s.Name, err)
	}
	if grow {
		if _, err := p.lvm("lvextend", "-y", "-L", strconv.FormatInt(s.Size, 10)+"b", p.vg+"/"+lv); err != nil {
			return Volume{}, false, fmt.Errorf("pool %s: growing the clone %s (left half-made, removed by a retry): %w", p.name, s.Name, err)
		}
		if _, err := p.lvm("lvchange", "--deltag", tagIncomplete, p.vg+"/"+lv); err != nil {
			return Volume{}, false, fmt.Errorf("pool %s: the clone %s (left half-made, removed by a retry): %w", p.name, s.Name, err)
		}
	}
	return p.volume(m, lv), true, nil
}

// planCreate looks at the thin pool for a Create: the volume there
// already (plan.have.ok: with other parameters, EEXIST), or what the new
// one needs of the allocatable space, of which reserved is held by the
// changes under way. A half-made volume of the name is removed first.
func (p *LVMThin) planCreate(s Spec, reserved int64) (plan createPlan, need int64, err error) {
	rows, err := p.scan()
	if err != nil {
		return plan, 0, err
	}
	f, err := p.find(rows, kindVolume, s.Name)
	if err != nil {
		return plan, 0, err
	}
	lv := lvName(p.vg, kindVolume, s.Name)
	switch {
	case f.ok && !f.mine:
		return plan, 0, errorf(syscall.EEXIST, "pool %s: volume %s would be LV %s/%s, which is there and is not the pool's", p.name, s.Name, p.vg, lv)
	case f.ok && f.row.incomplete():
		// A clone a crash left half-made: made again from the start.
		if _, err := p.lvm("lvremove", "-y", p.vg+"/"+lv); err != nil {
			return plan, 0, fmt.Errorf("pool %s: removing the half-made volume %s: %w", p.name, s.Name, err)
		}
		if rows, err = p.scan(); err != nil {
			return plan, 0, err
		}
	case f.ok:
		plan.have = f
		if diff := differs(p.volume(f.meta, lv), s); diff != "" {
			return plan, 0, errorf(syscall.EEXIST, "pool %s: volume %s exists with %s", p.name, s.Name, diff)
		}
		return plan, 0, nil
	}
	switch {
	case s.From != "":
		from, err := p.find(rows, kindVolume, s.From)
		if err != nil {
			return plan, 0, err
		}
		if !from.mine || from.row.incomplete() {
			return plan, 0, errorf(syscall.ENOENT, "pool %s: no volume %s to clone", p.name, s.From)
		}
		if s.Size < from.meta.Size {
			return plan, 0, errorf(syscall.EINVAL, "pool %s: a clone of %s (%d bytes) cannot be smaller (%d)", p.name, s.From, from.meta.Size, s.Size)
		}
		plan.src = from.row
	case s.FromSnapshot != "":
		from, err := p.find(rows, kindSnapshot, s.FromSnapshot)
		if err != nil {
			return plan, 0, err
		}
		if !from.mine {
			return plan, 0, errorf(syscall.ENOENT, "pool %s: no snapshot %s to clone", p.name, s.FromSnapshot)
		}
		if s.Size < from.meta.Size {
			return plan, 0, errorf(syscall.EINVAL, "pool %s: a clone of snapshot %s (%d bytes) cannot be smaller (%d)", p.name, s.FromSnapshot, from.meta.Size, s.Size)
		}
		plan.src = from.row
	}
	c, full, err := p.capacity(rows, reserved)
	if err != nil {
		return plan, 0, err
	}
	if full != "" {
		return plan, 0, errorf(syscall.ENOSPC, "pool %s: %s", p.name, full)
	}
	// What the new LV promises: its size, less what a clone maps from
	// its source from the start.
	need = max(roundUp(s.Size, extentOf(rows, p.thin))-plan.src.mapped(), 0)
	if need > c.Allocatable {
		return plan, 0, errorf(syscall.ENOSPC, "pool %s: %d bytes asked, %d allocatable in thin pool %s/%s", p.name, s.Size, c.Allocatable, p.vg, p.thin)
	}
	return plan, need, nil
}

// createError classifies a failed lvcreate: LVM's own refusal for
// space is ENOSPC.
func (p *LVMThin) createError(name string, err error) error {
	var te *toolError
	if errors.As(err, &te) && (strings.Contains(te.stderr, "nsufficient") || strings.Contains(te.stderr, "threshold")) {
		return errorf(syscall.ENOSPC, "pool %s: volume %s: %s", p.name, name, te.stderr)
	}
	return fmt.Errorf("pool %s: volume %s: %w", p.name, name, err)
}

// Resize grows volume name to size; smaller is EINVAL, the same size
// succeeds. The LV is grown first (lvextend), the size in its tags then:
// a crash between the two leaves an LV larger than its metadata says,
// which a retry finds grown and only records.
func (p *LVMThin) Resize(name string, size int64) (v Volume, err error) {
	if err := CheckName(name); err != nil {
		return Volume{}, err
	}
	if err := checkSize(size); err != nil {
		return Volume{}, err
	}
	err = p.names.with(lockKey(kindVolume, name), func() error {
		v, err = p.resize(name, size)
		return err
	})
	return v, err
}

func (p *LVMThin) resize(name string, size int64) (Volume, error) {
	f, err := p.get(kindVolume, name)
	if err != nil {
		return Volume{}, err
	}
	v := p.volume(f.meta, f.row.Name)
	if f.row.Size < v.Size {
		// Only a tool outside the pool makes this (lvreduce): the
		// metadata is the truth.
		if _, err := p.lvm("lvextend", "-y", "-L", strconv.FormatInt(v.Size, 10)+"b", p.vg+"/"+f.row.Name); err != nil {
			return v, fmt.Errorf("pool %s: growing %s back to %d bytes: %w", p.name, name, v.Size, err)
		}
	}
	switch {
	case size == v.Size:
		return v, nil
	case size < v.Size:
		return v, errorf(syscall.EINVAL, "pool %s: volume %s is %d bytes: a volume grows only (asked %d)", p.name, name, v.Size, size)
	}
	if f.row.Size < size {
		release, err := p.space.take(func(reserved int64) (int64, error) {
			rows, err := p.scan()
			if err != nil {
				return 0, err
			}
			c, full, err := p.capacity(rows, reserved)
			if err != nil {
				return 0, err
			}
			if full != "" {
				return 0, errorf(syscall.ENOSPC, "pool %s: %s", p.name, full)
			}
			more := roundUp(size, f.row.Extent) - f.row.Size
			if more > c.Allocatable {
				return 0, errorf(syscall.ENOSPC, "pool %s: %d more bytes asked, %d allocatable in thin pool %s/%s", p.name, more, c.Allocatable, p.vg, p.thin)
			}
			return more, nil
		})
		if err != nil {
			return v, err
		}
		defer release()
		if _, err := p.lvm("lvextend", "-y", "-L", strconv.FormatInt(size, 10)+"b", p.vg+"/"+f.row.Name); err != nil {
			return v, fmt.Errorf("pool %s: growing %s: %w", p.name, name, err)
		}
	}
	grown := f.meta
	grown.Size = size
	if err := p.retag(f.row, grown); err != nil {
		return v, err
	}
	v.Size = size
	return v, nil
}

// retag replaces the metadata in an LV's tags, in one lvchange (one
// commit of LVM's metadata): tags that stay are not touched.
func (p *LVMThin) retag(r lvRow, m lvmMeta) error {
	tags, err := encodeTags(m)
	if err != nil {
		return err
	}
	keep := map[string]bool{}
	for _, t := range tags {
		keep[t] = true
	}
	var args []string
	for _, t := range r.Tags {
		if strings.HasPrefix(t, tagPrefix) && t != tagIncomplete && !keep[t] {
			args = append(args, "--deltag", t)
		}
		delete(keep, t)
	}
	for _, t := range tags {
		if keep[t] {
			args = append(args, "--addtag", t)
		}
	}
	if len(args) == 0 {
		return nil
	}
	if _, err := p.lvm("lvchange", append(args, p.vg+"/"+r.Name)...); err != nil {
		return fmt.Errorf("pool %s: the metadata of %s: %w", p.name, m.Name, err)
	}
	return nil
}

// Delete removes volume name; one that is not there is success. An LV
// of its name that is not the pool's is not removed (ENOENT).
func (p *LVMThin) Delete(name string) error {
	if err := CheckName(name); err != nil {
		return err
	}
	return p.remove(kindVolume, name)
}

func (p *LVMThin) remove(kind, name string) error {
	return p.names.with(lockKey(kind, name), func() error { return p.removeLV(kind, name) })
}

func (p *LVMThin) removeLV(kind, name string) error {
	rows, err := p.scan()
	if err != nil {
		return err
	}
	f, err := p.find(rows, kind, name)
	switch {
	case err != nil:
		return err
	case !f.ok:
		return nil
	case !f.mine:
		return errorf(syscall.ENOENT, "pool %s: LV %s/%s is not %s %s of the pool (its tags do not say so): not removed", p.name, p.vg, f.row.Name, kind, name)
	}
	if _, err := p.lvm("lvremove", "-y", p.vg+"/"+f.row.Name); err != nil {
		return fmt.Errorf("pool %s: removing %s %s: %w", p.name, kind, name, err)
	}
	return nil
}

// CreateSnapshot implements Pool: a read-only thin snapshot of the
// volume's LV, activated (without LVM's activation-skip flag, which
// thin snapshots otherwise get).
func (p *LVMThin) CreateSnapshot(volume, name string, labels map[string]string) (s Snapshot, created bool, err error) {
	for _, n := range []string{volume, name} {
		if err := CheckName(n); err != nil {
			return Snapshot{}, false, err
		}
	}
	if err := checkLabels(labels); err != nil {
		return Snapshot{}, false, err
	}
	err = p.names.with(lockKey(kindSnapshot, name), func() error {
		s, created, err = p.createSnapshot(volume, name, labels)
		return err
	})
	return s, created, err
}

func (p *LVMThin) createSnapshot(volume, name string, labels map[string]string) (Snapshot, bool, error) {
	rows, err := p.scan()
	if err != nil {
		return Snapshot{}, false, err
	}
	f, err := p.find(rows, kindSnapshot, name)
	if err != nil {
		return Snapshot{}, false, err
	}
	lv := lvName(p.vg, kindSnapshot, name)
	switch {
	case f.ok && !f.mine:
		return Snapshot{}, false, errorf(syscall.EEXIST, "pool %s: snapshot %s would be LV %s/%s, which is there and is not the pool's", p.name, name, p.vg, lv)
	case f.ok:
		s := p.snapshot(f.meta, lv)
		if s.Volume != volume {
			return s, false, errorf(syscall.EEXIST, "pool %s: snapshot %s exists, of volume %s (asked %s)", p.name, name, s.Volume, volume)
		}
		return s, false, p.activate(f.row)
	}
	v, err := p.find(rows, kindVolume, volume)
	if err != nil {
		return Snapshot{}, false, err
	}
	if !v.mine || v.row.incomplete() {
		return Snapshot{}, false, errorf(syscall.ENOENT, "pool %s: no volume %s", p.name, volume)
	}
	if _, full, err := p.capacity(rows, 0); err != nil {
		return Snapshot{}, false, err
	} else if full != "" {
		return Snapshot{}, false, errorf(syscall.ENOSPC, "pool %s: %s", p.name, full)
	}
	m := lvmMeta{Kind: kindSnapshot, Name: name, Pool: p.name, Volume: volume, Size: v.meta.Size, Created: p.now().UTC().Truncate(time.Second),
		Labels: maps.Clone(labels)}
	tags, err := encodeTags(m)
	if err != nil {
		return Snapshot{}, false, err
	}
	args := []string{"-y", "-s", "-kn", "-ay", "-pr", "-n", lv}
	args = append(append(args, tagArgs("--addtag", tags)...), p.vg+"/"+v.row.Name)
	if _, err := p.lvm("lvcreate", args...); err != nil {
		return Snapshot{}, false, fmt.Errorf("pool %s: snapshot %s of %s: %w", p.name, name, volume, err)
	}
	return p.snapshot(m, lv), true, nil
}

// Snapshots implements Pool.
func (p *LVMThin) Snapshots() ([]Snapshot, error) {
	rows, err := p.scan()
	if err != nil {
		return nil, err
	}
	var ss []Snapshot
	for _, r := range rows {
		m, ok, err := p.ours(r)
		if err != nil {
			return nil, err
		}
		if ok && m.Kind == kindSnapshot && !r.incomplete() {
			ss = append(ss, p.snapshot(m, r.Name))
		}
	}
	sort.Slice(ss, func(i, j int) bool { return ss[i].Name < ss[j].Name })
	return ss, nil
}

// DeleteSnapshot implements Pool.
func (p *LVMThin) DeleteSnapshot(name string) error {
	if err := CheckName(name); err != nil {
		return err
	}
	return p.remove(kindSnapshot, name)
}

var _ Pool = (*LVMThin)(nil)

// SetLabels replaces volume name's labels: its LV retagged in one
// lvchange.
func (p *LVMThin) SetLabels(name string, labels map[string]string) (v Volume, err error) {
	if err := CheckName(name); err != nil {
		return Volume{}, err
	}
	if err := checkLabels(labels); err != nil {
		return Volume{}, err
	}
	err = p.names.with(lockKey(kindVolume, name), func() error {
		f, err := p.get(kindVolume, name)
		if err != nil {
			return err
		}
		m := f.meta
		m.Labels = maps.Clone(labels)
		v = p.volume(f.meta, f.row.Name)
		if err := p.retag(f.row, m); err != nil {
			return err
		}
		v = p.volume(m, f.row.Name)
		return nil
	})
	return v, err
}
