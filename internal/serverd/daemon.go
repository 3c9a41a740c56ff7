package serverd

import (
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/log"
	"github.com/rnbd/rnbd/internal/metrics"
	"github.com/rnbd/rnbd/internal/output"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/rdma"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// StateVersion is the version of the state file format.
const StateVersion = 1

// State is what survives a restart: the explicit exports, and the
// session names bound to client identities (rnbd.SessionOwner).
type State struct {
	Version       int                 `json:"version"`
	Exports       []rnbd.Export       `json:"exports"`
	SessionOwners []rnbd.SessionOwner `json:"session_owners,omitempty"`
}

// Daemon is a running rnbd-server.
type Daemon struct {
	stopOnce sync.Once
	stopErr  error // of the first Stop

	cfg  Config
	log  *log.Entry
	rnbd *rnbd.Server
	rtrs *rtrs.Server
	ctl  *ctl.Server

	// stateMu serializes changes of the exports and their saving.
	stateMu sync.Mutex
	// unrestored are the exports of the state file that could not be
	// served at start (a backing file or device not there yet): kept in
	// the file by every save until mapped again or unmapped. stateMu.
	unrestored []rnbd.Export
	// configured are the names of the configuration file's exports:
	// never saved in the state file, never mapped or unmapped.
	configured map[string]bool
	// configPending are the configuration file's exports that could not
	// be served (a device not there yet, a file not readable): the
	// others are served, and these are tried again every retryEvery, as
	// are the unrestored ones. notServed says why, by name. stateMu.
	configPending []rnbd.Export
	notServed     map[string]string
	retryEvery    time.Duration
	served        chan error
	metrics       *metrics.Server // nil without metrics_listen
	// ownersDirty asks saveOwners to save the state file: a session
	// name was bound. stopOwners and ownersDone end saveOwners.
	ownersDirty chan struct{}
	stopOwners  chan struct{}
	ownersDone  chan struct{}
	// stopRetry and retryDone end retryLoop, which tries the exports
	// not served again.
	stopRetry chan struct{}
	retryDone chan struct{}
	// probe looks at export paths before they are mapped, so that one
	// on a mount that does not answer holds nothing.
	probe pathProbe
}

// Options are what a daemon is started with beyond its configuration.
type Options struct {
	// Fabric overrides the TCP fabric (tests).
	Fabric fabric.Fabric
	// RDMA overrides the RDMA fabric (tests); nil makes one if an rdma://
	// address is to be listened on.
	RDMA fabric.Fabric
	Log  *log.Entry
	// GoMemoryLimit: the process is this daemon's, and the Go runtime's
	// soft memory limit follows what its paths may hold
	// (rtrs.ServerConfig.GoMemoryLimit).
	GoMemoryLimit bool
}

// Start loads the state, opens the control socket and starts serving.
// On error nothing is left running.
func Start(cfg Config, opts Options) (*Daemon, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if opts.Log == nil {
		opts.Log = log.L
	}
	if opts.Fabric != nil && cfg.TLS.Enabled() {
		// A fabric of the caller's would drop the TLS configured.
		return nil, errors.New("tls: configured, but the caller gave its own TCP fabric")
	}
	if opts.Fabric == nil {
		tc, err := cfg.TLS.Config()
		if err != nil {
			return nil, err
		}
		ut, _ := conf.ParseUserTimeout(cfg.TCPUserTimeout) // validated
		opts.Fabric = tcp.New(tcp.Options{TLS: tc, AllowAnonymousClients: cfg.TLS.AllowAnonymousClients, Log: opts.Log, UserTimeout: ut})
	}
	d := &Daemon{cfg: cfg, log: opts.Log, served: make(chan error, 1), retryEvery: cfg.ExportRetry.Duration,
		ownersDirty: make(chan struct{}, 1), stopOwners: make(chan struct{}), ownersDone: make(chan struct{}),
		stopRetry: make(chan struct{}), retryDone: make(chan struct{})}
	eps, err := endpoints(cfg.Listen, opts)
	if err != nil {
		return nil, err
	}
	searchFrom, _ := parseNetworks(cfg.SearchAllowFrom)    // validated
	searchIDs, _ := parseGrants(cfg.SearchAllowIdentities) // validated
	d.rnbd = rnbd.NewServer(rnbd.ServerConfig{
		DevSearchPath:         cfg.DevSearchPath,
		AllowMigration:        cfg.AllowMigration,
		SearchAllowFrom:       searchFrom,
		SearchAllowIdentities: searchIDs,
		Direct:                cfg.DirectIO,
		MaxIOSize:             cfg.MaxChunkSize - rtrs.MaxHdrSize,
		BindSessionNames:      cfg.TLS.Enabled() && cfg.BindSessionNames,
		OwnersChanged: func() {
			select {
			case d.ownersDirty <- struct{}{}:
			default: // a save is due already
			}
		},
		// d.rtrs is set before the control socket, where a name is
		// forgotten, serves.
		NameHeld: func(name string) bool { return d.rtrs.NameHeld(name) },
		Stat:     d.probe.stat,
		Answers:  d.probe.answers,
		Log:      opts.Log,
	})
	st, err := conf.LoadState(cfg.StateFile, &State{Version: StateVersion}, StateVersion)
	if err != nil {
		d.rnbd.Close()
		return nil, err
	}
	d.rnbd.SetSessionOwners(st.SessionOwners)
	// The configuration file's exports first: a name there is served as
	// the file says, whatever a map of the same name left in the state.
	d.configured, d.notServed = map[string]bool{}, map[string]string{}
	var paths []string
	for _, r := range cfg.Exports {
		paths = append(paths, r.Path)
	}
	for _, e := range st.Exports {
		paths = append(paths, e.Path)
	}
	looked := d.probe.look(paths, probeWait)
	for _, r := range cfg.Exports {
		e, _ := r.Export() // validated
		d.configured[e.Name] = true
		if err := d.mapLooked(e, looked); err != nil {
			// One missing device does not keep the others from
			// being served.
			d.configPending = append(d.configPending, e)
			d.noteNotServed(e, "export of the configuration file not served (tried again every "+d.retryEvery.String()+")", err)
			continue
		}
		d.log.WithFields(exportFields(e)).Info("export of the configuration file")
		d.warnReadOnly(e, looked[e.Path])
	}
	for _, e := range st.Exports {
		if d.configured[e.Name] {
			// Kept in the state file, for when the configuration
			// no longer has the name.
			d.log.WithField("export", e.Name).Warn("export of the state file not served: the configuration file has one of that name")
			d.unrestored = append(d.unrestored, e)
			continue
		}
		if err := d.mapLooked(e, looked); err != nil {
			// Keep going: the rest of the exports are still served,
			// and the state file keeps the entry for when it returns.
			d.noteNotServed(e, "restoring export failed (tried again every "+d.retryEvery.String()+")", err)
			d.unrestored = append(d.unrestored, e)
			continue
		}
		d.warnReadOnly(e, looked[e.Path])
	}
	if d.ctl, err = ctl.Listen(cfg.ControlSocket); err != nil {
		d.rnbd.Close()
		return nil, err
	}
	rcfg := rtrs.DefaultServerConfig()
	rcfg.Fabric, rcfg.Handler, rcfg.Endpoints, rcfg.Log = opts.Fabric, d.rnbd, eps, opts.Log
	rcfg.QueueDepth, rcfg.MaxChunkSize, rcfg.AlwaysInvalidate = cfg.QueueDepth, cfg.MaxChunkSize, cfg.AlwaysInvalidate
	rcfg.InvalidateByRegistration = cfg.InvalidateBy == "registration"
	rcfg.HBInterval, rcfg.HBMissedMax = cfg.HBInterval.Duration, cfg.HBMissedMax
	rcfg.MaxChunkMemory = int64(cfg.MaxChunkMemory)
	rcfg.MaxChunkMemoryPerClient = rtrs.DefaultMaxChunkMemoryPerClient(&rcfg)
	if cfg.MaxChunkMemoryPerClient != nil {
		rcfg.MaxChunkMemoryPerClient = int64(*cfg.MaxChunkMemoryPerClient)
	}
	rcfg.MaxSessionsPerClient = cfg.MaxSessionsPerClient
	rcfg.NewPathRate, rcfg.NewPathBurst = cfg.NewPathRate, cfg.NewPathBurst
	rcfg.GoMemoryLimit = opts.GoMemoryLimit
	if d.rtrs, err = rtrs.NewServer(rcfg); err != nil {
		d.ctl.Close()
		d.rnbd.Close()
		return nil, err
	}
	d.routes()
	if cfg.MetricsListen != "" {
		if d.metrics, err = metrics.Listen(cfg.MetricsListen, srvCollector{d}, d.log); err != nil {
			d.rtrs.Close()
			d.ctl.Close()
			d.rnbd.Close()
			return nil, err
		}
	}
	go d.saveOwners()
	go d.retryLoop()
	go func() { d.served <- d.ctl.Serve() }()
	// What is bound, not what was asked for: an rdma:// address on
	// every interface of a machine without RDMA is not listened on,
	// and the warning below names the same addresses as this line.
	var bound, wild []string
	for _, l := range d.rtrs.Listening() {
		bound = append(bound, l.String())
		if l.Addr.Addr().IsUnspecified() {
			wild = append(wild, l.String())
		}
	}
	d.log.WithFields(log.Fields{"listen": strings.Join(bound, ","), "control": cfg.ControlSocket,
		"exports": len(d.rnbd.Exports()), "not_served": len(d.unserved()), "dev_search_path": cfg.DevSearchPath, "tls": cfg.TLS.Enabled(),
		"max_chunk_memory": int64(cfg.MaxChunkMemory), "go_memory_limit": goMemoryLimit(opts.GoMemoryLimit, cfg)}).Info("rnbd-server started")
	if len(wild) > 0 {
		d.log.WithField("listen", strings.Join(wild, ",")).Warn("listening on every interface: any host that reaches the port " +
			"can open the exports that allow it; set listen to the storage network's address, and allow_from or allow_identities (with tls) on exports")
	}
	d.warnTrust(cfg, bound)
	return d, nil
}

// noTLSWarning is the start-up warning of a server without TLS (docs/operations.md).
const noTLSWarning = "without TLS anyone who can reach these addresses is trusted: session names (--allow) and client " +
	"addresses (--allow-from) are what a client claims, not credentials, and RDMA authenticates no one either; " +
	"configure [tls] (docs/operations.md, \"TLS on the TCP fabric\")"

// warnTrust says at start-up whom the listeners trust, where it is
// anyone who reaches them: every listener without TLS, RDMA ones with
// it, and anonymous client certificates when they are let in.
func (d *Daemon) warnTrust(cfg Config, bound []string) {
	var tcpL, rdmaL []string
	for _, l := range bound {
		if strings.HasPrefix(l, "rdma://") {
			rdmaL = append(rdmaL, l)
		} else {
			tcpL = append(tcpL, l)
		}
	}
	if !cfg.TLS.Enabled() {
		if len(bound) > 0 {
			d.log.WithField("listen", strings.Join(bound, ",")).Warn(noTLSWarning)
		}
		return
	}
	if len(rdmaL) > 0 {
		d.log.WithField("listen", strings.Join(rdmaL, ",")).Warn("TLS covers tcp:// only: on these RDMA addresses clients " +
			"are not authenticated nor encrypted, and exports with allow_identities cannot be opened there")
	}
	if cfg.TLS.AllowAnonymousClients && len(tcpL) > 0 {
		d.log.WithField("listen", strings.Join(tcpL, ",")).Warn("tls allow_anonymous_clients: a client certificate that " +
			"names no identity is accepted; such a client is counted by its address and may open every export that grants no identities")
	}
}

// goMemoryLimit says how the Go runtime's memory limit is set, for the
// start-up line.
func goMemoryLimit(follow bool, cfg Config) string {
	switch {
	case os.Getenv("GOMEMLIMIT") != "":
		return "GOMEMLIMIT=" + os.Getenv("GOMEMLIMIT")
	case !follow:
		return "none"
	case cfg.MaxChunkMemory == 0:
		return "none (max_chunk_memory 0)"
	}
	return fmt.Sprintf("what paths hold on the heap + %d MiB", rtrs.GoHeapMargin>>20)
}

// endpoints turns the listen addresses into the server's endpoints. An
// rdma:// address on every interface (0.0.0.0, ::) is listened on only
// where the machine can do RDMA; a specific one must work.
func endpoints(listen []string, opts Options) ([]rtrs.Endpoint, error) {
	var eps []rtrs.Endpoint
	for _, s := range listen {
		l, err := rtrs.ParseListen(s)
		if err != nil {
			return nil, err
		}
		e := rtrs.Endpoint{Fabric: opts.Fabric, Addr: l.Addr}
		if l.Transport == "rdma" {
			if opts.RDMA == nil {
				f, err := rdma.New(rdma.Options{})
				if err != nil && !l.Addr.Addr().IsUnspecified() {
					return nil, fmt.Errorf("listen %s: %w", s, err)
				}
				if err != nil {
					continue // no RDMA in this build: TCP only
				}
				opts.RDMA = f
			}
			e.Fabric, e.Optional = opts.RDMA, l.Addr.Addr().IsUnspecified()
		}
		eps = append(eps, e)
	}
	return eps, nil
}

// everywhere returns the listen addresses that are not one address but
// every interface's (0.0.0.0, ::) (the example configuration has none).
func everywhere(listen []string) []string {
	var wild []string
	for _, s := range listen {
		if l, err := rtrs.ParseListen(s); err == nil && l.Addr.Addr().IsUnspecified() {
			wild = append(wild, s)
		}
	}
	return wild
}

// Addrs are the addresses the daemon listens on for RTRS.
func (d *Daemon) Addrs() []netip.AddrPort { return d.rtrs.Addrs() }

// Stop drains and stops: no new connections, every path closed after its
// IO answered, then the control socket.
// Calls after the first return its result.
func (d *Daemon) Stop() error {
	d.stopOnce.Do(func() { d.stopErr = d.stop() })
	return d.stopErr
}

func (d *Daemon) stop() error {
	if d.metrics != nil {
		d.metrics.Close()
	}
	d.rtrs.Close()
	close(d.stopRetry)
	select {
	case <-d.retryDone:
	case <-time.After(retryStopWait):
		// Every stat of a retry is bounded (probeWait), but a retry
		// may look at many paths, one after another, under the
		// state lock: the stop does not wait for it all.
		d.log.Warn("stopping while a retry of exports not served is under way")
	}
	close(d.stopOwners)
	<-d.ownersDone
	d.rnbd.Close()
	err := d.ctl.Close()
	<-d.served
	d.log.Info("rnbd-server stopped")
	return err
}

// StateVersion implements conf.Versioned.
func (st *State) StateVersion() int { return st.Version }

// saveState writes the exports atomically: a temporary file, synced, then
// renamed over the old one, and the directory synced.
func (d *Daemon) saveState() error {
	st := State{Version: StateVersion, SessionOwners: d.rnbd.SessionOwners()}
	served := map[string]bool{}
	for _, e := range d.rnbd.Exports() {
		if !d.configured[e.Name] {
			st.Exports = append(st.Exports, e)
			served[e.Name] = true
		}
	}
	for _, e := range d.unrestored {
		if !served[e.Name] {
			st.Exports = append(st.Exports, e)
		}
	}
	sort.Slice(st.Exports, func(i, j int) bool { return st.Exports[i].Name < st.Exports[j].Name })
	return conf.SaveState(d.cfg.StateFile, st)
}

// dropUnrestored forgets an export that could not be restored (it was
// mapped again, or unmapped). stateMu is held.
func (d *Daemon) dropUnrestored(name string) bool {
	for i, e := range d.unrestored {
		if e.Name == name {
			delete(d.notServed, name)
			d.unrestored = append(d.unrestored[:i], d.unrestored[i+1:]...)
			return true
		}
	}
	return false
}

// saveOwners saves the state file when a session name was bound, until
// Stop, and once more then if one is still due.
func (d *Daemon) saveOwners() {
	defer close(d.ownersDone)
	save := func() {
		d.stateMu.Lock()
		defer d.stateMu.Unlock()
		if err := d.saveState(); err != nil {
			d.log.WithError(err).Error("saving the session names' identities failed")
		}
	}
	for {
		select {
		case <-d.ownersDirty:
			save()
		case <-d.stopOwners:
			select {
			case <-d.ownersDirty:
				save()
			default:
			}
			return
		}
	}
}

// unserved lists the exports that could not be served, with why: the
// configuration file's, and the state file's not shadowed by one of the
// configuration file.
func (d *Daemon) unserved() []ExportRecord {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	var out []ExportRecord
	for _, e := range d.configPending {
		out = append(out, ExportRecord{Export: e, Source: "config", NotServed: d.notServed[e.Name]})
	}
	for _, e := range d.unrestored {
		if !d.configured[e.Name] {
			out = append(out, ExportRecord{Export: e, Source: "map", NotServed: d.notServed[e.Name]})
		}
	}
	return out
}

// noteNotServed records why e is not served, and logs it when that is
// news. stateMu is held (or the daemon is starting).
func (d *Daemon) noteNotServed(e rnbd.Export, what string, err error) {
	if d.notServed[e.Name] == err.Error() {
		return
	}
	d.notServed[e.Name] = err.Error()
	d.log.WithError(err).WithFields(exportFields(e)).Error(what)
}

// mapLooked maps e, unless its path did not answer when looked at (Map
// looks again, bounded the same way).
func (d *Daemon) mapLooked(e rnbd.Export, looked map[string]probed) error {
	if err := looked[e.Path].err; errors.Is(err, syscall.ETIMEDOUT) {
		return fmt.Errorf("export %s: %w", e.Name, err)
	}
	if err := d.rnbd.Map(e); err != nil {
		return selfView.missing(e.Path, err)
	}
	return nil
}

// retryStopWait bounds how long Stop waits for a retry under way.
const retryStopWait = 5 * time.Second

// retryLoop tries the exports not served again every retryEvery, until
// Stop. It is a goroutine of its own: a path on a mount that hangs holds
// only it, not the saves of the state file.
func (d *Daemon) retryLoop() {
	defer close(d.retryDone)
	t := time.NewTicker(d.retryEvery)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			d.retryNotServed()
		case <-d.stopRetry:
			return
		}
	}
}

