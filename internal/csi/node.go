// The node service: a published volume is mapped through the worker's
// own rnbd-client daemon (its control socket, the worker's certificate
// its identity), formatted only if it holds no file system, and mounted;
// each step is undone by the one that mirrors it, and each is idempotent.
// The kernel paths (/dev/nbdN, ublk, mkfs, mount) are tested in the VM
// tier (node_kernel_test.go, csi-sanity, the fleet scenario).

package csi

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	mount "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/blockdev"
	"github.com/rnbd/rnbd/pkg/frontend/ublk"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/mirror"
)

// Publish context keys: what ControllerPublishVolume tells the node
// about the export it is to map.
const (
	PCExport      = "export"      // the export's name on the storage node
	PCStorageNode = "storageNode" // its name in the driver's configuration
	PCPaths       = "paths"       // comma-separated: ip:SERVER or ip:CLIENT@ip:SERVER
	PCPort        = "port"        // the fabric's port ("" : the default)
	PCTransport   = "transport"   // tcp or rdma
	PCMpathPolicy = "mpathPolicy" // round-robin, min-inflight, min-latency
	PCFrontend    = "frontend"    // nbd or ublk ("": the client's default)
	PCAccess      = "access"      // ro, rw or migration: what the node's identity was granted
)

// VCFsType is the volume context's key of the StorageClass's fsType:
// the file system a stage makes where the capability names none.
const VCFsType = "fsType"

// NodeOptions are what the node service needs of its configuration.
type NodeOptions struct {
	// NodeID is the worker's identity: the name of its rnbd-client's
	// TLS certificate, which the controller grants on publish.
	NodeID string
	// Topology are its topology labels (NodeGetInfo).
	Topology map[string]string
	// NodeLabels, where set, gives more of them at each NodeGetInfo:
	// those of the worker's Kubernetes Node ([node] topology_from_node).
	NodeLabels func(context.Context) (map[string]string, error)
	// ClientSocket is its rnbd-client daemon's control socket.
	ClientSocket string
	// DeviceWait bounds how long a mapped device node takes to appear.
	DeviceWait time.Duration
	Log        *log.Entry
}

// NodeServer is the CSI node service.
type NodeServer struct {
	csi.UnimplementedNodeServer
	opts    NodeOptions
	client  *api.Client
	mounter *mount.SafeFormatAndMount
	resizer *mount.ResizeFs

	locks opLocks // volume ids with an RPC under way
}

// NewNodeServer makes the node service of opts.
func NewNodeServer(opts NodeOptions) *NodeServer {
	if opts.DeviceWait == 0 {
		opts.DeviceWait = 30 * time.Second
	}
	if opts.Log == nil {
		opts.Log = log.L
	}
	ex := utilexec.New()
	return &NodeServer{opts: opts, client: api.NewClient(ctl.Dial(opts.ClientSocket)),
		mounter: mount.NewSafeFormatAndMount(mount.New(""), ex), resizer: mount.NewResizeFs(ex)}
}

// NodeGetInfo implements csi.NodeServer.
func (n *NodeServer) NodeGetInfo(ctx context.Context, _ *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	rsp := &csi.NodeGetInfoResponse{NodeId: n.opts.NodeID}
	topo := maps.Clone(n.opts.Topology)
	if n.opts.NodeLabels != nil {
		// node-driver-registrar retries a registration that failed: the
		// API server away a moment is not a worker without a zone.
		labels, err := n.opts.NodeLabels(ctx)
		if err != nil {
			return nil, status.Errorf(codes.Unavailable, "topology: %v", err)
		}
		if topo == nil {
			topo = map[string]string{}
		}
		maps.Copy(topo, labels)
	}
	if len(topo) > 0 {
		rsp.AccessibleTopology = &csi.Topology{Segments: topo}
	}
	return rsp, nil
}

// NodeGetCapabilities implements csi.NodeServer: what is built.
func (n *NodeServer) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	var caps []*csi.NodeServiceCapability
	for _, c := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
		// The access modes SINGLE_NODE_SINGLE_WRITER (one publish at
		// most, NodePublishVolume checks) and _MULTI_WRITER.
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		caps = append(caps, &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: c}}})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

