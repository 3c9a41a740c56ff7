// A storage node as the controller talks to it: its admin API, through
// the typed client of package api.

package csi

import (
	"context"
	"fmt"
	"strconv"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
)

type storageNode struct {
	cfg *StorageNode
	api *api.Server
	// c is the transport under api (its idle connections closed at Stop).
	c *ctl.Client
}

func (n *storageNode) pools(ctx context.Context) ([]api.PoolRecord, error) { return n.api.Pools(ctx) }

// allocatable is what a new volume may still be given in pool.
func (n *storageNode) allocatable(ctx context.Context, pool string) (int64, error) {
	ps, err := n.pools(ctx)
	if err != nil {
		return 0, err
	}
	for _, p := range ps {
		if p.Name == pool {
			if p.Allocatable == nil {
				return 0, ctl.Errorf(ctl.CodeUnavailable, "pool %s: %s", pool, p.State)
			}
			return *p.Allocatable, nil
		}
	}
	return 0, ctl.Errorf(ctl.CodeNotFound, "no pool %s", pool)
}

// volume is the record of volume name (a not_found error if none).
func (n *storageNode) volume(ctx context.Context, name string) (*api.VolumeRecord, error) {
	return n.api.Volume(ctx, name)
}

func (n *storageNode) volumes(ctx context.Context) ([]api.VolumeRecord, error) {
	return n.api.Volumes(ctx)
}

func (n *storageNode) createVolume(ctx context.Context, req api.VolumeRequest) (api.VolumeRecord, error) {
	out, err := n.api.CreateVolume(ctx, req)
	return out.Record, err
}

func (n *storageNode) deleteVolume(ctx context.Context, name string) error {
	_, err := n.api.DeleteVolume(ctx, name, false)
	return err
}

func (n *storageNode) resizeVolume(ctx context.Context, name string, size int64) error {
	_, err := n.api.ResizeVolume(ctx, name, strconv.FormatInt(size, 10))
	return err
}

func (n *storageNode) grants(ctx context.Context, volume string) ([]api.GrantRecord, error) {
	return n.api.VolumeGrants(ctx, volume)
}

func (n *storageNode) grant(ctx context.Context, volume, identity, access string) error {
	return n.api.GrantVolume(ctx, volume, api.GrantRequest{Identity: identity, Access: access})
}

func (n *storageNode) revoke(ctx context.Context, volume, identity string) error {
	return n.api.RevokeVolume(ctx, volume, identity)
}

func (n *storageNode) snapshot(ctx context.Context, name string) (*api.SnapshotRecord, error) {
	return n.api.Snapshot(ctx, name)
}

func (n *storageNode) snapshots(ctx context.Context, volume string) ([]api.SnapshotRecord, error) {
	return n.api.Snapshots(ctx, volume)
}

func (n *storageNode) createSnapshot(ctx context.Context, name, volume string) (api.SnapshotRecord, error) {
	out, err := n.api.CreateSnapshot(ctx, api.SnapshotRequest{Name: name, Volume: volume})
	return out.Record, err
}

func (n *storageNode) deleteSnapshot(ctx context.Context, name string) error {
	_, err := n.api.DeleteSnapshot(ctx, name)
	return err
}

func (n *storageNode) String() string { return fmt.Sprintf("storage node %s", n.cfg.Name) }
