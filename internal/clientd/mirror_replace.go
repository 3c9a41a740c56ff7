package clientd

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/mirror"
)

// A mirror's leg whose storage node is gone for good, put in the place
// of by another device: by the operator (replace-leg) or by a spare of
// the mapping (the rejoiner, after mirror_spare_after). The mirror
// rebuilds the new leg in full; the mapping keeps it once it is taken.

// ReplaceLeg puts the device l names in the place of leg which ("0",
// "1", "2" or "witness") of mirror mapping name: for a storage node
// gone for good. Only a leg out (stale or missing) or a witness that
// does not vote is replaced; the new leg is written at once and rebuilt
// in full in the background (a device of this mirror's, its old node
// back under another address, only with what it missed), then read. The
// mapping keeps the new leg from when this returns (a spare it names
// leaves the spares); nothing changes when it fails.
func (d *Daemon) ReplaceLeg(ctx context.Context, name, which string, l api.Leg) error {
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	mp, err := d.find(name, "replace-leg")
	if err != nil {
		return err
	}
	md := mp.mir
	if md == nil {
		return ctl.Errorf(ctl.CodeInvalid, "%s is not a mirror: replace-leg replaces a mirror's leg", name)
	}
	md.rejoinMu.Lock()
	defer md.rejoinMu.Unlock()
	md.mu.Lock()
	cur := md.spec
	md.mu.Unlock()
	i, err := cur.legIndex(which)
	if err != nil {
		return err
	}
	// A copy: normalize fills defaults in, and the rejoiner reads cur.
	next := cur.Mapping
	next.Legs = slices.Clone(cur.Legs)
	if w := cur.Witness; w != nil {
		c := *w
		next.Witness = &c
	}
	if i < len(next.Legs) {
		next.Legs[i] = l
	} else {
		next.Witness = &l
	}
	next.Spares = slices.DeleteFunc(slices.Clone(cur.Spares), func(sp api.Leg) bool { return sp.SessName == l.SessName })
	s, err := normalize(next) // one node and one session per leg
	if err != nil {
		return err
	}
	s.Device = mp.Device
	d.mu.Lock()
	err = d.mirrorConflictLocked(s, mp)
	d.mu.Unlock()
	if err != nil {
		return err
	}
	if err := md.replaceable(&cur, i); err != nil {
		return err
	}
	return d.takeLeg(ctx, mp, &cur, &s, i, "replaced by the operator")
}

// replaceable says why leg i of cur may not be replaced now, if it
// may not.
func (md *mirrorDev) replaceable(cur *mapSpec, i int) error {
	switch p := md.m.Resync(); {
	case md.m.Failed():
		return ctl.Errorf(ctl.CodeUnavailable, "mirror %s lost its quorum: unmap it and map it again (--force if it must) before replacing a leg", md.name)
	case i == len(cur.Legs) && md.m.WitnessVoting():
		return ctl.Errorf(ctl.CodeBusy, "mirror %s: the witness votes: only a witness that does not is replaced", md.name)
	case i < len(cur.Legs) && md.m.LegStates()[i] != "out":
		return ctl.Errorf(ctl.CodeBusy, "mirror %s: leg %d is %s: only a leg out (stale or missing) is replaced", md.name, i, md.m.LegStates()[i])
	case i < len(cur.Legs) && p.Leg >= 0:
		return ctl.Errorf(ctl.CodeBusy, "mirror %s: leg %d resyncs now (one at a time): replace leg %d once it is in sync", md.name, p.Leg, i)
	}
	return nil
}

// takeLeg has the mirror take leg i as s says in the place of cur's
// (rejoin), then keeps s as the mapping: in the mirror, the record and
// the state file. d.mapMu and md.rejoinMu are held.
func (d *Daemon) takeLeg(ctx context.Context, mp *mapped, cur, s *mapSpec, i int, why string) error {
	md := mp.mir
	if err := d.rejoin(ctx, md, i, s, false); err != nil {
		var re *mirror.RefusedError
		if ctl.Classify(err) == ctl.CodeInternal || errors.As(err, &re) {
			err = ctl.Errorf(ctl.CodeInvalid, "%v", err)
		}
		return fmt.Errorf("mirror %s: %s not taken: %w", md.name, s.legTitle(i), err)
	}
	md.mu.Lock()
	if c := md.conns()[i]; c.cs != nil {
		s.legs()[i].SessUUID = sessUUID(c.cs)
	}
	md.spec = *s
	md.mu.Unlock()
	d.mu.Lock()
	mp.Legs, mp.Witness, mp.Spares = s.Legs, s.Witness, s.Spares
	d.mu.Unlock()
	d.log.WithFields(log.Fields{"audit": true, "mirror": md.name, "was": cur.legTitle(i), "now": s.legTitle(i)}).
		Warn("mirror: " + cur.legName(i) + " " + why + "; rebuilding it")
	if err := d.saveState(); err != nil {
		return fmt.Errorf("%s replaced and rebuilding, but saving it in the state file failed: %w", cur.legName(i), err)
	}
	return nil
}

// takeSpare puts the first spare that the mirror takes in the place of
// leg i, out since longer than mirror_spare_after. It does nothing while
// a map or unmap holds the daemon (the next round tries again).
//
// +checklocksignore: checklocks does not follow TryLock.
func (d *Daemon) takeSpare(ctx context.Context, mp *mapped, i int) error {
	if !d.mapMu.TryLock() {
		return errors.New("the daemon maps or unmaps: tried again")
	}
	defer d.mapMu.Unlock()
	md := mp.mir
	md.rejoinMu.Lock()
	defer md.rejoinMu.Unlock()
	md.mu.Lock()
	cur := md.spec
	md.mu.Unlock()
	if err := md.replaceable(&cur, i); err != nil {
		return err
	}
	var errs []error
	for j := range cur.Spares {
		s := cur.spare(i, j)
		err := d.takeLeg(ctx, mp, &cur, &s, i, "out longer than mirror_spare_after: a spare took its place")
		if err == nil {
			return nil
		}
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// legIndex is the index in s.legs() of leg which: its number, or
// "witness".
func (s *mapSpec) legIndex(which string) (int, error) {
	if which == "witness" {
		if s.Witness == nil {
			return 0, ctl.Errorf(ctl.CodeInvalid, "mirror %s has no witness", s.Mirror)
		}
		return len(s.Legs), nil
	}
	i, err := strconv.Atoi(which)
	if err != nil || i < 0 || i >= len(s.Legs) {
		return 0, ctl.Errorf(ctl.CodeInvalid, "leg %q: mirror %s has legs 0 to %d (and a witness: witness)", which, s.Mirror, len(s.Legs)-1)
	}
	return i, nil
}

// spare is spare j of s as s.legs() has leg i: a spec whose leg i is
// the spare, the spare out of the list.
func (s *mapSpec) spare(i, j int) mapSpec {
	n := len(s.legs())
	next := *s
	next.Legs = slices.Clone(s.Legs)
	next.Spares = slices.Delete(slices.Clone(s.Spares), j, j+1)
	next.legPaths = slices.Clone(s.legPaths[:n])
	next.legPaths = append(next.legPaths, slices.Delete(slices.Clone(s.legPaths[n:]), j, j+1)...)
	next.legPaths[i] = s.legPaths[n+j]
	if i < len(s.Legs) {
		next.Legs[i] = s.Spares[j]
	} else {
		w := s.Spares[j]
		next.Witness = &w
	}
	return next
}
