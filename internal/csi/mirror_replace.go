// A replicated volume's leg made anew on another storage node when its
// own has not answered for [controller] mirror_replace_after (mirror.go
// has the design).
//
// The controller cannot reach the worker, so the worker is told before:
// ControllerPublishVolume gives it spares (publish context spares, the
// members' csi.spares), storage nodes that may take a leg's place, and
// its rnbd-client maps the mirror with them (map --spare). When a leg's
// node is gone for mirror_replace_after, the reconciler makes the leg's
// volume on the first spare that answers, is in the topology the other
// members share and keeps the legs apart by spreadBy, grants it to the
// worker, and records the new placement (the new member, made last,
// says it; the others are told too). The worker's rnbd-client, its leg
// out for its mirror_spare_after, tries its spares: only the one made
// and granted opens, and the mirror rebuilds it in full. A volume not
// published takes any such node: its next publish gives the new
// placement.
//
// The old member is retired (csi.retired on the others): never deleted
// while the volume may be published — the worker may have taken its
// leg back if its node returned first, and that leg may be the one in
// sync — only with the volume (DeleteVolume waits for a retired
// member's node as for a member's).

package csi

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/pkg/log"
)

const (
	// labelSpares are the storage nodes the worker was given as spares
	// at the last publish; labelRetired the nodes of members a
	// replacement left behind.
	labelSpares  = "csi.spares"
	labelRetired = "csi.retired"
	// maxSpares bounds the spares a publish gives: the worker's
	// rnbd-client dials each of them while a leg is out.
	maxSpares = 3
)

// PCSpares is the publish context's spares of a replicated volume: JSON,
// as PCLegs.
const PCSpares = "spares"

// spareNodes are the storage nodes that may take the place of a member
// of mv: configured, none of its members' nor its retired members',
// in the topology its members share (the worker reaches them), at most
// maxSpares, in the configuration's order.
func (c *controller) spareNodes(mv *mirrorVolume) []string {
	p := mv.place
	var shared map[string]string
	if t := c.sharedTopology(p); len(t) > 0 {
		shared = t[0].GetSegments()
	}
	var out []string
	for _, n := range c.nodes {
		if len(out) == maxSpares {
			break
		}
		if slices.ContainsFunc(p.members(), func(m member) bool { return m.node == n.cfg.Name }) || slices.Contains(mv.retired, n.cfg.Name) ||
			!within(n.cfg.Labels, shared) {
			continue
		}
		out = append(out, n.cfg.Name)
	}
	return out
}

