package rnbd

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/blockdev"
	"github.com/rnbd/rnbd/pkg/log"
)

// Resize of an exported file (rnbd-server resize), served at once to the
// sessions that have it open; a shrink waits for the writes in flight.

// Resize sets the size of an exported file (rnbd-server resize) and
// serves it at once to the sessions that have it open; our clients learn
// it within their size poll (rnbd.DefaultSizePoll), the kernel's on their
// next remap. Shrinking a file that a session has open, by any name, is
// refused (EBUSY) unless force: the part cut off may hold what they
// wrote. A forced shrink refuses writes past the new size at once and
// waits for those in flight before it cuts (EBUSY, nothing cut, if they
// do not end in shrinkWait), so none grows the file again. One resize of
// a file runs at a time (EBUSY for another). A block device cannot be
// resized here (EOPNOTSUPP): resize it
// (lvextend, …) and clients learn its new size the same way.
func (s *Server) Resize(name string, size int64, force bool) (was int64, err error) {
	path, err := s.exportPath(name)
	if err != nil {
		return 0, err
	}
	if size <= 0 || size%512 != 0 {
		return 0, errorf(syscall.EINVAL, "size %d: want a positive multiple of 512", size)
	}
	st, err := s.statExport(name, path) // bounded in the daemon: the mount may not answer
	if err != nil {
		return 0, err
	}
	if !st.Mode().IsRegular() {
		return 0, errorf(syscall.EOPNOTSUPP, "export %s is not a regular file: resize a block device with its own tools (lvextend, …), and its clients learn the new size", name)
	}
	// The file itself from here: a path renamed over meanwhile must not
	// be cut under the sessions of the file counted below.
	f, err := os.OpenFile(path, os.O_WRONLY|syscall.O_NONBLOCK, 0) // a FIFO put there: ENXIO, not a wait
	if err != nil {
		return 0, fmt.Errorf("export %s: %w", name, err)
	}
	defer f.Close()
	if st, err = f.Stat(); err != nil {
		return 0, fmt.Errorf("export %s: %w", name, err)
	}
	if !st.Mode().IsRegular() {
		return 0, errorf(syscall.EOPNOTSUPP, "export %s is not a regular file", name)
	}
	// Who has the file open: through this export, or through any other
	// name of it (the search path).
	id, ok := blockdev.FileID(st)
	if !ok {
		return st.Size(), fmt.Errorf("export %s: no identity from its stat", name)
	}
	s.mu.Lock()
	if _, busy := s.resizes[id]; busy {
		s.mu.Unlock()
		return st.Size(), errorf(syscall.EBUSY, "export %s: another resize of its file is under way", name)
	}
	s.resizeSeq++
	r := resizing{size: size, owner: s.resizeSeq}
	s.resizes[id] = r // the file's only resize from here
	s.mu.Unlock()
	// Its size now, with no other resize of it under way: the one
	// before may have changed it since the stat above.
	if st, err = f.Stat(); err != nil {
		s.endResize(id, r, false)
		return 0, fmt.Errorf("export %s: %w", name, err)
	}
	was = st.Size()
	s.mu.Lock()
	open, closing := s.openOn(id)
	// Devices closing too: they wait for IO they admitted.
	all := append(slices.Clip(open), closing...)
	// A shrink from what the sessions are served, too: the file may
	// have shrunk behind the server's back.
	r.shrink = size < was
	for _, d := range all {
		r.shrink = r.shrink || d.backend.Size() > size
	}
	if r.shrink && len(open) > 0 && !force {
		s.mu.Unlock()
		s.endResize(id, r, false)
		return was, errorf(syscall.EBUSY, "export %s is open %d time(s), by %s: shrinking it from %d to %d bytes cuts off what they may have written; --force does it anyway", name, len(open), sessionNames(open), was, size)
	}
	// From here a device opened on the file joins capped (takeDevice),
	// and endResize sets it right.
	s.resizes[id] = r
	s.mu.Unlock()
	if r.shrink {
		// Writes the sessions have in flight, checked against the old
		// size, would land past the cut and grow the file again: cap
		// every backend at the new size and let them end first.
		deadline := time.Now().Add(shrinkWait)
		for _, d := range all {
			if err := d.backend.Cap(size, time.Until(deadline), r.owner); err != nil {
				s.endResize(id, r, false)
				return was, errorf(syscall.EBUSY, "export %s: %v; nothing was cut", name, err)
			}
		}
	}
	if err := f.Truncate(size); err != nil {
		s.endResize(id, r, false)
		return was, fmt.Errorf("export %s: %w", name, err)
	}
	n := s.endResize(id, r, true)
	s.log.WithFields(log.Fields{"export": name, "path": path, "was": was, "now": size, "devices": n}).Info("export resized")
	return was, nil
}

