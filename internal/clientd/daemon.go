package clientd

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/metrics"
	"github.com/rnbd/rnbd/pkg/frontend/nbd"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// StateVersion is the version of the state file format.
const StateVersion = 1

// State is what survives a restart: the mappings.
type State struct {
	Version  int           `json:"version"`
	Mappings []api.Mapping `json:"mappings"`
}

// mapped is a mapping being served: a device of a session, offered
// through a frontend.
type mapped struct {
	api.Mapping
	dev *rnbd.CltDev // nil: a mirror
	mir *mirrorDev   // a mirror's
	io  ioDev        // what the frontend serves
	fe  frontend
}

// Daemon is a running rnbd-client. It is safe for concurrent use: the
// control API's requests, metrics scrapes, the retries of restores and
// the resizes that sessions report run at once, and Stop may be called
// more than once.
type Daemon struct {
	stopOnce sync.Once
	stopErr  error // of the first Stop

	cfg    Config
	log    *log.Entry
	fabric fabric.Fabric // TCP
	ctl    *ctl.Server

	rdmaMu sync.Mutex
	// +checklocks:rdmaMu
	rdma   fabric.Fabric // made on first use
	nbd    *nbd.Server
	served chan error

	// mu guards sessions and maps; mapMu serializes map/unmap and the
	// state file.
	mapMu sync.Mutex
	mu    sync.Mutex
	// +checklocks:mu
	sessions map[string]*session
	// +checklocks:mu
	maps map[string]*mapped
	// closed are when the sessions closed last were, by name: a dial of
	// the name soon after may find the server still holding the old one.
	// +checklocks:mu
	closed  map[string]time.Time
	metrics *metrics.Server // nil without metrics_listen
	// hints, where udev runs, is where the daemon leaves the stable
	// names of kernel devices for udev (devlinks.go); "": it makes the
	// links itself. sysBlock is /sys/block.
	hints    string
	sysBlock string
	failed   []failedMapping // saved mappings that did not come back; kept in the state file
	wg       sync.WaitGroup
	// stopRetry ends retryRestores, which closes retryDone; retryCtx
	// bounds its attempts.
	stopRetry   chan struct{}
	retryDone   chan struct{}
	retryCtx    context.Context
	retryCancel context.CancelFunc
}

// failedMapping is a mapping of the state file that did not come back
// at start. One whose server did not answer (not up yet at boot, the
// network not there yet) is tried again in the background (retry) until
// it is served or unmapped; one the state file gives wrong waits for the
// operator.
type failedMapping struct {
	api.Mapping
	retry bool
}

// StateNotRestored is the state `device list` gives a mapping of the
// state file that could not be restored at start and is not tried again
// (its entry is invalid); StateRestoring one that is being tried again.
const (
	StateNotRestored = "not restored"
	StateRestoring   = "restoring"
)

// Restore retries: the first a second after the start, then twice as
// long each time, up to restoreRetryMax; each attempt bounded by
// retryTimeout.
var (
	restoreRetryFirst = time.Second
	restoreRetryMax   = 30 * time.Second
)

// restoreTimeout bounds a restore at start; retryTimeout a retry, which
// holds map and unmap off while it runs (shorter: a retry comes again).
const (
	restoreTimeout = 30 * time.Second
	retryTimeout   = 10 * time.Second
)

// Options are what a daemon is started with beyond its configuration.
type Options struct {
	Fabric fabric.Fabric // overrides TCP (tests)
	RDMA   fabric.Fabric // overrides RDMA (tests)
	Log    *log.Entry
}

