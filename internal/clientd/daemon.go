package clientd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/log"
	"github.com/rnbd/rnbd/internal/output"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/frontend/nbd"
	"github.com/rnbd/rnbd/pkg/frontend/ublk"
	"github.com/rnbd/rnbd/pkg/ibverbs"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/rdma"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// StateVersion is the version of the state file format.
const StateVersion = 1

// Mapping is one mapped device as the state file and the API keep it:
// the kernel's map_device parameters and where the device is served.
type Mapping struct {
	Device     string   `json:"device"` // rnbdN
	SessName   string   `json:"sessname"`
	Paths      []string `json:"paths"`
	DevicePath string   `json:"device_path"`
	AccessMode string   `json:"access_mode"`
	DestPort   uint16   `json:"dest_port"`
	Transport  string   `json:"transport"`
	As         string   `json:"as"` // nbd, ublk or socket:PATH
	// Kernel is the /dev/nbdN or /dev/ublkbN a mapping "as nbd" or "as
	// ublk" got; a restart takes the same device back.
	Kernel string `json:"kernel_device,omitempty"`
	// SessUUID is the RTRS session's paths UUID (hex): a restarted daemon
	// dials its sessions with the same one, so the server takes them for
	// the sessions it may still hold rather than refusing their names.
	SessUUID string `json:"sess_uuid,omitempty"`
}

// State is what survives a restart: the mappings.
type State struct {
	Version  int       `json:"version"`
	Mappings []Mapping `json:"mappings"`
}

// mapped is a mapping being served.
type mapped struct {
	Mapping
	dev  *rnbd.CltDev
	be   *nbdBackend  // socket and kernel nbd mappings
	l    net.Listener // socket mappings
	sock string
	k    *kernelDev   // kernel nbd mappings
	u    *ublk.Device // ublk mappings
}

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

// Daemon is a running rnbd-client.
type Daemon struct {
	cfg    Config
	log    *log.Entry
	fabric fabric.Fabric // TCP
	ctl    *ctl.Server

	rdmaMu sync.Mutex
	rdma   fabric.Fabric // made on first use
	nbd    *nbd.Server
	served chan error

	// mu guards sessions and maps; mapMu serializes map/unmap and the
	// state file.
	mapMu    sync.Mutex
	mu       sync.Mutex
	sessions map[string]*session
	maps     map[string]*mapped
	failed   []Mapping // saved mappings that did not come back; kept in the state file
	wg       sync.WaitGroup
}

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
	if opts.Fabric == nil {
		opts.Fabric = tcp.New(tcp.Options{})
	}
	d := &Daemon{cfg: cfg, log: opts.Log, fabric: opts.Fabric, rdma: opts.RDMA, served: make(chan error, 1),
		sessions: map[string]*session{}, maps: map[string]*mapped{},
		nbd: nbd.NewServer(nbd.Options{Log: opts.Log})}
	st, err := loadState(cfg.StateFile)
	if err != nil {
		return nil, err
	}
	if d.ctl, err = ctl.Listen(cfg.ControlSocket); err != nil {
		return nil, err
	}
	d.routes()
	// The saved mappings come back before the control socket answers, so
	// a command after the start sees them.
	for _, m := range st.Mappings {
		if err := d.restore(m); err != nil {
			l := d.log.WithField("device", m.Device)
			l.WithError(err).Error("restoring mapping failed; it stays in the state file")
			if m.As == "ublk" && parseUblkIndex(m.Kernel) >= 0 {
				// Unlike nbd's dead_conn_timeout, a quiesced ublk
				// device holds its IO for ever: fail it now.
				d.removeOrphanUblk(parseUblkIndex(m.Kernel), ublkCookie(backendID(m)), l)
				m.Kernel = ""
			}
			d.failed = append(d.failed, m)
		}
	}
	go func() { d.served <- d.ctl.Serve() }()
	d.log.WithFields(log.Fields{"control": cfg.ControlSocket, "mappings": len(st.Mappings)}).Info("rnbd-client started")
	return d, nil
}

