// A storage node that does not answer: a volume's name is never made
// twice where it can be known, and a copy made twice while a node could
// not say is found and reclaimed (docs/kubernetes.md, "A storage node
// that does not answer", has the design).
//
// CreateVolume asks every storage node for the name before it makes a
// volume. A node that does not answer could have it: a create sent to it
// before it went silent may have made it, its answer lost. The volume is
// then made on a node that answers all the same (one node's trouble stays
// on that node), labelled with the nodes that could not say
// (csi.unchecked). Every copy carries csi.made: when the controller last
// gave it as CreateVolume's answer (or asked for it); a retry that finds
// a copy sets it anew before it answers. CreateVolume of one name runs
// one at a time (the name's lock here, the sidecars' leader election
// across replicas), so the copy with the newest csi.made is the one the
// CO was told last: the one it holds. The others are reclaimed:
//
//   - by the reconciler, which lists every node that answers every
//     reconcile_interval, and at once when a node answers again, reads
//     the copies of a name found twice again with its lock held, and
//     deletes each older than the newest, on the condition that it
//     still has the csi.made it was read with (another replica's
//     CreateVolume may have taken it as its answer since);
//   - by DeleteVolume of a copy labelled csi.unchecked, which looks at
//     each of those nodes first (Unavailable until each answers), so
//     that the copy a node held is not left behind when the one the CO
//     held is deleted.
//
// A copy that is in use (granted to a worker, or open) is never deleted:
// it is reported (an error in the log, rnbd_csi_duplicate_volumes_total
// with outcome kept) for the operator, who knows which data matters. The
// replicas' clocks (csi.made) must agree within the time between two
// tries of one CreateVolume, as leader election's leases already ask.

package csi

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/pkg/log"
)

// reconciler runs a round every reconcile_interval and when woken, until
// ctx ends.
func (c *controller) reconciler(ctx context.Context) {
	defer close(c.done)
	t := time.NewTicker(c.cfg.Controller.ReconcileInterval.Duration)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-c.wake:
		}
		c.reconcile(ctx)
	}
}

