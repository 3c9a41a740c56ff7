// Package clientd is the rnbd-client daemon: it holds RNBD client
// sessions and the devices mapped through them, serves each device to
// NBD clients, keeps the mappings in a state file, and answers the
// control API on a unix socket.
package clientd

import (
	"errors"
	"os"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// Default paths.
const (
	DefaultConfigFile    = "/etc/rnbd/client.toml"
	DefaultControlSocket = "/run/rnbd/client.sock"
	DefaultStateFile     = "/var/lib/rnbd/client.json"
	DefaultSocketDir     = "/run/rnbd"
)

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
	MPPolicy             string        `toml:"mpath_policy"`
	MaxReconnectAttempts int           `toml:"max_reconnect_attempts"`
	NoPathTimeout        conf.Duration `toml:"no_path_timeout"`
	HBInterval           conf.Duration `toml:"hb_interval"`
	HBMissedMax          int           `toml:"hb_missed_max"`
	LogLevel             string        `toml:"log_level"`
	LogFormat            string        `toml:"log_format"`
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	d := rtrs.DefaultClientConfig()
	return Config{
		Version:              ConfigVersion,
		ControlSocket:        DefaultControlSocket,
		StateFile:            DefaultStateFile,
		SocketDir:            DefaultSocketDir,
		ConnsPerPath:         d.ConnsPerPath,
		MPPolicy:             d.MPPolicy.Name(),
		MaxReconnectAttempts: d.MaxReconnectAttempts,
		NoPathTimeout:        conf.Duration{Duration: rtrs.DefaultNoPathTimeout},
		HBInterval:           conf.Duration{Duration: d.HBInterval},
		HBMissedMax:          d.HBMissedMax,
		LogLevel:             "info",
		LogFormat:            "text",
	}
}

// LoadConfig reads path over the defaults (see conf.LoadTOML).
func LoadConfig(path string, mustExist bool) (Config, []string, error) {
	cfg := DefaultConfig()
	warnings, err := conf.LoadTOML(path, mustExist, &cfg, func() int { return cfg.Version }, ConfigVersion)
	return cfg, warnings, err
}

// Validate checks the configuration before anything starts.
func (c *Config) Validate() error {
	if c.ControlSocket == "" || c.StateFile == "" || c.SocketDir == "" {
		return errors.New("control_socket, state_file and socket_dir must be set")
	}
	if c.ConnsPerPath < 1 {
		return errors.New("conns_per_path must be at least 1")
	}
	if _, err := rtrs.ParseMPPolicy(c.MPPolicy); err != nil {
		return err
	}
	if c.NoPathTimeout.Duration < 0 || c.HBInterval.Duration <= 0 || c.HBMissedMax < 0 {
		return errors.New("bad no_path_timeout or heartbeat")
	}
	if st, err := os.Stat(c.SocketDir); err == nil && !st.IsDir() {
		return errors.New("socket_dir is not a directory")
	}
	return nil
}
