package rnbd

import (
	"sort"
	"syscall"
)

// What the control socket shows of the server — its sessions and the
// devices they have open, with their counters — and the force close of a
// device, as the kernel's rnbd-srv-sysfs.c.

// collect returns the open devices of every session that match; it takes
// each session's lock without holding the server's.
func (s *Server) collect(match func(*SrvSessDev) bool) []*SrvSessDev {
	var out []*SrvSessDev
	for _, x := range s.Sessions() {
		x.mu.Lock()
		for _, d := range x.devs {
			if d != nil && match(d) {
				out = append(out, d)
			}
		}
		x.mu.Unlock()
	}
	return out
}

// forceClose closes a session's device and keeps its id reserved
// (rnbd_srv_sess_dev_force_close).
func (d *SrvSessDev) forceClose() {
	x := d.sess
	x.mu.Lock()
	if x.devs != nil && x.devs[d.id] == d {
		x.devs[d.id] = nil
	}
	x.mu.Unlock()
	d.close()
}

// ForceClose closes device name for the named session, or for every
// session that has it open when session is empty. It returns how many
// were closed.
func (s *Server) ForceClose(name, session string) (int, error) {
	victims := s.collect(func(d *SrvSessDev) bool {
		return (session == "" || d.sess.name == session) && (d.name == name || d.export == name)
	})
	if len(victims) == 0 {
		return 0, errorf(syscall.ENOENT, "%s is not open by %s", name, orAll(session))
	}
	for _, d := range victims {
		d.forceClose()
	}
	return len(victims), nil
}

func orAll(session string) string {
	if session == "" {
		return "any session"
	}
	return "session " + session
}

// SessDevInfo describes a device a session has open.
type SessDevInfo struct {
	Session    string
	Name       string // as the client opened it
	Export     string // the explicit export, if any
	Path       string
	DeviceID   uint32
	AccessMode AccessMode
	ReadOnly   bool
	// ReadSectors and WrittenSectors count the device's IO, in 512-byte
	// sectors, since it was opened; Reads and Writes the requests that
	// carried data (a write without data is a flush).
	ReadSectors, WrittenSectors uint64
	Reads, Writes               uint64
	// Inflight is the requests running on the backend now.
	Inflight int64
	// Flushes, FUAWrites, Discards and WriteZeroes count those requests
	// since it was opened (a write with preflush counts as a flush too).
	Flushes, FUAWrites, Discards, WriteZeroes uint64
	// WriteCache is what OPEN_RSP announced: the backend has a volatile
	// write cache that clients flush.
	WriteCache bool
	// BackingProblem is what the health check or a size poll last found
	// wrong with the backing store (deleted, replaced, shrunk, no
	// answer); empty if nothing.
	BackingProblem string
}

// OpenDevices lists every device every session has open, by session and
// name.
func (s *Server) OpenDevices() []SessDevInfo {
	var out []SessDevInfo
	for _, d := range s.collect(func(*SrvSessDev) bool { return true }) {
		out = append(out, SessDevInfo{
			Session: d.sess.name, Name: d.name, Export: d.export, Path: d.backend.Path(),
			DeviceID: d.id, AccessMode: d.access, ReadOnly: d.readonly,
			ReadSectors: d.rdSect.Load(), WrittenSectors: d.wrSect.Load(), Reads: d.reads.Load(), Writes: d.writes.Load(),
			Inflight: d.inflight.Load() + d.writing.Load(),
			Flushes:  d.flushes.Load(), FUAWrites: d.fuas.Load(), Discards: d.discards.Load(), WriteZeroes: d.wzeros.Load(),
			WriteCache: d.backend.Caps().WriteCache, BackingProblem: d.backingProblem(),
		})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Session != out[j].Session {
			return out[i].Session < out[j].Session
		}
		return out[i].Name < out[j].Name
	})
	return out
}

// devName is the name of the device in metrics: its export's, or the name
// it was opened by under the search path.
func (d *SrvSessDev) devName() string {
	if d.export != "" {
		return d.export
	}
	return d.name
}

// Sessions lists the RNBD sessions.
func (s *Server) Sessions() []*SrvSession {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*SrvSession
	for _, x := range s.sessions {
		out = append(out, x)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}