// sessName is the session a worker maps a storage node's exports in:
// its own (a server binds a session name to the identity that first
// uses it), one per storage node. A session name has no '.' nor '/'
// (RTRS's rule); node ids (host names) often have dots: such a name is
// written with '_' and made unique again by a hash of what it was.
func (n *NodeServer) sessName(storageNode string) string {
	s := n.opts.NodeID + "@" + storageNode
	if !strings.ContainsAny(s, "./") {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return strings.NewReplacer(".", "_", "/", "_").Replace(s) + "-" + hex.EncodeToString(sum[:4])
}

// legSessName is the session of a replicated volume's leg (or witness)
// on a storage node: a session of its own (the mirror closes it to fence
// the leg), named after the node's and the mirror's.
func (n *NodeServer) legSessName(storageNode, mirrorName string) string {
	sum := sha256.Sum256([]byte(mirrorName))
	return n.sessName(storageNode) + "-m" + hex.EncodeToString(sum[:4])
}

// mapping is a device the worker's rnbd-client has mapped.
type mapping struct {
	device  string // rnbdN
	devpath string // /dev/nbdN, /dev/ublkbN
	state   string
	legs    []api.CltLegRecord // a mirror's
}

// mappingOf finds the mapping of volume id: a replicated volume's
// mirror, or the export of one storage node in the worker's session to
// it. An id of neither form is InvalidArgument.
func (n *NodeServer) mappingOf(ctx context.Context, id string) (mapping, error) {
	if vname, ok := parseMirrorID(id); ok {
		return n.findMirrorMapping(ctx, vname)
	}
	storageNode, export, ok := strings.Cut(id, "/")
	if !ok {
		return mapping{}, status.Errorf(codes.InvalidArgument, "volume_id %q: want STORAGE-NODE/VOLUME or mirror:VOLUME", id)
	}
	return n.findMapping(ctx, n.sessName(storageNode), export)
}

// findMirrorMapping finds the mapping of mirror name ("" device if none).
func (n *NodeServer) findMirrorMapping(ctx context.Context, name string) (mapping, error) {
	recs, err := n.client.Devices(ctx)
	if err != nil {
		return mapping{}, clientError(err)
	}
	for _, r := range recs {
		if r.Mirror == name {
			return mapping{device: r.DevName, devpath: r.DevPath, state: r.State, legs: r.Legs}, nil
		}
	}
	return mapping{}, nil
}

// findMapping finds the mapping of export in session sess ("" device
// if none).
func (n *NodeServer) findMapping(ctx context.Context, sess, export string) (mapping, error) {
	recs, err := n.client.Devices(ctx)
	if err != nil {
		return mapping{}, clientError(err)
	}
	for _, r := range recs {
		if r.SessName == sess && r.MappingPath == export {
			return mapping{device: r.DevName, devpath: r.DevPath, state: r.State}, nil
		}
	}
	return mapping{}, nil
}

// clientError is an error of the worker's rnbd-client as a gRPC status.
func clientError(err error) error {
	return status.Errorf(grpcCode(err), "rnbd-client: %v", err)
}

// stageRequest is what NodeStageVolume needs, checked.
type stageRequest struct {
	id, staging       string
	storageNode, sess string
	export            string
	paths             []string
	port              uint16
	transport, policy string
	frontend          string
	access            string // ro, rw or migration (a second writer)
	// mirror, legs, witness and spares are a replicated volume's
	// (mirror.go): mapped as a mirror, not as export.
	mirror, adopt   string
	size            int64 // bytes of data the mirror has at least (PCSize), 0: as it is
	legs, spares    []api.Leg
	witness         *api.Leg
	readOnly, block bool
	fsType          string
	mountFlags      []string
}

func (n *NodeServer) parseStage(req *csi.NodeStageVolumeRequest) (stageRequest, error) {
	s := stageRequest{id: req.GetVolumeId(), staging: req.GetStagingTargetPath()}
	switch {
	case s.id == "":
		return s, status.Error(codes.InvalidArgument, "volume_id is missing")
	case s.staging == "":
		return s, status.Error(codes.InvalidArgument, "staging_target_path is missing")
	case req.GetVolumeCapability() == nil:
		return s, status.Error(codes.InvalidArgument, "volume_capability is missing")
	}
	pc := req.GetPublishContext()
	if pc[PCMirror] != "" {
		if err := n.parseMirrorStage(&s, pc); err != nil {
			return s, err
		}
	} else if err := n.parseExportStage(&s, pc); err != nil {
		return s, err
	}
	s.transport, s.policy, s.frontend = pc[PCTransport], pc[PCMpathPolicy], pc[PCFrontend]
	if s.frontend == "" {
		s.frontend = defaultFrontend()
	}
	vc := req.GetVolumeCapability()
	switch {
	case vc.GetBlock() != nil:
		s.block = true
	case vc.GetMount() != nil:
		// The capability's (csi.storage.k8s.io/fstype), else the
		// StorageClass's fsType the controller kept in the volume's
		// context, else ext4.
		s.fsType = vc.GetMount().GetFsType()
		if s.fsType == "" {
			s.fsType = req.GetVolumeContext()[VCFsType]
		}
		if s.fsType == "" {
			s.fsType = "ext4"
		}
		if !slices.Contains(fsTypes, s.fsType) {
			return s, status.Errorf(codes.InvalidArgument, "fsType %q: %s", s.fsType, strings.Join(fsTypes, " or "))
		}
		s.mountFlags = vc.GetMount().GetMountFlags()
	default:
		return s, status.Error(codes.InvalidArgument, "volume_capability: neither block nor mount")
	}
	if s.mirror != "" {
		// One writer, the mirror's, which also resyncs its legs.
		if accessFor(vc, false) != accessRW || pc[PCAccess] != "" && pc[PCAccess] != accessRW {
			return s, status.Errorf(codes.InvalidArgument, "volume %s is replicated: staged read-write on one node only", s.id)
		}
		s.access = accessRW
		return s, nil
	}
	// What the capability asks (accessFor, the controller's policy),
	// else, where it asks more than ro, the access the controller
	// granted (publish_context access: ro for a read-only publish,
	// migration for a second writer).
	s.access = accessFor(vc, false)
	switch a := pc[PCAccess]; a {
	case "":
	case accessRO, accessRW, accessMigration:
		if a == accessMigration && !s.block {
			return s, status.Errorf(codes.InvalidArgument, "publish_context %s %q: a second writer only for a raw block volume", PCAccess, a)
		}
		if s.access != accessRO {
			s.access = a
		}
	default:
		return s, status.Errorf(codes.InvalidArgument, "publish_context %s %q: want ro, rw or migration", PCAccess, a)
	}
	s.readOnly = s.access == accessRO
	return s, nil
}

// parseMirrorStage reads a replicated volume's publish context: its
// mirror's name, legs and witness, each a session of its own.
func (n *NodeServer) parseMirrorStage(s *stageRequest, pc map[string]string) error {
	s.mirror, s.adopt = pc[PCMirror], pc[PCAdopt]
	if vname, ok := parseMirrorID(s.id); !ok || vname != s.mirror {
		return status.Errorf(codes.InvalidArgument, "publish_context %s %q is not volume %s's", PCMirror, s.mirror, s.id)
	}
	if v, ok := pc[PCSize]; ok {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n <= 0 || n%4096 != 0 {
			return status.Errorf(codes.InvalidArgument, "publish_context %s %q: want the mirror's bytes of data, a multiple of 4096", PCSize, v)
		}
		s.size = n
	}
	var legs []legContext
	if err := json.Unmarshal([]byte(pc[PCLegs]), &legs); err != nil || len(legs) < 2 || len(legs) > mirror.MaxLegs {
		return status.Errorf(codes.InvalidArgument, "publish_context %s %q: want the JSON of 2 or 3 legs (%v)", PCLegs, pc[PCLegs], err)
	}
	leg := func(lc legContext) (api.Leg, error) {
		if lc.StorageNode == "" || lc.Export == "" || len(lc.Paths) == 0 || lc.Port < 0 || lc.Port > 65535 {
			return api.Leg{}, status.Errorf(codes.InvalidArgument, "publish_context: a member %+v without its storage node, export or paths (a node no longer configured?)", lc)
		}
		return api.Leg{SessName: n.legSessName(lc.StorageNode, s.mirror), Paths: lc.Paths, DevicePath: lc.Export, DestPort: uint16(lc.Port)}, nil
	}
	for _, lc := range legs {
		l, err := leg(lc)
		if err != nil {
			return err
		}
		s.legs = append(s.legs, l)
	}
	if w := pc[PCWitness]; w != "" {
		var lc legContext
		if err := json.Unmarshal([]byte(w), &lc); err != nil {
			return status.Errorf(codes.InvalidArgument, "publish_context %s %q: %v", PCWitness, w, err)
		}
		l, err := leg(lc)
		if err != nil {
			return err
		}
		s.witness = &l
	}
	if sp := pc[PCSpares]; sp != "" {
		var spares []legContext
		if err := json.Unmarshal([]byte(sp), &spares); err != nil || len(spares) > maxSpares {
			return status.Errorf(codes.InvalidArgument, "publish_context %s %q: want the JSON of at most %d members (%v)", PCSpares, sp, maxSpares, err)
		}
		for _, lc := range spares {
			l, err := leg(lc)
			if err != nil {
				return err
			}
			s.spares = append(s.spares, l)
		}
	}
	return nil
}

// parseExportStage reads a volume of one storage node's publish context.
func (n *NodeServer) parseExportStage(s *stageRequest, pc map[string]string) error {
	s.export, s.storageNode = pc[PCExport], pc[PCStorageNode]
	if s.export == "" || s.storageNode == "" || pc[PCPaths] == "" {
		return status.Errorf(codes.InvalidArgument, "publish_context lacks %s, %s or %s (was the volume published by rnbd-csi?)", PCExport, PCStorageNode, PCPaths)
	}
	s.sess = n.sessName(s.storageNode)
	s.paths = strings.Split(pc[PCPaths], ",")
	if p := pc[PCPort]; p != "" {
		v, err := strconv.ParseUint(p, 10, 16)
		if err != nil {
			return status.Errorf(codes.InvalidArgument, "publish_context %s %q: %v", PCPort, p, err)
		}
		s.port = uint16(v)
	}
	return nil
}

// NodeStageVolume implements csi.NodeServer: the export mapped through
// the worker's rnbd-client (a mapping already there is taken), and for
// a file system volume formatted if it holds none and mounted at the
// staging path. A failure part way undoes what this call did.
func (n *NodeServer) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	s, err := n.parseStage(req)
	if err != nil {
		return nil, err
	}
	unlock, err := n.locks.lockByVolumeID(s.id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	var m mapping
	if s.mirror != "" {
		m, err = n.findMirrorMapping(ctx, s.mirror)
	} else {
		m, err = n.findMapping(ctx, s.sess, s.export)
	}
	if err != nil {
		return nil, err
	}
	mapped := false
	if m.device == "" {
		if m, err = n.mapExport(ctx, s); err != nil {
			return nil, err
		}
		mapped = true
	}
	// A failure unmaps what no mount uses, whoever mapped it: a map
	// that timed out before (the daemon finished it) is found here, and
	// after a final error the kubelet calls no unstage.
	undo := func() {
		if !mapped && n.deviceMounted(m.devpath) {
			return
		}
		if err := n.unmap(context.Background(), m.device); err != nil {
			n.opts.Log.WithError(err).WithField("volume", s.id).Error("undoing a failed stage: unmapping failed")
		}
	}
	if err := waitDevice(ctx, m.devpath, n.opts.DeviceWait); err != nil {
		undo()
		return nil, err
	}
	if err := n.growMirror(ctx, s, m); err != nil {
		// Kept mapped: the leg that is not in sync resyncs meanwhile,
		// and the stage's retry grows it.
		return nil, err
	}
	if s.block {
		return &csi.NodeStageVolumeResponse{}, nil
	}
	if err := os.MkdirAll(s.staging, 0o750); err != nil {
		undo()
		return nil, status.Errorf(codes.Internal, "staging path %s: %v", s.staging, err)
	}
	notMnt, err := n.mounter.IsLikelyNotMountPoint(s.staging)
	if err != nil {
		undo()
		return nil, status.Errorf(codes.Internal, "staging path %s: %v", s.staging, err)
	}
	if !notMnt {
		// Staged already, if of this mapping's device: a mount of
		// another (one the daemon could not take back after a restart)
		// is no volume to publish.
		dev, _, err := mount.GetDeviceNameFromMount(n.mounter, s.staging)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "staging path %s: %v", s.staging, err)
		}
		if dev != m.devpath {
			undo()
			return nil, status.Errorf(codes.Internal, "staging path %s holds %s, but volume %s is %s now: unmount it (NodeUnstageVolume) and stage again", s.staging, dev, s.id, m.devpath)
		}
		// A retry of a stage whose growth of the file system failed
		// grows it.
		return &csi.NodeStageVolumeResponse{}, n.growFS(s, m.devpath)
	}
	opts := append([]string(nil), s.mountFlags...)
	if s.readOnly {
		// A read-only device: the journal cannot be replayed on it
		// (a volume not cleanly unmounted, a snapshot of a mounted
		// one), so the mount does not try.
		opts = append(opts, "ro", map[string]string{"ext4": "noload", "xfs": "norecovery"}[s.fsType])
	}
	// SafeFormatAndMount looks with blkid first: a device that holds
	// a file system or anything blkid knows is never formatted. What it
	// does not know (a raw block volume's database, say) is looked for
	// too: a volume never written reads zeros.
	if err := n.refuseUnknownData(m.devpath, s.id); err != nil {
		undo()
		return nil, err
	}
	if err := n.mounter.FormatAndMount(m.devpath, s.staging, s.fsType, opts); err != nil {
		undo()
		return nil, status.Errorf(codes.Internal, "mounting %s (volume %s) at %s: %v", m.devpath, s.id, s.staging, err)
	}
	if err := n.growFS(s, m.devpath); err != nil {
		return nil, err
	}
	n.opts.Log.WithFields(log.Fields{"volume": s.id, "device": m.devpath, "staging": s.staging, "fs": s.fsType}).Info("volume staged")
	return &csi.NodeStageVolumeResponse{}, nil
}