// retryNotServed tries the exports that could not be served again: a
// device that appeared since (an LVM volume activated late, a file
// system mounted) is served without a restart. Their paths are looked
// at without the state lock: a stat on a mount that does not answer
// hangs, and must not hold map, unmap and the saves with it; an export
// is mapped only once its path answered.
func (d *Daemon) retryNotServed() {
	d.stateMu.Lock()
	var paths []string
	for _, list := range [][]rnbd.Export{d.configPending, d.unrestored} {
		for _, e := range list {
			paths = append(paths, e.Path)
		}
	}
	d.stateMu.Unlock()
	if len(paths) == 0 {
		return
	}
	looked := d.probe.look(paths, probeWait)
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	// A state-file export the configuration file shadows waits for the
	// file to lose it (state true); the configuration's own never are.
	try := func(list []rnbd.Export, state bool, what string) []rnbd.Export {
		keep := list[:0]
		for _, e := range list {
			if state && d.configured[e.Name] {
				keep = append(keep, e)
				continue
			}
			if err := d.mapLooked(e, looked); err != nil {
				d.noteNotServed(e, what+" still not served", err)
				keep = append(keep, e)
				continue
			}
			delete(d.notServed, e.Name)
			d.log.WithFields(exportFields(e)).Info(what + " served now")
			d.warnReadOnly(e, looked[e.Path])
		}
		return keep
	}
	d.configPending = try(d.configPending, false, "export of the configuration file")
	d.unrestored = try(d.unrestored, true, "export of the state file")
}