// Start loads the state, opens the control socket and restores the
// mappings, each bounded in time, before it answers commands.
func Start(cfg Config, opts Options) (*Daemon, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if opts.Log == nil {
		opts.Log = log.L
	}
	f, err := cfg.TLS.Fabric(opts.Fabric, cfg.TCPUserTimeout, tcp.Options{Log: opts.Log})
	if err != nil {
		return nil, err
	}
	opts.Fabric = f
	d := &Daemon{cfg: cfg, log: opts.Log, fabric: opts.Fabric, rdma: opts.RDMA, served: make(chan error, 1),
		sessions: map[string]*session{}, maps: map[string]*mapped{}, closed: map[string]time.Time{},
		nbd: nbd.NewServer(nbd.Options{Log: opts.Log}), sysBlock: "/sys/block"}
	if cfg.DevLinksDir != "" && udevRunning() {
		d.hints = udevHints
	}
	st, err := conf.LoadState(cfg.StateFile, &State{Version: StateVersion}, StateVersion)
	if err != nil {
		return nil, err
	}
	if d.ctl, err = ctl.Listen(cfg.ControlSocket); err != nil {
		return nil, err
	}
	d.routes()
	if cfg.MetricsListen != "" {
		if d.metrics, err = metrics.Listen(cfg.MetricsListen, cltCollector{d}, d.log); err != nil {
			d.ctl.Close()
			return nil, err
		}
	}
	// The saved mappings come back before the control socket answers, so
	// a command after the start sees them.
	d.stopRetry, d.retryDone = make(chan struct{}), make(chan struct{})
	d.retryCtx, d.retryCancel = context.WithCancel(context.Background())
	retry := false
	for _, m := range st.Mappings {
		if err := d.restore(m); err != nil {
			l := d.log.WithField("device", m.Device)
			_, invalid := normalize(m)
			if invalid == nil {
				l.WithError(err).Error("restoring mapping failed; it stays in the state file and is tried again")
			} else {
				l.WithError(err).Error("restoring mapping failed; it stays in the state file until unmapped")
			}
			if m.As == "ublk" && parseUblkIndex(m.Kernel) >= 0 {
				// Unlike nbd's dead_conn_timeout, a quiesced ublk
				// device holds its IO for ever: fail it now.
				d.removeDevLink(m) // its device is going
				d.removeOrphanUblk(parseUblkIndex(m.Kernel), ublkCookie(backendID(m)), l)
				m.Kernel = ""
			}
			d.removeDevLink(m) // it would name a device that is not the mapping's
			d.failed = append(d.failed, failedMapping{Mapping: m, retry: invalid == nil})
			retry = retry || invalid == nil
		}
	}
	if retry {
		go d.retryRestores()
	} else {
		close(d.retryDone)
	}
	go func() { d.served <- d.ctl.Serve() }()
	d.log.WithFields(log.Fields{"control": cfg.ControlSocket, "mappings": len(st.Mappings), "tls": cfg.TLS.Enabled()}).Info("rnbd-client started")
	return d, nil
}

// Stop stops serving: NBD connections close, sessions close (the server
// then closes their devices); the mappings stay in the state file and come
// back with the next start.
// Calls after the first return its result.
func (d *Daemon) Stop() error {
	d.stopOnce.Do(func() { d.stopErr = d.stop() })
	return d.stopErr
}

func (d *Daemon) stop() error {
	close(d.stopRetry)
	d.retryCancel()
	<-d.retryDone // no session dialled after this
	if d.metrics != nil {
		d.metrics.Close()
	}
	d.nbd.Close()
	d.mu.Lock()
	maps := d.maps
	sessions := d.sessions
	d.maps, d.sessions = map[string]*mapped{}, map[string]*session{}
	d.mu.Unlock()
	for _, m := range maps {
		m.fe.detach()
		if m.mir != nil {
			// What is in flight fails as the legs' sessions close,
			// without taking a leg out for it.
			m.mir.m.Quiesce()
			m.mir.closeLegs(context.Background())
			m.mir.m.Close()
		}
	}
	for _, s := range sessions {
		s.cs.Close()
	}
	err := d.ctl.Close()
	<-d.served
	d.log.Info("rnbd-client stopped")
	return err
}

// StateVersion implements conf.Versioned.
func (st *State) StateVersion() int { return st.Version }

