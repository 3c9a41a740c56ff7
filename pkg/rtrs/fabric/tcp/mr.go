package tcp

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Remote keys are laid out as on an HCA: the high 24 bits index the region
// table, the low 8 bits are a key that changes on every re-registration, so
// a stale rkey no longer matches. Index 0 is never used: rkey 0 is invalid.
const (
	mrPageBits = 12
	mrPageSize = 1 << mrPageBits
	mrMaxIndex = 1<<24 - 1
	stValid    = 1 << 8 // in mrEntry.state, above the key byte: remote access allowed
	stAlive    = 1 << 9 // registered (not yet closed)
)

var (
	errBadRKey   = errors.New("tcp fabric: remote access with an unknown or stale rkey")
	errOutOfMR   = errors.New("tcp fabric: remote access out of the region's bounds")
	errWrongPD   = errors.New("tcp fabric: remote access to a region of another protection domain")
	errNoAccess  = errors.New("tcp fabric: region does not allow remote write")
	errChangedMR = errors.New("tcp fabric: region invalidated during a remote write")
)

// mrTable maps rkeys to regions for one device. Lookups are lock-free.
type mrTable struct {
	mu    sync.Mutex // guards registration: next, free and page allocation
	pages [mrMaxIndex>>mrPageBits + 1]atomic.Pointer[[mrPageSize]atomic.Pointer[mrEntry]]
	// +checklocks:mu
	next uint32
	// +checklocks:mu
	free []uint32
}

type mrEntry struct {
	table  *mrTable
	pd     *pd
	buf    []byte
	base   uint64
	access fabric.Access
	idx    uint32
	lkey   uint32
	// state is stAlive|stValid|key while remote access is allowed,
	// stAlive|key when invalidated, and 0 once deregistered.
	state atomic.Uint32
}

func (t *mrTable) slot(idx uint32) *atomic.Pointer[mrEntry] {
	p := t.pages[idx>>mrPageBits].Load()
	if p == nil {
		return nil
	}
	return &p[idx&(mrPageSize-1)]
}

func (t *mrTable) add(pd *pd, buf []byte, access fabric.Access) (*mrEntry, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var idx uint32
	if n := len(t.free); n > 0 {
		idx, t.free = t.free[n-1], t.free[:n-1]
	} else {
		if t.next == mrMaxIndex {
			return nil, fmt.Errorf("tcp fabric: region table full: %w", fabric.ErrQueueFull)
		}
		t.next++
		idx = t.next
		if t.pages[idx>>mrPageBits].Load() == nil {
			t.pages[idx>>mrPageBits].Store(new([mrPageSize]atomic.Pointer[mrEntry]))
		}
	}
	key := uint32(rand.Uint32N(256))
	e := &mrEntry{
		table:  t,
		pd:     pd,
		buf:    buf,
		base:   uint64(idx) << 32, // opaque, never the process's addresses
		access: access,
		idx:    idx,
		lkey:   idx<<8 | key,
	}
	e.state.Store(stAlive | stValid | key)
	t.slot(idx).Store(e)
	return e, nil
}

func (t *mrTable) remove(e *mrEntry) {
	e.state.Store(0)
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := t.slot(e.idx); s != nil && s.Load() == e {
		s.Store(nil)
		t.free = append(t.free, e.idx)
	}
}

// lookup validates a remote access of n bytes at addr with rkey arriving in
// pd, and returns the target memory with the state it was validated under.
func (t *mrTable) lookup(rkey uint32, pd *pd, addr uint64, n int) ([]byte, *mrEntry, uint32, error) {
	s := t.slot(rkey >> 8)
	if s == nil {
		return nil, nil, 0, errBadRKey
	}
	e := s.Load()
	if e == nil {
		return nil, nil, 0, errBadRKey
	}
	st := e.state.Load()
	if st&stValid == 0 || st&0xff != rkey&0xff {
		return nil, nil, 0, errBadRKey
	}
	if e.pd != pd {
		return nil, nil, 0, errWrongPD
	}
	if e.access&fabric.AccessRemoteWrite == 0 {
		return nil, nil, 0, errNoAccess
	}
	if addr < e.base || addr-e.base > uint64(len(e.buf)) || uint64(n) > uint64(len(e.buf))-(addr-e.base) {
		return nil, nil, 0, errOutOfMR
	}
	off := addr - e.base
	return e.buf[off : off+uint64(n)], e, st, nil
}

