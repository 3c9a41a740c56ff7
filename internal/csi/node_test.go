package csi

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// NodeStageVolume's request is checked before anything is touched:
// each missing or bad part answers InvalidArgument; a good one gives
// the worker's own session on the storage node, and every path.
func TestParseStage(t *testing.T) {
	n := NewNodeServer(NodeOptions{NodeID: "host-a", ClientSocket: "/nonexistent"})
	mountCap := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "xfs"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY}}
	pc := map[string]string{PCExport: "pvc-1", PCStorageNode: "sn1", PCPaths: "ip:10.0.8.5,ip:10.0.9.5", PCPort: "1234"}
	good := &csi.NodeStageVolumeRequest{VolumeId: "sn1/pvc-1", StagingTargetPath: "/st", VolumeCapability: mountCap, PublishContext: pc}
	s, err := n.parseStage(good)
	if err != nil {
		t.Fatal(err)
	}
	if s.sess != "host-a@sn1" || len(s.paths) != 2 || s.port != 1234 || s.fsType != "xfs" || !s.readOnly || s.block {
		t.Fatalf("parsed %+v", s)
	}
	for name, req := range map[string]*csi.NodeStageVolumeRequest{
		"no volume id":       {StagingTargetPath: "/st", VolumeCapability: mountCap, PublishContext: pc},
		"no staging path":    {VolumeId: "sn1/pvc-1", VolumeCapability: mountCap, PublishContext: pc},
		"no capability":      {VolumeId: "sn1/pvc-1", StagingTargetPath: "/st", PublishContext: pc},
		"no publish context": {VolumeId: "sn1/pvc-1", StagingTargetPath: "/st", VolumeCapability: mountCap},
		"a bad port": {VolumeId: "sn1/pvc-1", StagingTargetPath: "/st", VolumeCapability: mountCap,
			PublishContext: map[string]string{PCExport: "pvc-1", PCStorageNode: "sn1", PCPaths: "ip:10.0.8.5", PCPort: "70000"}},
		"btrfs": {VolumeId: "sn1/pvc-1", StagingTargetPath: "/st", PublishContext: pc,
			VolumeCapability: &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "btrfs"}}}},
	} {
		if _, err := n.parseStage(req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
	}
	// The access the controller granted: ro wins over the access mode,
	// migration only for raw block, nothing else.
	rwoCap := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	blkCap := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER}}
	for _, tc := range []struct {
		vc           *csi.VolumeCapability
		access, want string
		wantReadOnly bool
		wantInvalid  bool
	}{
		{rwoCap, "", "rw", false, false},
		{rwoCap, "rw", "rw", false, false},
		{rwoCap, "ro", "ro", true, false},
		{mountCap, "rw", "ro", true, false}, // a reader mode stays ro
		{blkCap, "migration", "migration", false, false},
		{rwoCap, "migration", "", false, true},
		{rwoCap, "all", "", false, true},
	} {
		pc := map[string]string{PCExport: "pvc-1", PCStorageNode: "sn1", PCPaths: "ip:10.0.8.5", PCAccess: tc.access}
		s, err := n.parseStage(&csi.NodeStageVolumeRequest{VolumeId: "sn1/pvc-1", StagingTargetPath: "/st", VolumeCapability: tc.vc, PublishContext: pc})
		switch {
		case tc.wantInvalid && status.Code(err) != codes.InvalidArgument:
			t.Errorf("access %q on %v: %v, want InvalidArgument", tc.access, tc.vc, err)
		case !tc.wantInvalid && (err != nil || s.access != tc.want || s.readOnly != tc.wantReadOnly):
			t.Errorf("access %q on %v: %q ro=%v (%v), want %q ro=%v", tc.access, tc.vc, s.access, s.readOnly, err, tc.want, tc.wantReadOnly)
		}
	}
	// The file system: the capability's, else the StorageClass's fsType
	// the controller kept in the volume context, else ext4.
	for _, tc := range []struct{ capFs, vcFs, want string }{{"", "xfs", "xfs"}, {"ext4", "xfs", "ext4"}, {"", "", "ext4"}} {
		vc := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: tc.capFs}},
			AccessMode: rwoCap.GetAccessMode()}
		s, err := n.parseStage(&csi.NodeStageVolumeRequest{VolumeId: "sn1/pvc-1", StagingTargetPath: "/st", VolumeCapability: vc, PublishContext: pc,
			VolumeContext: map[string]string{VCFsType: tc.vcFs}})
		if err != nil || s.fsType != tc.want {
			t.Errorf("capability fs %q, StorageClass fsType %q: %q (%v), want %q", tc.capFs, tc.vcFs, s.fsType, err, tc.want)
		}
	}
	// A node id with dots (a host name): a session name without them,
	// unique to it.
	dotted := NewNodeServer(NodeOptions{NodeID: "host-a.example", ClientSocket: "/nonexistent"})
	if a, b := dotted.sessName("sn1"), NewNodeServer(NodeOptions{NodeID: "host-a_example"}).sessName("sn1"); strings.ContainsAny(a, "./") || a == b {
		t.Fatalf("session names %q and %q", a, b)
	}
	// A second RPC on a volume under way: Aborted.
	unlock, err := n.locks.lockByVolumeID("sn1/pvc-1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "sn1/pvc-1", StagingTargetPath: "/st"}); status.Code(err) != codes.Aborted {
		t.Fatalf("an RPC beside another on the same volume: %v, want Aborted", err)
	}
	unlock()
}

