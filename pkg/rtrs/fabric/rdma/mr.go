// Protection domains and memory regions: a region's remote registration
// dropped and made again under a new rkey (Invalidate, Reregister), and
// type 1 memory windows (windowMR) where the device has them.

package rdma

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/rnbd/rnbd/pkg/ibverbs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// pd is a protection domain.
type pd struct {
	dev *device
	p   *ibverbs.PD
}

func verbsAccess(a fabric.Access) ibverbs.Access {
	var v ibverbs.Access
	if a&fabric.AccessLocalWrite != 0 {
		v |= ibverbs.AccessLocalWrite
	}
	if a&fabric.AccessRemoteWrite != 0 {
		v |= ibverbs.AccessRemoteWrite | ibverbs.AccessLocalWrite
	}
	if a&fabric.AccessRemoteRead != 0 {
		v |= ibverbs.AccessRemoteRead
	}
	return v
}

// RegisterMR registers buf, which must come from AllocMemory. With
// fabric.AccessWindow, where the device has memory windows, the remote
// access is a type 1 window (a windowMR).
func (p *pd) RegisterMR(buf []byte, access fabric.Access) (fabric.MR, error) {
	if access&fabric.AccessWindow != 0 {
		if w, err := p.registerWindow(buf, access); err == nil {
			return w, nil
		} else if !errors.Is(err, ibverbs.ErrNotSupported) && !errors.Is(err, syscall.ENOSYS) &&
			!errors.Is(err, syscall.EOPNOTSUPP) {
			return nil, err
		}
		// No windows on this device: registration per rkey.
	}
	m, err := p.p.RegMR(buf, verbsAccess(access))
	if err != nil {
		return nil, err
	}
	r := &mr{pd: p, buf: buf, access: verbsAccess(access), remote: m, rkey: m.RKey(), lkey: m.LKey()}
	return r, nil
}

// Windows says whether the device has type 1 memory windows, which
// RegisterMR with fabric.AccessWindow then uses (fabric.WindowPD): it
// allocates one and frees it.
func (p *pd) Windows() bool {
	w, err := p.p.AllocMW()
	if err != nil {
		return false
	}
	w.Close()
	return true
}

func (p *pd) Close() error { return p.p.Close() }

// mr is a memory region. Its remote registration is dropped by Invalidate
// and made again by Reregister; local access uses a local-only
// registration made on the first Invalidate, which never changes.
type mr struct {
	pd     *pd // +checklocksignore: fixed (used where mu is held)
	buf    []byte
	access ibverbs.Access // +checklocksignore: fixed (used where mu is held)

	mu sync.Mutex
	// +checklocks:mu
	remote *ibverbs.MR // nil while invalidated
	// +checklocks:mu
	local *ibverbs.MR // made by the first Invalidate
	// +checklocks:mu
	rkey uint32
	// +checklocks:mu
	lkey uint32
}

func (m *mr) Buf() []byte  { return m.buf }
func (m *mr) Addr() uint64 { return uint64(uintptr(unsafe.Pointer(&m.buf[0]))) }

func (m *mr) LKey() uint32 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lkey
}

func (m *mr) RKey() uint32 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.rkey
}

// Invalidate deregisters the remote registration: from when it returns,
// the device refuses a write with its rkey (a remote access error that
// breaks the writer's connection).
func (m *mr) Invalidate() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.local == nil {
		l, err := m.pd.p.RegMR(m.buf, ibverbs.AccessLocalWrite)
		if err != nil {
			return err
		}
		m.local, m.lkey = l, l.LKey()
	}
	if m.remote == nil {
		return nil
	}
	err := m.remote.Close()
	m.remote = nil
	return err
}

// Reregister registers the region for remote access again; the device
// gives it a new rkey.
func (m *mr) Reregister() (uint32, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.remote != nil {
		if err := m.remote.Close(); err != nil {
			return 0, err
		}
		m.remote = nil
	}
	r, err := m.pd.p.RegMR(m.buf, m.access)
	if err != nil {
		return 0, err
	}
	m.remote, m.rkey = r, r.RKey()
	if m.local == nil {
		m.lkey = r.LKey()
	}
	return m.rkey, nil
}

func (m *mr) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var errs []error
	for _, r := range []*ibverbs.MR{m.remote, m.local} {
		if r != nil {
			errs = append(errs, r.Close())
		}
	}
	m.remote, m.local = nil, nil
	return errors.Join(errs...)
}

// windowMR is a region registered for local access and window binding,
// with a type 1 window over it for the remote access (fabric.WindowMR).
type windowMR struct {
	buf    []byte
	mr     *ibverbs.MR
	mw     *ibverbs.MW
	access ibverbs.Access // the window's
	rkey   atomic.Uint32
}

func (p *pd) registerWindow(buf []byte, access fabric.Access) (*windowMR, error) {
	m, err := p.p.RegMR(buf, ibverbs.AccessLocalWrite|ibverbs.AccessMWBind)
	if err != nil {
		return nil, err
	}
	w, err := p.p.AllocMW()
	if err != nil {
		m.Close()
		return nil, err
	}
	// The window carries the remote rights only (verbsAccess adds local
	// write to remote write, as a registration needs).
	return &windowMR{buf: buf, mr: m, mw: w, access: verbsAccess(access) &^ ibverbs.AccessLocalWrite}, nil
}

func (m *windowMR) Buf() []byte  { return m.buf }
func (m *windowMR) Addr() uint64 { return uint64(uintptr(unsafe.Pointer(&m.buf[0]))) }
func (m *windowMR) LKey() uint32 { return m.mr.LKey() }
func (m *windowMR) RKey() uint32 { return m.rkey.Load() }

var errWindowByWR = errors.New("rdma fabric: a window is bound and unbound by work requests (WindowMR)")

func (m *windowMR) Invalidate() error           { return errWindowByWR }
func (m *windowMR) Reregister() (uint32, error) { return 0, errWindowByWR }

func (m *windowMR) Bind(c fabric.Conn) (uint32, error) {
	cc, ok := c.(*conn)
	if !ok {
		return 0, fmt.Errorf("rdma fabric: bind on a %T", c)
	}
	if err := cc.qp.BindMW(m.mw, m.mr, m.buf, m.access, 0, false); err != nil {
		return 0, postErr(err)
	}
	k := m.mw.RKey()
	m.rkey.Store(k)
	return k, nil
}

func (m *windowMR) Unbind(c fabric.Conn, id uint64) error {
	cc, ok := c.(*conn)
	if !ok {
		return fmt.Errorf("rdma fabric: unbind on a %T", c)
	}
	return postErr(cc.qp.BindMW(m.mw, m.mr, nil, 0, id, true))
}

func (m *windowMR) Close() error {
	return errors.Join(m.mw.Close(), m.mr.Close())
}
