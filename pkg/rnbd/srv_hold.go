package rnbd

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/blockdev"
	"github.com/rnbd/rnbd/pkg/log"
)

// A hold of an export's writes: for a bounded time the server starts no
// write, discard or write-zeroes on the export's backing store, from any
// session, by any name (reads and flushes go on: they change nothing).
// Snapshots taken of several exports, on several servers, while all of
// them are held are one point in time, as a crash would have left them:
// a replicated volume's legs and witness (docs/replication.md,
// "Snapshots"). A hold ends when its holder releases it or, if the holder
// is gone, when its time is up; the writes it held then run in the order
// they came.

// MaxHold bounds a hold: a client whose writes wait longer takes the leg
// out (pkg/mirror's DefaultLegTimeout is 5 s), and a device whose IO
// does not complete is what a hold must never become.
const MaxHold = 10 * time.Second

// holdDrain bounds, within the hold's own time, the wait for the writes
// that had started when it began.
const holdDrain = 2 * time.Second

// errParked: the request waits for its hold to end; it is answered then.
var errParked = errors.New("rnbd: held")

// hold is one hold of a backing store (by backend ID).
type hold struct {
	name  string // the export it was asked for
	token uint64

	mu sync.Mutex
	// +checklocks:mu
	timer *time.Timer // ends it when its time is up
	// +checklocks:mu
	ended bool // released or expired: park takes no more
	// +checklocks:mu
	expired bool
	// +checklocks:mu
	parked []srvReq
}

// park keeps q until h ends; false if it has ended already.
func (h *hold) park(q *srvReq) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.ended {
		return false
	}
	h.parked = append(h.parked, *q)
	return true
}

// Hold holds the writes of export name for at most max (at most MaxHold)
// and returns its token for Release. Writes that had started when it
// began are waited for first (EBUSY, nothing held, if they do not end
// within holdDrain or max). A second hold of the same backing store while
// one is on is EBUSY; an export of a file that cannot be found, ENOENT.
func (s *Server) Hold(name string, max time.Duration) (token uint64, err error) {
	if max <= 0 || max > MaxHold {
		return 0, errorf(syscall.EINVAL, "a hold of %v: want more than 0 and at most %v", max, MaxHold)
	}
	path, err := s.exportPath(name)
	if err != nil {
		return 0, err
	}
	st, err := s.statExport(name, path) // bounded: the mount may not answer
	if err != nil {
		return 0, err
	}
	id, ok := backendID(st)
	if !ok {
		return 0, errorf(syscall.EOPNOTSUPP, "export %s is neither a regular file nor a block device", name)
	}
	start := time.Now()
	s.mu.Lock()
	if s.noHolds {
		s.mu.Unlock()
		return 0, errorf(syscall.ESHUTDOWN, "export %s: the server is stopping", name)
	}
	if old := s.holds[id]; old != nil && old.on() {
		s.mu.Unlock()
		return 0, errorf(syscall.EBUSY, "export %s: its backing store is held already (by export %s)", name, old.name)
	}
	s.holdSeq++
	h := &hold{name: name, token: s.holdSeq}
	s.holds[id] = h
	if dev := s.devices[id]; dev != nil {
		dev.held.Store(h)
	}
	s.mu.Unlock()
	// The writes that started before the hold was seen: each counts
	// itself (SrvSessDev.writing) before it looks for a hold
	// (processIO), so once none is counted every later one parks.
	// Reads are not waited for: they go on.
	drain := min(max, holdDrain)
	for n := s.writesOn(id); n > 0; n = s.writesOn(id) {
		if time.Since(start) >= drain {
			s.end(id, h, false)
			return 0, errorf(syscall.EBUSY, "export %s: %d request(s) still running after %v; nothing held", name, n, drain)
		}
		time.Sleep(time.Millisecond)
	}
	h.mu.Lock()
	h.timer = time.AfterFunc(time.Until(start.Add(max)), func() { s.end(id, h, true) })
	h.mu.Unlock()
	s.log.WithFields(log.Fields{"export": name, "token": h.token, "max": max.String()}).Info("export's writes held")
	return h.token, nil
}

// Release ends the hold token of export name, and reports whether it had
// held until now: false if its time had run out (writes ran since, a
// snapshot taken after that is not of the held point). A token the
// server does not know (another hold's, or the server restarted) is
// ENOENT.
func (s *Server) Release(name string, token uint64) (heldThroughout bool, err error) {
	s.mu.Lock()
	var id string
	var h *hold
	for k, v := range s.holds {
		if v.name == name && v.token == token {
			id, h = k, v
		}
	}
	s.mu.Unlock()
	if h == nil {
		return false, errorf(syscall.ENOENT, "export %s has no hold %d", name, token)
	}
	expired := s.end(id, h, false)
	s.mu.Lock()
	if s.holds[id] == h {
		delete(s.holds, id)
	}
	s.mu.Unlock()
	return !expired, nil
}

// on reports whether h still holds.
func (h *hold) on() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return !h.ended
}

// end ends h (once: a release after its expiry only learns of it) and
// serves the writes it held; it reports whether h had expired.
func (s *Server) end(id string, h *hold, expire bool) (expired bool) {
	h.mu.Lock()
	if h.ended {
		expired = h.expired
		h.mu.Unlock()
		return expired
	}
	h.ended, h.expired = true, expire
	if h.timer != nil {
		h.timer.Stop()
	}
	parked := h.parked
	h.parked = nil
	h.mu.Unlock()
	s.mu.Lock()
	if dev := s.devices[id]; dev != nil {
		dev.held.CompareAndSwap(h, nil)
	}
	if expire {
		// Kept until released: Release tells its holder it expired.
	} else if s.holds[id] == h {
		delete(s.holds, id)
	}
	s.mu.Unlock()
	if expire {
		s.log.WithFields(log.Fields{"export": h.name, "token": h.token, "writes": len(parked)}).
			Warn("export's hold expired before its release: writes go on")
	}
	for i := range parked {
		if s.closed.Load() {
			parked[i].op.Respond(syscall.ESHUTDOWN)
			continue
		}
		s.serveApart(parked[i])
	}
	return expire
}

// writesOn counts the writes running on the backing store id now.
func (s *Server) writesOn(id string) int64 {
	s.mu.Lock()
	open, closing := s.openOn(id)
	s.mu.Unlock()
	var n int64
	for _, d := range append(open, closing...) {
		n += d.writing.Load()
	}
	return n
}

// EndHolds ends every hold and refuses new ones (ESHUTDOWN): the writes
// held run. A stopping daemon calls it before it closes the RTRS server,
// whose close waits for every request to be answered. Close calls it
// too; what is held then is refused.
func (s *Server) EndHolds() {
	s.mu.Lock()
	s.noHolds = true
	holds := make(map[string]*hold, len(s.holds))
	for id, h := range s.holds {
		holds[id] = h
	}
	s.mu.Unlock()
	for id, h := range holds {
		s.end(id, h, false)
	}
}

// backendID is the ID (blockdev.Backend.ID) of the backend of the file or
// block device fi is the stat(2) of.
func backendID(fi os.FileInfo) (string, bool) {
	if id, ok := blockdev.FileID(fi); ok {
		return id, true
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || fi.Mode()&os.ModeDevice == 0 || fi.Mode()&os.ModeCharDevice != 0 {
		return "", false
	}
	return fmt.Sprintf("blk:%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev)), true
}
