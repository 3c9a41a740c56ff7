// Pools and volumes: the [[pool]] tables, the volumes made in them by
// name, each exported under its name (docs/server.md, "Pools and
// volumes").

package serverd

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/pool"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
)

// PoolConfig is a [[pool]] table.
type PoolConfig struct {
	Name string `toml:"name"`
	// Type is "dir" (sparse files under Path) or "lvm-thin" (thin
	// volumes of ThinPool in VolumeGroup).
	Type string `toml:"type"`
	Path string `toml:"path"`
	// Mountpoint: a dir pool's path must be a mount point (pool.DirOptions).
	Mountpoint  bool   `toml:"mountpoint"`
	VolumeGroup string `toml:"volume_group"`
	ThinPool    string `toml:"thin_pool"`
}

// validate checks a [[pool]] table's keys (not that its directory or
// volume group is there: that is found at start, and a pool that is not
// there is not served until it is).
func (c PoolConfig) validate() error {
	if err := pool.CheckName(c.Name); err != nil {
		return fmt.Errorf("[[pool]] %q: %v", c.Name, err)
	}
	switch c.Type {
	case "dir":
		if c.Path == "" || c.VolumeGroup != "" || c.ThinPool != "" {
			return fmt.Errorf("[[pool]] %s: type dir takes path (and not volume_group nor thin_pool)", c.Name)
		}
	case "lvm-thin":
		if c.Path != "" || c.Mountpoint || c.VolumeGroup == "" || c.ThinPool == "" {
			return fmt.Errorf("[[pool]] %s: type lvm-thin takes volume_group and thin_pool (and not path nor mountpoint)", c.Name)
		}
	default:
		return fmt.Errorf("[[pool]] %s: type %q: want dir or lvm-thin", c.Name, c.Type)
	}
	return nil
}

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
}

// volume is a volume the daemon knows: its state, and why it is not
// served ("" if it is).
type volume struct {
	VolumeState
	notServed string
}

// openPools opens the configuration's pools; one that cannot be opened
// is logged and kept out (its volumes are not served), the others are
// served. Start calls it before d is shared.
// +checklocksignore: d is not shared yet (Start)
func (d *Daemon) openPools(cfgs []PoolConfig) {
	d.pools, d.poolErrs = map[string]pool.Pool{}, map[string]string{}
	for _, c := range cfgs {
		var p pool.Pool
		var cleaned []string
		var err error
		switch c.Type {
		case "dir":
			p, cleaned, err = pool.OpenDir(c.Name, c.Path, pool.DirOptions{Mountpoint: c.Mountpoint})
		case "lvm-thin":
			p, cleaned, err = pool.OpenLVMThin(c.Name, c.VolumeGroup, c.ThinPool)
		}
		if err != nil {
			d.poolErrs[c.Name] = err.Error()
			d.log.WithError(err).WithField("pool", c.Name).Error("pool not served: its volumes are not served until a restart finds it")
			continue
		}
		for _, x := range cleaned {
			d.log.WithFields(log.Fields{"pool": c.Name, "removed": x}).Warn("pool: removed what an interrupted change left half-made")
		}
		d.pools[c.Name] = p
	}
}

