// The daemon's configuration: the TOML file over the defaults, and
// its validation.

package serverd

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// Default paths.
const (
	DefaultConfigFile    = "/etc/rnbd/server.toml"
	DefaultControlSocket = "/run/rnbd/server.sock"
	DefaultStateFile     = "/var/lib/rnbd/server.json"
)

// ConfigVersion is the version of the configuration format; a file with a
// newer version is refused rather than half understood.
const ConfigVersion = 1

// Config is the daemon's configuration: the TOML file, then flags.
type Config struct {
	Version        int      `toml:"version"`
	Listen         []string `toml:"listen"`
	DevSearchPath  string   `toml:"dev_search_path"`
	AllowMigration bool     `toml:"allow_migration"`
	// SearchAllowFrom and SearchAllowIdentities are who may open the
	// devices under DevSearchPath, as an export's allow_from and
	// allow_identities (rnbd.SrvConfig).
	SearchAllowFrom       []string `toml:"dev_search_path_allow_from"`
	SearchAllowIdentities []string `toml:"dev_search_path_allow_identities"`
	// Exports are the exports of the configuration file ([[export]]
	// tables), served from start-up; map and unmap do not change them.
	Exports []api.MapRequest `toml:"export"`
	// Pools are where volumes are made ([[pool]] tables; volume.go).
	Pools []PoolConfig `toml:"pool"`
	// ExportRetry is how often an export that could not be served (of
	// the configuration file, or restored from the state file) is tried
	// again.
	ExportRetry    Duration `toml:"export_retry"`
	QueueDepth     int      `toml:"queue_depth"`
	MaxChunkSize   int      `toml:"max_chunk_size"`
	MaxChunkMemory Size     `toml:"max_chunk_memory"`
	// MaxChunkMemoryPerClient bounds what one client may hold of it
	// (rtrs.SrvConfig); unset, rtrs.DefaultMaxChunkMemoryPerClient.
	MaxChunkMemoryPerClient *Size `toml:"max_chunk_memory_per_client"`
	// MaxSessionsPerClient bounds one client's sessions (rtrs.SrvConfig).
	MaxSessionsPerClient int `toml:"max_sessions_per_client"`
	// NewPathRate and NewPathBurst bound how fast one client (address,
	// identity) makes new paths (rtrs.SrvConfig); rate 0: no bound.
	NewPathRate  float64 `toml:"new_path_rate"`
	NewPathBurst int     `toml:"new_path_burst"`
	// BindSessionNames, with TLS, binds each session name to the
	// identity whose session first opens a device with it
	// (rnbd.SrvConfig).
	BindSessionNames bool `toml:"bind_session_names"`
	AlwaysInvalidate bool `toml:"always_invalidate"`
	// InvalidateBy is how always_invalidate revokes a chunk's rkey on
	// RDMA: "window" (memory windows bound by work requests, where the
	// device has them) or "registration" (deregister and register).
	InvalidateBy string   `toml:"invalidate_by"`
	DirectIO     bool     `toml:"direct_io"`
	HBInterval   Duration `toml:"hb_interval"`
	HBMissedMax  int      `toml:"hb_missed_max"`
	// TCPUserTimeout is the TCP fabric's TCP_USER_TIMEOUT: a duration
	// or "off" (tcp.Options.UserTimeout).
	TCPUserTimeout string `toml:"tcp_user_timeout"`
	ControlSocket  string `toml:"control_socket"`
	StateFile      string `toml:"state_file"`
	// MetricsListen, HOST:PORT, serves Prometheus metrics at /metrics;
	// empty: none.
	MetricsListen string `toml:"metrics_listen"`
	LogLevel      string `toml:"log_level"`
	LogFormat     string `toml:"log_format"`
	// TLS, if set, makes every tcp:// listener speak TLS 1.3 only and
	// require a client certificate of TLS.CA; the certificate's names
	// are the client's identity (exports' allow_identities).
	TLS ServerTLS `toml:"tls"`
	// Admin is the control API on TCP, and who may do what (admin.go).
	Admin AdminConfig `toml:"admin"`
}

// ServerTLS is the server's [tls]: what both daemons have, and the
// server's own.
type ServerTLS struct {
	conf.TLS
	// AllowAnonymousClients accepts a client certificate of CA that
	// names no identity (no common name, no DNS, URI or e-mail
	// alternative name): such a client is counted by its address and
	// may open the exports that grant no identities. Off, it is refused
	// in the handshake (EACCES; tcp.Options.AllowAnonymousClients).
	AllowAnonymousClients bool `toml:"allow_anonymous_clients"`
}

// Duration and Size are written as "5s" and "8GiB" in the file.
type (
	Duration = conf.Duration
	Size     = units.Size
)

