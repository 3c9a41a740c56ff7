// Placement: which storage node a new volume goes to.

package csi

import (
	"sort"

	"github.com/container-storage-interface/spec/lib/go/csi"
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
