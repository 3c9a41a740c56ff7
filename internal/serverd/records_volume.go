// The records of pools, volumes, snapshots and grants. Each is read
// without the state lock: what the daemon knows is copied under it,
// then the pools are asked (a command of seconds on lvm2) with no lock
// held, so that a list never holds a map, an unmap or a change.

package serverd

import (
	"errors"
	"maps"
	"sort"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/pool"
	"github.com/rnbd/rnbd/pkg/rnbd"
)

// volumeRecords are the volume records (of one volume if name is set):
// each as its pool has it, with its export's rules as served. A pool
// that cannot say what it has (lvs failing) is an error, not records
// without what the pool keeps (their labels: whose they are).
func (d *Daemon) volumeRecords(name string) ([]api.VolumeRecord, error) {
	d.stateMu.Lock()
	var known []volume
	for _, v := range d.volumes {
		if name == "" || v.Name == name {
			known = append(known, *v)
		}
	}
	pools := maps.Clone(d.pools)
	d.stateMu.Unlock()
	poolOf := map[string]string{}
	for _, v := range known {
		poolOf[v.Name] = v.Pool
	}
	// What the pools have: each listed once (an lvs per pool on LVM,
	// not one per volume), or the one volume asked for.
	have := map[string]pool.Volume{}
	for pname, p := range pools {
		var vs []pool.Volume
		var err error
		if name == "" {
			vs, err = p.List()
		} else if poolOf[name] == pname {
			var x pool.Volume
			if x, err = p.Get(name); err == nil {
				vs = []pool.Volume{x}
			} else if errors.Is(err, syscall.ENOENT) {
				err = nil
			}
		}
		if err != nil {
			return nil, ctl.Errorf(ctl.CodeUnavailable, "pool %s cannot say what it has: %v", pname, err)
		}
		for _, x := range vs {
			if poolOf[x.Name] == pname {
				have[x.Name] = x
			}
		}
	}
	view := d.exportView()
	rows := []api.VolumeRecord{}
	for _, v := range known {
		var pv *pool.Volume
		if x, ok := have[v.Name]; ok {
			pv = &x
		}
		rows = append(rows, volumeRecord(v, pv, view))
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].Name < rows[j].Name })
	return rows, nil
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
func volumeRecord(v volume, pv *pool.Volume, view exportView) api.VolumeRecord {
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
	} else {
		maps.Copy(r.Labels, v.CreateLabels) // being made: the labels asked
	}
	return r
}

// snapshotRecords are the snapshot records of every pool (of one
// snapshot if name is set, of one volume if volume is).
func (d *Daemon) snapshotRecords(name, volume string) ([]api.SnapshotRecord, error) {
	rows := []api.SnapshotRecord{}
	for _, p := range d.servedPools() {
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
	return api.SnapshotRecord{Name: s.Name, Pool: s.Pool, Volume: s.Volume, Size: s.Size, Created: s.Created.Format(time.RFC3339), Labels: s.Labels}
}

// poolRecords are the pool records, with each pool's capacity.
func (d *Daemon) poolRecords() []api.PoolRecord {
	d.stateMu.Lock()
	rows := []api.PoolRecord{}
	pools := make([]pool.Pool, len(d.cfg.Pools))
	for i, c := range d.cfg.Pools {
		r := api.PoolRecord{Name: c.Name, Type: c.Type, Where: c.where(), State: "served"}
		for _, v := range d.volumes {
			if v.Pool == c.Name {
				r.Volumes++
			}
		}
		if pools[i] = d.pools[c.Name]; pools[i] == nil {
			r.State, r.Reason = "not served", d.poolReason(c.Name)
		}
		rows = append(rows, r)
	}
	d.stateMu.Unlock()
	for i, p := range pools {
		if p == nil {
			continue
		}
		r := &rows[i]
		cp, err := p.Capacity()
		if err != nil {
			r.State, r.Reason = "not served", err.Error()
			continue
		}
		r.Total, r.Used, r.Promised, r.Allocatable = ptr(cp.Total), ptr(cp.Used), ptr(cp.Promised), ptr(cp.Allocatable)
		if d.cfg.Pools[i].Type == "lvm-thin" {
			r.MetadataSize, r.MetadataUsed = ptr(cp.MetadataSize), ptr(cp.MetadataUsed)
		}
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