// growFS grows the file system mounted at s's staging path to its
// device dev where it is smaller (a volume restored or cloned larger
// than its source): the size the CO asked. ext4 and xfs are given to
// their grow tools (resize2fs, xfs_growfs: nothing to do is success),
// btrfs where it is smaller; another file system keeps its size (said
// in the log), as does a read-only one.
func (n *NodeServer) growFS(s stageRequest, dev string) error {
	if s.readOnly {
		return nil
	}
	need, err := n.resizer.NeedResize(dev, s.staging)
	if err != nil {
		n.opts.Log.WithError(err).WithField("volume", s.id).Warn("not checked whether the file system fills its device")
		return nil
	}
	if !need {
		return nil
	}
	if _, err := n.resizer.Resize(dev, s.staging); err != nil {
		return status.Errorf(codes.Internal, "growing the file system of %s (volume %s) at %s to its device: %v", dev, s.id, s.staging, err)
	}
	return nil
}

// growMirror grows a replicated volume's mirror to the size its publish
// context gives, where it has less: mapped by a map that could not grow
// it (a leg not in sync), or found mapped before its legs grew. A
// mirror that cannot grow yet is Unavailable, for the stage's retry.
func (n *NodeServer) growMirror(ctx context.Context, s stageRequest, m mapping) error {
	if s.mirror == "" || s.size == 0 {
		return nil
	}
	have, err := blockdev.DeviceSize(m.devpath)
	if err != nil {
		return status.Errorf(codes.Internal, "%s (volume %s): %v", m.devpath, s.id, err)
	}
	if have >= s.size {
		return nil
	}
	if err := n.client.Resize(ctx, m.device, s.size); err != nil {
		code := grpcCode(err)
		if ctl.Classify(err) == ctl.CodeBusy {
			code = codes.Unavailable // a leg resyncs or is out: later
		}
		return status.Errorf(code, "volume %s has %d bytes of the %d its legs hold; growing its mirror: %v", s.id, have, s.size, err)
	}
	if _, err := n.waitSize(ctx, m.devpath, s.size); err != nil {
		return err
	}
	n.opts.Log.WithFields(log.Fields{"volume": s.id, "was": have, "now": s.size}).Info("replicated volume's mirror grown to its legs")
	return nil
}

