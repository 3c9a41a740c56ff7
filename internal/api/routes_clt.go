package api

import "github.com/rnbd/rnbd/internal/ctl"

// rnbd-client's routes (docs/control-api.md, "rnbd-client"): its
// control socket only, root's, so each is the admin's.
var (
	CltMap         = Route{"POST", "/v1/devices", ctl.RightAdmin}
	CltDevices     = Route{"GET", "/v1/devices", ctl.RightAdmin}
	CltDevice      = Route{"GET", "/v1/devices/{name}", ctl.RightAdmin}
	CltDeviceUnmap = Route{"POST", "/v1/devices/{name}/unmap", ctl.RightAdmin}
	CltDeviceRemap = Route{"POST", "/v1/devices/{name}/remap", ctl.RightAdmin}
	CltDeviceSize  = Route{"POST", "/v1/devices/{name}/resize", ctl.RightAdmin}
	// CltDeviceLeg replaces a mirror's leg ({leg}: 0, 1, 2 or witness).
	CltDeviceLeg = Route{"POST", "/v1/devices/{name}/legs/{leg}/replace", ctl.RightAdmin}

	CltSessions         = Route{"GET", "/v1/sessions", ctl.RightAdmin}
	CltSession          = Route{"GET", "/v1/sessions/{name}", ctl.RightAdmin}
	CltSessionSet       = Route{"POST", "/v1/sessions/{name}/set", ctl.RightAdmin}
	CltSessionReconnect = Route{"POST", "/v1/sessions/{name}/reconnect", ctl.RightAdmin}
	CltSessionAddPath   = Route{"POST", "/v1/sessions/{name}/paths", ctl.RightAdmin}

	CltPaths          = Route{"GET", "/v1/paths", ctl.RightAdmin}
	CltPath           = Route{"GET", "/v1/paths/{name}", ctl.RightAdmin}
	CltPathRemove     = Route{"POST", "/v1/paths/{name}/remove", ctl.RightAdmin}
	CltPathReconnect  = Route{"POST", "/v1/paths/{name}/reconnect", ctl.RightAdmin}
	CltPathDisconnect = Route{"POST", "/v1/paths/{name}/disconnect", ctl.RightAdmin}

	CltStats      = Route{"GET", "/v1/stats", ctl.RightAdmin}
	CltStatsReset = Route{"POST", "/v1/stats/reset", ctl.RightAdmin}
)

// ClientRoutes are every route of rnbd-client.
var ClientRoutes = Table{
	CltMap, CltDevices, CltDevice, CltDeviceUnmap, CltDeviceRemap, CltDeviceSize, CltDeviceLeg,
	CltSessions, CltSession, CltSessionSet, CltSessionReconnect,
	CltPaths, CltPath, CltSessionAddPath, CltPathRemove, CltPathReconnect, CltPathDisconnect,
	CltStats, CltStatsReset,
}
