// The node service after the stage: a staged volume published into a
// pod (a bind mount of the staging mount, or of the device for a raw
// block volume) and unpublished, its file system grown after the
// controller grew the volume, its stats and its health.

package csi

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	mount "k8s.io/mount-utils"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/pkg/blockdev"
)

// NodePublishVolume implements csi.NodeServer: the staging mount bound
// at the target (a file system volume), or the device node bound on a
// file at the target (a block volume); read-only when asked.
func (n *NodeServer) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	id, staging, target := req.GetVolumeId(), req.GetStagingTargetPath(), req.GetTargetPath()
	switch {
	case id == "" || target == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id and target_path are needed")
	case req.GetVolumeCapability() == nil:
		return nil, status.Error(codes.InvalidArgument, "volume_capability is missing")
	case staging == "":
		return nil, status.Error(codes.FailedPrecondition, "staging_target_path is missing: the volume is staged first")
	}
	unlock, err := n.locks.lockByVolumeID(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	opts := []string{"bind"}
	if req.GetReadonly() {
		opts = append(opts, "ro")
	}
	source, block := staging, req.GetVolumeCapability().GetBlock() != nil
	if block {
		m, err := n.mappingOf(ctx, id)
		if status.Code(err) == codes.InvalidArgument {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not staged on this node", id)
		}
		if err != nil {
			return nil, err
		}
		if m.device == "" {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not staged on this node", id)
		}
		source = m.devpath
	} else if notMnt, err := n.mounter.IsLikelyNotMountPoint(staging); err != nil || notMnt {
		// Bound anyway, the pod would write to the node's own disk.
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not staged at %s (no file system mounted there)", id, staging)
	}
	if req.GetVolumeCapability().GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
		// Published once at most: any other mount of what the target
		// would bind (the staging mount, or the device node) is a
		// publish at another target. Checked before the target is
		// made, so a refusal leaves nothing behind.
		refs, err := mount.SearchMountPoints(source, "/proc/self/mountinfo")
		if err != nil {
			return nil, status.Errorf(codes.Internal, "mounts of %s: %v", source, err)
		}
		for _, r := range refs {
			if r != filepath.Clean(target) && r != source {
				return nil, status.Errorf(codes.FailedPrecondition, "volume %s is published at %s already: its access mode SINGLE_NODE_SINGLE_WRITER allows one publish", id, r)
			}
		}
	}
	// The target: a file to bind the device node on (block), a
	// directory to bind the staging mount on; removed again if this
	// call made it and the bind fails.
	_, err = os.Lstat(target)
	made := errors.Is(err, os.ErrNotExist)
	if block {
		if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
			return nil, status.Errorf(codes.Internal, "%s: %v", target, err)
		}
		f, err := os.OpenFile(target, os.O_CREATE, 0o640)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "%s: %v", target, err)
		}
		f.Close()
	} else if err := os.MkdirAll(target, 0o750); err != nil {
		return nil, status.Errorf(codes.Internal, "%s: %v", target, err)
	}
	notMnt, err := n.mounter.IsLikelyNotMountPoint(target)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "%s: %v", target, err)
	}
	if !notMnt {
		return &csi.NodePublishVolumeResponse{}, nil // published already
	}
	if err := n.mounter.Mount(source, target, "", opts); err != nil {
		if made {
			os.Remove(target)
		}
		return nil, status.Errorf(codes.Internal, "binding %s at %s: %v", source, target, err)
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

// NodeUnpublishVolume implements csi.NodeServer: the target unmounted
// and removed; one that is not there is success.
func (n *NodeServer) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	if id == "" || target == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id and target_path are needed")
	}
	unlock, err := n.locks.lockByVolumeID(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if err := mount.CleanupMountPoint(target, n.mounter, true); err != nil {
		return nil, status.Errorf(codes.Internal, "unmounting %s: %v", target, err)
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// NodeExpandVolume implements csi.NodeServer: once the mapping has
// learnt the size asked (its size poll; a replicated volume's mirror
// grown by its rnbd-client), the file system grown online (resize2fs,
// xfs_growfs).
func (n *NodeServer) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	if id == "" || path == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id and volume_path are needed")
	}
	unlock, err := n.locks.lockByVolumeID(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if _, ok := parseMirrorID(id); !ok && !strings.Contains(id, "/") {
		// Not an id this driver gives: no such volume.
		return nil, status.Errorf(codes.NotFound, "volume_id %q: no volume (ids are STORAGE-NODE/VOLUME or mirror:VOLUME)", id)
	}
	// The path first: the answer for one that is not there needs not
	// the client daemon.
	if _, err := os.Stat(path); errors.Is(err, fs.ErrNotExist) {
		return nil, status.Errorf(codes.NotFound, "volume path %s: %v", path, err)
	}
	m, err := n.mappingOf(ctx, id)
	if err != nil {
		return nil, err
	}
	if m.device == "" {
		return nil, status.Errorf(codes.NotFound, "volume %s is not staged on this node", id)
	}
	want := req.GetCapacityRange().GetRequiredBytes()
	if _, ok := parseMirrorID(id); ok && want > 0 {
		// Its legs grew (ControllerExpandVolume); the mirror grows
		// here, when its legs' sessions see them grown.
		if err := n.client.Resize(ctx, m.device, want); err != nil {
			return nil, clientError(err)
		}
	}
	// The storage node grew the volume (ControllerExpandVolume): the
	// mapping learns it by its size poll (rnbd.DefaultSizePoll, 5 s),
	// waited for here.
	size, err := n.waitSize(ctx, m.devpath, want)
	if err != nil {
		return nil, err
	}
	if req.GetVolumeCapability().GetBlock() != nil {
		return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
	}
	if _, err := n.resizer.Resize(m.devpath, path); err != nil {
		return nil, status.Errorf(codes.Internal, "growing the file system of %s at %s: %v", m.devpath, path, err)
	}
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}

// sizeWait bounds how long NodeExpandVolume waits for a mapping to
// learn a volume's new size: two of the client's size polls, and more.
const sizeWait = 15 * time.Second

// waitSize waits until the block device at path is at least want bytes
// (want 0: as it is), and answers its size.
func (n *NodeServer) waitSize(ctx context.Context, path string, want int64) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, sizeWait)
	defer cancel()
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		size, err := blockdev.DeviceSize(path)
		if err != nil {
			return 0, status.Errorf(codes.Internal, "%s: %v", path, err)
		}
		if size >= want {
			return size, nil
		}
		select {
		case <-ctx.Done():
			if strings.HasPrefix(path, "/dev/ublkb") {
				// ublk learnt UPDATE_SIZE in Linux 6.16.
				return 0, status.Errorf(codes.FailedPrecondition, "%s is %d bytes, %d asked: a ublk device grows online only on Linux 6.16 and later; unstage and stage the volume again (or map it with frontend nbd)", path, size, want)
			}
			return 0, status.Errorf(codes.Unavailable, "%s is %d bytes, %d asked: the mapping did not learn the volume's new size within %v (was the volume grown on its storage node?)", path, size, want, sizeWait)
		case <-t.C:
		}
	}
}