// reconcileVolumes makes the state file's volumes and the pools' agree
// at start: an interrupted create or delete is finished, a volume of a
// pool the state file does not know is adopted (exported with no grant:
// no client may open it until one is given), and one the state file
// knows that its pool lost is kept, not served, until deleted. Each is
// logged. Start calls it before d is shared.
// It saves the state file if anything changed.
// +checklocksignore: d is not shared yet (Start)
func (d *Daemon) reconcileVolumes(saved []VolumeState) {
	changed := false
	defer func() {
		if !changed {
			return
		}
		if err := d.saveState(); err != nil {
			d.log.WithError(err).Error("saving the state file after reconciling the volumes failed")
		}
	}()
	d.volumes = map[string]*volume{}
	for _, vs := range saved {
		v := &volume{VolumeState: vs}
		fields := log.Fields{"volume": vs.Name, "pool": vs.Pool}
		p := d.pools[vs.Pool]
		if p == nil {
			v.notServed = "pool " + vs.Pool + " is not served: " + d.poolReason(vs.Pool)
			d.volumes[vs.Name] = v
			d.log.WithFields(fields).Error("volume not served: " + v.notServed)
			continue
		}
		switch vs.Intent {
		case intentDelete:
			if err := p.Delete(vs.Name); err != nil {
				v.notServed = "an interrupted delete could not be finished: " + err.Error()
				d.volumes[vs.Name] = v
				d.log.WithError(err).WithFields(fields).Error("finishing an interrupted delete of a volume failed; delete it again")
				continue
			}
			d.log.WithFields(fields).Info("volume: an interrupted delete finished")
			changed = true
			continue
		case intentCreate:
			if _, err := p.Get(vs.Name); errors.Is(err, syscall.ENOENT) {
				d.log.WithFields(fields).Info("volume: an interrupted create had made nothing; dropped (a retry makes it)")
				changed = true
				continue
			}
			v.Intent, changed = "", true
			d.log.WithFields(fields).Info("volume: an interrupted create finished")
		}
		d.volumes[vs.Name] = v
	}
	for name, p := range d.pools {
		vs, err := p.List()
		if err != nil {
			d.log.WithError(err).WithField("pool", name).Error("listing a pool's volumes failed")
			continue
		}
		for _, pv := range vs {
			if old := d.volumes[pv.Name]; old != nil {
				if old.Pool != name {
					d.log.WithFields(log.Fields{"volume": pv.Name, "pool": name, "kept": old.Pool}).Error("a volume of this name is in two pools: this one is not served")
				}
				continue
			}
			d.volumes[pv.Name] = &volume{VolumeState: VolumeState{Name: pv.Name, Pool: name,
				Export: rnbd.Export{Name: pv.Name, Path: pv.Path, GrantsOnly: true}}}
			changed = true
			d.log.WithFields(log.Fields{"volume": pv.Name, "pool": name}).Warn("volume adopted: its pool has it and the state file did not; exported with no grant (give one to open it)")
		}
	}
	for _, v := range d.volumes {
		if v.notServed != "" {
			continue
		}
		pv, err := d.pools[v.Pool].Get(v.Name)
		if err != nil {
			v.notServed = "missing from pool " + v.Pool + ": " + err.Error()
			d.log.WithError(err).WithFields(log.Fields{"volume": v.Name, "pool": v.Pool}).Error("volume missing from its pool: not served (volume delete forgets it)")
			continue
		}
		if err := d.exportVolume(v, pv); err != nil {
			v.notServed = err.Error()
			d.log.WithError(err).WithFields(log.Fields{"volume": v.Name, "pool": v.Pool}).Error("volume not served")
		}
	}
	d.publishVolumeNames()
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

// poolReason says why a pool is not served.
// +checklocksignore: poolErrs is set at start and only read after
func (d *Daemon) poolReason(name string) string {
	if r, ok := d.poolErrs[name]; ok {
		return r
	}
	return "not in the configuration"
}

// exportVolume exports volume v as made in its pool (pv), with its
// rules; one exported already is left as it is.
func (d *Daemon) exportVolume(v *volume, pv pool.Volume) error {
	e := v.Export
	e.Name, e.Path = v.Name, pv.Path
	for _, x := range d.rnbd.Exports() {
		if x.Name == e.Name {
			if x.Path != e.Path {
				return fmt.Errorf("export %s exists and is not this volume (%s): %w", e.Name, x.Path, syscall.EEXIST)
			}
			return nil
		}
	}
	looked := d.probe.look([]string{e.Path}, probeWait)
	if err := d.mapLooked(e, looked); err != nil {
		return err
	}
	v.Export = e
	return nil
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

// volumeState is what saveState keeps of the volumes: each with its
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

// poolOf returns pool name, or why there is none to use.
func (d *Daemon) poolOf(name string) (pool.Pool, error) {
	if p := d.pools[name]; p != nil {
		return p, nil
	}
	if _, ok := d.poolErrs[name]; ok {
		return nil, ctl.Errorf(ctl.CodeUnavailable, "pool %s is not served: %s", name, d.poolReason(name))
	}
	return nil, ctl.Errorf(ctl.CodeNotFound, "no pool %s (pools: %s)", name, d.poolNames())
}

func (d *Daemon) poolNames() string {
	var names []string
	for _, c := range d.cfg.Pools {
		names = append(names, c.Name)
	}
	if len(names) == 0 {
		return "none configured: add a [[pool]] table"
	}
	return strings.Join(names, ", ")
}

// CreateVolume makes a volume and exports it, or answers the one of
// that name if it has the same pool and parameters (created false).
// The intent is in the state file before the pool is touched: a crash
// at any step leaves what a restart finishes or a retry completes.
func (d *Daemon) CreateVolume(req api.VolumeRequest) (rec api.VolumeRecord, created bool, err error) {
	p, err := d.poolOf(req.Pool)
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
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	if d.configured[req.Name] || (!d.hasVolume(req.Name) && (d.exported(req.Name) || d.isUnrestored(req.Name))) {
		return rec, false, ctl.Errorf(ctl.CodeExists, "an export %s exists that is not a volume", req.Name)
	}
	v := d.volumes[req.Name]
	switch {
	case v != nil && v.Pool != req.Pool:
		return rec, false, ctl.Errorf(ctl.CodeExists, "volume %s exists in pool %s (asked %s)", req.Name, v.Pool, req.Pool)
	case v != nil && v.Intent == intentDelete:
		return rec, false, ctl.Errorf(ctl.CodeBusy, "volume %s is being deleted; delete it again to finish, then create it", req.Name)
	case v == nil:
		v = &volume{VolumeState: VolumeState{Name: req.Name, Pool: req.Pool, Intent: intentCreate, Export: e}}
		d.volumes[req.Name] = v
		d.publishVolumeNames()
		if err := d.saveState(); err != nil {
			delete(d.volumes, req.Name)
			d.publishVolumeNames()
			return rec, false, fmt.Errorf("saving the state file: %w", err)
		}
	}
	d.crashPoint("volume-create-intent")
	pv, created, err := p.Create(spec)
	if err != nil {
		if v.Intent == intentCreate {
			d.dropVolume(v.Name)
		}
		return rec, false, err
	}
	d.crashPoint("volume-create-made")
	if err := d.exportVolume(v, pv); err != nil {
		// The volume is made; a retry exports it.
		return rec, false, fmt.Errorf("volume %s made, but exporting it failed: %w", req.Name, err)
	}
	d.crashPoint("volume-create-exported")
	v.Intent, v.notServed = "", ""
	if err := d.saveState(); err != nil {
		return rec, false, fmt.Errorf("volume %s made and exported, but saving the state file failed (a retry saves it): %w", req.Name, err)
	}
	if created {
		d.log.WithFields(log.Fields{"volume": pv.Name, "pool": pv.Pool, "size": pv.Size, "source": pv.Source,
			"source_snapshot": pv.SourceSnapshot, "path": pv.Path}).Info("volume created")
	}
	return d.volumeRecord(v, &pv, d.exportView()), created, nil
}

// dropVolume forgets a volume and saves the state; an error saving is
// logged (the volume is gone either way: a restart drops its record).
// +checklocks:d.stateMu
func (d *Daemon) dropVolume(name string) {
	delete(d.volumes, name)
	d.publishVolumeNames()
	if err := d.saveState(); err != nil {
		d.log.WithError(err).WithField("volume", name).Error("saving the state file failed")
	}
}

// hasVolume reports whether the daemon knows volume name.
// +checklocks:d.stateMu
func (d *Daemon) hasVolume(name string) bool { return d.volumes[name] != nil }

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
// volume that is not there is success.
func (d *Daemon) DeleteVolume(name string, force bool) (deleted bool, err error) {
	if err := pool.CheckName(name); err != nil {
		return false, err
	}
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	v := d.volumes[name]
	if v == nil {
		return false, nil
	}
	return true, d.deleteVolumeLocked(v, force)
}

// deleteVolumeLocked is DeleteVolume of a volume the daemon knows.
// +checklocks:d.stateMu
func (d *Daemon) deleteVolumeLocked(v *volume, force bool) error {
	name := v.Name
	p := d.pools[v.Pool]
	if _, failed := d.poolErrs[v.Pool]; p == nil && !failed {
		// Its pool left the configuration: nothing to delete the
		// volume in; the record is forgotten.
		delete(d.volumes, name)
		d.publishVolumeNames()
		if err := d.saveState(); err != nil {
			return fmt.Errorf("volume %s forgotten, but saving the state file failed: %w", name, err)
		}
		d.log.WithFields(log.Fields{"volume": name, "pool": v.Pool}).Warn("volume forgotten: its pool is no longer in the configuration (whatever it holds there is left as it is)")
		return nil
	}
	if p == nil {
		return ctl.Errorf(ctl.CodeUnavailable, "volume %s: pool %s is not served: %s", name, v.Pool, d.poolReason(v.Pool))
	}
	if err := d.rnbd.Unmap(name, force); err != nil && !errors.Is(err, syscall.ENOENT) {
		return err // busy
	}
	d.crashPoint("volume-delete-unmapped")
	v.Intent = intentDelete
	if err := d.saveState(); err != nil {
		return fmt.Errorf("volume %s withdrawn, but saving the state file failed (a retry deletes it): %w", name, err)
	}
	d.crashPoint("volume-delete-intent")
	if err := p.Delete(name); err != nil {
		v.notServed = "an interrupted delete: " + err.Error()
		return fmt.Errorf("volume %s withdrawn, but deleting it failed (a retry deletes it): %w", name, err)
	}
	d.crashPoint("volume-delete-deleted")
	delete(d.volumes, name)
	d.publishVolumeNames()
	if err := d.saveState(); err != nil {
		return fmt.Errorf("volume %s deleted, but saving the state file failed (a restart forgets it): %w", name, err)
	}
	d.log.WithFields(log.Fields{"volume": name, "pool": v.Pool, "force": force}).Info("volume deleted")
	return nil
}

// ResizeVolume grows a volume, and its export: sessions that have it
// open learn the new size (at once for a file, within their size poll
// for a block device).
func (d *Daemon) ResizeVolume(name string, size int64) (was int64, err error) {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	v := d.volumes[name]
	if v == nil {
		return 0, ctl.Errorf(ctl.CodeNotFound, "no volume %s", name)
	}
	p, err := d.poolOf(v.Pool)
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
	if st, err := os.Stat(pv.Path); err == nil && st.Mode().IsRegular() && v.notServed == "" {
		// Served at once to the sessions that have it open.
		if _, err := d.rnbd.Resize(name, size, false); err != nil {
			return old.Size, fmt.Errorf("volume %s grown, but telling its sessions failed (they learn it at their next open): %w", name, err)
		}
	}
	d.log.WithFields(log.Fields{"volume": name, "pool": v.Pool, "was": old.Size, "now": size}).Info("volume resized")
	return old.Size, nil
}

// SetVolumeLabels replaces a volume's labels (the caller's, kept with
// it in its pool).
func (d *Daemon) SetVolumeLabels(name string, labels map[string]string) error {
	if err := pool.CheckName(name); err != nil {
		return err
	}
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	v := d.volumes[name]
	if v == nil {
		return ctl.Errorf(ctl.CodeNotFound, "no volume %s", name)
	}
	p, err := d.poolOf(v.Pool)
	if err != nil {
		return err
	}
	if _, err := p.SetLabels(name, labels); err != nil {
		return err
	}
	d.log.WithFields(log.Fields{"volume": name, "pool": v.Pool, "labels": len(labels)}).Info("volume labels set")
	return nil
}

// CreateSnapshot takes a snapshot of a volume in its pool. Snapshot
// names are the node's, across pools.
func (d *Daemon) CreateSnapshot(req api.SnapshotRequest) (pool.Snapshot, bool, error) {
	for _, n := range []string{req.Name, req.Volume} {
		if err := pool.CheckName(n); err != nil {
			return pool.Snapshot{}, false, err
		}
	}
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	v := d.volumes[req.Volume]
	if v == nil {
		return pool.Snapshot{}, false, ctl.Errorf(ctl.CodeNotFound, "no volume %s", req.Volume)
	}
	p, err := d.poolOf(v.Pool)
	if err != nil {
		return pool.Snapshot{}, false, err
	}
	for name, q := range d.pools {
		if name == v.Pool {
			continue
		}
		if ss, _ := q.Snapshots(); slices.ContainsFunc(ss, func(s pool.Snapshot) bool { return s.Name == req.Name }) {
			return pool.Snapshot{}, false, ctl.Errorf(ctl.CodeExists, "snapshot %s exists in pool %s", req.Name, name)
		}
	}
	s, created, err := p.CreateSnapshot(req.Volume, req.Name)
	if err == nil && created {
		d.log.WithFields(log.Fields{"snapshot": s.Name, "volume": s.Volume, "pool": s.Pool}).Info("snapshot created")
	}
	return s, created, err
}

// DeleteSnapshot deletes a snapshot, in whichever pool has it; one
// that is nowhere is success.
func (d *Daemon) DeleteSnapshot(name string) (deleted bool, err error) {
	if err := pool.CheckName(name); err != nil {
		return false, err
	}
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	for pname, p := range d.pools {
		ss, err := p.Snapshots()
		if err != nil {
			return deleted, err
		}
		if slices.ContainsFunc(ss, func(s pool.Snapshot) bool { return s.Name == name }) {
			if err := p.DeleteSnapshot(name); err != nil {
				return deleted, err
			}
			deleted = true
			d.log.WithFields(log.Fields{"snapshot": name, "pool": pname}).Info("snapshot deleted")
		}
	}
	return deleted, nil
}

// Grant gives an identity access to an export, and Revoke takes it
// back; both save the state. The configuration file's exports are
// changed there.
func (d *Daemon) Grant(export string, g rnbd.Grant) error {
	return d.changeGrants(export, func() (bool, error) { return d.rnbd.Grant(export, g) },
		log.Fields{"export": export, "identity": g.Identity, "access": g.Access}, "grant given")
}

// Revoke: see Grant.
func (d *Daemon) Revoke(export, identity string) error {
	return d.changeGrants(export, func() (bool, error) { return d.rnbd.Revoke(export, identity) },
		log.Fields{"export": export, "identity": identity}, "grant revoked")
}

func (d *Daemon) changeGrants(export string, change func() (bool, error), fields log.Fields, what string) error {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	if d.configured[export] {
		return fmt.Errorf("export %s is one of the configuration file's: change its allow_identities there: %w", export, syscall.EPERM)
	}
	changed, err := change()
	if err != nil {
		return err
	}
	if !changed {
		return nil
	}
	if err := d.saveState(); err != nil {
		return fmt.Errorf("%s, but saving the state file failed: %w", what, err)
	}
	d.log.WithFields(fields).Info(what)
	return nil
}

// volumeRecords are the volume records (of one volume if name is set):
// each as its pool has it, with its export's rules as served.
func (d *Daemon) volumeRecords(name string) []api.VolumeRecord {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	// What the pools have: each listed once (an lvs per pool on LVM,
	// not one per volume), or the one volume asked for.
	have := map[string]pool.Volume{}
	for pname, p := range d.pools {
		var vs []pool.Volume
		if name == "" {
			vs, _ = p.List()
		} else if v := d.volumes[name]; v != nil && v.Pool == pname {
			if x, err := p.Get(name); err == nil {
				vs = []pool.Volume{x}
			}
		}
		for _, x := range vs {
			if d.volumes[x.Name] != nil && d.volumes[x.Name].Pool == pname {
				have[x.Name] = x
			}
		}
	}
	view := d.exportView()
	rows := []api.VolumeRecord{}
	for _, v := range d.volumes {
		if name != "" && v.Name != name {
			continue
		}
		var pv *pool.Volume
		if x, ok := have[v.Name]; ok {
			pv = &x
		}
		rows = append(rows, d.volumeRecord(v, pv, view))
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].Name < rows[j].Name })
	return rows
}

