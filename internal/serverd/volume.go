// Volumes: made in a pool by name, each exported under its name;
// created, deleted and grown, each change under its name's lock and
// its intent in the state file before the pool is touched
// (docs/server.md, "Pools and volumes").

package serverd

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"sort"
	"strconv"
	"syscall"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/pool"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
)

// Volume states in the state file and the records: made and exported
// (""; "served" in records), being made or deleted (an intent written
// before the step, which a restart finishes), or missing from its pool.
const (
	intentCreate = "create"
	intentDelete = "delete"
)

// VolumeState is a volume as the state file keeps it: its pool, the
// rules of its export (grants included), and an intent if a change of
// it was under way.
type VolumeState struct {
	Name   string      `json:"name"`
	Pool   string      `json:"pool"`
	Intent string      `json:"intent,omitempty"`
	Export rnbd.Export `json:"export"`
	// CreateLabels are the labels a create under way asked for, shown
	// while the pool has nothing yet (a caller that looks for its name
	// meanwhile sees whose it is); gone once it is made.
	CreateLabels map[string]string `json:"create_labels,omitempty"`
}

// volume is a volume the daemon knows: its state, and why it is not
// served ("" if it is). Its fields are the daemon's stateMu's, and only
// a change holding the volume's name lock changes them.
type volume struct {
	VolumeState
	notServed string
}

// CrashEnv names a point of a volume change at which the daemon kills
// itself (SIGKILL), for the tests that prove a crash between the steps
// leaves what a restart and a retry finish (test/e2e, docs/testing.md).
const CrashEnv = "RNBD_TEST_CRASH_AT"

// crashPoint kills the daemon at point if CrashEnv names it.
func (d *Daemon) crashPoint(point string) {
	if d.crashAt == point {
		d.log.WithField("point", point).Warn(CrashEnv + ": killing the daemon here")
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is on its way
	}
}

// exportVolume exports a volume as made in its pool (pv), with rules e,
// and returns the export; one exported already is left as it is. It
// looks at the volume's path first (up to probeWait): the caller holds
// the volume's name lock, not the state lock.
func (d *Daemon) exportVolume(e rnbd.Export, pv pool.Volume) (rnbd.Export, error) {
	e.Name, e.Path = pv.Name, pv.Path
	for _, x := range d.rnbd.Exports() {
		if x.Name == e.Name {
			if x.Path != e.Path {
				return e, fmt.Errorf("export %s exists and is not this volume (%s): %w", e.Name, x.Path, syscall.EEXIST)
			}
			return x, nil
		}
	}
	looked := d.probe.look([]string{e.Path}, probeWait)
	if err := d.mapLooked(e, looked); err != nil {
		return e, err
	}
	return e, nil
}

// publishVolumeNames makes the names of the volumes what isVolume
// answers, without the state lock.
// +checklocks:d.stateMu
func (d *Daemon) publishVolumeNames() {
	names := make(map[string]bool, len(d.volumes))
	for n := range d.volumes {
		names[n] = true
	}
	d.volumeNames.Store(&names)
}

// volumeCount is the number of volumes the daemon knows.
func (d *Daemon) volumeCount() int {
	m := d.volumeNames.Load()
	if m == nil {
		return 0
	}
	return len(*m)
}

// isVolume reports whether export name is a volume's.
func (d *Daemon) isVolume(name string) bool {
	m := d.volumeNames.Load()
	return m != nil && (*m)[name]
}