// A SINGLE_NODE_SINGLE_WRITER volume is published once at most: a
// second target is FailedPrecondition, the same target again success;
// SINGLE_NODE_MULTI_WRITER may be published at both. A refused target
// is not left behind (csi-sanity's next spec could not make its own). The staging
// mount is a tmpfs here (a file system volume's publish is a bind
// mount of it; no device needed).
func TestPublishSingleWriter(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root")
	}
	dir := t.TempDir()
	staging := filepath.Join(dir, "staging")
	if err := os.Mkdir(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", staging, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("mounting a tmpfs: %v", err)
	}
	n := NewNodeServer(NodeOptions{NodeID: "host-a", ClientSocket: "/nonexistent"})
	publish := func(target string, mode csi.VolumeCapability_AccessMode_Mode) error {
		_, err := n.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{VolumeId: "sn1/pvc-1",
			StagingTargetPath: staging, TargetPath: filepath.Join(dir, target), VolumeCapability: mountCap(mode)})
		return err
	}
	t.Cleanup(func() {
		for _, p := range []string{"t1", "t2", "staging"} {
			unix.Unmount(filepath.Join(dir, p), unix.MNT_DETACH)
		}
	})
	if err := publish("t1", csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER); err != nil {
		t.Fatal(err)
	}
	if err := publish("t1", csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER); err != nil {
		t.Fatalf("the same target again: %v", err)
	}
	if err := publish("t2", csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("a second target: %v, want FailedPrecondition", err)
	}
	if _, err := os.Lstat(filepath.Join(dir, "t2")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the refused target is left behind: %v", err)
	}
	if err := publish("t2", csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER); err != nil {
		t.Fatalf("a second target, SINGLE_NODE_MULTI_WRITER: %v", err)
	}
}