// Stop stops serving: NBD connections close, sessions close (the server
// then closes their devices); the mappings stay in the state file and come
// back with the next start.
func (d *Daemon) Stop() error {
	d.nbd.Close()
	d.mu.Lock()
	maps := d.maps
	sessions := d.sessions
	d.maps, d.sessions = map[string]*mapped{}, map[string]*session{}
	d.mu.Unlock()
	for _, m := range maps {
		switch {
		case m.u != nil:
			// The ublk device stays (user recovery): the kernel holds
			// its IO and the restarted daemon takes it back. Without
			// recovery in the kernel it is stopped.
			if err := m.u.Detach(); err != nil {
				d.log.WithError(err).WithField("device", m.Device).Warn("ublk detach")
			}
		case m.k != nil:
			// Not disconnected: the kernel keeps the device and its
			// queued IO for kernelDeadConnTimeout, and the restarted
			// daemon takes it back.
			for _, c := range m.k.ours {
				c.Close()
			}
		default:
			m.l.Close()
			os.Remove(m.sock)
		}
		if m.be != nil {
			m.be.close()
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

func loadState(path string) (State, error) {
	st := State{Version: StateVersion}
	err := conf.LoadState(path, &st, StateVersion)
	return st, err
}

// saveState writes the mappings; d.mapMu is held. Mappings that failed
// to restore are kept: the operator unmaps them explicitly.
func (d *Daemon) saveState() error {
	st := State{Version: StateVersion}
	d.mu.Lock()
	for _, m := range d.maps {
		st.Mappings = append(st.Mappings, m.Mapping)
	}
	st.Mappings = append(st.Mappings, d.failed...)
	d.mu.Unlock()
	sort.Slice(st.Mappings, func(i, j int) bool { return st.Mappings[i].Device < st.Mappings[j].Device })
	return conf.SaveState(d.cfg.StateFile, st)
}

// ParseMapString parses the kernel's map_device line: "sessname=s1
// path=ip:10.0.0.1 path=ip:10.0.1.1 device_path=vol1 access_mode=rw
// dest_port=1234".
func ParseMapString(s string) (Mapping, error) {
	var m Mapping
	for _, tok := range strings.Fields(s) {
		k, v, ok := strings.Cut(tok, "=")
		if !ok || v == "" {
			return m, ctl.Errorf(ctl.CodeInvalid, "map: token %q: want key=value", tok)
		}
		switch k {
		case "sessname":
			m.SessName = v
		case "path":
			m.Paths = append(m.Paths, v)
		case "device_path":
			m.DevicePath = v
		case "access_mode":
			m.AccessMode = v
		case "dest_port":
			p, err := strconv.ParseUint(v, 10, 16)
			if err != nil || p == 0 {
				return m, ctl.Errorf(ctl.CodeInvalid, "map: dest_port %q", v)
			}
			m.DestPort = uint16(p)
		case "nr_poll_queues":
			return m, ctl.Errorf(ctl.CodeNotSupported, "map: nr_poll_queues is a kernel block-layer option with no meaning here")
		default:
			return m, ctl.Errorf(ctl.CodeInvalid, "map: unknown parameter %q", k)
		}
	}
	return m, nil
}

// normalize checks a mapping request and fills the defaults.
func (d *Daemon) normalize(m *Mapping) error {
	if m.SessName == "" || len(m.Paths) == 0 || m.DevicePath == "" {
		return ctl.Errorf(ctl.CodeInvalid, "map needs sessname, at least one path and device_path")
	}
	if err := rtrs.ValidSessName(m.SessName); err != nil {
		return ctl.Errorf(ctl.CodeInvalid, "sessname %q: %v", m.SessName, err)
	}
	if m.AccessMode == "" {
		m.AccessMode = "rw"
	}
	if _, err := rnbd.ParseAccessMode(m.AccessMode); err != nil {
		return ctl.Errorf(ctl.CodeInvalid, "access_mode %q: want ro, rw or migration", m.AccessMode)
	}
	if m.DestPort == 0 {
		m.DestPort = rtrs.DefaultPort
	}
	for _, p := range m.Paths {
		if _, err := rtrs.ParsePathAddr(p, m.DestPort); err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "path %q: %v", p, err)
		}
	}
	switch m.Transport {
	case "", "auto":
		m.Transport = autoTransport(m)
	case "tcp":
	case "rdma":
		if !ibverbs.Supported {
			return ctl.Errorf(ctl.CodeNotSupported, "this rnbd-client was built without RDMA (cgo); use --transport tcp")
		}
	default:
		return ctl.Errorf(ctl.CodeInvalid, "transport %q: want auto, tcp or rdma", m.Transport)
	}
	switch {
	case m.As == "":
		if kernelHasNBD() {
			m.As = "nbd"
		}
		// else a socket in socket_dir, named when the device is
	case m.As == "socket":
		m.As = ""
	case m.As == "nbd":
		if !kernelHasNBD() {
			return ctl.Errorf(ctl.CodeNotSupported, "this kernel has no nbd driver (modprobe nbd); map with --as socket:PATH instead")
		}
	case m.As == "ublk":
		if !kernelHasUblk() {
			return ctl.Errorf(ctl.CodeNotSupported, "this kernel has no ublk driver (modprobe ublk_drv); map with --as nbd or --as socket:PATH instead")
		}
	case strings.HasPrefix(m.As, "socket:") && len(m.As) > len("socket:"):
		p := m.As[len("socket:"):]
		if !filepath.IsAbs(p) {
			return ctl.Errorf(ctl.CodeInvalid, "--as socket:PATH needs an absolute path")
		}
	default:
		return ctl.Errorf(ctl.CodeInvalid, "--as %q: want nbd, ublk or socket:PATH", m.As)
	}
	return nil
}

// Map maps a device and serves it; the mapping is saved before it
// answers.
func (d *Daemon) Map(ctx context.Context, m Mapping) (Mapping, error) {
	if err := d.normalize(&m); err != nil {
		return m, err
	}
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	d.mu.Lock()
	for _, x := range d.maps {
		if x.SessName == m.SessName && x.DevicePath == m.DevicePath {
			d.mu.Unlock()
			return m, ctl.Errorf(ctl.CodeExists, "%s is already mapped through session %s as %s", m.DevicePath, m.SessName, x.Device)
		}
	}
	m.Device = d.nextDeviceLocked()
	d.mu.Unlock()
	if m.As == "" {
		m.As = "socket:" + filepath.Join(d.cfg.SocketDir, m.Device+".sock")
	}
	if err := d.mapLocked(ctx, m, false); err != nil {
		return m, err
	}
	d.mu.Lock()
	m = d.maps[m.Device].Mapping // with the kernel device it got
	d.mu.Unlock()
	if err := d.saveState(); err != nil {
		d.unmapLocked(ctx, m.Device, true)
		return m, fmt.Errorf("saving the state file: %w", err)
	}
	return m, nil
}

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

// restore maps a mapping of the state file under its old device name.
func (d *Daemon) restore(m Mapping) error {
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.normalize(&m); err != nil {
		return err
	}
	return d.mapLocked(ctx, m, true)
}

// mapLocked does the work of a map: the session (found or dialled), the
// device, the NBD export and its socket. A restore dials a session with
// the UUID it had, and is content with any one of its paths up.
func (d *Daemon) mapLocked(ctx context.Context, m Mapping, restore bool) error {
	s, created, err := d.getSession(ctx, m, restore)
	if err != nil {
		return err
	}
	m.SessUUID = s.uuid()
	mode, _ := rnbd.ParseAccessMode(m.AccessMode)
	dev, err := s.cs.Map(ctx, m.DevicePath, mode)
	if err != nil {
		if created {
			d.dropSession(m.SessName)
		}
		return err
	}
	fail := func(err error) error {
		dev.Unmap(context.Background())
		if created {
			d.dropSession(m.SessName)
		}
		return err
	}
	if m.As == "ublk" {
		u, err := d.attachUblk(dev, backendID(m), parseUblkIndex(m.Kernel))
		if err != nil {
			return fail(err)
		}
		m.Kernel = u.Path()
		d.register(&mapped{Mapping: m, dev: dev, u: u}, "kernel_device", m.Kernel)
		return nil
	}
	be, err := newNBDBackend(dev, 64)
	if err != nil {
		return fail(err)
	}
	if err := d.nbd.AddExport(be.export(m.DevicePath)); err != nil {
		be.close()
		return fail(err)
	}
	if m.As == "nbd" {
		k, err := d.attachKernel(be.export(m.DevicePath), backendID(m), parseKernelIndex(m.Kernel))
		if err != nil {
			d.nbd.RemoveExport(m.DevicePath)
			be.close()
			return fail(err)
		}
		m.Kernel = k.Path()
		d.register(&mapped{Mapping: m, dev: dev, be: be, k: k}, "kernel_device", m.Kernel)
		return nil
	}
	sock := m.As[len("socket:"):]
	os.MkdirAll(filepath.Dir(sock), 0o755)
	os.Remove(sock)
	l, err := net.Listen("unix", sock)
	if err != nil {
		d.nbd.RemoveExport(m.DevicePath)
		be.close()
		return fail(err)
	}
	os.Chmod(sock, 0o600)
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		d.nbd.Serve(l)
	}()
	d.register(&mapped{Mapping: m, dev: dev, be: be, l: l, sock: sock}, "socket", sock)
	return nil
}

