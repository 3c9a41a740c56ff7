package api

import (
	"context"
	"strconv"

	"github.com/rnbd/rnbd/internal/ctl"
)

// Client is a typed client of an rnbd-client daemon's control API (its
// unix socket, ctl.Dial). Errors are the daemon's, with their class.
type Client struct{ c *ctl.Client }

// NewClient is the typed client over c.
func NewClient(c *ctl.Client) *Client { return &Client{c: c} }

// Devices are the device records.
func (c *Client) Devices(ctx context.Context) ([]CltDeviceRecord, error) {
	return list[CltDeviceRecord](ctx, c.c, CltDevices, nil, nil)
}

// Map maps a device.
func (c *Client) Map(ctx context.Context, m Mapping) (MapResponse, error) {
	var out MapResponse
	err := Call(ctx, c.c, CltMap, nil, nil, m, &out)
	return out, err
}

// Unmap unmaps device (rnbdN); force: even while it is open.
func (c *Client) Unmap(ctx context.Context, device string, force bool) error {
	return Call(ctx, c.c, CltDeviceUnmap, []string{device}, nil, UnmapRequest{Force: force}, nil)
}

// Resize sets device's size (rnbdN): a size the server's device has
// room for; a mirror grows to it once its legs have.
func (c *Client) Resize(ctx context.Context, device string, size int64) error {
	return Call(ctx, c.c, CltDeviceSize, []string{device}, nil, DeviceResizeRequest{Size: strconv.FormatInt(size, 10)}, nil)
}

// Sessions are the session records.
func (c *Client) Sessions(ctx context.Context) ([]CltSessionRecord, error) {
	return list[CltSessionRecord](ctx, c.c, CltSessions, nil, nil)
}

// Session is the record of session name (not_found if none).
func (c *Client) Session(ctx context.Context, name string) (*CltSessionRecord, error) {
	recs, err := list[CltSessionRecord](ctx, c.c, CltSession, []string{name}, nil)
	return one(recs, err, "session", name)
}
