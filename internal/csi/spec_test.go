package csi

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	storagev1 "k8s.io/api/storage/v1"
)

// TestTopologyAnswers: what the CSI spec answers where topology is
// involved, against two storage nodes in zones a and b and workers
// known from a Kubernetes API (CSINodes registering the zone key, Nodes
// labelled with it): a name retried with another zone's requirement is
// AlreadyExists, not the other zone's volume; a volume published to a
// worker of another zone is FailedPrecondition, nothing granted; to a
// worker of its zone it is granted; to a worker that did not register
// the key, refused.
func TestTopologyAnswers(t *testing.T) {
	reg := func(node, id string, keys ...string) storagev1.CSINode {
		return csiNode(node, storagev1.CSINodeDriver{Name: DefaultDriverName, NodeID: id, TopologyKeys: keys})
	}
	kc, _ := apiServer(t, "tok", []storagev1.CSINode{reg("k-a", "host-a", zoneKey), reg("k-b", "host-b", zoneKey), reg("k-none", "host-none")},
		map[string]map[string]string{"k-a": {zoneKey: "a"}, "k-b": {zoneKey: "b"}, "k-none": {}})
	r := newRigWith(t, rigOptions{labels: []map[string]string{{zoneKey: "a"}, {zoneKey: "b"}}, edit: func(c *Config) {
		c.Workers, c.Kubernetes = WorkersConfig{Source: WorkersKubernetes}, kc
	}})
	ctx := context.Background()
	inA := &csi.TopologyRequirement{Requisite: []*csi.Topology{zone("a")}}
	va := r.mustCreate("pvc-zoned", 64<<20, nil, inA)
	publish := func(node string) error {
		_, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: va.GetVolumeId(), NodeId: node, VolumeCapability: rwo})
		return err
	}
	for _, tc := range []struct {
		what string
		call func() error
		want codes.Code
	}{
		{"CreateVolume: the name retried with another zone's requirement", func() error {
			_, err := r.create("pvc-zoned", 64<<20, nil, &csi.TopologyRequirement{Requisite: []*csi.Topology{zone("b")}})
			return err
		}, codes.AlreadyExists},
		{"CreateVolume: the name retried with its zone", func() error {
			v, err := r.create("pvc-zoned", 64<<20, nil, inA)
			if err == nil && v.GetVolumeId() != va.GetVolumeId() {
				err = fmt.Errorf("answered %s", v.GetVolumeId())
			}
			return err
		}, codes.OK},
		{"ControllerPublishVolume: to a worker of another zone", func() error { return publish("host-b") }, codes.FailedPrecondition},
		{"ControllerPublishVolume: to a worker that reported no zone", func() error { return publish("host-none") }, codes.FailedPrecondition},
		{"ControllerPublishVolume: to a worker of its zone", func() error { return publish("host-a") }, codes.OK},
	} {
		wantCode(t, tc.what, tc.call(), tc.want)
	}
	if g := r.grants(va.GetVolumeId()); len(g) != 1 || g["host-a"] != "rw" {
		t.Errorf("grants %v: want host-a's only", g)
	}
}

// TestCSINamesUnaddressable: CSI names a URL path cannot carry as they
// are ("." and "..", a '/', a blank) are volumes all the same, under a
// name the storage node addresses: made, found again, deleted.
func TestCSINamesUnaddressable(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	for _, name := range []string{".", "..", "a/b", "with blank"} {
		v := r.mustCreate(name, 1<<20, nil, nil)
		if _, vn, ok := parseID(v.GetVolumeId()); !ok || vn == name || strings.Trim(vn, ".") == "" {
			t.Errorf("CSI name %q: volume %q", name, v.GetVolumeId())
		}
		if again := r.mustCreate(name, 1<<20, nil, nil); again.GetVolumeId() != v.GetVolumeId() {
			t.Errorf("CSI name %q again: %s, first %s", name, again.GetVolumeId(), v.GetVolumeId())
		}
		for range 2 {
			if _, err := r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()}); err != nil {
				t.Errorf("DeleteVolume of CSI name %q: %v", name, err)
			}
		}
	}
	if lv, err := r.cc.ListVolumes(ctx, &csi.ListVolumesRequest{}); err != nil || len(lv.GetEntries()) != 0 {
		t.Errorf("after the deletes: %v %v", lv.GetEntries(), err)
	}
}