// autoTransport is RDMA when every path's addresses lead to an RDMA
// device (a session runs on one transport), else TCP.
func autoTransport(m *Mapping) string {
	for _, p := range m.Paths {
		pa, err := rtrs.ParsePathAddr(p, m.DestPort)
		if err != nil || pa.GID {
			return "tcp"
		}
		if dev, err := rdma.DeviceFor(pa.Src.Addr(), pa.Dst.Addr()); err != nil || dev == "" {
			return "tcp"
		}
	}
	return "rdma"
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

// backendID names what a kernel device of m serves: nbd's
// BACKEND_IDENTIFIER, the source of a ublk device's cookie.
func backendID(m Mapping) string { return "rnbd:" + m.SessName + "/" + m.DevicePath }

// register records a mapping that is being served and says where.
func (d *Daemon) register(mp *mapped, whereKey, where string) {
	d.mu.Lock()
	d.maps[mp.Device] = mp
	d.mu.Unlock()
	d.log.WithFields(log.Fields{"device": mp.Device, "session": mp.SessName, "device_path": mp.DevicePath,
		"access_mode": mp.AccessMode, whereKey: where, "size": mp.dev.Size()}).Info("device mapped")
}

// getSession finds the session named in m or dials it. A session of that
// name must have the same paths: a different set is a mistake, not a
// second session.
func (d *Daemon) getSession(ctx context.Context, m Mapping, restore bool) (*session, bool, error) {
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
	fab, err := d.fabricFor(m.Transport)
	if err != nil {
		return nil, false, err
	}
	cfg := rtrs.DefaultClientConfig()
	cfg.SessName, cfg.Fabric, cfg.Log = m.SessName, fab, d.log
	cfg.ConnsPerPath = d.cfg.ConnsPerPath
	cfg.MPPolicy, _ = rtrs.ParseMPPolicy(d.cfg.MPPolicy)
	cfg.MaxReconnectAttempts = d.cfg.MaxReconnectAttempts
	cfg.HBInterval, cfg.HBMissedMax = d.cfg.HBInterval.Duration, d.cfg.HBMissedMax
	// The session's UUID is ours, not rtrs's random one, and kept in the
	// state file: its paths' UUIDs derive from it, so after a restart
	// the server sees the same paths coming back.
	cfg.OpenAnyPath = restore
	if u, err := hex.DecodeString(m.SessUUID); err == nil && len(u) == len(cfg.UUID) {
		copy(cfg.UUID[:], u)
	} else if _, err := rand.Read(cfg.UUID[:]); err != nil {
		return nil, false, err
	}
	for _, p := range m.Paths {
		pa, _ := rtrs.ParsePathAddr(p, m.DestPort)
		cfg.Paths = append(cfg.Paths, pa)
	}
	cs, err := rnbd.DialSession(ctx, cfg, d.cfg.NoPathTimeout.Duration)
	if err != nil {
		return nil, false, err
	}
	s = &session{cs: cs, paths: m.Paths, transport: m.Transport}
	d.mu.Lock()
	d.sessions[m.SessName] = s
	d.mu.Unlock()
	return s, true, nil
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
	}
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
	d.mu.Unlock()
	if m == nil {
		return ctl.Errorf(ctl.CodeNotFound, "no device %s", device)
	}
	if m.k != nil || m.u != nil {
		if !force && inUse(m.Kernel) {
			return ctl.Errorf(ctl.CodeBusy, "%s (%s) is in use (mounted?); unmount it or unmap --force", device, m.Kernel)
		}
	} else if n := d.nbd.Conns(m.DevicePath); n > 0 && !force {
		return ctl.Errorf(ctl.CodeBusy, "%s has %d NBD connection(s); close them or unmap --force", device, n)
	}
	d.mu.Lock()
	delete(d.maps, device)
	d.mu.Unlock()
	switch {
	case m.u != nil:
		if err := m.u.Stop(); err != nil {
			d.log.WithError(err).WithField("device", device).Warn("ublk stop")
		}
	case m.k != nil:
		m.k.detach(d.log)
	default:
		m.l.Close()
		os.Remove(m.sock)
	}
	if m.be != nil {
		d.nbd.RemoveExport(m.DevicePath) // closes the connections, waits for their IO
	}
	err := m.dev.Unmap(ctx)
	if m.be != nil {
		m.be.close()
	}
	d.dropSession(m.SessName)
	d.log.WithFields(log.Fields{"device": device, "force": force}).Info("device unmapped")
	return err
}

