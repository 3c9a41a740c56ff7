// Package serverd is the rnbd-server daemon: it runs the RTRS server and
// the RNBD server on top, keeps the explicit exports and the volumes in
// a state file, makes volumes in pools, and answers the control API on
// a unix socket and, with [admin], on TLS.
//
// Files, read top-down:
//
//	config.go          Config: the TOML file and its defaults, validated
//	keys.go            ConfigKeys: the reference of the file's keys (docs, man page)
//	daemon.go          Daemon, Start and Stop, what it warns about at start
//	routes.go          the control API: devices, exports, sessions, paths, stats
//	routes_volume.go   the control API: pools, volumes, snapshots, grants
//	admin.go           the admin listener (TLS), roles and rights, discovery
//	export.go          map and unmap, grant and revoke; an export parsed
//	state.go           the state file; the exports not served, tried again
//	probe.go           pathProbe: a stat of an export's path, bounded
//	sandbox.go         the file system as the unit's sandbox shows it
//	pools.go           [[pool]]: opened at start and retried, each reconciled
//	volume.go          volumes: create, delete, resize, each step's intent saved
//	snapshot.go        snapshots: take and delete, named across the pools
//	names.go           nameLocks: one change of a volume or snapshot name at a time
//	records.go         the records of devices, exports, sessions, paths, stats
//	records_volume.go  the records of pools, volumes, snapshots, grants
//	metrics.go         the Prometheus collector
//
// Locks, in the order they are taken (a lock may be taken while one
// above it is held, never the other way round):
//
//	nameLocks' names   a volume's or snapshot's name, by a change of it
//	                   (create, delete, resize, snapshot, the reconcile
//	                   of a pool): held across the pool's commands and the
//	                   look at the volume's path; several in sorted order
//	  Daemon.stateMu   the exports, the volumes, the pools served, the
//	                   state file and its saving; held over rnbd.Server's
//	                   Map and Unmap of a mapped export and the save after
//	                   them (a volume's export is mapped and unmapped with
//	                   its name held and stateMu not: the save that
//	                   follows keeps only the volumes the daemon knows),
//	                   never over a pool's command or a look at a path
//	    rnbd.Server's, rtrs.Server's own
//	nameLocks.mu       the names held; held over no call
//	pathProbe.mu       the stats pending; held over no call
//
// A pool (pool.Pool) is called with a name held and stateMu not: its
// own locks come after the names and never meet stateMu. The reads of
// volumes, pools and snapshots copy what they need under stateMu and
// ask the pools after, with no lock held, so that a pool command of
// seconds (lvm2) holds no map, unmap or list behind it.
//
// rnbd.Server calls back into the daemon (Stat, Answers, NameHeld,
// OwnersChanged), under stateMu when a map is why: none of them takes
// stateMu (OwnersChanged only wakes saveOwners, which takes it in its own
// goroutine).
//
// Which fields each lock guards, and which functions run with it held,
// are +checklocks annotations, checked by gVisor's checklocks analyzer
// in make vet; the order above is not.
package serverd
