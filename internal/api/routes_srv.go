package api

import "github.com/rnbd/rnbd/internal/ctl"

// rnbd-server's routes (docs/control-api.md, "rnbd-server"), each with
// the right it needs: read for what only looks, provision for the
// volumes of the pools, their snapshots and their grants (what an
// orchestrator needs, nothing else), admin for the rest: exports of
// paths, session names, disconnects, closes and resets.
var (
	SrvDevices     = Route{"GET", "/v1/devices", ctl.RightRead}
	SrvDevice      = Route{"GET", "/v1/devices/{name}", ctl.RightRead}
	SrvDeviceClose = Route{"POST", "/v1/devices/{name}/close", ctl.RightAdmin}

	SrvExports      = Route{"GET", "/v1/exports", ctl.RightRead}
	SrvExport       = Route{"GET", "/v1/exports/{name}", ctl.RightRead}
	SrvExportMap    = Route{"POST", "/v1/exports", ctl.RightAdmin}
	SrvExportResize = Route{"POST", "/v1/exports/{name}/resize", ctl.RightAdmin}
	SrvExportUnmap  = Route{"DELETE", "/v1/exports/{name}", ctl.RightAdmin}
	SrvExportGrants = Route{"GET", "/v1/exports/{name}/grants", ctl.RightRead}
	// An export's grants: a provisioner's of the volumes' exports only
	// (the routes of rnbd-csi's controller before the volume routes,
	// kept for it); any export's for an admin.
	SrvExportGrant  = Route{"POST", "/v1/exports/{name}/grants", ctl.RightProvision}
	SrvExportRevoke = Route{"DELETE", "/v1/exports/{name}/grants/{identity}", ctl.RightProvision}

	SrvSessions          = Route{"GET", "/v1/sessions", ctl.RightRead}
	SrvSession           = Route{"GET", "/v1/sessions/{name}", ctl.RightRead}
	SrvSessionDisconnect = Route{"POST", "/v1/sessions/{name}/disconnect", ctl.RightAdmin}
	SrvSessionNames      = Route{"GET", "/v1/session-names", ctl.RightRead}
	SrvSessionNameBind   = Route{"PUT", "/v1/session-names/{name}", ctl.RightAdmin}
	SrvSessionNameForget = Route{"DELETE", "/v1/session-names/{name}", ctl.RightAdmin}

	SrvPaths          = Route{"GET", "/v1/paths", ctl.RightRead}
	SrvPath           = Route{"GET", "/v1/paths/{name}", ctl.RightRead}
	SrvPathDisconnect = Route{"POST", "/v1/paths/{name}/disconnect", ctl.RightAdmin}

	SrvStats      = Route{"GET", "/v1/stats", ctl.RightRead}
	SrvStatsReset = Route{"POST", "/v1/stats/reset", ctl.RightAdmin}

	SrvPools = Route{"GET", "/v1/pools", ctl.RightRead}

	SrvVolumes      = Route{"GET", "/v1/volumes", ctl.RightRead}
	SrvVolume       = Route{"GET", "/v1/volumes/{name}", ctl.RightRead}
	SrvVolumeCreate = Route{"POST", "/v1/volumes", ctl.RightProvision}
	SrvVolumeDelete = Route{"DELETE", "/v1/volumes/{name}", ctl.RightProvision}
	SrvVolumeResize = Route{"POST", "/v1/volumes/{name}/resize", ctl.RightProvision}
	SrvVolumeLabels = Route{"PUT", "/v1/volumes/{name}/labels", ctl.RightProvision}
	SrvVolumeGrants = Route{"GET", "/v1/volumes/{name}/grants", ctl.RightRead}
	SrvVolumeGrant  = Route{"POST", "/v1/volumes/{name}/grants", ctl.RightProvision}
	SrvVolumeRevoke = Route{"DELETE", "/v1/volumes/{name}/grants/{identity}", ctl.RightProvision}
	// A hold of a volume's writes, for snapshots of several volumes that
	// are one point in time (a replicated volume's legs).
	SrvVolumeHold    = Route{"POST", "/v1/volumes/{name}/hold", ctl.RightProvision}
	SrvVolumeRelease = Route{"DELETE", "/v1/volumes/{name}/hold/{token}", ctl.RightProvision}

	SrvSnapshots      = Route{"GET", "/v1/snapshots", ctl.RightRead}
	SrvSnapshot       = Route{"GET", "/v1/snapshots/{name}", ctl.RightRead}
	SrvSnapshotCreate = Route{"POST", "/v1/snapshots", ctl.RightProvision}
	SrvSnapshotDelete = Route{"DELETE", "/v1/snapshots/{name}", ctl.RightProvision}

	SrvDiscover = Route{"GET", "/v1/discover", ctl.RightDiscover}
)

// ServerRoutes are every route of rnbd-server: what it registers, what
// its rights are looked up in, what docs/control-api.md's tables are
// held to.
var ServerRoutes = Table{
	SrvDevices, SrvDevice, SrvDeviceClose,
	SrvExports, SrvExport, SrvExportMap, SrvExportResize, SrvExportUnmap,
	SrvSessions, SrvSession, SrvSessionDisconnect, SrvSessionNames, SrvSessionNameBind, SrvSessionNameForget,
	SrvPaths, SrvPath, SrvPathDisconnect,
	SrvStats, SrvStatsReset,
	SrvPools,
	SrvVolumes, SrvVolume, SrvVolumeCreate, SrvVolumeDelete, SrvVolumeResize, SrvVolumeLabels,
	SrvSnapshots, SrvSnapshot, SrvSnapshotCreate, SrvSnapshotDelete,
	SrvExportGrants, SrvExportGrant, SrvExportRevoke,
	SrvVolumeGrants, SrvVolumeGrant, SrvVolumeRevoke,
	SrvVolumeHold, SrvVolumeRelease,
	SrvDiscover,
}