// volumeStates is what saveState keeps of the volumes: each with its
// export's rules as served now (grants given since included).
// +checklocks:d.stateMu
func (d *Daemon) volumeStates(served map[string]rnbd.Export) []VolumeState {
	var out []VolumeState
	for _, v := range d.volumes {
		vs := v.VolumeState
		if e, ok := served[v.Name]; ok {
			vs.Export = e
		}
		out = append(out, vs)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// CreateVolume makes a volume and exports it, or answers the one of
// that name if it has the same pool and parameters (created false).
// The intent is in the state file before the pool is touched: a crash
// at any step leaves what a restart finishes or a retry completes. The
// volume's name (and its source's, for a clone) is held throughout: a
// second change of it waits (nameWait, ctx); the state lock only while
// the state changes, never across the pool's command or the look at the
// volume's path.
func (d *Daemon) CreateVolume(ctx context.Context, req api.VolumeRequest) (rec api.VolumeRecord, created bool, err error) {
	if err := pool.CheckName(req.Name); err != nil {
		return rec, false, err
	}
	keys := []string{volumeKey(req.Name)}
	switch {
	case req.FromVolume != "":
		keys = append(keys, volumeKey(req.FromVolume))
	case req.FromSnapshot != "":
		keys = append(keys, snapshotKey(req.FromSnapshot))
	}
	unlock, err := d.names.lock(ctx, d.nameWait, "create", keys...)
	if err != nil {
		return rec, false, err
	}
	defer unlock()
	d.stateMu.Lock()
	p, err := d.poolOf(req.Pool)
	d.stateMu.Unlock()
	if err != nil {
		return rec, false, err
	}
	if req.Size == "" && (req.FromVolume != "" || req.FromSnapshot != "") {
		n, err := sourceSize(p, req.FromVolume, req.FromSnapshot)
		if err != nil {
			return rec, false, err
		}
		req.Size = strconv.FormatInt(n, 10)
	}
	spec, e, err := parseVolume(req)
	if err != nil {
		return rec, false, err
	}
	v, fresh, err := d.createIntent(req.Name, req.Pool, e, req.Labels)
	if err != nil {
		return rec, false, err
	}
	d.crashPoint("volume-create-intent")
	d.stateMu.Lock()
	vs := v.VolumeState
	d.stateMu.Unlock()
	pv, created, err := p.Create(spec)
	if err != nil {
		if fresh {
			d.dropVolume(req.Name)
		}
		return rec, false, err
	}
	d.crashPoint("volume-create-made")
	e, err = d.exportVolume(vs.Export, pv)
	if err != nil {
		// The volume is made; a retry exports it.
		return rec, false, fmt.Errorf("volume %s made, but exporting it failed: %w", req.Name, err)
	}
	d.crashPoint("volume-create-exported")
	view := d.exportView()
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	v.Intent, v.notServed, v.Export, v.CreateLabels = "", "", e, nil
	if err := d.saveState(); err != nil {
		return rec, false, fmt.Errorf("volume %s made and exported, but saving the state file failed (a retry saves it): %w", req.Name, err)
	}
	if created {
		d.log.WithFields(log.Fields{"volume": pv.Name, "pool": pv.Pool, "size": pv.Size, "source": pv.Source,
			"source_snapshot": pv.SourceSnapshot, "path": pv.Path}).Info("volume created")
	}
	return volumeRecord(*v, &pv, view), created, nil
}

// createIntent is the first step of CreateVolume: the volume of that
// name, checked against the request and the other exports, or a new one
// with the intent create, saved. The name's lock is held.
// fresh is true where this call wrote the intent: only then is the
// volume forgotten if the pool then fails to make it (an intent of an
// earlier call may stand for a volume its pool has).
func (d *Daemon) createIntent(name, pname string, e rnbd.Export, labels map[string]string) (v *volume, fresh bool, err error) {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	if d.configured[name] || (d.volumes[name] == nil && (d.exported(name) || d.isUnrestored(name))) {
		return nil, false, ctl.Errorf(ctl.CodeExists, "an export %s exists that is not a volume", name)
	}
	v = d.volumes[name]
	switch {
	case v != nil && v.Pool != pname:
		return nil, false, ctl.Errorf(ctl.CodeExists, "volume %s exists in pool %s (asked %s)", name, v.Pool, pname)
	case v != nil && v.Intent == intentDelete:
		return nil, false, ctl.Errorf(ctl.CodeBusy, "volume %s is being deleted; delete it again to finish, then create it", name)
	case v != nil:
		return v, false, nil
	}
	v = &volume{VolumeState: VolumeState{Name: name, Pool: pname, Intent: intentCreate, Export: e, CreateLabels: maps.Clone(labels)}}
	d.volumes[name] = v
	d.publishVolumeNames()
	if err := d.saveState(); err != nil {
		delete(d.volumes, name)
		d.publishVolumeNames()
		return nil, false, fmt.Errorf("saving the state file: %w", err)
	}
	return v, true, nil
}

// dropVolume forgets a volume and saves the state; an error saving is
// logged (the volume is gone either way: a restart drops its record).
func (d *Daemon) dropVolume(name string) {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	delete(d.volumes, name)
	d.publishVolumeNames()
	if err := d.saveState(); err != nil {
		d.log.WithError(err).WithField("volume", name).Error("saving the state file failed")
	}
}

// isUnrestored reports whether the state file has an export of that name
// that is not served.
// +checklocks:d.stateMu
func (d *Daemon) isUnrestored(name string) bool {
	return slices.ContainsFunc(d.unrestored, func(e rnbd.Export) bool { return e.Name == name })
}

// exported reports whether an export of that name is served.
func (d *Daemon) exported(name string) bool {
	for _, e := range d.rnbd.Exports() {
		if e.Name == name {
			return true
		}
	}
	return false
}

// sourceSize is the size of the volume or snapshot a clone is made of:
// a clone's size where its request gives none.
func sourceSize(p pool.Pool, volume, snapshot string) (int64, error) {
	if volume != "" {
		v, err := p.Get(volume)
		if err != nil {
			return 0, fmt.Errorf("the volume to clone: %w", err)
		}
		return v.Size, nil
	}
	ss, err := p.Snapshots()
	if err != nil {
		return 0, err
	}
	for _, s := range ss {
		if s.Name == snapshot {
			return s.Size, nil
		}
	}
	return 0, ctl.Errorf(ctl.CodeNotFound, "no snapshot %s in pool %s", snapshot, p.Name())
}

// parseVolume checks a volume request: the pool's spec and the export's rules.
func parseVolume(req api.VolumeRequest) (pool.Spec, rnbd.Export, error) {
	size, err := units.ParseSize(req.Size)
	if err != nil {
		return pool.Spec{}, rnbd.Export{}, ctl.Errorf(ctl.CodeInvalid, "size %q: %v", req.Size, err)
	}
	spec := pool.Spec{Name: req.Name, Size: size, From: req.FromVolume, FromSnapshot: req.FromSnapshot, Labels: req.Labels}
	if err := pool.CheckSpec(spec); err != nil {
		return spec, rnbd.Export{}, err
	}
	if req.Export.Name != "" || req.Export.Path != "" {
		return spec, rnbd.Export{}, ctl.Errorf(ctl.CodeInvalid, "volume %s: the export's name and path are the volume's: leave them out", req.Name)
	}
	e, err := exportOf(req.Export)
	if err != nil {
		return spec, rnbd.Export{}, ctl.Errorf(ctl.CodeInvalid, "volume %s: %v", req.Name, err)
	}
	e.Name = req.Name
	return spec, e, nil
}

// DeleteVolume withdraws a volume's export and deletes it: refused
// while a session has it open, unless force (their IO then fails). A
// volume that is not there is success. Its name is held throughout
// (as CreateVolume's).
//
// ifLabels, if any, are labels the volume must have for the delete to
// go on (a caller that decided on what it read, as rnbd-csi's reclaim
// of an older copy): one that differs is busy, nothing deleted. They
// are compared with the name held, so no change of the labels comes
// between.
func (d *Daemon) DeleteVolume(ctx context.Context, name string, force bool, ifLabels map[string]string) (deleted bool, err error) {
	if err := pool.CheckName(name); err != nil {
		return false, err
	}
	unlock, err := d.names.lock(ctx, d.nameWait, "delete", volumeKey(name))
	if err != nil {
		return false, err
	}
	defer unlock()
	d.stateMu.Lock()
	v := d.volumes[name]
	if v == nil {
		d.stateMu.Unlock()
		return false, nil
	}
	p := d.pools[v.Pool]
	_, failed := d.poolErrs[v.Pool]
	if p == nil {
		defer d.stateMu.Unlock()
		if !failed {
			return true, d.forgetVolume(v)
		}
		return true, ctl.Errorf(ctl.CodeUnavailable, "volume %s: pool %s is not served: %s", name, v.Pool, d.poolReason(v.Pool))
	}
	pname := v.Pool
	d.stateMu.Unlock()

	if len(ifLabels) > 0 {
		pv, err := p.Get(name)
		if err != nil {
			return true, err
		}
		for _, k := range slices.Sorted(maps.Keys(ifLabels)) {
			if pv.Labels[k] != ifLabels[k] {
				return true, ctl.Errorf(ctl.CodeBusy, "volume %s: its label %s is %q, not %q as the delete asked (if_label): not deleted", name, k, pv.Labels[k], ifLabels[k])
			}
		}
	}
	if err := d.rnbd.Unmap(name, force); err != nil && !errors.Is(err, syscall.ENOENT) {
		return true, err // busy
	}
	d.crashPoint("volume-delete-unmapped")
	if err := d.setIntent(v, intentDelete); err != nil {
		return true, fmt.Errorf("volume %s withdrawn, but saving the state file failed (a retry deletes it): %w", name, err)
	}
	d.crashPoint("volume-delete-intent")
	if err := p.Delete(name); err != nil {
		d.stateMu.Lock()
		v.notServed = "an interrupted delete: " + err.Error()
		d.stateMu.Unlock()
		return true, fmt.Errorf("volume %s withdrawn, but deleting it failed (a retry deletes it): %w", name, err)
	}
	d.crashPoint("volume-delete-deleted")
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	delete(d.volumes, name)
	d.publishVolumeNames()
	if err := d.saveState(); err != nil {
		return true, fmt.Errorf("volume %s deleted, but saving the state file failed (a restart forgets it): %w", name, err)
	}
	d.log.WithFields(log.Fields{"volume": name, "pool": pname, "force": force}).Info("volume deleted")
	return true, nil
}

// setIntent writes a volume's intent to the state file.
func (d *Daemon) setIntent(v *volume, intent string) error {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	v.Intent = intent
	return d.saveState()
}

// forgetVolume forgets a volume whose pool left the configuration:
// nothing to delete it in; whatever the pool holds is left as it is.
// +checklocks:d.stateMu
func (d *Daemon) forgetVolume(v *volume) error {
	delete(d.volumes, v.Name)
	d.publishVolumeNames()
	if err := d.saveState(); err != nil {
		return fmt.Errorf("volume %s forgotten, but saving the state file failed: %w", v.Name, err)
	}
	d.log.WithFields(log.Fields{"volume": v.Name, "pool": v.Pool}).Warn("volume forgotten: its pool is no longer in the configuration (whatever it holds there is left as it is)")
	return nil
}

// ResizeVolume grows a volume, and its export: sessions that have it
// open learn the new size (at once for a file, within their size poll
// for a block device). Its name is held throughout.
func (d *Daemon) ResizeVolume(ctx context.Context, name string, size int64) (was int64, err error) {
	unlock, err := d.names.lock(ctx, d.nameWait, "resize", volumeKey(name))
	if err != nil {
		return 0, err
	}
	defer unlock()
	d.stateMu.Lock()
	v := d.volumes[name]
	if v == nil {
		d.stateMu.Unlock()
		return 0, ctl.Errorf(ctl.CodeNotFound, "no volume %s", name)
	}
	pname, served := v.Pool, v.notServed == ""
	p, err := d.poolOf(pname)
	d.stateMu.Unlock()
	if err != nil {
		return 0, err
	}
	old, err := p.Get(name)
	if err != nil {
		return 0, err
	}
	pv, err := p.Resize(name, size)
	if err != nil {
		return old.Size, err
	}
	if st, err := os.Stat(pv.Path); err == nil && st.Mode().IsRegular() && served {
		// Served at once to the sessions that have it open.
		if _, err := d.rnbd.Resize(name, size, false); err != nil {
			return old.Size, fmt.Errorf("volume %s grown, but telling its sessions failed (they learn it at their next open): %w", name, err)
		}
	}
	d.log.WithFields(log.Fields{"volume": name, "pool": pname, "was": old.Size, "now": size}).Info("volume resized")
	return old.Size, nil
}

// SetVolumeLabels replaces a volume's labels (the caller's, kept with
// it in its pool). Its name is held throughout, the state lock only to
// find its pool.
func (d *Daemon) SetVolumeLabels(ctx context.Context, name string, labels map[string]string) error {
	if err := pool.CheckName(name); err != nil {
		return err
	}
	unlock, err := d.names.lock(ctx, d.nameWait, "label", volumeKey(name))
	if err != nil {
		return err
	}
	defer unlock()
	d.stateMu.Lock()
	v := d.volumes[name]
	if v == nil {
		d.stateMu.Unlock()
		return ctl.Errorf(ctl.CodeNotFound, "no volume %s", name)
	}
	pname := v.Pool
	p, err := d.poolOf(pname)
	d.stateMu.Unlock()
	if err != nil {
		return err
	}
	if _, err := p.SetLabels(name, labels); err != nil {
		return err
	}
	d.log.WithFields(log.Fields{"volume": name, "pool": pname, "labels": len(labels)}).Info("volume labels set")
	return nil
}
