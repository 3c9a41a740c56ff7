package rtrs

import (
	"errors"
	"fmt"
	"runtime"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Configuration of a client session: what DialSession takes (CltConfig), and
// the settings that may change while it runs (the kernel's sysfs files:
// mpath_policy, max_reconnect_attempts, ...).

// CltConfig configures a client session. Start from DefaultCltConfig:
// zero values are taken literally.
type CltConfig struct {
	// SessName names the session on the server: 1..254 bytes, no '/'
	// or '.'.
	SessName string
	// Paths are connected, in order, by DialSession.
	Paths []PathAddr
	// Fabric carries the connections.
	Fabric fabric.Fabric
	// ConnsPerPath is the number of IO connections of each path; each
	// path also has a service connection. Default: the number of CPUs.
	ConnsPerPath int
	// MPPolicy picks the path of each IO. Default: min-inflight.
	MPPolicy MPPolicy
	// MaxReconnectAttempts bounds automatic reconnects of a path: -1
	// retries forever (default), 0 never reconnects automatically.
	MaxReconnectAttempts int
	// CtrlLossTmo is NVMe-oF's ctrl_loss_tmo: a path that has been down
	// this long stops reconnecting, whatever attempts are left. 0 (the
	// zero value) or negative: no bound.
	CtrlLossTmo time.Duration
	// ReconnectDelay is the wait before the first reconnect attempt; it
	// doubles after each failed attempt up to ReconnectMaxDelay, and a
	// random ReconnectJitter is added to spread clients out.
	ReconnectDelay    time.Duration
	ReconnectMaxDelay time.Duration
	ReconnectJitter   time.Duration
	// HBInterval and HBMissedMax drive the heartbeat (5 s, 5).
	HBInterval  time.Duration
	HBMissedMax int
	// ConnectTimeout bounds establishing one path (30 s).
	ConnectTimeout time.Duration
	// UUID is the session's paths UUID; zero picks a random one. A
	// client that restarts passes its predecessor's: the server then takes
	// its paths for the same session's (their UUIDs derive from it and
	// the path's addresses), replaces any the predecessor left behind, and
	// the session name is not "taken" by what the dead client left there.
	UUID [16]byte
	// OpenAnyPath makes Open succeed once one path is connected; the
	// others keep trying in the background, as after a failure. DialSession
	// otherwise needs every path, as the kernel's rtrs_clt_open does.
	OpenAnyPath bool
	// LinkEvent, if set, is told when the last path goes down and when a
	// path comes back. Calls are serialized; it must not call back into
	// the session's path controls.
	LinkEvent func(CltLinkEvent)
	// Log receives the session's messages.
	Log *log.Entry
}

// DefaultCltConfig returns the defaults: the kernel's where it has
// them.
func DefaultCltConfig() CltConfig {
	return CltConfig{
		ConnsPerPath:         runtime.NumCPU(),
		MPPolicy:             MPMinInflight,
		MaxReconnectAttempts: -1,
		ReconnectDelay:       time.Second,
		ReconnectMaxDelay:    30 * time.Second,
		ReconnectJitter:      time.Second,
		HBInterval:           DefaultHBInterval,
		HBMissedMax:          DefaultHBMissedMax,
		ConnectTimeout:       DefaultConnectTimeout,
	}
}

func (c *CltConfig) validate() error {
	if err := ValidSessName(c.SessName); err != nil {
		return err
	}
	if len(c.Paths) == 0 || len(c.Paths) > MaxPathsNum {
		return fmt.Errorf("rtrs: a session needs 1..%d paths, got %d", MaxPathsNum, len(c.Paths))
	}
	if c.Fabric == nil {
		return errors.New("rtrs: no fabric")
	}
	if c.ConnsPerPath < 1 || c.ConnsPerPath >= MaxConnsPerPath {
		return fmt.Errorf("rtrs: %d IO connections per path, want 1..%d", c.ConnsPerPath, MaxConnsPerPath-1)
	}
	if _, err := ParseMPPolicy(fmt.Sprint(int32(c.MPPolicy))); err != nil {
		return err
	}
	if c.MaxReconnectAttempts < -1 {
		return fmt.Errorf("rtrs: max_reconnect_attempts %d, want -1 or more", c.MaxReconnectAttempts)
	}
	if c.HBInterval <= 0 || c.HBMissedMax < 0 {
		return errors.New("rtrs: heartbeat interval must be positive and missed count not negative")
	}
	if c.ReconnectDelay < 0 || c.ReconnectJitter < 0 || c.ConnectTimeout <= 0 {
		return errors.New("rtrs: negative delay or timeout")
	}
	if c.ReconnectMaxDelay < c.ReconnectDelay {
		c.ReconnectMaxDelay = c.ReconnectDelay
	}
	if c.Log == nil {
		c.Log = log.L
	}
	return nil
}

// MPPolicy returns the multipath policy.
func (s *CltSession) MPPolicy() MPPolicy { return MPPolicy(s.policy.Load()) }

// SetMPPolicy switches the multipath policy; requests already on a path
// stay there.
func (s *CltSession) SetMPPolicy(p MPPolicy) error {
	if _, err := ParseMPPolicy(fmt.Sprint(int32(p))); err != nil {
		return err
	}
	s.policy.Store(int32(p))
	return nil
}

// CtrlLossTmo is how long a path may be down before it stops
// reconnecting; negative: no bound.
func (s *CltSession) CtrlLossTmo() time.Duration { return time.Duration(s.ctrlLossTmo.Load()) }

// SetCtrlLossTmo sets ctrl_loss_tmo (0 or negative: no bound). It applies
// to the next reconnect a path schedules, counted from when it went down.
func (s *CltSession) SetCtrlLossTmo(d time.Duration) {
	if d <= 0 {
		d = -1
	}
	s.ctrlLossTmo.Store(int64(d))
}

// ReconnectDelay is the wait before a path's first reconnect attempt;
// it doubles after each failed one, up to ReconnectMaxDelay or itself,
// whichever is longer.
func (s *CltSession) ReconnectDelay() time.Duration { return time.Duration(s.reconnectDelay.Load()) }

// The range of SetReconnectDelay: a path that cannot connect must not
// retry in a tight loop.
const (
	MinReconnectDelayLimit = 100 * time.Millisecond
	MaxReconnectDelayLimit = time.Hour
)

// SetReconnectDelay sets reconnect_delay, 100 ms to an hour. It applies
// to the next reconnect a path schedules.
func (s *CltSession) SetReconnectDelay(d time.Duration) error {
	if d < MinReconnectDelayLimit || d > MaxReconnectDelayLimit {
		return fmt.Errorf("rtrs: reconnect_delay %v out of range %v..%v: %w", d, MinReconnectDelayLimit, MaxReconnectDelayLimit, syscall.EINVAL)
	}
	s.reconnectDelay.Store(int64(d))
	return nil
}

// MaxReconnectAttempts returns the reconnect bound (-1: forever).
func (s *CltSession) MaxReconnectAttempts() int { return int(s.maxReconnectAttempts.Load()) }

// SetMaxReconnectAttempts sets the bound, -1..9999 as the kernel's sysfs.
func (s *CltSession) SetMaxReconnectAttempts(n int) error {
	if n < -1 || n > 9999 {
		return fmt.Errorf("rtrs: max_reconnect_attempts %d out of range -1..9999: %w", n, syscall.EINVAL)
	}
	s.maxReconnectAttempts.Store(int32(n))
	return nil
}
