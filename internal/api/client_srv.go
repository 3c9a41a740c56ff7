package api

import (
	"context"
	"net/url"
	"strconv"
	"time"

	"github.com/rnbd/rnbd/internal/ctl"
)

// Server is a typed client of an rnbd-server's control API: its unix
// socket or its admin listener (ctl.Dial, ctl.DialTLS). Errors are the
// daemon's, with their class (ctl.Classify).
type Server struct{ c *ctl.Client }

// NewServer is the typed client over c.
func NewServer(c *ctl.Client) *Server { return &Server{c: c} }

// Call sends a request of route rt (its names filled by args) with body
// (nil: none) and decodes the answer into out (nil: none).
func Call(ctx context.Context, c *ctl.Client, rt Route, args []string, query url.Values, body, out any) error {
	for _, a := range args {
		if a == "" || a == "." || a == ".." {
			// A URL path cleans them away: the request would reach
			// another route, or none.
			return ctl.Errorf(ctl.CodeInvalid, "name %q: no object of the control API has it (a URL path cannot carry it)", a)
		}
	}
	path := rt.URL(args...)
	if len(query) > 0 {
		path += "?" + query.Encode()
	}
	return c.Do(ctx, rt.Method, path, body, out)
}

// one is the first record a show answered, or a not_found error naming
// kind and name (a daemon answers 404 itself; this is for an empty list).
func one[T any](recs []T, err error, kind, name string) (*T, error) {
	if err != nil {
		return nil, err
	}
	if len(recs) == 0 {
		return nil, ctl.Errorf(ctl.CodeNotFound, "no %s %s", kind, name)
	}
	return &recs[0], nil
}

func list[T any](ctx context.Context, c *ctl.Client, rt Route, args []string, query url.Values) ([]T, error) {
	var out []T
	err := Call(ctx, c, rt, args, query, nil, &out)
	return out, err
}

// Pools are the pool records.
func (s *Server) Pools(ctx context.Context) ([]PoolRecord, error) {
	return list[PoolRecord](ctx, s.c, SrvPools, nil, nil)
}

// Volumes are the volume records.
func (s *Server) Volumes(ctx context.Context) ([]VolumeRecord, error) {
	return list[VolumeRecord](ctx, s.c, SrvVolumes, nil, nil)
}

// Volume is the record of volume name (not_found if none).
func (s *Server) Volume(ctx context.Context, name string) (*VolumeRecord, error) {
	recs, err := list[VolumeRecord](ctx, s.c, SrvVolume, []string{name}, nil)
	return one(recs, err, "volume", name)
}

// CreateVolume makes a volume, or finds the one of that name made with
// the same parameters.
func (s *Server) CreateVolume(ctx context.Context, req VolumeRequest) (CreatedVolume, error) {
	var out CreatedVolume
	err := Call(ctx, s.c, SrvVolumeCreate, nil, nil, req, &out)
	return out, err
}

// DeleteVolume deletes a volume (force: even while sessions have it
// open); false if there was none.
func (s *Server) DeleteVolume(ctx context.Context, name string, force bool) (bool, error) {
	var q url.Values
	if force {
		q = url.Values{"force": {"true"}}
	}
	var out Deleted
	err := Call(ctx, s.c, SrvVolumeDelete, []string{name}, q, nil, &out)
	return out.Deleted, err
}

// DeleteVolumeIf deletes a volume if it has the labels ifLabels (each
// KEY=VALUE an if_label of the request), compared on the storage node
// with no change of the volume between: one that differs is busy,
// nothing deleted. False if there was no volume.
func (s *Server) DeleteVolumeIf(ctx context.Context, name string, ifLabels map[string]string) (bool, error) {
	q := url.Values{}
	for k, v := range ifLabels {
		q.Add("if_label", k+"="+v)
	}
	var out Deleted
	err := Call(ctx, s.c, SrvVolumeDelete, []string{name}, q, nil, &out)
	return out.Deleted, err
}

// ResizeVolume grows a volume to size ("20GiB" or bytes).
func (s *Server) ResizeVolume(ctx context.Context, name, size string) (ResizeResponse, error) {
	var out ResizeResponse
	err := Call(ctx, s.c, SrvVolumeResize, []string{name}, nil, ResizeRequest{Size: size}, &out)
	return out, err
}

// SetVolumeLabels replaces a volume's labels.
func (s *Server) SetVolumeLabels(ctx context.Context, name string, labels map[string]string) error {
	return Call(ctx, s.c, SrvVolumeLabels, []string{name}, nil, LabelsRequest{Labels: labels}, nil)
}

// VolumeGrants are the grants of a volume's export.
func (s *Server) VolumeGrants(ctx context.Context, name string) ([]GrantRecord, error) {
	return list[GrantRecord](ctx, s.c, SrvVolumeGrants, []string{name}, nil)
}

// GrantVolume gives an identity access to a volume's export.
func (s *Server) GrantVolume(ctx context.Context, name string, g GrantRequest) error {
	return Call(ctx, s.c, SrvVolumeGrant, []string{name}, nil, g, nil)
}

// RevokeVolume takes an identity's grant off a volume's export.
func (s *Server) RevokeVolume(ctx context.Context, name, identity string) error {
	return Call(ctx, s.c, SrvVolumeRevoke, []string{name, identity}, nil, nil, nil)
}

// HoldVolume holds the writes of volume name for at most d.
func (s *Server) HoldVolume(ctx context.Context, name string, d time.Duration) (Hold, error) {
	var out Hold
	err := Call(ctx, s.c, SrvVolumeHold, []string{name}, nil, HoldRequest{For: d.String()}, &out)
	return out, err
}

// ReleaseVolume ends the hold token of volume name: whether it held
// until now.
func (s *Server) ReleaseVolume(ctx context.Context, name string, token uint64) (bool, error) {
	var out Released
	err := Call(ctx, s.c, SrvVolumeRelease, []string{name, strconv.FormatUint(token, 10)}, nil, nil, &out)
	return out.HeldThroughout, err
}

// Snapshot is the record of snapshot name (not_found if none).
func (s *Server) Snapshot(ctx context.Context, name string) (*SnapshotRecord, error) {
	recs, err := list[SnapshotRecord](ctx, s.c, SrvSnapshot, []string{name}, nil)
	return one(recs, err, "snapshot", name)
}

// Snapshots are the snapshot records, of volume if not "".
func (s *Server) Snapshots(ctx context.Context, volume string) ([]SnapshotRecord, error) {
	var q url.Values
	if volume != "" {
		q = url.Values{"volume": {volume}}
	}
	return list[SnapshotRecord](ctx, s.c, SrvSnapshots, nil, q)
}

// CreateSnapshot takes a snapshot, or finds the one of that name of the
// same volume.
func (s *Server) CreateSnapshot(ctx context.Context, req SnapshotRequest) (CreatedSnapshot, error) {
	var out CreatedSnapshot
	err := Call(ctx, s.c, SrvSnapshotCreate, nil, nil, req, &out)
	return out, err
}

// DeleteSnapshot deletes a snapshot; false if there was none.
func (s *Server) DeleteSnapshot(ctx context.Context, name string) (bool, error) {
	var out Deleted
	err := Call(ctx, s.c, SrvSnapshotDelete, []string{name}, nil, nil, &out)
	return out.Deleted, err
}

// Discover are the exports the caller may open.
func (s *Server) Discover(ctx context.Context) ([]DiscoverRecord, error) {
	return list[DiscoverRecord](ctx, s.c, SrvDiscover, nil, nil)
}