// saveState writes the mappings; d.mapMu is held. Mappings that failed
// to restore are kept: the operator unmaps them explicitly.
func (d *Daemon) saveState() error {
	st := State{Version: StateVersion}
	d.mu.Lock()
	for _, m := range d.maps {
		st.Mappings = append(st.Mappings, m.Mapping)
	}
	for _, f := range d.failed {
		st.Mappings = append(st.Mappings, f.Mapping)
	}
	d.mu.Unlock()
	sort.Slice(st.Mappings, func(i, j int) bool { return st.Mappings[i].Device < st.Mappings[j].Device })
	return conf.SaveState(d.cfg.StateFile, st)
}

// Map maps a device and serves it; the mapping is saved before it
// answers.
func (d *Daemon) Map(ctx context.Context, m api.Mapping) (api.Mapping, error) {
	out, _, err := d.mapNoted(ctx, m)
	return out, err
}

// mapNoted is Map, with the note of MapResponse, which it also logs.
func (d *Daemon) mapNoted(ctx context.Context, m api.Mapping) (api.Mapping, string, error) {
	spec, err := normalize(m)
	if err != nil {
		return m, "", err
	}
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	d.mu.Lock()
	if err := d.mirrorConflictLocked(spec, nil); err != nil {
		d.mu.Unlock()
		return m, "", err
	}
	for _, x := range d.maps {
		if spec.Mirror == "" && x.Mirror == "" && x.SessName == spec.SessName && x.DevicePath == spec.DevicePath {
			d.mu.Unlock()
			return m, "", ctl.Errorf(ctl.CodeExists, "%s is already mapped through session %s as %s", spec.DevicePath, spec.SessName, x.Device)
		}
	}
	for _, f := range d.failed {
		if spec.Mirror == "" && f.Mirror == "" && f.SessName == spec.SessName && f.DevicePath == spec.DevicePath {
			d.mu.Unlock()
			return m, "", ctl.Errorf(ctl.CodeExists, "%s through session %s is %s, not restored at start (%s): unmap %s, then map it again",
				spec.DevicePath, spec.SessName, f.Device, f.state(), f.Device)
		}
	}
	spec.named(d.nextDeviceLocked(), d.cfg.SocketDir)
	d.mu.Unlock()
	mp, err := d.mapLocked(ctx, spec, false)
	if err != nil {
		return spec.Mapping, "", err
	}
	if err := d.saveState(); err != nil {
		d.unmapLocked(ctx, mp.Device, true)
		return mp.Mapping, "", fmt.Errorf("saving the state file: %w", err)
	}
	if mp.mir != nil && spec.growTo > mp.mir.m.Size() {
		spec.note = fmt.Sprintf("mirror %s is mapped at its %d bytes, not the %d asked: a leg is not in sync (device show); it grows by resize once every leg is",
			spec.Mirror, mp.mir.m.Size(), spec.growTo)
	}
	if spec.note != "" {
		d.log.WithFields(log.Fields{"device": mp.Device, "socket": strings.TrimPrefix(mp.As, "socket:")}).Warn(spec.note)
	}
	return mp.Mapping, spec.note, nil
}

// nextDeviceLocked names the first free rnbdN.
// +checklocks:d.mu
func (d *Daemon) nextDeviceLocked() string {
	for i := 0; ; i++ {
		name := fmt.Sprintf("rnbd%d", i)
		taken := d.maps[name] != nil
		for _, f := range d.failed {
			taken = taken || f.Device == name
		}
		if !taken {
			return name
		}
	}
}

func (f failedMapping) state() string {
	if f.retry {
		return StateRestoring
	}
	return StateNotRestored
}

