package clientd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"strings"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/rdma"
)

// A mapping's session: found by its name or dialled with the daemon's
// settings, and dropped with its last device.

// session is a client session and the mappings through it.
type session struct {
	cs        *rnbd.CltSession
	paths     []string
	transport string // tcp or rdma
}

func (s *session) uuid() string {
	u := s.cs.Session().UUID()
	return hex.EncodeToString(u[:])
}

// sessionSettings applies a new mapping's session settings to its
// session and makes every mapping of the session carry all of them, so
// that the state file keeps them as long as any of its mappings lives.
// A restore applies what the mapping carries.
func (d *Daemon) sessionSettings(sess *session, mp *mapped, restore bool) {
	d.mu.Lock()
	all := api.SetRequest{}
	if !restore {
		for _, m := range d.maps {
			if m.SessName == mp.SessName && m != mp {
				all = all.Merge(m.Settings)
			}
		}
	}
	all = all.Merge(mp.Settings) // the newest win
	for _, m := range d.maps {
		if m.SessName == mp.SessName {
			m.Settings = all
		}
	}
	d.mu.Unlock()
	if err := sess.set(mp.Settings); err != nil { // checked by normalize
		d.log.WithError(err).WithField("session", mp.SessName).Warn("session settings")
	}
}

// fabricFor is the fabric of a transport; the RDMA one is made on first
// use.
func (d *Daemon) fabricFor(transport string) (fabric.Fabric, error) {
	if transport != "rdma" {
		return d.fabric, nil
	}
	d.rdmaMu.Lock()
	defer d.rdmaMu.Unlock()
	if d.rdma == nil {
		f, err := rdma.New(rdma.Options{})
		if err != nil {
			return nil, ctl.Errorf(ctl.CodeNotSupported, "RDMA: %v", err)
		}
		d.rdma = f
	}
	return d.rdma, nil
}

// getSession finds the session named in m or dials it. A session of that
// name must have the same paths: a different set is a mistake, not a
// second session.
func (d *Daemon) getSession(ctx context.Context, m mapSpec, restore bool) (*session, bool, error) {
	d.mu.Lock()
	s := d.sessions[m.SessName]
	d.mu.Unlock()
	if s != nil {
		if strings.Join(s.paths, " ") != strings.Join(m.Paths, " ") {
			return nil, false, ctl.Errorf(ctl.CodeInvalid, "session %s exists with paths %v, not %v", m.SessName, s.paths, m.Paths)
		}
		if s.transport != m.Transport {
			return nil, false, ctl.Errorf(ctl.CodeInvalid, "session %s runs on %s, not %s", m.SessName, s.transport, m.Transport)
		}
		return s, false, nil
	}
	cs, err := d.dial(ctx, m.SessName, m.SessUUID, m.Transport, m.paths, restore)
	if err != nil {
		return nil, false, err
	}
	cs.OnResize(func(dev *rnbd.CltDev) { d.resized(dev) })
	s = &session{cs: cs, paths: m.Paths, transport: m.Transport}
	d.mu.Lock()
	d.sessions[m.SessName] = s
	d.mu.Unlock()
	return s, true, nil
}

// dial dials a session with the daemon's settings: its UUID the hex
// given (a restart's), else a random one.
func (d *Daemon) dial(ctx context.Context, name, uuid, transport string, paths []rtrs.PathAddr, restore bool) (*rnbd.CltSession, error) {
	fab, err := d.fabricFor(transport)
	if err != nil {
		return nil, err
	}
	cfg := rtrs.DefaultCltConfig()
	cfg.SessName, cfg.Fabric, cfg.Log = name, fab, d.log
	cfg.ConnsPerPath = d.cfg.ConnsPerPath
	cfg.MPPolicy = d.cfg.MPPolicy
	cfg.MaxReconnectAttempts = d.cfg.MaxReconnectAttempts
	cfg.CtrlLossTmo, _ = ParseTmo(d.cfg.CtrlLossTmo) // validated
	cfg.ReconnectDelay = d.cfg.ReconnectDelay.Duration
	cfg.HBInterval, cfg.HBMissedMax = d.cfg.HBInterval.Duration, d.cfg.HBMissedMax
	// The session's UUID is ours, not rtrs's random one, and kept in the
	// state file: its paths' UUIDs derive from it, so after a restart
	// the server sees the same paths coming back.
	cfg.OpenAnyPath = restore
	if u, err := hex.DecodeString(uuid); err == nil && len(u) == len(cfg.UUID) {
		copy(cfg.UUID[:], u)
	} else if _, err := rand.Read(cfg.UUID[:]); err != nil {
		return nil, err
	}
	cfg.Paths = paths
	cs, err := rnbd.DialSession(ctx, cfg, d.cfg.NoPathTimeout.Duration)
	// A session of this name closed here a moment ago: the server may
	// not have seen it go yet, and refuses the name until it does. Dialled
	// again for a while (unmap, then map of the same session at once).
	for end := d.closedAt(name).Add(renameWait); err != nil && errors.Is(err, rtrs.ErrInfoUnanswered) && time.Now().Before(end) && ctx.Err() == nil; {
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
		cs, err = rnbd.DialSession(ctx, cfg, d.cfg.NoPathTimeout.Duration)
	}
	if err != nil {
		return nil, err
	}
	cs.SetSizePoll(d.cfg.SizePoll.Duration)
	cs.SetFastIOFailTmo(d.cfg.fastIOFail())
	return cs, nil
}

func (d *Daemon) dropSession(name string) {
	d.mu.Lock()
	s := d.sessions[name]
	if s != nil && len(s.cs.Devices()) == 0 {
		delete(d.sessions, name)
	} else {
		s = nil
	}
	d.mu.Unlock()
	if s != nil {
		s.cs.Close()
		d.noteClosed(name)
	}
}

// noteClosed records that the sessions of names closed now: a dial of
// one of them within renameWait is tried again while the server still
// holds the old session (dial).
func (d *Daemon) noteClosed(names ...string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now()
	for _, n := range names {
		d.closed[n] = now
	}
	for n, t := range d.closed {
		if now.Sub(t) > renameWait {
			delete(d.closed, n)
		}
	}
}

// renameWait is how long after closing a session the daemon dials its
// name again when the server refuses it (dial).
const renameWait = 5 * time.Second

// closedAt is when the session name last closed here (zero: not lately).
func (d *Daemon) closedAt(name string) time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.closed[name]
}

func (d *Daemon) findSession(name string) (*session, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if s := d.sessions[name]; s != nil {
		return s, nil
	}
	return nil, ctl.Errorf(ctl.CodeNotFound, "no session %s", name)
}