// deviceMounted: a mount has the block device at dev for its source.
func (n *NodeServer) deviceMounted(dev string) bool {
	mps, err := n.mounter.List()
	if err != nil {
		return true // not known: keep it
	}
	for _, mp := range mps {
		if mp.Device == dev {
			return true
		}
	}
	return false
}

// dataProbe is how much of a device's start and of its end
// refuseUnknownData reads: where file systems, partition tables and
// most formats keep their headers and backups.
const dataProbe = 1 << 20

// refuseUnknownData is FailedPrecondition where the device holds no
// signature blkid knows but is not blank: its first or last MiB has a
// byte that is not zero. Formatting it would destroy data mkfs's caller
// cannot see (a volume that was used raw, then asked for as a file
// system). A device with a file system passes: it is mounted, not
// formatted.
func (n *NodeServer) refuseUnknownData(dev, id string) error {
	format, err := n.mounter.GetDiskFormat(dev)
	if err != nil {
		return status.Errorf(codes.Internal, "blkid %s (volume %s): %v", dev, id, err)
	}
	if format != "" {
		return nil
	}
	f, err := os.Open(dev)
	if err != nil {
		return status.Errorf(codes.Internal, "%s: %v", dev, err)
	}
	defer f.Close()
	size, err := blockdev.DeviceSize(dev)
	if err != nil {
		return status.Errorf(codes.Internal, "%s: %v", dev, err)
	}
	buf := make([]byte, min(dataProbe, size))
	for _, off := range []int64{0, max(0, size-dataProbe)} {
		if _, err := f.ReadAt(buf, off); err != nil {
			return status.Errorf(codes.Internal, "reading %s (volume %s) at %d: %v", dev, id, off, err)
		}
		if i := slices.IndexFunc(buf, func(b byte) bool { return b != 0 }); i >= 0 {
			return status.Errorf(codes.FailedPrecondition, "%s (volume %s) holds data at byte %d but no file system blkid knows: not formatting it; stage it as a raw block volume, or clear it yourself if it is not needed", dev, id, off+int64(i))
		}
	}
	return nil
}