// NodeGetVolumeStats implements csi.NodeServer: bytes and inodes of a
// mounted volume, a block volume's size.
func (n *NodeServer) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	if id == "" || path == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id and volume_path are needed")
	}
	fi, err := os.Stat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.NotFound, "volume path %s: %v", path, err)
	} else if err != nil {
		return nil, status.Errorf(codes.Internal, "volume path %s: %v", path, err)
	}
	rsp := &csi.NodeGetVolumeStatsResponse{}
	if !fi.IsDir() {
		size, err := blockdev.DeviceSize(path)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "%s: %v", path, err)
		}
		rsp.Usage = []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}}
		return rsp, nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return nil, status.Errorf(codes.Internal, "statfs %s: %v", path, err)
	}
	bs := int64(st.Bsize)
	rsp.Usage = []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: int64(st.Blocks) * bs, Available: int64(st.Bavail) * bs, Used: int64(st.Blocks-st.Bfree) * bs},
		{Unit: csi.VolumeUsage_INODES, Total: int64(st.Files), Available: int64(st.Ffree), Used: int64(st.Files - st.Ffree)},
	}
	return rsp, nil
}

// NodeGetVolumeHealth implements csi.NodeServer: INACCESSIBLE, with
// the reason, when the volume's session has no path connected (IO waits,
// then fails past the client's no-path timeout); healthy otherwise.
func (n *NodeServer) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is missing")
	}
	h := &csi.VolumeHealth{VolumeId: id}
	if vname, ok := parseMirrorID(id); ok {
		h.HealthStatuses = n.mirrorHealth(ctx, vname)
	} else if msg := n.noPath(ctx, id); msg != "" {
		h.HealthStatuses = []*csi.VolumeHealth_VolumeHealthEntry{{Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: "NoPath", Message: msg}}
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: h}, nil
}

