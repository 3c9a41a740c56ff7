package api

// rnbd-server's requests, answers and records (docs/control-api.md has
// each field with its JSON type and meaning).

import "time"

// Requests and answers.
type (
	// MapRequest is an export as map gives it (POST /v1/exports), and as
	// an [[export]] table of the configuration file does; a volume's
	// export rules are one without name and path.
	MapRequest struct {
		Name     string   `json:"name,omitempty" toml:"name"`
		Path     string   `json:"path,omitempty" toml:"path"`
		ReadOnly bool     `json:"read_only,omitempty" toml:"read_only"`
		Allow    []string `json:"allow,omitempty" toml:"allow"`
		// AllowFrom: the networks (CIDR) an OPEN may come from; empty,
		// any (rnbd.Export.AllowFrom).
		AllowFrom []string `json:"allow_from,omitempty" toml:"allow_from"`
		// AllowIdentities: NAME or NAME=ro|rw|migration, the client
		// certificate names that may open it (rnbd.Export.AllowIdentities).
		AllowIdentities []string `json:"allow_identities,omitempty" toml:"allow_identities"`
		// Migration: access_mode=migration allowed (rnbd.Export.Migration).
		Migration bool `json:"migration,omitempty" toml:"migration"`
		// MaxSessions: sessions that may have it open at once; 0 no
		// bound (rnbd.Export.MaxSessions).
		MaxSessions int `json:"max_sessions,omitempty" toml:"max_sessions"`
		// WriteThrough: every write durable on completion, no write
		// cache announced (rnbd.Export.WriteThrough).
		WriteThrough bool `json:"write_through,omitempty" toml:"write_through"`
		// GrantsOnly: only AllowIdentities may open it; none, no client
		// (rnbd.Export.GrantsOnly). Unset, false on the unix socket and
		// in the configuration file, true on the admin listener: an
		// export made over the network is open to no one until granted,
		// unless its admin says otherwise.
		GrantsOnly *bool `json:"grants_only,omitempty" toml:"grants_only"`
	}

	// VolumeRequest asks for a volume (POST /v1/volumes): made in Pool,
	// empty or a clone of FromVolume or FromSnapshot, and exported under
	// its name with Export's rules (whose name and path are the
	// volume's: left empty). Size may be left empty for a clone: its
	// source's.
	VolumeRequest struct {
		Name         string            `json:"name"`
		Pool         string            `json:"pool"`
		Size         string            `json:"size,omitempty"`
		FromVolume   string            `json:"from_volume,omitempty"`
		FromSnapshot string            `json:"from_snapshot,omitempty"`
		Labels       map[string]string `json:"labels,omitempty"`
		Export       MapRequest        `json:"export,omitzero"`
	}
	// LabelsRequest replaces a volume's labels (PUT
	// /v1/volumes/{name}/labels): the caller's, kept with the volume.
	LabelsRequest struct {
		Labels map[string]string `json:"labels"`
	}
	// SnapshotRequest asks for a snapshot of a volume (POST /v1/snapshots).
	SnapshotRequest struct {
		Name   string            `json:"name"`
		Volume string            `json:"volume"`
		Labels map[string]string `json:"labels,omitempty"`
	}
	// HoldRequest holds a volume's writes (POST /v1/volumes/{name}/hold)
	// for at most For ("2s"; at most rnbd.MaxHold).
	HoldRequest struct {
		For string `json:"for"`
	}
	// Hold is a hold on: its token, for its release, and when it ends by
	// itself if not released.
	Hold struct {
		Token uint64    `json:"token"`
		Until time.Time `json:"until"`
	}
	// Released: HeldThroughout false is a hold whose time ran out before
	// its release (writes ran since).
	Released struct {
		HeldThroughout bool `json:"held_throughout"`
	}
	// GrantRequest gives an identity access to an export or a volume
	// (POST …/grants): ro, rw (the default) or migration.
	GrantRequest struct {
		Identity string `json:"identity"`
		Access   string `json:"access,omitempty"`
	}
	// ResizeRequest: Size as "20GiB" or bytes; Force shrinks an export
	// that sessions have open (rnbd.Server.Resize); a volume grows only.
	ResizeRequest struct {
		Size  string `json:"size"`
		Force bool   `json:"force,omitempty"`
	}
	ResizeResponse struct {
		Was int64 `json:"was"`
		Now int64 `json:"now"`
	}
	// CloseRequest closes a device for Session ("": every session).
	CloseRequest struct {
		Session string `json:"session"`
	}
	CloseResponse struct {
		Closed int `json:"closed"`
	}
	// BindRequest gives a session name to a client identity
	// (rnbd.Server.BindSessionName).
	BindRequest struct {
		Identity string `json:"identity"`
	}
	// BindResponse: Disconnected is 1 if a session that had the name
	// under another identity was disconnected.
	BindResponse struct {
		Disconnected int `json:"disconnected"`
	}
	// CreatedVolume is what POST /v1/volumes made or found: Created is
	// false when it was there already with the same parameters (a
	// retry).
	CreatedVolume struct {
		Created bool         `json:"created"`
		Record  VolumeRecord `json:"record"`
	}
	// CreatedSnapshot: as CreatedVolume.
	CreatedSnapshot struct {
		Created bool           `json:"created"`
		Record  SnapshotRecord `json:"record"`
	}
	// Deleted answers a DELETE of a volume or a snapshot: false when
	// there was nothing of that name (success all the same: a retry).
	Deleted struct {
		Deleted bool `json:"deleted"`
	}
)