// invalidate handles SEND_WITH_INV: the rkey must be valid in pd.
func (t *mrTable) invalidate(rkey uint32, pd *pd) error {
	s := t.slot(rkey >> 8)
	if s == nil {
		return errBadRKey
	}
	e := s.Load()
	if e == nil || e.pd != pd {
		return errBadRKey
	}
	for {
		st := e.state.Load()
		if st&stValid == 0 || st&0xff != rkey&0xff {
			return errBadRKey
		}
		if e.state.CompareAndSwap(st, st&^stValid) {
			return nil
		}
	}
}

// mr is the fabric.MR of the TCP fabric.
type mr struct {
	e      *mrEntry
	closed atomic.Bool
}

func (m *mr) Buf() []byte  { return m.e.buf }
func (m *mr) Addr() uint64 { return m.e.base }
func (m *mr) LKey() uint32 { return m.e.lkey }
func (m *mr) RKey() uint32 { return m.e.idx<<8 | m.e.state.Load()&0xff }

func (m *mr) Invalidate() error {
	for {
		st := m.e.state.Load()
		if st&stAlive == 0 {
			return fabric.ErrClosed
		}
		if m.e.state.CompareAndSwap(st, st&^stValid) {
			return nil
		}
	}
}

func (m *mr) Reregister() (uint32, error) {
	for {
		st := m.e.state.Load()
		if st&stAlive == 0 {
			return 0, fabric.ErrClosed
		}
		key := (st + 1) & 0xff
		if m.e.state.CompareAndSwap(st, stAlive|stValid|key) {
			return m.e.idx<<8 | key, nil
		}
	}
}

func (m *mr) Close() error {
	if m.closed.Swap(true) {
		return nil
	}
	m.e.pd.regions.Add(-1)
	m.e.table.remove(m.e)
	return nil
}

// pd is the fabric.PD of the TCP fabric.
type pd struct {
	dev     *device
	regions atomic.Int64
	closed  atomic.Bool
}

func (p *pd) RegisterMR(buf []byte, access fabric.Access) (fabric.MR, error) {
	if p.closed.Load() {
		return nil, fabric.ErrClosed
	}
	if len(buf) == 0 {
		return nil, errors.New("tcp fabric: cannot register an empty region")
	}
	e, err := p.dev.mrs.add(p, buf, access)
	if err != nil {
		return nil, err
	}
	p.regions.Add(1)
	if access&fabric.AccessWindow != 0 && p.dev.fab.opts.Windows {
		// Unbound until the first Bind, as a fresh window.
		e.state.Store(stAlive | e.state.Load()&0xff)
		return &windowMR{mr{e: e}}, nil
	}
	return &mr{e: e}, nil
}

// windowMR emulates a memory window over a region (Options.Windows): a
// bind re-keys the region at once (nothing posted after it can run
// before it); an unbind revokes it at once and completes, signaled, in
// the order of the send queue.
type windowMR struct{ mr }

var errWindowByWR = errors.New("tcp fabric: a window is bound and unbound by work requests (WindowMR)")

func (m *windowMR) Invalidate() error           { return errWindowByWR }
func (m *windowMR) Reregister() (uint32, error) { return 0, errWindowByWR }

func (m *windowMR) Bind(c fabric.Conn) (uint32, error) {
	if _, ok := c.(*conn); !ok {
		return 0, fmt.Errorf("tcp fabric: bind on a %T", c)
	}
	return m.mr.Reregister()
}

func (m *windowMR) Unbind(c fabric.Conn, id uint64) error {
	cc, ok := c.(*conn)
	if !ok {
		return fmt.Errorf("tcp fabric: unbind on a %T", c)
	}
	if err := m.mr.Invalidate(); err != nil {
		return err
	}
	return cc.post(&fabric.SendWR{ID: id, Op: opUnbind, Signaled: true}, 1)
}

// Windows says whether regions registered with fabric.AccessWindow get
// (emulated) windows: with Options.Windows (fabric.WindowPD).
func (p *pd) Windows() bool { return p.dev.fab.opts.Windows }

func (p *pd) Close() error {
	if n := p.regions.Load(); n != 0 {
		return fmt.Errorf("tcp fabric: protection domain still has %d regions", n)
	}
	p.closed.Store(true)
	return nil
}
