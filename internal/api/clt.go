package api

import (
	"strconv"

	"github.com/rnbd/rnbd/internal/ctl"
)

// rnbd-client's requests, answers and records (docs/control-api.md has
// each field with its JSON type and meaning).

// Requests and answers.
type (
	// Mapping is one mapped device as the API and the state file keep
	// it: the kernel's map_device parameters and where the device is
	// served (POST /v1/devices).
	Mapping struct {
		Device     string   `json:"device"` // rnbdN
		SessName   string   `json:"sessname"`
		Paths      []string `json:"paths"`
		DevicePath string   `json:"device_path"`
		AccessMode string   `json:"access_mode"`
		DestPort   uint16   `json:"dest_port"`
		Transport  string   `json:"transport"`
		As         string   `json:"as"` // nbd, ublk or socket:PATH
		// Kernel is the /dev/nbdN or /dev/ublkbN a mapping "as nbd" or
		// "as ublk" got; a restart takes the same device back.
		Kernel string `json:"kernel_device,omitempty"`
		// SessUUID is the RTRS session's paths UUID (hex): a restarted
		// daemon dials its sessions with the same one, so the server
		// takes them for the sessions it may still hold rather than
		// refusing their names.
		SessUUID string `json:"sess_uuid,omitempty"`
		// Settings of the session given with the map that made it, or
		// with session set since: a restart dials the session with them.
		// Unset ones are the daemon's configuration.
		Settings SetRequest `json:"session_settings,omitzero"`
		// Mirror names a mirror mapping: one device over Legs on
		// different storage nodes (docs/replication.md). Its name is
		// the mirror's identity on its legs' metadata. SessName, Paths
		// and DevicePath are empty in a mirror's mapping.
		Mirror  string `json:"mirror,omitempty"`
		Legs    []Leg  `json:"legs,omitempty"`
		Witness *Leg   `json:"witness,omitempty"`
		// Spares are devices on other storage nodes that take the
		// place of a leg out longer than mirror_spare_after, tried
		// in their order, rebuilt in full (as replace-leg does it);
		// one taken leaves the list.
		Spares []Leg `json:"spares,omitempty"`
		// Adopt names the mirror whose voters the legs and witness are
		// copies of, one point in time (a volume restored from a
		// replicated volume's snapshots): their metadata may carry that
		// mirror's identity, which the first assembly replaces with
		// Mirror's. Kept: a leg away at that assembly still carries it.
		Adopt string `json:"adopt,omitempty"`
		// Create makes the mirror's metadata on its legs, new volumes
		// holding no superblock: map only, not kept.
		Create bool `json:"create,omitempty"`
		// CreateIfNew makes the metadata where no assembly ever served
		// the mirror (every voter blank, or a create that stopped part
		// way), else assembles it as a map does: a new volume's first
		// map and every retry of it (mirror.CreateIfNew). Map only, not
		// kept.
		CreateIfNew bool `json:"create_if_new,omitempty"`
		// RegionSize, with Create or CreateIfNew, is the new mirror's bitmap region
		// (a size, "4MiB"; empty: the default): map only, not kept.
		RegionSize string `json:"region_size,omitempty"`
		// Size is the data a mirror must have at least ("20GiB"): one
		// with less (a volume restored from a smaller snapshot, its legs
		// made larger) grows to it before its device is made, as resize
		// grows it, if every leg is in sync; else it is mapped at its
		// size, and grows by resize once its legs are. Map only, not
		// kept.
		Size string `json:"size,omitempty"`
		// Force assembles the mirror without the proof of currency it
		// asks for: map only, not kept; logged and audited.
		Force *MirrorForce `json:"force,omitempty"`
	}
	// Leg is a leg or the witness of a mirror: an RNBD device on a
	// storage node, through a session of its own (the mapping's
	// transport, and its session settings).
	Leg struct {
		SessName   string   `json:"sessname"`
		Paths      []string `json:"paths"`
		DevicePath string   `json:"device_path"`
		DestPort   uint16   `json:"dest_port"`
		// SessUUID, as a Mapping's: the restarted daemon dials the
		// leg's session with it.
		SessUUID string `json:"sess_uuid,omitempty"`
	}
	// MirrorForce is an operator's order to serve a mirror that
	// refused: By names who gives it (the audit line, and the legs'
	// superblocks); From is the leg to keep as the only source, -1 for
	// the mirror's choice.
	MirrorForce struct {
		By   string `json:"by"`
		From int    `json:"from"`
	}
	// MapResponse is the answer of POST /v1/devices: the mapping made,
	// and Note, what the operator should know of how it is served (a
	// socket where the request implied /dev/nbdN, a mirror mapped at less
	// than its Size); empty when nothing.
	MapResponse struct {
		Mapping
		Note string `json:"note,omitempty"`
	}
	// SetRequest is a session's settings (session set, or map's for
	// the session it makes); unset fields stay as they are.
	SetRequest struct {
		MPPolicy             *string `json:"mpath_policy,omitempty"`
		MaxReconnectAttempts *int    `json:"max_reconnect_attempts,omitempty"`
		NoPathTimeout        *string `json:"no_path_timeout,omitempty"`
		// FastIOFailTmo: a duration, or "off".
		FastIOFailTmo *string `json:"fast_io_fail_tmo,omitempty"`
		// CtrlLossTmo: a duration, or "off".
		CtrlLossTmo *string `json:"ctrl_loss_tmo,omitempty"`
		// ReconnectDelay: a duration.
		ReconnectDelay *string `json:"reconnect_delay,omitempty"`
	}
	// DeviceResizeRequest: Size as "20GiB" or bytes.
	DeviceResizeRequest struct {
		Size string `json:"size"`
	}
	// PathRequest adds a path to a session: "[ip:SRC@]ip:DST".
	PathRequest struct {
		Path string `json:"path"`
	}
	// UnmapRequest unmaps a device; Force even while it is open.
	UnmapRequest struct {
		Force bool `json:"force"`
	}
)