func (d *Daemon) find(device string) (*mapped, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if m := d.maps[device]; m != nil {
		return m, nil
	}
	return nil, ctl.Errorf(ctl.CodeNotFound, "no device %s", device)
}

func (d *Daemon) findSession(name string) (*session, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if s := d.sessions[name]; s != nil {
		return s, nil
	}
	return nil, ctl.Errorf(ctl.CodeNotFound, "no session %s", name)
}

// Requests of the control API.
type (
	ResizeRequest struct {
		Size string `json:"size"`
	}
	SetRequest struct {
		MPPolicy             *string `json:"mpath_policy,omitempty"`
		MaxReconnectAttempts *int    `json:"max_reconnect_attempts,omitempty"`
		NoPathTimeout        *string `json:"no_path_timeout,omitempty"`
	}
	PathRequest struct {
		Path string `json:"path"`
	}
	UnmapRequest struct {
		Force bool `json:"force"`
	}
)

// Field lists in the rnbd tool's names.
var (
	DeviceFields  = []string{"devname", "sessname", "devpath", "mapping_path", "access_mode", "state", "size", "socket", "io_mode", "direction"}
	SessionFields = []string{"sessname", "path_cnt", "act_path_cnt", "state", "path_uu", "mpath_policy", "no_path_timeout", "max_reconnect_attempts", "rx_bytes", "tx_bytes", "inflights", "devices", "transport", "direction"}
	PathFields    = []string{"sessname", "pathname", "src_addr", "dst_addr", "hca_name", "hca_port", "state", "rx_bytes", "tx_bytes", "inflights", "reconnects", "cur_latency", "direction"}
	StatsFields   = []string{"sessname", "pathname", "rdma", "reconnects", "cur_latency"}
)