// wakeReconciler asks the reconciler for a round now.
func (c *controller) wakeReconciler() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// reconcile is one round: the copies of each CSI name on the storage
// nodes that answer, all but the newest reclaimed. A name found on two
// nodes is decided on what is read again with its lock held, every copy
// of it answering (one that does not could be the newest): never on the
// list, which a retry of CreateVolume may have made stale since. Then
// the replicated volumes' grants are mended (mirror.go). It returns how
// many copies it reclaimed and members it mended.
func (c *controller) reconcile(ctx context.Context) int {
	results := each(ctx, c.nodes, func(ctx context.Context, n *storageNode) ([]api.VolumeRecord, error) { return n.volumes(ctx) })
	type copyOf struct {
		n    *storageNode
		name string // on n
	}
	byName := map[string][]copyOf{}
	for _, r := range results {
		for _, v := range r.v {
			// A replicated volume's members are one name on several
			// nodes by design (mirror.go).
			if name := v.Labels[labelName]; name != "" && v.Labels[labelMember] == "" {
				byName[name] = append(byName[name], copyOf{r.n, v.Name})
			}
		}
	}
	var names []string
	for name, cs := range byName {
		if len(cs) > 1 {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	reclaimed := 0
	for _, name := range names {
		unlock, err := c.locks.lockByName(name)
		if err != nil {
			continue // a CreateVolume of it under way: the next round
		}
		var fs []found
		fresh := true
		for _, cp := range byName[name] {
			v, err := cp.n.volume(ctx, cp.name)
			switch {
			case isNotFound(err):
			case err != nil:
				fresh = false
			case v.Labels[labelName] == name:
				fs = append(fs, found{cp.n, *v})
			}
		}
		if fresh && len(fs) > 1 {
			keep := newest(fs)
			for _, f := range fs {
				if f.n == keep.n && f.v.Name == keep.v.Name {
					continue
				}
				if c.reclaim(ctx, f, makeID(keep.n.cfg.Name, keep.v.Name)) == nil {
					reclaimed++
				}
			}
		}
		unlock()
	}
	return reclaimed + c.reconcileGrants(ctx, results) + c.replaceLegs(ctx, results)
}

// reclaim deletes f, a copy of a CSI name older than the copy keep,
// unless it is in use (granted, or open): then it is reported and kept,
// and the error says so. The delete is conditional on the storage node:
// only if f still has the csi.made it was read with (a CreateVolume
// that took f as its answer meanwhile, in this controller or another,
// changed it), so the copy a CO holds is never the one deleted.
func (c *controller) reclaim(ctx context.Context, f found, keep string) error {
	id := makeID(f.n.cfg.Name, f.v.Name)
	fields := log.Fields{"volume": id, "csi_name": f.v.Labels[labelName], "kept": keep, "made": f.v.Labels[labelMade]}
	unlock, err := c.locks.lockByVolumeID(id)
	if err != nil {
		return err
	}
	defer unlock()
	if len(f.v.AllowIdentities) > 0 || f.v.Sessions > 0 || f.v.State != api.VolumeServed {
		c.m.duplicates.WithLabelValues(f.n.cfg.Name, "kept").Inc()
		c.log.WithFields(fields).WithFields(log.Fields{"grants": strings.Join(f.v.AllowIdentities.Identities(), ","), "sessions": f.v.Sessions,
			"state": f.v.State}).Error("two copies of one CSI name, and the older is in use (or changing): not reclaimed; see which holds the data wanted and delete the other")
		return status.Errorf(codes.FailedPrecondition, "volume %s, an older copy of CSI name %q than %s, is in use (granted, open or changing): not reclaimed",
			id, f.v.Labels[labelName], keep)
	}
	_, err = callOn(ctx, f.n, "a reclaim of volume "+f.v.Name, func(ctx context.Context) (bool, error) {
		return f.n.api.DeleteVolumeIf(ctx, f.v.Name, map[string]string{labelMade: f.v.Labels[labelMade], labelName: f.v.Labels[labelName]})
	})
	if err != nil {
		c.log.WithError(err).WithFields(fields).Warn("reclaiming an older copy of a CSI name failed (or it changed since it was read); looked at again next round")
		return toStatus(err, "reclaiming volume "+id)
	}
	c.m.duplicates.WithLabelValues(f.n.cfg.Name, "reclaimed").Inc()
	c.log.WithFields(fields).Warn("reclaimed an older copy of a CSI name, made on a storage node that did not answer when the name was made again")
	return nil
}

// reclaimUnchecked looks, before v on n is deleted, at each storage node
// that could not say whether it had v's name when v was made
// (csi.unchecked): a copy of the name there is reclaimed. A node that
// does not answer yet is Unavailable: the delete waits for it, so that
// its copy is not left behind with nothing to say it is one.
func (c *controller) reclaimUnchecked(ctx context.Context, n *storageNode, v *api.VolumeRecord) error {
	if v.Labels[labelUnchecked] == "" {
		return nil
	}
	for _, name := range strings.Split(v.Labels[labelUnchecked], ",") {
		u := c.node(name)
		if u == nil || u == n {
			continue // no longer configured: nothing to look at
		}
		other, err := u.volume(ctx, v.Name)
		switch {
		case isNotFound(err):
			continue
		case err != nil:
			return status.Errorf(codes.Unavailable, "volume %s was made while %s did not answer: it is deleted once %s answers, "+
				"so that a copy of its name there is found and reclaimed (%v)", makeID(n.cfg.Name, v.Name), u, u.cfg.Name, err)
		case other.Labels[labelName] != v.Labels[labelName]:
			continue // another name's
		}
		if err := c.reclaim(ctx, found{u, *other}, makeID(n.cfg.Name, v.Name)); err != nil && status.Code(err) != codes.FailedPrecondition {
			return fmt.Errorf("deleting volume %s: %w", makeID(n.cfg.Name, v.Name), err)
		}
		// A copy in use is reported (reclaim says so) and kept: the
		// CO's delete of the copy it holds goes on all the same.
	}
	return nil
}