// noPath says why volume id's session has no path connected ("" when
// one is).
func (n *NodeServer) noPath(ctx context.Context, id string) string {
	storageNode, _, _ := parseID(id)
	rec, err := n.client.Session(ctx, n.sessName(storageNode))
	if err != nil {
		return fmt.Sprintf("rnbd-client: %v", err)
	}
	if rec.ActPathCnt > 0 {
		return ""
	}
	return "no path of the volume's session is connected"
}

// mirrorHealth is a replicated volume's health, from its mapping's
// record: INACCESSIBLE where the mirror serves no IO (not mapped here,
// failed, or waiting to assemble), DEGRADED where a leg is out or being
// resynced (the legs' states and a resync's progress in the message);
// healthy (none) where every leg is in sync.
func (n *NodeServer) mirrorHealth(ctx context.Context, vname string) []*csi.VolumeHealth_VolumeHealthEntry {
	m, err := n.findMirrorMapping(ctx, vname)
	entry := func(t csi.VolumeHealthErrorType, reason, msg string) []*csi.VolumeHealth_VolumeHealthEntry {
		return []*csi.VolumeHealth_VolumeHealthEntry{{Status: t, Reason: reason, Message: msg}}
	}
	switch {
	case err != nil:
		return entry(csi.VolumeHealthErrorType_INACCESSIBLE, "ClientUnavailable", fmt.Sprintf("rnbd-client: %v", err))
	case m.device == "":
		return entry(csi.VolumeHealthErrorType_INACCESSIBLE, "NotMapped", "the volume's mirror is not mapped on this node")
	case m.state == "open":
		return nil
	case m.state != "degraded":
		return entry(csi.VolumeHealthErrorType_INACCESSIBLE, "MirrorNotServing", fmt.Sprintf("the volume's mirror is %q: %s", m.state, legWords(m.legs)))
	}
	reason := "LegOut"
	for _, l := range m.legs {
		if l.State == "resyncing" {
			reason = "Resyncing"
		}
	}
	return entry(csi.VolumeHealthErrorType_DEGRADED, reason, "the volume's mirror is degraded: "+legWords(m.legs))
}

// legWords says a mirror's legs' states: "leg 0 in sync, leg 1 resyncing
// (12582912 of 67108864 bytes), witness voting".
func legWords(legs []api.CltLegRecord) string {
	var out []string
	for _, l := range legs {
		s := l.Leg + " " + l.State
		if l.State == "resyncing" && l.ResyncTotal > 0 {
			s += fmt.Sprintf(" (%d of %d bytes)", l.Resync, l.ResyncTotal)
		}
		out = append(out, s)
	}
	return strings.Join(out, ", ")
}
