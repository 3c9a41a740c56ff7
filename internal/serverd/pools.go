// Pools: the [[pool]] tables, opened at start and, one that was not
// there, tried again every export_retry; when a pool is served, its
// volumes are reconciled with the state file's (docs/server.md, "Pools
// and volumes").

package serverd

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"syscall"

	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/pool"
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

// where is what a pool record says the pool is: its directory, or its
// volume group and thin pool.
func (c PoolConfig) where() string {
	if c.Type == "lvm-thin" {
		return c.VolumeGroup + "/" + c.ThinPool
	}
	return c.Path
}

// openPool opens a [[pool]] table's pool (with Options.OpenPool if
// set), and logs what opening it removed of an interrupted change.
func (d *Daemon) openPool(c PoolConfig) (pool.Pool, error) {
	var p pool.Pool
	var cleaned []string
	var err error
	switch {
	case d.openPoolFn != nil:
		p, cleaned, err = d.openPoolFn(c)
	case c.Type == "dir":
		p, cleaned, err = pool.OpenDir(c.Name, c.Path, pool.DirOptions{Mountpoint: c.Mountpoint})
	case c.Type == "lvm-thin":
		p, cleaned, err = pool.OpenLVMThin(c.Name, c.VolumeGroup, c.ThinPool)
	default:
		err = fmt.Errorf("pool type %q", c.Type) // validated: never
	}
	if err != nil {
		return nil, err
	}
	for _, x := range cleaned {
		d.log.WithFields(log.Fields{"pool": c.Name, "removed": x}).Warn("pool: removed what an interrupted change left half-made")
	}
	return p, nil
}

// startPools opens the configuration's pools and serves the state file's
// volumes in them: a pool that cannot be opened is logged and kept out
// (its volumes are not served; retryPools tries it again), the others
// are served, each reconciled with the state file (servePool). Start
// calls it before the control API is served.
func (d *Daemon) startPools(ctx context.Context, saved []VolumeState) {
	opened := map[string]pool.Pool{}
	errs := map[string]string{}
	for _, c := range d.cfg.Pools {
		p, err := d.openPool(c)
		if err != nil {
			errs[c.Name] = err.Error()
			d.log.WithError(err).WithField("pool", c.Name).Error("pool not served: its volumes are not served until it is (tried again every " +
				d.retryEvery.String() + ")")
			continue
		}
		opened[c.Name] = p
	}
	d.stateMu.Lock()
	d.pools, d.poolErrs, d.volumes = map[string]pool.Pool{}, errs, map[string]*volume{}
	for _, vs := range saved {
		v := &volume{VolumeState: vs}
		if opened[vs.Pool] == nil {
			v.notServed = "pool " + vs.Pool + " is not served: " + d.poolReason(vs.Pool)
			d.log.WithFields(log.Fields{"volume": vs.Name, "pool": vs.Pool}).Error("volume not served: " + v.notServed)
		}
		d.volumes[vs.Name] = v
	}
	d.publishVolumeNames()
	d.stateMu.Unlock()
	for _, c := range d.cfg.Pools {
		if p := opened[c.Name]; p != nil {
			d.servePool(ctx, c.Name, p)
		}
	}
}

// retryPools tries the pools that could not be opened again (retryLoop):
// one whose directory or volume group appeared since is served, its
// volumes reconciled as at start, without a restart.
func (d *Daemon) retryPools(ctx context.Context) {
	d.stateMu.Lock()
	var want []PoolConfig
	for _, c := range d.cfg.Pools {
		if d.pools[c.Name] == nil {
			want = append(want, c)
		}
	}
	d.stateMu.Unlock()
	for _, c := range want {
		if ctx.Err() != nil {
			return
		}
		p, err := d.openPool(c)
		if err != nil {
			d.stateMu.Lock()
			news := d.poolErrs[c.Name] != err.Error()
			d.poolErrs[c.Name] = err.Error()
			d.stateMu.Unlock()
			if news {
				d.log.WithError(err).WithField("pool", c.Name).Error("pool still not served")
			}
			continue
		}
		if n, ok := d.servePool(ctx, c.Name, p); ok {
			d.log.WithFields(log.Fields{"pool": c.Name, "volumes_served": n}).Info("pool served now")
		}
	}
}

// servePool reconciles pool name's volumes and the state file's (each
// under its name's lock, so that a change of it waits, reconcileVolume),
// then serves the pool: from then on volumes are made in it. It saves
// the state file if anything changed, and returns how many of the
// pool's volumes are served; false if the daemon stopped first (ctx).
func (d *Daemon) servePool(ctx context.Context, name string, p pool.Pool) (int, bool) {
	names := map[string]*pool.Volume{}
	d.stateMu.Lock()
	for n, v := range d.volumes {
		if v.Pool == name {
			names[n] = nil
		}
	}
	d.stateMu.Unlock()
	listed, err := p.List()
	if err != nil {
		d.log.WithError(err).WithField("pool", name).Error("listing a pool's volumes failed: none adopted")
	}
	for i := range listed {
		names[listed[i].Name] = &listed[i]
	}
	changed := false
	for _, n := range slices.Sorted(maps.Keys(names)) {
		unlock, err := d.names.lock(ctx, 0, "reconcile", volumeKey(n))
		if err != nil {
			// The daemon stops: the pool is left not served.
			d.log.WithError(err).WithField("pool", name).Warn("pool not served: the daemon stopped while its volumes were reconciled")
			return 0, false
		}
		if d.reconcileVolume(name, p, n, names[n]) {
			changed = true
		}
		unlock()
	}
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	d.pools[name] = p
	delete(d.poolErrs, name)
	d.publishVolumeNames()
	if changed {
		if err := d.saveState(); err != nil {
			d.log.WithError(err).WithField("pool", name).Error("saving the state file after reconciling a pool's volumes failed")
		}
	}
	served := 0
	for _, v := range d.volumes {
		if v.Pool == name && v.notServed == "" && v.Intent == "" {
			served++
		}
	}
	return served, true
}

