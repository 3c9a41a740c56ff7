// Package rdma is the RDMA fabric: the reliable-connection contract of
// package fabric on verbs (pkg/ibverbs), wire-compatible with the kernel's
// RTRS. Connections are RC queue pairs set up through rdma_cm in the TCP
// port space, the RTRS conn_req/conn_rsp travelling as the CM's private
// data; writes, writes with immediate and sends are the verbs operations
// themselves, so what reaches the peer is what the kernel's RTRS sends.
//
// Each connection has its own completion queue, completion channel and
// rdma_cm event channel, waited on in Go's poller by two goroutines: one
// polls the CQ in batches and delivers completions (sends and receives
// alike, each in order), the other turns CM events (disconnect, device
// removal, address change) into Handler.Disconnected at once, without
// waiting for a heartbeat.
//
// Userspace verbs have no fast registration (FRWR): a memory region whose
// remote access is revoked (MR.Invalidate) is deregistered, and
// Reregister registers it again under a new rkey. Local access goes
// through a second, local-only registration that never changes, the way
// the kernel uses its PD's local DMA key.
//
// Every object is safe for concurrent use, as package fabric's contract
// wants. Lock order (outermost first):
//
//	conn.closeOnce (Close: it waits for the connection's goroutines)
//	conn.heldMu
//	  ibverbs.QP's send lock (postHeld posts under heldMu)
//	mr.mu
//	  ibverbs' node and tracker locks (registrations are made and
//	  dropped under mu)
//
// conn.heldMu and mr.mu are never held together, and no handler is
// called under either: the poll loop ends a burst (BurstEnd) before it
// takes heldMu, and a connection fails (Handler.Disconnected) with no
// lock held.
//
// Which fields each lock guards, and which functions run with it held,
// are +checklocks annotations, checked by gVisor's checklocks analyzer
// in make vet; the order above is not.
package rdma

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/rnbd/rnbd/pkg/ibverbs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Options configure a Fabric. The zero value is usable.
type Options struct {
	// ResolveTimeout bounds address and route resolution (the kernel's
	// RTRS_CONNECT_TIMEOUT_MS, 30 s).
	ResolveTimeout time.Duration
	// Backlog is the listen backlog (64, as rtrs-srv).
	Backlog int
}

// Fabric is the RDMA fabric. It is safe for concurrent use.
type Fabric struct {
	opts Options
}

// New returns an RDMA fabric. It fails with an error wrapping
// fabric.ErrNotSupported where this build or machine cannot do RDMA.
func New(opts Options) (*Fabric, error) {
	if !ibverbs.Supported {
		return nil, fmt.Errorf("%w: built without cgo", fabric.ErrNotSupported)
	}
	if opts.ResolveTimeout <= 0 {
		opts.ResolveTimeout = 30 * time.Second
	}
	if opts.Backlog <= 0 {
		opts.Backlog = 64
	}
	return &Fabric{opts: opts}, nil
}

var _ fabric.Fabric = (*Fabric)(nil)

func (f *Fabric) Name() string { return "rdma" }

func notSupported(err error) error {
	if errors.Is(err, ibverbs.ErrNotSupported) && !errors.Is(err, fabric.ErrNotSupported) {
		return fmt.Errorf("%w: %w", fabric.ErrNotSupported, err)
	}
	return err
}

// Resolve finds the device through which dst is reached from src: an
// rdma_cm address resolution (ENODEV for an address without an RDMA
// device: rdma_cm does not work over lo).
func (f *Fabric) Resolve(ctx context.Context, src, dst netip.AddrPort) (fabric.Device, error) {
	ch, err := ibverbs.NewEventChannel()
	if err != nil {
		return nil, notSupported(err)
	}
	defer ch.Close()
	id, err := ch.CreateID(ibverbs.PortSpaceTCP)
	if err != nil {
		return nil, err
	}
	if err := id.ResolveAddr(src, dst, int(f.opts.ResolveTimeout/time.Millisecond)); err != nil {
		return nil, notSupported(err)
	}
	if _, err := expect(ctx, ch, ibverbs.EventAddrResolved); err != nil {
		return nil, fmt.Errorf("rdma fabric: resolve %v: %w", dst, err)
	}
	x := id.Context()
	if x == nil {
		return nil, fmt.Errorf("rdma fabric: %v resolves to no RDMA device: %w", dst, fabric.ErrNotSupported)
	}
	return &device{f: f, x: x, port: id.Port()}, nil
}

// device is an HCA port.
type device struct {
	f    *Fabric
	x    *ibverbs.Context
	port int
}

func (d *device) Name() string { return d.x.Name() }
func (d *device) Port() int    { return d.port }

func (d *device) AllocPD() (fabric.PD, error) {
	p, err := d.x.AllocPD()
	if err != nil {
		return nil, err
	}
	return &pd{dev: d, p: p}, nil
}