// mapExport maps s's export (or mirror) through the worker's
// rnbd-client.
func (n *NodeServer) mapExport(ctx context.Context, s stageRequest) (mapping, error) {
	m := api.Mapping{SessName: s.sess, Paths: s.paths, DevicePath: s.export, AccessMode: s.access,
		DestPort: s.port, Transport: s.transport, As: s.frontend}
	if s.mirror != "" {
		// Its first stage makes the mirror's metadata; every other
		// (and a retry of the first) assembles it.
		m = api.Mapping{Mirror: s.mirror, Adopt: s.adopt, Legs: s.legs, Witness: s.witness, Spares: s.spares, CreateIfNew: true, AccessMode: accessRW,
			Transport: s.transport, As: s.frontend}
		if s.size > 0 {
			m.Size = strconv.FormatInt(s.size, 10)
		}
	}
	if s.policy != "" {
		m.Settings.MPPolicy = &s.policy
	}
	rsp, err := n.client.Map(ctx, m)
	if err != nil {
		return mapping{}, clientError(err)
	}
	if rsp.Kernel == "" {
		// A socket: no kernel device to mount. Unmapped again.
		n.unmap(context.Background(), rsp.Device)
		return mapping{}, status.Errorf(codes.FailedPrecondition, "rnbd-client mapped volume %s as an NBD socket: this node has neither nbd nor ublk", s.id)
	}
	return mapping{device: rsp.Device, devpath: rsp.Kernel}, nil
}

