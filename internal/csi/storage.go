// A storage node as the controller talks to it: its admin API, and the
// records it answers.

package csi

import (
	"context"
	"fmt"
	"net/url"
	"strconv"

	"github.com/rnbd/rnbd/internal/ctl"
)

type storageNode struct {
	cfg *StorageNode
	c   *ctl.Client
}

// The records of the storage node's API (docs/control-api.md,
// "Records"): the fields the controller reads.
type (
	volumeRecord struct {
		Name            string            `json:"name"`
		Pool            string            `json:"pool"`
		Size            *int64            `json:"size"`
		Source          string            `json:"source"`
		SourceSnapshot  string            `json:"source_snapshot"`
		Labels          map[string]string `json:"labels"`
		State           string            `json:"state"`
		AllowIdentities map[string]string `json:"allow_identities"`
	}
	poolRecord struct {
		Name        string `json:"name"`
		State       string `json:"state"`
		Allocatable *int64 `json:"allocatable"`
	}
	snapshotRecord struct {
		Name    string `json:"name"`
		Pool    string `json:"pool"`
		Volume  string `json:"volume"`
		Size    int64  `json:"size"`
		Created string `json:"created"`
	}
	grantRecord struct {
		Export   string `json:"export"`
		Identity string `json:"identity"`
		Access   string `json:"access"`
	}
	createdVolume struct {
		Created bool         `json:"created"`
		Record  volumeRecord `json:"record"`
	}
	createdSnapshot struct {
		Created bool           `json:"created"`
		Record  snapshotRecord `json:"record"`
	}
	exportBody struct {
		GrantsOnly   bool `json:"grants_only"`
		WriteThrough bool `json:"write_through"`
	}
	volumeBody struct {
		Name         string            `json:"name"`
		Pool         string            `json:"pool"`
		Size         string            `json:"size"`
		FromVolume   string            `json:"from_volume,omitempty"`
		FromSnapshot string            `json:"from_snapshot,omitempty"`
		Labels       map[string]string `json:"labels"`
		Export       exportBody        `json:"export"`
	}
)

func (n *storageNode) pools(ctx context.Context) ([]poolRecord, error) {
	var out []poolRecord
	err := n.c.Do(ctx, "GET", "/v1/pools", nil, &out)
	return out, err
}

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
func (n *storageNode) volume(ctx context.Context, name string) (*volumeRecord, error) {
	var out []volumeRecord
	if err := n.c.Do(ctx, "GET", "/v1/volumes/"+url.PathEscape(name), nil, &out); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, ctl.Errorf(ctl.CodeNotFound, "no volume %s", name)
	}
	return &out[0], nil
}

func (n *storageNode) volumes(ctx context.Context) ([]volumeRecord, error) {
	var out []volumeRecord
	err := n.c.Do(ctx, "GET", "/v1/volumes", nil, &out)
	return out, err
}

func (n *storageNode) createVolume(ctx context.Context, b volumeBody) (volumeRecord, error) {
	var out createdVolume
	err := n.c.Do(ctx, "POST", "/v1/volumes", b, &out)
	return out.Record, err
}

func (n *storageNode) deleteVolume(ctx context.Context, name string) error {
	return n.c.Do(ctx, "DELETE", "/v1/volumes/"+url.PathEscape(name), nil, nil)
}

func (n *storageNode) resizeVolume(ctx context.Context, name string, size int64) error {
	return n.c.Do(ctx, "POST", "/v1/volumes/"+url.PathEscape(name)+"/resize", map[string]string{"size": strconv.FormatInt(size, 10)}, nil)
}

func (n *storageNode) grants(ctx context.Context, export string) ([]grantRecord, error) {
	var out []grantRecord
	err := n.c.Do(ctx, "GET", "/v1/exports/"+url.PathEscape(export)+"/grants", nil, &out)
	return out, err
}

func (n *storageNode) grant(ctx context.Context, export, identity, access string) error {
	return n.c.Do(ctx, "POST", "/v1/exports/"+url.PathEscape(export)+"/grants",
		map[string]string{"identity": identity, "access": access}, nil)
}

func (n *storageNode) revoke(ctx context.Context, export, identity string) error {
	return n.c.Do(ctx, "DELETE", "/v1/exports/"+url.PathEscape(export)+"/grants/"+url.PathEscape(identity), nil, nil)
}

func (n *storageNode) snapshot(ctx context.Context, name string) (*snapshotRecord, error) {
	var out []snapshotRecord
	if err := n.c.Do(ctx, "GET", "/v1/snapshots/"+url.PathEscape(name), nil, &out); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, ctl.Errorf(ctl.CodeNotFound, "no snapshot %s", name)
	}
	return &out[0], nil
}

func (n *storageNode) snapshots(ctx context.Context, volume string) ([]snapshotRecord, error) {
	var out []snapshotRecord
	q := ""
	if volume != "" {
		q = "?volume=" + url.QueryEscape(volume)
	}
	err := n.c.Do(ctx, "GET", "/v1/snapshots"+q, nil, &out)
	return out, err
}

func (n *storageNode) createSnapshot(ctx context.Context, name, volume string) (snapshotRecord, error) {
	var out createdSnapshot
	err := n.c.Do(ctx, "POST", "/v1/snapshots", map[string]string{"name": name, "volume": volume}, &out)
	return out.Record, err
}

func (n *storageNode) deleteSnapshot(ctx context.Context, name string) error {
	return n.c.Do(ctx, "DELETE", "/v1/snapshots/"+url.PathEscape(name), nil, nil)
}

func (n *storageNode) String() string { return fmt.Sprintf("storage node %s", n.cfg.Name) }