// A replicated volume's stage: every member a session of its own, named
// after the worker, the storage node and the mirror; read-write only;
// a publish context that is not the volume's, or without its legs, is
// InvalidArgument.
func TestParseStageMirror(t *testing.T) {
	n := NewNodeServer(NodeOptions{NodeID: "host-a", ClientSocket: "/nonexistent"})
	rwo := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	legs := `[{"storageNode":"sn1","export":"pvc-1","paths":["ip:10.0.8.5"],"port":1234},{"storageNode":"sn2","export":"pvc-1","paths":["ip:10.0.8.6","ip:10.0.9.6"]}]`
	wit := `{"storageNode":"sn3","export":"pvc-1","paths":["ip:10.0.8.7"]}`
	spares := `[{"storageNode":"sn4","export":"pvc-1","paths":["ip:10.0.8.8"]}]`
	pc := map[string]string{PCMirror: "pvc-1", PCLegs: legs, PCWitness: wit, PCSpares: spares, PCAccess: "rw"}
	s, err := n.parseStage(&csi.NodeStageVolumeRequest{VolumeId: "mirror:pvc-1", StagingTargetPath: "/st", VolumeCapability: rwo, PublishContext: pc})
	if err != nil {
		t.Fatal(err)
	}
	if s.mirror != "pvc-1" || len(s.legs) != 2 || s.witness == nil || s.access != "rw" || !s.block ||
		s.legs[0].DestPort != 1234 || len(s.legs[1].Paths) != 2 || s.witness.DevicePath != "pvc-1" ||
		len(s.spares) != 1 || s.spares[0].DevicePath != "pvc-1" || s.spares[0].Paths[0] != "ip:10.0.8.8" {
		t.Fatalf("parsed %+v", s)
	}
	sess := map[string]bool{s.legs[0].SessName: true, s.legs[1].SessName: true, s.witness.SessName: true, s.spares[0].SessName: true, n.sessName("sn1"): true}
	if len(sess) != 5 || !strings.HasPrefix(s.legs[0].SessName, "host-a@sn1-m") {
		t.Fatalf("sessions %v: each member's own, apart from the node's volumes' session", sess)
	}
	if other := n.legSessName("sn1", "pvc-2"); other == s.legs[0].SessName {
		t.Fatalf("two mirrors on one node share session %s", other)
	}
	if s.adopt != "" {
		t.Fatalf("adopt %q without the publish context's", s.adopt)
	}
	// A volume restored from a replicated volume's snapshot: its
	// members adopted, as the publish context says, and grown to the
	// size its legs hold.
	pc[PCAdopt], pc[PCSize] = "pvc-0", "134217728"
	if s, err = n.parseStage(&csi.NodeStageVolumeRequest{VolumeId: "mirror:pvc-1", StagingTargetPath: "/st", VolumeCapability: rwo, PublishContext: pc}); err != nil || s.adopt != "pvc-0" || s.size != 128<<20 {
		t.Fatalf("adopt: %q, size %d, %v", s.adopt, s.size, err)
	}
	with := func(k, v string) map[string]string {
		m := map[string]string{PCMirror: "pvc-1", PCLegs: legs, PCWitness: wit}
		if v == "" {
			delete(m, k)
		} else {
			m[k] = v
		}
		return m
	}
	reader := &csi.VolumeCapability{AccessType: rwo.AccessType,
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY}}
	for name, tc := range map[string]struct {
		id string
		pc map[string]string
		vc *csi.VolumeCapability
	}{
		"another volume's":   {"mirror:pvc-9", pc, rwo},
		"one node's id":      {"sn1/pvc-1", pc, rwo},
		"no legs":            {"mirror:pvc-1", with(PCLegs, ""), rwo},
		"one leg":            {"mirror:pvc-1", with(PCLegs, `[{"storageNode":"sn1","export":"pvc-1","paths":["ip:10.0.8.5"]}]`), rwo},
		"a leg without path": {"mirror:pvc-1", with(PCLegs, `[{"storageNode":"sn1","export":"pvc-1"},{"storageNode":"sn2","export":"pvc-1","paths":["ip:1.2.3.4"]}]`), rwo},
		"a bad port":         {"mirror:pvc-1", with(PCLegs, `[{"storageNode":"sn1","export":"pvc-1","paths":["ip:1.2.3.4"],"port":70000},{"storageNode":"sn2","export":"pvc-1","paths":["ip:1.2.3.5"]}]`), rwo},
		"a bad witness":      {"mirror:pvc-1", with(PCWitness, `{"storageNode":`), rwo},
		"bad spares":         {"mirror:pvc-1", with(PCSpares, `{"storageNode":"sn4"}`), rwo},
		"a spare, no paths":  {"mirror:pvc-1", with(PCSpares, `[{"storageNode":"sn4","export":"pvc-1"}]`), rwo},
		"four spares":        {"mirror:pvc-1", with(PCSpares, "["+strings.Repeat(`{"storageNode":"sn4","export":"pvc-1","paths":["ip:1.2.3.4"]},`, 3)+`{"storageNode":"sn5","export":"pvc-1","paths":["ip:1.2.3.4"]}]`), rwo},
		"read-only":          {"mirror:pvc-1", with(PCAccess, "ro"), rwo},
		"a size not of 4096": {"mirror:pvc-1", with(PCSize, "1000"), rwo},
		"a size of no bytes": {"mirror:pvc-1", with(PCSize, "0"), rwo},
		"a size not a size":  {"mirror:pvc-1", with(PCSize, "1GiB"), rwo},
		"a reader mode":      {"mirror:pvc-1", pc, reader},
	} {
		if _, err := n.parseStage(&csi.NodeStageVolumeRequest{VolumeId: tc.id, StagingTargetPath: "/st", VolumeCapability: tc.vc, PublishContext: tc.pc}); status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
	}
}