// Merge overlays what o sets on req.
func (req SetRequest) Merge(o SetRequest) SetRequest {
	if o.MPPolicy != nil {
		req.MPPolicy = o.MPPolicy
	}
	if o.MaxReconnectAttempts != nil {
		req.MaxReconnectAttempts = o.MaxReconnectAttempts
	}
	if o.NoPathTimeout != nil {
		req.NoPathTimeout = o.NoPathTimeout
	}
	if o.FastIOFailTmo != nil {
		req.FastIOFailTmo = o.FastIOFailTmo
	}
	if o.CtrlLossTmo != nil {
		req.CtrlLossTmo = o.CtrlLossTmo
	}
	if o.ReconnectDelay != nil {
		req.ReconnectDelay = o.ReconnectDelay
	}
	return req
}

// SettingKeys are the session settings Parse takes.
const SettingKeys = "mpath_policy, max_reconnect_attempts, reconnect_delay, ctrl_loss_tmo, no_path_timeout or fast_io_fail_tmo"

// SettingNames are SettingKeys one by one, and SettingValues the words
// some of them take (for completion).
var (
	SettingNames  = []string{"mpath_policy", "max_reconnect_attempts", "reconnect_delay", "ctrl_loss_tmo", "no_path_timeout", "fast_io_fail_tmo"}
	SettingValues = map[string][]string{
		"mpath_policy":     {"round-robin", "min-inflight", "min-latency"},
		"ctrl_loss_tmo":    {"off"},
		"fast_io_fail_tmo": {"off"},
	}
)

// Parse sets the session setting k to v (session set KEY=VALUE, and the
// map string's session keys); values are checked by the daemon.
func (req *SetRequest) Parse(k, v string) error {
	switch k {
	case "mpath_policy", "mp_policy":
		req.MPPolicy = &v
	case "max_reconnect_attempts":
		n, err := strconv.Atoi(v)
		if err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "max_reconnect_attempts %q: want a number", v)
		}
		req.MaxReconnectAttempts = &n
	case "no_path_timeout":
		req.NoPathTimeout = &v
	case "fast_io_fail_tmo":
		req.FastIOFailTmo = &v
	case "ctrl_loss_tmo":
		req.CtrlLossTmo = &v
	case "reconnect_delay":
		req.ReconnectDelay = &v
	default:
		return ctl.Errorf(ctl.CodeInvalid, "unknown setting %q: want %s", k, SettingKeys)
	}
	return nil
}

