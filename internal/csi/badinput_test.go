package csi

import (
	"context"
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/pkg/log"
)

// TestBadInput: bad input to each RPC that takes any answers the code
// the CSI spec gives for it, through gRPC as the sidecars call, against
// the controller on two real storage nodes and a node service: a
// missing id or path or capability is InvalidArgument, an access mode
// or parameter rnbd-csi does not serve is InvalidArgument, a volume,
// snapshot or node that is not there is NotFound, a size over what any
// storage node has free is ResourceExhausted, a size no block multiple
// fits is OutOfRange, a name reused with other parameters is
// AlreadyExists, a page token not ours is Aborted, a publish before
// the stage is FailedPrecondition. Nothing is made by any of them.
func TestBadInput(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()

	cfg := DefaultConfig()
	cfg.Node.NodeID, cfg.Node.ClientSocket = "host-1", filepath.Join(t.TempDir(), "none.sock")
	nd, err := NewDriver(cfg, ModeNode, log.Discard())
	if err != nil {
		t.Fatal(err)
	}
	nc := csi.NewNodeClient(serveDriver(t, nd))

	caps := func(c ...*csi.VolumeCapability) []*csi.VolumeCapability { return c }
	noAccess := &csi.VolumeCapability{AccessMode: rwo.GetAccessMode()}
	unknownMode := mountCap(csi.VolumeCapability_AccessMode_UNKNOWN)
	used := r.mustCreate("pvc-used", 64<<20, nil, nil)
	vid := used.GetVolumeId()
	cr := func(req int64) *csi.CapacityRange { return &csi.CapacityRange{RequiredBytes: req} }
	missing := filepath.Join(t.TempDir(), "not-there")
	// A volume of the storage node the driver did not make (no csi.name
	// label): not the driver's to delete.
	foreign := api.NewServer(r.admin["node-a"])
	if _, err := foreign.CreateVolume(ctx, api.VolumeRequest{Name: "admins", Pool: "files", Size: "1MiB"}); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		rpc, what string
		call      func() error
		want      codes.Code
	}{
		// CreateVolume
		{"CreateVolume", "no name", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{VolumeCapabilities: caps(rwo)})
			return err
		}, codes.InvalidArgument},
		{"CreateVolume", "no capabilities", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x"})
			return err
		}, codes.InvalidArgument},
		{"CreateVolume", "a capability with neither block nor mount", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(noAccess)})
			return err
		}, codes.InvalidArgument},
		{"CreateVolume", "unknown access mode", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(unknownMode)})
			return err
		}, codes.InvalidArgument},
		{"CreateVolume", "multi-node writer on a file system", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER))})
			return err
		}, codes.InvalidArgument},
		{"CreateVolume", "unknown parameter", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(rwo), Parameters: map[string]string{"colour": "red"}})
			return err
		}, codes.InvalidArgument},
		{"CreateVolume", "replicas 4", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(rwo), Parameters: map[string]string{"replicas": "4"}})
			return err
		}, codes.InvalidArgument},
		{"CreateVolume", "replicas 3 on two storage nodes", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(rwo), Parameters: map[string]string{"replicas": "3"}})
			if err != nil && !strings.Contains(err.Error(), "replicas 3 needs") {
				return fmt.Errorf("%w (it must say what replicas 3 needs)", err)
			}
			return err
		}, codes.ResourceExhausted},
		{"CreateVolume", "replicas 2, spreadBy a label no node has", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(rwo), Parameters: map[string]string{"replicas": "2", "spreadBy": "rack"}})
			return err
		}, codes.ResourceExhausted},
		{"ControllerPublishVolume", "a replicated volume that is not there", func() error {
			_, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "mirror:nope", NodeId: "host-1", VolumeCapability: rwo})
			return err
		}, codes.NotFound},
		{"CreateVolume", "bad transport", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(rwo), Parameters: map[string]string{"transport": "udp"}})
			return err
		}, codes.InvalidArgument},
		{"CreateVolume", "required over limit", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(rwo), CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 20, LimitBytes: 1 << 20}})
			return err
		}, codes.InvalidArgument},
		{"CreateVolume", "more than any storage node has", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(rwo), CapacityRange: cr(1 << 60)})
			return err
		}, codes.ResourceExhausted},
		{"CreateVolume", "a size no volume can have", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(rwo), CapacityRange: cr(math.MaxInt64)})
			return err
		}, codes.OutOfRange},
		{"CreateVolume", "a limit under the block size", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(rwo), CapacityRange: &csi.CapacityRange{RequiredBytes: 100, LimitBytes: 200}})
			return err
		}, codes.OutOfRange},
		{"CreateVolume", "a source volume that is not there", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(rwo), VolumeContentSource: &csi.VolumeContentSource{
				Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: "node-a/nope"}}}})
			return err
		}, codes.NotFound},
		{"CreateVolume", "a source snapshot that is not there", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(rwo), VolumeContentSource: &csi.VolumeContentSource{
				Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "node-b/nope"}}}})
			return err
		}, codes.NotFound},
		{"CreateVolume", "a source smaller than asked: the clone larger than its limit", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(rwo), CapacityRange: &csi.CapacityRange{RequiredBytes: 4096, LimitBytes: 1 << 20},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: vid}}}})
			return err
		}, codes.OutOfRange},
		{"CreateVolume", "a name reused with another size", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-used", VolumeCapabilities: caps(rwo), CapacityRange: cr(128 << 20)})
			return err
		}, codes.AlreadyExists},
		{"CreateVolume", "a name reused with a capacity range its size is in: the volume there", func() error {
			v, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-used", VolumeCapabilities: caps(rwo),
				CapacityRange: &csi.CapacityRange{RequiredBytes: 32 << 20, LimitBytes: 128 << 20}})
			if err == nil && (v.GetVolume().GetVolumeId() != vid || v.GetVolume().GetCapacityBytes() != 64<<20) {
				err = fmt.Errorf("answered %v, not the volume there", v.GetVolume())
			}
			return err
		}, codes.OK},
		{"CreateVolume", "a name reused with a limit under its size", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-used", VolumeCapabilities: caps(rwo),
				CapacityRange: &csi.CapacityRange{RequiredBytes: 4096, LimitBytes: 32 << 20}})
			return err
		}, codes.AlreadyExists},
		{"CreateVolume", "a file system rnbd-csi does not make", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(&csi.VolumeCapability{
				AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ntfs"}}, AccessMode: rwo.GetAccessMode()})})
			return err
		}, codes.InvalidArgument},
		{"CreateVolume", "a StorageClass fsType rnbd-csi does not make", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x", VolumeCapabilities: caps(rwo), Parameters: map[string]string{"fsType": "btrfs"}})
			return err
		}, codes.InvalidArgument},
		{"CreateVolume", "a name reused with other parameters", func() error {
			_, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-used", VolumeCapabilities: caps(rwo), CapacityRange: cr(64 << 20),
				Parameters: map[string]string{"mpathPolicy": "round-robin"}})
			return err
		}, codes.AlreadyExists},

		// DeleteVolume
		{"DeleteVolume", "no volume id", func() error {
			_, err := r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{})
			return err
		}, codes.InvalidArgument},
		{"DeleteVolume", "a volume the driver did not make", func() error {
			_, err := r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "node-a/admins"})
			return err
		}, codes.FailedPrecondition},

		// ControllerPublishVolume
		{"ControllerPublishVolume", "no volume id", func() error {
			_, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{NodeId: "h", VolumeCapability: rwo})
			return err
		}, codes.InvalidArgument},
		{"ControllerPublishVolume", "no node id", func() error {
			_, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vid, VolumeCapability: rwo})
			return err
		}, codes.InvalidArgument},
		{"ControllerPublishVolume", "no capability", func() error {
			_, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vid, NodeId: "h"})
			return err
		}, codes.InvalidArgument},
		{"ControllerPublishVolume", "unknown access mode", func() error {
			_, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vid, NodeId: "h", VolumeCapability: unknownMode})
			return err
		}, codes.InvalidArgument},
		{"ControllerPublishVolume", "a volume that is not there", func() error {
			_, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "node-a/nope", NodeId: "h", VolumeCapability: rwo})
			return err
		}, codes.NotFound},
		{"ControllerPublishVolume", "a volume id of a storage node not configured", func() error {
			_, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "node-z/pvc-used", NodeId: "h", VolumeCapability: rwo})
			return err
		}, codes.NotFound},
		{"ControllerPublishVolume", "a node no worker has", func() error {
			_, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vid, NodeId: "nobody", VolumeCapability: rwo})
			return err
		}, codes.NotFound},

		// ControllerUnpublishVolume
		{"ControllerUnpublishVolume", "no volume id", func() error {
			_, err := r.cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{NodeId: "h"})
			return err
		}, codes.InvalidArgument},

		// ValidateVolumeCapabilities
		{"ValidateVolumeCapabilities", "no volume id", func() error {
			_, err := r.cc.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeCapabilities: caps(rwo)})
			return err
		}, codes.InvalidArgument},
		{"ValidateVolumeCapabilities", "no capabilities", func() error {
			_, err := r.cc.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: vid})
			return err
		}, codes.InvalidArgument},
		{"ValidateVolumeCapabilities", "a volume that is not there", func() error {
			_, err := r.cc.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: "node-b/nope", VolumeCapabilities: caps(rwo)})
			return err
		}, codes.NotFound},

		// ControllerExpandVolume
		{"ControllerExpandVolume", "below its size: a volume does not shrink", func() error {
			_, err := r.cc.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vid, CapacityRange: cr(32 << 20)})
			return err
		}, codes.OutOfRange},
		{"ControllerExpandVolume", "no volume id", func() error {
			_, err := r.cc.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{CapacityRange: cr(1 << 30)})
			return err
		}, codes.InvalidArgument},
		{"ControllerExpandVolume", "no capacity range", func() error {
			_, err := r.cc.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vid})
			return err
		}, codes.InvalidArgument},
		{"ControllerExpandVolume", "a volume that is not there", func() error {
			_, err := r.cc.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "node-a/nope", CapacityRange: cr(1 << 30)})
			return err
		}, codes.NotFound},
		{"ControllerExpandVolume", "more than its storage node has", func() error {
			_, err := r.cc.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vid, CapacityRange: cr(1 << 60)})
			return err
		}, codes.ResourceExhausted},

		// GetCapacity
		{"GetCapacity", "unknown access mode", func() error {
			_, err := r.cc.GetCapacity(ctx, &csi.GetCapacityRequest{VolumeCapabilities: caps(unknownMode)})
			return err
		}, codes.InvalidArgument},
		{"GetCapacity", "unknown parameter", func() error {
			_, err := r.cc.GetCapacity(ctx, &csi.GetCapacityRequest{Parameters: map[string]string{"colour": "red"}})
			return err
		}, codes.InvalidArgument},

		// ListVolumes, ListSnapshots
		{"ListVolumes", "a token not ours", func() error {
			_, err := r.cc.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: "page-2"})
			return err
		}, codes.Aborted},
		{"ListVolumes", "negative max_entries", func() error {
			_, err := r.cc.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: -1})
			return err
		}, codes.InvalidArgument},
		{"ListSnapshots", "a token not ours", func() error {
			_, err := r.cc.ListSnapshots(ctx, &csi.ListSnapshotsRequest{StartingToken: "page-2"})
			return err
		}, codes.Aborted},

		// CreateSnapshot, DeleteSnapshot
		{"CreateSnapshot", "no name", func() error {
			_, err := r.cc.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: vid})
			return err
		}, codes.InvalidArgument},
		{"CreateSnapshot", "no source volume id", func() error {
			_, err := r.cc.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-x"})
			return err
		}, codes.InvalidArgument},
		{"CreateSnapshot", "unknown parameter", func() error {
			_, err := r.cc.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-x", SourceVolumeId: vid, Parameters: map[string]string{"colour": "red"}})
			return err
		}, codes.InvalidArgument},
		{"CreateSnapshot", "a source volume that is not there", func() error {
			_, err := r.cc.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-x", SourceVolumeId: "node-a/nope"})
			return err
		}, codes.NotFound},
		{"DeleteSnapshot", "no snapshot id", func() error {
			_, err := r.cc.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{})
			return err
		}, codes.InvalidArgument},

		// NodeStageVolume, NodeUnstageVolume
		{"NodeStageVolume", "no volume id", func() error {
			_, err := nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{StagingTargetPath: missing, VolumeCapability: rwo, PublishContext: map[string]string{PCExport: "pvc-used"}})
			return err
		}, codes.InvalidArgument},
		{"NodeStageVolume", "no staging path", func() error {
			_, err := nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vid, VolumeCapability: rwo, PublishContext: map[string]string{PCExport: "pvc-used"}})
			return err
		}, codes.InvalidArgument},
		{"NodeStageVolume", "no capability", func() error {
			_, err := nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vid, StagingTargetPath: missing, PublishContext: map[string]string{PCExport: "pvc-used"}})
			return err
		}, codes.InvalidArgument},
		{"NodeStageVolume", "a capability with neither block nor mount", func() error {
			_, err := nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vid, StagingTargetPath: missing, VolumeCapability: noAccess, PublishContext: map[string]string{PCExport: "pvc-used"}})
			return err
		}, codes.InvalidArgument},
		{"NodeStageVolume", "no publish context", func() error {
			_, err := nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vid, StagingTargetPath: missing, VolumeCapability: rwo})
			return err
		}, codes.InvalidArgument},
		{"NodeUnstageVolume", "no volume id", func() error {
			_, err := nc.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{StagingTargetPath: missing})
			return err
		}, codes.InvalidArgument},
		{"NodeUnstageVolume", "no staging path", func() error {
			_, err := nc.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vid})
			return err
		}, codes.InvalidArgument},

		// NodePublishVolume, NodeUnpublishVolume
		{"NodePublishVolume", "no volume id", func() error {
			_, err := nc.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{TargetPath: missing, StagingTargetPath: missing, VolumeCapability: rwo})
			return err
		}, codes.InvalidArgument},
		{"NodePublishVolume", "no target path", func() error {
			_, err := nc.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vid, StagingTargetPath: missing, VolumeCapability: rwo})
			return err
		}, codes.InvalidArgument},
		{"NodePublishVolume", "no capability", func() error {
			_, err := nc.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vid, TargetPath: missing, StagingTargetPath: missing})
			return err
		}, codes.InvalidArgument},
		{"NodePublishVolume", "no staging path (the volume is staged first)", func() error {
			_, err := nc.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vid, TargetPath: missing, VolumeCapability: rwo})
			return err
		}, codes.FailedPrecondition},
		{"NodePublishVolume", "a file system volume not staged (nothing mounted at the staging path)", func() error {
			_, err := nc.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vid, TargetPath: missing, StagingTargetPath: t.TempDir(), VolumeCapability: rwo})
			return err
		}, codes.FailedPrecondition},
		{"NodeUnpublishVolume", "no volume id", func() error {
			_, err := nc.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{TargetPath: missing})
			return err
		}, codes.InvalidArgument},
		{"NodeUnpublishVolume", "no target path", func() error {
			_, err := nc.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vid})
			return err
		}, codes.InvalidArgument},

		// NodeGetVolumeStats, NodeExpandVolume
		{"NodeGetVolumeStats", "no volume id", func() error {
			_, err := nc.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumePath: missing})
			return err
		}, codes.InvalidArgument},
		{"NodeGetVolumeStats", "no volume path", func() error {
			_, err := nc.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: vid})
			return err
		}, codes.InvalidArgument},
		{"NodeGetVolumeStats", "a path that is not there", func() error {
			_, err := nc.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: vid, VolumePath: missing})
			return err
		}, codes.NotFound},
		{"NodeExpandVolume", "no volume id", func() error {
			_, err := nc.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumePath: missing, CapacityRange: cr(1 << 30)})
			return err
		}, codes.InvalidArgument},
		{"NodeExpandVolume", "no volume path", func() error {
			_, err := nc.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: vid, CapacityRange: cr(1 << 30)})
			return err
		}, codes.InvalidArgument},
		{"NodeExpandVolume", "a volume not staged here", func() error {
			_, err := nc.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: vid, VolumePath: missing, CapacityRange: cr(1 << 30)})
			return err
		}, codes.NotFound},
	} {
		wantCode(t, tc.rpc+", "+tc.what, tc.call(), tc.want)
	}

	// Nothing made: the one volume there was, at its size, granted to
	// nobody.
	lv, err := r.cc.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(lv.GetEntries()) != 1 || lv.GetEntries()[0].GetVolume().GetCapacityBytes() != 64<<20 {
		t.Errorf("volumes after bad input: %v", lv.GetEntries())
	}
	if g := r.grants(vid); len(g) != 0 {
		t.Errorf("grants after bad input: %v", g)
	}
	if _, err := foreign.Volume(ctx, "admins"); err != nil {
		t.Errorf("the volume the driver did not make, after a DeleteVolume of it: %v", err)
	}
	ls, err := r.cc.ListSnapshots(ctx, &csi.ListSnapshotsRequest{})
	if err != nil || len(ls.GetEntries()) != 0 {
		t.Errorf("snapshots after bad input: %v, %v", ls.GetEntries(), err)
	}

	// What the access modes allow: multi-node writer on raw block.
	if _, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "blk", VolumeCapabilities: caps(blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER))}); err != nil {
		t.Error("multi-node writer on raw block:", err)
	}
}