// resizing is a resize of a file under way (Server.resizes); owner names
// its caps.
type resizing struct {
	shrink bool
	size   int64
	owner  uint64
}

// shrinkWait bounds how long a shrink waits, in all, for the writes in
// flight on the file's backends to end.
const shrinkWait = 10 * time.Second

// sessionNames names the sessions of devs for a message: "session a",
// "sessions a, b", each once, sorted.
func sessionNames(devs []*SrvSessDev) string {
	var names []string
	for _, d := range devs {
		if !slices.Contains(names, d.sess.name) {
			names = append(names, d.sess.name)
		}
	}
	slices.Sort(names)
	if len(names) == 1 {
		return "session " + names[0]
	}
	return "sessions " + strings.Join(names, ", ")
}

// exportPath is the path of export name, ENOENT if there is none (or it
// is being withdrawn).
func (s *Server) exportPath(name string) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.exports[name]; e != nil && !e.withdrawing {
		return e.Path, nil
	}
	return "", errorf(syscall.ENOENT, "no export %s", name)
}

// openOn returns the session devices on the backend id: those open, and
// those closing (which wait for the IO they admitted). s.mu is held.
// +checklocks:s.mu
func (s *Server) openOn(id string) (open, closing []*SrvSessDev) {
	dev := s.devices[id]
	if dev == nil {
		return nil, nil
	}
	dev.mu.Lock()
	defer dev.mu.Unlock()
	for _, d := range dev.sessDevs {
		d.mu.Lock()
		if d.closing {
			closing = append(closing, d)
		} else {
			open = append(open, d)
		}
		d.mu.Unlock()
	}
	return open, closing
}

// endResize ends the resize r of file id: devices opened on it from now
// on are not capped, and every one open now (those that joined during it
// too) drops r's cap and serves the file's size — if the file was resized
// (done): else the size it served before, a shrink behind the server's
// back still an error, not made a resize by a resize refused. It returns
// how many there are.
func (s *Server) endResize(id string, r resizing, done bool) int {
	s.mu.Lock()
	delete(s.resizes, id)
	open, closing := s.openOn(id)
	dev := s.devices[id]
	s.mu.Unlock()
	for _, d := range closing {
		d.backend.Uncap(r.owner)
	}
	for _, d := range open {
		if r.shrink {
			d.backend.Uncap(r.owner) // nothing, if a later shrink took over
		}
		if !d.ref() {
			continue // closing since: its backend is, or is about to be
		}
		refresh := d.backend.Refresh
		if !done {
			refresh = d.backend.PollSize
		}
		var se *blockdev.ShrinkError
		if _, _, err := refresh(); err != nil && !errors.As(err, &se) {
			s.log.WithError(err).WithFields(log.Fields{"device": d.name, "session": d.sess.name}).Warn("refreshing the size")
		}
		d.refs.Done()
	}
	if done && dev != nil {
		// The size the file has is served: no shrink is left.
		s.noteSize(dev, nil)
	}
	return len(open)
}
