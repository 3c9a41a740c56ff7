package rtrs

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/tagpool"
)

// Permits of a client session (struct rtrs_permit): one per server chunk,
// with the header memory that goes with it, sized from the first path's
// conn_rsp and handed out lowest id first.

// ConType selects the connection of a permit: IO connections, or the
// service connection (cid 0) for admin messages.
type ConType uint8

const (
	IOCon ConType = iota
	AdminCon
)

// Permit is one server chunk, held by one request at a time, and the
// header memory that goes with it (struct rtrs_permit). It belongs to the
// goroutine that took it until PutPermit; ID may be read by anyone.
type Permit struct {
	sess    *CltSession
	id      uint16
	memOff  uint32
	conType ConType
	held    atomic.Bool
	hdr     []byte // registered header memory: usr message, then RTRS message
	req     request
}

// ID is the permit's chunk number (buf_id, msg_id on the wire).
func (p *Permit) ID() int { return int(p.id) }

// request is the state of the one request a permit carries.
type request struct {
	dir    Dir
	conf   Confirmer
	usrLen int
	buf    *Buffer
	off, n int
	start  time.Time
}

// initResources sizes the session from the first connection response:
// permits (one per server chunk) and header memory. Once it succeeded it
// does nothing more; until then each path's response may try.
func (s *CltSession) initResources(qd int, maxHdr, maxIO uint32) error {
	s.initMu.Lock()
	defer s.initMu.Unlock()
	if s.queueDepth.Load() != 0 {
		return nil
	}
	if qd < 1 || qd > MaxSessQueueDepth {
		return fmt.Errorf("rtrs: server queue depth %d: %w", qd, syscall.ECONNRESET)
	}
	if maxHdr < RDMAReadSize+SGDescSize || maxHdr > 1<<20 {
		return fmt.Errorf("rtrs: server max_hdr_size %d: %w", maxHdr, syscall.ECONNRESET)
	}
	// The header room per permit is what the server allows, capped at a
	// page as the kernel's server announces: that is plenty for any user
	// message and keeps qd × slot small whatever it says.
	slot := int(min(maxHdr, MaxHdrSize))
	mem, err := s.cfg.Fabric.AllocMemory(qd * slot)
	if err != nil {
		return err
	}
	s.hdrSlot = slot
	s.maxIOSize.Store(maxIO)
	s.hdrMem = mem
	s.regMu.Lock()
	// The server never writes into the header memory: it is registered
	// for local access only.
	s.regions = append(s.regions, &Buffer{sess: s, idx: 0, mem: mem, b: mem.Bytes(), local: true})
	s.regMu.Unlock()
	memBits := MemBits(uint32(qd))
	s.permits = make([]Permit, qd)
	for i := range s.permits {
		p := &s.permits[i]
		p.sess = s
		p.id = uint16(i)
		p.memOff = uint32(i) << memBits
		p.hdr = s.hdrMem.Bytes()[i*s.hdrSlot : (i+1)*s.hdrSlot]
	}
	s.permitTags.Init(qd)
	s.queueDepth.Store(int32(qd))
	return nil
}

// GetPermit takes a permit, waiting for one if all are in use.
func (s *CltSession) GetPermit(ctx context.Context, t ConType) (*Permit, error) {
	if s.closed.Load() {
		return nil, ErrClosed
	}
	id, err := s.permitTags.Get(ctx, s.closedCh)
	if errors.Is(err, tagpool.ErrStopped) {
		return nil, ErrClosed
	}
	if err != nil {
		return nil, err
	}
	if !s.permitTaken() {
		s.permitTags.Put(id)
		s.permitPut()
		return nil, ErrClosed
	}
	p := &s.permits[id]
	p.held.Store(true)
	p.conType = t
	return p, nil
}

// permitTaken counts a permit out; false if the session is closed, when
// the permit must go back (permitPut) unused: the header memory it names
// may be freed.
func (s *CltSession) permitTaken() bool {
	s.permitsOut.Add(1)
	return !s.closed.Load()
}

// permitPut counts a permit back in; the last one back after Close frees
// the header memory.
func (s *CltSession) permitPut() {
	if s.permitsOut.Add(-1) == 0 && s.closed.Load() {
		s.freeHdrMem()
	}
}

// freeHdrMem frees the permits' header memory once the session is closed
// and no permit is out (the memory is mmapped on RDMA: the garbage
// collector never takes it).
func (s *CltSession) freeHdrMem() {
	if s.hdrMem == nil || !s.hdrFreed.CompareAndSwap(false, true) {
		return
	}
	s.regMu.Lock()
	if len(s.regions) > 0 && s.regions[0] != nil {
		s.regions[0] = nil
	}
	s.regMu.Unlock()
	s.hdrMem.Free()
}

// TryGetPermit takes a permit if one is free.
func (s *CltSession) TryGetPermit(t ConType) *Permit {
	id := s.permitTags.TryGet()
	if id < 0 {
		return nil
	}
	if !s.permitTaken() {
		s.permitTags.Put(id)
		s.permitPut()
		return nil
	}
	p := &s.permits[id]
	p.held.Store(true)
	p.conType = t
	return p
}

// PutPermit returns a permit. Its request, if any, must have completed.
func (s *CltSession) PutPermit(p *Permit) {
	if p.sess != s || !p.held.Swap(false) {
		panic("rtrs: PutPermit of a permit not held")
	}
	p.req.conf, p.req.buf = nil, nil
	s.permitTags.Put(int(p.id))
	s.permitPut()
}