// Records.
type (
	// CltDeviceRecord is a mapped device.
	CltDeviceRecord struct {
		DevName     string `json:"devname"`
		SessName    string `json:"sessname"`
		DevPath     string `json:"devpath"`
		MappingPath string `json:"mapping_path"`
		AccessMode  string `json:"access_mode"`
		State       string `json:"state"`
		Size        int64  `json:"size"`
		Socket      string `json:"socket"`
		IOMode      string `json:"io_mode"`
		Direction   string `json:"direction"`
		// Mirror is a mirror's name, Legs its legs (empty for one
		// device).
		Mirror string         `json:"mirror"`
		Legs   []CltLegRecord `json:"legs"`
		// RegionSize is a mirror's bitmap region, bytes (0 for one
		// device, and for a mirror not served).
		RegionSize int64 `json:"region_size"`
	}
	// CltLegRecord is a mirror's leg, its witness (leg "witness") or a
	// spare (leg "spare0", ...).
	CltLegRecord struct {
		Leg        string `json:"leg"`
		SessName   string `json:"sessname"`
		DevicePath string `json:"device_path"`
		// State: "in sync", "resyncing", "stale" (out: it missed
		// writes) or "missing" (not reached); a witness "voting" or
		// "missing"; a spare "spare".
		State string `json:"state"`
		// Resync is a resyncing leg's progress in bytes copied of
		// ResyncTotal.
		Resync      int64 `json:"resync_bytes"`
		ResyncTotal int64 `json:"resync_total_bytes"`
	}
	// CltSessionRecord is a session to a server; durations in seconds,
	// null for a timer that is off or a time left that does not run.
	CltSessionRecord struct {
		SessName             string   `json:"sessname"`
		PathCnt              int      `json:"path_cnt"`
		ActPathCnt           int      `json:"act_path_cnt"`
		State                string   `json:"state"`
		PathUU               string   `json:"path_uu"`
		MPPolicy             string   `json:"mpath_policy"`
		MPPolicySysfs        string   `json:"mpath_policy_sysfs"`
		NoPathTimeoutSec     float64  `json:"no_path_timeout_sec"`
		NoPathSince          *string  `json:"no_path_since"`
		WaitingIO            int      `json:"waiting_io"`
		WaitingIOFailsInSec  *float64 `json:"waiting_io_fails_in_sec"`
		FastIOFailTmoSec     *float64 `json:"fast_io_fail_tmo_sec"`
		FastIOFailInSec      *float64 `json:"fast_io_fail_in_sec"`
		MaxReconnectAttempts int      `json:"max_reconnect_attempts"`
		ReconnectDelaySec    float64  `json:"reconnect_delay_sec"`
		CtrlLossTmoSec       *float64 `json:"ctrl_loss_tmo_sec"`
		RxBytes              uint64   `json:"rx_bytes"`
		TxBytes              uint64   `json:"tx_bytes"`
		Inflights            int64    `json:"inflights"`
		Devices              int      `json:"devices"`
		Transport            string   `json:"transport"`
		Direction            string   `json:"direction"`
	}
	// CltPathRecord is a path of a session.
	CltPathRecord struct {
		SessName             string     `json:"sessname"`
		PathName             string     `json:"pathname"`
		SrcAddr              string     `json:"src_addr"`
		DstAddr              string     `json:"dst_addr"`
		HCAName              string     `json:"hca_name"`
		HCAPort              int        `json:"hca_port"`
		State                string     `json:"state"`
		RTRSState            string     `json:"rtrs_state"`
		RxBytes              uint64     `json:"rx_bytes"`
		TxBytes              uint64     `json:"tx_bytes"`
		Inflights            int64      `json:"inflights"`
		Reconnects           Reconnects `json:"reconnects"`
		ReconnectAttempts    int        `json:"reconnect_attempts"`
		NextReconnectInSec   *float64   `json:"next_reconnect_in_sec"`
		CtrlLossInSec        *float64   `json:"ctrl_loss_in_sec"`
		ReconnectDelaySec    float64    `json:"reconnect_delay_sec"`
		MaxReconnectAttempts int        `json:"max_reconnect_attempts"`
		CtrlLossTmoSec       *float64   `json:"ctrl_loss_tmo_sec"`
		CurLatencyUs         float64    `json:"cur_latency_us"`
		RDMA                 CltRDMA    `json:"rdma"`
		Direction            string     `json:"direction"`
	}
	// CltStatsRecord is a path's counters, as the kernel client's
	// stats.
	CltStatsRecord struct {
		SessName     string     `json:"sessname"`
		PathName     string     `json:"pathname"`
		RDMA         CltRDMA    `json:"rdma"`
		Reconnects   Reconnects `json:"reconnects"`
		CurLatencyUs float64    `json:"cur_latency_us"`
	}
	// Reconnects is the kernel's stats/reconnects, "successful failed",
	// by name.
	Reconnects struct {
		Successful int64 `json:"successful"`
		Failed     int64 `json:"failed"`
	}
	// CltRDMA is the kernel client's stats/rdma, "rd_cnt rd_bytes wr_cnt
	// wr_bytes inflight failover_cnt", by name.
	CltRDMA struct {
		RdCnt       uint64 `json:"rd_cnt"`
		RdBytes     uint64 `json:"rd_bytes"`
		WrCnt       uint64 `json:"wr_cnt"`
		WrBytes     uint64 `json:"wr_bytes"`
		Inflight    int64  `json:"inflight"`
		FailoverCnt uint64 `json:"failover_cnt"`
	}
)
