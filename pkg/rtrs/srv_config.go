package rtrs

import (
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Configuration of a server: SrvConfig, its endpoints, and the
// defaults (the kernel module's where it has them; the bounds on what
// clients may make the server hold are this server's own).

// SrvConfig configures a Server. Start from DefaultSrvConfig.
type SrvConfig struct {
	// Fabric carries the paths accepted on the Listen addresses.
	Fabric fabric.Fabric
	// Listen are the addresses to accept paths on.
	Listen []netip.AddrPort
	// Endpoints are more addresses, each on a fabric of its own (RDMA
	// beside TCP). A path lives on the fabric it was accepted on.
	Endpoints []Endpoint
	// QueueDepth is the number of chunks per session (sess_queue_depth).
	QueueDepth int
	// MaxChunkSize is the size of a chunk, a power of two >= 8 KiB; the
	// largest IO is MaxChunkSize - MaxHdrSize.
	MaxChunkSize int
	// AlwaysInvalidate revokes a chunk's rkey while the server works on
	// it and sends the client a new one with each response.
	AlwaysInvalidate bool
	// InvalidateByRegistration does always_invalidate by deregistering
	// and registering each chunk (two system calls per IO) even where
	// the fabric has memory windows (bound and unbound by work requests,
	// fabric.WindowMR), which it otherwise uses.
	InvalidateByRegistration bool
	HBInterval               time.Duration
	HBMissedMax              int
	// ConnectTimeout closes a path that does not finish connecting.
	ConnectTimeout time.Duration
	// MaxSessions bounds the sessions the server keeps.
	MaxSessions int
	// MaxChunkMemory bounds the memory of all paths together: each
	// path's chunks (QueueDepth × MaxChunkSize bytes) and their
	// structures, and the buffers of the connections it asked for (what
	// its fabric says one costs): a path that would pass it is refused
	// with ENOMEM. 0 means no bound. See srv_mem.go.
	MaxChunkMemory int64
	// GoMemoryLimit keeps the Go runtime's soft memory limit
	// (runtime/debug.SetMemoryLimit) at GoHeapMargin plus the part of
	// what the paths hold that lives on the Go heap, so that the
	// garbage of paths that came and went is collected before the
	// process passes MaxChunkMemory. For a process that runs one server
	// (rnbd-server); nothing without MaxChunkMemory.
	GoMemoryLimit bool
	// MaxChunkMemoryPerClient bounds what the paths of one client (one
	// identity, else one address, as MaxSessionsPerClient counts) may
	// hold of MaxChunkMemory together: a path that would pass it is
	// refused with ENOMEM, so one client cannot take the memory the
	// others need. 0 means no bound of its own.
	MaxChunkMemoryPerClient int64
	// MaxConnectingPerAddr bounds the paths one client address (fabric.PeerGroup)
	// may have connecting at once (accepted, not yet
	// through INFO_REQ), each
	// holding its share of MaxChunkMemory until ConnectTimeout: more
	// are refused with EBUSY, and the client retries. 0 means no bound.
	MaxConnectingPerAddr int
	// NewPathRate bounds how fast one client makes new paths, per
	// second, after a burst of NewPathBurst: of one address, and of one
	// identity where the fabric authenticates peers. A path past it is
	// refused with EAGAIN and its client retries. Each new path costs
	// the server a connection and a place in its budget until it proves
	// itself or times out. 0 means no bound.
	NewPathRate  float64
	NewPathBurst int
	// MaxSessionsPerClient bounds the sessions of one client: of one
	// identity where the fabric authenticates peers (TLS certificates),
	// else of one address. One more is refused with EUSERS, so a client
	// cannot take every session, or the chunk memory, from the others.
	// 0 means no bound.
	MaxSessionsPerClient int
	Handler              SrvHandler
	Log                  *log.Entry
}

// Endpoint is an address to accept paths on, on a fabric.
type Endpoint struct {
	Fabric fabric.Fabric
	Addr   netip.AddrPort
	// Optional: if the fabric cannot work here (fabric.ErrNotSupported:
	// no RDMA device), the server goes on without this endpoint.
	Optional bool
}

// DefaultMaxChunkMemory is a quarter of the machine's memory, at most
// 8 GiB (128 paths of the default 512 × 128 KiB chunks): what peers can
// make the server hold stays a part of what it has.
func DefaultMaxChunkMemory() int64 {
	const most = 8 << 30
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil || si.Totalram == 0 {
		return most
	}
	return min(most, int64(si.Totalram)*int64(si.Unit)/4)
}

// DefaultClientMemoryShare is the part of MaxChunkMemory one client may
// hold by default: a quarter (DefaultMaxChunkMemoryPerClient).
const DefaultClientMemoryShare = 4

// DefaultClientPaths is how many paths one client may hold by default
// however small the budget: a client with a few sessions of two paths.
const DefaultClientPaths = 8

// DefaultMaxChunkMemoryPerClient is what one client may hold of cfg's
// MaxChunkMemory by default: a quarter of it (2 GiB of the largest
// default budget, about 29 paths of the default 512 × 128 KiB chunks),
// but at least DefaultClientPaths paths of cfg's chunks with a
// connection per CPU and the service one, and at most all of it. On a
// machine whose budget holds few paths there is no share to keep.
func DefaultMaxChunkMemoryPerClient(cfg *SrvConfig) int64 {
	total := cfg.MaxChunkMemory
	if total <= 0 {
		return 0
	}
	one, _ := pathFootprint(cfg, nil, cfg.QueueDepth, cfg.MaxChunkSize, runtime.NumCPU()+1)
	paths := DefaultClientPaths * one
	return min(total, max(total/DefaultClientMemoryShare, paths))
}

// DefaultMaxConnectingPerAddr lets a client host bring up 8 paths at
// once; a legitimate client connects a path's connections one after the
// other and sends INFO_REQ at once, so its paths are connecting for
// milliseconds.
const DefaultMaxConnectingPerAddr = 8

// DefaultNewPathRate and DefaultNewPathBurst: a client host (or
// identity) may bring up 32 paths at once — 16 sessions of two paths
// after its daemon restarted — and 8 a second after that.
const (
	DefaultNewPathRate  = 8
	DefaultNewPathBurst = 32
)

// DefaultMaxSessionsPerClient: a client host has a session per server
// (or per group of devices) it maps from; 64 of them on one server is
// more than any legitimate one makes.
const DefaultMaxSessionsPerClient = 64

// DefaultSrvConfig returns the kernel module's defaults.
func DefaultSrvConfig() SrvConfig {
	c := SrvConfig{
		QueueDepth:           DefaultQueueDepth,
		MaxChunkSize:         DefaultMaxChunkSize,
		AlwaysInvalidate:     true,
		HBInterval:           DefaultHBInterval,
		HBMissedMax:          DefaultHBMissedMax,
		ConnectTimeout:       DefaultConnectTimeout,
		MaxSessions:          1024,
		MaxConnectingPerAddr: DefaultMaxConnectingPerAddr,
		MaxSessionsPerClient: DefaultMaxSessionsPerClient,
		NewPathRate:          DefaultNewPathRate,
		NewPathBurst:         DefaultNewPathBurst,
	}
	c.MaxChunkMemory = DefaultMaxChunkMemory()
	c.MaxChunkMemoryPerClient = DefaultMaxChunkMemoryPerClient(&c)
	return c
}

func (c *SrvConfig) validate() error {
	if c.Handler == nil || (c.Fabric == nil && len(c.Listen) > 0) || (len(c.Listen) == 0 && len(c.Endpoints) == 0 && c.Fabric == nil) {
		return errors.New("rtrs: server needs a fabric and a handler")
	}
	for _, e := range c.Endpoints {
		if e.Fabric == nil {
			return errors.New("rtrs: server endpoint without a fabric")
		}
	}
	if c.QueueDepth < 1 || c.QueueDepth > MaxSessQueueDepth {
		return fmt.Errorf("rtrs: queue depth %d, want 1..%d", c.QueueDepth, MaxSessQueueDepth)
	}
	if c.MaxChunkSize < MinChunkSize || c.MaxChunkSize&(c.MaxChunkSize-1) != 0 {
		return fmt.Errorf("rtrs: max chunk size %d, want a power of two >= %d", c.MaxChunkSize, MinChunkSize)
	}
	if err := CheckImmBudget(uint32(c.QueueDepth), uint32(c.MaxChunkSize)); err != nil {
		return err
	}
	if c.HBInterval <= 0 || c.HBMissedMax < 0 || c.ConnectTimeout <= 0 || c.MaxSessions < 1 || c.MaxChunkMemory < 0 || c.MaxChunkMemoryPerClient < 0 || c.MaxConnectingPerAddr < 0 || c.MaxSessionsPerClient < 0 ||
		c.NewPathRate < 0 || c.NewPathBurst < 0 || (c.NewPathRate > 0 && c.NewPathBurst < 1) {
		return errors.New("rtrs: bad heartbeat, timeout or session limit")
	}
	if c.Log == nil {
		c.Log = log.L
	}
	return nil
}