// unmap unmaps a device of the worker's rnbd-client; one that is gone
// is success.
func (n *NodeServer) unmap(ctx context.Context, device string) error {
	err := n.client.Unmap(ctx, device, false)
	if err != nil && ctl.Classify(err) != ctl.CodeNotFound {
		return clientError(err)
	}
	return nil
}

// waitDevice waits for a device node to appear.
func waitDevice(ctx context.Context, path string, wait time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		if fi, err := os.Stat(path); err == nil && fi.Mode()&os.ModeDevice != 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return status.Errorf(codes.DeadlineExceeded, "device %s did not appear within %v", path, wait)
		case <-t.C:
		}
	}
}

// NodeUnstageVolume implements csi.NodeServer: the staging mount
// unmounted and the export unmapped; what is not there is success.
func (n *NodeServer) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	if id == "" || staging == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id and staging_target_path are needed")
	}
	unlock, err := n.locks.lockByVolumeID(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if err := mount.CleanupMountPoint(staging, n.mounter, true); err != nil {
		return nil, status.Errorf(codes.Internal, "unmounting %s: %v", staging, err)
	}
	m, err := n.mappingOf(ctx, id)
	if err != nil {
		return nil, err
	}
	if m.device != "" {
		if err := n.unmap(ctx, m.device); err != nil {
			return nil, err
		}
	}
	n.opts.Log.WithFields(log.Fields{"volume": id, "staging": staging}).Info("volume unstaged")
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// defaultFrontend is the frontend of a volume whose StorageClass names
// none: ublk where the kernel can grow a ublk device while it is in use
// (UPDATE_SIZE, Linux 6.16), so that a volume of a class that allows
// expansion grows in its running pod whichever it is; the nbd driver
// elsewhere. Both keep their devices across a restart of the client
// daemon (ublk's user recovery, nbd's RECONFIGURE).
func defaultFrontend() string {
	if f, err := ublk.Probe(); err == nil && f&ublk.FlagUpdateSize != 0 {
		return "ublk"
	}
	return "nbd"
}