// Rules are who may open an export, as the device and export records
// give them (the access rules of docs/server.md).
type Rules struct {
	Allow           Strings `json:"allow"`
	AllowFrom       Strings `json:"allow_from"`
	AllowIdentities Grants  `json:"allow_identities"`
	MaxSessions     *int    `json:"max_sessions"`
	Migration       bool    `json:"migration"`
	WriteThrough    bool    `json:"write_through"`
}

// Records.
type (
	// SrvDeviceRecord is an export, or a device a session has open.
	SrvDeviceRecord struct {
		DevName     string  `json:"devname"`
		DevPath     string  `json:"devpath"`
		SessName    string  `json:"sessname"`
		MappingPath string  `json:"mapping_path"`
		AccessMode  string  `json:"access_mode"`
		ReadOnly    bool    `json:"read_only"`
		DeviceID    *uint32 `json:"device_id"`
		State       string  `json:"state"`
		WriteCache  string  `json:"write_cache"`
		RxSect      uint64  `json:"rx_sect"`
		TxSect      uint64  `json:"tx_sect"`
		FlushCnt    uint64  `json:"flush_cnt"`
		FUACnt      uint64  `json:"fua_cnt"`
		DiscardCnt  uint64  `json:"discard_cnt"`
		WZeroCnt    uint64  `json:"wzero_cnt"`
		Source      string  `json:"source"`
		Reason      string  `json:"reason"`
		Rules
		Direction string `json:"direction"`
	}
	// ExportRecord is an export and its rules.
	ExportRecord struct {
		Name     string `json:"name"`
		Path     string `json:"path"`
		ReadOnly bool   `json:"read_only"`
		Rules
		GrantsOnly bool   `json:"grants_only"`
		Source     string `json:"source"`
		NotServed  string `json:"not_served"`
	}
	// SrvSessionRecord is a session of a client.
	SrvSessionRecord struct {
		SessName string `json:"sessname"`
		PathSum
		Devices   int    `json:"devices"`
		Peer      string `json:"peer"`
		Direction string `json:"direction"`
	}
	// SessionNameRecord is a session name bound to a client identity.
	SessionNameRecord struct {
		SessName string `json:"sessname"`
		Identity string `json:"identity"`
	}
	// SrvPathRecord is a path of a session.
	SrvPathRecord struct {
		SessName  string `json:"sessname"`
		PathName  string `json:"pathname"`
		SrcAddr   string `json:"src_addr"`
		DstAddr   string `json:"dst_addr"`
		HCAName   string `json:"hca_name"`
		HCAPort   int    `json:"hca_port"`
		State     string `json:"state"`
		RxBytes   uint64 `json:"rx_bytes"`
		TxBytes   uint64 `json:"tx_bytes"`
		Inflights int64  `json:"inflights"`
		Direction string `json:"direction"`
	}
	// SrvStatsRecord is a path's counters, as the kernel server's stats.
	SrvStatsRecord struct {
		SessName  string  `json:"sessname"`
		PathName  string  `json:"pathname"`
		RDMA      SrvRDMA `json:"rdma"`
		Inflights int64   `json:"inflights"`
	}
	// SrvRDMA is the kernel server's stats/rdma, "rd_cnt rd_bytes
	// wr_cnt wr_bytes", by name.
	SrvRDMA struct {
		RdCnt   uint64 `json:"rd_cnt"`
		RdBytes uint64 `json:"rd_bytes"`
		WrCnt   uint64 `json:"wr_cnt"`
		WrBytes uint64 `json:"wr_bytes"`
	}
	// PoolRecord is a pool with its capacity (null where not known).
	PoolRecord struct {
		Name         string `json:"name"`
		Type         string `json:"type"`
		Where        string `json:"where"`
		State        string `json:"state"`
		Reason       string `json:"reason"`
		Total        *int64 `json:"total"`
		Used         *int64 `json:"used"`
		Promised     *int64 `json:"promised"`
		Allocatable  *int64 `json:"allocatable"`
		MetadataSize *int64 `json:"metadata_size"`
		MetadataUsed *int64 `json:"metadata_used"`
		Volumes      int    `json:"volumes"`
	}
	// VolumeRecord is a volume as its pool has it, with its export's
	// rules as served.
	VolumeRecord struct {
		Name            string `json:"name"`
		Pool            string `json:"pool"`
		Size            *int64 `json:"size"`
		Source          string `json:"source"`
		SourceSnapshot  string `json:"source_snapshot"`
		Created         string `json:"created"`
		Labels          Labels `json:"labels"`
		Path            string `json:"path"`
		State           string `json:"state"`
		Reason          string `json:"reason"`
		ReadOnly        bool   `json:"read_only"`
		AllowIdentities Grants `json:"allow_identities"`
		GrantsOnly      bool   `json:"grants_only"`
		Sessions        int    `json:"sessions"`
	}
	// SnapshotRecord is a snapshot of a volume.
	SnapshotRecord struct {
		Name    string `json:"name"`
		Pool    string `json:"pool"`
		Volume  string `json:"volume"`
		Size    int64  `json:"size"`
		Created string `json:"created"`
		Labels  Labels `json:"labels"`
	}
	// GrantRecord is one identity's access to an export.
	GrantRecord struct {
		Export   string `json:"export"`
		Identity string `json:"identity"`
		Access   string `json:"access"`
	}
	// DiscoverRecord is an export the caller may open.
	DiscoverRecord struct {
		Name     string `json:"name"`
		Size     *int64 `json:"size"`
		Access   string `json:"access"`
		ReadOnly bool   `json:"read_only"`
	}
)

