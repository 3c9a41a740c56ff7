// Package clientd is the rnbd-client daemon: it holds RNBD client
// sessions and the devices mapped through them, serves each device to
// NBD clients, keeps the mappings in a state file, and answers the
// control API on a unix socket.
//
// The files read top-down: routes.go (the control API), daemon.go (Start,
// Stop, map and unmap), spec.go (a mapping as given, checked), then the
// frontends a device is offered through (frontend.go, fe_*.go).
//
// Locks, in the order they are taken:
//
//	Daemon.mapMu     map, unmap, resize and the state file, one at a time
//	Daemon.mu        the sessions and mappings; held only to read or
//	                 change them (and rnbd's session locks under it)
//	Daemon.rdmaMu    the RDMA fabric, made on first use; never with mu
//	ublkBackend.mu   a ublk device's queues; held over no call
//
// Which fields each lock guards, and which functions run with it held,
// are +checklocks annotations, checked by gVisor's checklocks analyzer
// in make vet; the order above is not.
package clientd

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/mirror"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// Default paths.
const (
	DefaultConfigFile    = "/etc/rnbd/client.toml"
	DefaultControlSocket = "/run/rnbd/client.sock"
	DefaultStateFile     = "/var/lib/rnbd/client.json"
	DefaultSocketDir     = "/run/rnbd"
)

// DefaultMirrorSpareAfter is mirror_spare_after: longer than a storage
// node's reboot, which a resync from the bitmap mends at a fraction of a
// rebuild's cost.
const DefaultMirrorSpareAfter = 5 * time.Minute

// ConfigVersion is the version of the configuration format.
const ConfigVersion = 1

// Config is the daemon's configuration: the TOML file, then flags. The
// session settings are the defaults of every new session; `session set`
// changes one session at run time.
type Config struct {
	Version              int           `toml:"version"`
	ControlSocket        string        `toml:"control_socket"`
	StateFile            string        `toml:"state_file"`
	SocketDir            string        `toml:"socket_dir"`
	ConnsPerPath         int           `toml:"conns_per_path"`
	MPPolicy             rtrs.MPPolicy `toml:"mpath_policy"`
	MaxReconnectAttempts int           `toml:"max_reconnect_attempts"`
	NoPathTimeout        conf.Duration `toml:"no_path_timeout"`
	FastIOFailTmo        string        `toml:"fast_io_fail_tmo"`
	CtrlLossTmo          string        `toml:"ctrl_loss_tmo"`
	ReconnectDelay       conf.Duration `toml:"reconnect_delay"`
	HBInterval           conf.Duration `toml:"hb_interval"`
	HBMissedMax          int           `toml:"hb_missed_max"`
	// TCPUserTimeout is the TCP fabric's TCP_USER_TIMEOUT: a duration
	// or "off" (tcp.Options.UserTimeout).
	TCPUserTimeout string        `toml:"tcp_user_timeout"`
	UblkQueueDepth int           `toml:"ublk_queue_depth"`
	UblkMaxIOKB    int           `toml:"ublk_max_io_kb"`
	NBDBuffers     int           `toml:"nbd_buffers"`
	NBDIOTimeout   conf.Duration `toml:"nbd_io_timeout"`
	SizePoll       conf.Duration `toml:"size_poll"`
	// MirrorLegTimeout is how long a mirror's leg may hold requests
	// without completing any before it is fenced and taken out
	// (docs/replication.md).
	MirrorLegTimeout conf.Duration `toml:"mirror_leg_timeout"`
	// MirrorResyncRate bounds each mirror's resync copy, bytes per
	// second (mirror.Config.ResyncRate).
	MirrorResyncRate units.Size `toml:"mirror_resync_rate"`
	// MirrorSpareAfter is how long a mirror's leg stays out (its
	// storage node not back) before the first of the mapping's spares
	// takes its place, rebuilt in full.
	MirrorSpareAfter conf.Duration `toml:"mirror_spare_after"`
	// DevLinksDir holds the stable names of kernel devices,
	// DIR/SESSNAME/DEVICE_PATH (devlinks.go); empty: none.
	DevLinksDir string `toml:"dev_links_dir"`
	// MetricsListen, HOST:PORT, serves Prometheus metrics at /metrics;
	// empty: none.
	MetricsListen string `toml:"metrics_listen"`
	LogLevel      string `toml:"log_level"`
	LogFormat     string `toml:"log_format"`
	// TLS, if set, makes every session over tcp:// use TLS 1.3,
	// presenting TLS.Cert (the client's identity on the server) and
	// accepting only a server certificate of TLS.CA.
	TLS conf.TLS `toml:"tls"`
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	d := rtrs.DefaultCltConfig()
	return Config{
		Version:              ConfigVersion,
		ControlSocket:        DefaultControlSocket,
		StateFile:            DefaultStateFile,
		SocketDir:            DefaultSocketDir,
		ConnsPerPath:         d.ConnsPerPath,
		MPPolicy:             d.MPPolicy,
		MaxReconnectAttempts: d.MaxReconnectAttempts,
		NoPathTimeout:        conf.Duration{Duration: rnbd.DefaultNoPathTimeout},
		FastIOFailTmo:        "off",
		CtrlLossTmo:          "off",
		DevLinksDir:          "/dev/rnbd",
		ReconnectDelay:       conf.Duration{Duration: d.ReconnectDelay},
		HBInterval:           conf.Duration{Duration: d.HBInterval},
		HBMissedMax:          d.HBMissedMax,
		TCPUserTimeout:       tcp.DefaultUserTimeout.String(),
		UblkQueueDepth:       64,
		UblkMaxIOKB:          512,
		NBDBuffers:           64,
		SizePoll:             conf.Duration{Duration: rnbd.DefaultSizePoll},
		MirrorLegTimeout:     conf.Duration{Duration: mirror.DefaultLegTimeout},
		MirrorResyncRate:     mirror.DefaultResyncRate,
		MirrorSpareAfter:     conf.Duration{Duration: DefaultMirrorSpareAfter},
		LogLevel:             "info",
		LogFormat:            "text",
	}
}