// exportView is what the volume records show of the exports: each
// served one by name, and how many sessions have each open.
type exportView struct {
	exports map[string]rnbd.Export
	opens   map[string]int
}

func (d *Daemon) exportView() exportView {
	x := exportView{exports: map[string]rnbd.Export{}, opens: map[string]int{}}
	for _, e := range d.rnbd.Exports() {
		x.exports[e.Name] = e
	}
	for _, o := range d.rnbd.OpenDevices() {
		x.opens[o.Export]++
	}
	return x
}

// volumeRecord is a volume as GET /v1/volumes gives it; pv is what its
// pool has (nil: nothing).
// +checklocks:d.stateMu
func (d *Daemon) volumeRecord(v *volume, pv *pool.Volume, view exportView) api.VolumeRecord {
	e, ok := view.exports[v.Name]
	if !ok {
		e = v.Export
	}
	state, reason := api.VolumeServed, v.notServed
	switch {
	case v.Intent == intentCreate:
		state = api.VolumeCreating
	case v.Intent == intentDelete:
		state = api.VolumeDeleting
	case reason != "":
		state = api.VolumeNotServed
	}
	r := api.VolumeRecord{Name: v.Name, Pool: v.Pool, Labels: api.Labels{}, Path: e.Path, State: state, Reason: reason,
		ReadOnly: e.ReadOnly, AllowIdentities: grantsOf(e.AllowIdentities), GrantsOnly: e.GrantsOnly, Sessions: view.opens[v.Name]}
	if pv != nil {
		r.Size, r.Source, r.SourceSnapshot, r.Path = ptr(pv.Size), pv.Source, pv.SourceSnapshot, pv.Path
		r.Created = pv.Created.Format(time.RFC3339)
		maps.Copy(r.Labels, pv.Labels)
	}
	return r
}

