// Snapshots: taken of a volume in its pool, named across the node's
// pools (docs/server.md, "Pools and volumes").

package serverd

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/pool"
	"github.com/rnbd/rnbd/pkg/log"
)

// CreateSnapshot takes a snapshot of a volume in its pool. Snapshot
// names are the node's, across pools: the snapshot's name is held
// (and its volume's) while the other pools are asked whether they have
// one of that name and the snapshot is taken, so that no other change
// makes one of that name meanwhile, in any pool.
func (d *Daemon) CreateSnapshot(ctx context.Context, req api.SnapshotRequest) (pool.Snapshot, bool, error) {
	for _, n := range []string{req.Name, req.Volume} {
		if err := pool.CheckName(n); err != nil {
			return pool.Snapshot{}, false, err
		}
	}
	unlock, err := d.names.lock(ctx, d.nameWait, "snapshot", snapshotKey(req.Name), volumeKey(req.Volume))
	if err != nil {
		return pool.Snapshot{}, false, err
	}
	defer unlock()
	d.stateMu.Lock()
	v := d.volumes[req.Volume]
	if v == nil {
		d.stateMu.Unlock()
		return pool.Snapshot{}, false, ctl.Errorf(ctl.CodeNotFound, "no volume %s", req.Volume)
	}
	pname := v.Pool
	p, err := d.poolOf(pname)
	others := maps.Clone(d.pools)
	d.stateMu.Unlock()
	if err != nil {
		return pool.Snapshot{}, false, err
	}
	delete(others, pname)
	for _, name := range slices.Sorted(maps.Keys(others)) {
		if ss, _ := others[name].Snapshots(); slices.ContainsFunc(ss, func(s pool.Snapshot) bool { return s.Name == req.Name }) {
			return pool.Snapshot{}, false, ctl.Errorf(ctl.CodeExists, "snapshot %s exists in pool %s", req.Name, name)
		}
	}
	s, created, err := p.CreateSnapshot(req.Volume, req.Name, req.Labels)
	if err == nil && created {
		d.log.WithFields(log.Fields{"snapshot": s.Name, "volume": s.Volume, "pool": s.Pool}).Info("snapshot created")
	}
	return s, created, err
}

// DeleteSnapshot deletes a snapshot, in whichever pool has it; one
// that is nowhere is success. Its name is held throughout.
func (d *Daemon) DeleteSnapshot(ctx context.Context, name string) (deleted bool, err error) {
	if err := pool.CheckName(name); err != nil {
		return false, err
	}
	unlock, err := d.names.lock(ctx, d.nameWait, "snapshot delete", snapshotKey(name))
	if err != nil {
		return false, err
	}
	defer unlock()
	pools := d.servedPools()
	for _, pname := range slices.Sorted(maps.Keys(pools)) {
		p := pools[pname]
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

// HoldVolume holds the writes of volume name, from every session, for at
// most max (rnbd.Server.Hold): snapshots of several volumes taken while
// all are held are one point in time, as after a crash (a replicated
// volume's legs and witness, docs/replication.md). Only a volume's: a
// provisioner holds nothing else.
func (d *Daemon) HoldVolume(ctx context.Context, name string, max time.Duration) (api.Hold, error) {
	d.stateMu.Lock()
	v := d.volumes[name]
	served := v != nil && v.notServed == ""
	d.stateMu.Unlock()
	if v == nil {
		return api.Hold{}, ctl.Errorf(ctl.CodeNotFound, "no volume %s", name)
	}
	if !served {
		return api.Hold{}, ctl.Errorf(ctl.CodeUnavailable, "volume %s is not served now: nothing to hold", name)
	}
	start := time.Now()
	token, err := d.rnbd.Hold(name, max)
	if err != nil {
		return api.Hold{}, fmt.Errorf("volume %s: %w", name, err)
	}
	return api.Hold{Token: token, Until: start.Add(max).UTC()}, nil
}

// ReleaseVolume ends the hold token of volume name: whether it held
// until now (false: its time ran out first).
func (d *Daemon) ReleaseVolume(ctx context.Context, name string, token uint64) (bool, error) {
	held, err := d.rnbd.Release(name, token)
	if err != nil {
		return false, fmt.Errorf("volume %s: %w", name, err)
	}
	return held, nil
}