// reconcileVolume makes volume name of pool pname agree with the state
// file: an interrupted create or delete is finished, a volume the pool
// has (listed) that the daemon does not know is adopted (exported with no
// grant: no client may open it until one is given), and one the daemon
// knows that the pool lost is kept, not served, until deleted; the others
// are exported. Each is logged. The name's lock is held; no other. It
// reports whether the state file is to be saved.
func (d *Daemon) reconcileVolume(pname string, p pool.Pool, name string, listed *pool.Volume) (changed bool) {
	fields := log.Fields{"volume": name, "pool": pname}
	d.stateMu.Lock()
	v := d.volumes[name]
	switch {
	case v == nil && listed == nil:
		d.stateMu.Unlock() // deleted meanwhile
		return false
	case v == nil && (d.configured[name] || d.exported(name) || d.isUnrestored(name)):
		d.stateMu.Unlock()
		d.log.WithFields(fields).Error("a volume of the pool has the name of an export that is not a volume: not adopted, not served")
		return false
	case v == nil:
		v = &volume{VolumeState: VolumeState{Name: name, Pool: pname, Export: rnbd.Export{Name: name, Path: listed.Path, GrantsOnly: true}}}
		d.volumes[name] = v
		d.publishVolumeNames()
		changed = true
		d.log.WithFields(fields).Warn("volume adopted: its pool has it and the state file did not; exported with no grant (give one to open it)")
	case v.Pool != pname:
		d.stateMu.Unlock()
		d.log.WithFields(log.Fields{"volume": name, "pool": pname, "kept": v.Pool}).Error("a volume of this name is in two pools: this one is not served")
		return false
	}
	vs := v.VolumeState
	d.stateMu.Unlock()

	switch vs.Intent {
	case intentDelete:
		err := p.Delete(name)
		d.stateMu.Lock()
		defer d.stateMu.Unlock()
		if err != nil {
			v.notServed = "an interrupted delete could not be finished: " + err.Error()
			d.log.WithError(err).WithFields(fields).Error("finishing an interrupted delete of a volume failed; delete it again")
			return changed
		}
		delete(d.volumes, name)
		d.publishVolumeNames()
		d.log.WithFields(fields).Info("volume: an interrupted delete finished")
		return true
	case intentCreate:
		if _, err := p.Get(name); errors.Is(err, syscall.ENOENT) {
			d.stateMu.Lock()
			defer d.stateMu.Unlock()
			delete(d.volumes, name)
			d.publishVolumeNames()
			d.log.WithFields(fields).Info("volume: an interrupted create had made nothing; dropped (a retry makes it)")
			return true
		}
		changed = true
		d.log.WithFields(fields).Info("volume: an interrupted create finished")
	}
	// Looked at and exported without the state lock (the probe may
	// take probeWait): the name's lock keeps the volume as it is.
	pv, missing := p.Get(name)
	var e rnbd.Export
	var err error
	if missing == nil {
		e, err = d.exportVolume(vs.Export, pv)
	}
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	v.Intent, v.notServed, v.CreateLabels = "", "", nil
	switch {
	case missing != nil:
		v.notServed = "missing from pool " + pname + ": " + missing.Error()
		d.log.WithError(missing).WithFields(fields).Error("volume missing from its pool: not served (volume delete forgets it)")
	case err != nil:
		v.notServed = err.Error()
		d.log.WithError(err).WithFields(fields).Error("volume not served")
	default:
		v.Export = e
	}
	return changed
}

// poolReason says why a pool is not served.
// +checklocks:d.stateMu
func (d *Daemon) poolReason(name string) string {
	if r, ok := d.poolErrs[name]; ok {
		return r
	}
	return "not in the configuration"
}

// poolOf returns pool name, or why there is none to use.
// +checklocks:d.stateMu
func (d *Daemon) poolOf(name string) (pool.Pool, error) {
	if p := d.pools[name]; p != nil {
		return p, nil
	}
	if _, ok := d.poolErrs[name]; ok {
		return nil, ctl.Errorf(ctl.CodeUnavailable, "pool %s is not served: %s", name, d.poolReason(name))
	}
	return nil, ctl.Errorf(ctl.CodeNotFound, "no pool %s (pools: %s)", name, d.poolNames())
}

// poolNames are the configuration's pools, for an error.
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

// servedPools are the pools served now, by name.
func (d *Daemon) servedPools() map[string]pool.Pool {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	return maps.Clone(d.pools)
}