func (d *Daemon) routes() {
	h := d.ctl.Handle
	h("POST /v1/devices", func(r *http.Request) (any, error) {
		var m Mapping
		if err := ctl.Decode(r, &m); err != nil {
			return nil, err
		}
		return d.Map(r.Context(), m)
	})
	h("GET /v1/devices", func(r *http.Request) (any, error) { return d.devices(""), nil })
	h("GET /v1/devices/{name}", func(r *http.Request) (any, error) {
		if _, err := d.find(r.PathValue("name")); err != nil {
			return nil, err
		}
		return d.devices(r.PathValue("name")), nil
	})
	h("POST /v1/devices/{name}/unmap", func(r *http.Request) (any, error) {
		var req UnmapRequest
		if err := ctl.Decode(r, &req); err != nil {
			return nil, err
		}
		return nil, d.Unmap(r.Context(), r.PathValue("name"), req.Force)
	})
	h("POST /v1/devices/{name}/remap", func(r *http.Request) (any, error) {
		m, err := d.find(r.PathValue("name"))
		if err != nil {
			return nil, err
		}
		return nil, m.dev.Remap(r.Context())
	})
	h("POST /v1/devices/{name}/resize", func(r *http.Request) (any, error) {
		var req ResizeRequest
		if err := ctl.Decode(r, &req); err != nil {
			return nil, err
		}
		m, err := d.find(r.PathValue("name"))
		if err != nil {
			return nil, err
		}
		n, err := units.ParseSize(req.Size)
		if err != nil {
			return nil, ctl.Errorf(ctl.CodeInvalid, "%v", err)
		}
		return nil, m.dev.Resize(n)
	})
	h("GET /v1/sessions", func(r *http.Request) (any, error) { return d.sessionRecords(""), nil })
	h("GET /v1/sessions/{name}", func(r *http.Request) (any, error) {
		if _, err := d.findSession(r.PathValue("name")); err != nil {
			return nil, err
		}
		return d.sessionRecords(r.PathValue("name")), nil
	})
	h("POST /v1/sessions/{name}/set", func(r *http.Request) (any, error) {
		var req SetRequest
		if err := ctl.Decode(r, &req); err != nil {
			return nil, err
		}
		s, err := d.findSession(r.PathValue("name"))
		if err != nil {
			return nil, err
		}
		return nil, s.set(req)
	})
	h("POST /v1/sessions/{name}/reconnect", func(r *http.Request) (any, error) {
		s, err := d.findSession(r.PathValue("name"))
		if err != nil {
			return nil, err
		}
		var errs []error
		for _, p := range s.cs.Session().Paths() {
			if err := p.Reconnect(r.Context()); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", p.Name(), err))
			}
		}
		return nil, errors.Join(errs...)
	})
	h("GET /v1/paths", func(r *http.Request) (any, error) { return d.pathRecords(r.URL.Query().Get("session"), ""), nil })
	h("GET /v1/paths/{name}", func(r *http.Request) (any, error) {
		recs := d.pathRecords(r.URL.Query().Get("session"), r.PathValue("name"))
		if len(recs) == 0 {
			return nil, ctl.Errorf(ctl.CodeNotFound, "no path %s", r.PathValue("name"))
		}
		return recs, nil
	})
	h("POST /v1/sessions/{name}/paths", func(r *http.Request) (any, error) {
		var req PathRequest
		if err := ctl.Decode(r, &req); err != nil {
			return nil, err
		}
		s, err := d.findSession(r.PathValue("name"))
		if err != nil {
			return nil, err
		}
		pa, err := rtrs.ParsePathAddr(req.Path, rtrs.DefaultPort)
		if err != nil {
			return nil, ctl.Errorf(ctl.CodeInvalid, "%v", err)
		}
		p, err := s.cs.Session().AddPath(r.Context(), pa)
		if err != nil {
			return nil, err
		}
		return []output.Record{pathRecord(s.cs.Session(), p)}, nil
	})
	for _, op := range []string{"remove", "reconnect", "disconnect"} {
		h("POST /v1/paths/{name}/"+op, func(r *http.Request) (any, error) {
			p, err := d.findPath(r.URL.Query().Get("session"), r.PathValue("name"))
			if err != nil {
				return nil, err
			}
			switch op {
			case "remove":
				return nil, p.Remove()
			case "reconnect":
				return nil, p.Reconnect(r.Context())
			}
			return nil, p.Disconnect()
		})
	}
	h("GET /v1/stats", func(r *http.Request) (any, error) {
		var recs []output.Record
		for _, rec := range d.pathRecords("", "") {
			recs = append(recs, output.Record{"sessname": rec["sessname"], "pathname": rec["pathname"],
				"rdma": rec["rdma"], "reconnects": rec["reconnects"], "cur_latency": rec["cur_latency"]})
		}
		return recs, nil
	})
	h("POST /v1/stats/reset", func(r *http.Request) (any, error) {
		for _, s := range d.sessionList() {
			for _, p := range s.cs.Session().Paths() {
				p.Stats().ResetRDMA()
				p.Stats().ResetReconnects()
				p.Stats().ResetLatency()
			}
		}
		return nil, nil
	})
}