// snapshotRecords are the snapshot records of every pool (of one
// snapshot if name is set, of one volume if volume is).
func (d *Daemon) snapshotRecords(name, volume string) ([]api.SnapshotRecord, error) {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	rows := []api.SnapshotRecord{}
	for _, p := range d.pools {
		ss, err := p.Snapshots()
		if err != nil {
			return nil, err
		}
		for _, s := range ss {
			if (name != "" && s.Name != name) || (volume != "" && s.Volume != volume) {
				continue
			}
			rows = append(rows, snapshotRecord(s))
		}
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].Name < rows[j].Name })
	return rows, nil
}

func snapshotRecord(s pool.Snapshot) api.SnapshotRecord {
	return api.SnapshotRecord{Name: s.Name, Pool: s.Pool, Volume: s.Volume, Size: s.Size, Created: s.Created.Format(time.RFC3339)}
}

// poolRecords are the pool records, with each pool's capacity.
func (d *Daemon) poolRecords() []api.PoolRecord {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	rows := []api.PoolRecord{}
	for _, c := range d.cfg.Pools {
		where := c.Path
		if c.Type == "lvm-thin" {
			where = c.VolumeGroup + "/" + c.ThinPool
		}
		r := api.PoolRecord{Name: c.Name, Type: c.Type, Where: where, State: "served"}
		for _, v := range d.volumes {
			if v.Pool == c.Name {
				r.Volumes++
			}
		}
		p := d.pools[c.Name]
		if p == nil {
			r.State, r.Reason = "not served", d.poolReason(c.Name)
			rows = append(rows, r)
			continue
		}
		cp, err := p.Capacity()
		if err != nil {
			r.State, r.Reason = "not served", err.Error()
		} else {
			r.Total, r.Used, r.Promised, r.Allocatable = ptr(cp.Total), ptr(cp.Used), ptr(cp.Promised), ptr(cp.Allocatable)
			if c.Type == "lvm-thin" {
				r.MetadataSize, r.MetadataUsed = ptr(cp.MetadataSize), ptr(cp.MetadataUsed)
			}
		}
		rows = append(rows, r)
	}
	return rows
}

// grantRecords are an export's grants, one record each.
func (d *Daemon) grantRecords(export string) ([]api.GrantRecord, error) {
	for _, e := range d.rnbd.Exports() {
		if e.Name != export {
			continue
		}
		rows := []api.GrantRecord{}
		for _, g := range e.AllowIdentities {
			rows = append(rows, api.GrantRecord{Export: e.Name, Identity: g.Identity, Access: g.Access})
		}
		return rows, nil
	}
	return nil, ctl.Errorf(ctl.CodeNotFound, "no export %s", export)
}