// DefaultConfig returns the defaults: the kernel module's where it has
// them (port 1234, 512 chunks of 128 KiB, always_invalidate on).
func DefaultConfig() Config {
	return Config{
		Version:              ConfigVersion,
		Listen:               []string{fmt.Sprintf("tcp://0.0.0.0:%d", rtrs.DefaultPort), fmt.Sprintf("rdma://0.0.0.0:%d", rtrs.DefaultPort)},
		QueueDepth:           rtrs.DefaultQueueDepth,
		MaxChunkSize:         rtrs.DefaultMaxChunkSize,
		MaxChunkMemory:       Size(rtrs.DefaultMaxChunkMemory()),
		MaxSessionsPerClient: rtrs.DefaultMaxSessionsPerClient,
		NewPathRate:          rtrs.DefaultNewPathRate,
		NewPathBurst:         rtrs.DefaultNewPathBurst,
		BindSessionNames:     true,
		AlwaysInvalidate:     true,
		InvalidateBy:         "window",
		HBInterval:           Duration{Duration: rtrs.DefaultHBInterval},
		HBMissedMax:          rtrs.DefaultHBMissedMax,
		ExportRetry:          Duration{Duration: 10 * time.Second},
		TCPUserTimeout:       tcp.DefaultUserTimeout.String(),
		ControlSocket:        DefaultControlSocket,
		StateFile:            DefaultStateFile,
		LogLevel:             "info",
		LogFormat:            "text",
		Admin:                DefaultAdminConfig(),
	}
}

// LoadConfig reads path over the defaults. A missing file is fine when
// mustExist is false (the default path). A key or table the daemon does
// not know is an error naming its line (conf.LoadTOML); a [tls] table
// makes TLS required (conf.TLS.Configured).
func LoadConfig(path string, mustExist bool) (Config, error) {
	cfg := DefaultConfig()
	err := conf.LoadConfig(path, mustExist, &cfg, func() int { return cfg.Version }, ConfigVersion, &cfg.TLS.TLS)
	return cfg, err
}

// CheckConfig reads path as LoadConfig does, validates it and loads the
// TLS files it names ([tls]'s and [admin]'s), starting nothing: `rnbd-server config check`.
func CheckConfig(path string, mustExist bool) (Config, error) {
	cfg, err := LoadConfig(path, mustExist)
	if err != nil {
		return cfg, err
	}
	if err := conf.Check(path, cfg.Validate, cfg.TLS.TLS); err != nil {
		return cfg, err
	}
	if len(cfg.Admin.Listen) > 0 {
		if _, err := cfg.adminTLS().Config(); err != nil {
			return cfg, fmt.Errorf("config %s: [admin]: %w", path, err)
		}
	}
	return cfg, nil
}

// Validate checks the configuration before anything starts.
func (c *Config) Validate() error {
	if len(c.Listen) == 0 {
		return errors.New("no listen address")
	}
	for _, l := range c.Listen {
		if _, err := rtrs.ParseListen(l); err != nil {
			return err
		}
	}
	if c.DevSearchPath != "" {
		st, err := os.Stat(dirOf(c.DevSearchPath))
		if err != nil || !st.IsDir() {
			return fmt.Errorf("dev_search_path %s: not a directory", c.DevSearchPath)
		}
	}
	if c.ControlSocket == "" || c.StateFile == "" {
		return errors.New("control_socket and state_file must be set")
	}
	if c.ExportRetry.Duration < 100*time.Millisecond {
		return fmt.Errorf("export_retry %v: at least 100ms", c.ExportRetry.Duration)
	}
	if c.MaxSessionsPerClient < 0 {
		return errors.New("max_sessions_per_client must not be negative (0: no bound)")
	}
	if c.NewPathRate < 0 || (c.NewPathRate > 0 && c.NewPathBurst < 1) {
		return fmt.Errorf("new_path_rate %g, new_path_burst %d: want a rate of at least 0 (0: no bound) and a burst of at least 1", c.NewPathRate, c.NewPathBurst)
	}
	if err := c.TLS.Validate(); err != nil {
		return err
	}
	if c.TLS.ServerName != "" {
		return errors.New("tls: server_name is a client's setting (the name it checks a server's certificate against); a server's names are in its certificate")
	}
	if c.TLS.AllowAnonymousClients && !c.TLS.Enabled() {
		return errors.New("tls: allow_anonymous_clients is set, but not cert, key and ca: it is about client certificates")
	}
	if _, err := conf.ParseUserTimeout(c.TCPUserTimeout); err != nil {
		return err
	}
	if _, err := parseNetworks(c.SearchAllowFrom); err != nil {
		return fmt.Errorf("dev_search_path_%v", err)
	}
	if _, err := parseGrants(c.SearchAllowIdentities); err != nil {
		return fmt.Errorf("dev_search_path_%v", err)
	}
	names := map[string]bool{}
	for i, r := range c.Exports {
		if r.Name == "" || r.Path == "" {
			return fmt.Errorf("[[export]] %d: name and path must be set", i+1)
		}
		if names[r.Name] {
			return fmt.Errorf("[[export]] %s: defined twice", r.Name)
		}
		names[r.Name] = true
		if _, err := exportOf(r); err != nil {
			return fmt.Errorf("[[export]] %s: %v", r.Name, err)
		}
	}
	pools := map[string]bool{}
	for _, p := range c.Pools {
		if err := p.validate(); err != nil {
			return err
		}
		if pools[p.Name] {
			return fmt.Errorf("[[pool]] %s: defined twice", p.Name)
		}
		pools[p.Name] = true
	}
	if err := c.Admin.validate(c); err != nil {
		return err
	}
	if c.InvalidateBy != "window" && c.InvalidateBy != "registration" {
		return fmt.Errorf("invalidate_by %q: want window or registration", c.InvalidateBy)
	}
	return nil
}

// dirOf is the part of a search path that must exist: up to %SESSNAME%.
func dirOf(sp string) string {
	for i := 0; i+len("%SESSNAME%") <= len(sp); i++ {
		if sp[i:i+len("%SESSNAME%")] == "%SESSNAME%" {
			return sp[:i]
		}
	}
	return sp
}