func (s *session) set(req SetRequest) error {
	cs := s.cs
	if req.MPPolicy != nil {
		p, err := rtrs.ParseMPPolicy(*req.MPPolicy)
		if err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "%v", err)
		}
		if err := cs.Session().SetMPPolicy(p); err != nil {
			return err
		}
	}
	if req.MaxReconnectAttempts != nil {
		if err := cs.Session().SetMaxReconnectAttempts(*req.MaxReconnectAttempts); err != nil {
			return err
		}
	}
	if req.NoPathTimeout != nil {
		t, err := time.ParseDuration(*req.NoPathTimeout)
		if err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "no_path_timeout %q: %v", *req.NoPathTimeout, err)
		}
		return cs.SetNoPathTimeout(t)
	}
	return nil
}

func (d *Daemon) sessionList() []*session {
	d.mu.Lock()
	defer d.mu.Unlock()
	var ss []*session
	for _, s := range d.sessions {
		ss = append(ss, s)
	}
	sort.Slice(ss, func(i, j int) bool { return ss[i].cs.Session().Name() < ss[j].cs.Session().Name() })
	return ss
}

func (d *Daemon) devices(name string) []output.Record {
	d.mu.Lock()
	var ms []*mapped
	for _, m := range d.maps {
		if name == "" || m.Device == name {
			ms = append(ms, m)
		}
	}
	d.mu.Unlock()
	sort.Slice(ms, func(i, j int) bool { return ms[i].Device < ms[j].Device })
	var recs []output.Record
	for _, m := range ms {
		devpath, mode := m.sock, "nbd-socket"
		switch {
		case m.k != nil:
			devpath, mode = m.Kernel, "nbd-kernel"
		case m.u != nil:
			devpath, mode = m.Kernel, "ublk"
		}
		recs = append(recs, output.Record{
			"devname": m.Device, "sessname": m.SessName, "devpath": devpath, "mapping_path": m.DevicePath,
			"access_mode": m.AccessMode, "state": m.dev.State().String(), "size": m.dev.Size(),
			"socket": m.sock, "io_mode": mode, "direction": "client",
		})
	}
	return recs
}

