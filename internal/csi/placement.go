// Placement: which storage node a new volume goes to.

package csi

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/internal/ctl"
)

// matches reports whether a storage node's labels fit a topology
// segment: each key of the segment has the segment's value.
func matches(labels map[string]string, seg *csi.Topology) bool {
	for k, v := range seg.GetSegments() {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// eligible reports whether a storage node may hold a volume of ar: it
// fits one of the requisite segments (any node where none is given).
func eligible(labels map[string]string, ar *csi.TopologyRequirement) bool {
	if len(ar.GetRequisite()) == 0 {
		return true
	}
	for _, seg := range ar.GetRequisite() {
		if matches(labels, seg) {
			return true
		}
	}
	return false
}

// preference is the index of the first preferred segment a node fits
// (len(preferred) if none): lower goes first.
func preference(labels map[string]string, ar *csi.TopologyRequirement) int {
	for i, seg := range ar.GetPreferred() {
		if matches(labels, seg) {
			return i
		}
	}
	return len(ar.GetPreferred())
}

// candidate is a storage node a volume may go to, with its room.
type candidate struct {
	node        *storageNode
	allocatable int64
	pref        int
}

// order sorts candidates: the preferred topology first (the CO's
// choice, as the scheduled pod's node under WaitForFirstConsumer), then
// the most free capacity, then by name (a stable answer).
func order(cs []candidate) {
	sort.SliceStable(cs, func(i, j int) bool {
		a, b := cs[i], cs[j]
		if a.pref != b.pref {
			return a.pref < b.pref
		}
		if a.allocatable != b.allocatable {
			return a.allocatable > b.allocatable
		}
		return a.node.cfg.Name < b.node.cfg.Name
	})
}

// topologyOf is the accessible topology of a volume on a node: its
// labels, or none (accessible everywhere) where it has none.
func topologyOf(n *StorageNode) []*csi.Topology {
	if len(n.Labels) == 0 {
		return nil
	}
	seg := make(map[string]string, len(n.Labels))
	for k, v := range n.Labels {
		seg[k] = v
	}
	return []*csi.Topology{{Segments: seg}}
}

// candidates are the storage nodes a volume may go to, best first, from
// those that answer (each asked at once; silent, those that did not
// answer the lookup a moment ago, are not asked again); none is
// ResourceExhausted (no room, or no node in the topology asked) or
// Unavailable (none of those that could hold it answers).
func (c *controller) candidates(ctx context.Context, p volumeParams, ar *csi.TopologyRequirement, only *storageNode, size int64,
	silent []string) ([]candidate, error) {
	var why []string
	var asked []*storageNode
	could, unreachable := 0, 0 // the nodes that could hold it; those of them that do not answer
	for _, n := range c.nodes {
		if only != nil && n != only {
			continue
		}
		if !eligible(n.cfg.Labels, ar) {
			why = append(why, n.cfg.Name+": not in the topology asked")
			continue
		}
		if _, ok := p.pathsOn(n.cfg); !ok {
			why = append(why, n.cfg.Name+": has not the paths asked")
			continue
		}
		could++
		if slices.Contains(silent, n.cfg.Name) {
			why = append(why, n.cfg.Name+": did not answer")
			unreachable++
			continue
		}
		asked = append(asked, n)
	}
	var out []candidate
	for _, r := range each(ctx, asked, func(ctx context.Context, n *storageNode) (int64, error) { return n.allocatable(ctx, p.poolOn(n.cfg)) }) {
		switch {
		case r.err != nil:
			why = append(why, fmt.Sprintf("%s: %v", r.n.cfg.Name, r.err))
			if ctl.Classify(r.err) == ctl.CodeUnavailable {
				unreachable++
				c.m.leftOut.WithLabelValues(r.n.cfg.Name, "CreateVolume").Inc()
			}
		case r.v < size:
			why = append(why, fmt.Sprintf("%s: %d bytes allocatable", r.n.cfg.Name, r.v))
		default:
			out = append(out, candidate{node: r.n, allocatable: r.v, pref: preference(r.n.cfg.Labels, ar)})
		}
	}
	if len(out) == 0 {
		// Every node that could hold it did not answer: later, maybe.
		code := codes.ResourceExhausted
		if could > 0 && unreachable == could {
			code = codes.Unavailable
		}
		return nil, status.Errorf(code, "no storage node for a volume of %d bytes: %s", size, strings.Join(why, "; "))
	}
	order(out)
	return out, nil
}
