// The life of the daemon: Start, what it warns about at start-up, Stop.

package serverd

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/metrics"
	"github.com/rnbd/rnbd/internal/pool"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/rdma"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// Daemon is a running rnbd-server. It is safe for concurrent use: the
// control API's requests, metrics scrapes, saveOwners and retryLoop run
// at once, and Stop may be called more than once.
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
	// +checklocks:stateMu
	unrestored []rnbd.Export
	// configured are the names of the configuration file's exports:
	// never saved in the state file, never mapped or unmapped.
	configured map[string]bool
	// configPending are the configuration file's exports that could not
	// be served (a device not there yet, a file not readable): the
	// others are served, and these are tried again every retryEvery, as
	// are the unrestored ones. notServed says why, by name. stateMu.
	// +checklocks:stateMu
	configPending []rnbd.Export
	// +checklocks:stateMu
	notServed  map[string]string
	retryEvery time.Duration
	served     chan error
	metrics    *metrics.Server // nil without metrics_listen
	// ownersDirty asks saveOwners to save the state file: a session
	// name was bound. stopOwners and ownersDone end saveOwners.
	ownersDirty chan struct{}
	stopOwners  chan struct{}
	ownersDone  chan struct{}
	// retryCtx ends with stopRetry, which ends retryLoop (which tries
	// the exports and pools not served again); retryDone says it did.
	retryCtx  context.Context
	stopRetry context.CancelFunc
	retryDone chan struct{}
	// probe looks at export paths before they are mapped, so that one
	// on a mount that does not answer holds nothing.
	probe pathProbe
	// pools are the configuration's pools served, poolErrs why the
	// others are not (retryPools tries them again).
	// +checklocks:stateMu
	pools map[string]pool.Pool
	// +checklocks:stateMu
	poolErrs map[string]string
	// openPoolFn is Options.OpenPool.
	openPoolFn func(PoolConfig) (pool.Pool, []string, error)
	// volumes are the volumes of the pools and of the state file, by
	// name; volumeNames their names, for isVolume without stateMu.
	// +checklocks:stateMu
	volumes     map[string]*volume
	volumeNames atomic.Pointer[map[string]bool]
	// names are the volume and snapshot names with a change under way;
	// nameWait how long another change of one waits for it (names.go).
	names    nameLocks
	nameWait time.Duration
	// crashAt is CrashEnv's point, "" but in tests.
	crashAt string
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
	// (rtrs.SrvConfig.GoMemoryLimit).
	GoMemoryLimit bool
	// OpenPool opens a [[pool]] table in place of the pool package's
	// OpenDir and OpenLVMThin: the tests' seam for a pool that is slow
	// on purpose. nil (the daemon's): the pool package's.
	OpenPool func(PoolConfig) (pool.Pool, []string, error)
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
	f, err := cfg.TLS.Fabric(opts.Fabric, cfg.TCPUserTimeout, tcp.Options{AllowAnonymousClients: cfg.TLS.AllowAnonymousClients, Log: opts.Log})
	if err != nil {
		return nil, err
	}
	opts.Fabric = f
	d := &Daemon{cfg: cfg, log: opts.Log, served: make(chan error, 1), retryEvery: cfg.ExportRetry.Duration,
		ownersDirty: make(chan struct{}, 1), stopOwners: make(chan struct{}), ownersDone: make(chan struct{}),
		retryDone: make(chan struct{}), crashAt: os.Getenv(CrashEnv), openPoolFn: opts.OpenPool, nameWait: nameWait}
	d.retryCtx, d.stopRetry = context.WithCancel(context.Background())
	eps, err := endpoints(cfg.Listen, opts)
	if err != nil {
		return nil, err
	}
	searchFrom, _ := parseNetworks(cfg.SearchAllowFrom)    // validated
	searchIDs, _ := parseGrants(cfg.SearchAllowIdentities) // validated
	d.rnbd = rnbd.NewServer(rnbd.SrvConfig{
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
	d.serveAtStart(cfg, st)
	d.startPools(d.retryCtx, st.Volumes)
	if d.ctl, err = ctl.Listen(cfg.ControlSocket); err != nil {
		d.rnbd.Close()
		return nil, err
	}
	if err = d.listenAdmin(); err != nil {
		d.ctl.Close()
		d.rnbd.Close()
		return nil, err
	}
	rcfg := rtrs.DefaultSrvConfig()
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
		"exports": len(d.rnbd.Exports()), "not_served": len(d.unserved()), "pools": len(d.servedPools()), "volumes": d.volumeCount(), "dev_search_path": cfg.DevSearchPath, "tls": cfg.TLS.Enabled(),
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

// serveAtStart serves the exports of the configuration file, then those
// the state file kept; what cannot be served yet is tried again later
// (retryLoop). Start calls it before d is shared.
// +checklocksignore: d is not shared yet (Start)
func (d *Daemon) serveAtStart(cfg Config, st *State) {
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
		e, _ := exportOf(r) // validated
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
}

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
	d.rnbd.EndHolds() // the writes held run: the RTRS close waits for their answers
	d.rtrs.Close()
	d.stopRetry()
	select {
	case <-d.retryDone:
	case <-time.After(retryStopWait):
		// Every stat of a retry is bounded (probeWait), but a retry
		// may look at many paths, one after another, and open a pool
		// (lvm2's commands): the stop does not wait for it all.
		d.log.Warn("stopping while a retry of exports or pools not served is under way")
	}
	close(d.stopOwners)
	<-d.ownersDone
	d.rnbd.Close()
	err := d.ctl.Close()
	<-d.served
	d.log.Info("rnbd-server stopped")
	return err
}