// Requests of the control API.
type (
	// MapRequest is an export as map gives it, and as an [[export]]
	// table of the configuration file does.
	MapRequest struct {
		Name     string   `json:"name" toml:"name"`
		Path     string   `json:"path" toml:"path"`
		ReadOnly bool     `json:"read_only" toml:"read_only"`
		Allow    []string `json:"allow" toml:"allow"`
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
		WriteThrough bool `json:"write_through" toml:"write_through"`
	}
	// ExportRecord is an export and where it comes from, "config" (the
	// configuration file) or "map"; GET /v1/exports gives it as
	// exportRecord makes it.
	ExportRecord struct {
		rnbd.Export
		Source string
		// NotServed says why an export is not served (its file or
		// device could not be opened; tried again every export_retry).
		NotServed string
	}
	CloseRequest struct {
		Session string `json:"session"`
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
	// ResizeRequest: Size as "20GiB" or bytes; Force shrinks an export
	// that sessions have open (rnbd.Server.Resize).
	ResizeRequest struct {
		Size  string `json:"size"`
		Force bool   `json:"force,omitempty"`
	}
	ResizeResponse struct {
		Was int64 `json:"was"`
		Now int64 `json:"now"`
	}
	CloseResponse struct {
		Closed int `json:"closed"`
	}
)

// Field lists of the records the API returns, in the rnbd tool's names
// (docs/control-api.md, "Records", has each with its JSON type).
var (
	DeviceFields = []string{"devname", "devpath", "sessname", "mapping_path", "access_mode", "read_only", "device_id", "state", "write_cache", "rx_sect", "tx_sect", "flush_cnt", "fua_cnt", "discard_cnt", "wzero_cnt", "source", "reason",
		"allow", "allow_from", "allow_identities", "max_sessions", "migration", "write_through", "direction"}
	ExportFields      = []string{"name", "path", "read_only", "allow", "allow_from", "allow_identities", "max_sessions", "migration", "write_through", "source", "not_served"}
	SessionFields     = []string{"sessname", "path_cnt", "act_path_cnt", "state", "path_uu", "rx_bytes", "tx_bytes", "inflights", "devices", "peer", "direction"}
	SessionNameFields = []string{"sessname", "identity"}
	PathFields        = []string{"sessname", "pathname", "src_addr", "dst_addr", "hca_name", "hca_port", "state", "rx_bytes", "tx_bytes", "inflights", "direction"}
	StatsFields       = []string{"sessname", "pathname", "rdma", "inflights"}
)

func (d *Daemon) routes() {
	h := d.ctl.Handle
	h("GET /v1/devices", func(r *http.Request) (any, error) { return d.devices(""), nil })
	h("GET /v1/devices/{name}", func(r *http.Request) (any, error) {
		rows := d.devices(r.PathValue("name"))
		if len(rows) == 0 {
			return nil, ctl.Errorf(ctl.CodeNotFound, "no device %s", r.PathValue("name"))
		}
		return rows, nil
	})
	h("POST /v1/devices/{name}/close", func(r *http.Request) (any, error) {
		var req CloseRequest
		if err := ctl.Decode(r, &req); err != nil {
			return nil, err
		}
		n, err := d.rnbd.ForceClose(r.PathValue("name"), req.Session)
		return CloseResponse{Closed: n}, err
	})
	h("GET /v1/exports", func(r *http.Request) (any, error) { return d.exports(""), nil })
	h("GET /v1/exports/{name}", func(r *http.Request) (any, error) {
		rows := d.exports(r.PathValue("name"))
		if len(rows) == 0 {
			return nil, ctl.Errorf(ctl.CodeNotFound, "no export %s", r.PathValue("name"))
		}
		return rows, nil
	})
	h("POST /v1/exports", func(r *http.Request) (any, error) {
		var req MapRequest
		if err := ctl.Decode(r, &req); err != nil {
			return nil, err
		}
		e, err := req.Export()
		if err != nil {
			return nil, ctl.Errorf(ctl.CodeInvalid, "%v", err)
		}
		return nil, d.Map(e)
	})
	h("POST /v1/exports/{name}/resize", func(r *http.Request) (any, error) {
		var req ResizeRequest
		if err := ctl.Decode(r, &req); err != nil {
			return nil, err
		}
		n, err := units.ParseSize(req.Size)
		if err != nil {
			return nil, ctl.Errorf(ctl.CodeInvalid, "size %q: %v", req.Size, err)
		}
		was, err := d.rnbd.Resize(r.PathValue("name"), n, req.Force)
		if err != nil {
			return nil, err
		}
		return ResizeResponse{Was: was, Now: n}, nil
	})
	h("DELETE /v1/exports/{name}", func(r *http.Request) (any, error) {
		return nil, d.Unmap(r.PathValue("name"), r.URL.Query().Get("force") == "true")
	})
	h("GET /v1/sessions", func(r *http.Request) (any, error) { return d.sessions(""), nil })
	h("GET /v1/sessions/{name}", func(r *http.Request) (any, error) {
		rows := d.sessions(r.PathValue("name"))
		if len(rows) == 0 {
			return nil, ctl.Errorf(ctl.CodeNotFound, "no session %s", r.PathValue("name"))
		}
		return rows, nil
	})
	h("POST /v1/sessions/{name}/disconnect", func(r *http.Request) (any, error) {
		x := d.findSession(r.PathValue("name"))
		if x == nil {
			return nil, ctl.Errorf(ctl.CodeNotFound, "no session %s", r.PathValue("name"))
		}
		for _, p := range x.Paths() {
			p.Disconnect()
		}
		return nil, nil
	})
	h("GET /v1/session-names", func(r *http.Request) (any, error) {
		rows := []output.Record{}
		for _, o := range d.rnbd.SessionOwners() {
			rows = append(rows, output.Record{"sessname": o.Name, "identity": o.Identity})
		}
		return rows, nil
	})
	h("PUT /v1/session-names/{name}", func(r *http.Request) (any, error) {
		var req BindRequest
		if err := ctl.Decode(r, &req); err != nil {
			return nil, err
		}
		d.stateMu.Lock()
		defer d.stateMu.Unlock()
		n, err := d.rnbd.BindSessionName(r.PathValue("name"), req.Identity)
		if err != nil {
			return nil, err
		}
		if err := d.saveState(); err != nil {
			return nil, fmt.Errorf("name bound, but saving the state file failed: %w", err)
		}
		return BindResponse{Disconnected: n}, nil
	})
	h("DELETE /v1/session-names/{name}", func(r *http.Request) (any, error) {
		d.stateMu.Lock()
		defer d.stateMu.Unlock()
		if _, err := d.rnbd.ForgetSessionName(r.PathValue("name")); err != nil {
			return nil, err
		}
		if err := d.saveState(); err != nil {
			return nil, fmt.Errorf("name freed, but saving the state file failed: %w", err)
		}
		return nil, nil
	})
	h("GET /v1/paths", func(r *http.Request) (any, error) { return d.paths("", r.URL.Query().Get("session")), nil })
	h("GET /v1/paths/{name}", func(r *http.Request) (any, error) {
		found, err := d.lookupPaths(r.PathValue("name"), r.URL.Query().Get("session"))
		if err != nil {
			return nil, err
		}
		rows := []output.Record{}
		for _, p := range found {
			rows = append(rows, pathRecord(p))
		}
		return rows, nil
	})
	h("POST /v1/paths/{name}/disconnect", func(r *http.Request) (any, error) {
		p, err := d.findPath(r.PathValue("name"), r.URL.Query().Get("session"))
		if err != nil {
			return nil, err
		}
		p.Disconnect()
		return nil, nil
	})
	h("GET /v1/stats", func(r *http.Request) (any, error) { return d.stats(), nil })
	h("POST /v1/stats/reset", func(r *http.Request) (any, error) {
		for _, x := range d.rtrs.Sessions() {
			for _, p := range x.Paths() {
				p.Stats().Reset()
			}
		}
		return nil, nil
	})
}

// Map adds an export and saves the state; if saving fails the export is
// withdrawn again, so the daemon never serves what a restart would lose.
func (d *Daemon) Map(e rnbd.Export) error {
	if d.configured[e.Name] { // set at start, never changed
		return fmt.Errorf("export %s is one of the configuration file's: change it there: %w", e.Name, syscall.EEXIST)
	}
	// Looked at first, without the state lock: a path that does not
	// answer fails this map, not every other map and unmap with it.
	looked := d.probe.look([]string{e.Path}, probeWait)
	// A read-write export no session could open read-write (the unit's
	// sandbox) is refused here, not at every client's OPEN.
	if err := selfView.readOnly(e, looked[e.Path]); err != nil {
		return err
	}
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	if err := d.mapLooked(e, looked); err != nil {
		return err
	}
	if err := d.saveState(); err != nil {
		d.rnbd.Unmap(e.Name, true)
		return fmt.Errorf("saving the state file: %w", err)
	}
	d.dropUnrestored(e.Name) // served now, as given
	d.log.WithFields(exportFields(e)).WithField("write_cache", d.exportCache(e)).Info("export mapped")
	return nil
}

// exportFields are the log fields of an export.
func exportFields(e rnbd.Export) log.Fields {
	return log.Fields{"export": e.Name, "path": e.Path, "read_only": e.ReadOnly, "allow": e.Allow,
		"allow_from": e.AllowFrom, "allow_identities": e.AllowIdentities, "migration": e.Migration, "max_sessions": e.MaxSessions,
		"write_through": e.WriteThrough}
}

// Unmap withdraws an export and saves the state.
func (d *Daemon) Unmap(name string, force bool) error {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	if d.configured[name] {
		return fmt.Errorf("export %s is one of the configuration file's: remove it there and restart: %w", name, syscall.EPERM)
	}
	if err := d.rnbd.Unmap(name, force); err != nil {
		if !errors.Is(err, syscall.ENOENT) || !d.dropUnrestored(name) {
			return err
		}
		// An export of the state file that is not served: unmapping
		// removes it from the file.
	}
	if err := d.saveState(); err != nil {
		return fmt.Errorf("export withdrawn, but saving the state file failed: %w", err)
	}
	d.log.WithFields(log.Fields{"export": name, "force": force}).Info("export unmapped")
	return nil
}

func (d *Daemon) devices(name string) []output.Record {
	rows := []output.Record{}
	open := map[string]bool{}
	exports := map[string]rnbd.Export{}
	for _, e := range d.rnbd.Exports() {
		exports[e.Name] = e
	}
	for _, o := range d.rnbd.OpenDevices() {
		devname := o.Export
		rules := d.searchRules()
		if e, ok := exports[o.Export]; ok {
			rules = exportRules(e)
		}
		if o.Export == "" {
			devname = o.Name
		} else {
			open[o.Export] = true
		}
		if name != "" && devname != name && o.Name != name {
			continue
		}
		rows = append(rows, withRules(output.Record{
			"devname": devname, "devpath": o.Path, "sessname": o.Session, "mapping_path": o.Name,
			"access_mode": o.AccessMode.String(), "read_only": o.ReadOnly, "device_id": o.DeviceID,
			"state": "open", "write_cache": writeCache(o.WriteCache), "rx_sect": o.WrittenSectors, "tx_sect": o.ReadSectors, "flush_cnt": o.Flushes,
			"fua_cnt": o.FUAWrites, "discard_cnt": o.Discards, "wzero_cnt": o.WriteZeroes, "source": d.source(o.Export),
			"direction": "server", "reason": "",
		}, rules))
	}
	for _, e := range d.rnbd.Exports() {
		if open[e.Name] || (name != "" && e.Name != name) {
			continue
		}
		rows = append(rows, withRules(output.Record{
			"devname": e.Name, "devpath": e.Path, "sessname": "", "mapping_path": "",
			"access_mode": "", "read_only": e.ReadOnly, "device_id": nil,
			"state": "exported", "write_cache": d.exportCache(e), "rx_sect": 0, "tx_sect": 0, "flush_cnt": 0, "fua_cnt": 0, "discard_cnt": 0,
			"wzero_cnt": 0, "source": d.source(e.Name), "direction": "server", "reason": "",
		}, exportRules(e)))
	}
	for _, x := range d.unserved() {
		e := x.Export
		if name != "" && e.Name != name {
			continue
		}
		rows = append(rows, withRules(output.Record{
			"devname": e.Name, "devpath": e.Path, "sessname": "", "mapping_path": "",
			"access_mode": "", "read_only": e.ReadOnly, "device_id": nil,
			"state": "not served", "write_cache": "", "rx_sect": 0, "tx_sect": 0, "flush_cnt": 0, "fua_cnt": 0, "discard_cnt": 0,
			"wzero_cnt": 0, "source": x.Source, "direction": "server", "reason": x.NotServed,
		}, exportRules(e)))
	}
	sort.SliceStable(rows, func(i, j int) bool { return rows[i]["devname"].(string) < rows[j]["devname"].(string) })
	return rows
}

// exports are the export records: the exports served, then those not
// served (by name if given).
func (d *Daemon) exports(name string) []output.Record {
	rows := []output.Record{}
	for _, e := range d.rnbd.Exports() {
		if name == "" || e.Name == name {
			rows = append(rows, exportRecord(ExportRecord{Export: e, Source: d.source(e.Name)}))
		}
	}
	for _, x := range d.unserved() {
		if name == "" || x.Name == name {
			rows = append(rows, exportRecord(x))
		}
	}
	return rows
}

// exportRecord is an export as GET /v1/exports gives it: its rules,
// where it comes from, and why it is not served ("" if it is).
func exportRecord(x ExportRecord) output.Record {
	return withRules(output.Record{"name": x.Name, "path": x.Path, "read_only": x.ReadOnly,
		"source": x.Source, "not_served": x.NotServed}, exportRules(x.Export))
}

// rules are who may open a device, as the records give them (the
// access rules of docs/server.md).
type rules struct {
	allow, allowFrom []string
	identities       output.Object
	maxSessions      any // a number, or nil: no bound
	migration        bool
	writeThrough     bool
}

// withRules adds the rules' fields to a record.
func withRules(r output.Record, x rules) output.Record {
	r["allow"], r["allow_from"], r["allow_identities"] = x.allow, x.allowFrom, x.identities
	r["max_sessions"], r["migration"], r["write_through"] = x.maxSessions, x.migration, x.writeThrough
	return r
}

// exportRules are an export's rules: session names (none: any), networks
// (none: any), identities with the most each may open it for (none:
// any), the bound on sessions.
func exportRules(e rnbd.Export) rules {
	x := rules{allow: []string{}, allowFrom: []string{}, identities: grantsObject(e.AllowIdentities),
		migration: e.Migration, writeThrough: e.WriteThrough}
	x.allow = append(x.allow, e.Allow...)
	for _, p := range e.AllowFrom {
		x.allowFrom = append(x.allowFrom, p.String())
	}
	if e.MaxSessions > 0 {
		x.maxSessions = e.MaxSessions
	}
	return x
}

// searchRules are the rules of a device opened under dev_search_path.
func (d *Daemon) searchRules() rules {
	from, _ := parseNetworks(d.cfg.SearchAllowFrom)    // validated
	ids, _ := parseGrants(d.cfg.SearchAllowIdentities) // validated
	return exportRules(rnbd.Export{AllowFrom: from, AllowIdentities: ids, Migration: d.cfg.AllowMigration})
}

// grantsObject is allow_identities as an object: each identity and the
// most it may open the export for (of several grants of one identity
// the widest, the one that counts).
func grantsObject(gs []rnbd.Grant) output.Object {
	o := output.Object{}
	for _, g := range gs {
		acc, _ := rnbd.ParseAccessMode(g.Access)
		i := slices.IndexFunc(o, func(m output.Member) bool { return m.Key == g.Identity })
		if i < 0 {
			o = append(o, output.Member{Key: g.Identity, Value: g.Access})
			continue
		}
		if was, _ := rnbd.ParseAccessMode(o[i].Value.(string)); accessRank(acc) > accessRank(was) {
			o[i].Value = g.Access
		}
	}
	return o
}

// accessRank orders access modes by what they allow: ro, rw, migration.
func accessRank(m rnbd.AccessMode) int {
	switch m {
	case rnbd.AccessRO:
		return 0
	case rnbd.AccessRW:
		return 1
	}
	return 2
}

// source says where a device comes from: "config" (an [[export]] of
// the configuration file), "map", or "search" (dev_search_path) for a
// device of no export.
func (d *Daemon) source(export string) string {
	switch {
	case export == "":
		return "search"
	case d.configured[export]:
		return "config"
	}
	return "map"
}

// writeCache names a cache policy as the kernel's queue/write_cache does.
func writeCache(on bool) string {
	if on {
		return "write back"
	}
	return "write through"
}

// exportCache is the cache policy an export not open will announce when
// it is: known but for a block device opened with O_DIRECT, which
// announces its own ("device").
func (d *Daemon) exportCache(e rnbd.Export) string {
	if e.WriteThrough || !d.cfg.DirectIO {
		return writeCache(!e.WriteThrough)
	}
	if st, err := d.probe.stat(e.Path); err == nil && st.Mode()&fs.ModeDevice != 0 {
		return "device"
	}
	return writeCache(true)
}

func (d *Daemon) findSession(name string) *rtrs.SrvSession {
	for _, x := range d.rtrs.Sessions() {
		if x.Name() == name {
			return x
		}
	}
	return nil
}

func (d *Daemon) sessions(name string) []output.Record {
	devs := map[string]int{}
	for _, o := range d.rnbd.OpenDevices() {
		devs[o.Session]++
	}
	rows := []output.Record{}
	for _, x := range d.rtrs.Sessions() {
		if name != "" && x.Name() != name {
			continue
		}
		var up int
		var uu strings.Builder
		var rx, tx uint64
		var inflight int64
		paths := x.Paths()
		for _, p := range paths {
			c := p.Stats().Counters()
			rx, tx, inflight = rx+c.WriteBytes, tx+c.ReadBytes, inflight+c.Inflight
			if p.State() == rtrs.SrvPathConnected {
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
		rows = append(rows, output.Record{
			"sessname": x.Name(), "path_cnt": len(paths), "act_path_cnt": up, "state": state,
			"path_uu": uu.String(), "rx_bytes": rx, "tx_bytes": tx, "inflights": inflight,
			"devices": devs[x.Name()], "peer": x.Identity(), "direction": "server",
		})
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i]["sessname"].(string) < rows[j]["sessname"].(string) })
	return rows
}

func pathRecord(p *rtrs.SrvPath) output.Record {
	c := p.Stats().Counters()
	return output.Record{
		"sessname": p.Session().Name(), "pathname": p.Name(),
		"src_addr": rtrs.FormatAddr(p.ClientAddr().Addr(), false), "dst_addr": rtrs.FormatAddr(p.ServerAddr().Addr(), false),
		"hca_name": p.HCAName(), "hca_port": p.HCAPort(), "state": p.State().SysfsString(),
		"rx_bytes": c.WriteBytes, "tx_bytes": c.ReadBytes, "inflights": c.Inflight, "direction": "server",
	}
}

func (d *Daemon) paths(name, session string) []output.Record {
	rows := []output.Record{}
	for _, x := range d.rtrs.Sessions() {
		if session != "" && x.Name() != session {
			continue
		}
		for _, p := range x.Paths() {
			if name == "" || p.Name() == name {
				rows = append(rows, pathRecord(p))
			}
		}
	}
	sort.Slice(rows, func(i, j int) bool {
		a, b := rows[i], rows[j]
		if a["sessname"] != b["sessname"] {
			return a["sessname"].(string) < b["sessname"].(string)
		}
		return a["pathname"].(string) < b["pathname"].(string)
	})
	return rows
}

// lookupPaths finds the paths a name as typed names, within session if
// given: their name, or the same written another way
// (rtrs.MatchPathName), sorted by session and name.
func (d *Daemon) lookupPaths(name, session string) ([]*rtrs.SrvPath, error) {
	var all []*rtrs.SrvPath
	for _, x := range d.rtrs.Sessions() {
		if session == "" || x.Name() == session {
			all = append(all, x.Paths()...)
		}
	}
	found, err := ctl.Lookup("path", name, all, (*rtrs.SrvPath).Name, func(p *rtrs.SrvPath) bool {
		return rtrs.MatchPathName(name, p.ClientAddr().Addr(), p.ServerAddr().Addr())
	})
	sort.Slice(found, func(i, j int) bool {
		a, b := found[i], found[j]
		if a.Session().Name() != b.Session().Name() {
			return a.Session().Name() < b.Session().Name()
		}
		return a.Name() < b.Name()
	})
	return found, err
}

// findPath is the one path a name as typed names (lookupPaths); a name
// that several sessions' paths share needs the session.
func (d *Daemon) findPath(name, session string) (*rtrs.SrvPath, error) {
	found, err := d.lookupPaths(name, session)
	if err != nil {
		return nil, err
	}
	return ctl.One("path", name, found, (*rtrs.SrvPath).Name, func(p *rtrs.SrvPath) string { return p.Session().Name() })
}

func (d *Daemon) stats() []output.Record {
	rows := []output.Record{}
	for _, x := range d.rtrs.Sessions() {
		for _, p := range x.Paths() {
			c := p.Stats().Counters()
			rows = append(rows, output.Record{
				"sessname": x.Name(), "pathname": p.Name(),
				// The kernel server's stats/rdma, "rd_cnt rd_bytes
				// wr_cnt wr_bytes", by name.
				"rdma": output.Object{{Key: "rd_cnt", Value: c.ReadCount}, {Key: "rd_bytes", Value: c.ReadBytes},
					{Key: "wr_cnt", Value: c.WriteCount}, {Key: "wr_bytes", Value: c.WriteBytes}},
				"inflights": p.Stats().Inflight(),
			})
		}
	}
	sort.Slice(rows, func(i, j int) bool {
		a, b := rows[i], rows[j]
		if a["sessname"] != b["sessname"] {
			return a["sessname"].(string) < b["sessname"].(string)
		}
		return a["pathname"].(string) < b["pathname"].(string)
	})
	return rows
}

// Export is the export r describes, its networks and grants parsed.
func (r MapRequest) Export() (rnbd.Export, error) {
	from, err := parseNetworks(r.AllowFrom)
	if err != nil {
		return rnbd.Export{}, err
	}
	grants, err := parseGrants(r.AllowIdentities)
	if err != nil {
		return rnbd.Export{}, err
	}
	return rnbd.Export{Name: r.Name, Path: r.Path, ReadOnly: r.ReadOnly, Allow: r.Allow, AllowFrom: from,
		AllowIdentities: grants, Migration: r.Migration, MaxSessions: r.MaxSessions, WriteThrough: r.WriteThrough}, nil
}

// parseNetworks reads allow_from: CIDR prefixes or addresses.
func parseNetworks(ss []string) ([]netip.Prefix, error) {
	var from []netip.Prefix
	for _, s := range ss {
		p, err := parseNetwork(s)
		if err != nil {
			return nil, fmt.Errorf("allow_from %q: %v", s, err)
		}
		from = append(from, p)
	}
	return from, nil
}

// parseGrants reads allow_identities: NAME or NAME=ro|rw|migration.
func parseGrants(ss []string) ([]rnbd.Grant, error) {
	var grants []rnbd.Grant
	for _, s := range ss {
		g, err := rnbd.ParseGrant(s)
		if err != nil {
			return nil, fmt.Errorf("allow_identities: %v", err)
		}
		grants = append(grants, g)
	}
	return grants, nil
}

// parseNetwork reads a CIDR prefix, or a bare address as a prefix of
// its whole length.
func parseNetwork(s string) (netip.Prefix, error) {
	if p, err := netip.ParsePrefix(s); err == nil {
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, errors.New("want an address or a network like 10.0.0.0/24")
	}
	return netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()), nil
}