func (d *Daemon) sessionRecords(name string) []output.Record {
	var recs []output.Record
	for _, s := range d.sessionList() {
		rs := s.cs.Session()
		if name != "" && rs.Name() != name {
			continue
		}
		var up int
		var uu strings.Builder
		var rx, tx uint64
		var inflight int64
		paths := rs.Paths()
		for _, p := range paths {
			c := p.Stats().Counters()
			rx, tx, inflight = rx+c.ReadBytes, tx+c.WriteBytes, inflight+c.Inflight
			if p.State() == rtrs.PathConnected {
				up++
				uu.WriteByte('U')
			} else {
				uu.WriteByte('_')
			}
		}
		state := "disconnected"
		if up > 0 {
			state = "connected"
		}
		recs = append(recs, output.Record{
			"sessname": rs.Name(), "path_cnt": len(paths), "act_path_cnt": up, "state": state,
			"path_uu": uu.String(), "mpath_policy": rs.MPPolicy().String(), "transport": s.transport,
			"no_path_timeout": s.cs.NoPathTimeout().String(), "max_reconnect_attempts": rs.MaxReconnectAttempts(),
			"rx_bytes": rx, "tx_bytes": tx, "inflights": inflight, "devices": len(s.cs.Devices()), "direction": "client",
		})
	}
	return recs
}

func pathRecord(rs *rtrs.CltSession, p *rtrs.CltPath) output.Record {
	c := p.Stats().Counters()
	a := p.Addr()
	return output.Record{
		"sessname": rs.Name(), "pathname": p.Name(),
		"src_addr": rtrs.FormatAddr(a.Src.Addr(), false), "dst_addr": rtrs.FormatAddr(a.Dst.Addr(), false),
		"hca_name": p.HCAName(), "hca_port": p.HCAPort(), "state": p.State().SysfsString(),
		"rx_bytes": c.ReadBytes, "tx_bytes": c.WriteBytes, "inflights": c.Inflight,
		"reconnects": strings.TrimSpace(p.Stats().Reconnects()), "cur_latency": p.CurLatency().Nanoseconds(),
		"rdma": strings.TrimSpace(p.Stats().RDMA()), "direction": "client",
	}
}

func (d *Daemon) pathRecords(session, name string) []output.Record {
	var recs []output.Record
	for _, s := range d.sessionList() {
		rs := s.cs.Session()
		if session != "" && rs.Name() != session {
			continue
		}
		for _, p := range rs.Paths() {
			if name == "" || p.Name() == name {
				recs = append(recs, pathRecord(rs, p))
			}
		}
	}
	return recs
}

func (d *Daemon) findPath(session, name string) (*rtrs.CltPath, error) {
	var found []*rtrs.CltPath
	for _, s := range d.sessionList() {
		rs := s.cs.Session()
		if session != "" && rs.Name() != session {
			continue
		}
		for _, p := range rs.Paths() {
			if p.Name() == name {
				found = append(found, p)
			}
		}
	}
	switch len(found) {
	case 0:
		return nil, ctl.Errorf(ctl.CodeNotFound, "no path %s", name)
	case 1:
		return found[0], nil
	}
	return nil, fmt.Errorf("path %s exists in %d sessions, name the session: %w", name, len(found), syscall.EINVAL)
}