// LoadConfig reads path over the defaults (see conf.LoadTOML): unknown
// keys are errors, and a [tls] table makes TLS required.
func LoadConfig(path string, mustExist bool) (Config, error) {
	cfg := DefaultConfig()
	err := conf.LoadConfig(path, mustExist, &cfg, func() int { return cfg.Version }, ConfigVersion, &cfg.TLS)
	return cfg, err
}

// CheckConfig reads path as LoadConfig does, validates it and loads the
// TLS files it names, starting nothing: `rnbd-client config check`.
func CheckConfig(path string, mustExist bool) (Config, error) {
	cfg, err := LoadConfig(path, mustExist)
	if err != nil {
		return cfg, err
	}
	return cfg, conf.Check(path, cfg.Validate, cfg.TLS)
}

// Validate checks the configuration before anything starts.
func (c *Config) Validate() error {
	if c.ControlSocket == "" || c.StateFile == "" || c.SocketDir == "" {
		return errors.New("control_socket, state_file and socket_dir must be set")
	}
	if c.ConnsPerPath < 1 {
		return errors.New("conns_per_path must be at least 1")
	}
	if err := c.TLS.Validate(); err != nil {
		return err
	}
	if _, err := conf.ParseUserTimeout(c.TCPUserTimeout); err != nil {
		return err
	}
	if c.NoPathTimeout.Duration < 0 || c.HBInterval.Duration <= 0 || c.HBMissedMax < 0 {
		return errors.New("bad no_path_timeout or heartbeat")
	}
	if _, err := ParseTmo(c.FastIOFailTmo); err != nil {
		return fmt.Errorf("fast_io_fail_tmo: %w", err)
	}
	if _, err := ParseTmo(c.CtrlLossTmo); err != nil {
		return fmt.Errorf("ctrl_loss_tmo: %w", err)
	}
	if d := c.ReconnectDelay.Duration; d < rtrs.MinReconnectDelayLimit || d > rtrs.MaxReconnectDelayLimit {
		return fmt.Errorf("reconnect_delay %v: want %v to %v", d, rtrs.MinReconnectDelayLimit, rtrs.MaxReconnectDelayLimit)
	}
	if c.MirrorLegTimeout.Duration < 100*time.Millisecond {
		return errors.New("mirror_leg_timeout must be at least 100ms")
	}
	if c.MirrorResyncRate < 1<<20 {
		return errors.New("mirror_resync_rate must be at least 1MiB (a second)")
	}
	if c.MirrorSpareAfter.Duration < 0 {
		return errors.New("mirror_spare_after must not be negative")
	}
	if c.SizePoll.Duration < 0 {
		return errors.New("size_poll must not be negative (0: never)")
	}
	if c.NBDIOTimeout.Duration < 0 {
		return errors.New("nbd_io_timeout must not be negative (0: derived)")
	}
	if c.UblkQueueDepth < 1 || c.UblkQueueDepth > 4096 {
		return errors.New("ublk_queue_depth must be 1 to 4096")
	}
	if c.UblkMaxIOKB < 4 || c.UblkMaxIOKB > slotSize>>10 || c.UblkMaxIOKB%4 != 0 {
		return fmt.Errorf("ublk_max_io_kb must be a multiple of 4 from 4 to %d", slotSize>>10)
	}
	if c.NBDBuffers < 1 || c.NBDBuffers > 4096 {
		return errors.New("nbd_buffers must be 1 to 4096")
	}
	if st, err := os.Stat(c.SocketDir); err == nil && !st.IsDir() {
		return errors.New("socket_dir is not a directory")
	}
	return nil
}

// fastIOFail is fast_io_fail_tmo (validated), negative when off.
func (c *Config) fastIOFail() time.Duration {
	t, _ := ParseTmo(c.FastIOFailTmo)
	return t
}

// nbdIOTimeout is the kernel nbd driver's per-request timeout for the
// devices this daemon attaches. When it fires the kernel re-sends the
// request on another socket, while the daemon may still hold the first
// copy and send it to the server later: a stale write could then land
// after a newer one. So by default the timeout outlasts the longest time
// a request can wait in the daemon: no_path_timeout after the failure
// was detected (a heartbeat interval times the missed heartbeats allowed,
// plus one), with a margin; never less than the kernel's own 30 s. The
// price: a request the kernel had sent on a socket that died (a daemon
// restart) waits that long before the kernel re-sends it.
func (c *Config) nbdIOTimeout() time.Duration {
	if c.NBDIOTimeout.Duration > 0 {
		return c.NBDIOTimeout.Duration
	}
	detect := c.HBInterval.Duration * time.Duration(c.HBMissedMax+1)
	return max(c.NoPathTimeout.Duration+detect+10*time.Second, 30*time.Second)
}
