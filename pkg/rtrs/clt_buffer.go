package rtrs

import (
	"errors"
	"fmt"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Memory regions of a client session: Buffers a request's data lives in,
// and their registration with each path's current connection attempt.

// Buffer is registered memory a request's data must live in: reads land
// in it, writes are sent from it. Bytes stays valid until Free. Its
// methods are safe for concurrent use; its bytes are the user's to share.
type Buffer struct {
	sess  *CltSession
	idx   int
	mem   fabric.Memory
	b     []byte
	local bool // no remote access: request headers
}

// Bytes returns the buffer's memory.
func (b *Buffer) Bytes() []byte { return b.b }

// AllocBuffer allocates n bytes of memory registered with every path.
func (s *CltSession) AllocBuffer(n int) (*Buffer, error) {
	if s.closed.Load() {
		return nil, ErrClosed
	}
	mem, err := s.cfg.Fabric.AllocMemory(n)
	if err != nil {
		return nil, err
	}
	b, err := s.addBuffer(mem, mem.Bytes())
	if err != nil {
		mem.Free()
	}
	return b, err
}

// ShareBuffer registers the memory of b, a buffer of another session,
// with every path of s: one memory the requests of several sessions
// use, as a mirror's writes go to each of its legs from one buffer. The
// Buffer returned is s's; its Free deregisters it from s and leaves the
// memory, which b owns and must keep until then. The two sessions must
// be of one kind of fabric (memory allocated for RDMA is not TCP's).
func (s *CltSession) ShareBuffer(b *Buffer) (*Buffer, error) {
	switch {
	case s.closed.Load():
		return nil, ErrClosed
	case b.local:
		return nil, errors.New("rtrs: a session's header buffer is its own")
	case b.sess.cfg.Fabric.Name() != s.cfg.Fabric.Name():
		return nil, fmt.Errorf("rtrs: a buffer of a %s session shared with a %s one", b.sess.cfg.Fabric.Name(), s.cfg.Fabric.Name())
	}
	return s.addBuffer(nil, b.b)
}

// addBuffer registers p with every path under the lowest free id; mem
// is the memory the buffer owns (nil: another buffer's, shared).
func (s *CltSession) addBuffer(mem fabric.Memory, p []byte) (*Buffer, error) {
	s.regMu.Lock()
	defer s.regMu.Unlock()
	// The lowest id a freed buffer left, else a new one: the tables of
	// every path are as long as the most buffers alive at once, not as
	// the buffers ever allocated.
	idx := len(s.regions)
	for i := 1; i < len(s.regions); i++ {
		if s.regions[i] == nil {
			idx = i
			break
		}
	}
	b := &Buffer{sess: s, idx: idx, mem: mem, b: p}
	for _, p := range s.Paths() {
		if err := p.registerLocked(b); err != nil {
			for _, q := range s.Paths() {
				q.deregisterLocked(b)
			}
			return nil, err
		}
	}
	if idx == len(s.regions) {
		s.regions = append(s.regions, b)
	} else {
		s.regions[idx] = b
	}
	return b, nil
}

// Free deregisters the buffer and releases its memory. No request may be
// using it.
func (b *Buffer) Free() error {
	s := b.sess
	s.regMu.Lock()
	defer s.regMu.Unlock()
	if b.idx == 0 || b.idx >= len(s.regions) || s.regions[b.idx] != b {
		return errors.New("rtrs: buffer already freed")
	}
	for _, p := range s.Paths() {
		p.deregisterLocked(b)
	}
	s.regions[b.idx] = nil
	for len(s.regions) > 1 && s.regions[len(s.regions)-1] == nil {
		s.regions = s.regions[:len(s.regions)-1]
	}
	if b.mem == nil {
		return nil // shared: the memory is its owner's
	}
	return b.mem.Free()
}

// registerLocked registers session region b with the path's current
// attempt, if any. s.regMu must be held.
func (p *CltPath) registerLocked(b *Buffer) error {
	res := p.curRes()
	if res == nil {
		return nil
	}
	return p.registerResLocked(res, b)
}

func (p *CltPath) registerResLocked(res *pathRes, b *Buffer) error {
	old := *res.mrs.Load()
	if b.idx < len(old) && old[b.idx] != nil {
		return nil
	}
	access := fabric.AccessLocalWrite | fabric.AccessRemoteWrite
	if b.local {
		access = fabric.AccessLocalWrite
	}
	mr, err := res.pd.RegisterMR(b.b, access)
	if err != nil {
		return err
	}
	mrs := make([]fabric.MR, max(len(old), b.idx+1))
	copy(mrs, old)
	mrs[b.idx] = mr
	res.mrs.Store(&mrs)
	return nil
}

func (p *CltPath) deregisterLocked(b *Buffer) {
	res := p.curRes()
	if res == nil {
		return
	}
	old := *res.mrs.Load()
	if b.idx >= len(old) || old[b.idx] == nil {
		return
	}
	mrs := append([]fabric.MR(nil), old...)
	mr := mrs[b.idx]
	mrs[b.idx] = nil
	res.mrs.Store(&mrs)
	mr.Close()
}
