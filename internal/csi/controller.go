// The controller service: volumes and snapshots on the storage nodes,
// through their admin API with the provisioner's certificate.

package csi

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/log"
)

// Labels the controller keeps with each volume it makes: the CSI name
// (a retry finds the volume by it; another name mapped to the same
// volume name is told apart), and the parameters it was made with (a
// name reused with others is AlreadyExists: the storage node compares
// labels).
const (
	labelName   = "csi.name"
	labelParams = "csi.params"
)

// blockSize: volume sizes are multiples of it (the pools').
const blockSize = 4096

// defaultSize is a volume's size where the request gives no capacity.
const defaultSize = 1 << 30

type controller struct {
	csi.UnimplementedControllerServer
	cfg   Config
	log   *log.Entry
	nodes []*storageNode
	// workers are the worker nodes a volume may be published to.
	workers workers

	// busy are the volumes (CSI names, volume and snapshot ids) with an
	// operation under way: another on the same is Aborted.
	busy inFlight
}

func newController(cfg Config, l *log.Entry) (*controller, error) {
	tc, err := cfg.TLS.Config()
	if err != nil {
		return nil, err
	}
	w, err := newWorkers(cfg.Workers, cfg.Kubernetes, cfg.DriverName)
	if err != nil {
		return nil, err
	}
	c := &controller{cfg: cfg, log: l, workers: w}
	for i := range cfg.StorageNodes {
		n := &cfg.StorageNodes[i]
		cl, err := ctl.DialTLS(n.Admin, tc)
		if err != nil {
			return nil, fmt.Errorf("storage_node %s: %w", n.Name, err)
		}
		c.nodes = append(c.nodes, &storageNode{cfg: n, api: api.NewServer(cl), c: cl})
	}
	return c, nil
}

// lock marks key busy; a key already busy is Aborted (the CO retries).
func (c *controller) lock(key string) (func(), error) { return c.busy.lock(key) }

func (c *controller) node(name string) *storageNode {
	for _, n := range c.nodes {
		if n.cfg.Name == name {
			return n
		}
	}
	return nil
}

var storageNameRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,128}$`)

// storageName is the name on a storage node of the volume or snapshot
// of a CSI name: the name itself where it is one a pool takes (pvc-…,
// snapshot-…), else a readable part and a hash of it, so that a retry
// finds the same.
func storageName(csiName string) string {
	if storageNameRE.MatchString(csiName) {
		return csiName
	}
	var b strings.Builder
	for _, r := range csiName {
		if b.Len() >= 40 {
			break
		}
		if r < 128 && storageNameRE.MatchString(string(r)) {
			b.WriteRune(r)
		} else {
			b.WriteByte('-')
		}
	}
	sum := sha256.Sum256([]byte(csiName))
	return "csi-" + b.String() + "-" + hex.EncodeToString(sum[:8])
}

// splitID reads an id "<storage-node>/<name>"; ok false where it is not
// one.
func splitID(id string) (node, name string, ok bool) {
	node, name, ok = strings.Cut(id, "/")
	if !ok || node == "" || !storageNameRE.MatchString(name) {
		return "", "", false
	}
	return node, name, true
}

// volumeParams are a StorageClass's parameters.
type volumeParams struct {
	pool, fsType, transport, mpathPolicy string
	// frontend is the node's (nbd or ublk): not part of what makes
	// the volume, so not in canonical.
	frontend     string
	paths        []string
	writeThrough bool
}

var mpathPolicies = []string{"round-robin", "min-inflight", "min-latency"}

// parseParams reads the parameters; an unknown one is InvalidArgument
// (a typo must not be ignored), except the CO's own
// (csi.storage.k8s.io/…).
func parseParams(m map[string]string) (volumeParams, error) {
	var p volumeParams
	for k, v := range m {
		switch k {
		case "pool":
			p.pool = v
		case "fsType":
			p.fsType = v
		case "transport":
			if v != "tcp" && v != "rdma" {
				return p, status.Errorf(codes.InvalidArgument, "parameter transport %q: want tcp or rdma", v)
			}
			p.transport = v
		case "mpathPolicy":
			if !slices.Contains(mpathPolicies, v) {
				return p, status.Errorf(codes.InvalidArgument, "parameter mpathPolicy %q: want one of %s", v, strings.Join(mpathPolicies, ", "))
			}
			p.mpathPolicy = v
		case "paths":
			for s := range strings.SplitSeq(v, ",") {
				if s = strings.TrimSpace(s); s != "" {
					p.paths = append(p.paths, s)
				}
			}
			if len(p.paths) == 0 {
				return p, status.Errorf(codes.InvalidArgument, "parameter paths %q: want the storage node paths to map through, comma-separated (ip:10.0.8.5,ip:10.0.9.5)", v)
			}
		case "frontend":
			if v != "nbd" && v != "ublk" {
				return p, status.Errorf(codes.InvalidArgument, "parameter frontend %q: want nbd or ublk", v)
			}
			p.frontend = v
		case "writeThrough":
			b, err := strconv.ParseBool(v)
			if err != nil {
				return p, status.Errorf(codes.InvalidArgument, "parameter writeThrough %q: want true or false", v)
			}
			p.writeThrough = b
		default:
			if !strings.HasPrefix(k, "csi.storage.k8s.io/") {
				return p, status.Errorf(codes.InvalidArgument, "unknown parameter %q: rnbd-csi takes pool, fsType, transport, mpathPolicy, paths, frontend, writeThrough", k)
			}
		}
	}
	return p, nil
}

// canonical is the parameters as one label value: what makes a volume
// what it is (not the pool's name where the node's default is meant).
func (p volumeParams) canonical() string {
	return fmt.Sprintf("pool=%s;fsType=%s;transport=%s;mpathPolicy=%s;paths=%s;writeThrough=%t",
		p.pool, p.fsType, p.transport, p.mpathPolicy, strings.Join(p.paths, ","), p.writeThrough)
}

// pathsOn are the paths a volume on n is mapped through, and whether n
// has them all.
func (p volumeParams) pathsOn(n *StorageNode) ([]string, bool) {
	if len(p.paths) == 0 {
		return n.Paths, true
	}
	for _, x := range p.paths {
		if !slices.Contains(n.Paths, x) {
			return nil, false
		}
	}
	return p.paths, true
}

func (p volumeParams) poolOn(n *StorageNode) string {
	if p.pool != "" {
		return p.pool
	}
	return n.Pool
}

// checkCaps refuses access modes the driver does not serve: one node
// writing (SINGLE_NODE_WRITER, _SINGLE_WRITER, _MULTI_WRITER), many
// reading, and many writing a raw block volume only (a file system
// mounted on two nodes at once is corrupted).
func checkCaps(caps []*csi.VolumeCapability) error {
	if len(caps) == 0 {
		return status.Error(codes.InvalidArgument, "no volume capabilities")
	}
	for _, vc := range caps {
		if err := checkCap(vc); err != nil {
			return err
		}
	}
	return nil
}

func checkCap(vc *csi.VolumeCapability) error {
	block := vc.GetBlock() != nil
	if !block && vc.GetMount() == nil {
		return status.Error(codes.InvalidArgument, "a volume capability with neither block nor mount access")
	}
	if vc.GetAccessMode() == nil {
		return status.Error(codes.InvalidArgument, "a volume capability without an access mode")
	}
	switch m := vc.GetAccessMode().GetMode(); m {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER, csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:
	case csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
		if !block {
			return status.Error(codes.InvalidArgument, "access mode MULTI_NODE_MULTI_WRITER is for raw block volumes only: a file system mounted on several nodes at once is corrupted")
		}
	default:
		return status.Errorf(codes.InvalidArgument, "access mode %s is not supported: rnbd-csi serves SINGLE_NODE_WRITER, SINGLE_NODE_SINGLE_WRITER, SINGLE_NODE_MULTI_WRITER, MULTI_NODE_READER_ONLY, and MULTI_NODE_MULTI_WRITER for raw block", m)
	}
	return nil
}

func singleNode(vc *csi.VolumeCapability) bool {
	switch vc.GetAccessMode().GetMode() {
	case csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
		return false
	}
	return true
}

// sizeOf is the size to make of a capacity range: the required bytes
// rounded up to the block size (defaultSize where none is given), within
// the limit.
func sizeOf(r *csi.CapacityRange) (int64, error) {
	req, lim := r.GetRequiredBytes(), r.GetLimitBytes()
	if req < 0 || lim < 0 {
		return 0, status.Error(codes.InvalidArgument, "a negative capacity")
	}
	if lim > 0 && req > lim {
		return 0, status.Errorf(codes.InvalidArgument, "required_bytes %d over limit_bytes %d", req, lim)
	}
	if req > math.MaxInt64-blockSize {
		return 0, status.Errorf(codes.OutOfRange, "required_bytes %d: no volume is that large", req)
	}
	size := req
	if size == 0 {
		size = defaultSize
		if lim > 0 && lim < size {
			size = lim / blockSize * blockSize
		}
	}
	size = (size + blockSize - 1) / blockSize * blockSize
	if size == 0 || (lim > 0 && size > lim) {
		return 0, status.Errorf(codes.OutOfRange, "no multiple of %d bytes between required_bytes %d and limit_bytes %d", blockSize, req, lim)
	}
	return size, nil
}

func (c *controller) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, t := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_READONLY,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{
			Rpc: &csi.ControllerServiceCapability_RPC{Type: t}}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (c *controller) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "no name")
	}
	if err := checkCaps(req.GetVolumeCapabilities()); err != nil {
		return nil, err
	}
	p, err := parseParams(req.GetParameters())
	if err != nil {
		return nil, err
	}
	size, err := sizeOf(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	unlock, err := c.lock(req.GetName())
	if err != nil {
		return nil, err
	}
	defer unlock()
	vname := storageName(req.GetName())
	yes := true
	body := api.VolumeRequest{Name: vname, Size: strconv.FormatInt(size, 10),
		Labels: map[string]string{labelName: req.GetName(), labelParams: p.canonical()},
		Export: api.MapRequest{GrantsOnly: &yes, WriteThrough: p.writeThrough}}

	// A clone or a restore is made where its source is.
	var only *storageNode
	if src := req.GetVolumeContentSource(); src != nil {
		var id string
		switch {
		case src.GetSnapshot() != nil:
			id = src.GetSnapshot().GetSnapshotId()
		case src.GetVolume() != nil:
			id = src.GetVolume().GetVolumeId()
		default:
			return nil, status.Error(codes.InvalidArgument, "a volume content source of neither a snapshot nor a volume")
		}
		nodeName, name, ok := splitID(id)
		if only = c.node(nodeName); !ok || only == nil {
			return nil, status.Errorf(codes.NotFound, "content source %q: no such volume or snapshot", id)
		}
		// The new volume's size: the source's where the request asks
		// none; never less than the source's.
		fit := func(what string, srcSize int64) error {
			if req.GetCapacityRange().GetRequiredBytes() == 0 && srcSize > 0 {
				if lim := req.GetCapacityRange().GetLimitBytes(); lim == 0 || srcSize <= lim {
					size = srcSize
					body.Size = strconv.FormatInt(size, 10)
				}
			}
			if srcSize > size {
				return status.Errorf(codes.OutOfRange, "%s %s has %d bytes: more than the %d asked", what, id, srcSize, size)
			}
			return nil
		}
		if src.GetSnapshot() != nil {
			s, err := only.snapshot(ctx, name)
			if err != nil {
				return nil, toStatus(err, "content source snapshot "+id)
			}
			if err := fit("snapshot", s.Size); err != nil {
				return nil, err
			}
			body.FromSnapshot = name
		} else {
			v, err := only.volume(ctx, name)
			if err != nil {
				return nil, toStatus(err, "content source volume "+id)
			}
			if v.Size != nil {
				if err := fit("volume", *v.Size); err != nil {
					return nil, err
				}
			}
			body.FromVolume = name
		}
	}

	// A retry: the volume is on one of the storage nodes already. A
	// storage node that does not answer could have it: no new one is
	// made elsewhere until it does.
	for _, n := range c.nodes {
		v, err := n.volume(ctx, vname)
		if isNotFound(err) {
			continue
		}
		if err != nil {
			return nil, status.Errorf(codes.Unavailable, "looking for volume %s on %s (a retry must not make it twice): %v", vname, n, err)
		}
		if v.Labels[labelName] != req.GetName() {
			return nil, status.Errorf(codes.AlreadyExists, "volume %s on %s is not the volume of CSI name %q (its csi.name is %q)", vname, n, req.GetName(), v.Labels[labelName])
		}
		body.Pool = v.Pool
		rec, err := n.createVolume(ctx, body)
		if err != nil {
			return nil, toStatus(err, fmt.Sprintf("volume %s (CSI name %q) on %s", vname, req.GetName(), n))
		}
		return &csi.CreateVolumeResponse{Volume: c.csiVolume(n, rec, p, req.GetVolumeContentSource())}, nil
	}

	cands, err := c.candidates(ctx, p, req.GetAccessibilityRequirements(), only, size)
	if err != nil {
		return nil, err
	}
	var errs []error
	for _, cd := range cands {
		body.Pool = p.poolOn(cd.node.cfg)
		rec, err := cd.node.createVolume(ctx, body)
		if ctl.Classify(err) == ctl.CodeNoSpace {
			errs = append(errs, err)
			continue // taken since we asked: the next one
		}
		if err != nil {
			return nil, toStatus(err, fmt.Sprintf("creating volume %s on %s", vname, cd.node))
		}
		c.log.WithFields(log.Fields{"volume": cd.node.cfg.Name + "/" + vname, "csi_name": req.GetName(), "size": size}).Info("volume created")
		return &csi.CreateVolumeResponse{Volume: c.csiVolume(cd.node, rec, p, req.GetVolumeContentSource())}, nil
	}
	return nil, status.Errorf(codes.ResourceExhausted, "no storage node had room for %d bytes: %v", size, errors.Join(errs...))
}

// candidates are the storage nodes a volume may go to, best first; none
// is ResourceExhausted (no room, or no node in the topology asked) or
// Unavailable (none answers).
func (c *controller) candidates(ctx context.Context, p volumeParams, ar *csi.TopologyRequirement, only *storageNode, size int64) ([]candidate, error) {
	var out []candidate
	var why []string
	unreachable, asked := 0, 0
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
		asked++
		free, err := n.allocatable(ctx, p.poolOn(n.cfg))
		if err != nil {
			why = append(why, fmt.Sprintf("%s: %v", n.cfg.Name, err))
			if ctl.Classify(err) == ctl.CodeUnavailable {
				unreachable++
			}
			continue
		}
		if free < size {
			why = append(why, fmt.Sprintf("%s: %d bytes allocatable", n.cfg.Name, free))
			continue
		}
		out = append(out, candidate{node: n, allocatable: free, pref: preference(n.cfg.Labels, ar)})
	}
	if len(out) == 0 {
		// Every node that could hold it did not answer: later, maybe.
		c := codes.ResourceExhausted
		if asked > 0 && unreachable == asked {
			c = codes.Unavailable
		}
		return nil, status.Errorf(c, "no storage node for a volume of %d bytes: %s", size, strings.Join(why, "; "))
	}
	order(out)
	return out, nil
}

// csiVolume is the CSI volume of a record on n.
func (c *controller) csiVolume(n *storageNode, rec api.VolumeRecord, p volumeParams, src *csi.VolumeContentSource) *csi.Volume {
	var size int64
	if rec.Size != nil {
		size = *rec.Size
	}
	paths, _ := p.pathsOn(n.cfg)
	vc := map[string]string{"storageNode": n.cfg.Name, "pool": rec.Pool, "paths": strings.Join(paths, ","),
		"port": strconv.Itoa(n.cfg.Port), "writeThrough": strconv.FormatBool(p.writeThrough)}
	for k, v := range map[string]string{"fsType": p.fsType, "transport": p.transport, "mpathPolicy": p.mpathPolicy, PCFrontend: p.frontend} {
		if v != "" {
			vc[k] = v
		}
	}
	return &csi.Volume{VolumeId: n.cfg.Name + "/" + rec.Name, CapacityBytes: size, VolumeContext: vc,
		ContentSource: src, AccessibleTopology: topologyOf(n.cfg)}
}

func (c *controller) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume id")
	}
	nodeName, name, ok := splitID(req.GetVolumeId())
	n := c.node(nodeName)
	if !ok || n == nil {
		return &csi.DeleteVolumeResponse{}, nil // never one of ours: gone
	}
	unlock, err := c.lock(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	if err := n.deleteVolume(ctx, name); err != nil {
		return nil, toStatus(err, "deleting volume "+req.GetVolumeId())
	}
	c.log.WithField("volume", req.GetVolumeId()).Info("volume deleted")
	return &csi.DeleteVolumeResponse{}, nil
}

// volumeOf finds the storage node and the record of a volume id:
// InvalidArgument without one, NotFound where there is no such volume.
func (c *controller) volumeOf(ctx context.Context, id string) (*storageNode, *api.VolumeRecord, error) {
	if id == "" {
		return nil, nil, status.Error(codes.InvalidArgument, "no volume id")
	}
	nodeName, name, ok := splitID(id)
	n := c.node(nodeName)
	if !ok || n == nil {
		return nil, nil, status.Errorf(codes.NotFound, "no volume %s", id)
	}
	v, err := n.volume(ctx, name)
	if err != nil {
		return nil, nil, toStatus(err, "volume "+id)
	}
	return n, v, nil
}

func (c *controller) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume id")
	}
	if req.GetNodeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "no node id")
	}
	if req.GetVolumeCapability() == nil {
		return nil, status.Error(codes.InvalidArgument, "no volume capability")
	}
	if err := checkCap(req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	n, v, err := c.volumeOf(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	switch ok, err := c.workers.has(ctx, req.GetNodeId()); {
	case err != nil:
		return nil, status.Errorf(codes.Unavailable, "is node %s a worker: %v", req.GetNodeId(), err)
	case !ok:
		return nil, status.Errorf(codes.NotFound, "no worker node %s: %s", req.GetNodeId(), c.workers)
	}
	unlock, err := c.lock(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	// The grant: ro for a read-only publish or a reader mode; for
	// multi-node writers (raw block only) RNBD's migration access, the
	// one that lets a second session write beside the first: the storage
	// node takes two writers of a device at most, so a third is refused
	// here rather than at its OPEN.
	mode := req.GetVolumeCapability().GetAccessMode().GetMode()
	access := "rw"
	switch {
	case req.GetReadonly() || mode == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY ||
		mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY:
		access = "ro"
	case mode == csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
		access = "migration"
	}
	grants, err := n.grants(ctx, v.Name)
	if err != nil {
		return nil, toStatus(err, "grants of "+req.GetVolumeId())
	}
	have, writers := false, 0
	for _, g := range grants {
		if g.Identity != req.GetNodeId() && g.Access != "ro" {
			writers++
		}
		switch {
		case g.Identity == req.GetNodeId() && g.Access != access:
			return nil, status.Errorf(codes.AlreadyExists, "volume %s is published to node %s %s, asked %s", req.GetVolumeId(), g.Identity, g.Access, access)
		case g.Identity == req.GetNodeId():
			have = true
		case singleNode(req.GetVolumeCapability()):
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is published to node %s: a single-node access mode allows one node", req.GetVolumeId(), g.Identity)
		}
	}
	if !have && access == "migration" && writers >= 2 {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s has two writers already: a storage node takes two at most (RNBD's migration access)", req.GetVolumeId())
	}
	if !have {
		if err := n.grant(ctx, v.Name, req.GetNodeId(), access); err != nil {
			return nil, toStatus(err, fmt.Sprintf("granting volume %s to node %s", req.GetVolumeId(), req.GetNodeId()))
		}
		c.log.WithFields(log.Fields{"volume": req.GetVolumeId(), "node": req.GetNodeId(), "access": access}).Info("volume published")
	}
	paths := n.cfg.Paths
	if s := req.GetVolumeContext()["paths"]; s != "" {
		paths = strings.Split(s, ",")
	}
	pc := map[string]string{PCStorageNode: n.cfg.Name, PCExport: v.Name, PCPaths: strings.Join(paths, ","),
		PCPort: strconv.Itoa(n.cfg.Port), PCAccess: access}
	for _, k := range []string{PCTransport, PCMpathPolicy, PCFrontend} {
		if s := req.GetVolumeContext()[k]; s != "" {
			pc[k] = s
		}
	}
	return &csi.ControllerPublishVolumeResponse{PublishContext: pc}, nil
}

// ControllerUnpublishVolume revokes the node's grant (every node's
// where none is named). A volume that is no more is unpublished from
// every node: success, as the spec asks.
func (c *controller) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	n, v, err := c.volumeOf(ctx, req.GetVolumeId())
	if status.Code(err) == codes.NotFound {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	unlock, err := c.lock(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	ids := []string{req.GetNodeId()}
	if req.GetNodeId() == "" { // every node
		grants, err := n.grants(ctx, v.Name)
		if err != nil {
			return nil, toStatus(err, "grants of "+req.GetVolumeId())
		}
		ids = ids[:0]
		for _, g := range grants {
			ids = append(ids, g.Identity)
		}
	}
	for _, id := range ids {
		if err := n.revoke(ctx, v.Name, id); err != nil {
			return nil, toStatus(err, fmt.Sprintf("revoking volume %s from node %s", req.GetVolumeId(), id))
		}
		c.log.WithFields(log.Fields{"volume": req.GetVolumeId(), "node": id}).Info("volume unpublished")
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

func (c *controller) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume id")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "no volume capabilities")
	}
	if _, _, err := c.volumeOf(ctx, req.GetVolumeId()); err != nil {
		return nil, err
	}
	if _, err := parseParams(req.GetParameters()); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
	}
	if err := checkCaps(req.GetVolumeCapabilities()); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext: req.GetVolumeContext(), VolumeCapabilities: req.GetVolumeCapabilities(), Parameters: req.GetParameters()}}, nil
}

func (c *controller) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	if req.GetCapacityRange() == nil {
		return nil, status.Error(codes.InvalidArgument, "no capacity range")
	}
	if req.GetVolumeCapability() != nil {
		if err := checkCap(req.GetVolumeCapability()); err != nil {
			return nil, err
		}
	}
	n, v, err := c.volumeOf(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	size, err := sizeOf(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	unlock, err := c.lock(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	nodeExpansion := req.GetVolumeCapability().GetBlock() == nil
	if v.Size != nil && *v.Size >= size {
		return &csi.ControllerExpandVolumeResponse{CapacityBytes: *v.Size, NodeExpansionRequired: nodeExpansion}, nil
	}
	if err := n.resizeVolume(ctx, v.Name, size); err != nil {
		return nil, toStatus(err, fmt.Sprintf("growing volume %s to %d bytes", req.GetVolumeId(), size))
	}
	c.log.WithFields(log.Fields{"volume": req.GetVolumeId(), "size": size}).Info("volume expanded")
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: size, NodeExpansionRequired: nodeExpansion}, nil
}

// page is one page of a sorted list of ids: from after the token (the
// last id of the page before), at most max entries; the next token, ""
// at the end. A token that is not one of ours is Aborted (the spec's).
func page(ids []string, token string, max int32) (from, to int, next string, err error) {
	if max < 0 {
		return 0, 0, "", status.Error(codes.InvalidArgument, "negative max_entries")
	}
	if token != "" {
		after, ok := strings.CutPrefix(token, "after:")
		if !ok {
			return 0, 0, "", status.Errorf(codes.Aborted, "starting_token %q is not one this driver gave", token)
		}
		from = sort.SearchStrings(ids, after)
		if from < len(ids) && ids[from] == after {
			from++
		}
	}
	to = len(ids)
	if max > 0 && from+int(max) < to {
		to = from + int(max)
		next = "after:" + ids[to-1]
	}
	return from, to, next, nil
}

func (c *controller) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	type entry struct {
		n *storageNode
		v api.VolumeRecord
	}
	byID := map[string]entry{}
	var ids []string
	for _, n := range c.nodes {
		vs, err := n.volumes(ctx)
		if err != nil {
			return nil, toStatus(err, "listing the volumes of "+n.String())
		}
		for _, v := range vs {
			if v.Labels[labelName] == "" {
				continue // not one of the driver's
			}
			id := n.cfg.Name + "/" + v.Name
			byID[id] = entry{n, v}
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	from, to, next, err := page(ids, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	resp := &csi.ListVolumesResponse{NextToken: next}
	for _, id := range ids[from:to] {
		e := byID[id]
		var size int64
		if e.v.Size != nil {
			size = *e.v.Size
		}
		nodes := e.v.AllowIdentities.Identities()
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{
			Volume: &csi.Volume{VolumeId: id, CapacityBytes: size, AccessibleTopology: topologyOf(e.n.cfg)},
			Status: &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: nodes}})
	}
	return resp, nil
}

// GetCapacity is what the storage nodes of a topology segment (every one
// where none is given) may still give new volumes in the pool of the
// parameters: the sum, and the most one volume may have. A storage node
// that does not answer counts for nothing.
func (c *controller) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	for _, vc := range req.GetVolumeCapabilities() {
		if err := checkCap(vc); err != nil {
			return nil, err
		}
	}
	p, err := parseParams(req.GetParameters())
	if err != nil {
		return nil, err
	}
	var sum, most int64
	for _, n := range c.nodes {
		if req.GetAccessibleTopology() != nil && !matches(n.cfg.Labels, req.GetAccessibleTopology()) {
			continue
		}
		if _, ok := p.pathsOn(n.cfg); !ok {
			continue
		}
		free, err := n.allocatable(ctx, p.poolOn(n.cfg))
		if err != nil {
			c.log.WithError(err).WithField("storage_node", n.cfg.Name).Debug("capacity not known")
			continue
		}
		sum += free
		most = max(most, free)
	}
	return &csi.GetCapacityResponse{AvailableCapacity: sum, MaximumVolumeSize: wrapInt64(most)}, nil
}

func (c *controller) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "no name")
	}
	if req.GetSourceVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "no source volume id")
	}
	if len(req.GetParameters()) > 0 {
		for k := range req.GetParameters() {
			if !strings.HasPrefix(k, "csi.storage.k8s.io/") {
				return nil, status.Errorf(codes.InvalidArgument, "unknown snapshot parameter %q: rnbd-csi takes none", k)
			}
		}
	}
	n, v, err := c.volumeOf(ctx, req.GetSourceVolumeId())
	if err != nil {
		return nil, err
	}
	unlock, err := c.lock("snapshot " + req.GetName())
	if err != nil {
		return nil, err
	}
	defer unlock()
	sname := storageName(req.GetName())
	// The snapshot name taken on another storage node, by a snapshot of
	// another volume: AlreadyExists as the spec asks.
	for _, o := range c.nodes {
		if o == n {
			continue
		}
		s, err := o.snapshot(ctx, sname)
		if err == nil {
			return nil, status.Errorf(codes.AlreadyExists, "snapshot %s exists on %s, of volume %s", req.GetName(), o, s.Volume)
		}
	}
	rec, err := n.createSnapshot(ctx, sname, v.Name)
	if err != nil {
		return nil, toStatus(err, fmt.Sprintf("snapshot %s of volume %s", req.GetName(), req.GetSourceVolumeId()))
	}
	return &csi.CreateSnapshotResponse{Snapshot: csiSnapshot(n, rec)}, nil
}

func csiSnapshot(n *storageNode, s api.SnapshotRecord) *csi.Snapshot {
	out := &csi.Snapshot{SnapshotId: n.cfg.Name + "/" + s.Name, SourceVolumeId: n.cfg.Name + "/" + s.Volume, SizeBytes: s.Size, ReadyToUse: true}
	if t, err := time.Parse(time.RFC3339Nano, s.Created); err == nil {
		out.CreationTime = timestamppb.New(t)
	}
	return out
}

func (c *controller) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	if req.GetSnapshotId() == "" {
		return nil, status.Error(codes.InvalidArgument, "no snapshot id")
	}
	nodeName, name, ok := splitID(req.GetSnapshotId())
	n := c.node(nodeName)
	if !ok || n == nil {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	unlock, err := c.lock("snapshot id " + req.GetSnapshotId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	if err := n.deleteSnapshot(ctx, name); err != nil {
		return nil, toStatus(err, "deleting snapshot "+req.GetSnapshotId())
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

func (c *controller) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	type entry struct {
		n *storageNode
		s api.SnapshotRecord
	}
	byID := map[string]entry{}
	var ids []string
	add := func(n *storageNode, ss ...api.SnapshotRecord) {
		for _, s := range ss {
			id := n.cfg.Name + "/" + s.Name
			byID[id] = entry{n, s}
			ids = append(ids, id)
		}
	}
	switch {
	case req.GetSnapshotId() != "":
		nodeName, name, ok := splitID(req.GetSnapshotId())
		if n := c.node(nodeName); ok && n != nil {
			s, err := n.snapshot(ctx, name)
			if err != nil && !isNotFound(err) {
				return nil, toStatus(err, "snapshot "+req.GetSnapshotId())
			}
			if err == nil && (req.GetSourceVolumeId() == "" || req.GetSourceVolumeId() == nodeName+"/"+s.Volume) {
				add(n, *s)
			}
		}
	case req.GetSourceVolumeId() != "":
		nodeName, name, ok := splitID(req.GetSourceVolumeId())
		if n := c.node(nodeName); ok && n != nil {
			ss, err := n.snapshots(ctx, name)
			if err != nil && !isNotFound(err) {
				return nil, toStatus(err, "snapshots of "+req.GetSourceVolumeId())
			}
			add(n, ss...)
		}
	default:
		for _, n := range c.nodes {
			ss, err := n.snapshots(ctx, "")
			if err != nil {
				return nil, toStatus(err, "listing the snapshots of "+n.String())
			}
			add(n, ss...)
		}
	}
	sort.Strings(ids)
	from, to, next, err := page(ids, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	resp := &csi.ListSnapshotsResponse{NextToken: next}
	for _, id := range ids[from:to] {
		e := byID[id]
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: csiSnapshot(e.n, e.s)})
	}
	return resp, nil
}

func wrapInt64(v int64) *wrapperspb.Int64Value { return wrapperspb.Int64(v) }