// Volume states of the volume record.
const (
	VolumeServed    = "served"
	VolumeNotServed = "not served"
	VolumeCreating  = "creating"
	VolumeDeleting  = "deleting"
)

// PathSum is what both daemons' session records say of a session's
// paths, summed path by path the same way (output.PathSum sums them).
type PathSum struct {
	PathCnt    int    `json:"path_cnt"`
	ActPathCnt int    `json:"act_path_cnt"`
	State      string `json:"state"`
	PathUU     string `json:"path_uu"`
	RxBytes    uint64 `json:"rx_bytes"`
	TxBytes    uint64 `json:"tx_bytes"`
	Inflights  int64  `json:"inflights"`
}

// NewPathSum is the sum of no path: a session that has none is
// disconnected.
func NewPathSum() PathSum { return PathSum{State: "disconnected"} }

// Add counts a path: whether it is connected, the bytes it received and
// sent, its requests in flight. Bytes received and sent are as the
// daemon sees them: a server receives the writes, a client the reads. A
// session is "connected" while one of its paths is.
func (s *PathSum) Add(connected bool, rx, tx uint64, inflight int64) {
	s.PathCnt++
	s.RxBytes, s.TxBytes, s.Inflights = s.RxBytes+rx, s.TxBytes+tx, s.Inflights+inflight
	if connected {
		s.ActPathCnt++
		s.PathUU += "U"
		s.State = "connected"
	} else {
		s.PathUU += "_"
	}
}
