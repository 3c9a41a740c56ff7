package csi

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/mirror"
)

// expandMirror grows every leg of a replicated volume to the size asked
// and the mirror's metadata; the mirror itself grows on the worker it is
// staged on (NodeExpandVolume), once every leg has — so the node's
// expansion is always required, raw block too. Every leg's storage node
// must answer: a leg left small could not rejoin the grown mirror. The
// witness keeps its size. A retry after some legs grew grows the rest.
func (c *controller) expandMirror(ctx context.Context, req *csi.ControllerExpandVolumeRequest, vname string) (*csi.ControllerExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	unlock, err := c.locks.lockByVolumeID(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	mv, err := c.findMirror(ctx, vname)
	if err != nil {
		return nil, err
	}
	size, err := sizeOf(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	var silent []string
	for _, n := range mv.silent {
		if slices.Contains(mv.place.legs, n) {
			silent = append(silent, n)
		}
	}
	if len(silent) > 0 {
		return nil, status.Errorf(codes.Unavailable, "volume %s grows on every leg's storage node at once: %s did not answer", id, strings.Join(silent, ", "))
	}
	var grow []found
	for i := range mv.place.legs {
		f, ok := mv.found[legMember(i)]
		switch {
		case !ok:
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s: its %s is not on %s, where its placement says", id, legMember(i), mv.place.legs[i])
		case f.v.Size == nil:
			return nil, status.Errorf(codes.Internal, "volume %s: %s on %s has no size", id, legMember(i), f.n.cfg.Name)
		case *f.v.Size-mirror.DataOff > size:
			return nil, status.Errorf(codes.OutOfRange, "volume %s has %d bytes, asked %d: a volume grows only", id, *f.v.Size-mirror.DataOff, size)
		case *f.v.Size-mirror.DataOff < size:
			grow = append(grow, f)
		}
	}
	for _, f := range grow {
		if err := f.n.resizeVolume(ctx, vname, size+mirror.DataOff); err != nil {
			return nil, toStatus(err, fmt.Sprintf("growing %s of volume %s on %s to %d bytes", f.v.Labels[labelMember], id, f.n.cfg.Name, size+mirror.DataOff))
		}
	}
	if len(grow) > 0 {
		c.log.WithFields(log.Fields{"volume": id, "size": size, "legs_grown": len(grow)}).Info("replicated volume's legs expanded; its mirror grows on its worker")
	}
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: size, NodeExpansionRequired: true}, nil
}