// retryRestores tries the mappings that did not come back at start
// again, backing off, until each is served or unmapped, or the daemon
// stops.
func (d *Daemon) retryRestores() {
	defer close(d.retryDone)
	delay := restoreRetryFirst
	t := time.NewTimer(delay)
	defer t.Stop()
	for attempt := 2; ; attempt++ {
		select {
		case <-d.stopRetry:
			return
		case <-t.C:
		}
		d.mu.Lock()
		var todo []api.Mapping
		for _, f := range d.failed {
			if f.retry {
				todo = append(todo, f.Mapping)
			}
		}
		d.mu.Unlock()
		if len(todo) == 0 {
			return
		}
		for _, m := range todo {
			select {
			case <-d.stopRetry:
				return
			default:
			}
			if err := d.restoreFailed(m.Device); err != nil {
				d.log.WithError(err).WithFields(log.Fields{"device": m.Device, "attempt": attempt}).
					Warn("restoring mapping failed again; it is tried again")
			}
		}
		delay = min(2*delay, restoreRetryMax)
		t.Reset(delay)
	}
}

// restoreFailed tries a mapping that did not come back once more; it
// does nothing if the mapping was unmapped (or mapped) meanwhile.
func (d *Daemon) restoreFailed(device string) error {
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	i := d.failedIndex(device)
	if i < 0 {
		return nil
	}
	// The entry as it is now: session set may have changed its settings.
	m := d.failed[i].Mapping
	spec, err := normalize(m)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(d.retryCtx, retryTimeout)
	defer cancel()
	mp, err := d.mapLocked(ctx, spec, true)
	if err != nil {
		return err
	}
	d.mu.Lock()
	if i := d.failedIndex(device); i >= 0 {
		d.failed = append(d.failed[:i:i], d.failed[i+1:]...)
	}
	d.mu.Unlock()
	d.log.WithFields(log.Fields{"device": mp.Device, "session": mp.SessName, "device_path": mp.DevicePath}).Info("mapping restored")
	if err := d.saveState(); err != nil { // its kernel device may be another
		d.log.WithError(err).Error("saving the state file")
	}
	return nil
}

// failedIndex is the index of device in d.failed, or -1. d.mu or
// d.mapMu is held.
func (d *Daemon) failedIndex(device string) int {
	for i, f := range d.failed {
		if f.Device == device {
			return i
		}
	}
	return -1
}

// restore maps a mapping of the state file under its old device name.
func (d *Daemon) restore(m api.Mapping) error {
	spec, err := normalize(m)
	if err != nil {
		return err
	}
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), restoreTimeout)
	defer cancel()
	_, err = d.mapLocked(ctx, spec, true)
	return err
}

// mapLocked does the work of a map, down the layers: the session (found
// or dialled), the device opened through it, the frontend attached to the
// device, and the mapping registered. A restore dials a session with the
// UUID it had, and is content with any one of its paths up.
func (d *Daemon) mapLocked(ctx context.Context, s mapSpec, restore bool) (*mapped, error) {
	if s.Mirror != "" {
		return d.mapMirror(ctx, s, restore)
	}
	sess, created, err := d.getSession(ctx, s, restore)
	if err != nil {
		return nil, err
	}
	s.SessUUID = sess.uuid()
	dev, err := sess.cs.Map(ctx, s.DevicePath, s.mode)
	if err == nil {
		var fe frontend
		if fe, err = d.attach(s, rnbdDev{dev}); err == nil {
			mp := d.register(s, dev, rnbdDev{dev}, fe)
			d.sessionSettings(sess, mp, restore)
			return mp, nil
		}
		dev.Unmap(context.Background())
	}
	if created {
		d.dropSession(s.SessName)
	}
	return nil, err
}