// within says whether labels have every key and value of shared.
func within(labels, shared map[string]string) bool {
	for k, v := range shared {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// goneFor says whether storage node name has not answered for at least
// after (or is no longer configured).
func (c *controller) goneFor(name string, after time.Duration) bool {
	n := c.node(name)
	if n == nil {
		return true
	}
	since := n.downSince.Load()
	return !n.up.Load() && since != 0 && time.Since(time.Unix(0, since)) >= after
}

// replaceLegs makes anew, for each replicated volume of the storage
// nodes' records, every leg whose node has not answered for
// mirror_replace_after. It returns how many it made.
func (c *controller) replaceLegs(ctx context.Context, results []nodeResult[[]api.VolumeRecord]) int {
	after := c.cfg.Controller.MirrorReplaceAfter.Duration
	if after <= 0 {
		return 0
	}
	gone := false
	for _, n := range c.nodes {
		gone = gone || c.goneFor(n.cfg.Name, after)
	}
	if !gone {
		return 0
	}
	vols := map[string]bool{}
	for _, r := range results {
		for _, v := range r.v {
			if v.Labels[labelMember] != "" && v.Labels[labelName] != "" {
				vols[v.Name] = true
			}
		}
	}
	names := slices.Sorted(maps.Keys(vols))
	made := 0
	for _, vname := range names {
		unlock, err := c.locks.lockByVolumeID(mirrorID(vname))
		if err != nil {
			continue // a call of it under way: the next round
		}
		mv, err := c.findMirror(ctx, vname)
		if err == nil {
			for i, node := range mv.place.legs {
				if _, ok := mv.found[legMember(i)]; ok || !c.goneFor(node, after) {
					continue
				}
				fields := log.Fields{"volume": mv.id(), "member": legMember(i), "storage_node": node, "after": after}
				to, err := c.replaceLeg(ctx, mv, i)
				if err != nil {
					c.log.WithError(err).WithFields(fields).Warn("a replicated volume's leg whose storage node is gone was not made anew; tried again next round")
					continue
				}
				made++
				fields["audit"], fields["to"] = true, to
				c.log.WithFields(fields).Warn("a replicated volume's leg made anew on another storage node (its own gone for mirror_replace_after): the worker's mirror rebuilds it")
			}
		}
		unlock()
	}
	return made
}

// replaceLeg makes leg i of mv on another storage node and records the
// new placement; mv is changed to it. It returns the node.
func (c *controller) replaceLeg(ctx context.Context, mv *mirrorVolume, i int) (string, error) {
	var last, pub found
	size := int64(-1)
	for _, f := range mv.found {
		if last.n == nil || madeAt(f.v).After(madeAt(last.v)) {
			last = f
		}
		if pub.n == nil || f.v.Labels[labelPublishedAt] > pub.v.Labels[labelPublishedAt] {
			pub = f
		}
		if f.v.Labels[labelMember] != memberWit && f.v.Size != nil {
			size = max(size, *f.v.Size) // the largest: an expansion may have grown some legs only
		}
	}
	if size < 0 {
		return "", errors.New("no leg of it answers: nothing to rebuild the leg from")
	}
	p, err := parseParams(paramsOf(last.v.Labels[labelParams]))
	if err != nil {
		return "", fmt.Errorf("its %s label: %w", labelParams, err)
	}
	worker := pub.v.Labels[labelPublished]
	choices := c.spareNodes(mv)
	if worker != "" {
		// Published: only a spare the worker was given opens there.
		choices = splitSet(pub.v.Labels[labelSpares])
	}
	rest := mv.place
	rest.legs = slices.Delete(slices.Clone(mv.place.legs), i, i+1)
	var shared map[string]string
	if t := c.sharedTopology(rest); len(t) > 0 {
		shared = t[0].GetSegments()
	}
	var why []string
	for _, name := range choices {
		n := c.node(name)
		switch {
		case n == nil || !n.up.Load():
			why = append(why, name+": does not answer")
			continue
		case slices.ContainsFunc(mv.place.members(), func(m member) bool { return m.node == name }):
			why = append(why, name+": has a member")
			continue
		case !within(n.cfg.Labels, shared):
			why = append(why, name+": not in the other members' topology")
			continue
		}
		if k := p.spreadBy; k != "" {
			v, ok := n.cfg.Labels[k]
			if !ok || slices.ContainsFunc(rest.legs, func(o string) bool { on := c.node(o); return on != nil && on.cfg.Labels[k] == v }) {
				why = append(why, fmt.Sprintf("%s: %s %q has a leg already", name, k, v))
				continue
			}
		}
		next := mv.place
		next.legs = slices.Clone(mv.place.legs)
		next.legs[i] = name
		l := maps.Clone(last.v.Labels)
		l[labelMember], l[labelMembers] = legMember(i), next.String()
		l[labelMade] = time.Now().UTC().Format(time.RFC3339Nano)
		l[labelPublished], l[labelPublishedAt], l[labelSpares] = pub.v.Labels[labelPublished], pub.v.Labels[labelPublishedAt], pub.v.Labels[labelSpares]
		l[labelRetired] = joinSet(last.v.Labels[labelRetired], mv.place.legs[i])
		rec, err := n.createVolume(ctx, api.VolumeRequest{Name: mv.vname, Pool: p.poolOn(n.cfg), Size: strconv.FormatInt(size, 10), Labels: l,
			Export: api.MapRequest{GrantsOnly: ptr(true), WriteThrough: p.writeThrough}})
		if err != nil {
			why = append(why, fmt.Sprintf("%s: %v", name, err))
			continue
		}
		if worker != "" {
			if err := n.grant(ctx, mv.vname, worker, accessRW); err != nil {
				// The reconciler's grants mend it (the member says to
				// whom the volume is published).
				c.log.WithError(err).WithFields(log.Fields{"volume": mv.id(), "storage_node": name}).Warn("a replicated volume's new leg not granted to its worker yet")
			}
		}
		for part, f := range mv.found {
			fl := maps.Clone(f.v.Labels)
			fl[labelMembers], fl[labelRetired] = l[labelMembers], l[labelRetired]
			if err := f.n.setLabels(ctx, f.v.Name, fl); err != nil {
				// The new member, made last, says the placement.
				c.log.WithError(err).WithFields(log.Fields{"volume": mv.id(), "member": part}).Warn("a replicated volume's member not told its new placement")
			}
		}
		mv.place = next
		mv.found[legMember(i)] = found{n, rec}
		return name, nil
	}
	if len(choices) == 0 {
		return "", errors.New("no spare storage node (none configured in the members' topology, or none given to the worker at its publish: publish it again)")
	}
	return "", fmt.Errorf("no spare takes it: %s", strings.Join(why, "; "))
}

// paramsOf reads a csi.params label (volumeParams.canonical) back into
// StorageClass parameters, the empty ones left out.
func paramsOf(canonical string) map[string]string {
	out := map[string]string{}
	for kv := range strings.SplitSeq(canonical, ";") {
		if k, v, ok := strings.Cut(kv, "="); ok && v != "" {
			out[k] = v
		}
	}
	return out
}

// joinSet adds name to a comma-separated set.
func joinSet(set, name string) string {
	var out []string
	for s := range strings.SplitSeq(set, ",") {
		if s != "" && s != name {
			out = append(out, s)
		}
	}
	out = append(out, name)
	sort.Strings(out)
	return strings.Join(out, ",")
}

// splitSet is a comma-separated set's names.
func splitSet(set string) []string {
	var out []string
	for s := range strings.SplitSeq(set, ",") {
		if s != "" {
			out = append(out, s)
		}
	}
	return out
}
