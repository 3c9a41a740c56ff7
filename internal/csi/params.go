// What a request asks, checked: a StorageClass's parameters, volume
// capabilities and the access each asks (one policy, the controller's
// grant and the node's map alike), capacity ranges, and the names and
// ids of volumes and snapshots on the storage nodes.

package csi

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/internal/pool"
)

// blockSize: volume sizes are multiples of it (the pools').
const blockSize = 4096

// defaultSize is a volume's size where the request gives no capacity.
const defaultSize = 1 << 30

// storageName is the name on a storage node of the volume or snapshot
// of a CSI name: the name itself where it is one the storage node's API
// takes and addresses (pvc-…, snapshot-…), else a readable part and a
// hash of it, so that a retry finds the same. "." and "..", which a URL
// path cannot carry, are always hashed.
func storageName(csiName string) string {
	if pool.CheckName(csiName) == nil && strings.Trim(csiName, ".") != "" {
		return csiName
	}
	var b strings.Builder
	for _, r := range csiName {
		if b.Len() >= 40 {
			break
		}
		if r < 128 && (r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
			b.WriteRune(r)
		} else {
			b.WriteByte('-')
		}
	}
	sum := sha256.Sum256([]byte(csiName))
	return "csi-" + b.String() + "-" + hex.EncodeToString(sum[:8])
}

// makeID is the id of volume or snapshot name on storage node node:
// "<storage-node>/<name>".
func makeID(node, name string) string { return node + "/" + name }

// parseID reads an id makeID made; ok false where it is not one (then
// it names nothing of this driver's).
func parseID(id string) (node, name string, ok bool) {
	node, name, ok = strings.Cut(id, "/")
	if !ok || node == "" || pool.CheckName(name) != nil || strings.Trim(name, ".") == "" {
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
	// replicas is how many legs a replicated volume has (2 or 3: a
	// mirror of rnbd-client's over as many storage nodes, mirror.go);
	// 0 for one volume on one node (replicas 1). spreadBy is the
	// storage nodes' label whose values the legs' nodes must differ in
	// ("": the nodes only).
	replicas int
	spreadBy string
}

var mpathPolicies = []string{"round-robin", "min-inflight", "min-latency"}

// fsTypes are the file systems the node service makes and mounts.
var fsTypes = []string{"ext4", "xfs"}

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
			// Deprecated in Kubernetes for csi.storage.k8s.io/fstype
			// (which the CO passes in the capability); still taken,
			// and the node uses it where the capability names none.
			if !slices.Contains(fsTypes, v) {
				return p, status.Errorf(codes.InvalidArgument, "parameter fsType %q: want %s", v, strings.Join(fsTypes, " or "))
			}
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
		case "replicas":
			// 1 is one volume on one node; 2 or 3 a mirror of
			// rnbd-client's over as many (mirror.go).
			switch v {
			case "1":
			case "2", "3":
				p.replicas = int(v[0] - '0')
			default:
				return p, status.Errorf(codes.InvalidArgument, "parameter replicas %q: want 1, 2 or 3", v)
			}
		case "spreadBy":
			if v == "" {
				return p, status.Errorf(codes.InvalidArgument, "parameter spreadBy is empty: want a label of the storage nodes (topology.rnbd.io/zone)")
			}
			p.spreadBy = v
		case "writeThrough":
			b, err := strconv.ParseBool(v)
			if err != nil {
				return p, status.Errorf(codes.InvalidArgument, "parameter writeThrough %q: want true or false", v)
			}
			p.writeThrough = b
		default:
			if !strings.HasPrefix(k, "csi.storage.k8s.io/") {
				return p, status.Errorf(codes.InvalidArgument, "unknown parameter %q: rnbd-csi takes pool, fsType, transport, mpathPolicy, paths, frontend, writeThrough, replicas, spreadBy", k)
			}
		}
	}
	switch {
	case p.spreadBy != "" && p.replicas == 0:
		return p, status.Errorf(codes.InvalidArgument, "parameter spreadBy %q is for a replicated volume (replicas 2 or 3)", p.spreadBy)
	case p.replicas > 0 && len(p.paths) > 0:
		return p, status.Errorf(codes.InvalidArgument, "parameter paths names one storage node's addresses: a replicated volume's legs are on %d storage nodes, each mapped through its own paths", p.replicas)
	}
	return p, nil
}

// canonical is the parameters as one label value: what makes a volume
// what it is (not the pool's name where the node's default is meant).
func (p volumeParams) canonical() string {
	s := fmt.Sprintf("pool=%s;fsType=%s;transport=%s;mpathPolicy=%s;paths=%s;writeThrough=%t",
		p.pool, p.fsType, p.transport, p.mpathPolicy, strings.Join(p.paths, ","), p.writeThrough)
	if p.replicas > 0 {
		// Only then: the volumes of one node keep the label they had.
		s += fmt.Sprintf(";replicas=%d;spreadBy=%s", p.replicas, p.spreadBy)
	}
	return s
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
	if fs := vc.GetMount().GetFsType(); fs != "" && !slices.Contains(fsTypes, fs) {
		return status.Errorf(codes.InvalidArgument, "fs_type %q: rnbd-csi makes and mounts %s", fs, strings.Join(fsTypes, " or "))
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

// RNBD access modes, as a grant gives them and a map asks them.
const (
	accessRO        = "ro"
	accessRW        = "rw"
	accessMigration = "migration"
)

// accessFor is the access a capability asks of a volume, the one policy
// of the controller's grant and the node's map: ro for a read-only
// publish or a reader mode; for multi-node writers (raw block only)
// RNBD's migration access, the one that lets a second session write
// beside the first; rw otherwise.
func accessFor(vc *csi.VolumeCapability, readonly bool) string {
	switch m := vc.GetAccessMode().GetMode(); {
	case readonly || m == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY || m == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY:
		return accessRO
	case m == csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
		return accessMigration
	}
	return accessRW
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

// fits reports whether a volume of size bytes answers capacity range r:
// at least its required bytes, at most its limit (none: no bound).
func fits(size int64, r *csi.CapacityRange) bool {
	return size >= r.GetRequiredBytes() && (r.GetLimitBytes() == 0 || size <= r.GetLimitBytes())
}