// register records a mapping that is being served and says where.
func (d *Daemon) register(s mapSpec, dev *rnbd.CltDev, io ioDev, fe frontend) *mapped {
	mp := &mapped{Mapping: s.Mapping, dev: dev, io: io, fe: fe}
	mp.mir, _ = io.(*mirrorDev)
	whereKey := "socket"
	if s.fe != feSocket {
		mp.Kernel, whereKey = fe.path(), "kernel_device"
		if other := d.linkHolder(mp.Mapping); other != "" {
			// "a!b" and "a_b" make one name: the first keeps it.
			d.log.WithFields(log.Fields{"device": mp.Device, "name": d.linkName(mp.Mapping), "held_by": other}).
				Warn("no stable name for the device: another mapping's device has it")
		} else {
			d.makeDevLink(mp.Mapping, mp.Kernel)
		}
	}
	d.mu.Lock()
	d.maps[mp.Device] = mp
	d.mu.Unlock()
	d.log.WithFields(log.Fields{"device": mp.Device, "session": mp.SessName, "device_path": mp.DevicePath,
		"access_mode": mp.AccessMode, "mirror": mp.Mirror, whereKey: fe.path(), "size": io.Size()}).Info("device mapped")
	return mp
}

// Unmap withdraws a mapping. Without force it refuses while NBD clients
// are connected.
func (d *Daemon) Unmap(ctx context.Context, device string, force bool) error {
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	if err := d.unmapLocked(ctx, device, force); err != nil {
		return err
	}
	return d.saveState()
}

func (d *Daemon) unmapLocked(ctx context.Context, device string, force bool) error {
	d.mu.Lock()
	m := d.maps[device]
	if m == nil {
		for i, f := range d.failed {
			if f.Device == device {
				// Never came back after a restart: only forget it
				// (a ublk device it left was removed then).
				d.failed = append(d.failed[:i:i], d.failed[i+1:]...)
				d.mu.Unlock()
				return nil
			}
		}
	}
	if m == nil {
		err := d.noDevice(device, "unmap")
		d.mu.Unlock()
		return err
	}
	d.mu.Unlock()
	if why := m.fe.busy(); why != "" && !force {
		return ctl.Errorf(ctl.CodeBusy, "%s %s or unmap --force", device, why)
	}
	d.mu.Lock()
	delete(d.maps, device)
	d.mu.Unlock()
	m.fe.remove() // no request of the frontend is left after it
	d.removeDevLink(m.Mapping)
	var err error
	if m.mir != nil {
		m.mir.stopRejoiner()
		m.mir.m.Close()
		m.mir.closeLegs(ctx)
		// Its legs' and witness's sessions, as a device's own below.
		names := make([]string, 0, len(m.Legs)+1)
		for _, l := range m.Legs {
			names = append(names, l.SessName)
		}
		if m.Witness != nil {
			names = append(names, m.Witness.SessName)
		}
		d.noteClosed(names...)
	} else {
		err = m.dev.Unmap(ctx)
		d.dropSession(m.SessName)
	}
	d.log.WithFields(log.Fields{"device": device, "force": force}).Info("device unmapped")
	return err
}

// find is the mapping of device, or an error for cmd (the command
// that names it: "remap", "device show").
func (d *Daemon) find(device, cmd string) (*mapped, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if m := d.maps[device]; m != nil {
		return m, nil
	}
	return nil, d.noDevice(device, cmd)
}

// noDevice is the error of a device name that is no mapping's, for cmd.
// A name the server gives a device (device_path) is not the local one
// (rnbd0): it says which mappings it is, and what cmd to run.
//
// +checklocks:d.mu
func (d *Daemon) noDevice(device, cmd string) error {
	var as []string
	for _, m := range d.maps {
		if m.DevicePath == device {
			as = append(as, m.Device+" (session "+m.SessName+")")
		}
	}
	for _, f := range d.failed {
		if f.DevicePath == device {
			as = append(as, f.Device+" (session "+f.SessName+", "+f.state()+")")
		}
	}
	sort.Strings(as)
	switch len(as) {
	case 0:
		return ctl.Errorf(ctl.CodeNotFound, "no device %s", device)
	case 1:
		dev, _, _ := strings.Cut(as[0], " ")
		return ctl.Errorf(ctl.CodeNotFound, "no device %s; %s is mapped as %s: %s %s", device, device, as[0], cmd, dev)
	}
	return ctl.Errorf(ctl.CodeNotFound, "no device %s; %s is mapped as %s: %s one of them", device, device, strings.Join(as, ", "), cmd)
}
